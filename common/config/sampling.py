"""The sections of what is sampled and scored: the models, the prompts, generation (vLLM's options), the reward
and its judges."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from common.config.base import DType, Section


class ModelDtypes(Section):
    """Per-model dtypes (bf16 on GPUs); unset ones take ``model.dtype``. The learner keeps fp32 master weights
    whatever the actor's and critic's dtype: under FSDP these set the compute dtype of its mixed precision."""

    actor: DType | None = Field(None, description="The actor's dtype (default: model.dtype).")
    critic: DType | None = Field(None, description="The critic's dtype (default: model.dtype).")
    reference: DType | None = Field(None, description="The reference model's dtype (default: model.dtype).")
    reward: DType | None = Field(None, description="The reward model's (or judge's) dtype (default: model.dtype).")


class LoraOptions(Section):
    """Train low-rank adapters on the actor (peft's LoRA) instead of all its weights: the learner trains, checkpoints
    and publishes the adapters alone; the generators keep the base weights and swap adapters."""

    rank: int = Field(8, gt=0, description="r of the adapters: each adapted matrix gains r × (in + out) weights.")
    alpha: float = Field(16.0, gt=0, description="Scale: the update is alpha / rank · B·A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input in training.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, description="Names of the linear layers adapted."
    )


class ModelSection(Section):
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


class DataSection(Section):
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


class VllmOptions(Section):
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


class GenerationSection(Section):
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


class JudgeSection(Section):
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


class RewardSection(Section):
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
