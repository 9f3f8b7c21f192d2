"""Prompt files with labels, and the rewards that check a response against its prompt's label."""

import dataclasses
import json

import pytest
from helpers import started

from common.data import DatasetError, load_prompts
from common.rewards import RewardError, RewardFunction
from common.schema import DeadLetter, decode, encode
from recipes.rewards import final_number_matches
from services.feeder import FeederService
from services.generator import GeneratorService
from services.roles import pipeline_topics
from services.scorer import ScorerService
from services.transport import MemoryBus


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_prompt_file_gives_each_prompt_its_label(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "2+2?", "label": "4"}, {"prompt": "hi"}])
    dataset = load_prompts(path)
    assert dataset.texts == ["2+2?", "hi"] and dataset.labels == ["4", ""] and len(dataset) == 2


@pytest.mark.parametrize(
    "rows, error",
    [
        ([{"prompt": "2+2?", "label": 4}], "p.jsonl:1: 'label' must be a string"),
        ([{"prompt": "ok"}, {"text": "no prompt"}], "p.jsonl:2: expected an object with a non-empty string 'prompt'"),
        ([], "holds no prompts"),
    ],
)
def test_a_malformed_prompt_file_is_refused_with_its_line(tmp_path, rows, error):
    with pytest.raises(DatasetError, match=error):
        load_prompts(write_rows(tmp_path / "p.jsonl", rows))


def test_the_final_number_is_checked_against_the_label():
    responses = [
        "3 + 4 = 7, so she has 7 apples.",  # the last number
        "She has 7 apples, 3 more than before.",  # a later number is the answer read
        "The answer is 1,250.",  # thousands separators
        "It costs $12.0",  # a decimal that equals the label
        "I do not know.",  # no number
        "-5 degrees",
    ]
    labels = ["7", "7", "1250", "12", "3", "-5"]
    assert final_number_matches([""] * 6, responses, labels) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="the label '' holds no number"):
        final_number_matches(["q"], ["7"], [""])


def test_a_reward_function_gets_labels_only_if_it_takes_them():
    two = RewardFunction("recipes.rewards:vowel_fraction")
    three = RewardFunction("recipes.rewards:final_number_matches")
    assert not two.takes_labels and three.takes_labels
    assert two(["p"], ["aaaaeeee"], ["7"]).tolist() == [1.0]
    assert three(["p"], ["it is 7"], ["7"]).tolist() == [1.0]


@pytest.fixture
def labelled_config(make_config, tmp_path):
    rows = [{"prompt": f"what is {i} plus {i}?", "label": str(2 * i)} for i in range(4)]
    path = write_rows(tmp_path / "sums.jsonl", rows)
    return make_config(
        f"data.prompts={path}",
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "reward.function=recipes.rewards:final_number_matches",
    )


def test_labels_travel_from_the_dataset_to_the_reward_function(labelled_config):
    prompts = decode(encode(FeederService(labelled_config).batch(1)))
    assert prompts.prompt_label == [str(2 * int(i)) for i in prompts.prompt_index]
    rollouts = decode(encode(GeneratorService(labelled_config).process(prompts)[0]))
    assert rollouts.prompt_label == [prompts.prompt_label[g] for g in rollouts.group_index]
    # Responses written to match some labels: the scores say the scorer compared them with the right ones.
    answers = [f"it is {label}" if row % 2 else "it is 99" for row, label in enumerate(rollouts.prompt_label)]
    scored = ScorerService(labelled_config).process(dataclasses.replace(rollouts, response_text=answers))[0]
    assert scored.scores.tolist() == [float(row % 2) for row in range(len(answers))]
    assert decode(encode(scored)).prompt_label == rollouts.prompt_label


def test_a_batch_whose_labels_cannot_be_checked_is_a_dead_letter_where_the_run_says_so(labelled_config):
    """reward.on_error: dead_letter sets a batch the reward fails on aside and goes on; by default (stop) the run
    stops, with the reward, the batch and the row named."""
    rollouts = GeneratorService(labelled_config).process(FeederService(labelled_config).batch(0))[0]
    unlabelled = dataclasses.replace(rollouts, prompt_label=[""] * len(rollouts.prompt_label))
    with pytest.raises(RewardError, match=f"batch {rollouts.batch_id} .* holds no number .*; on row 0: prompt 'what"):
        ScorerService(labelled_config).process(unlabelled)
    config = labelled_config.model_copy(
        update={"reward": labelled_config.reward.model_copy(update={"on_error": "dead_letter"})}
    )
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=1))
    producer = bus.producer("test")
    producer.send("rollouts", encode(unlabelled), key=b"a")
    producer.send("rollouts", encode(rollouts), key=b"a")
    runner = started(ScorerService(config, "scorer"), bus)
    while runner.poll_once():
        pass
    dead = [decode(r.value) for r in bus.consumer("rollouts.dlq", None, "reader").poll(0.0, max_records=10)]
    assert len(dead) == 1 and isinstance(dead[0], DeadLetter)
    assert "the label '' holds no number" in dead[0].error
    # The next batch, labelled, is scored: one bad batch does not stop the scorer.
    (scored,) = [decode(r.value) for r in bus.consumer("scored", None, "reader").poll(0.0, max_records=10)]
    assert scored.batch_id == rollouts.batch_id


def test_the_vowels_reward_needs_an_answer_not_one_vowel():
    from recipes.rewards import vowel_fraction

    scores = vowel_fraction([""] * 5, ["a", "", "aeiou aeiou", "the cat sat", "bcdfghjklm"])
    assert scores == pytest.approx([1 / 8, 0.0, 1.0, 3 / 9, 0.0])


def test_a_reward_function_that_raises_names_itself_and_the_input(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def score(prompts, responses):\n    return [1 / len(r) for r in responses]\n")
    monkeypatch.chdir(tmp_path)
    reward = RewardFunction("mine.py:score")  # a file of the user's, by path
    assert reward(["p", "q"], ["ab", "abcd"], ["", ""]).tolist() == [0.5, 0.25]
    with pytest.raises(RewardError, match="mine.py:score raised ZeroDivisionError: division by zero; on row 1: "
                                          "prompt 'q', response ''"):  # fmt: skip
        reward(["p", "q"], ["ab", ""], ["", ""])
