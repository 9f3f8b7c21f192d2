"""The wire contract: one message type per topic, and the msgpack codec that carries them.

Every message is a msgpack map. Arrays travel as ``{"dtype": str, "shape": [int, ...], "data": bytes}`` with
little-endian data. Nothing is pickled. Each field's wire type is declared once, in the dataclass field's
metadata, and that declaration drives encoding, validation on decode, and the published description in
``protos/`` (kept equal to it by ``tests/test_schema.py``).

Decoding untrusted bytes either returns a fully validated message or raises :class:`SchemaError`: declared sizes
are checked against the bytes actually present before anything is allocated, and symbolic dimensions (``N``,
``T``...) must agree across all arrays of a message.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

__all__ = [
    "BatchMessage",
    "BatchReference",
    "Completion",
    "CompletionRequest",
    "DeadLetter",
    "EnvironmentReply",
    "EpisodeEvent",
    "EpisodeTurn",
    "ExperienceBatch",
    "ADMITTED_EPOCH",
    "LEARNER_EPOCH",
    "LEARNER_REPLACEMENTS",
    "LEARNER_SETTLED",
    "MESSAGE_TYPES",
    "Message",
    "PromptBatch",
    "RUN_ID",
    "ReplicaStatus",
    "RolloutBatch",
    "SchemaError",
    "ScoredBatch",
    "TOPIC_MESSAGE",
    "chain_link",
    "split_link",
    "WeightAnnouncement",
    "decode",
    "derive",
    "describe",
    "encode",
    "episode_key",
    "message_key",
    "message_partition",
    "new_header",
]

# Array dtypes allowed on the wire. Little-endian only: '<' is forced on encode and required on decode.
WIRE_DTYPES = ("bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
# Bounds that keep a hostile message from costing more than its own size.
MAX_LINEAGE_ENTRIES = 256


# Lineage key naming the run a message belongs to; topics can outlive a run, so consumers check it.
RUN_ID = "run.id"
# Lineage key of a weight announcement: the epoch of the learner that wrote it, which rises at each learner start,
# so a reader can ignore a zombie learner (an older epoch) that still announces.
LEARNER_EPOCH = "learner.epoch"
# Lineage key of a gateway's call to the generators: the learner epoch of the announcement that the gateway admitted
# the call by (its header's policy_version is that announcement's version). A generator answers the call with those
# weights or newer ones: with older ones, its tokens would be too stale for the update the call was admitted to.
ADMITTED_EPOCH = "gateway.admitted_epoch"
# Lineage of an actor announcement whose snapshot holds LoRA adapters: "lora", and the base model they adapt.
ADAPTER = "actor.adapter"
ADAPTER_BASE = "actor.base"
# Lineage key of a weight announcement: the groups the learner has used up (trained, or dropped: stale or without
# signal). Generators admit prompt batches by it (bounded staleness counted in groups).
LEARNER_GROUPS_DONE = "learner.groups_done"
# Lineage key of a weight announcement: the prompt batches before it are settled (each group trained, waiting in the
# learner's checkpoint, or dropped). A feeder on a new log (the broker lost its data) publishes again from it.
LEARNER_SETTLED = "learner.settled"
# Lineage key of a weight announcement: the prompt batches published past the run's own to replace groups dropped as
# too stale (pipeline.stale_reserve), so that the run still makes run.steps updates. The feeder publishes them.
LEARNER_REPLACEMENTS = "learner.replacements"


def group_key(step: int, index: int) -> str:
    """The idempotency key of one group (a prompt's ``n`` responses): the prompt's step and row in its batch. A
    group is trained once however the records that carry it are cut."""
    return f"{step}/{index}"


class SchemaError(ValueError):
    """A message that cannot be decoded or does not satisfy its schema. The text says which field and why."""


# --------------------------------------------------------------------------------------------- wire types


@dataclass(frozen=True)
class Scalar:
    kind: str  # "str" | "int" | "float" | "bool" | "bytes"
    doc: str

    def describe(self) -> dict:
        return {"type": self.kind, "doc": self.doc}


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[str, ...]  # symbolic dimension names, e.g. ("N", "T")
    doc: str

    def describe(self) -> dict:
        return {"type": "array", "dtype": self.dtype, "shape": list(self.dims), "doc": self.doc}


@dataclass(frozen=True)
class StringList:
    dim: str
    doc: str

    def describe(self) -> dict:
        return {"type": "list[str]", "shape": [self.dim], "doc": self.doc}


@dataclass(frozen=True)
class Lineage:
    doc: str

    def describe(self) -> dict:
        return {"type": "map[str, str|int|float|bool|null]", "doc": self.doc}


WireType = Scalar | Array | StringList | Lineage


def _wire(wire_type: WireType):
    return field(metadata={"wire": wire_type})


def scalar(kind: str, doc: str):
    return _wire(Scalar(kind, doc))


def array(dtype: str, *dims: str, doc: str):
    assert dtype in WIRE_DTYPES, dtype
    return _wire(Array(dtype, tuple(dims), doc))


# --------------------------------------------------------------------------------------------- messages

# (lengths field, padded width dimension) pairs: a length may not exceed the width it measures.
_LENGTHS = (("prompt_lengths", "P"), ("response_lengths", "T"))
_TOKENS = (
    "prompt_tokens",
    "response_tokens",
    "prompt_index",
    "group_index",
    "no_signal_groups",
    "dead_lettered_groups",
)


@dataclass
class Message:
    """The header every pipeline message carries (see ``docs/ARCHITECTURE.md``, "Topics and messages")."""

    SCHEMA: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    # Older versions this build still reads: version -> a function from its raw map to the current version's.
    UPGRADES: ClassVar[dict] = {}
    DOC: ClassVar[str] = ""

    batch_id: str = scalar("str", "Stable id of the prompt batch this message descends from; the idempotency key.")
    producer: str = scalar("str", "Id of the service replica that produced this message.")
    policy_version: int = scalar(
        "int", "Actor policy version that sampled the rollouts (weights: the version announced)."
    )
    created_at: float = scalar("float", "Unix time at which this message was produced.")
    lineage: dict = _wire(
        Lineage(
            "Everything needed to re-train from this message: sampling parameters, model ids and versions, "
            "coefficients."
        )
    )

    @classmethod
    def wire_fields(cls) -> list[tuple[str, WireType]]:
        return [(f.name, f.metadata["wire"]) for f in dataclasses.fields(cls)]

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        """Checks across fields, beyond each field's wire type (lengths within widths, ids not negative); raises
        :class:`SchemaError`. ``values`` are the decoded fields, ``dims`` the sizes of the symbolic dimensions."""
        for name, dim in _LENGTHS:
            if name in values:
                lengths = values[name]
                if lengths.size and (lengths.min() < 0 or lengths.max() > dims[dim]):
                    raise SchemaError(f"{cls.SCHEMA}: {name} must lie in [0, {dim}={dims[dim]}]")
        for name in _TOKENS:
            if name in values and values[name].size and values[name].min() < 0:
                raise SchemaError(f"{cls.SCHEMA}: {name} holds negative ids")


@dataclass
class BatchMessage(Message):
    """A message of the pipeline's batch topics: it descends from one prompt batch, whose step it carries."""

    step: int = scalar(
        "int",
        "Sequence number of the prompt batch in the feeder's stream (0, 1, 2, ...); gates bounded staleness and "
        "picks the partition (step mod partitions).",
    )

    @property
    def rows(self) -> int:
        """Sequences in the batch: prompts, or responses downstream of the generator."""
        raise NotImplementedError

    def idempotency_keys(self) -> list[str]:
        """What a consumer remembers having handled: the batch id, or (past the generator) each group's key."""
        return [self.batch_id]

    @property
    def response_tokens_total(self) -> int:
        """Real response tokens in the batch (0 before the generator)."""
        return 0


def new_header(batch_id: str, producer: str, policy_version: int, lineage: dict | None = None) -> dict:
    """Header keyword arguments for a new message."""
    return {
        "batch_id": batch_id,
        "producer": producer,
        "policy_version": int(policy_version),
        "created_at": time.time(),
        "lineage": dict(lineage or {}),
    }


def _unlabelled_v1_to_v2(raw: dict) -> dict:
    """Version 1 carried no labels: every prompt's label is ''."""
    texts = raw.get("prompt_text")
    return raw | {"prompt_label": [""] * len(texts)} if isinstance(texts, list) else raw


_LABEL_DOC = (
    "The dataset row's label: what a verifiable reward checks the response against (a final answer, say); '' where "
    "the row has none."
)


@dataclass
class PromptBatch(BatchMessage):
    SCHEMA: ClassVar[str] = "prompts"
    DOC: ClassVar[str] = (
        "A batch of B prompts from the feeder, tokenized with the actor's tokenizer, right-padded to P."
    )
    VERSION: ClassVar[int] = 2
    UPGRADES: ClassVar[dict] = {1: _unlabelled_v1_to_v2}

    prompt_index: np.ndarray = array("int64", "B", doc="Row of each prompt in the dataset file.")
    prompt_text: list = _wire(StringList("B", "The prompts as text."))
    prompt_label: list = _wire(StringList("B", _LABEL_DOC))
    prompt_tokens: np.ndarray = array("int64", "B", "P", doc="Prompt token ids, right-padded.")
    prompt_lengths: np.ndarray = array("int64", "B", doc="Number of real tokens in each prompt row.")

    @property
    def rows(self) -> int:
        return len(self.prompt_lengths)


def _chain(*upgrades):
    """One upgrade that applies ``upgrades`` in order (each from one version's raw map to the next's)."""

    def upgrade(raw: dict) -> dict:
        for step in upgrades:
            raw = step(raw)
        return raw

    return upgrade


def _raw_array(values: np.ndarray, dtype: str) -> dict:
    """``values`` as the wire carries an array (what an upgrade adds to a raw map)."""
    data = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": dtype, "shape": list(data.shape), "data": data.tobytes()}


def _real_tokens(lengths: np.ndarray, width: int) -> np.ndarray:
    """``(N, width)`` True at the first ``lengths[i]`` positions of each row: the response mask."""
    return np.arange(width) < np.asarray(lengths)[:, None]


def _one_version_per_token(raw: dict) -> dict:
    """Before token_versions a record was sampled by one version: every response token carries the header's."""
    tokens, lengths, version = raw.get("response_tokens"), raw.get("response_lengths"), raw.get("policy_version")
    try:
        shape = [int(d) for d in tokens["shape"]]
        real = _real_tokens(np.frombuffer(lengths["data"], "<i8"), shape[1])
        versions = np.where(real, np.int32(version), np.int32(0))
    except Exception:  # not arrays as the wire has them: validation names what is wrong
        return raw
    return raw | {"token_versions": _raw_array(versions, "int32")}


def _every_token_the_models(raw: dict) -> dict:
    """Before episodes a response was one answer: every real token the model's, in one turn."""
    tokens, lengths = raw.get("response_tokens"), raw.get("response_lengths")
    try:
        shape = [int(d) for d in tokens["shape"]]
        count = np.frombuffer(lengths["data"], "<i8")
        real = _real_tokens(count, shape[1])
    except Exception:  # not arrays as the wire has them: validation names what is wrong
        return raw
    return raw | {
        "response_mask": _raw_array(real, "bool"),
        "turns": _raw_array(np.ones(len(count)), "int64"),
        "environment_reward": _raw_array(np.zeros(len(count)), "float32"),
    }


def _no_dead_letters(raw: dict) -> dict:
    """Before gateways no group was dead-lettered whole on its way."""
    return raw | {"dead_lettered_groups": _raw_array(np.zeros(0), "int64")}


@dataclass
class RolloutBatch(BatchMessage):
    SCHEMA: ClassVar[str] = "rollouts"
    DOC: ClassVar[str] = (
        "N = B·n sampled responses (n per prompt) with the behaviour policy's per-token log-probs and the policy "
        "version that sampled each token. The header's policy_version is the oldest of them."
    )
    # Version 2 added prompt_label, version 3 token_versions, version 4 response_mask and turns (episodes), version 5
    # dead_lettered_groups (gateways), here and so in every schema that extends this one.
    VERSION: ClassVar[int] = 5
    UPGRADES: ClassVar[dict] = {
        1: _chain(_unlabelled_v1_to_v2, _one_version_per_token, _every_token_the_models, _no_dead_letters),
        2: _chain(_one_version_per_token, _every_token_the_models, _no_dead_letters),
        3: _chain(_every_token_the_models, _no_dead_letters),
        4: _no_dead_letters,
    }

    group_index: np.ndarray = array("int64", "N", doc="Row of the prompt batch each response was sampled for.")
    prompt_text: list = _wire(StringList("N", "Prompt of each response, as text."))
    prompt_label: list = _wire(StringList("N", "Label of each response's prompt. " + _LABEL_DOC))
    response_text: list = _wire(StringList("N", "Each response decoded to text (special tokens removed)."))
    prompt_tokens: np.ndarray = array("int64", "N", "P", doc="Prompt token ids, right-padded.")
    prompt_lengths: np.ndarray = array("int64", "N", doc="Real tokens in each prompt row.")
    response_tokens: np.ndarray = array(
        "int64", "N", "T", doc="Response token ids, right-padded; EOS included when sampled."
    )
    response_lengths: np.ndarray = array(
        "int64",
        "N",
        doc="Real tokens in each response row: the model's and, in an episode, the environment's (see response_mask).",
    )
    finished: np.ndarray = array(
        "bool", "N", doc="True where the response ended with EOS, False where it was truncated."
    )
    behaviour_logprobs: np.ndarray = array(
        "float32", "N", "T", doc="log π_behaviour(token) at sampling temperature; 0 where response_mask is False."
    )
    token_versions: np.ndarray = array(
        "int32",
        "N",
        "T",
        doc="Policy version of the weights that sampled each response token; 0 at padding. A response's versions "
        "differ when new weights were loaded while it was sampled (generation.in_flight_updates); its staleness is "
        "judged by the oldest. 0 at padding and at the environment's tokens.",
    )
    response_mask: np.ndarray = array(
        "bool",
        "N",
        "T",
        doc="True where the model sampled the token: it is trained and has a behaviour log-prob, a reference "
        "log-prob and a KL. False at padding and, in a multi-turn episode, at the environment's tokens (tool output, "
        "observations): those are context only. A single answer's mask is its first response_lengths tokens.",
    )
    turns: np.ndarray = array(
        "int64",
        "N",
        doc="The model's turns in each response: 1 for a single answer; in an episode, one more after each "
        "observation.",
    )
    environment_reward: np.ndarray = array(
        "float32",
        "N",
        doc="What the environment's steps returned as reward over each episode, summed; 0 for a single answer. The "
        "scorer's reward section says how it enters the score.",
    )
    dead_lettered_groups: np.ndarray = array(
        "int64",
        "D",
        doc="Rows of the prompt batch whose groups this record settles with no response: every episode of them was "
        "dead-lettered on the way (a gateway's unrewarded: dead_letter). Never trained; the learner counts them as "
        "used up.",
    )

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        versions, mask = values["token_versions"], values["response_mask"]
        if (mask & ~_real_tokens(values["response_lengths"], mask.shape[1])).any():
            raise SchemaError(f"{cls.SCHEMA}: response_mask marks padding (past response_lengths) as the model's")
        if values["turns"].size and values["turns"].min() < 1:
            raise SchemaError(f"{cls.SCHEMA}: turns must be at least 1")
        real = mask
        if real.any() and int(versions[real].min()) != values["policy_version"]:
            raise SchemaError(
                f"{cls.SCHEMA}: policy_version {values['policy_version']} is not the oldest of token_versions "
                f"({int(versions[real].min())})"
            )

    @property
    def rows(self) -> int:
        return len(self.response_lengths)

    def newest_version(self) -> int:
        """The newest version that sampled a token of the record (the header's when it has none)."""
        real = self.response_mask
        return int(self.token_versions[real].max()) if real.any() else self.policy_version

    def row_versions(self) -> np.ndarray:
        """``(N,)`` the oldest version that sampled a token of each response (the header's for an empty one)."""
        real = self.response_mask
        oldest = np.where(real, self.token_versions, np.iinfo(np.int32).max).min(axis=1, initial=np.iinfo(np.int32).max)
        return np.where(real.any(axis=1), oldest, self.policy_version).astype(np.int64)

    @property
    def response_tokens_total(self) -> int:
        """Real response tokens: the model's and the environment's (both were processed downstream)."""
        return int(self.response_lengths.sum())

    def model_tokens(self) -> np.ndarray:
        """``(N,)`` the tokens of each response the model sampled (its length without the environment's)."""
        return self.response_mask.sum(axis=1).astype(np.int64)

    def groups(self) -> list[int]:
        """The rows of the prompt batch whose groups this record carries (ascending)."""
        return sorted({int(g) for g in self.group_index})

    def groups_accounted(self) -> list[int]:
        """The groups this record settles: those it carries and those dead-lettered whole on the way."""
        return sorted({*self.groups(), *(int(g) for g in self.dead_lettered_groups)})

    def idempotency_keys(self) -> list[str]:
        return [group_key(self.step, g) for g in self.groups_accounted()] or [self.batch_id]

    def without_groups(self, keys: set[str]) -> RolloutBatch:
        """A copy without the groups whose keys are in ``keys`` (e.g. those handled already)."""
        trimmed = self.take_rows(np.array([group_key(self.step, int(g)) not in keys for g in self.group_index], bool))
        trimmed.dead_lettered_groups = np.array(
            [g for g in self.dead_lettered_groups if group_key(self.step, int(g)) not in keys], dtype=np.int64
        )
        return trimmed

    def take_rows(self, keep: np.ndarray) -> RolloutBatch:
        """A copy with the responses where ``keep`` (``(N,)`` bool) is True; every other field as it is."""
        fields = {}
        for f in dataclasses.fields(self):
            value, wire = getattr(self, f.name), f.metadata["wire"]
            if isinstance(wire, Array) and wire.dims[:1] == ("N",):
                value = value[keep]
            elif isinstance(wire, StringList) and wire.dim == "N":
                value = [v for v, k in zip(value, keep) if k]
            fields[f.name] = value
        taken = type(self)(**fields)
        real = taken.response_mask
        if real.any():  # the header names the oldest version left
            taken.policy_version = int(taken.token_versions[real].min())
        return taken


@dataclass
class ScoredBatch(RolloutBatch):
    SCHEMA: ClassVar[str] = "scored"
    DOC: ClassVar[str] = "Rollouts with the reward model's score and the frozen reference model's log-probs."

    scores: np.ndarray = array(
        "float32", "N", doc="Reward model (or reward function) score of each response, unshaped."
    )
    ref_logprobs: np.ndarray = array(
        "float32", "N", "T", doc="log π_ref(token) at sampling temperature; 0 where response_mask is False."
    )


def _experience_v2_to_v3(raw: dict) -> dict:
    """Version 2 had no dynamic sampling: no group was dropped for want of signal."""
    return raw | {"no_signal_groups": {"dtype": "int64", "shape": [0], "data": b""}}


@dataclass
class ExperienceBatch(ScoredBatch):
    SCHEMA: ClassVar[str] = "experience"
    DOC: ClassVar[str] = "Scored rollouts with critic values, KL-shaped token rewards, and raw (unwhitened) GAE."
    # Version 3 added no_signal_groups (dynamic sampling), version 4 token_versions (from the rollouts' version 3),
    # version 5 response_mask and turns (the rollouts' version 4), version 6 dead_lettered_groups (the rollouts' 5).
    VERSION: ClassVar[int] = 6
    UPGRADES: ClassVar[dict] = {
        1: _chain(
            _unlabelled_v1_to_v2,
            _experience_v2_to_v3,
            _one_version_per_token,
            _every_token_the_models,
            _no_dead_letters,
        ),
        2: _chain(_experience_v2_to_v3, _one_version_per_token, _every_token_the_models, _no_dead_letters),
        3: _chain(_one_version_per_token, _every_token_the_models, _no_dead_letters),
        4: _chain(_every_token_the_models, _no_dead_letters),
        5: _no_dead_letters,
    }

    values: np.ndarray = array(
        "float32",
        "N",
        "T",
        doc="Critic V(s_t) for the state before each of the model's tokens; 0 where response_mask is False.",
    )
    kl: np.ndarray = array(
        "float32",
        "N",
        "T",
        doc="Per-token KL estimate between behaviour and reference policy; 0 where response_mask is False.",
    )
    token_rewards: np.ndarray = array(
        "float32",
        "N",
        "T",
        doc="−β·kl on each of the model's tokens plus the (clipped, penalised) score on its last; 0 elsewhere.",
    )
    advantages: np.ndarray = array(
        "float32",
        "N",
        "T",
        doc="Advantages (GAE or the estimator's), not whitened; 0 where response_mask is False: GAE runs over the "
        "model's tokens only, an environment's tokens between two of them being skipped.",
    )
    returns: np.ndarray = array(
        "float32", "N", "T", doc="Returns, advantages + values; 0 where response_mask is False."
    )
    no_signal_groups: np.ndarray = array(
        "int64",
        "G",
        doc="Rows of the prompt batch whose groups the advantage stage dropped (algorithm.dynamic_sampling): all "
        "their scores were equal, so all their advantages zero. Their responses are not in this record.",
    )

    def groups_accounted(self) -> list[int]:
        """The groups this record settles: those it carries, those dropped for want of signal, and those
        dead-lettered on the way."""
        return sorted({*super().groups_accounted(), *(int(g) for g in self.no_signal_groups)})

    def without_groups(self, keys: set[str]) -> ExperienceBatch:
        trimmed = super().without_groups(keys)
        trimmed.no_signal_groups = np.array(
            [g for g in self.no_signal_groups if group_key(self.step, int(g)) not in keys], dtype=np.int64
        )
        return trimmed


def episode_key(step: int, row: int, index: int) -> str:
    """An episode's id: its group's key and its index among the group's responses."""
    return f"{group_key(step, row)}#{index}"


@dataclass
class EpisodeTurn(BatchMessage):
    SCHEMA: ClassVar[str] = "turns"
    DOC: ClassVar[str] = (
        "One model turn of a multi-turn episode, for an environment replica to answer: the episode so far as text "
        "(the prompt, the model's turns, the environment's observations), so that any replica can answer it, one "
        "that never saw the episode by replaying its earlier turns."
    )

    episode: str = scalar("str", "The episode: '<step>/<row>#<index>', its group's key and its index in the group.")
    turn: int = scalar("int", "Which of the model's turns this is (0 for the first).")
    reply_to: str = scalar(
        "str",
        "The generator process waiting for the answer ('<replica>/<incarnation>'); an answer for another is "
        "ignored, so a restarted generator never takes an answer meant for its predecessor.",
    )
    prompt_text: str = scalar("str", "The episode's prompt, as text.")
    prompt_label: str = scalar("str", "The dataset row's label ('' where it has none).")
    model_turns: list = _wire(StringList("K", "The model's turns so far, as text; the last is the one to answer."))
    observations: list = _wire(StringList("J", "The environment's answers to the earlier turns (J = K − 1)."))

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        if dims["K"] != values["turn"] + 1 or dims["J"] != dims["K"] - 1:
            raise SchemaError(
                f"{cls.SCHEMA}: turn {values['turn']} needs {values['turn'] + 1} model turns and {values['turn']} "
                f"observations, not {dims['K']} and {dims['J']}"
            )

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.episode}.{self.turn}"]


