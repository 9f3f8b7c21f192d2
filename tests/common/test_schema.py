"""The wire contract: round trips, the published protos, and hostile input."""

import dataclasses
import struct
import time

import msgpack
import numpy as np
import pytest
import yaml
from conftest import REPO
from helpers import started
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import schema
from common.schema import (
    MESSAGE_TYPES,
    DeadLetter,
    ExperienceBatch,
    PromptBatch,
    RolloutBatch,
    SchemaError,
    ScoredBatch,
    WeightAnnouncement,
    decode,
    describe,
    encode,
)
from common.schema.wire import Array, Lineage, StringList
from services.service import Service

PROTOS = REPO / "protos"


# The fields that rollouts version 4 (experience 5) added for multi-turn episodes, and version 5 (experience 6) for
# gateways.
EPISODE_FIELDS = ("response_mask", "turns", "environment_reward")
GATEWAY_FIELDS = ("dead_lettered_groups",)


def sample_message(cls, rng: np.random.Generator, dims: dict[str, int] | None = None):
    """A valid message of ``cls`` with random content."""
    dims = {"K": 2, "J": 1, "S": 2, "D": 0} | (dims or {"B": 2, "N": 3, "P": 4, "T": 5, "L": 2, "G": 1})
    values = {}
    for name, wire in cls.wire_fields():
        if isinstance(wire, Array):
            shape = [dims[d] for d in wire.dims]
            if name.endswith("_lengths"):
                width = dims["P" if name.startswith("prompt") else "T"]
                values[name] = rng.integers(0, width + 1, size=shape).astype(wire.dtype)
            elif wire.dtype == "bool":
                values[name] = rng.random(shape) > 0.5
            elif wire.dtype.startswith("int"):
                values[name] = rng.integers(0, 50, size=shape).astype(wire.dtype)
            else:
                values[name] = rng.standard_normal(shape).astype(wire.dtype)
        elif isinstance(wire, StringList):
            values[name] = [f"text {i} ✓" for i in range(dims[wire.dim])]
        elif isinstance(wire, Lineage):
            values[name] = {"sampling.temperature": 0.7, "actor.model": "m", "n": 4, "flag": True, "none": None}
        else:
            values[name] = {"str": "x-1", "int": 7, "float": 1.5, "bool": True, "bytes": b"\x00\x01"}[wire.kind]
    if cls is schema.EpisodeTurn:  # turn k carries k + 1 model turns and k observations
        values["turn"] = dims["K"] - 1
    if cls is WeightAnnouncement:  # a chain ends with the snapshot announced
        values["chain"][-1] = f"{values['digest']} {values['uri']}"
    if "response_mask" in values:  # the model's tokens lie among the real ones; an episode has a turn at least
        values["response_mask"] &= np.arange(dims["T"]) < values["response_lengths"][:, None]
        values["turns"] = values["turns"] % 3 + 1
    if cls is schema.CompletionRequest:  # sampling settings within their bounds
        values["top_p"] = 0.9
    if cls in (schema.Completion, schema.EpisodeEvent):  # a call's answer
        values["finish_reason"] = "stop"
    if cls is schema.EpisodeEvent:
        values["kind"] = "call"
    if "token_versions" in values:  # the header names the oldest version that sampled a token
        real = values.get("response_mask", np.ones(values["token_versions"].shape, bool))
        values["policy_version"] = int(values["token_versions"][real].min()) if real.any() else 7
    return cls(**values)


def assert_messages_equal(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("cls", MESSAGE_TYPES.values(), ids=MESSAGE_TYPES.keys())
def test_round_trip(cls):
    message = sample_message(cls, np.random.default_rng(0))
    assert_messages_equal(decode(encode(message)), message)


@pytest.mark.parametrize("cls", MESSAGE_TYPES.values(), ids=MESSAGE_TYPES.keys())
def test_protos_describe_the_code(cls):
    published = yaml.safe_load((PROTOS / f"{cls.SCHEMA}.yaml").read_text())
    assert published == describe(cls), "protos/ is out of date: run `streamppo protos --write`"


_WIRE_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes}


