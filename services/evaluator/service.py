"""evaluator: held-out prompts scored while the run trains, off the learner's path (``eval`` in the config).

It follows the actor's announcements as a generator does, and at versions 0, ``eval.every``, 2·``eval.every``, ...
and the run's last, answers the first ``eval.max_prompts`` held-out prompts (greedily, or ``eval.samples`` times at
``eval.temperature``) and scores them with the run's reward: one line per version in ``<run.dir>/eval.jsonl``
(:mod:`common.report` plots it). Nothing waits for it: the learner never hears of it, and when an evaluation takes
longer than the updates it falls behind, it takes the newest version due and says which it skipped. verl and
OpenRLHF stop training to validate; here the evaluator is one more replica on the bus.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path

import torch

from common.config import RunConfig
from common.data import load_prompts, tokenize_prompts
from common.generation import sample_responses
from common.models import add_lora, load_actor, load_tokenizer, resolve_model
from common.report import EVAL_FILE, OUTCOME_FILE, load_eval
from common.rewards import load_reward
from common.sampling import SamplingParams
from common.schema import WeightAnnouncement
from common.weights import load_snapshot_into
from services.service import Service, load_announced_weights

log = logging.getLogger(__name__)

__all__ = ["EvaluatorService"]


class EvaluatorService(Service):
    role = "evaluator"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        if config.eval is not None:
            load_prompts(config.eval.prompts, "eval.prompts")
        resolve_model(config.model.actor, config.model.cache_dir)

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        if config.eval is None:
            raise ValueError("the evaluator needs an eval section (eval.prompts: the held-out prompts)")
        self.eval, m = config.eval, config.model
        path = resolve_model(m.actor, m.cache_dir)
        self.tokenizer = load_tokenizer(path, m.trust_remote_code)
        self.actor = load_actor(path, m.dtype_of("actor"), m.trust_remote_code, device=m.device).requires_grad_(False)
        if m.lora is not None:  # the learner announces the adapters alone
            self.actor = add_lora(self.actor, m.lora).requires_grad_(False)
        self.reward, _ = load_reward(config)
        held_out = load_prompts(self.eval.prompts, "eval.prompts")
        self.texts = held_out.texts[: self.eval.max_prompts]
        self.labels = held_out.labels[: self.eval.max_prompts]
        self.run_dir = Path(config.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / EVAL_FILE
        # The versions already in eval.jsonl: a restart does them once.
        self.evaluated = {int(line["policy_version"]) for line in load_eval(self.run_dir)}
        self.loaded = 0  # the actor version in self.actor
        self.due: int | None = 0 if 0 not in self.evaluated else None  # the version to evaluate next
        self.skipped: list[int] = []

    def _is_due(self, version: int) -> bool:
        return version not in self.evaluated and (version % self.eval.every == 0 or version >= self.config.run.steps)

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        version = announcement.policy_version
        if version == self.loaded:
            return True  # progress only (groups used up): nothing to load
        if not load_announced_weights(
            partial(load_snapshot_into, self.actor), announcement, self.replica_id, self.loaded
        ):
            return False
        previous, self.loaded = self.loaded, version
        # Versions due that this one replaces before they were evaluated (or that it never saw loaded at all).
        missed = [v for v in range(previous + 1, version) if self._is_due(v)]
        if self.due is not None and self.due not in (version, *missed):
            missed.insert(0, self.due)
        if missed:
            self.skipped += missed
            log.warning(
                "%s: skipping v%s: v%d came out before %s evaluated (an evaluation takes longer than the updates "
                "between them: raise eval.every, or lower eval.max_prompts)",
                self.replica_id,
                ", v".join(map(str, missed)),
                version,
                "it was" if len(missed) == 1 else "they were",
            )
        self.due = version if self._is_due(version) else None
        return True

    def process(self, message) -> list:
        raise NotImplementedError("the evaluator takes no input")

    def tick(self) -> list:
        if self.due is None and self._learner_finished() and self.loaded not in self.evaluated:
            self.due = self.loaded  # a run that ended short: its last version
        if self.due is None or self.due != self.loaded:
            return []
        version, self.due = self.due, None
        started = time.perf_counter()
        scores = self._score()
        line = {
            "policy_version": version,
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std(unbiased=False)),
            "prompts": len(self.texts),
            "samples": self.eval.samples,
            "temperature": self.eval.temperature,
            "seconds": round(time.perf_counter() - started, 3),
            "time": time.time(),
        }
        with open(self.path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        self.evaluated.add(version)
        log.info("%s: held-out reward %.4f at v%d", self.replica_id, line["reward_mean"], version)
        return []

    @torch.no_grad()
    def _score(self) -> torch.Tensor:
        """Every held-out prompt's answers, scored by the run's reward: ``(prompts × samples,)``."""
        data, gen = self.config.data, self.config.generation
        tokens, lengths = tokenize_prompts(self.tokenizer, self.texts, data.max_prompt_tokens, data.chat_template)
        params = SamplingParams(
            n=self.eval.samples,
            max_new_tokens=gen.max_new_tokens,
            temperature=self.eval.temperature,
            seed=self.config.run.seed,
        )
        with torch.random.fork_rng(devices=[]):  # seeded sampling here leaves the other roles' draws alone
            samples = sample_responses(
                self.actor,
                torch.from_numpy(tokens).to(self.actor.device),
                torch.from_numpy(lengths).to(self.actor.device),
                params,
                self.tokenizer.eos_token_id,
                self.tokenizer.pad_token_id,
            )
        answers = self.tokenizer.batch_decode(samples.response_tokens, skip_special_tokens=True)
        prompts = [text for text in self.texts for _ in range(self.eval.samples)]
        labels = [label for label in self.labels for _ in range(self.eval.samples)]
        return self.reward(prompts, answers, labels).float()

    def done(self) -> bool:
        """The run's last version evaluated: ``run.steps``, or the one the learner ended on (a run that ended
        short: its outcome written)."""
        if self.due is not None:
            return False
        if any(version >= self.config.run.steps for version in self.evaluated):
            return True
        return self._learner_finished() and self.loaded in self.evaluated

    def _learner_finished(self) -> bool:
        return (self.run_dir / OUTCOME_FILE).exists()

    def counters(self) -> dict[str, int]:
        return {"evaluations": len(self.evaluated), "eval_skipped": len(self.skipped)}

    def take_up_new_log(self) -> bool:
        return True  # what it evaluated is in eval.jsonl; the learner announces its actor again on the new log

    def close(self) -> None:
        self.reward.close()
