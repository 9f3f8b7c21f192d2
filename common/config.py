"""Typed run configuration, validated at start-up.

A run is described by one YAML file; ``--set section.key=value`` overrides any entry. Unknown keys and bad values
are errors that name the field (``learner.actor_lr: Input should be greater than 0``), raised as
:class:`ConfigError` before any model is loaded.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import secrets
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.algorithms import (
    CRITIC_SETTINGS,
    ESTIMATORS,
    KINDS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    Kind,
)
from common.schema import TOPIC_MESSAGE, BatchMessage

__all__ = ["ConfigError", "RunConfig", "load_config"]


class ConfigError(ValueError):
    """The configuration is invalid; the message names every bad field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrackingOptions(_Section):
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI: a server (http://...) or a database (sqlite:///...); "
        "default sqlite:///<run.dir>/mlflow.db.",
    )
    project: str = Field("streamppo", min_length=1, description="The MLflow experiment and the W&B project.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B writes <run.dir>/wandb only (`wandb sync` uploads it later)."
    )


class RunSection(_Section):
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


class ModelDtypes(_Section):
    """Per-model dtypes (bf16 on GPUs); unset ones take ``model.dtype``. The learner keeps fp32 master weights
    whatever the actor's and critic's dtype: under FSDP these set the compute dtype of its mixed precision."""

    actor: DType | None = Field(None, description="The actor's dtype (default: model.dtype).")
    critic: DType | None = Field(None, description="The critic's dtype (default: model.dtype).")
    reference: DType | None = Field(None, description="The reference model's dtype (default: model.dtype).")
    reward: DType | None = Field(None, description="The reward model's (or judge's) dtype (default: model.dtype).")


class LoraOptions(_Section):
    """Train low-rank adapters on the actor (peft's LoRA) instead of all its weights: the learner trains, checkpoints
    and publishes the adapters alone; the generators keep the base weights and swap adapters."""

    rank: int = Field(8, gt=0, description="r of the adapters: each adapted matrix gains r × (in + out) weights.")
    alpha: float = Field(16.0, gt=0, description="Scale: the update is alpha / rank · B·A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input in training.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, description="Names of the linear layers adapted."
    )


class ModelSection(_Section):
    actor: str = Field(description="Local transformers folder, or 'builtin:<name>' for a model built locally.")
    reference: str | None = Field(None, description="Frozen reference model; default: the actor's initial weights.")
    critic: str | None = Field(None, description="Critic backbone; default: the actor's. A scalar head is added.")
    dtype: DType = Field("float32", description="Default dtype of every model; `model.dtypes` overrides it per model.")
    dtypes: ModelDtypes = ModelDtypes()
    lora: LoraOptions | None = Field(None, description="Train LoRA adapters on the actor; unset: all its weights.")
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?|mps)$",
        description="Where the transformers models run (the vLLM engine places itself). 'cuda' for a GPU.",
    )
    trust_remote_code: bool = Field(False, description="Run the model folder's own Python code (transformers).")
    cache_dir: Path = Field(Path.home() / ".cache" / "streamppo", description="Where builtin models are built.")
    max_tokens_per_microbatch: int | None = Field(
        None,
        gt=0,
        description="Token budget of one inference forward pass (the scorer's reference model, the advantage "
        "service's critic): rows sorted by length, grouped while rows × longest row fits. Default: the whole batch.",
    )

    def dtype_of(self, model: Literal["actor", "critic", "reference", "reward"]) -> DType:
        return getattr(self.dtypes, model) or self.dtype


class DataSection(_Section):
    prompts: Path = Field(
        description="JSONL file, one object per line with a 'prompt' string and optionally a 'label' string (what a "
        "reward function of (prompts, responses, labels) checks)."
    )
    batch_size: int = Field(8, gt=0, description="Prompts per step.")
    shuffle: bool = Field(True, description="Shuffle the prompts each epoch (seeded by run.seed).")
    max_prompt_tokens: int = Field(64, gt=0, description="Longer prompts are truncated from the left.")
    chat_template: bool = Field(
        False, description="Wrap each prompt as a user turn with the tokenizer's chat template (instruct models)."
    )
    eval_prompts: int = Field(
        8,
        ge=0,
        description="The first N prompts, answered greedily by the actor before and "
        "after training: <run.dir>/generations.md.",
    )


class VllmOptions(_Section):
    kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description="Memory the engine reserves for its KV cache, in GiB (host "
        "memory on CPU). Set explicitly rather than as a fraction, so that several engines "
        "and the other services fit on one machine.",
    )
    enforce_eager: bool = Field(True, description="No CUDA graphs / torch.compile: faster start, slower decode.")
    max_model_len: int | None = Field(None, gt=0, description="Default: the model's own limit.")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs one engine shards the actor over.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of each GPU the engine may use (weights, activations and KV cache); replaces "
        "kv_cache_gib when set. GPU only.",
    )
    dtype: DType | None = Field(None, description="The engine's dtype; default: the actor's (`model.dtypes.actor`).")
    max_loras: int = Field(
        1,
        gt=0,
        description="With LoRA: adapters one engine step may use. The LoRA runs a fleet's generator replica serves "
        "share one engine; requests of an adapter without a slot wait for one, and an adapter evicted from the "
        "engine's memory is loaded again from its folder when a request needs it.",
    )


