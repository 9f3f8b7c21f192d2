"""A service's request/reply exchange over two topics (:class:`~services.service.Channel`): the generator's model turns
to the environment replicas and their answers, the gateway's calls to the generators and their answers, and the
gateway's episodes log (a channel whose requests and replies are one topic).

It is given what it needs of its runner and no more: ``produce`` (requests go out as the service's outputs do: signed,
partitioned by step, by reference when large), ``accept`` (replies are checked as input is: decoded, verified, of this
run) and ``dead_letter`` (what the service sets aside).
"""

from __future__ import annotations

from collections.abc import Callable

from common.schema import TOPIC_MESSAGE, Message, encode, message_key
from services.service import Channel
from services.transport import Bus, Record

__all__ = ["BusChannel"]


class BusChannel(Channel):
    """Requests produced to ``requests``; replies read from ``replies`` by a reader that joins no group (every
    partition, from the start: the service picks its own)."""

    def __init__(
        self,
        bus: Bus,
        replica_id: str,
        requests: str,
        replies: str,
        produce: Callable[[list[Message], str], None],
        accept: Callable[[Record, type], Message | None],
        dead_letter: Callable[[str, bytes, bytes | None, str], None],
    ):
        self.requests, self.replies = requests, replies
        self.produce, self.accept, self.set_aside = produce, accept, dead_letter
        self.reader = bus.consumer(replies, group=None, client_id=f"{replica_id}.{replies}")
        self.read: list[Record] = []  # read by caught_up(), not yet received

    def send(self, message: Message) -> None:
        self.produce([message], self.requests)

    def receive(self) -> list[Message]:
        received = []
        records, self.read = self.read, []
        while records or (records := self.reader.poll(0.0, max_records=64)):
            for record in records:
                message = self.accept(record, TOPIC_MESSAGE[self.replies])
                if message is not None:
                    received.append(message)
            records = []
        return received

    def caught_up(self) -> bool:
        records, at_end = self.reader.read_to_end(64)
        self.read.extend(records)
        return at_end

    def dead_letter(self, message: Message, error: str) -> None:
        self.set_aside(self.requests, encode(message), message_key(message), error)

    def close(self) -> None:
        self.reader.close()
