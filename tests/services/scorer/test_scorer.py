"""The scorer: the reward model's score and the frozen reference's log-probs of each response."""

import pytest
import torch

from services.feeder import FeederService
from services.generator import GeneratorService
from services.scorer import ScorerService


@pytest.fixture
def config(make_config):
    return make_config(
        "data.batch_size=2", "generation.n=2", "generation.max_new_tokens=4", "learner.mini_batch_size=4"
    )


def test_the_scorer_uses_a_reward_model_with_its_own_tokenizer(make_config, tiny_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from common.models import load_tokenizer

    rm_dir = tmp_path / "reward-model"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(rm_dir)
    load_tokenizer(tiny_model).save_pretrained(rm_dir)
    config = make_config(
        "reward.function=null",
        f"reward.model={rm_dir}",
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
    )
    rollouts = GeneratorService(config).process(FeederService(config).batch(0))[0]
    scored = ScorerService(config).process(rollouts)[0]
    assert scored.scores.shape == (4,) and scored.lineage["reward.model"] == str(rm_dir)
    rm, tokenizer = AutoModelForSequenceClassification.from_pretrained(rm_dir), load_tokenizer(rm_dir)
    with torch.no_grad():
        for i in range(4):
            enc = tokenizer(rollouts.prompt_text[i], rollouts.response_text[i], return_tensors="pt")
            assert rm(**enc).logits[0, 0].item() == pytest.approx(float(scored.scores[i]), abs=1e-4)