@pytest.mark.parametrize("cls", MESSAGE_TYPES.values(), ids=MESSAGE_TYPES.keys())
def test_encoded_bytes_follow_the_protos(cls):
    """Read real encoded bytes with plain msgpack and check each field against the published file."""
    published = yaml.safe_load((PROTOS / f"{cls.SCHEMA}.yaml").read_text())
    raw = msgpack.unpackb(encode(sample_message(cls, np.random.default_rng(1))), raw=False)
    assert raw.pop("schema") == published["schema"] and raw.pop("version") == published["version"]
    assert set(raw) == set(published["fields"])
    dims = {}
    for name, spec in published["fields"].items():
        value = raw[name]
        if spec["type"] == "array":
            assert set(value) == {"dtype", "shape", "data"}
            assert value["dtype"] == spec["dtype"] and len(value["shape"]) == len(spec["shape"])
            assert len(value["data"]) == np.prod(value["shape"]) * np.dtype(spec["dtype"]).itemsize
            for dim, size in zip(spec["shape"], value["shape"]):
                assert dims.setdefault(dim, size) == size
        elif spec["type"] == "list[str]":
            assert all(isinstance(v, str) for v in value)
            assert dims.setdefault(spec["shape"][0], len(value)) == len(value)
        elif spec["type"].startswith("map"):
            assert isinstance(value, dict)
        else:
            assert isinstance(value, _WIRE_TYPES[spec["type"]])


def test_arrays_are_little_endian_on_the_wire():
    message = sample_message(PromptBatch, np.random.default_rng(2))
    message.prompt_tokens = message.prompt_tokens.astype(">i8")  # a big-endian producer array
    raw = msgpack.unpackb(encode(message), raw=False)
    first = struct.unpack("<q", raw["prompt_tokens"]["data"][:8])[0]
    assert first == int(message.prompt_tokens.flat[0])
    assert np.array_equal(decode(encode(message)).prompt_tokens, message.prompt_tokens)


def test_encode_refuses_what_decode_would_reject():
    message = sample_message(ExperienceBatch, np.random.default_rng(3))
    message.values = message.values[:, :2]  # T disagrees with the other arrays
    with pytest.raises(SchemaError, match="dimension T"):
        encode(message)
    message = sample_message(ExperienceBatch, np.random.default_rng(3))
    message.returns[0, 0] = np.nan
    with pytest.raises(SchemaError, match="NaN"):
        encode(message)


# --------------------------------------------------------------------------------------------- hostile input

VALID = encode(sample_message(ExperienceBatch, np.random.default_rng(4)))


def mutate(**changes) -> bytes:
    raw = msgpack.unpackb(VALID, raw=False)
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return msgpack.packb(raw, use_bin_type=True)


def _array(dtype, shape, data):
    return {"dtype": dtype, "shape": shape, "data": data}


HOSTILE = {
    "empty": b"",
    "not msgpack": b"\xc1\xc1\xc1",
    "a list, not a map": msgpack.packb([1, 2, 3]),
    "unknown schema": mutate(schema="bananas"),
    "unknown version": mutate(version=99),
    "version as string": mutate(version="1"),
    "missing field": mutate(values=KeyError),
    "extra field": mutate(surprise=1),
    "int for str": mutate(batch_id=5),
    "bool for int": mutate(policy_version=True),
    "string for float": mutate(created_at="now"),
    "nan float": mutate(created_at=float("nan")),
    "array as list": mutate(values=[[1.0]]),
    "array missing data": mutate(values={"dtype": "float32", "shape": [3, 5]}),
    "wrong dtype": mutate(values=_array("float64", [3, 5], b"\x00" * 120)),
    "unknown dtype": mutate(values=_array("object", [3, 5], b"\x00" * 60)),
    "wrong rank": mutate(values=_array("float32", [15], b"\x00" * 60)),
    "shape/data mismatch": mutate(values=_array("float32", [3, 5], b"\x00" * 59)),
    "negative shape": mutate(values=_array("float32", [-3, -5], b"\x00" * 60)),
    "absurd declared size": mutate(values=_array("float32", [2**40, 2**40], b"\x00" * 60)),
    "shape as floats": mutate(values=_array("float32", [3.0, 5.0], b"\x00" * 60)),
    "inconsistent N": mutate(scores=_array("float32", [4], b"\x00" * 16)),
    "nan in array": mutate(scores=_array("float32", [3], np.array([0, np.nan, 0], "<f4").tobytes())),
    "length beyond width": mutate(response_lengths=_array("int64", [3], np.array([1, 6, 0], "<i8").tobytes())),
    "negative token id": mutate(response_tokens=_array("int64", [3, 5], np.full(15, -1, "<i8").tobytes())),
    "lineage with nested map": mutate(lineage={"a": {"b": 1}}),
    "strings of wrong count": mutate(response_text=["only one"]),
    "forged array32 header": b"\x81\xa6schema\xdd\xff\xff\xff\xff",
    "forged bin32 header": b"\x81\xa6schema\xc6\xff\xff\xff\xf0abc",
    "forged map32 header": b"\xdf\xff\xff\xff\xff",
    "trailing bytes": VALID + b"\x00",
    "ext type": msgpack.packb(msgpack.ExtType(5, b"hello")),
}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_input_raises_schema_error(data):
    started = time.perf_counter()
    with pytest.raises(SchemaError):
        decode(data)
    assert time.perf_counter() - started < 5, "decoding hostile input must not hang"


