"""The bus over Kafka (kafka-python): any Kafka-protocol broker, Apache Kafka in production.

Settings are chosen to be valid on Apache Kafka and on the small test broker alike:

- producer: ``acks=all`` with idempotence, so a retried send is not written twice;
- consumers: manual commits only (the runner commits after the batch's output is flushed), ``earliest``
  reset for groups, so a new group starts at the beginning of the log; partitions dealt round-robin among a
  group's members, so that consecutive steps (on consecutive partitions, ``common.schema.message_partition``)
  go to different replicas and can be worked on at once (kafka-python's default deals each member a block);
- a group's member named by its replica (``member``) is a static member (KIP-345): it never leaves by closing, so
  closing removes it, and ``remove_member`` takes a dead one's partitions from it at once (``streamppo up`` calls
  it when it sees a replica exit);
- clients give up on a broker that does not answer within ``request_timeout_ms`` and look the partitions' leaders
  up every ``metadata_max_age_ms`` (kafka-python 3 does not after a timeout);
- broadcast readers (``group=None``) join no group: they are assigned every partition of the topic and read it
  from the beginning at each start, so a restart leaves no orphan group on the broker, and they never commit;
- lag is the fetch high-watermark minus the position (``ListOffsets`` is not trusted).

The package: :mod:`.bus` (settings, admin, the log's identity), :mod:`.clients` (the producer and consumer),
:mod:`.groups` (a wedged group left for a new generation).
"""

from services.transport.kafka.bus import (
    ANSWER_TIMEOUT_S,
    BrokerUnavailable,
    KafkaBus,
    KafkaSettings,
    min_insync_replicas,
)

__all__ = ["ANSWER_TIMEOUT_S", "BrokerUnavailable", "KafkaBus", "KafkaSettings", "min_insync_replicas"]