class GenerationSection(_Section):
    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="'auto' is vLLM when it is installed, else transformers (logged)."
    )
    vllm: VllmOptions = VllmOptions()
    n: int = Field(4, gt=0, description="Responses sampled per prompt.")
    max_new_tokens: int = Field(32, gt=0, description="Tokens per response at most (per model turn of an episode).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; every log-prob is of this distribution.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling's mass; 1: off.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    streaming: bool = Field(
        False,
        description="Admit prompt batches continuously and send groups on as they are sampled (each prompt's n "
        "responses by the weights loaded then), instead of one record per prompt batch.",
    )
    groups_per_record: int = Field(
        1,
        gt=0,
        description="With streaming: finished groups (of one prompt batch) sent together as one record, at most.",
    )
    flush_s: float = Field(
        1.0,
        gt=0,
        description="With streaming: the longest a finished group waits for others to share its record.",
    )
    in_flight_updates: Literal["keep", "recompute", "finish"] = Field(
        "recompute",
        description="With streaming on vLLM, what new weights do to the responses being sampled. keep: they go on "
        "with the cache the old weights computed (tokens from then on are the new version's, but their context was "
        "encoded by the old: only the off-policy correction accounts for it); recompute: their cache is computed "
        "again by the new weights, so every token comes from the one version it is labelled with; finish: new "
        "weights wait until the responses in flight are done, and no new ones start meanwhile.",
    )


JUDGE_TEMPLATE = (
    "Rate how well the answer answers the question, from 0 (wrong) to 10 (right). Reply with the number only.\n\n"
    "Question: {prompt}\nReference answer: {label}\nAnswer: {response}"
)


class JudgeSection(_Section):
    """A generative reward: a language model reads the prompt, the answer and the label, and writes a score."""

    model: str = Field(description="The judge: a local causal LM folder, or 'builtin:<name>'.")
    template: str = Field(
        JUDGE_TEMPLATE, description="The judge's prompt; {prompt}, {response} and {label} are filled in."
    )
    chat: bool = Field(True, description="Wrap the prompt in the judge's chat template (an instruct model).")
    pattern: str = Field(
        r"(-?\d+(?:\.\d+)?)", description="Regular expression whose first group, in its first match, is the score."
    )
    on_unparsed: Literal["default", "dead_letter"] = Field(
        "default",
        description="A judge's text without a score: default: that answer gets default_score; dead_letter: its batch "
        "goes to the dead letters. Counted either way.",
    )
    default_score: float = Field(
        0.0, description="The score of an answer the judge wrote no score for (on_unparsed: default)."
    )
    max_new_tokens: int = Field(8, gt=0, description="The most the judge writes per answer (greedy).")
    backend: Literal["auto", "vllm", "transformers"] = Field("auto", description="auto: vLLM where installed.")
    kv_cache_gib: float = Field(0.25, gt=0, description="With vLLM: the judge engine's KV cache.")
    max_model_len: int = Field(
        2048, gt=0, description="With vLLM: the longest judge prompt plus text; its KV cache must hold one."
    )

    @model_validator(mode="after")
    def _template_and_pattern_work(self):
        try:
            self.template.format(prompt="", response="", label="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template may name only {{prompt}}, {{response}} and {{label}}: {exc!r}") from None
        if "{response}" not in self.template:
            raise ValueError("template must show the judge the answer: it has no {response}")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as exc:
            raise ValueError(f"pattern is not a regular expression: {exc}") from None
        if groups < 1:
            raise ValueError("pattern needs a group around the score, e.g. 'Score: (\\d+)'")
        return self


class SandboxSection(_Section):
    """Where a tool runs a model's Python code (``services/environment/sandbox.py``)."""

    isolation: Literal["auto", "bwrap", "rlimits"] = Field(
        "auto",
        description="bwrap: namespaces (no network, read-only file system outside the scratch folder, no host "
        "process visible); rlimits: resource limits and a Python audit hook only (escapable: for trusted code); auto: "
        "bwrap, and where it is not installed or cannot make its namespaces the service refuses to start, saying why "
        "(never rlimits unasked).",
    )
    python: str | None = Field(
        None, description="The interpreter that runs the code; default /usr/bin/python3 where it exists."
    )
    cpu_seconds: float = Field(2.0, gt=0, description="CPU time per run (RLIMIT_CPU).")
    wall_seconds: float = Field(5.0, gt=0, description="Wall-clock time per run; then every process of it is killed.")
    memory_mb: int = Field(512, ge=32, description="Address space per process (RLIMIT_AS).")
    output_bytes: int = Field(
        8192, gt=0, description="Output kept, and the most any file the code writes may hold (RLIMIT_FSIZE)."
    )
    processes: int = Field(
        16,
        gt=0,
        description="Processes one run may have at once (RLIMIT_NPROC of a user of the run's own: applied where the "
        "service runs as root, which can give each run its own unprivileged user).",
    )


class OpenEnvSection(_Section):
    """An OpenEnv environment (``openenv-core``) run in process, each episode its own instance
    (``services/environment/adapters.py``)."""

    environment: str = Field(
        description="'module:Class': an OpenEnv environment (a subclass of openenv.core.env_server.interfaces"
        ".Environment)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments its constructor is called with.")
    action: str | None = Field(
        None,
        description="'module:Class': its action type (an openenv Action); default: the annotation of its step's "
        "action, or its generic argument.",
    )
    action_field: str | None = Field(
        None, description="The action's field the model's turn (its text) fills; default: its only string field."
    )
    action_parser: str | None = Field(
        None,
        description="'module:function' making the action from the turn's text, for actions that are more than text "
        "(instead of action and action_field).",
    )
    observation_field: str | None = Field(
        None,
        description="The observation's field the model reads; default: its one field besides done, reward and "
        "metadata where that is a string, else those fields as JSON.",
    )
    observation_format: str = Field(
        "\n{observation}\n", description="How the observation's text is set in the episode ({observation})."
    )
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a model turn besides EOS (kept in the turn's text)."
    )

    @model_validator(mode="after")
    def _one_way_to_act(self):
        if self.action_parser is not None and (self.action is not None or self.action_field is not None):
            raise ValueError("set action_parser, or action/action_field, not both")
        if "{observation}" not in self.observation_format:
            raise ValueError("observation_format must hold {observation}")
        return self


