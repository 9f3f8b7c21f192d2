"""The batch topics' messages, in pipeline order: a prompt batch, its rollouts, scored, then experience; each with
the upgrades from the versions this build still reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from common.schema.base import BatchMessage, chain_upgrades
from common.schema.wire import (
    Array,
    SchemaError,
    StringList,
    array,
    group_key,
    wire_field,
)


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
    prompt_text: list = wire_field(StringList("B", "The prompts as text."))
    prompt_label: list = wire_field(StringList("B", _LABEL_DOC))
    prompt_tokens: np.ndarray = array("int64", "B", "P", doc="Prompt token ids, right-padded.")
    prompt_lengths: np.ndarray = array("int64", "B", doc="Number of real tokens in each prompt row.")

    @property
    def rows(self) -> int:
        return len(self.prompt_lengths)


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
        1: chain_upgrades(_unlabelled_v1_to_v2, _one_version_per_token, _every_token_the_models, _no_dead_letters),
        2: chain_upgrades(_one_version_per_token, _every_token_the_models, _no_dead_letters),
        3: chain_upgrades(_every_token_the_models, _no_dead_letters),
        4: _no_dead_letters,
    }

    group_index: np.ndarray = array("int64", "N", doc="Row of the prompt batch each response was sampled for.")
    prompt_text: list = wire_field(StringList("N", "Prompt of each response, as text."))
    prompt_label: list = wire_field(StringList("N", "Label of each response's prompt. " + _LABEL_DOC))
    response_text: list = wire_field(StringList("N", "Each response decoded to text (special tokens removed)."))
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
        1: chain_upgrades(
            _unlabelled_v1_to_v2,
            _experience_v2_to_v3,
            _one_version_per_token,
            _every_token_the_models,
            _no_dead_letters,
        ),
        2: chain_upgrades(_experience_v2_to_v3, _one_version_per_token, _every_token_the_models, _no_dead_letters),
        3: chain_upgrades(_one_version_per_token, _every_token_the_models, _no_dead_letters),
        4: chain_upgrades(_every_token_the_models, _no_dead_letters),
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