@dataclass
class EnvironmentReply(BatchMessage):
    SCHEMA: ClassVar[str] = "observations"
    DOC: ClassVar[str] = "An environment's answer to one model turn of an episode (turns): what the model reads next."

    episode: str = scalar("str", "The episode (as in the turn answered).")
    turn: int = scalar("int", "The turn answered.")
    reply_to: str = scalar("str", "The generator process that asked (as in the turn).")
    observation: str = scalar("str", "Text appended after the model's turn, never trained on ('' when done).")
    reward: float = scalar("float", "The environment's reward for the turn.")
    done: bool = scalar("bool", "Whether the episode is over.")
    status: str = scalar(
        "str", "'ok', or why the environment could not step (it then ends the episode): the error, in one line."
    )

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.episode}.{self.turn}"]


# ------------------------------------------------------------------ an agent's calls through the gateway


@dataclass
class CompletionRequest(BatchMessage):
    SCHEMA: ClassVar[str] = "requests"
    DOC: ClassVar[str] = (
        "One call of an agent's episode, from a gateway to the generator fleet: the whole prompt as token ids, to be "
        "answered with one response on completions. The batch id is the call's id."
    )

    episode: str = scalar("str", "The episode: '<step>/<row>#<index>', its group's key and its index in the group.")
    call: str = scalar("str", "The call's id, unique in the run ('<episode>/<key>'); the answer carries it.")
    reply_to: str = scalar(
        "str",
        "The gateway process waiting for the answer ('<replica>/<incarnation>'); an answer for another is ignored, so "
        "a restarted gateway never takes one meant for its predecessor.",
    )
    prompt_tokens: np.ndarray = array("int64", "P", doc="The prompt's token ids, whole.")
    max_tokens: int = scalar("int", "The most tokens the response may have.")
    temperature: float = scalar("float", "Sampling temperature (> 0).")
    top_p: float = scalar("float", "Nucleus sampling's mass, in (0, 1].")
    top_k: int = scalar("int", "Top-k sampling; 0: off.")
    seed: int = scalar("int", "The call's sampling seed; -1: none (the engine's own randomness).")
    stop: list = _wire(StringList("S", "Strings that end the response besides EOS (kept in its tokens)."))

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        if dims["P"] == 0 or values["max_tokens"] < 1:
            raise SchemaError(f"{cls.SCHEMA}: a request needs a prompt and max_tokens of at least 1")
        if not (values["temperature"] > 0 and 0 < values["top_p"] <= 1 and values["top_k"] >= 0):
            raise SchemaError(f"{cls.SCHEMA}: temperature must be > 0, top_p in (0, 1], top_k >= 0")

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.call}"]


