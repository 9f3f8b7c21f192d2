"""learner: experience → weights. PPO updates of actor and critic, then new snapshots announced for both.

Experience older than ``max_staleness`` versions is dropped and counted, never trained on. Each update appends
one line of statistics to ``<run dir>/metrics.jsonl``.

Every ``learner.checkpoint_every`` updates (and on shutdown) the learner checkpoints itself: models, optimizers,
KL controller, version, applied batch ids and the input offsets they cover; its input is committed only then. A
learner that restarts, after SIGTERM or ``kill -9``, resumes from the checkpoint: the batches it had applied since
were not committed, come back, and are applied again to the restored state; a batch applied and checkpointed but
not yet committed comes back too and is recognised by its id. Metrics lines are written at checkpoints, so
``metrics.jsonl`` never shows an update that a restart would apply again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from common.checkpoint import load_latest_checkpoint, save_checkpoint
from common.config import RunConfig
from common.data import load_prompts, tokenize_prompts
from common.generation import SamplingParams, sample_responses
from common.models import load_actor, load_critic, load_tokenizer, resolve_model
from common.schema import RUN_ID, ExperienceBatch, WeightAnnouncement, new_header
from common.trainer import Experience, PPOTrainer
from common.weights import WeightStore
from services.runtime import Service, check_token_ids

log = logging.getLogger(__name__)


class LearnerService(Service):
    role = "learner"
    input_topic = "experience"
    output_topic = "weights"

    def __init__(self, config: RunConfig, replica_id: str = "learner-0", resume: bool = True):
        self.config, self.replica_id, self.run_id = config, replica_id, config.run.run_id
        m = config.model
        actor_path = resolve_model(m.actor, m.cache_dir)
        critic_path = resolve_model(m.critic or m.actor, m.cache_dir)
        self.tokenizer = load_tokenizer(actor_path, m.trust_remote_code)
        actor = load_actor(actor_path, m.dtype, m.trust_remote_code, device=m.device)
        critic = load_critic(critic_path, m.dtype, m.trust_remote_code, m.device)
        self.trainer = PPOTrainer(
            actor, critic, config.learner, config.algorithm, config.generation.temperature,
            self.tokenizer.pad_token_id, seed=config.run.seed,
        )
        self.store = WeightStore(config.weight_store)
        self.run_dir = Path(config.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.updates = 0
        self.dropped_stale = 0
        self.applied: set[str] = set()
        self.offsets: dict[str, int] = {}  # "topic/partition" -> next offset, as of the last checkpoint
        self.since_checkpoint = 0  # batches consumed since the last checkpoint
        self.unsaved_records: list[dict] = []  # metrics lines of those updates, written with the next checkpoint
        self.listeners: list[Callable[[dict], None]] = []
        self.started = time.time()
        checkpoint = load_latest_checkpoint(config.checkpoint_dir) if resume else None
        if checkpoint is not None:
            state, meta = checkpoint
            self.trainer.load_state_dict(state)
            self.updates, self.dropped_stale = meta["updates"], meta["dropped_stale"]
            self.applied, self.offsets = set(meta["applied"]), meta["offsets"]
            self._restore_metrics(meta["records"])
            log.info("%s: resumed from checkpoint at v%d (%d updates; input offsets %s)", replica_id,
                     self.trainer.version, self.updates, self.offsets)
        self.before_path = self.run_dir / "generations_before.jsonl"
        if self.trainer.version == 0 and config.data.eval_prompts:
            self.before_path.write_text("".join(json.dumps(row) + "\n" for row in self.answer_eval_prompts()))

    def _append_metrics(self, record: dict) -> None:
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _restore_metrics(self, records: list[dict]) -> None:
        """A learner killed between its checkpoint and its metrics lines writes those lines now."""
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.exists() else []
        last_step = json.loads(lines[-1])["step"] if lines else 0
        for record in records:
            if record["step"] > last_step:
                self._append_metrics(record)

    def startup_messages(self) -> list[WeightAnnouncement]:
        # After a restart, announce the resumed version: the announcement of the last update may never have left.
        return self.announce() if self.trainer.version > 0 else []

    @property
    def consumed(self) -> int:
        """Experience batches taken off the topic: trained on or dropped."""
        return self.updates + self.dropped_stale

    def ready_for(self, message: ExperienceBatch) -> bool:
        # After a crash the learner restarts from its last checkpoint, up to checkpoint_every - 1 updates behind
        # weights it had already announced; experience sampled by those waits while the re-delivered batches are
        # applied again. Anything newer was never published by this learner: process() drops it.
        ahead = message.policy_version - self.trainer.version
        return not 0 < ahead < self.config.learner.checkpoint_every

    def waiting_for(self, message: ExperienceBatch) -> str:
        return (f"experience {message.batch_id} (sampled by v{message.policy_version}) waits for the learner, "
                f"restored to v{self.trainer.version}, to re-apply the updates since its checkpoint")

    def process(self, message: ExperienceBatch) -> list[WeightAnnouncement]:
        if message.batch_id in self.applied:
            log.info("%s: batch %s is already in the checkpoint; not applied again", self.replica_id, message.batch_id)
            return []
        staleness = self.trainer.version - message.policy_version
        if staleness < 0:
            # Sampled by a policy this learner never published: a learner that lost its checkpoint, or weights from
            # elsewhere. Training on it would be off-policy by an unknown amount.
            return self._drop(message, "newer than this learner")
        if staleness > self.config.pipeline.max_staleness:
            return self._drop(message, f"older than max_staleness {self.config.pipeline.max_staleness} allows")
        check_token_ids(message, self.trainer.actor, "actor")
        started = time.perf_counter()
        stats = self.trainer.train(Experience.from_message(message))
        self.updates += 1
        stage_seconds = {f"seconds_{k.removeprefix('seconds.')}": v for k, v in message.lineage.items()
                         if k.startswith("seconds.")}
        record = {"step": self.updates, "batch_id": message.batch_id, "time": time.time() - self.started,
                  "train_seconds": time.perf_counter() - started, "sequences": len(message.response_lengths),
                  "dropped_stale": self.dropped_stale, **stage_seconds, **stats}
        self.applied.add(message.batch_id)
        self.since_checkpoint += 1
        self.unsaved_records.append(record)
        for listener in self.listeners:
            listener(record)
        return self.announce()

    def make_durable(self, offsets: dict[str, int], force: bool = False) -> bool:
        if self.since_checkpoint == 0:
            return True
        if self.since_checkpoint < self.config.learner.checkpoint_every and not force:
            return False
        self.offsets.update(offsets)
        started = time.perf_counter()
        save_checkpoint(self.config.checkpoint_dir, self.trainer.version, self.trainer.state_dict(),
                        {"updates": self.updates, "dropped_stale": self.dropped_stale, "applied": sorted(self.applied),
                         "offsets": self.offsets, "records": self.unsaved_records})
        log.debug("%s: checkpoint v%d in %.2f s", self.replica_id, self.trainer.version, time.perf_counter() - started)
        # Written after the checkpoint, so metrics.jsonl never shows an update a restart would apply again.
        for record in self.unsaved_records:
            self._append_metrics(record)
        self.unsaved_records, self.since_checkpoint = [], 0
        return True

    def _drop(self, message: ExperienceBatch, why: str) -> list:
        self.dropped_stale += 1
        self.since_checkpoint += 1
        self.applied.add(message.batch_id)  # counted once, even if it comes back
        log.warning("%s: dropping batch %s: sampled by v%d, learner at v%d: %s", self.replica_id, message.batch_id,
                    message.policy_version, self.trainer.version, why)
        return []

    def announce(self) -> list[WeightAnnouncement]:
        """Snapshot actor and critic at the current version into the weight store and announce both."""
        version = self.trainer.version
        announcements = []
        for name, module in (("actor", self.trainer.actor), ("critic", self.trainer.critic)):
            snapshot = self.store.save(name, version, module)
            self.store.prune(name, self.config.pipeline.keep_snapshots)
            lineage = {RUN_ID: self.config.run.run_id, "kl_coef": self.trainer.kl_controller.value,
                       "learner": self.replica_id}
            announcements.append(WeightAnnouncement(
                **new_header(f"{self.config.run.run_id}-weights-{name}-v{version:08d}", self.replica_id, version, lineage),
                model=name, uri=snapshot.uri, sha256=snapshot.sha256, num_bytes=snapshot.num_bytes,
            ))
        return announcements

    def answer_eval_prompts(self) -> list[dict]:
        """The actor's answers to the first ``data.eval_prompts`` prompts (sampled with a fixed seed)."""
        data, gen = self.config.data, self.config.generation
        texts = load_prompts(data.prompts)[: data.eval_prompts]
        tokens, lengths = tokenize_prompts(self.tokenizer, texts, data.max_prompt_tokens, data.chat_template)
        params = SamplingParams(n=1, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                top_k=gen.top_k, seed=self.config.run.seed)
        samples = sample_responses(self.trainer.actor, torch.from_numpy(tokens), torch.from_numpy(lengths), params,
                                   self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        answers = self.tokenizer.batch_decode(samples.response_tokens, skip_special_tokens=True)
        return [{"prompt": p, "response": a, "policy_version": self.trainer.version} for p, a in zip(texts, answers)]

    def write_generations(self) -> Path | None:
        """``generations.md``: each eval prompt with the answer before training and after, side by side."""
        if not self.config.data.eval_prompts or not self.before_path.exists():
            return None
        before = [json.loads(line) for line in self.before_path.read_text().splitlines()]
        after = self.answer_eval_prompts()
        cell = lambda text: " ".join(text.split()).replace("|", "\\|") or "(empty)"  # noqa: E731
        lines = [f"# Generations before (v0) and after (v{self.trainer.version}) training", "",
                 "| prompt | before | after |", "|---|---|---|"]
        lines += [f"| {cell(b['prompt'])} | {cell(b['response'])} | {cell(a['response'])} |" for b, a in zip(before, after)]
        path = self.run_dir / "generations.md"
        path.write_text("\n".join(lines) + "\n")
        (self.run_dir / "generations.jsonl").write_text("".join(
            json.dumps({"prompt": b["prompt"], "before": b["response"], "after": a["response"]}) + "\n"
            for b, a in zip(before, after)))
        return path

    def save_final(self) -> Path:
        """Save the trained actor (with its tokenizer) and critic as ordinary transformers folders, and the
        before/after generations."""
        self.write_generations()
        final = self.run_dir / "final"
        self.trainer.actor.save_pretrained(final / "actor")
        self.tokenizer.save_pretrained(final / "actor")
        self.trainer.critic.save_pretrained(final / "critic")
        self.tokenizer.save_pretrained(final / "critic")
        return final