OPENENV_ADAPTER = "services.environment.adapters:OpenEnvEnvironment"


class EnvironmentSection(_Section):
    """Multi-turn episodes: what the model talks to between its turns (``services/environment/``)."""

    name: str = Field(
        "services.environment.tools:ToolEnvironment",
        description="The environment class, 'module:Class' (a services.environment.base.Environment); the default "
        "serves the built-in tools.",
    )
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"], description="The built-in tools the default environment serves."
    )
    max_turns: int = Field(4, gt=0, description="The model's turns per episode at most; then it ends truncated.")
    max_episode_tokens: int | None = Field(
        None,
        gt=0,
        description="Response tokens per episode at most, the model's and the environment's (default: "
        "max_turns × generation.max_new_tokens); an episode that reaches it ends truncated.",
    )
    turn_timeout_s: float = Field(
        30.0, gt=0, description="How long an environment may take to answer a turn; then the episode ends truncated."
    )
    timeout_reward: float = Field(0.0, description="The environment's reward for an episode ended by a timeout.")
    placement: Literal["bus", "local"] = Field(
        "bus",
        description="bus: environment replicas (streamppo environment) answer the turns over the turns and "
        "observations topics; local: the generator steps the environments in threads of its own process.",
    )
    workers: int = Field(4, gt=0, description="With placement local: environment steps run at once (threads).")
    sandbox: SandboxSection = SandboxSection()
    openenv: OpenEnvSection | None = Field(
        None, description=f"An OpenEnv environment to serve (environment.name is then {OPENENV_ADAPTER})."
    )

    @model_validator(mode="before")
    @classmethod
    def _openenv_names_its_adapter(cls, data):
        if isinstance(data, dict) and data.get("openenv") is not None and "name" not in data:
            data = {**data, "name": OPENENV_ADAPTER}
        return data

    @model_validator(mode="after")
    def _openenv_fits(self):
        if self.openenv is not None and self.name != OPENENV_ADAPTER:
            raise ValueError(f"environment.openenv is read by {OPENENV_ADAPTER} alone; environment.name is {self.name}")
        if self.openenv is None and self.name == OPENENV_ADAPTER:
            raise ValueError(f"environment.name {OPENENV_ADAPTER} needs environment.openenv")
        if self.openenv is not None and "tools" in self.model_fields_set:
            raise ValueError("environment.tools configures the built-in tools; an OpenEnv environment brings its own")
        return self


class AgentSection(_Section):
    """The agent that runs each episode of a gateway run (``services/gateway/agents.py``): a function of yours."""

    function: str | None = Field(
        None,
        description="'module:function' called with each episode (services.gateway.agents.Episode: its base_url, "
        "api_key, prompt and label); it talks to the model through any OpenAI client at the episode's base URL. A "
        "number it returns is the episode's reward; None leaves the reward to what it posted, or to "
        "gateway.unrewarded. Required with placement local; with remote, `streamppo agents` takes it (or --function).",
    )
    workers: int = Field(8, gt=0, description="Episodes run at once (threads).")
    placement: Literal["local", "remote"] = Field(
        "local",
        description="local: threads of each gateway replica run the episodes it hands out; remote: nothing in the run "
        "starts agents: `streamppo agents` (or any client of POST /episodes/claim) runs them elsewhere.",
    )

    @model_validator(mode="after")
    def _a_local_agent_is_named(self) -> AgentSection:
        if self.placement == "local" and not self.function:
            raise ValueError("gateway.agent.function is required with placement local (the gateway runs the agent)")
        return self


class GatewaySection(_Section):
    """An OpenAI-compatible gateway (``services/gateway/``): agents written for any OpenAI client run each episode,
    and every call they make is sampled by the generator fleet and written to the log before it is answered."""

    host: str = Field("127.0.0.1", description="The address the gateway's HTTP server binds.")
    port: str = Field(
        "8400-8431",
        pattern=r"^\d+(-\d+)?$",
        description="A port, or a range FIRST-LAST: each replica serves on the first free one (0: any free port).",
    )
    public_url: str | None = Field(
        None, description="The URL agents reach a replica at, which base URLs are made of; default http://HOST:PORT."
    )
    model_name: str | None = Field(
        None, description="The model's name in /v1/models and in answers; default: the actor folder's name."
    )
    call_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A client that has waited this long for a call's answer gets a retryable error (503 with "
        "Retry-After; OpenAI's clients time out at 600 s); the call goes on, and the client's retry gets its answer.",
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, description="An episode with no call, reward or end for this long ends (outcome timed_out)."
    )
    unrewarded: Literal["dead_letter", "score", "reward"] = Field(
        "dead_letter",
        description="What becomes of an episode that ends without a reward posted (the agent ended it without one, "
        "failed, or it timed out): dead_letter: not trained, its rows written to episodes.dlq; score: trained on the "
        "run's reward section's score alone (a verifiable reward on the answer); reward: trained with "
        "unrewarded_reward as what the agent would have posted. Each is counted by outcome.",
    )
    unrewarded_reward: float = Field(0.0, description="With unrewarded: reward, the reward such an episode gets.")
    max_calls: int = Field(64, gt=0, description="Calls per episode at most; one more is refused (400).")
    max_episode_tokens: int = Field(
        4096,
        gt=0,
        description="Tokens of an episode's row after its first prompt at most (the model's and the conversation's); "
        "a call whose prompt and max_tokens would pass it is refused (400, context_length_exceeded).",
    )
    max_request_bytes: int = Field(1 << 20, gt=0, description="The largest request body accepted (413 past it).")
    agent: AgentSection | None = Field(
        None,
        description="The agent the run starts for each episode; none: agents "
        "claim episodes over HTTP (POST /episodes/claim).",
    )

    @field_validator("port", mode="before")
    @classmethod
    def _port_as_text(cls, port):
        return str(port) if isinstance(port, int) and not isinstance(port, bool) else port

    @model_validator(mode="after")
    def _reward_only_for_reward(self):
        if "unrewarded_reward" in self.model_fields_set and self.unrewarded != "reward":
            raise ValueError("gateway.unrewarded_reward is read only with gateway.unrewarded: reward")
        return self


