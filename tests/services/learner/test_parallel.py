"""The sharded learner (FSDP2 over gloo ranks on CPU) against the single-process one, and micro-batching by a
token budget against whole mini-batches."""

import os
import subprocess
import sys

import pytest
import torch

from common.config import AlgorithmSection, LearnerSection
from common.models import enable_activation_checkpointing, load_actor, load_critic
from common.sequences import lengths_to_mask, micro_batches
from services.learner.trainer import PPOTrainer

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ranks_worker.py is there
sys.path.insert(0, TESTS)
from conftest import sampled_experience  # noqa: E402
from ranks_worker import trainer_settings  # noqa: E402

pytestmark = pytest.mark.slow  # ranks started by torch's launcher


@pytest.fixture(scope="module")
def experience(tiny_model, tmp_path_factory):
    """Twelve sampled responses of mixed lengths (prompts of 1..6 words), with random advantages and values."""
    texts = ["tell me about the cat today.", "hi", "say something nice!", "the sea", "a", "one two three"]
    tokenizer, exp = sampled_experience(tiny_model, texts, 12, seed=1, kl_scale=0.01)
    path = tmp_path_factory.mktemp("experience") / "experience.pt"
    torch.save(exp, path)
    return tokenizer, exp, path


def single_trainer(tiny_model, tokenizer, **overrides):
    return PPOTrainer(
        load_actor(tiny_model),
        load_critic(tiny_model),
        LearnerSection(**trainer_settings(overrides)),
        AlgorithmSection(),
        temperature=1.0,
        pad_token_id=tokenizer.pad_token_id,
    )


def run_ranks(ranks: int, tiny_model, experience_path, out, *args, settings=()):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        os.path.join(TESTS, "ranks_worker.py"),
        str(tiny_model),
        str(experience_path),
        str(out),
        *args,
    ]
    if settings:
        command += ["--set", *settings]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=False)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_ranks_make_the_update_one_process_makes(tiny_model, experience, tmp_path):
    tokenizer, exp, path = experience
    single = single_trainer(tiny_model, tokenizer)
    start = {k: v.clone() for k, v in single.full_state("actor").items()}
    stats = single.train(exp)
    sharded = run_ranks(2, tiny_model, path, tmp_path / "out.pt")
    for name in ("actor", "critic"):
        difference = max_difference(single.full_state(name), sharded["states"][name])
        print(f"{name}: max |2 ranks − 1 process| = {difference:.2e}")
        assert difference < 1e-5, name
    # The update moved the weights by far more than that difference: the comparison can fail.
    assert max_difference(start, single.full_state("actor")) > 1e-4
    for key in ("policy_loss", "value_loss", "entropy", "clip_frac", "approx_kl", "grad_norm_actor"):
        assert sharded["stats"][key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key


def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tiny_model, experience, tmp_path):
    """Two ranks apply an update and checkpoint; one rank resumes it and applies a second: as one process would."""
    tokenizer, exp, path = experience
    single = single_trainer(tiny_model, tokenizer)
    single.train(exp), single.train(exp)
    checkpoint = tmp_path / "ckpt"
    first = run_ranks(2, tiny_model, path, tmp_path / "first.pt", "--save", str(checkpoint))
    assert first["version"] == 1 and (checkpoint / "shards" / ".metadata").is_file()
    resumed = run_ranks(1, tiny_model, path, tmp_path / "resumed.pt", "--load", str(checkpoint))
    assert resumed["version"] == 2
    for name in ("actor", "critic"):
        assert max_difference(single.full_state(name), resumed["states"][name]) < 1e-5, name


