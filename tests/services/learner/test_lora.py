"""LoRA on the actor: only the adapters train, travel and are checkpointed, and a generator that loads them samples
with the learner's log-probs."""

import copy

import pytest
import torch

from common.config import AlgorithmSection, LearnerSection, LoraOptions
from common.models import ModelLoadError, add_lora, load_actor
from common.sequences import pack, response_logprobs
from common.weights import WeightIntegrityError, WeightStore, load_snapshot_into, published_tensors
from services.learner.trainer import PPOTrainer

LORA = LoraOptions(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def lora_trainer(tiny_model, tokenizer):
    return PPOTrainer(
        add_lora(load_actor(tiny_model), LORA),
        None,
        LearnerSection(ppo_epochs=1, mini_batch_size=8, actor_lr=1e-2, max_grad_norm=None),
        AlgorithmSection(estimator="grpo"),
        temperature=1.0,
        pad_token_id=tokenizer.pad_token_id,
    )


def test_only_the_adapters_train_travel_and_are_checkpointed(tiny_model, experience, tmp_path):
    tokenizer, exp = experience
    trainer = lora_trainer(tiny_model, tokenizer)
    base_before = {k: v.clone() for k, v in trainer.actor.state_dict().items() if "lora_" not in k}
    trainer.train(exp)
    after = trainer.actor.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items()), "the base weights never change"
    assert any(not torch.equal(t, torch.zeros_like(t)) for k, t in after.items() if "lora_B" in k), "B has moved"
    state = trainer.full_state("actor")
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    full_bytes = sum(t.nbytes for t in base_before.values())
    assert sum(t.nbytes for t in state.values()) < full_bytes / 10
    trainer.save(tmp_path)
    saved = torch.load(tmp_path / "trainer.pt", weights_only=True)
    assert set(saved["actor"]) == set(state), "the checkpoint holds what trains: the adapters"
    resumed = lora_trainer(tiny_model, tokenizer)
    resumed.load(tmp_path)
    assert all(torch.equal(t, published_tensors(resumed.actor)[k]) for k, t in published_tensors(trainer.actor).items())


def test_a_generator_that_loads_the_adapters_has_the_learners_log_probs(tiny_model, experience, tmp_path):
    tokenizer, exp = experience
    trainer = lora_trainer(tiny_model, tokenizer)
    trainer.train(exp)
    snapshot = WeightStore(tmp_path).save_state("actor", 1, trainer.full_state("actor"))
    generator = add_lora(load_actor(tiny_model), LORA).eval()
    load_snapshot_into(generator, snapshot.chain)
    packed = pack(
        exp.prompt_tokens, exp.prompt_lengths, exp.response_tokens, exp.response_lengths, tokenizer.pad_token_id
    )
    with torch.no_grad():
        learner, _ = response_logprobs(trainer.actor.eval(), packed, exp.response_tokens)
        sampler, _ = response_logprobs(generator, packed, exp.response_tokens)
        base, _ = response_logprobs(load_actor(tiny_model), packed, exp.response_tokens)
    mask = exp.mask.bool()
    assert float((learner - sampler)[mask].abs().max()) < 1e-5
    assert float((learner - base)[mask].abs().max()) > 1e-3, "the adapters changed the policy"
    # Adapters of another shape (rank 8) do not fit, and the generator keeps its own.
    other = lora_trainer(tiny_model, tokenizer)
    other.actor = add_lora(load_actor(tiny_model), LoraOptions(rank=8, target_modules=["q_proj", "v_proj"]))
    wrong = WeightStore(tmp_path / "other").save_state("actor", 1, other.full_state("actor"))
    kept = copy.deepcopy(published_tensors(generator))
    with pytest.raises(WeightIntegrityError, match="does not fit the model's adapters"):
        load_snapshot_into(generator, wrong.chain)
    assert all(torch.equal(kept[k], t) for k, t in published_tensors(generator).items())
    # A whole-model snapshot does not load into adapters either.
    whole = WeightStore(tmp_path / "whole").save("actor", 1, load_actor(tiny_model))
    with pytest.raises(WeightIntegrityError, match="unexpected"):
        load_snapshot_into(generator, whole.chain)


def test_target_modules_the_model_lacks_are_named(tiny_model):
    with pytest.raises(ModelLoadError, match="model.lora"):
        add_lora(load_actor(tiny_model), LoraOptions(target_modules=["no_such_proj"]))


def test_lora_settings_that_cannot_work_are_rejected():
    from conftest import EXAMPLE

    from common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.lora trains on one process"):
        load_config(
            EXAMPLE / "config.yaml",
            ["model.lora={rank: 4}", "learner.parallel.strategy=fsdp", "learner.parallel.processes=2"],
        )
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config(EXAMPLE / "config.yaml", ["model.lora={rank: 0}"])


