"""A learner that dies and restarts resumes from its checkpoint: nothing lost, nothing applied twice."""

import pytest
import torch

from services.advantage import AdvantageService
from services.feeder import FeederService
from services.generator import GeneratorService
from services.learner import LearnerService
from services.scorer import ScorerService


@pytest.fixture
def config(make_config):
    # Staleness 3 lets all four batches be sampled up front by v0, without a running learner.
    return make_config("data.batch_size=2", "generation.n=2", "generation.max_new_tokens=6",
                       "learner.mini_batch_size=2", "pipeline.max_staleness=3")


@pytest.fixture
def experience(config):
    feeder, generator, scorer, advantage = (FeederService(config), GeneratorService(config), ScorerService(config),
                                            AdvantageService(config))
    return [advantage.process(scorer.process(generator.process(feeder.batch(step))[0])[0])[0] for step in range(4)]


def weights(learner):
    return {k: v.clone() for k, v in learner.trainer.state_dict()["actor"].items()}


def test_a_restarted_learner_continues_exactly_where_it_stopped(config, experience, tmp_path):
    uninterrupted = LearnerService(config.model_copy(update={"run": config.run.model_copy(update={"dir": tmp_path / "a"})}))
    for message in experience:
        uninterrupted.process(message)

    first = LearnerService(config)
    first.process(experience[0])
    first.process(experience[1])
    del first  # killed after its second update was checkpointed, before its input was committed

    resumed = LearnerService(config)
    assert resumed.trainer.version == 2 and resumed.updates == 2
    assert [a.policy_version for a in resumed.startup_messages()] == [2, 2], "re-announces the resumed version"
    assert resumed.process(experience[1]) == [], "the re-delivered batch is recognised"
    resumed.process(experience[2])
    resumed.process(experience[3])
    assert resumed.trainer.version == 4 and resumed.updates == 4
    expected, actual = weights(uninterrupted), weights(resumed)
    assert all(torch.equal(expected[k], actual[k]) for k in expected), "same weights as a run that never stopped"


def test_a_fresh_start_ignores_old_checkpoints_when_asked(config, experience):
    LearnerService(config).process(experience[0])
    assert LearnerService(config).trainer.version == 1
    assert LearnerService(config, resume=False).trainer.version == 0


def test_a_metrics_line_lost_to_a_crash_is_written_on_resume(config, experience):
    learner = LearnerService(config)
    learner.process(experience[0])
    learner.process(experience[1])
    lines = learner.metrics_path.read_text().splitlines()
    learner.metrics_path.write_text(lines[0] + "\n")  # killed after the checkpoint, before the metrics line
    LearnerService(config)
    restored = learner.metrics_path.read_text().splitlines()
    assert restored == lines
    LearnerService(config)  # and only once
    assert learner.metrics_path.read_text().splitlines() == lines