class RewardSection(_Section):
    function: str | None = Field(None, description="'module:function' taking (prompts, responses) -> scores.")
    model: str | None = Field(None, description="Sequence-classification reward model folder (one label).")
    judge: JudgeSection | None = Field(None, description="A language model that reads each answer and writes a score.")
    batch_size: int = Field(16, gt=0, description="Responses the reward model, function or judge scores at once.")
    on_error: Literal["stop", "dead_letter"] = Field(
        "stop",
        description="What a reward that fails (a function that raises, or gives no finite score per response; a judge "
        "or reward model that cannot score) does to the run: stop (the error names the reward, the batch and the "
        "input it failed on), or dead_letter (the batch is set aside on rollouts.dlq with that error, counted; the "
        "run goes on).",
    )
    environment_weight: float = Field(
        1.0,
        description="An episode's score is the reward's plus this times its own reward (environment_reward: what "
        "its environment returned, or what its agent posted through a gateway; 0 for a single answer). With "
        "recipes.rewards:no_score that alone scores.",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self):
        if sum(source is not None for source in (self.function, self.model, self.judge)) != 1:
            raise ValueError("set exactly one of reward.function, reward.model and reward.judge")
        return self


class AdaptiveKL(_Section):
    target: float = Field(6.0, gt=0, description="Target KL per sequence (sum over tokens).")
    horizon: int = Field(10000, gt=0, description="Sequences over which β moves by at most 20%.")


def _declared(kind: Kind):
    """A setting that names a declared variant of ``kind`` (:mod:`common.algorithms`), described by the declarations."""
    return Annotated[str, AfterValidator(kind.check)]


class AlgorithmSection(_Section):
    estimator: _declared(ESTIMATORS) = Field("gae", description=ESTIMATORS.describe())
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of later token rewards (1: none, the LLM default).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (gae only).")
    kl_estimator: _declared(KL_ESTIMATORS) = Field("k1", description=KL_ESTIMATORS.describe())
    kl_coef: float = Field(0.05, ge=0, description="β of the KL penalty (initial β if adaptive).")
    kl_in: Literal["reward", "loss"] = Field(
        "reward",
        description="reward: −β·KL in every token's reward (PPO-RLHF); loss: β·KL(π‖π_ref) added to the policy loss "
        "with kl_estimator (k3 as in GRPO), the rewards carrying the score alone.",
    )
    adaptive_kl: AdaptiveKL | None = None
    whiten_advantages: bool = Field(
        True, description="Whiten GAE advantages over each batch (gae only: the other estimators normalise their own)."
    )

    @property
    def uses_critic(self) -> bool:
        return ESTIMATORS.chosen(self).uses_critic

    @property
    def whitens(self) -> bool:
        """Whether the learner whitens the advantages it receives."""
        return self.uses_critic and self.whiten_advantages

    score_clip: float | None = Field(None, gt=0, description="Scores clipped to [-score_clip, score_clip]; none: not.")
    missing_eos_penalty: float | None = Field(None, description="Subtracted from the score of truncated responses.")
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's overlong shaping: a response longer than generation.max_new_tokens − overlong_buffer "
        "tokens loses overlong_penalty × (its excess / overlong_buffer) of its score, the whole penalty at the limit.",
    )
    overlong_penalty: float = Field(1.0, gt=0, description="With overlong_buffer: the penalty at the length limit.")
    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose scores are all equal (zero advantage: they teach nothing) at the advantage "
        "stage, and keep sampling until every update has learner.groups_per_update informative groups (DAPO). Needs "
        "a group estimator.",
    )
    max_sampling_factor: float = Field(
        3.0,
        ge=1,
        description="With dynamic_sampling: at most this many times the groups the updates need are sampled (the "
        "feeder publishes that many prompt batches); a run that uses them all ends early and says so.",
    )


class ParallelOptions(_Section):
    """How the learner spreads over devices."""

    strategy: Literal["single", "fsdp"] = Field(
        "single", description="single: one process; fsdp: actor and critic sharded with torch's FSDP2."
    )
    processes: int = Field(
        1,
        gt=0,
        description="Ranks on this machine. With more than 1, `streamppo learner` starts them itself through "
        "torch's launcher; across machines run it under torchrun (README).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times in a row `streamppo learner` restarts all ranks after one dies, before it exits with an "
        "error (for its supervisor).",
    )

    @model_validator(mode="after")
    def _processes_need_a_strategy(self):
        if self.processes > 1 and self.strategy == "single":
            raise ValueError("processes > 1 needs strategy: fsdp")
        return self


Band = tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]]