@dataclass
class Completion(BatchMessage):
    SCHEMA: ClassVar[str] = "completions"
    DOC: ClassVar[str] = (
        "A generator's answer to one request (requests): the sampled token ids with their behaviour log-probs and the "
        "policy version that sampled each. The header's policy_version is the oldest of them."
    )

    episode: str = scalar("str", "The episode (as in the request).")
    call: str = scalar("str", "The call answered (as in the request).")
    reply_to: str = scalar("str", "The gateway process that asked (as in the request).")
    response_tokens: np.ndarray = array("int64", "T", doc="The sampled token ids, EOS or the stop string included.")
    behaviour_logprobs: np.ndarray = array(
        "float32", "T", doc="log π_behaviour of each sampled token at the sampling temperature."
    )
    token_versions: np.ndarray = array("int32", "T", doc="The policy version that sampled each token.")
    text: str = scalar(
        "str",
        "The response as the client reads it: decoded without special tokens, cut before the first stop string.",
    )
    finish_reason: str = scalar("str", "'stop' (EOS or a stop string), 'length' (max_tokens), or 'error' (see status).")
    status: str = scalar(
        "str", "'ok', or why the request could not be sampled (a prompt longer than the engine takes), in one line."
    )

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        versions = values["token_versions"]
        if versions.size and int(versions.min()) != values["policy_version"]:
            raise SchemaError(f"{cls.SCHEMA}: policy_version is not the oldest of token_versions")
        if values["finish_reason"] not in ("stop", "length", "error"):
            raise SchemaError(f"{cls.SCHEMA}: finish_reason must be stop, length or error")

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.call}"]


