"""learner: experience → weights. PPO updates of actor and critic, then new snapshots announced for both.

Batches are applied in step order (update ``v+1`` trains on step ``v``), so a batch sampled within the staleness
bound is trained within it. Experience older than ``max_staleness`` versions, or sampled by weights this learner
never published, is dropped and counted, never trained on, and never counts toward ``run.steps``; experience of a
step no real batch can have goes to the dead-letter topic. Each update appends one line of statistics to
``<run dir>/metrics.jsonl``.

Every ``learner.checkpoint_every`` updates (and on shutdown) the learner checkpoints itself: models, optimizers,
KL controller, version, the ids of the batches it handled last and the input offsets they cover; its input is
committed only then. A learner that restarts, after SIGTERM or ``kill -9``, resumes from the checkpoint: the
batches it had applied since were not committed, come back, and are applied again to the restored state; a batch
applied and checkpointed but not yet committed comes back too and is recognised by its id. Metrics lines are written
at checkpoints, so ``metrics.jsonl`` never shows an update that a restart would apply again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from common.broadcast import WeightSender
from common.checkpoint import load_latest_checkpoint, next_epoch, save_checkpoint
from common.config import RunConfig
from common.models import (
    add_lora,
    enable_activation_checkpointing,
    load_actor,
    load_critic,
    load_tokenizer,
    resolve_model,
)
from common.schema import ADAPTER, ADAPTER_BASE, LEARNER_EPOCH, RUN_ID, ExperienceBatch, WeightAnnouncement, new_header
from common.weights import Snapshot, WeightStore
from services.learner.evaluation import answer_eval_prompts, write_generations
from services.learner.export import export_final_models
from services.learner.metrics_log import MetricsLog
from services.learner.parallel import init_ranks, shard_model
from services.learner.ranks import LearnerRanks
from services.learner.trainer import Experience, PPOTrainer
from services.service import Dropped, InputError, Progress, Service, check_token_ids

log = logging.getLogger(__name__)


class LearnerService(Service):
    role = "learner"

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        m, parallel = config.model, config.learner.parallel
        self.ranks = init_ranks(parallel.strategy, parallel.processes, m.device)
        actor_path = resolve_model(m.actor, m.cache_dir)
        self.tokenizer = load_tokenizer(actor_path, m.trust_remote_code)
        actor = self._trainable(load_actor, actor_path, m.dtype_of("actor"))
        if m.lora is not None:  # one process (config): the adapters are what trains and what is published
            actor = add_lora(actor, m.lora)
        critic = None  # a critic-free estimator: no critic, optimizer, checkpoint or snapshot
        if config.algorithm.uses_critic:
            critic_path = resolve_model(m.critic or m.actor, m.cache_dir)
            critic = self._trainable(load_critic, critic_path, m.dtype_of("critic"))
        self.trainer = PPOTrainer(
            actor,
            critic,
            config.learner,
            config.algorithm,
            config.generation.temperature,
            self.tokenizer.pad_token_id,
            seed=config.run.seed,
            ranks=self.ranks,
            max_response_length=config.generation.max_new_tokens,
        )
        self.store = WeightStore(config.weight_store, config.weights.digest, config.weights.full_every)
        self.run_dir = Path(config.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_log = MetricsLog(self.run_dir / "metrics.jsonl")
        self.before_path = self.run_dir / "generations_before.jsonl"
        self.updates = 0
        self.dropped_stale = 0
        self.progress: Progress | None = None  # what the last checkpoint covers (input offsets, batch ids handled)
        self.since_checkpoint = 0  # batches consumed since the last checkpoint
        self.unsaved_records: list[dict] = []  # metrics lines of those updates, written with the next checkpoint
        self.started = time.time()
        self.epoch = 0  # taken in start(): 0 only for a learner that announces without having started (tests)
        self.sender: WeightSender | None = None  # the broadcast path, opened in start() when configured
        if self.ranks.leads:  # the other ranks load the checkpoint when rank 0 leads them to
            self._resume()

    def _trainable(self, load, path: Path, dtype: str):
        """A model to train: sharded over the ranks with fp32 master weights and ``dtype`` compute, or (single
        process) in ``dtype`` itself."""
        m = self.config.model
        sharded = self.ranks.sharded
        model = load(path, "float32" if sharded else dtype, m.trust_remote_code, device=str(self.ranks.device))
        if self.config.learner.activation_checkpointing:
            enable_activation_checkpointing(model)
        return shard_model(model, self.ranks, getattr(torch, dtype)) if sharded else model

    @classmethod
    def process_group(cls, config: RunConfig) -> LearnerRanks | None:
        return LearnerRanks(config) if config.learner.parallel.processes > 1 else None

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.trainer.release()

    def _resume(self) -> None:
        checkpoint = load_latest_checkpoint(self.config.checkpoint_dir)
        if checkpoint is None:
            return
        folder, meta = checkpoint
        self.trainer.load(folder)
        self.updates, self.dropped_stale = meta["updates"], meta["dropped_stale"]
        # "applied": the unbounded id list of checkpoints written before the window existed
        self.progress = Progress(meta["offsets"], meta.get("handled", meta.get("applied", [])), meta.get("log"))
        # A learner killed between its checkpoint and its metrics lines writes those lines now.
        self.metrics_log.restore(meta["records"])
        log.info(
            "%s: resumed from checkpoint at v%d (%d updates; input offsets %s)",
            self.replica_id,
            self.trainer.version,
            self.updates,
            self.progress.offsets,
        )

    def restored(self) -> Progress | None:
        return self.progress

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> list[WeightAnnouncement]:
        self.epoch = next_epoch(self.config.checkpoint_dir)
        log.info("%s: learner epoch %d", self.replica_id, self.epoch)
        broadcast = self.config.weights.broadcast
        if broadcast.address is not None:
            self.sender = WeightSender(
                broadcast.address, broadcast.receivers, broadcast.timeout_s, self.config.weights.digest
            )
        if self.trainer.version == 0:
            if self.config.data.eval_prompts:
                before = self.trainer.answer(answer_eval_prompts, self.tokenizer, self.config, 0)
                self.before_path.write_text("".join(json.dumps(row) + "\n" for row in before))
            return []
        # After a restart, announce the resumed version: the announcement of the last update may never have left.
        return self.announce()

    def done(self) -> bool:
        # Updates applied: a dropped batch (forged, replayed, too stale) never counts toward the run's steps.
        return self.updates >= self.config.run.steps

    def finish(self) -> None:
        """The trained actor and critic under ``final/``, and the eval answers before and after training."""
        if self.config.data.eval_prompts and self.before_path.exists():
            before = [json.loads(line) for line in self.before_path.read_text().splitlines()]
            after = self.trainer.answer(answer_eval_prompts, self.tokenizer, self.config, self.trainer.version)
            write_generations(self.run_dir, before, after)
        export_final_models(
            self.run_dir,
            {name: (module, self.trainer.full_state(name)) for name, module, _ in self.trainer.models()},
            self.tokenizer,
        )
        log.info("%s: %d updates done; final models in %s", self.replica_id, self.updates, self.run_dir / "final")

    def ready_for(self, message: ExperienceBatch) -> bool:
        # Batches are applied in step order: update v+1 trains on step v. Partitions deliver out of order, and a
        # batch trained after later steps would be staler than max_staleness allows, although its sampler kept the
        # bound. After a crash rolls the learner back to its checkpoint, the experience of the steps it had already
        # applied comes again and waits the same way. A step that no real batch can have is let through, for
        # process() to dead-letter rather than to block its partition.
        return message.step <= self.trainer.version or not self._possible_step(message.step)

    def waiting_for(self, message: ExperienceBatch) -> str:
        return (
            f"experience of step {message.step} waits for step {self.trainer.version} (learner at "
            f"v{self.trainer.version}; batches are applied in step order)"
        )

    def _possible_step(self, step: int) -> bool:
        """Whether real experience can have ``step``: inside the run, and sampled by weights this learner, or its
        rolled-back predecessor (up to ``checkpoint_every − 1`` versions further), announced."""
        cfg = self.config
        newest_announced = self.trainer.version + cfg.learner.checkpoint_every - 1
        return 0 <= step < cfg.run.steps and step <= newest_announced + cfg.pipeline.max_staleness

    def process(self, message: ExperienceBatch) -> list[WeightAnnouncement]:
        if not self._possible_step(message.step):
            raise InputError(
                f"step {message.step} cannot be real: the run has steps 0..{self.config.run.steps - 1} and the "
                f"learner, at v{self.trainer.version}, has not published weights that could sample it"
            )
        staleness = self.trainer.version - message.policy_version
        if staleness < 0:
            # Sampled by a policy this learner never published: a learner that lost its checkpoint, or weights from
            # elsewhere. Training on it would be off-policy by an unknown amount.
            raise self._drop(message, "newer than this learner")
        if staleness > self.config.pipeline.max_staleness:
            raise self._drop(message, f"older than max_staleness {self.config.pipeline.max_staleness} allows")
        check_token_ids(message, self.trainer.actor, "actor")
        started = time.perf_counter()
        stats = self.trainer.train(Experience.from_message(message))
        self.updates += 1
        stage_seconds = {
            f"seconds_{k.removeprefix('seconds.')}": v for k, v in message.lineage.items() if k.startswith("seconds.")
        }
        record = {
            "step": self.updates,
            "batch_id": message.batch_id,
            "time": time.time() - self.started,
            "train_seconds": time.perf_counter() - started,
            "sequences": len(message.response_lengths),
            "dropped_stale": self.dropped_stale,
            **stage_seconds,
            **stats,
        }
        self.since_checkpoint += 1
        self.unsaved_records.append(record)
        self.report(record)
        return self.announce()

    def make_durable(self, progress: Progress, force: bool = False) -> bool:
        if self.since_checkpoint == 0:
            return True
        if self.since_checkpoint < self.config.learner.checkpoint_every and not force:
            return False
        # Offsets of another log (the broker lost its data since the last checkpoint) are not carried over.
        same_log = self.progress is not None and self.progress.log == progress.log
        offsets = {**(self.progress.offsets if same_log else {}), **progress.offsets}
        self.progress = Progress(offsets, progress.handled, progress.log)
        started = time.perf_counter()
        save_checkpoint(
            self.config.checkpoint_dir,
            self.trainer.version,
            self.trainer.save,
            self.trainer.checkpoint_nbytes(),
            {
                "updates": self.updates,
                "dropped_stale": self.dropped_stale,
                "handled": self.progress.handled,
                "offsets": self.progress.offsets,
                "log": self.progress.log,
                "records": self.unsaved_records,
            },
        )
        log.debug("%s: checkpoint v%d in %.2f s", self.replica_id, self.trainer.version, time.perf_counter() - started)
        # Written after the checkpoint, so metrics.jsonl never shows an update a restart would apply again.
        self.metrics_log.append(self.unsaved_records)
        self.unsaved_records, self.since_checkpoint = [], 0
        return True

    # ------------------------------------------------------------------ internals

    def _drop(self, message: ExperienceBatch, why: str) -> Dropped:
        # Its id is not remembered: a dropped record must not make the real batch of that id look re-delivered.
        self.dropped_stale += 1
        self.since_checkpoint += 1
        return Dropped(f"sampled by v{message.policy_version}, learner at v{self.trainer.version}: {why}")

    def _publish(self, name: str, version: int) -> tuple[Snapshot, str]:
        """Snapshot ``name`` into the store, and the actor also to the generators when the broadcast is configured.

        Returns:
            The snapshot, and the digest of the broadcast every receiver holds (``""`` when none was made).
        """
        dtype = self.config.weights.dtype
        if self.ranks.world_size > 1:  # a part from each rank; one call that all ranks run at a time
            sent = self.sender.send(version, self.trainer.full_state(name, dtype)) if self._broadcasts(name) else ""
            snapshot = self.store.save_sharded(
                name,
                version,
                lambda folder: self.trainer.write_snapshot_parts(name, dtype, folder, self.store.digest),
            )
            return snapshot, sent
        state = self.trainer.full_state(name, dtype)
        if not self._broadcasts(name):
            return self.store.save_state(name, version, state), ""
        return self.sender.send_and_save(self.store, name, version, state)

    def _broadcasts(self, name: str) -> bool:
        return name == "actor" and self.sender is not None

    def announce(self) -> list[WeightAnnouncement]:
        """Snapshot actor and critic at the current version into the weight store (the actor also broadcast, when
        configured) and announce both."""
        version = self.trainer.version
        announcements = []
        for name, _, _ in self.trainer.models():
            snapshot, broadcast_digest = self._publish(name, version)
            self.store.prune(name, self.config.pipeline.keep_snapshots, version)
            lineage = {
                RUN_ID: self.config.run.run_id,
                "kl_coef": self.trainer.kl_controller.value,
                "learner": self.replica_id,
                LEARNER_EPOCH: self.epoch,
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
        return announcements
