"""learner: experience → weights. PPO updates of actor and critic, then new snapshots announced for both.

Experience arrives as groups (a prompt's ``n`` responses, in records of one or more); an update trains on
``learner.groups_per_update`` of them as they arrive, oldest policy version first (:mod:`services.learner.groups`).
A group that waited more than ``max_staleness`` versions is dropped and counted, never trained on; experience
sampled by weights this learner never published is dropped too, and a step outside the run's prompt batches goes
to the dead-letter topic. Experience sampled by a version newer than the learner's comes from its predecessor, whose
updates since the last checkpoint a crash rolled back: those weights were published, the behaviour log-probs say
what they sampled, and the group is trained like any other (staleness below zero, corrected for as off-policy).
Holding it until the version is made again could wait for good: the groups that made it are not all there to make
it again when groups are taken as they arrive. Groups the advantage stage dropped for want of signal (dynamic
sampling) are counted.
Each update appends one line of statistics to ``<run dir>/metrics.jsonl``, naming the groups it trained on.

Every ``learner.checkpoint_every`` updates (and on shutdown) the learner checkpoints itself: models, optimizers,
KL controller, version, the groups waiting for an update, which prompt batches are settled, the keys of the groups
it handled last and the input offsets they cover; its input is committed only then. A learner that restarts, after
SIGTERM or ``kill -9``, resumes from the checkpoint: the records it had read since were not committed, come back,
and are applied again to the restored state; a group handled and checkpointed but not yet committed comes back too
and is recognised by its key. Metrics lines are written at checkpoints, so ``metrics.jsonl`` never shows an update
that a restart would apply again.

Each announcement carries the groups used up so far (``learner.groups_done``): generators admit prompt batches by
it. When groups are used up without an update (dropped), the actor's announcement is repeated with the new count.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

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
from common.report import OUTCOME_FILE
from common.schema import (
    LEARNER_EPOCH,
    LEARNER_GROUPS_DONE,
    LEARNER_REPLACEMENTS,
    LEARNER_SETTLED,
    ExperienceBatch,
    WeightAnnouncement,
)
from services.learner.checkpoints import checkpoint_nbytes
from services.learner.evaluation import answer_eval_prompts, episode_rows, write_generations
from services.learner.experience import Experience
from services.learner.export import export_final_models
from services.learner.groups import GroupBuffer, StepLedger, groups_of
from services.learner.metrics_log import MetricsLog
from services.learner.parallel import init_ranks, shard_model
from services.learner.publishing import Publisher
from services.learner.ranks import LearnerRanks
from services.learner.staleness import StalenessBook
from services.learner.trackers import Trackers, check_trackers
from services.learner.trainer import PPOTrainer
from services.service import Dropped, InputError, Progress, Service, check_token_ids

log = logging.getLogger(__name__)


class LearnerService(Service):
    role = "learner"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        m = config.model
        check_trackers(config)  # a tracker's library not installed
        resolve_model(m.actor, m.cache_dir)
        if config.algorithm.uses_critic:
            resolve_model(m.critic or m.actor, m.cache_dir)

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
            max_response_length=config.max_response_tokens,
            total_updates=config.run.steps,
        )
        self.publisher = Publisher(config, self.replica_id, self.ranks.world_size)
        self.run_dir = Path(config.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_log = MetricsLog(self.run_dir / "metrics.jsonl")
        self.before_path = self.run_dir / "generations_before.jsonl"
        self.updates = 0
        self.dropped_stale = 0  # groups dropped as stale: past the bound, or of a version this learner never published
        self.past_bound = 0  # of them, those that waited past max_staleness (replaced: pipeline.stale_reserve)
        self.no_signal = 0  # groups the advantage stage dropped (dynamic sampling)
        self.dead_lettered = 0  # groups every episode of which a gateway dead-lettered
        self.groups_done = 0  # groups used up: trained, or dropped (stale, no signal)
        self.buffer = GroupBuffer()
        self.ledger = StepLedger(config.data.batch_size)
        self.staleness = StalenessBook(config, self.replica_id)
        self.progress: Progress | None = None  # what the last checkpoint covers (input offsets, batch ids handled)
        self.changed = False  # input read, or an update made, since the last checkpoint
        self.since_checkpoint = 0  # updates since the last checkpoint
        self.unsaved_records: list[dict] = []  # metrics lines of those updates, written with the next checkpoint
        self.started = time.time()
        self.epoch = 0  # taken in start(): 0 only for a learner that announces without having started (tests)
        self.on_new_log = False  # goes on on a log that replaced a lost one (take_up_new_log)
        self.trackers = Trackers()  # run.trackers: rank 0's alone
        # A run of episodes: the conversations of the first update since this start and of the last (generations.md).
        self.episodes: list[list[dict]] = [[], []]
        if self.ranks.leads:  # the other ranks load the checkpoint when rank 0 leads them to
            restored = self._resume()
            self.trackers = Trackers.open(config, self.run_dir, resumed=restored is not None)
            self.trackers.log(restored or [])

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
        self.trackers.close()
        self.publisher.close()
        self.trainer.release()

    def _resume(self) -> list[dict] | None:
        """Take up the last checkpoint's state; returns the metrics lines it wrote again (None: no checkpoint)."""
        checkpoint = load_latest_checkpoint(self.config.checkpoint_dir)
        if checkpoint is None:
            return None
        folder, meta = checkpoint
        self.trainer.load(folder)
        self.buffer.load(folder)
        self.updates, self.dropped_stale = meta["updates"], meta["dropped_stale"]
        self.no_signal = meta.get("no_signal", 0)
        self.past_bound = meta.get("too_stale", 0)  # its checkpoint key
        self.dead_lettered = meta.get("dead_lettered", 0)
        # Checkpoints from before groups: one update trained one whole prompt batch.
        self.groups_done = meta.get("groups_done", self.updates * self.config.data.batch_size)
        self.ledger = StepLedger.from_state(self.config.data.batch_size, meta.get("ledger"), self.updates)
        self.staleness.done_at = {int(v): done for v, done in meta.get("done_at", {}).items()} or {0: 0}
        # "applied": the unbounded id list of checkpoints written before the window existed
        self.progress = Progress(meta["offsets"], meta.get("handled", meta.get("applied", [])), meta.get("log"))
        # A learner killed between its checkpoint and its metrics lines writes those lines now.
        restored = self.metrics_log.restore(meta["records"])
        log.info(
            "%s: resumed from checkpoint at v%d (%d updates; input offsets %s)",
            self.replica_id,
            self.trainer.version,
            self.updates,
            self.progress.offsets,
        )
        return restored

    def restored(self) -> Progress | None:
        return self.progress

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> list[WeightAnnouncement]:
        (self.run_dir / OUTCOME_FILE).unlink(missing_ok=True)  # the run goes on: it has no outcome yet
        self.epoch = next_epoch(self.config.checkpoint_dir)
        log.info("%s: learner epoch %d", self.replica_id, self.epoch)
        self.publisher.open_broadcast()
        if self.trainer.version == 0 and self.config.data.eval_prompts and not self.on_new_log:
            before = self.trainer.answer(answer_eval_prompts, self.tokenizer, self.config, 0)
            self.before_path.write_text("".join(json.dumps(row) + "\n" for row in before))
        if self.trainer.version == 0 and not (self.on_new_log or self.config.run.resume):
            return []
        # After a restart, or on a new log, announce the version it goes on from: the announcement of the last update
        # may never have left, and a feeder on a new log publishes again from the prompt batches it settled.
        return self.announce()

    def take_up_new_log(self) -> bool:
        # What it applied was checkpointed (ServiceRunner.leave_for_new_log); its state is the checkpoint's.
        self.on_new_log = True
        return True

    def done(self) -> bool:
        # Updates applied: a dropped group (forged, replayed, too stale) never counts toward the run's steps.
        return self.updates >= self.config.run.steps or self._used_up()

    def _used_up(self) -> bool:
        """Whether every prompt batch the run may use is settled and too few groups are left for an update (with
        dynamic sampling, when too many groups had no signal)."""
        published = self.config.prompt_batches + self.config.replacements_for(self.past_bound)
        return self.ledger.below >= published and len(self.buffer) < self.config.groups_per_update

    def finish(self) -> None:
        """The trained actor and critic under ``final/``, and the eval answers before and after training (a run of
        episodes: its agents' or environment's conversations of the first and last updates first)."""
        before = after = []
        if self.config.data.eval_prompts and self.before_path.exists():
            before = [json.loads(line) for line in self.before_path.read_text().splitlines()]
            after = self.trainer.answer(answer_eval_prompts, self.tokenizer, self.config, self.trainer.version)
        episodes = tuple(self.episodes) if self.config.episodes and all(self.episodes) else None
        if (before and after) or episodes:
            write_generations(self.run_dir, before, after, episodes)
        shortfall = self.shortfall()
        (self.run_dir / OUTCOME_FILE).write_text(
            json.dumps({"updates": self.updates, "steps": self.config.run.steps, "shortfall": shortfall or ""}) + "\n"
        )
        export_final_models(
            self.run_dir,
            {name: (module, self.trainer.full_state(name)) for name, module, _ in self.trainer.models()},
            self.tokenizer,
        )
        self.trackers.finish(self.run_dir)
        log.info("%s: %d updates done; final models in %s", self.replica_id, self.updates, self.run_dir / "final")

    def shortfall(self) -> str | None:
        """Why the run ends before ``run.steps`` updates, with the setting that applies to each cause; None if not."""
        cfg = self.config
        if self.updates >= cfg.run.steps:
            return None
        published = cfg.prompt_batches + cfg.replacements_for(self.past_bound)
        causes = []
        if self.past_bound:
            reserve = cfg.replacement_batches * cfg.data.batch_size
            causes.append(
                f"{self.past_bound} groups were too stale to train, of which pipeline.stale_reserve="
                f"{cfg.pipeline.stale_reserve:g} lets {min(reserve, self.past_bound)} be replaced"
                + ("; raise pipeline.stale_reserve" if self.past_bound > reserve else "")
            )
        if self.no_signal:
            causes.append(
                f"{self.no_signal} groups had no signal"
                + (
                    f" (dynamic sampling publishes algorithm.max_sampling_factor={cfg.algorithm.max_sampling_factor:g}"
                    " times the groups the updates need; raise it)"
                    if cfg.algorithm.dynamic_sampling
                    else ""
                )
            )
        if self.dead_lettered:
            causes.append(f"{self.dead_lettered} groups were dead-lettered whole (gateway.unrewarded: dead_letter)")
        if self.dropped_stale > self.past_bound:
            causes.append(f"{self.dropped_stale - self.past_bound} groups were dropped as not of this run's versions")
        return (
            f"the run ended after {self.updates} of its {cfg.run.steps} updates: all {published} prompt batches it may "
            f"publish are used ({'; '.join(causes) or 'too few groups are left for an update'}); or lower run.steps"
        )

    def process(self, message: ExperienceBatch) -> list[WeightAnnouncement]:
        cfg = self.config
        if not 0 <= message.step < cfg.steps_possible:
            raise InputError(
                f"step {message.step} cannot be real: the run has prompt batches 0..{cfg.steps_possible - 1}"
            )
        if not self.staleness.possible_version(message.newest_version(), self.trainer.version):
            # Sampled by a policy this learner never published: a learner that lost its checkpoint, or weights from
            # elsewhere. Training on it would be off-policy by an unknown amount.
            self.changed = True
            self.dropped_stale += len(message.groups())
            raise Dropped(
                f"sampled by v{message.newest_version()}, learner at v{self.trainer.version}: newer than this learner "
                "(or one it took over from) can have published"
            )
        impossible = self.staleness.never_admitted(message, self.trainer.version)
        if impossible:
            # A record that lies (another run's, relabelled with this run's id and a later step) is dropped and
            # counted, never trained: taken in, it would move the staleness bound for good.
            raise InputError(impossible)
        check_token_ids(message, self.trainer.actor, "actor")
        self.changed = True
        no_signal = [int(g) for g in message.no_signal_groups]
        dead = [int(g) for g in message.dead_lettered_groups]
        self.ledger.settle(message.step, message.groups_accounted())
        self.no_signal += len(no_signal)
        self.dead_lettered += len(dead)
        self.groups_done += len(no_signal) + len(dead)
        self.buffer.add(groups_of(message))
        updates, dropped = self.updates, self._drop_stale()
        dropped += self._train_ready()
        if self.updates > updates:
            return self.announce()
        return self._progress_announcement() if dropped or no_signal or dead else []

    def tick(self) -> list[WeightAnnouncement]:
        # Waiting for a group in flight ends after pipeline.hold_timeout_s (it may never come: dead-lettered on
        # the way); the updates it held back are made then.
        updates = self.updates
        if self.staleness.waiting_since is not None and len(self.buffer) >= self.config.groups_per_update:
            self._train_ready()
        return self.announce() if self.updates > updates else []

    def _train_ready(self) -> int:
        """Make the updates the waiting groups allow; the groups dropped as stale meanwhile."""
        dropped = 0
        while (
            self.updates < self.config.run.steps
            and len(self.buffer) >= self.config.groups_per_update
            and not self.staleness.waits_for_in_flight(self.ledger, self.trainer.version, self.updates + 1)
        ):
            self._update()
            dropped += self._drop_stale()
        return dropped

    def _drop_stale(self) -> int:
        """Drop the waiting groups more than ``max_staleness`` versions behind; how many."""
        stale = self.buffer.drop_older_than(self.trainer.version - self.config.pipeline.max_staleness)
        if stale:
            log.warning(
                "%s: dropped %d groups sampled by v%s: the learner is at v%d, max_staleness %d",
                self.replica_id,
                len(stale),
                ",".join(sorted({str(g.version) for g in stale})),
                self.trainer.version,
                self.config.pipeline.max_staleness,
            )
        self.dropped_stale += len(stale)
        self.past_bound += len(stale)
        self.groups_done += len(stale)
        return len(stale)

    def _update(self) -> None:
        """One update on the oldest ``groups_per_update`` waiting groups."""
        groups = self.buffer.take(self.config.groups_per_update)
        started = time.perf_counter()
        staleness = [self.trainer.version - g.version for g in groups]
        experience = Experience.concat([g.experience for g in groups])
        stats = self.trainer.train(experience)
        self.updates += 1
        if self.config.episodes:
            shown = max(self.config.data.eval_prompts, 4)
            rows = episode_rows(experience, self.tokenizer, self.trainer.version, shown)
            self.episodes = [self.episodes[0] or rows, rows]
        self.groups_done += len(groups)
        seconds: dict[str, float] = {}
        for group in groups:
            for stage, s in group.seconds.items():
                seconds[f"seconds_{stage}"] = seconds.get(f"seconds_{stage}", 0.0) + s
        record = {
            "step": self.updates,
            "groups": [g.key for g in groups],
            "batch_ids": sorted({g.batch_id for g in groups}),
            "time": time.time() - self.started,
            "train_seconds": time.perf_counter() - started,
            "sequences": sum(g.experience.rows for g in groups),
            "staleness_max": max(staleness),
            "staleness_counts": {str(k): staleness.count(k) for k in sorted(set(staleness))},
            "dropped_stale": self.dropped_stale,
            "no_signal_groups": self.no_signal,
            "dead_lettered_groups": self.dead_lettered,
            **{k: round(v, 4) for k, v in seconds.items()},
            **stats,
        }
        self.since_checkpoint += 1
        self.changed = True
        self.unsaved_records.append(record)
        self.report(record)

    def make_durable(self, progress: Progress, force: bool = False) -> bool:
        if not self.changed:
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
            self._save_state,
            checkpoint_nbytes(self.trainer) + sum(g.experience.nbytes() for g in self.buffer.groups),
            {
                "updates": self.updates,
                "dropped_stale": self.dropped_stale,
                "too_stale": self.past_bound,
                "no_signal": self.no_signal,
                "dead_lettered": self.dead_lettered,
                "groups_done": self.groups_done,
                "ledger": self.ledger.state(),
                "done_at": {str(v): done for v, done in self.staleness.done_at.items()},
                "handled": self.progress.handled,
                "offsets": self.progress.offsets,
                "log": self.progress.log,
                "records": self.unsaved_records,
            },
        )
        log.debug("%s: checkpoint v%d in %.2f s", self.replica_id, self.trainer.version, time.perf_counter() - started)
        # Written after the checkpoint, so metrics.jsonl never shows an update a restart would apply again.
        self.metrics_log.append(self.unsaved_records)
        self.trackers.log(self.unsaved_records)
        self.unsaved_records, self.since_checkpoint, self.changed = [], 0, False
        return True

    def _save_state(self, folder: Path) -> None:
        self.trainer.save(folder)
        self.buffer.save(folder)

    # ------------------------------------------------------------------ internals

    def _progress(self) -> dict:
        """What the announcements say of the learner's progress (generators admit by it; a feeder on a new log
        publishes again from the batches settled)."""
        return {
            LEARNER_EPOCH: self.epoch,
            LEARNER_GROUPS_DONE: self.groups_done,
            LEARNER_SETTLED: self.ledger.below,
            LEARNER_REPLACEMENTS: self.config.replacements_for(self.past_bound),
        }

    def announce(self) -> list[WeightAnnouncement]:
        """Snapshot actor and critic at the current version into the weight store (the actor also broadcast, when
        configured) and announce both."""
        announcements = self.publisher.publish(self.trainer, self._progress())
        for record in self.unsaved_records:  # the update's metrics line names what it made (streamppo replay)
            if record["step"] == self.trainer.version:
                record["digests"] = {a.model: a.digest for a in announcements}
        self.staleness.announced(self.trainer.version, self.groups_done)
        return announcements

    def _progress_announcement(self) -> list[WeightAnnouncement]:
        """The actor's announcement again, with the groups used up now: generators admit prompt batches by it, and
        groups used up without an update (dropped) would otherwise leave them waiting."""
        progress = {key: self._progress()[key] for key in (LEARNER_GROUPS_DONE, LEARNER_REPLACEMENTS)}
        again = self.publisher.actor_again(self.trainer.version, progress)
        if again is None:
            return [a for a in self.announce() if a.model == "actor"]
        self.staleness.announced(self.trainer.version, self.groups_done)
        return [again]