EPISODE_EVENTS = ("start", "call", "reward", "end")
EPISODE_OUTCOMES = ("rewarded", "ended", "failed", "timed_out")


@dataclass
class EpisodeEvent(BatchMessage):
    SCHEMA: ClassVar[str] = "episodes"
    DOC: ClassVar[str] = (
        "The gateways' log of agents' episodes, one event at a time, in order per episode (its step picks the "
        "partition): an agent took the episode (start), one call answered (call, written before the answer is "
        "returned), a reward posted (reward), the episode over (end). Any gateway replica rebuilds an episode from "
        "it; the one that holds the episode's prompt batch turns its calls into rollouts once every episode of a group "
        "has ended. The batch id is the episode's prompt batch's."
    )

    episode: str = scalar("str", "The episode: '<step>/<row>#<index>'.")
    kind: str = scalar("str", "'start', 'call', 'reward' or 'end'.")
    event: str = scalar("str", "The event's id, unique in the run: a call's id for a call.")
    parent: str = scalar(
        "str",
        "call: the earlier call whose prompt and response this call's prompt extends (its tokens are reused as they "
        "are); '' when it extends none and begins a new row of the episode.",
    )
    request_digest: str = scalar(
        "str",
        "call: a digest of the request as the client sent it (model, messages or prompt, limits): a retry's is "
        "the same.",
    )
    messages: int = scalar("int", "call: the messages of its chat (0 for a prompt of the completions API).")
    prompt_text: str = scalar(
        "str", "call: the prompt's text after the parent's response (the whole prompt without a parent)."
    )
    prompt_tokens: np.ndarray = array(
        "int64",
        "P",
        doc="call: the prompt's token ids after the parent's response (the whole prompt without a parent).",
    )
    response_tokens: np.ndarray = array("int64", "T", doc="call: the sampled token ids.")
    behaviour_logprobs: np.ndarray = array("float32", "T", doc="call: their behaviour log-probs.")
    token_versions: np.ndarray = array("int32", "T", doc="call: the policy version that sampled each.")
    text: str = scalar("str", "call: the response as the client read it.")
    finish_reason: str = scalar("str", "call: 'stop' or 'length'.")
    reward: float = scalar("float", "reward: the reward posted; end: the reward it ends with (see outcome).")
    outcome: str = scalar(
        "str",
        "end: 'rewarded' (a reward was posted), 'ended' (the agent ended it without one), 'failed' (the agent failed), "
        "'timed_out' (nothing came for gateway.episode_timeout_s); the gateway's unrewarded policy says what becomes "
        "of all but the first.",
    )
    detail: str = scalar("str", "start: the agent that took it; end: why it ended ('' when the agent ended it).")

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        kind = values["kind"]
        if kind not in EPISODE_EVENTS:
            raise SchemaError(f"{cls.SCHEMA}: kind must be one of {', '.join(EPISODE_EVENTS)}, not {kind!r}")
        if kind != "call" and (dims["P"] or dims["T"]):
            raise SchemaError(f"{cls.SCHEMA}: a {kind} event carries no tokens")
        if kind == "call" and values["finish_reason"] not in ("stop", "length"):
            raise SchemaError(f"{cls.SCHEMA}: a call's finish_reason must be stop or length")
        versions = values["token_versions"]
        if versions.size and int(versions.min()) != values["policy_version"]:
            raise SchemaError(f"{cls.SCHEMA}: policy_version is not the oldest of token_versions")
        if kind == "end" and values["outcome"] not in EPISODE_OUTCOMES:
            raise SchemaError(f"{cls.SCHEMA}: an end's outcome must be one of {', '.join(EPISODE_OUTCOMES)}")

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [self.event]