class OffPolicy(_Section):
    """How the learner corrects for tokens sampled by another policy than π_old (``common.ppo.off_policy_weights``),
    from ``r = π_old / π_behaviour``."""

    applies_to: Literal["none", "stale", "all"] = Field(
        "stale",
        description="stale: tokens sampled by another version than π_old's; all: every token, as the sampler's "
        "numerics never match the learner's; none: no correction.",
    )
    token_cap: float | None = Field(2.0, ge=1, description="Truncated importance weight min(r, token_cap); null: 1.")
    token_band: Band | None = Field(None, description="[lo, hi]: a token whose r is outside gets weight 0 (IcePop).")
    sequence_band: Band | None = Field(
        None, description="[lo, hi]: a response whose product of r is outside gets weight 0 on every token."
    )
    geometric_band: Band | None = Field(
        None, description="[lo, hi]: a response whose geometric mean of r is outside gets weight 0 on every token."
    )

    @model_validator(mode="after")
    def _bands_are_ordered(self):
        for name in ("token_band", "sequence_band", "geometric_band"):
            band = getattr(self, name)
            if band is not None and not band[0] < 1.0 < band[1]:
                raise ValueError(f"{name} {list(band)} must hold 1 strictly inside: [lo < 1 < hi]")
        return self


class LearnerSection(_Section):
    groups_per_update: int | None = Field(
        None,
        gt=0,
        description="Groups (a prompt's n responses) one update trains on, taken as they arrive, oldest version "
        "first; default: data.batch_size (one prompt batch per update).",
    )
    ppo_epochs: int = Field(2, gt=0, description="Passes over each update's experience.")
    mini_batch_size: int = Field(
        16,
        gt=0,
        description="Sequences per optimizer step. Left unset, at most the responses per update (a smaller batch "
        "is then one mini-batch).",
    )
    micro_batch_size: int | None = Field(None, gt=0, description="Sequences per forward pass; default: the mini-batch.")
    actor_lr: float = Field(1e-5, gt=0, description="The actor's learning rate (AdamW).")
    critic_lr: float = Field(1e-5, gt=0, description="The critic's learning rate (AdamW).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="The learning rates over the run's updates (run.steps), set at each update: constant; linear "
        "to lr_min_ratio × lr at the last update (TRL's default, per optimizer step there); cosine down to it.",
    )
    lr_warmup_updates: int = Field(0, ge=0, description="Updates over which the rates rise linearly to their value.")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="Where linear and cosine end, as a share of the rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay, both models.")
    clip_low: float = Field(0.2, gt=0, lt=1, description="ε_low of the ratio clip.")
    clip_high: float = Field(0.2, gt=0, description="ε_high of the ratio clip.")
    dual_clip: float | None = Field(
        None, gt=1, description="Dual clip: the loss of a negative advantage at most c·|A|."
    )
    gspo_clip_low: float = Field(3e-4, gt=0, lt=1, description="ε_low of GSPO's clip of a response's ratio.")
    gspo_clip_high: float = Field(4e-4, gt=0, description="ε_high of GSPO's clip of a response's ratio.")
    value_clip: float | None = Field(0.2, gt=0, description="ε_v: the value loss clips V to V_old ± this; none: not.")
    value_coef: float = Field(1.0, gt=0, description="Scale of the critic's loss (it has its own optimizer).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus in the policy loss.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradients clipped to this norm; none: not clipped.")
    policy_loss: _declared(POLICY_LOSSES) = Field("ppo", description=POLICY_LOSSES.describe())
    loss_agg: _declared(LOSS_AGGREGATIONS) = Field(
        "token-mean", description="How per-token losses add up: " + LOSS_AGGREGATIONS.describe()
    )
    off_policy: OffPolicy = OffPolicy()
    checkpoint_dir: Path | None = Field(None, description="Default: <run.dir>/checkpoints.")
    checkpoint_every: int = Field(
        1,
        gt=0,
        description="Updates between checkpoints (and on shutdown). Input is "
        "committed at checkpoints only; a crash re-applies the updates since the last one.",
    )
    max_tokens_per_microbatch: int | None = Field(
        None,
        gt=0,
        description="Token budget of one forward/backward pass: each rank's rows of a mini-batch, sorted by "
        "length, grouped while rows × longest row fits (a row longer than the budget goes alone). Replaces "
        "micro_batch_size; the update is the same, within float rounding.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass: less memory, ~1/3 more compute.",
    )
    parallel: ParallelOptions = ParallelOptions()


