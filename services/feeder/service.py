"""feeder: dataset → prompts. Publishes tokenized prompt batches ``0 .. steps−1``, then is done.

It consumes nothing: its whole output is what :meth:`FeederService.start` returns. With ``run.resume``
(``--resume``) it starts at the step after the learner's last checkpoint, as after the loss of a broker's data.
Batch ids are a function of the run id and the step, so re-publishing after a restart produces duplicates that
every consumer recognises.
"""

from __future__ import annotations

import logging

from common.checkpoint import latest_checkpoint_version
from common.config import RunConfig
from common.data import PromptSchedule, load_prompts, tokenize_prompts
from common.models import load_tokenizer, resolve_model
from common.schema import RUN_ID, PromptBatch, new_header
from services.service import Service

log = logging.getLogger(__name__)


class FeederService(Service):
    role = "feeder"

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        self.prompts = load_prompts(config.data.prompts)
        path = resolve_model(config.model.actor, config.model.cache_dir)
        self.tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        self.schedule = PromptSchedule(len(self.prompts), config.data.batch_size, config.data.shuffle, config.run.seed)
        self.published = False

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

    def start(self) -> list[PromptBatch]:
        first = self.first_step()
        batches = [self.batch(step) for step in range(first, self.config.run.steps)]
        self.published = True
        log.info("%s: publishing prompt batches %d..%d", self.replica_id, first, self.config.run.steps - 1)
        return batches

    def first_step(self) -> int:
        """0, or with ``run.resume`` the step after the learner's last checkpoint (update v trains on step v)."""
        checkpoint = latest_checkpoint_version(self.config.checkpoint_dir)
        if self.config.run.resume:
            return checkpoint or 0
        if checkpoint:
            log.warning(
                "%s: the learner has a checkpoint at v%d and resumes from it; with --resume the feeder would "
                "skip the %d steps already applied",
                self.replica_id,
                checkpoint,
                checkpoint,
            )
        return 0

    def process(self, message):
        raise TypeError("the feeder consumes nothing")

    def done(self) -> bool:
        return self.published