def chain_link(digest: str, uri: str) -> str:
    """One entry of a weight announcement's ``chain``: ``"<digest> <uri>"`` (a digest has no space; a uri may)."""
    return f"{digest} {uri}"


def split_link(link: str) -> tuple[str, str]:
    """``(digest, uri)`` of a ``chain`` entry."""
    digest, _, uri = link.partition(" ")
    return digest, uri


def _weights_v1_to_v3(raw: dict) -> dict:
    """Version 1 named its digest ``sha256`` (hex): it reads as a ``sha256:`` digest, a chain of that one file."""
    if not isinstance(raw.get("sha256"), str):
        return raw  # validation names what is wrong
    digest = f"sha256:{raw['sha256']}"
    return _weights_v2_to_v3(
        {k: v for k, v in raw.items() if k != "sha256"}
        | {"digest": digest, "chain": [chain_link(digest, raw.get("uri"))]}
    )


def _weights_v2_to_v3(raw: dict) -> dict:
    """Version 2 had no broadcast path: nothing was broadcast."""
    return raw | {"broadcast_digest": ""}


@dataclass
class WeightAnnouncement(Message):
    SCHEMA: ClassVar[str] = "weights"
    DOC: ClassVar[str] = (
        "A weight snapshot in the weight store. Keyed by model on a compacted topic, so the latest one per model "
        "survives; policy_version is the version the snapshot holds."
    )

    VERSION: ClassVar[int] = 3
    UPGRADES: ClassVar[dict] = {1: _weights_v1_to_v3, 2: _weights_v2_to_v3}

    model: str = scalar("str", "Which model: 'actor' or 'critic'.")
    uri: str = scalar("str", "Where the safetensors snapshot lies (a path in the shared weight store, or a URL).")
    digest: str = scalar(
        "str", "'<algorithm>:<hex>' of the snapshot file's bytes, blake3 or sha256; a mismatch rejects the snapshot."
    )
    chain: list = _wire(
        StringList(
            "L",
            "The files to read, in order, each '<digest> <uri>': the newest full snapshot, then the deltas up to "
            "this one (its last entry is this digest and uri). One entry when the snapshot is full.",
        )
    )
    num_bytes: int = scalar("int", "Size of the snapshot file in bytes.")
    broadcast_digest: str = scalar(
        "str",
        "'<algorithm>:<hex>' of the tensors the learner also broadcast for this version (manifest, then each "
        "tensor's bytes), sent only when every receiver held exactly that; '' when nothing was broadcast. A "
        "generator that holds it loads it instead of the snapshot.",
    )

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        if not values["chain"] or values["chain"][-1] != chain_link(values["digest"], values["uri"]):
            raise SchemaError("weights: the chain must end with this snapshot's '<digest> <uri>'")

    @property
    def learner_epoch(self) -> int:
        """The epoch of the learner that announced it (:data:`LEARNER_EPOCH`; 0 before epochs existed)."""
        return int(self.lineage.get(LEARNER_EPOCH, 0))