class PipelineSection(_Section):
    max_staleness: int = Field(0, ge=0, description="0: strictly on-policy; k: generation may run k versions ahead.")
    stale_reserve: float = Field(
        0.5,
        ge=0,
        description="Groups dropped as too stale (an agent's episode that outlasted updates, a learner rolled back "
        "by a crash) are replaced by prompt batches past the run's own, published as the drops happen, up to this "
        "fraction of the run's prompt batches: a run still makes run.steps updates. 0: none (the run ends short).",
    )
    keep_snapshots: int = Field(3, gt=0, description="Weight snapshots kept per model in the weight store.")
    weight_store: Path | None = Field(None, description="Shared weight directory; default: <run.dir>/weights.")
    inline_max_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="A batch that encodes to more bytes travels by reference: written to the batch store, with a "
        "small record on its topic pointing to it. Above ~1 MB that hop is the faster one (benchmarks/RESULTS.md, "
        "section 9), and every record then fits a broker's default limit (Apache Kafka: 1 MB); a 7B experience "
        "batch is ~84 MB. At most kafka.max_message_bytes − 64 KiB.",
    )
    batch_store: Path | None = Field(
        None, description="Shared directory of batches sent by reference; default: <run.dir>/batches."
    )
    hold_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="A service that holds input (waiting for newer weights, or an earlier step) and handles nothing "
        "else for this long dead-letters the held record furthest ahead, so that what sits behind it in its "
        "partition can flow. Above the longest update a run can take.",
    )
    held_per_partition: int = Field(
        4,
        gt=0,
        description="Input records a service keeps aside per partition while it is not ready for them (a prompt "
        "batch waiting for newer weights, experience of a later step), reading on past them; with this many, the "
        "partition is paused. Input is committed only below the oldest record kept aside.",
    )
    dedupe_window: int = Field(
        4096,
        gt=0,
        description="Idempotency keys each replica remembers to recognise re-deliveries: prompt batch ids, and past "
        "the generator one key per group (the learner keeps them in its checkpoint, so a checkpoint never grows with "
        "the run). Keep it above the groups a crash can bring back: those in flight and since the last checkpoint.",
    )
    signing_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the run's signing key: every message a service "
        "publishes is signed with it (HMAC-SHA256), and what is unsigned or signed with another key is refused. "
        "Unset (and no signing_key_file): messages are not signed.",
    )
    signing_key_file: Path | None = Field(None, description="File whose content is the run's signing key.")
    run_key: bool = Field(
        False,
        description="Sign with a key made for the run when no signing_key_env or signing_key_file names one: the "
        "first service to start writes a random key to <run.dir>/signing.key (mode 0600), every other reads it. "
        "streamppo up, the compose file and the chart turn it on, so that a client of the broker cannot forge a "
        "record; false there is an unsigned run, which streamppo status shows.",
    )

    @model_validator(mode="after")
    def _one_key_source(self):
        if self.signing_key_env is not None and self.signing_key_file is not None:
            raise ValueError("set at most one of pipeline.signing_key_env and pipeline.signing_key_file")
        return self

    def signing_key(self, run_dir: Path | None = None) -> bytes | None:
        """The run's signing key, read now (ConfigError naming the variable or file when it cannot be); None when
        messages are not signed. With ``run_key`` and no other source, the run's own key in ``run_dir``, made by
        whoever asks first. Never logged."""
        if self.signing_key_env is None and self.signing_key_file is None:
            return _run_key(Path(run_dir)) if self.run_key and run_dir is not None else None
        return _secret(self.signing_key_env, self.signing_key_file, "pipeline signing key").encode()


class BroadcastSection(_Section):
    """The broadcast path: the learner sends each actor version straight to the generators (torch.distributed, gloo)
    besides writing it to the store, which late joiners and every fallback read."""

    address: str | None = Field(
        None,
        pattern=r"^\S+:\d{1,5}$",
        description="HOST:PORT where the learner's rank 0 listens for the generators (a port of its own, not "
        "torchrun's); unset: weights go by the store alone.",
    )
    receivers: int = Field(
        1,
        ge=1,
        description="How many receivers make the group: generator replicas (× generation.vllm.tensor_parallel_size "
        "with vLLM, whose every worker receives); the learner sends once all have joined.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for any step of a broadcast (a round to fill, a tensor to go): a receiver that "
        "died or hangs costs the learner this once, then the update goes by the store and a new group forms.",
    )


class WeightsSection(_Section):
    dtype: DType = Field(
        "float32",
        description="dtype of the actor and critic snapshots the learner publishes (bfloat16 halves them; the "
        "learner's master weights stay float32).",
    )
    digest: Literal["blake3", "sha256"] = Field(
        "blake3",
        description="Digest of each snapshot, named in its announcement: blake3 (multi-threaded, several times faster: "
        "benchmarks/RESULTS.md, section 5) "
        "or sha256. Readers check either.",
    )
    full_every: int = Field(
        1,
        ge=1,
        description="Write a full snapshot every this many versions and deltas (the changed elements) between; 1: "
        "always full. Pays with bfloat16 snapshots and small learning rates, where few elements change per update; "
        "float32 weights change everywhere, and a delta not under half the full size is written full anyway.",
    )
    broadcast: BroadcastSection = BroadcastSection()


class TopicRetention(_Section):
    hours: float | None = Field(None, gt=0, description="Hours this topic's records are kept; none: the default.")
    bytes: int | None = Field(None, gt=0, description="Per partition, as Kafka's retention.bytes.")


class RetentionSection(_Section):
    """How long the log is kept. Set on the data topics (and their dead letters) when streamppo creates them, and
    kept by the batch store for the files of batches that travel by reference: a record and its file go together."""

    hours: float | None = Field(
        168.0,
        gt=0,
        description="Kafka's retention.ms of the data topics, in hours (its default: 7 days); null: forever.",
    )
    bytes: int | None = Field(None, gt=0, description="Kafka's retention.bytes (per partition); null: no limit.")
    topics: dict[str, TopicRetention] = Field(
        {}, description="Per topic (prompts, rollouts, scored, experience), what differs from the above."
    )
    remove_committed_batches: bool = Field(
        False,
        description="Remove a referenced batch's file as soon as its reader commits past its record (the log then "
        "cannot replay or export that record): for disks that cannot keep a run's batches for its retention.",
    )

    @model_validator(mode="after")
    def _known_topics(self):
        data = [topic for topic, cls in TOPIC_MESSAGE.items() if issubclass(cls, BatchMessage)]
        unknown = sorted(set(self.topics) - set(data))
        if unknown:
            raise ValueError(f"retention of unknown topic(s) {unknown}; data topics: {data}")
        return self

    def of(self, topic: str) -> tuple[float | None, int | None]:
        """``(hours, bytes)`` for ``topic`` (a data topic or its dead letters)."""
        own = self.topics.get(topic.removesuffix(".dlq"))
        hours = own.hours if own is not None and own.hours is not None else self.hours
        size = own.bytes if own is not None and own.bytes is not None else self.bytes
        return hours, size