def test_a_single_process_checkpoint_is_refused_by_a_sharded_learner_with_a_clear_error(
    tiny_model, experience, tmp_path
):
    tokenizer, exp, path = experience
    single = single_trainer(tiny_model, tokenizer)
    (tmp_path / "ckpt").mkdir()
    single.save(tmp_path / "ckpt")
    command = [sys.executable, os.path.join(TESTS, "ranks_worker.py"), str(tiny_model), str(path), str(tmp_path / "o")]
    result = subprocess.run(command + ["--load", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "was written by a single-process learner; this one is sharded" in result.stderr


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_two_ranks_with_a_token_budget_make_the_same_update(tiny_model, experience, tmp_path, agg):
    """Ranks with unequal numbers of passes (a budget that splits their rows differently) still keep in step."""
    tokenizer, exp, path = experience
    single = single_trainer(tiny_model, tokenizer, loss_agg=agg)
    single.train(exp)
    sharded = run_ranks(
        2, tiny_model, path, tmp_path / "out.pt", settings=[f"loss_agg={agg}", "max_tokens_per_microbatch=20"]
    )
    assert max_difference(single.full_state("actor"), sharded["states"]["actor"]) < 1e-5


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_token_budget_gives_the_losses_and_gradients_of_the_whole_batch(tiny_model, experience, agg):
    tokenizer, exp, _ = experience
    settings = dict(loss_agg=agg, ppo_epochs=1, mini_batch_size=len(exp.response_lengths))
    whole = single_trainer(tiny_model, tokenizer, **settings)
    budget = single_trainer(tiny_model, tokenizer, **settings, max_tokens_per_microbatch=16)
    passes = budget._passes(exp, torch.arange(len(exp.response_lengths)))
    assert len(passes) > 2, "the budget splits the batch"
    stats_whole, stats_budget = whole.train(exp), budget.train(exp)
    for model in ("actor", "critic"):
        for a, b in zip(getattr(whole, model).parameters(), getattr(budget, model).parameters()):
            assert a.grad is not None
            assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), model
    for key in ("policy_loss", "value_loss", "entropy", "clip_frac", "grad_norm_actor", "grad_norm_critic"):
        assert stats_budget[key] == pytest.approx(stats_whole[key], rel=1e-4, abs=1e-6), key


def test_micro_batches_keep_to_the_budget_sorted_by_length():
    prompt = torch.tensor([3, 1, 5, 2, 2, 9])
    response = torch.tensor([4, 1, 5, 2, 0, 9])  # lengths 7, 2, 10, 4, 2, 18
    groups = micro_batches(prompt, response, torch.arange(6), max_tokens=12)
    lengths = (prompt + response).tolist()
    assert sorted(i for g in groups for i in g.tolist()) == list(range(6)), "every row once"
    assert groups[0].tolist() == [5], "a row beyond the budget goes alone"
    for group in groups[1:]:
        assert len(group) * max(lengths[i] for i in group.tolist()) <= 12
    assert [lengths[i] for g in groups for i in g.tolist()] == sorted(lengths, reverse=True)
    assert [g.tolist() for g in micro_batches(prompt, response, torch.arange(6), max_rows=4)] == [[0, 1, 2, 3], [4, 5]]


def test_activation_checkpointing_gives_the_same_gradients(tiny_model, experience):
    tokenizer, exp, _ = experience
    settings = dict(ppo_epochs=1, mini_batch_size=len(exp.response_lengths))
    plain = single_trainer(tiny_model, tokenizer, **settings)
    recomputed = single_trainer(tiny_model, tokenizer, **settings)
    for model in (recomputed.actor, recomputed.critic):
        enable_activation_checkpointing(model)
    calls = {"plain": 0, "recomputed": 0}
    for name, trainer in (("plain", plain), ("recomputed", recomputed)):
        layer = trainer.actor.model.layers[0]
        layer.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    plain.train(exp), recomputed.train(exp)
    assert calls["recomputed"] > calls["plain"] > 0, f"the backward pass ran the layer again: {calls}"
    for a, b in zip(plain.actor.parameters(), recomputed.actor.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4)


def test_a_bfloat16_snapshot_is_half_the_size_and_loads_into_a_float32_model(tiny_model, experience, tmp_path):
    from common.weights import WeightStore, load_snapshot_into

    tokenizer, exp, _ = experience
    trainer = single_trainer(tiny_model, tokenizer)
    trainer.train(exp)
    store = WeightStore(tmp_path)
    full = store.save_state("actor", 1, trainer.full_state("actor", "float32"))
    half = store.save_state("actor", 2, trainer.full_state("actor", "bfloat16"))
    assert half.num_bytes < 0.55 * full.num_bytes
    reader = load_actor(tiny_model)
    load_snapshot_into(reader, half.chain)
    for name, tensor in trainer.actor.state_dict().items():
        loaded = reader.state_dict()[name]
        assert loaded.dtype == torch.float32
        assert torch.equal(loaded, tensor.to(torch.bfloat16).float()), name


def test_two_ranks_write_a_sharded_snapshot_each_rank_a_part_that_readers_load_whole(tiny_model, experience, tmp_path):
    from common.weights import load_snapshot_into

    _, _, path = experience
    sharded = run_ranks(2, tiny_model, path, tmp_path / "out.pt", "--snapshot", str(tmp_path / "store"))
    for name, load in (("actor", load_actor), ("critic", load_critic)):
        snapshot = sharded["snapshots"][name]
        parts = sorted((tmp_path / "store" / f"{name}-v00000001.parts").iterdir())
        assert [p.name for p in parts] == ["part-00000-of-00002.safetensors", "part-00001-of-00002.safetensors"]
        assert all(p.stat().st_size > 0.2 * snapshot.num_bytes for p in parts), "both ranks wrote a fair share"
        reader = load(tiny_model)
        load_snapshot_into(reader, snapshot.chain)
        for key, tensor in sharded["states"][name].items():
            assert torch.equal(reader.state_dict()[key], tensor), (name, key)


def test_the_scorer_and_advantage_passes_by_token_budget_match_one_pass(tiny_model, experience):
    """The reference log-probs (scorer) and critic values (advantage service), cut by a token budget into passes
    trimmed to their own longest rows, are those of one pass over the batch."""
    from common.sequences import batched_response_logprobs, batched_response_values, pack

    tokenizer, exp, _ = experience
    packed = pack(exp.prompt_tokens, exp.prompt_lengths, exp.response_tokens, exp.response_lengths, 0)
    mask = lengths_to_mask(exp.response_lengths, exp.response_tokens.shape[1])
    reference, critic = load_actor(tiny_model), load_critic(tiny_model)
    lengths = (exp.prompt_lengths, exp.response_tokens, exp.response_lengths)
    with torch.no_grad():
        whole = batched_response_logprobs(reference, packed, *lengths)
        budget = batched_response_logprobs(reference, packed, *lengths, max_tokens=24)
        values_whole = batched_response_values(critic, packed, exp.prompt_lengths, exp.response_lengths)
        values_budget = batched_response_values(critic, packed, exp.prompt_lengths, exp.response_lengths, max_tokens=24)
    assert len(micro_batches(exp.prompt_lengths, exp.response_lengths, torch.arange(len(mask)), 24)) > 2
    assert torch.allclose(whole * mask, budget * mask, atol=1e-5)
    assert torch.allclose(values_whole * mask, values_budget * mask, atol=1e-5)


def test_the_rank_launcher_says_each_failure_in_a_line_and_passes_on_the_leader_s_answer(make_config, tmp_path, capfd):
    """Rank 0 exits 4 (the log replaced): the launcher says so in a line per rank, and the learner's supervisor passes
    4 on (``up`` then resumes the run) rather than restarting the ranks (which would find the same log gone)."""
    import signal

    from services.learner.ranks import LearnerRanks

    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(4)\ntime.sleep(60)\n")
    ranks = LearnerRanks(make_config("learner.parallel.strategy=fsdp", "learner.parallel.processes=2"))
    command = [sys.executable, "-m", "services.learner.launcher", "--standalone", "--nproc-per-node=2", str(script)]
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        code = ranks._supervise(command)
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    err = capfd.readouterr().err
    assert code == 4, err
    assert "learner rank 0 ended: exit code 4" in err and "learner rank 1 ended: killed by SIGTERM" in err, err
    assert err.count("learner rank 0 ended") == 1, "the ranks ran once: not restarted"
    assert "Traceback" not in err and "ChildFailedError" not in err, err