class _Record:
    """A wire type outside the pipeline (no header): its wire fields are all its fields."""

    UPGRADES: ClassVar[dict] = {}

    @classmethod
    def wire_fields(cls) -> list[tuple[str, WireType]]:
        return [(f.name, f.metadata["wire"]) for f in dataclasses.fields(cls)]

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        """No checks across fields."""


@dataclass
class DeadLetter(_Record):
    """Not a pipeline message: what a service writes to ``<topic>.dlq`` for input it could not decode."""

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1
    DOC: ClassVar[str] = "A message that failed to decode or validate, with the error and where it came from."

    error: str = scalar("str", "Why the message was rejected.")
    source_topic: str = scalar("str", "Topic the message was read from.")
    source_partition: int = scalar("int", "Partition it was read from.")
    source_offset: int = scalar("int", "Its offset there.")
    payload: bytes = scalar(
        "bytes",
        "The original bytes, untouched; empty for a null value, and cut where the record would not fit beside the "
        "other fields (the error then gives the whole size and digest).",
    )
    producer: str = scalar("str", "The service replica that rejected it.")
    created_at: float = scalar("float", "Unix time of the rejection.")


# How far apart a replica's reports on the status topic are at most while its loop runs (and one when it stops): a
# report older than twice this says the replica is silent (stopped, gone, or in one batch of minutes of compute).
REPORT_EVERY_S = 30.0