class KafkaSection(_Section):
    """How the services reach Kafka when they run as processes (``--bootstrap`` overrides ``bootstrap``)."""

    bootstrap: str | None = Field(None, description="HOST:PORT[,HOST:PORT]")
    namespace: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,180}$",
        description="Prefix of the run's topics and consumer groups (<namespace>.prompts, ...): runs of other "
        "namespaces on one cluster share nothing. Default: run.run_id.",
    )
    partitions: int = Field(4, gt=0, description="Partitions of the data topics when streamppo creates them.")
    replication_factor: int | None = Field(
        None,
        gt=0,
        description="Copies of each partition when streamppo creates its topics. Default: the brokers' "
        "default.replication.factor, but at least 3 on a cluster of 3 brokers or more (1 on one broker). Each topic "
        "gets min.insync.replicas 2 from 3 copies on (1 below): with the producers' acks=all a record is on two "
        "brokers before it counts as sent, and one broker's loss loses nothing.",
    )
    retention: RetentionSection = RetentionSection()
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0, description="The largest record the clients send or fetch.")
    session_timeout_ms: int = Field(
        6000,
        gt=0,
        description="How long a silent consumer keeps its partitions; "
        "Apache Kafka accepts ≥ 6000 unless its group.min.session.timeout.ms is lowered.",
    )
    heartbeat_interval_ms: int = Field(1000, gt=0, description="How often a consumer tells its group it is alive.")
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a service waits for an unreachable broker "
        "(one that is still starting) before it stops with an error.",
    )
    fetch_max_wait_ms: int = Field(
        100,
        ge=0,
        description="Longest a broker may hold an empty fetch. Brokers that do not answer early when data "
        "arrives (the local test broker) make this the per-hop latency; Kafka's own default is 500.",
    )
    idempotent_producer: bool = Field(
        True,
        description="acks=all plus idempotence; turn off only for a broker whose idempotence kafka-python "
        "cannot use (the local test broker).",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How the clients reach the brokers."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="With SASL_*: the mechanism."
    )
    sasl_username: str | None = Field(
        None, description="With SASL_*: the user (its password by sasl_password_env or _file)."
    )
    sasl_password_env: str | None = Field(None, description="Name of the environment variable with the password.")
    sasl_password_file: Path | None = Field(None, description="File whose content is the password.")
    ssl_cafile: Path | None = Field(None, description="With SSL: the CA bundle that signed the brokers' certificates.")
    ssl_certfile: Path | None = Field(None, description="With SSL: the client's certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(None, description="With SSL: the client certificate's key.")
    ssl_password_env: str | None = Field(None, description="Environment variable with the key's password.")

    @model_validator(mode="after")
    def _security_is_complete(self):
        if self.security_protocol.startswith("SASL"):
            if self.sasl_mechanism is None or self.sasl_username is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism and sasl_username")
            if (self.sasl_password_env is None) == (self.sasl_password_file is None):
                raise ValueError("set exactly one of sasl_password_env and sasl_password_file")
        elif self.sasl_mechanism is not None:
            raise ValueError("sasl_mechanism is set but security_protocol is not SASL_PLAINTEXT or SASL_SSL")
        return self

    def client_options(self) -> dict:
        """kafka-python security options, with secrets read from the environment or files now.

        Raises ConfigError naming the variable or file when a secret is missing. The values returned must not be
        logged; only their names appear in config and messages.
        """
        options: dict = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            options.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=_secret(self.sasl_password_env, self.sasl_password_file, "kafka SASL password"),
            )
        if self.security_protocol in ("SSL", "SASL_SSL"):
            for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                path = getattr(self, key)
                if path is not None:
                    if not path.is_file():
                        raise ConfigError(f"kafka.{key}: file not found: {path}")
                    options[key] = str(path)
            if self.ssl_password_env is not None:
                options["ssl_password"] = _secret(self.ssl_password_env, None, "kafka SSL key password")
        return options


RUN_KEY_FILE = "signing.key"


def _run_key(run_dir: Path) -> bytes:
    """The run's own signing key in ``run_dir``: made once (a random key, mode 0600, linked into place so that of
    services starting at once one writes it and every one reads the same), then read."""
    path = run_dir / RUN_KEY_FILE
    if not path.exists():
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            made = run_dir / f".{RUN_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            made.write_text(secrets.token_hex(32) + "\n")
            made.chmod(0o600)
            try:
                os.link(made, path)  # fails if another service made it first: its key is the run's
            except FileExistsError:
                pass
            finally:
                made.unlink()
        except OSError as exc:
            raise ConfigError(f"pipeline.run_key: cannot make the run's key in {run_dir}: {exc.strerror}") from None
    return _secret(None, path, "the run's signing key").encode()


def _secret(env: str | None, file: Path | None, what: str) -> str:
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise ConfigError(f"{what}: environment variable {env} is not set")
        return value
    try:
        return file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {file}: {exc.strerror}") from None


class EvalSection(_Section):
    """Evaluation while the run trains, off the learner's path: the evaluator role (``services/evaluator/``) follows
    the actor's announcements and scores held-out prompts with the run's reward every ``every`` versions."""

    prompts: Path = Field(
        description="Held-out prompts, JSONL as data.prompts (a label per row for rewards that read one); relative to "
        "the config's folder. Never trained on."
    )
    every: int = Field(5, gt=0, description="Evaluate actor versions 0, every, 2·every, ... and the run's last.")
    max_prompts: int = Field(64, gt=0, description="The first N held-out prompts are answered at each evaluation.")
    samples: int = Field(1, gt=0, description="Answers per prompt (with temperature > 0; greedy needs one).")
    temperature: float = Field(0.0, ge=0, description="0: greedy; above: sampled, seeded by run.seed.")

    @model_validator(mode="after")
    def _greedy_answers_once(self) -> EvalSection:
        if self.temperature == 0 and self.samples > 1:
            raise ValueError("eval.samples > 1 needs eval.temperature > 0: greedy answers are all the same")
        return self


