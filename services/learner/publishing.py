"""What the learner publishes of each version: the snapshots of actor and critic in the weight store (the actor also
broadcast to the generators, when ``weights.broadcast`` is configured), pruned to ``pipeline.keep_snapshots``, and
their announcements on the weights topic, each with the learner's progress in its lineage (the groups used up, the
prompt batches settled, the replacements asked for): what generators admit prompt batches by.
"""

from __future__ import annotations

import dataclasses
import time

from common.broadcast import WeightSender
from common.config import RunConfig
from common.schema import ADAPTER, ADAPTER_BASE, LEARNER_GROUPS_DONE, RUN_ID, WeightAnnouncement, new_header
from common.weights import Snapshot, WeightStore
from services.learner.trainer import PPOTrainer

__all__ = ["Publisher"]


class Publisher:
    def __init__(self, config: RunConfig, replica_id: str, world_size: int):
        self.config, self.replica_id, self.world_size = config, replica_id, world_size
        self.store = WeightStore(config.weight_store, config.weights.digest, config.weights.full_every)
        self.sender: WeightSender | None = None  # the broadcast path, opened by open_broadcast
        self.published: list[WeightAnnouncement] = []  # the announcements of the current version

    def open_broadcast(self) -> None:
        """The broadcast path to the generators, when configured (once: a learner that starts again keeps it)."""
        broadcast = self.config.weights.broadcast
        if broadcast.address is not None and self.sender is None:
            self.sender = WeightSender(
                broadcast.address, broadcast.receivers, broadcast.timeout_s, self.config.weights.digest
            )

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def publish(self, trainer: PPOTrainer, progress: dict) -> list[WeightAnnouncement]:
        """Snapshot every model of ``trainer`` at its version and announce each, ``progress`` (the learner's epoch and
        counts) in their lineage."""
        version = trainer.version
        announcements = []
        for name, _, _ in trainer.models():
            snapshot, broadcast_digest = self._snapshot(trainer, name, version)
            self.store.prune(name, self.config.pipeline.keep_snapshots, version)
            lineage = {
                RUN_ID: self.config.run.run_id,
                "kl_coef": trainer.kl_controller.value,
                "learner": self.replica_id,
                **progress,
            }
            if name == "actor" and self.config.model.lora is not None:  # the snapshot is adapters for this base
                lineage |= {ADAPTER: "lora", ADAPTER_BASE: self.config.model.actor}
            announcements.append(
                WeightAnnouncement(
                    **new_header(
                        f"{self.config.run.run_id}-weights-{name}-v{version:08d}", self.replica_id, version, lineage
                    ),
                    model=name,
                    uri=snapshot.uri,
                    digest=snapshot.digest,
                    chain=list(snapshot.chain),
                    num_bytes=snapshot.num_bytes,
                    broadcast_digest=broadcast_digest,
                )
            )
        self.published = announcements
        return announcements

    def actor_again(self, version: int, progress: dict) -> WeightAnnouncement | None:
        """The actor's announcement of ``version`` again, with ``progress`` now (same snapshot: groups used up
        without an update, which generators admit by); None when ``version``'s was not published here."""
        actor = next((a for a in self.published if a.model == "actor"), None)
        if actor is None or actor.policy_version != version:
            return None
        batch_id = f"{actor.batch_id}-g{progress[LEARNER_GROUPS_DONE]}"
        lineage = {**actor.lineage, **progress}
        return dataclasses.replace(actor, batch_id=batch_id, lineage=lineage, created_at=time.time())

    def _snapshot(self, trainer: PPOTrainer, name: str, version: int) -> tuple[Snapshot, str]:
        """Snapshot ``name`` into the store, and the actor also to the generators when the broadcast is configured.

        Returns:
            The snapshot, and the digest of the broadcast every receiver holds (``""`` when none was made).
        """
        dtype = self.config.weights.dtype
        broadcasts = name == "actor" and self.sender is not None
        if self.world_size > 1:  # a part from each rank; one call that all ranks run at a time
            sent = self.sender.send(version, trainer.full_state(name, dtype)) if broadcasts else ""
            snapshot = self.store.save_sharded(
                name, version, lambda folder: trainer.write_snapshot_parts(name, dtype, folder, self.store.digest)
            )
            return snapshot, sent
        state = trainer.full_state(name, dtype)
        if not broadcasts:
            return self.store.save_state(name, version, state), ""
        return self.sender.send_and_save(self.store, name, version, state)