@dataclass
class ReplicaStatus(_Record):
    """Not a pipeline message: what each service replica says about itself, every 30 s, on the status topic."""

    SCHEMA: ClassVar[str] = "replica_status"
    VERSION: ClassVar[int] = 2
    UPGRADES: ClassVar[dict] = {1: lambda raw: {"url": ""} | raw}  # version 1 had no url: it served none
    DOC: ClassVar[str] = (
        "A service replica's state, keyed by replica on a compacted topic, so the latest one per replica survives: "
        "what `streamppo status` shows."
    )

    replica: str = scalar("str", "The replica's id.")
    role: str = scalar("str", "Its role.")
    run_id: str = scalar("str", "The run it serves.")
    state: str = scalar("str", "'serving', 'waiting' (it holds input it is not ready for), 'done' or 'stopped'.")
    waiting_for: str = scalar("str", "What held input waits for, with its partition and for how long; '' if none.")
    held: int = scalar("int", "Input records held back.")
    held_seconds: float = scalar("float", "How long the oldest held record has waited.")
    lag: int = scalar("int", "Records in its partitions not yet consumed.")
    counters: dict = _wire(
        Lineage(
            "Batches by outcome (processed, dropped, duplicates, dead_letters, ...), response tokens (tokens), "
            "the weight versions loaded (weights.<model>), and from a fleet's replica the run's share of it (fleet.*)."
        )
    )
    created_at: float = scalar("float", "Unix time of this report.")
    url: str = scalar("str", "Where the replica serves clients over HTTP (the gateway's OpenAI API); '' if nowhere.")


@dataclass
class BatchReference(_Record):
    """Not a batch: where a batch too large for a record lies (``common/batch_store.py``), sent in its place."""

    SCHEMA: ClassVar[str] = "batch_reference"
    VERSION: ClassVar[int] = 1
    DOC: ClassVar[str] = (
        "Sent on a batch topic in place of a batch whose encoded bytes exceed pipeline.inline_max_bytes: the batch "
        "is a file in the run's shared batch store. A reader fetches it, checks its digest and decodes it as the "
        "message the topic carries."
    )

    carries: str = scalar("str", "The schema of the message in the file: the one the topic carries.")
    batch_id: str = scalar("str", "The batch id of that message.")
    step: int = scalar("int", "Its step (-1 for a message without one).")
    uri: str = scalar("str", "Where the file lies (a path in the shared batch store).")
    digest: str = scalar("str", "'blake3:<hex>' of the file's bytes; a mismatch dead-letters the record.")
    num_bytes: int = scalar("int", "Size of the file in bytes.")


MESSAGE_TYPES: dict[str, type] = {
    cls.SCHEMA: cls
    for cls in (
        PromptBatch,
        RolloutBatch,
        ScoredBatch,
        ExperienceBatch,
        WeightAnnouncement,
        DeadLetter,
        ReplicaStatus,
        BatchReference,
        EpisodeTurn,
        EnvironmentReply,
        CompletionRequest,
        Completion,
        EpisodeEvent,
    )
}
# The message type each pipeline topic carries. Dead-letter topics are named "<topic>.dlq".
TOPIC_MESSAGE: dict[str, type] = {
    "prompts": PromptBatch,
    "rollouts": RolloutBatch,
    "scored": ScoredBatch,
    "experience": ExperienceBatch,
    "weights": WeightAnnouncement,
    "turns": EpisodeTurn,
    "observations": EnvironmentReply,
    "requests": CompletionRequest,
    "completions": Completion,
    "episodes": EpisodeEvent,
}


def derive(parent: Message, cls: type, producer: str, lineage: dict | None = None, **fields: Any) -> Message:
    """A message of type ``cls`` that extends ``parent`` (a base class of ``cls``) with ``fields``.

    Header and parent fields are carried over; ``producer`` and ``created_at`` are renewed and ``lineage`` is
    merged into the parent's, so every stage adds what it contributed.
    """
    carried = {f.name: getattr(parent, f.name) for f in dataclasses.fields(parent)}
    carried.update(producer=producer, created_at=time.time(), lineage={**parent.lineage, **(lineage or {})})
    return cls(**carried, **fields)


def message_partition(message: Message, partitions: int) -> int | None:
    """The partition of a batch message: its step modulo the topic's partitions, so consecutive steps land on
    consecutive partitions and each of a role's replicas (which own partitions) gets every R-th step. ``None``
    (partition by key) for messages without a step.

    Hashing batch ids spreads batches unevenly: 32 batches over 8 partitions give the busiest partition about twice
    the mean, and the replica that owns it sets the role's pace (``benchmarks/RESULTS.md``, the simulated cluster).
    A batch's step never changes, so every message of one batch still goes to one partition.
    """
    return message.step % partitions if isinstance(message, BatchMessage) else None


def message_key(message: Message) -> bytes:
    """The partitioning key: the model for weight announcements (so compaction keeps the latest per model),
    the batch id for everything else (so one batch's messages stay in one partition)."""
    if isinstance(message, WeightAnnouncement):
        return message.model.encode()
    return message.batch_id.encode()


def describe(cls: type) -> dict:
    """The published description of a message type, as written in ``protos/<schema>.yaml``."""
    return {
        "schema": cls.SCHEMA,
        "version": cls.VERSION,
        "doc": cls.DOC,
        "fields": {name: wire.describe() for name, wire in cls.wire_fields()},
    }


# --------------------------------------------------------------------------------------------- encode


