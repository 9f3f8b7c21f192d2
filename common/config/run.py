"""The run config whole (:class:`RunConfig`): its sections, the checks that span several of them, and the counts
derived from them (groups per update, prompt batches, replacements); the run section itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from common.algorithms import (
    CRITIC_SETTINGS,
    ESTIMATORS,
    KINDS,
)
from common.config.base import Section
from common.config.delivery import (
    KafkaSection,
    PipelineSection,
    WeightsSection,
)
from common.config.episodes import EnvironmentSection, GatewaySection
from common.config.sampling import (
    DataSection,
    GenerationSection,
    ModelSection,
    RewardSection,
)
from common.config.training import AlgorithmSection, EvalSection, LearnerSection


class TrackingOptions(Section):
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI: a server (http://...) or a database (sqlite:///...); "
        "default sqlite:///<run.dir>/mlflow.db.",
    )
    project: str = Field("streamppo", min_length=1, description="The MLflow experiment and the W&B project.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B writes <run.dir>/wandb only (`wandb sync` uploads it later)."
    )


class RunSection(Section):
    dir: Path = Field(Path("runs/default"), description="Run directory: metrics, weight store, final model.")
    seed: int = Field(0, description="Seeds the prompt order, the models built locally, sampling and training.")
    steps: int = Field(20, gt=0, description="PPO updates to run (each on learner.groups_per_update groups).")
    run_id: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Prefix of every batch_id.")
    resume: bool = Field(
        False,
        description="Continue from the learner's last checkpoint (`--resume`): the feeder "
        "publishes only the steps after it, e.g. on a new, empty broker.",
    )
    archive_log: bool = Field(
        False,
        description="At the end of an embedded run (`streamppo run`), write its log to <run.dir>/log for "
        "`streamppo trace`, `export` and `rescore`: the in-memory bus ends with the process. A run on a broker is "
        "archived with `streamppo archive`.",
    )
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        [],
        description="Where the learner also sends each update's statistics (the lines of metrics.jsonl), with the "
        "run's config as parameters and the final models and report as artifacts.",
    )
    tracking: TrackingOptions = TrackingOptions()

    @model_validator(mode="after")
    def _trackers_once(self):
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"trackers {self.trackers} names one twice")
        return self


DType = Literal["float32", "bfloat16", "float16"]


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelSection
    data: DataSection
    generation: GenerationSection = GenerationSection()
    reward: RewardSection
    algorithm: AlgorithmSection = AlgorithmSection()
    learner: LearnerSection = LearnerSection()
    pipeline: PipelineSection = PipelineSection()
    weights: WeightsSection = WeightsSection()
    kafka: KafkaSection = KafkaSection()
    environment: EnvironmentSection | None = Field(
        None, description="Multi-turn episodes with an environment (tools); none: each response is one answer."
    )
    gateway: GatewaySection | None = Field(
        None,
        description="Episodes run by agents you already have, through an OpenAI-compatible gateway (every call on "
        "the log); none: the generator samples each response itself.",
    )
    eval: EvalSection | None = Field(
        None, description="Held-out prompts scored while the run trains (the evaluator role); none: no evaluation."
    )

    def signing_key(self) -> bytes | None:
        """The key every message of the run is signed with (:meth:`PipelineSection.signing_key`), or None."""
        return self.pipeline.signing_key(self.run.dir)

    @property
    def episodes(self) -> bool:
        """Whether responses are multi-turn episodes with a reward of their own (environment_reward): an environment's,
        or what an agent posted through a gateway."""
        return self.environment is not None or self.gateway is not None

    @property
    def max_response_tokens(self) -> int:
        """The longest a response can be: one answer's generation.max_new_tokens, or an episode's budget (the model's
        and the environment's tokens)."""
        if self.gateway is not None:
            return self.gateway.max_episode_tokens
        env = self.environment
        if env is None:
            return self.generation.max_new_tokens
        return env.max_episode_tokens or env.max_turns * self.generation.max_new_tokens

    @model_validator(mode="after")
    def _batch_sizes_fit(self):
        rollouts = self.groups_per_update * self.generation.n
        if self.learner.mini_batch_size > rollouts and "mini_batch_size" not in self.learner.model_fields_set:
            # The default does not stop a config that only made the batch smaller: the update is one mini-batch.
            # (Sections are frozen once made; this is their making. Left unset, a dump leaves it out again.)
            object.__setattr__(self.learner, "mini_batch_size", rollouts)
        if self.learner.mini_batch_size > rollouts:
            raise ValueError(
                f"learner.mini_batch_size ({self.learner.mini_batch_size}) exceeds the responses per update "
                f"(learner.groups_per_update, default data.batch_size, × generation.n = {rollouts})"
            )
        micro = self.learner.micro_batch_size
        if micro is not None and self.learner.mini_batch_size % micro:
            raise ValueError("learner.mini_batch_size must be a multiple of learner.micro_batch_size")
        if micro is not None and self.learner.max_tokens_per_microbatch is not None:
            raise ValueError("set learner.micro_batch_size or learner.max_tokens_per_microbatch, not both")
        parallel = self.learner.parallel
        if parallel.strategy == "fsdp" and self.learner.mini_batch_size < parallel.processes:
            raise ValueError(
                f"learner.mini_batch_size ({self.learner.mini_batch_size}) is smaller than the learner's ranks "
                f"(learner.parallel.processes = {parallel.processes}): some ranks would train on nothing"
            )
        return self

    @model_validator(mode="after")
    def _settings_fit_the_variants(self):
        """Derived from the declarations (:mod:`common.algorithms`): no setting that the chosen variants do not read,
        no critic setting without a critic, groups for a group estimator."""
        unread = [name for kind in KINDS for name in kind.unread_settings(self._section(kind.section))]
        estimator = ESTIMATORS.chosen(self.algorithm)
        if not estimator.uses_critic:
            unread += [name for name in CRITIC_SETTINGS if self._explicit(name)]
        if unread:
            raise ValueError(
                f"{', '.join(unread)} {'is' if len(unread) == 1 else 'are'} set, but no chosen variant reads "
                f"{'it' if len(unread) == 1 else 'them'} (algorithm.estimator {estimator.name}"
                f"{'' if estimator.uses_critic else ', which runs without a critic'}): remove "
                f"{'it' if len(unread) == 1 else 'them'}"
            )
        if estimator.needs_groups and self.generation.n < 2:
            raise ValueError(
                f"algorithm.estimator {estimator.name} compares the responses to one prompt: "
                f"generation.n must be at least 2 (it is {self.generation.n})"
            )
        if estimator.needs_kl_in_reward and self.algorithm.kl_in != "reward":
            raise ValueError(
                f"algorithm.estimator {estimator.name} learns from the KL in the token rewards: algorithm.kl_in must "
                "be reward"
            )
        if self.algorithm.dynamic_sampling and not estimator.needs_groups:
            raise ValueError(
                f"algorithm.dynamic_sampling drops groups whose scores are all equal, which a group estimator gives "
                f"no advantage; algorithm.estimator {estimator.name} is not one (its advantages do not come from the "
                "group)"
            )
        if self._explicit("algorithm.overlong_penalty") and self.algorithm.overlong_buffer is None:
            raise ValueError("algorithm.overlong_penalty is set, but only algorithm.overlong_buffer reads it")
        if (self.algorithm.overlong_buffer or 0) >= self.max_response_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must be shorter than "
                f"generation.max_new_tokens ({self.generation.max_new_tokens}): the penalty starts that many tokens "
                "before the limit"
            )
        if self._explicit("algorithm.max_sampling_factor") and not self.algorithm.dynamic_sampling:
            raise ValueError("algorithm.max_sampling_factor is set, but only algorithm.dynamic_sampling reads it")
        env = self.environment
        if env is not None and env.placement == "bus" and not self.generation.streaming:
            raise ValueError(
                "environment.placement bus needs generation.streaming: true (a generator that samples whole batches "
                "would hold its batch while the environment replicas answer); or set environment.placement: local"
            )
        if self.gateway is not None and env is not None:
            raise ValueError(
                "gateway and environment are two ways to run episodes: with a gateway your agent owns the loop (its "
                "tools included); set one of them"
            )
        if self.gateway is not None and not self.generation.streaming:
            raise ValueError(
                "gateway needs generation.streaming: true (the generators answer the agents' calls as they come, "
                "many at once)"
            )
        for name in ("groups_per_record", "flush_s", "in_flight_updates"):
            if self._explicit(f"generation.{name}") and not self.generation.streaming:
                raise ValueError(f"generation.{name} is set, but only generation.streaming reads it")
        if not self.generation.streaming and self.groups_per_update % self.data.batch_size:
            raise ValueError(
                f"learner.groups_per_update ({self.groups_per_update}) is not a multiple of data.batch_size "
                f"({self.data.batch_size}): without generation.streaming a prompt batch is sampled whole, by one "
                "policy, and the groups of a batch split across updates would be trained past max_staleness; stream, "
                "or make updates of whole prompt batches"
            )
        return self

    def _section(self, path: str):
        section = self
        for name in path.split("."):
            section = getattr(section, name)
        return section

    def _explicit(self, setting: str) -> bool:
        """Whether ``setting`` ("section.key") was given in the file or an override, not left at its default."""
        parent, _, name = setting.rpartition(".")
        return name in self._section(parent).model_fields_set

    @model_validator(mode="after")
    def _batches_fit_a_record(self):
        # A reference record is a few hundred bytes; a batch just under the limit must still fit a record.
        if self.pipeline.inline_max_bytes > self.kafka.max_message_bytes - 64 * 1024:
            raise ValueError(
                f"pipeline.inline_max_bytes ({self.pipeline.inline_max_bytes}) must leave 64 KiB below "
                f"kafka.max_message_bytes ({self.kafka.max_message_bytes}): a batch that travels inline must fit a "
                "record"
            )
        return self

    @model_validator(mode="after")
    def _weight_flow_fits(self):
        parallel = self.learner.parallel
        if self.model.lora is not None and parallel.strategy == "fsdp":
            raise ValueError("model.lora trains on one process: set learner.parallel.strategy=single")
        if self.weights.broadcast.address is not None and self.model.lora is not None:
            raise ValueError("weights.broadcast is for whole models: LoRA adapters (a few MB) go by the store")
        if parallel.strategy == "fsdp" and parallel.processes > 1 and self.weights.full_every > 1:
            raise ValueError(
                "weights.full_every > 1 (delta snapshots) needs the whole state on one process: a learner of "
                "several ranks writes sharded full snapshots; set weights.full_every=1"
            )
        return self

    @property
    def groups_per_update(self) -> int:
        """Groups (prompts, each with its ``generation.n`` responses) one learner update trains on."""
        return self.learner.groups_per_update or self.data.batch_size

    @property
    def prompt_batches(self) -> int:
        """Prompt batches the feeder publishes: enough groups for ``run.steps`` updates, times
        ``algorithm.max_sampling_factor`` with dynamic sampling (groups without signal are not trained)."""
        groups = self.run.steps * self.groups_per_update
        if self.algorithm.dynamic_sampling:
            groups = math.ceil(groups * self.algorithm.max_sampling_factor)
        return -(-groups // self.data.batch_size)

    @property
    def replacement_batches(self) -> int:
        """The most prompt batches published past :attr:`prompt_batches` to replace groups dropped as too stale."""
        return math.ceil(self.prompt_batches * self.pipeline.stale_reserve)

    def replacements_for(self, dropped_stale: int) -> int:
        """Prompt batches that replace ``dropped_stale`` groups (each batch holds ``data.batch_size``), within the
        reserve."""
        return min(self.replacement_batches, -(-dropped_stale // self.data.batch_size))

    @property
    def steps_possible(self) -> int:
        """Steps a real prompt batch of the run can have: its own and the replacements'."""
        return self.prompt_batches + self.replacement_batches

    @property
    def namespace(self) -> str:
        """What the run's topics and consumer groups are prefixed with on the broker."""
        return self.kafka.namespace or self.run.run_id

    @property
    def weight_store(self) -> Path:
        return self.pipeline.weight_store or self.run.dir / "weights"

    @property
    def batch_store(self) -> Path:
        return self.pipeline.batch_store or self.run.dir / "batches"

    def batch_retention(self, topic: str) -> tuple[float | None, int | None]:
        """``(seconds, bytes)`` the batch store keeps ``topic``'s files: its records' retention, the bytes summed
        over its partitions."""
        hours, size = self.kafka.retention.of(topic)
        return (None if hours is None else hours * 3600, None if size is None else size * self.kafka.partitions)

    @property
    def checkpoint_dir(self) -> Path:
        return self.learner.checkpoint_dir or self.run.dir / "checkpoints"