class RunConfig(_Section):
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


def _apply_override(tree: dict, assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} is not of the form section.key=value")
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {part} is not a section")
    node[leaf] = yaml.safe_load(raw)


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "no such setting" + _nearest_setting(item["loc"])
        lines.append(f"  {where}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


def _nearest_setting(location: tuple) -> str:
    """``; did you mean `section.key`?`` for a mistyped key, from the settings its section has ('' if none is
    near)."""
    model = RunConfig
    for part in location[:-1]:
        field = model.model_fields.get(str(part))
        model = _section_model(field.annotation) if field is not None else None
        if model is None:
            return ""
    known = list(model.model_fields)
    near = difflib.get_close_matches(str(location[-1]), known, n=1, cutoff=0.6)
    prefix = ".".join(str(p) for p in location[:-1])
    return (
        f"; did you mean `{prefix + '.' if prefix else ''}{near[0]}`?"
        if near
        else f" (the settings here: {', '.join(known)})"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config, apply ``section.key=value`` overrides, validate.

    Relative paths in the file (prompts, models, run dir) are taken relative to the file's folder when they
    exist there, else relative to the working directory.
    """
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        tree = loaded
        _resolve_relative(tree, path.parent)
    for assignment in overrides or []:
        _apply_override(tree, assignment)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


# Settings that name a file or folder, and settings that name a function by its file (``path/to/file.py:name``).
_PATHS = (
    ("data", "prompts"),
    ("model", "actor"),
    ("model", "reference"),
    ("model", "critic"),
    ("reward", "model"),
    ("eval", "prompts"),
)
_NAMED_BY_FILE = (("reward", "function"), ("gateway", "agent", "function"), ("environment", "name"))


def _resolve_relative(tree: dict, base: Path) -> None:
    """One rule for every relative path a config file names, a function's file included: from the config's folder,
    where that is there (else as given, from the working directory)."""

    def at(keys: tuple[str, ...]) -> tuple[dict | None, object]:
        node = tree
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        return (node, node.get(keys[-1])) if isinstance(node, dict) else (None, None)

    for keys in _PATHS:
        node, value = at(keys)
        if isinstance(value, str) and not value.startswith("builtin:") and not Path(value).is_absolute():
            candidate = base / value
            if candidate.exists():
                node[keys[-1]] = str(candidate)
    for keys in _NAMED_BY_FILE:
        node, value = at(keys)
        where, sep, name = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        by_file = sep and (where.endswith(".py") or "/" in where)
        if by_file and not Path(where).expanduser().is_absolute() and (base / where).is_file():
            node[keys[-1]] = f"{base / where}:{name}"


def reference() -> str:
    """Every setting of a run config as Markdown, section by section: its type, default, bounds and meaning, read
    from the declarations above (``docs/config-reference.md``, which ``streamppo config-reference --write`` makes and
    a test holds equal to them)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `common/config.py` by `streamppo config-reference --write`; `tests/test_config.py` holds it",
        "equal to the code. A run config is YAML, one mapping per section; every setting can be given on the command",
        "line as `--set section.key=value`. A mistyped key is refused with the nearest one it could be.",
    ]
    sections: list[tuple[str, type[BaseModel], str]] = [("", RunConfig, "")]
    while sections:
        prefix, model, about = sections.pop(0)
        rows, nested = [], []
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            inner = _section_model(field.annotation)
            if inner is not None:
                nested.append((f"{path}.", inner, field.description or (inner.__doc__ or "").split("\n\n")[0]))
                continue
            cells = (f"`{path}`", _type_name(field), _default(field), _bounds(field), field.description or "")
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        if rows:
            title = prefix.rstrip(".") or "(top level)"
            lines += ["", f"## `{title}`", ""] + ([" ".join(about.split()), ""] if about else [])
            lines += ["| setting | type | default | bounds | meaning |", "|---|---|---|---|---|", *rows]
        sections = nested + sections
    return "\n".join(lines) + "\n"


def _section_model(annotation) -> type[BaseModel] | None:
    """The section (a model) a field holds, if it holds one (optional ones too); None for a plain setting."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(field) -> str:
    def name(annotation) -> str:
        if get_origin(annotation) is Literal:
            return " / ".join(f"`{value}`" for value in get_args(annotation))
        if get_origin(annotation) in (Union, types.UnionType):
            return " or ".join(name(a) for a in get_args(annotation) if a is not type(None)) + " or null"
        if get_origin(annotation) in (list, dict):
            return f"{get_origin(annotation).__name__} of {', '.join(name(a) for a in get_args(annotation))}"
        return {Path: "path", Any: "any"}.get(annotation, getattr(annotation, "__name__", str(annotation)))

    declared = [m for m in field.metadata if isinstance(m, AfterValidator)]
    if declared:  # a declared variant (common.algorithms): its names
        kind = declared[0].func.__self__
        return " / ".join(f"`{variant}`" for variant in kind.variants)
    return name(field.annotation)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, Path) and value.is_relative_to(Path.home()):
        value = Path("~") / value.relative_to(Path.home())  # the reader's home, not this machine's
    return "null" if value is None else f"`{value}`"


def _bounds(field) -> str:
    said = []
    for item in field.metadata:
        for attribute, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "length ≥")):
            value = getattr(item, attribute, None)
            if value is not None:
                said.append(f"{sign} {value}")
        if getattr(item, "pattern", None):
            said.append(f"matches `{item.pattern}`")
    return ", ".join(said)
