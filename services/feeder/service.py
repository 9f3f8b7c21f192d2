"""feeder: dataset → prompts. Publishes the run's tokenized prompt batches (``RunConfig.prompt_batches``), then follows
the learner's progress (its announcements) until it has settled them or finished the run, and is done.

It consumes nothing: its output is what :meth:`FeederService.start` returns, and on a new log what :meth:`tick`
returns. With ``run.resume`` (``--resume``) it starts at the first prompt batch the learner's last checkpoint has not
settled (every group trained, waiting in the checkpoint or dropped), as after the loss of a broker's data. A feeder
that saw the log lost (:meth:`take_up_new_log`) waits for the learner's first announcement on the new log, which the
learner makes after checkpointing, and publishes again from the first prompt batch it says is not settled.
Batch ids are a function of the run id and the step, so re-publishing after a restart produces duplicates that
every consumer recognises. Groups the learner drops as too stale are replaced: its announcements say how many prompt
batches past the run's own it needs (``learner.replacements``, within ``pipeline.stale_reserve``), and the feeder
publishes them, the next prompts of the schedule, as they are asked for; the run still makes ``run.steps`` updates.
"""

from __future__ import annotations

import logging

from common.checkpoint import load_latest_checkpoint
from common.config import RunConfig
from common.data import PromptSchedule, load_prompts, tokenize_prompts
from common.models import load_tokenizer, resolve_model
from common.schema import LEARNER_REPLACEMENTS, LEARNER_SETTLED, RUN_ID, PromptBatch, WeightAnnouncement, new_header
from services.service import Service

log = logging.getLogger(__name__)


class FeederService(Service):
    role = "feeder"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        prompts = load_prompts(config.data.prompts)  # a file that is not prompt lines, named by its line
        PromptSchedule(len(prompts), config.data.batch_size, config.data.shuffle, config.run.seed)  # a batch's worth
        resolve_model(config.model.actor, config.model.cache_dir)  # its tokenizer

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        self.prompts = load_prompts(config.data.prompts)
        path = resolve_model(config.model.actor, config.model.cache_dir)
        self.tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        self.schedule = PromptSchedule(len(self.prompts), config.data.batch_size, config.data.shuffle, config.run.seed)
        self.published = False
        self.learner_done = False  # its announcements say it needs no more prompt batches
        self.new_log = False  # on a log that replaced a lost one, before publishing on it
        self.republish_from: int | None = None  # there: the first prompt batch the learner has not settled
        self.replacements = 0  # prompt batches past the run's own the learner asked for (groups dropped as stale)
        self.replaced = 0  # of them, those published by this process
        self.first = 0  # the first prompt batch this process published (the ones before it are settled)

    def batch(self, step: int) -> PromptBatch:
        index = self.schedule.indices(step)
        texts = [self.prompts.texts[i] for i in index]
        tokens, lengths = tokenize_prompts(
            self.tokenizer, texts, self.config.data.max_prompt_tokens, self.config.data.chat_template
        )
        lineage = {
            RUN_ID: self.config.run.run_id,
            "data.prompts": str(self.config.data.prompts),
            "data.seed": self.config.run.seed,
        }
        return PromptBatch(
            **new_header(f"{self.config.run.run_id}-{step:08d}", self.replica_id, 0, lineage),
            step=step,
            prompt_index=index,
            prompt_text=texts,
            prompt_label=[self.prompts.labels[i] for i in index],
            prompt_tokens=tokens,
            prompt_lengths=lengths,
        )

    @property
    def weight_models(self) -> tuple[str, ...]:
        return ("actor",)  # for the learner's progress in the announcements; no weights are loaded

    def start(self) -> list[PromptBatch]:
        return [] if self.new_log else self._publish(self.first_step())

    def _publish(self, first: int) -> list[PromptBatch]:
        last = self.config.prompt_batches - 1
        batches = [self.batch(step) for step in range(first, last + 1)]
        self.published, self.first, self.replaced = True, first, 0
        log.info("%s: publishing prompt batches %d..%d", self.replica_id, first, last)
        return batches + self._replacements()

    def _replacements(self) -> list[PromptBatch]:
        """The prompt batches past the run's own that the learner asked for and this process has not published (those
        a predecessor published and the learner settled excepted): groups dropped as too stale, replaced by the next
        prompts of the schedule (pipeline.stale_reserve)."""
        start = self.config.prompt_batches
        steps = [s for s in range(start + self.replaced, start + self.replacements) if s >= self.first]
        self.replaced = self.replacements
        if steps:
            log.info("%s: publishing prompt batches %d..%d in place of groups dropped as too stale", self.replica_id,
                     steps[0], steps[-1])  # fmt: skip
        return [self.batch(step) for step in steps]

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        settled = int(announcement.lineage.get(LEARNER_SETTLED, 0))
        self.replacements = max(self.replacements, int(announcement.lineage.get(LEARNER_REPLACEMENTS, 0)))
        self.learner_done = (
            announcement.policy_version >= self.config.run.steps
            or settled >= self.config.prompt_batches + self.replacements
        )
        if self.new_log:
            self.republish_from = settled
        return True

    def tick(self) -> list[PromptBatch]:
        if self.new_log:
            if self.republish_from is None:
                return []
            self.new_log = False
            return self._publish(self.republish_from)
        return self._replacements() if self.published and self.replacements > self.replaced else []

    def take_up_new_log(self) -> bool:
        # The learner announces on the new log once it has checkpointed: what it settled then is what stays settled.
        self.new_log, self.republish_from, self.published = True, None, False
        return True

    def first_step(self) -> int:
        """0, or with ``run.resume`` the first prompt batch the learner's last checkpoint has not settled. Groups of
        it that the checkpoint holds (or trained) are recognised by their keys when they come again."""
        checkpoint = load_latest_checkpoint(self.config.checkpoint_dir)
        if checkpoint is None:
            return 0
        meta = checkpoint[1]
        # A checkpoint from before the ledger: one update trained one whole prompt batch.
        settled = meta["ledger"]["below"] if "ledger" in meta else meta["updates"]
        if self.config.run.resume:
            return settled
        if settled:
            log.warning(
                "%s: the learner has a checkpoint and resumes from it; with --resume the feeder would skip the %d "
                "prompt batches it settled",
                self.replica_id,
                settled,
            )
        return 0

    def process(self, message):
        raise TypeError("the feeder consumes nothing")

    def done(self) -> bool:
        return self.published and self.learner_done
