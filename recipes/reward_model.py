"""Training a reward model on preference pairs with the Bradley–Terry loss.

The model is a one-label sequence classifier ``r(prompt, response)``; for a pair where ``chosen`` is preferred to
``rejected``, ``P(chosen ≻ rejected) = σ(r_c − r_r)`` and the loss is ``−log σ(r_c − r_r)`` (as in TRL's
``RewardTrainer`` and OpenRLHF's ``PairWiseLoss``). Pairwise accuracy, the share of held-out pairs with
``r_c > r_r``, is what the result is judged by. Text is encoded exactly as the scorer encodes it
(:func:`common.rewards.encode_pairs`), so the trained folder scores in the pipeline as it did here.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.models import ModelLoadError, load_reward_model, load_tokenizer
from common.rewards import encode_pairs

__all__ = ["PreferencePair", "RewardTrainingConfig", "bradley_terry_loss", "load_pairs", "train_reward_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class RewardTrainingConfig:
    epochs: int = 2
    batch_size: int = 16
    lr: float = 5e-5
    eval_fraction: float = 0.2
    max_length: int = 256
    seed: int = 0


def load_pairs(path: Path) -> list[PreferencePair]:
    """JSONL with ``prompt``, ``chosen``, ``rejected`` strings per line; a bad line is an error naming the line."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pair = PreferencePair(row["prompt"], row["chosen"], row["rejected"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{number}: expected an object with prompt, chosen, rejected strings ({exc})"
            ) from None
        if not all(isinstance(v, str) for v in asdict(pair).values()):
            raise ValueError(f"{path}:{number}: prompt, chosen and rejected must be strings")
        pairs.append(pair)
    if len(pairs) < 2:
        raise ValueError(f"{path}: needs at least 2 preference pairs, found {len(pairs)}")
    return pairs


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """``mean(−log σ(r_c − r_r))`` over ``(B,)`` scores."""
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


def _scores(model, tokenizer, pairs: list[PreferencePair], which: str, max_length: int) -> torch.Tensor:
    enc = encode_pairs(tokenizer, [p.prompt for p in pairs], [getattr(p, which) for p in pairs], max_length)
    return model(**enc.to(model.device)).logits[:, 0].float()


@torch.no_grad()
def pairwise_accuracy(model, tokenizer, pairs: list[PreferencePair], max_length: int, batch_size: int = 64) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        correct += int(
            (
                _scores(model, tokenizer, chunk, "chosen", max_length)
                > _scores(model, tokenizer, chunk, "rejected", max_length)
            ).sum()
        )
    return correct / len(pairs)


def train_reward_model(base: Path, pairs: list[PreferencePair], out: Path, cfg: RewardTrainingConfig) -> dict:
    """Fine-tune ``base`` (any transformers encoder or decoder folder) into a reward model saved at ``out``.

    Returns (and saves as ``out/reward_model.json``) the held-out pairwise accuracy before and after training,
    the loss curve by epoch, and the split sizes.
    """
    rng = random.Random(cfg.seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    held_out = max(1, int(round(cfg.eval_fraction * len(pairs))))
    if held_out >= len(pairs):
        raise ValueError(f"eval_fraction {cfg.eval_fraction} leaves no training pairs out of {len(pairs)}")
    eval_pairs = [pairs[i] for i in order[:held_out]]
    train_pairs = [pairs[i] for i in order[held_out:]]

    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(base)
    model = load_reward_model(base)
    model.requires_grad_(True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    accuracy_before = pairwise_accuracy(model, tokenizer, eval_pairs, cfg.max_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    epochs = []
    for epoch in range(cfg.epochs):
        model.train()
        rng.shuffle(train_pairs)
        losses = []
        for start in range(0, len(train_pairs), cfg.batch_size):
            chunk = train_pairs[start : start + cfg.batch_size]
            loss = bradley_terry_loss(
                _scores(model, tokenizer, chunk, "chosen", cfg.max_length),
                _scores(model, tokenizer, chunk, "rejected", cfg.max_length),
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        accuracy = pairwise_accuracy(model, tokenizer, eval_pairs, cfg.max_length)
        epochs.append({"epoch": epoch + 1, "train_loss": sum(losses) / len(losses), "eval_accuracy": accuracy})
        log.warning(
            "reward model epoch %d: train loss %.4f, held-out pairwise accuracy %.3f",
            epoch + 1,
            epochs[-1]["train_loss"],
            accuracy,
        )
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError as exc:
        raise ModelLoadError(f"cannot save the reward model to {out}: {exc}") from exc
    report = {
        "base": str(base),
        "train_pairs": len(train_pairs),
        "eval_pairs": len(eval_pairs),
        "eval_accuracy_before": accuracy_before,
        "eval_accuracy": epochs[-1]["eval_accuracy"] if epochs else accuracy_before,
        "epochs": epochs,
        "config": asdict(cfg),
    }
    (out / "reward_model.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
