"""The weight store: snapshots round-trip, tied weights survive, and bad snapshots are rejected untouched."""

import hashlib
from pathlib import Path

import pytest
import torch

from common.models import load_actor
from common.weights import WeightIntegrityError, WeightStore, load_snapshot_into


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def file_digest(path, algorithm):
    import blake3

    data = open(path, "rb").read()
    return f"{algorithm}:{(blake3.blake3 if algorithm == 'blake3' else hashlib.sha256)(data).hexdigest()}"


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_snapshot_round_trip_with_tied_embeddings(tiny_model, tmp_path, algorithm):
    source = perturbed(load_actor(tiny_model))
    assert source.config.tie_word_embeddings
    snapshot = WeightStore(tmp_path, algorithm).save("actor", 3, source)
    # Taken from the tensors in memory while writing, it is the digest of the file's bytes.
    assert snapshot.digest == file_digest(snapshot.uri, algorithm)
    target = load_actor(tiny_model)
    load_snapshot_into(target, snapshot.chain)
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    # Stored once, under the input embedding's name, as transformers checkpoints do (vLLM skips lm_head if tied).
    from safetensors import safe_open

    with safe_open(snapshot.uri, "pt") as stored:
        names = set(stored.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize(
    "damage", ["truncate", "empty", "flip", "flip-header", "wrong-digest", "unknown-algorithm", "missing"]
)
def test_damaged_snapshots_are_rejected_and_leave_the_model_unchanged(tiny_model, tmp_path, damage, algorithm):
    snapshot = WeightStore(tmp_path, algorithm).save("actor", 1, perturbed(load_actor(tiny_model)))
    data = open(snapshot.uri, "rb").read()
    digest = snapshot.digest
    if damage == "truncate":
        open(snapshot.uri, "wb").write(data[: len(data) // 2])
    elif damage == "empty":
        open(snapshot.uri, "wb").close()
    elif damage in ("flip", "flip-header"):
        at = -10 if damage == "flip" else 20
        open(snapshot.uri, "wb").write(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    elif damage == "wrong-digest":
        digest = f"{algorithm}:{'0' * 64}"
    elif damage == "unknown-algorithm":
        digest = "md5:" + digest.partition(":")[2]
    else:
        tmp_path.joinpath(snapshot.uri.rsplit("/", 1)[1]).unlink()
    target = load_actor(tiny_model)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(WeightIntegrityError):
        load_snapshot_into(target, [f"{digest} {snapshot.uri}"])
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_snapshot_of_another_architecture_is_rejected(tiny_model, tmp_path):
    from common.models import load_critic

    snapshot = WeightStore(tmp_path).save("critic", 1, load_critic(tiny_model))
    with pytest.raises(WeightIntegrityError, match="does not fit"):
        load_snapshot_into(load_actor(tiny_model), snapshot.chain)


def test_prune_keeps_the_newest(tiny_model, tmp_path):
    store = WeightStore(tmp_path)
    model = load_actor(tiny_model)
    for version in range(5):
        store.save("actor", version, model)
    store.save("critic", 0, model)
    deleted = store.prune("actor", keep=2, current=4)
    assert len(deleted) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "actor-v00000003.safetensors",
        "actor-v00000004.safetensors",
        "critic-v00000000.safetensors",
    ]


def test_prune_never_drops_the_snapshot_just_written(tiny_model, tmp_path):
    """Snapshots of a longer earlier run (or of updates a crash rolled back) are above the current version."""
    store = WeightStore(tmp_path)
    model = load_actor(tiny_model)
    for version in (5, 6, 7):
        store.save("actor", version, model)
    store.save("actor", 1, model)
    store.prune("actor", keep=3, current=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor-v00000001.safetensors"]


def test_snapshots_are_readable_by_other_users(tiny_model, tmp_path):
    snapshot = WeightStore(tmp_path).save("actor", 1, load_actor(tiny_model))
    assert Path(snapshot.uri).stat().st_mode & 0o777 == 0o644


def test_a_bfloat16_snapshot_is_digested_as_written(tiny_model, tmp_path):
    from common.weights import snapshot_state

    state = {k: v.to(torch.bfloat16) for k, v in snapshot_state(perturbed(load_actor(tiny_model))).items()}
    snapshot = WeightStore(tmp_path).save_state("actor", 2, state)
    assert snapshot.digest == file_digest(snapshot.uri, "blake3")
    target = load_actor(tiny_model)
    load_snapshot_into(target, snapshot.chain)
    assert torch.equal(target.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())


def test_an_unknown_digest_algorithm_is_refused_by_the_store(tmp_path):
    with pytest.raises(WeightIntegrityError, match="unknown digest algorithm 'md5'"):
        WeightStore(tmp_path, "md5")


def bf16_state(model, seed, scale):
    """The model's snapshot state in bfloat16 after a small update: few elements change at bf16 precision."""
    from common.weights import snapshot_state

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return {k: v.to(torch.bfloat16) for k, v in snapshot_state(model).items()}


def test_deltas_chain_to_the_newest_full_snapshot_and_rebuild_each_version(tiny_model, tmp_path):
    store = WeightStore(tmp_path, full_every=3)
    model, states, snapshots = load_actor(tiny_model), [], []
    for version in range(5):
        states.append(bf16_state(model, version, 1e-6))
        snapshots.append(store.save_state("actor", version, states[-1]))
    assert [s.is_delta for s in snapshots] == [False, True, True, False, True], "full every 3 versions"
    assert [len(s.chain) for s in snapshots] == [1, 2, 3, 1, 2]
    assert snapshots[1].num_bytes * 5 < snapshots[0].num_bytes, "a delta of a small bf16 update is small"
    for version in (1, 2, 4):  # a reader that missed versions needs nothing but the chain
        target = load_actor(tiny_model, "bfloat16")
        load_snapshot_into(target, snapshots[version].chain)
        for name, tensor in states[version].items():
            assert torch.equal(target.state_dict()[name], tensor), (version, name)


def test_a_chain_with_a_missing_or_foreign_link_is_refused_and_the_model_kept(tiny_model, tmp_path):
    store = WeightStore(tmp_path, full_every=4)
    model = load_actor(tiny_model)
    snapshots = [store.save_state("actor", v, bf16_state(model, v, 1e-5)) for v in range(3)]
    target = load_actor(tiny_model, "bfloat16")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(WeightIntegrityError, match="applies to"):  # version 1 skipped: 2 is not chained to 0
        load_snapshot_into(target, [snapshots[0].chain[0], snapshots[2].chain[-1]])
    with pytest.raises(WeightIntegrityError, match="chain starts with it"):
        load_snapshot_into(target, snapshots[2].chain[1:])
    Path(snapshots[1].uri).unlink()
    with pytest.raises(WeightIntegrityError, match="cannot be read"):
        load_snapshot_into(target, snapshots[2].chain)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_float32_updates_change_every_element_so_snapshots_stay_full(tiny_model, tmp_path):
    from common.weights import snapshot_state

    store = WeightStore(tmp_path, full_every=8)
    model = perturbed(load_actor(tiny_model))
    first = store.save("actor", 0, model)
    second = store.save("actor", 1, perturbed(model))
    assert not second.is_delta and second.chain == (f"{second.digest} {second.uri}",)
    assert second.num_bytes == first.num_bytes
    unchanged = store.save_state("actor", 2, snapshot_state(model))
    assert unchanged.is_delta and unchanged.num_bytes < 1024, "nothing changed: an empty delta"


def test_pruning_keeps_every_link_of_the_current_chain(tiny_model, tmp_path):
    store = WeightStore(tmp_path, full_every=5)
    model = load_actor(tiny_model)
    for version in range(4):
        snapshot = store.save_state("actor", version, bf16_state(model, version, 1e-5))
        store.prune("actor", keep=2, current=version)
    assert len(list(tmp_path.glob("actor-*"))) == 4, "versions 0..3 form the chain of version 3"
    load_snapshot_into(load_actor(tiny_model, "bfloat16"), snapshot.chain)


def split_into_parts(state, count, algorithm="blake3"):
    """``write_parts`` as the learner's ranks do it, here from one process: ``count`` parts of ``state``."""
    from common.weights import write_part

    def write_parts(folder):
        names = sorted(state)
        parts = []
        for rank in range(count):
            mine = {n: state[n] for n in names[rank::count]}
            name = f"part-{rank:05d}-of-{count:05d}.safetensors"
            parts.append(
                (name, write_part(folder, name, mine, algorithm), {n: tuple(t.shape) for n, t in mine.items()})
            )
        return parts

    return write_parts


def test_a_sharded_snapshot_is_verified_and_loaded_part_by_part(tiny_model, tmp_path):
    from common.weights import snapshot_shapes, snapshot_state

    source = perturbed(load_actor(tiny_model))
    state = snapshot_state(source)
    store = WeightStore(tmp_path)
    snapshot = store.save_sharded("actor", 4, split_into_parts(state, 3))
    assert snapshot.uri.endswith("actor-v00000004.index.json") and len(snapshot.chain) == 1
    assert len(list((tmp_path / "actor-v00000004.parts").iterdir())) == 3
    assert snapshot_shapes(snapshot.uri) == {k: tuple(v.shape) for k, v in state.items()}
    target = load_actor(tiny_model)
    load_snapshot_into(target, snapshot.chain)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


@pytest.mark.parametrize("damage", ["flip-a-part", "remove-a-part", "edit-the-index"])
def test_a_damaged_sharded_snapshot_is_refused_and_the_model_kept(tiny_model, tmp_path, damage):
    from common.weights import snapshot_state

    snapshot = WeightStore(tmp_path).save_sharded(
        "actor", 1, split_into_parts(snapshot_state(perturbed(load_actor(tiny_model))), 2)
    )
    part = tmp_path / "actor-v00000001.parts" / "part-00001-of-00002.safetensors"
    if damage == "flip-a-part":
        data = part.read_bytes()
        part.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif damage == "remove-a-part":
        part.unlink()
    else:
        index = Path(snapshot.uri)
        index.write_text(index.read_text().replace("part-00001", "part-00000", 1))
    target = load_actor(tiny_model)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(WeightIntegrityError):
        load_snapshot_into(target, snapshot.chain)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_pruning_removes_old_sharded_snapshots_with_their_parts(tiny_model, tmp_path):
    from common.weights import snapshot_state

    store = WeightStore(tmp_path)
    state = snapshot_state(load_actor(tiny_model))
    for version in range(3):
        store.save_sharded("actor", version, split_into_parts(state, 2))
    store.prune("actor", keep=1, current=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor-v00000002.index.json", "actor-v00000002.parts"]