def test_the_generator_takes_adapters_for_its_own_base_only(make_config, tiny_model, tmp_path):
    from common.schema import ADAPTER, ADAPTER_BASE, WeightAnnouncement, new_header
    from services.generator.service import GeneratorService

    config = make_config("model.lora={rank: 4, target_modules: [q_proj, v_proj]}")
    generator = GeneratorService(config)
    learner = add_lora(load_actor(tiny_model), LORA)
    with torch.no_grad():
        for tensor in published_tensors(learner).values():
            tensor.normal_(0.0, 0.1)
    snapshot = WeightStore(tmp_path).save("actor", 1, learner)

    def announce(lineage):
        return WeightAnnouncement(
            **new_header("b", "learner-0", 1, {"run.id": config.run.run_id, **lineage}),
            model="actor",
            uri=snapshot.uri,
            digest=snapshot.digest,
            chain=list(snapshot.chain),
            num_bytes=snapshot.num_bytes,
            broadcast_digest="",
        )

    assert not generator.on_weights(announce({}))  # a whole model's announcement
    assert not generator.on_weights(announce({ADAPTER: "lora", ADAPTER_BASE: "some/other-model"}))
    assert generator.policy_version == 0
    assert generator.on_weights(announce({ADAPTER: "lora", ADAPTER_BASE: config.model.actor}))
    assert generator.policy_version == 1
    loaded = published_tensors(generator.sampler.model)
    assert all(torch.equal(loaded[k], t) for k, t in published_tensors(learner).items())


def test_runs_of_one_process_share_the_base_model_and_each_samples_with_its_own_adapters(make_config, tmp_path):
    """A fleet's generator replica serves several LoRA runs: one base model in memory, an adapter per run, each run's
    snapshots loaded into its own adapter and its groups sampled with it; a run that leaves takes its adapter along."""
    from common.sampling import SamplingParams
    from services.generator.service import GeneratorService

    def run(run_id):
        config = make_config(f"run.run_id={run_id}", "model.lora={rank: 4, target_modules: [q_proj, v_proj]}")
        return GeneratorService(config, f"generator-{run_id}")

    a, b = run("a"), run("b")
    assert a.sampler.host is b.sampler.host, "one base model"
    base = {k: v.clone() for k, v in a.sampler.host.base.state_dict().items() if "lora_" not in k}
    learners = {}
    for name, generator, seed in (("a", a, 0), ("b", b, 1)):
        learners[name] = add_lora(load_actor(generator.model_id), generator.config.model.lora).eval()
        torch.manual_seed(seed)
        with torch.no_grad():
            for tensor in published_tensors(learners[name]).values():
                tensor.normal_(0.0, 0.3)
        generator.sampler.load_snapshot(WeightStore(tmp_path / name).save("actor", 1, learners[name]).chain)

    prompt = torch.tensor([[5, 6, 7, 8]])
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=3)

    def mismatch(generator, model) -> float:
        samples = generator.sampler.sample(prompt, torch.tensor([4]), params)
        packed = pack(prompt.expand(2, -1), torch.tensor([4, 4]), samples.response_tokens, samples.response_lengths, 0)
        with torch.no_grad():
            logp, _ = response_logprobs(model, packed, samples.response_tokens)
        real = torch.arange(samples.response_tokens.shape[1]) < samples.response_lengths[:, None]
        return float((logp - samples.behaviour_logprobs)[real].abs().max())

    for _ in range(2):  # taking turns, as a fleet's runs do
        assert mismatch(a, learners["a"]) < 1e-4 and mismatch(b, learners["b"]) < 1e-4
    assert mismatch(a, learners["b"]) > 1e-3, "the two runs' policies differ"
    after = {k: v for k, v in a.sampler.host.base.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(after[k], v) for k, v in base.items()), "the base weights never change"
    a.close()
    assert a.sampler.adapter not in b.sampler.host.model.peft_config and mismatch(b, learners["b"]) < 1e-4
    b.close()


def test_a_lora_runs_adapter_merges_into_a_plain_folder_that_computes_what_base_and_adapter_do(tiny_model, tmp_path):
    """`streamppo models merge <run dir>/final/actor --out DIR`: a folder any transformers loader reads (no peft),
    whose logits are the adapted model's, not the base's."""
    from helpers import streamppo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapted = add_lora(load_actor(tiny_model), LoraOptions(rank=4))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)  # B = 0 at start: a trained adapter moves the model
    adapted.save_pretrained(tmp_path / "final" / "actor")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "final" / "actor")
    result = streamppo("models", "merge", tmp_path / "final" / "actor", "--out", tmp_path / "merged")
    assert result.returncode == 0, result.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        want, got = adapted(tokens).logits, merged(tokens).logits
        base = load_actor(tiny_model)(tokens).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, base, atol=1e-3)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()
    missing = streamppo(
        "models", "merge", tmp_path / "final" / "actor", "--out", tmp_path / "m2", "--base", tmp_path / "gone"
    )
    assert missing.returncode == 2 and "gone not found" in missing.stderr