def test_truncations_of_a_valid_message_all_fail_cleanly():
    for cut in range(0, len(VALID), 7):
        with pytest.raises(SchemaError):
            decode(VALID[:cut])


def test_decode_checks_the_topic_type():
    with pytest.raises(SchemaError, match="expected a 'weights' message"):
        decode(VALID, expected=WeightAnnouncement)


def test_schema_error_names_the_field():
    with pytest.raises(SchemaError, match="response_lengths"):
        decode(HOSTILE["length beyond width"])
    with pytest.raises(SchemaError, match=r"missing fields \['values'\]"):
        decode(HOSTILE["missing field"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    try:
        decode(data)
    except SchemaError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_fuzz_bit_flips_and_splices_of_valid_messages(data):
    base = bytearray(data.draw(st.sampled_from([VALID, encode(sample_message(DeadLetter, np.random.default_rng(5)))])))
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(base) - 1))
        base[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(base)))
        base = base[:cut] + data.draw(st.binary(max_size=64))
    try:
        message = decode(bytes(base))
    except SchemaError:
        return
    # Whatever survives a mutation is a fully valid message: it encodes again and decodes to itself.
    assert_messages_equal(decode(encode(message)), message)


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True), st.text(max_size=8)
)
msgpack_values = st.recursive(
    json_scalars | st.binary(max_size=16),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.text(max_size=12), msgpack_values, max_size=8))
def test_fuzz_structured_maps(name, fields):
    raw = {"schema": name, "version": 1, **fields}
    try:
        decode(msgpack.packb(raw, use_bin_type=True))
    except SchemaError:
        pass


def test_older_replica_reports_read_as_serving_nowhere():
    from common.schema import ReplicaStatus

    report = ReplicaStatus("gateway-0", "gateway", "r", "serving", "", 0, 0.0, 0, {}, 1.0, "http://127.0.0.1:8400")
    raw = msgpack.unpackb(encode(report), raw=False)
    assert raw["version"] == 2 and decode(encode(report)).url == "http://127.0.0.1:8400"
    raw["version"] = 1  # version 1 had no url
    del raw["url"]
    assert decode(msgpack.packb(raw, use_bin_type=True), expected=ReplicaStatus).url == ""


