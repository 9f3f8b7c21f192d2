"""Packing and the shared forward passes agree with running each row alone, without padding."""

from pathlib import Path

import torch

from common.generation import sample_responses
from common.models import load_actor, load_critic, load_tokenizer
from common.ppo import logprobs_from_logits
from common.sampling import SamplingParams
from common.sequences import lengths_to_mask, pack, response_logprobs, response_values


def ragged_batch(tokenizer):
    prompts = ["hello there", "hi", "what do you think of the sea?"]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(4, len(tokenizer), (3, 6), generator=g)
    return enc["input_ids"], enc["attention_mask"].sum(1), responses, torch.tensor([6, 2, 4])


def test_pack_right_aligns_prompts_and_masks_padding(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    prompt_tokens, prompt_lengths, responses, response_lengths = ragged_batch(tokenizer)
    packed = pack(prompt_tokens, prompt_lengths, responses, response_lengths, tokenizer.pad_token_id)
    P = prompt_tokens.shape[1]
    for row in range(3):
        n = int(prompt_lengths[row])
        assert torch.equal(packed.input_ids[row, P - n : P], prompt_tokens[row, :n])
        assert packed.attention_mask[row, : P - n].sum() == 0
        assert packed.position_ids[row, P - n] == 0
        r = int(response_lengths[row])
        assert torch.equal(packed.input_ids[row, P : P + r], responses[row, :r])
        assert packed.attention_mask[row, P + r :].sum() == 0


def test_batched_logprobs_and_values_equal_unpadded_single_rows(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    actor, critic = load_actor(tiny_model), load_critic(tiny_model)
    with torch.no_grad():
        critic.score.weight.normal_()  # a non-zero head, so values say something
    prompt_tokens, prompt_lengths, responses, response_lengths = ragged_batch(tokenizer)
    packed = pack(prompt_tokens, prompt_lengths, responses, response_lengths, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, entropy = response_logprobs(actor, packed, responses, temperature=0.7, with_entropy=True)
        values = response_values(critic, packed)
        for row in range(3):
            n, r = int(prompt_lengths[row]), int(response_lengths[row])
            ids = torch.cat([prompt_tokens[row, :n], responses[row, :r]]).unsqueeze(0)
            logits = actor(input_ids=ids).logits[0, n - 1 : n - 1 + r] / 0.7
            expected = logprobs_from_logits(logits.unsqueeze(0), responses[row, :r].unsqueeze(0))[0]
            assert torch.allclose(logp[row, :r], expected, atol=1e-5)
            v = critic(input_ids=ids).logits[0, n - 1 : n - 1 + r, 0]
            assert torch.allclose(values[row, :r], v, atol=1e-5)
    assert entropy.shape == logp.shape


def test_sampled_behaviour_logprobs_equal_the_trainer_forward(tiny_model):
    """The generator's log-probs and the learner's recomputation agree on the same weights."""
    tokenizer = load_tokenizer(tiny_model)
    actor = load_actor(tiny_model)
    prompt_tokens, prompt_lengths, _, _ = ragged_batch(tokenizer)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=0.8, seed=5)
    samples = sample_responses(
        actor, prompt_tokens, prompt_lengths, params, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    assert samples.response_tokens.shape[0] == 9 and samples.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    rows = samples.group_index
    packed = pack(
        prompt_tokens[rows],
        prompt_lengths[rows],
        samples.response_tokens,
        samples.response_lengths,
        tokenizer.pad_token_id,
    )
    with torch.no_grad():
        logp, _ = response_logprobs(actor, packed, samples.response_tokens, temperature=0.8)
    mask = lengths_to_mask(samples.response_lengths, samples.response_tokens.shape[1])
    assert torch.allclose(logp * mask, samples.behaviour_logprobs, atol=1e-4)
    # A finished response ends with exactly one EOS, at its last real position.
    for row in torch.nonzero(samples.finished).flatten().tolist():
        length = int(samples.response_lengths[row])
        assert samples.response_tokens[row, length - 1] == tokenizer.eos_token_id
        assert (samples.response_tokens[row, : length - 1] != tokenizer.eos_token_id).all()


def test_sampling_is_reproducible_from_its_seed(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    actor = load_actor(tiny_model)
    prompt_tokens, prompt_lengths, _, _ = ragged_batch(tokenizer)

    def run(seed: int) -> torch.Tensor:
        params = SamplingParams(n=2, seed=seed)
        samples = sample_responses(
            actor, prompt_tokens, prompt_lengths, params, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        return samples.response_tokens

    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


def test_builtin_model_built_by_several_processes_at_once(tmp_path):
    """Services started together on a fresh machine: one builds the builtin model into the cache, the others wait
    for it and load the same folder."""
    import subprocess
    import sys
    import time

    from conftest import REPO

    # Each process imports what it needs, says so, and waits for the others: then all ask for the model at once.
    code = (
        "import logging, os, sys, time; from common.models import resolve_model; "
        "logging.basicConfig(level=logging.INFO); "
        "open(os.path.join(sys.argv[2], f'ready-{os.getpid()}'), 'w').close(); "
        "[time.sleep(0.01) for _ in iter(lambda: os.path.exists(os.path.join(sys.argv[2], 'go')), True)]; "
        "print(resolve_model('builtin:tiny-char-llama', sys.argv[1]))"
    )
    gate = tmp_path / "gate"
    gate.mkdir()
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache), str(gate)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    deadline = time.monotonic() + 300
    while len(list(gate.glob("ready-*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    (gate / "go").touch()
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in results]
    (built,) = {out.strip() for out, _ in results}
    assert sum("preparing builtin model" in err for _, err in results) == 1, "one built it, the others waited"
    left = [p.name for p in (cache / "models").iterdir() if p.suffix != ".lock"]
    assert left == [Path(built).name], "no partial folders left"
    load_actor(Path(built))


def test_temperature_zero_samples_greedily_with_the_models_own_logprobs(tiny_model):
    """Temperature 0 is greedy, as in vLLM (transformers' sampling refuses it): each token the argmax, its log-prob
    the model's own; the recipes' evaluations sample so without vLLM."""
    tokenizer = load_tokenizer(tiny_model)
    actor = load_actor(tiny_model)
    prompt_tokens, prompt_lengths, _, _ = ragged_batch(tokenizer)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    samples = sample_responses(
        actor, prompt_tokens, prompt_lengths, params, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    assert torch.equal(samples.response_tokens[0::2], samples.response_tokens[1::2]), "greedy: both samples alike"
    rows = samples.group_index
    packed = pack(prompt_tokens[rows], prompt_lengths[rows], samples.response_tokens, samples.response_lengths,
                  tokenizer.pad_token_id)  # fmt: skip
    with torch.no_grad():
        logits = actor(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids).logits  # fmt: skip
    P = prompt_tokens.shape[1]
    mask = lengths_to_mask(samples.response_lengths, samples.response_tokens.shape[1]).bool()
    chosen = logits[:, P - 1 : -1].argmax(-1)
    assert torch.equal(chosen[mask], samples.response_tokens[mask]), "each token the most likely one"
    logp = logprobs_from_logits(logits[:, P - 1 : -1], samples.response_tokens)
    assert torch.allclose(logp[mask], samples.behaviour_logprobs[mask], atol=1e-4)