def _encode_array(name: str, spec: Array, value: Any) -> dict:
    arr = np.asarray(value)
    if spec.dtype == "bfloat16":
        raise SchemaError(f"{name}: bfloat16 arrays must be sent as float32")  # numpy has no native bfloat16
    arr = np.ascontiguousarray(arr, dtype=np.dtype(spec.dtype).newbyteorder("<"))
    if arr.ndim != len(spec.dims):
        raise SchemaError(f"{name}: expected rank {len(spec.dims)} {spec.dims}, got shape {arr.shape}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise SchemaError(f"{name}: contains NaN or infinity")
    return {"dtype": spec.dtype, "shape": list(arr.shape), "data": arr.tobytes()}


def encode(message: Any) -> bytes:
    """Encode a message to msgpack bytes. Raises :class:`SchemaError` if a field does not fit its wire type."""
    cls = type(message)
    if MESSAGE_TYPES.get(getattr(cls, "SCHEMA", None)) is not cls:
        raise SchemaError(f"not a wire message type: {cls.__name__}")
    out: dict[str, Any] = {"schema": cls.SCHEMA, "version": cls.VERSION}
    dims: dict[str, int] = {}
    # Validate on the producer's side too, so a bug fails where it is made and not in a consumer's DLQ.
    for name, wire in cls.wire_fields():
        value = getattr(message, name)
        if isinstance(wire, Array):
            out[name] = _encode_array(name, wire, value)
            for dim, size in zip(wire.dims, out[name]["shape"]):
                _bind_dim(name, dim, size, dims)
            continue
        if isinstance(wire, StringList):
            value = [str(v) for v in value]
        elif isinstance(wire, Lineage):
            value = {str(k): v for k, v in value.items()}
        out[name] = _check_field(name, wire, value, dims)
    return msgpack.packb(out, use_bin_type=True)


# --------------------------------------------------------------------------------------------- decode

_SCALAR_TYPES = {"str": (str,), "int": (int,), "float": (float, int), "bool": (bool,), "bytes": (bytes,)}


def _check_scalar(name: str, kind: str, value: Any) -> Any:
    # bool is a subclass of int in Python; on the wire they are different types.
    if isinstance(value, bool) and kind != "bool":
        raise SchemaError(f"{name}: expected {kind}, got bool")
    if not isinstance(value, _SCALAR_TYPES[kind]):
        raise SchemaError(f"{name}: expected {kind}, got {type(value).__name__}")
    if kind == "float":
        value = float(value)
        if not math.isfinite(value):
            raise SchemaError(f"{name}: expected a finite float, got {value}")
    return value


def _bind_dim(name: str, dim: str, size: int, dims: dict[str, int]) -> None:
    bound = dims.setdefault(dim, size)
    if bound != size:
        raise SchemaError(f"{name}: dimension {dim} is {size} here but {bound} in an earlier field")


def _decode_array(name: str, spec: Array, value: Any, dims: dict[str, int]) -> np.ndarray:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise SchemaError(f"{name}: expected an array, a map with exactly dtype, shape and data")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype != spec.dtype:
        raise SchemaError(f"{name}: expected dtype {spec.dtype}, got {dtype!r}")
    if not isinstance(shape, list) or len(shape) != len(spec.dims):
        raise SchemaError(f"{name}: expected a shape of rank {len(spec.dims)} {spec.dims}, got {shape!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise SchemaError(f"{name}: shape must be non-negative integers, got {shape!r}")
    if not isinstance(data, bytes):
        raise SchemaError(f"{name}: data must be bytes, got {type(data).__name__}")
    np_dtype = np.dtype(dtype).newbyteorder("<")
    # Python ints do not overflow; the comparison with the bytes present bounds every allocation below.
    if math.prod(shape) * np_dtype.itemsize != len(data):
        raise SchemaError(
            f"{name}: shape {shape} of {dtype} needs {math.prod(shape) * np_dtype.itemsize} bytes, got {len(data)}"
        )
    for dim, size in zip(spec.dims, shape):
        _bind_dim(name, dim, size, dims)
    arr = np.frombuffer(data, dtype=np_dtype).reshape(shape).astype(np_dtype.newbyteorder("="), copy=True)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise SchemaError(f"{name}: contains NaN or infinity")
    return arr


def _check_field(name: str, wire: WireType, value: Any, dims: dict[str, int]) -> Any:
    if isinstance(wire, Array):
        return _decode_array(name, wire, value, dims)
    if isinstance(wire, StringList):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SchemaError(f"{name}: expected a list of strings")
        _bind_dim(name, wire.dim, len(value), dims)
        return value
    if isinstance(wire, Lineage):
        if not isinstance(value, dict) or len(value) > MAX_LINEAGE_ENTRIES:
            raise SchemaError(f"{name}: expected a map of at most {MAX_LINEAGE_ENTRIES} entries")
        for key, item in value.items():
            if not isinstance(key, str) or not (item is None or isinstance(item, (str, int, float, bool))):
                raise SchemaError(f"{name}: entry {key!r} must map a string to a string, number, bool or null")
            if isinstance(item, float) and not math.isfinite(item):
                raise SchemaError(f"{name}: entry {key!r} is not a finite number")
        return value
    return _check_scalar(name, wire.kind, value)


def decode(data: bytes, expected: type | tuple[type, ...] | None = None) -> Any:
    """Decode and validate msgpack bytes into a message.

    Args:
        data: the raw bytes of one message.
        expected: if given, the message must be of this type (e.g. the type a topic carries), or of one of these.
    Raises:
        SchemaError: for anything that is not a valid message of a known schema and version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(f"expected bytes, got {type(data).__name__}")
    size = len(data)
    try:
        # Every container and blob is bounded by the input's own size, so a forged length cannot allocate more.
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError, UnicodeDecodeError...)
        raise SchemaError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise SchemaError(f"a message must be a msgpack map, got {type(raw).__name__}")
    schema, version = raw.get("schema"), raw.get("version")
    cls = MESSAGE_TYPES.get(schema) if isinstance(schema, str) else None
    if cls is None:
        raise SchemaError(f"unknown schema {schema!r}")
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if expected is not None and cls not in allowed:
        raise SchemaError(f"expected a {' or '.join(repr(t.SCHEMA) for t in allowed)} message, got {schema!r}")
    if version != cls.VERSION:
        upgrade = cls.UPGRADES.get(version) if isinstance(version, int) and not isinstance(version, bool) else None
        if upgrade is None:
            raise SchemaError(
                f"{schema}: unsupported schema version {version!r} (this build reads version {cls.VERSION}"
                f"{''.join(f', {v}' for v in sorted(cls.UPGRADES))})"
            )
        raw = upgrade(raw)
    wire_fields = cls.wire_fields()
    names = {name for name, _ in wire_fields}
    present = set(raw) - {"schema", "version"}
    if present != names:
        missing, extra = sorted(names - present), sorted(str(k) for k in present - names)
        raise SchemaError(f"{schema}: missing fields {missing}, unexpected fields {extra}")
    dims: dict[str, int] = {}
    values = {name: _check_field(name, wire, raw[name], dims) for name, wire in wire_fields}
    cls.check(values, dims)
    return cls(**values)