def test_older_weight_announcements_read_as_version_3():
    current = sample_message(WeightAnnouncement, np.random.default_rng(5))
    raw = msgpack.unpackb(encode(current), raw=False)
    assert raw["version"] == 3
    # Version 2 had no broadcast path: nothing was broadcast.
    raw["version"] = 2
    del raw["broadcast_digest"]
    v2 = decode(msgpack.packb(raw, use_bin_type=True))
    assert v2.broadcast_digest == "" and v2.chain == current.chain
    # Version 1 named its digest sha256 (hex), and had no chain.
    raw["version"], raw["sha256"] = 1, "ab" * 32
    del raw["digest"], raw["chain"]
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert old.digest == "sha256:" + "ab" * 32 and old.uri == current.uri and old.broadcast_digest == ""
    assert old.chain == [f"{old.digest} {old.uri}"], "a version 1 snapshot is always full"
    raw["sha256"] = 7  # an upgrade does not hide what is wrong with the old record
    with pytest.raises(SchemaError, match="missing fields \\['broadcast_digest', 'chain', 'digest'\\], unexpected "):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw["version"] = 4
    with pytest.raises(SchemaError, match="unsupported schema version 4 .this build reads version 3, 1, 2."):
        decode(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize("cls", [PromptBatch, RolloutBatch, ScoredBatch, ExperienceBatch], ids=lambda c: c.SCHEMA)
def test_messages_from_before_labels_read_with_empty_labels(cls):
    current = sample_message(cls, np.random.default_rng(6))
    raw = msgpack.unpackb(encode(current), raw=False)
    assert raw["version"] == cls.VERSION
    raw["version"] = 1
    del raw["prompt_label"]
    raw.pop("no_signal_groups", None)  # experience version 3 added it
    raw.pop("token_versions", None)  # rollouts version 3 (experience 4) added it
    for name in EPISODE_FIELDS + GATEWAY_FIELDS:  # rollouts version 4 (experience 5) added them, and 5 (6)
        raw.pop(name, None)
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert old.prompt_label == [""] * len(current.prompt_text) and old.prompt_text == current.prompt_text
    raw["prompt_text"] = "not a list"  # an upgrade does not hide what is wrong with the old record
    with pytest.raises(SchemaError, match="missing fields \\['prompt_label'\\]"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_experience_from_before_dynamic_sampling_reads_with_no_group_dropped():
    current = sample_message(ExperienceBatch, np.random.default_rng(7))
    raw = msgpack.unpackb(encode(current), raw=False)
    raw["version"] = 2
    del raw["no_signal_groups"], raw["token_versions"]
    for name in EPISODE_FIELDS + GATEWAY_FIELDS:
        del raw[name]
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert old.no_signal_groups.shape == (0,) and old.no_signal_groups.dtype == np.int64
    np.testing.assert_array_equal(old.advantages, current.advantages)


@pytest.mark.parametrize("cls", [RolloutBatch, ScoredBatch, ExperienceBatch], ids=lambda c: c.SCHEMA)
def test_records_from_before_token_versions_read_as_sampled_by_their_header_version(cls):
    current = sample_message(cls, np.random.default_rng(9), {"B": 2, "N": 3, "P": 4, "T": 5, "L": 2, "G": 1})
    current.response_lengths, current.policy_version = np.array([5, 2, 0]), 7
    raw = msgpack.unpackb(encode(current), raw=False)
    raw["version"] = 3 if cls is ExperienceBatch else 2
    for name in EPISODE_FIELDS + GATEWAY_FIELDS + ("token_versions",):
        del raw[name]
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert old.token_versions.tolist() == [[7] * 5, [7, 7, 0, 0, 0], [0] * 5], "the header's, 0 at padding"
    assert old.row_versions().tolist() == [7, 7, 7]


@pytest.mark.parametrize("cls", [RolloutBatch, ScoredBatch, ExperienceBatch], ids=lambda c: c.SCHEMA)
def test_records_from_before_episodes_read_as_single_answers(cls):
    current = sample_message(cls, np.random.default_rng(11), {"B": 2, "N": 3, "P": 4, "T": 5, "L": 2, "G": 1})
    current.response_lengths = np.array([5, 2, 0])
    current.response_mask = np.arange(5) < current.response_lengths[:, None]
    current.token_versions = np.where(current.response_mask, 3, 0).astype(np.int32)
    current.policy_version = 3
    raw = msgpack.unpackb(encode(current), raw=False)
    raw["version"] = cls.VERSION - 2
    for name in EPISODE_FIELDS + GATEWAY_FIELDS:
        del raw[name]
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert old.response_mask.tolist() == current.response_mask.tolist(), "every real token the model's"
    assert old.turns.tolist() == [1, 1, 1] and old.environment_reward.tolist() == [0.0, 0.0, 0.0]
    assert old.model_tokens().tolist() == [5, 2, 0]


@pytest.mark.parametrize("cls", [RolloutBatch, ScoredBatch, ExperienceBatch], ids=lambda c: c.SCHEMA)
def test_records_from_before_gateways_read_with_no_group_dead_lettered(cls):
    current = sample_message(cls, np.random.default_rng(13))
    raw = msgpack.unpackb(encode(current), raw=False)
    raw["version"] = cls.VERSION - 1
    del raw["dead_lettered_groups"]
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert old.dead_lettered_groups.shape == (0,) and old.dead_lettered_groups.dtype == np.int64
    assert old.groups_accounted() == sorted({*current.groups(), *getattr(current, "no_signal_groups", [])})


def test_a_group_dead_lettered_whole_is_accounted_for_and_deduplicated():
    message = sample_message(RolloutBatch, np.random.default_rng(14))
    message.dead_lettered_groups = np.array([9], np.int64)
    assert f"{message.step}/9" in message.idempotency_keys() and 9 in message.groups_accounted()
    trimmed = message.without_groups({f"{message.step}/9"})
    assert trimmed.dead_lettered_groups.tolist() == [] and trimmed.groups() == message.groups()


def test_a_mask_that_marks_padding_as_the_models_is_refused():
    message = sample_message(RolloutBatch, np.random.default_rng(12), {"B": 2, "N": 2, "P": 4, "T": 4, "L": 2})
    message.response_lengths = np.array([2, 4])
    message.response_mask = np.array([[True, False, True, False], [True] * 4])  # row 0: a model token past length
    message.token_versions = np.where(message.response_mask, 1, 0).astype(np.int32)
    message.policy_version = 1
    with pytest.raises(SchemaError, match="response_mask marks padding"):
        decode(encode(message))
    message.response_mask[0, 2] = False
    message.turns = np.array([1, 0])
    with pytest.raises(SchemaError, match="turns must be at least 1"):
        decode(encode(message))


def test_an_episodes_versions_are_its_model_tokens():
    message = sample_message(RolloutBatch, np.random.default_rng(13), {"B": 1, "N": 1, "P": 4, "T": 6, "L": 2})
    # Two model turns (versions 4, then 5 after an in-flight update) around two environment tokens (version 0).
    message.response_lengths = np.array([6])
    message.response_mask = np.array([[True, True, False, False, True, True]])
    message.token_versions = np.array([[4, 4, 0, 0, 5, 5]], dtype=np.int32)
    message.policy_version, message.turns = 4, np.array([2])
    decoded = decode(encode(message))
    assert decoded.row_versions().tolist() == [4] and decoded.newest_version() == 5
    assert decoded.model_tokens().tolist() == [4] and decoded.response_tokens_total == 6


def test_a_response_is_as_old_as_its_oldest_token():
    message = sample_message(RolloutBatch, np.random.default_rng(10), {"B": 2, "N": 3, "P": 4, "T": 4, "L": 2})
    message.response_lengths, message.policy_version = np.array([4, 2, 0]), 5
    message.response_mask = np.arange(4) < message.response_lengths[:, None]
    # Row 0: new weights landed after its second token; row 1: its padding says nothing; row 2: empty.
    message.token_versions = np.array([[5, 5, 6, 6], [6, 6, 0, 0], [0, 0, 0, 0]], dtype=np.int32)
    assert message.row_versions().tolist() == [5, 6, 5]


def test_groups_are_keyed_by_step_and_row_and_a_record_sheds_the_ones_handled():
    rng = np.random.default_rng(8)
    message = sample_message(ExperienceBatch, rng, {"B": 2, "N": 6, "P": 4, "T": 5, "L": 2, "G": 1})
    message.step, message.group_index = 7, np.array([2, 2, 0, 0, 5, 5])
    message.no_signal_groups = np.array([3])
    assert message.groups() == [0, 2, 5] and message.groups_accounted() == [0, 2, 3, 5]
    assert message.idempotency_keys() == ["7/0", "7/2", "7/3", "7/5"]
    rest = message.without_groups({"7/2", "7/3"})
    assert rest.groups() == [0, 5] and rest.no_signal_groups.tolist() == []
    np.testing.assert_array_equal(rest.advantages, message.advantages[2:])
    assert rest.response_text == message.response_text[2:] and rest.step == 7
    decode(encode(rest))  # still a valid record
    empty = message.take_rows(np.zeros(6, dtype=bool))
    assert empty.rows == 0 and empty.idempotency_keys() == ["7/3"]
    assert decode(encode(empty)).rows == 0, "a record whose groups all had no signal still travels"


def test_a_client_decodes_every_record_of_a_run_s_log_from_the_protos_alone(make_config):
    """What a client in another language does: every topic of a finished run, read with plain msgpack and checked
    against protos/ (the log's identity, the one record that is not a map, by protos/log-identity.yaml)."""
    import re

    from services.launch.embedded import run_embedded
    from services.roles import STATUS_TOPIC, pipeline_topics
    from services.transport import MemoryBus

    bus = MemoryBus()
    config = make_config("run.steps=1", "data.eval_prompts=0")
    run_embedded(config, progress=False, bus=bus)
    started(_StatusOnly(config), bus).publish_status()  # a status record too (the embedded run writes none)
    identity = yaml.safe_load((PROTOS / "log-identity.yaml").read_text())
    files = {p.stem: yaml.safe_load(p.read_text()) for p in PROTOS.glob("*.yaml") if p.stem != "log-identity"}
    by_schema = {spec["schema"]: spec for spec in files.values()}
    seen = set()
    for spec in pipeline_topics():
        for record in bus.consumer(spec.name, None, "outsider").poll(0.0, max_records=10_000):
            seen.add(spec.name)
            if spec.name == identity["topic"]:
                assert re.fullmatch(identity["value"]["pattern"], record.value.decode("ascii"))
                continue
            raw = msgpack.unpackb(record.value, raw=False)
            published = by_schema[raw.pop("schema")]
            assert raw.pop("version") == published["version"] and set(raw) == set(published["fields"]), spec.name
    assert {"log-identity", STATUS_TOPIC, "prompts", "rollouts", "scored", "experience", "weights"} <= seen


class _StatusOnly(Service):
    """A replica that only says how it is (the embedded run publishes no status)."""

    role = "scorer"

    def process(self, message):
        return []
