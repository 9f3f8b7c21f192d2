"""The feeder: the run's prompt batches published once each, in step order, under ids of the run and the step; the
replacements the learner asks for; done once the learner has settled them."""

import pytest
from helpers import announce_v1, read_messages, started

from common.schema import LEARNER_REPLACEMENTS, LEARNER_SETTLED, PromptBatch
from services.feeder import FeederService
from services.roles import pipeline_topics
from services.transport import MemoryBus


@pytest.fixture
def config(make_config):
    return make_config("data.batch_size=2", "generation.n=2", "learner.mini_batch_size=4", "run.steps=3")


@pytest.fixture
def bus():
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=2))
    return bus


def test_the_feeder_publishes_each_prompt_batch_of_the_run_once_in_step_order_and_again_under_the_same_ids(bus, config):
    feeder = started(FeederService(config), bus)
    batches = [m for m in read_messages(bus, "prompts") if isinstance(m, PromptBatch)]
    assert config.prompt_batches == 3
    assert sorted(b.step for b in batches) == [0, 1, 2], "each step once"
    assert {b.batch_id for b in batches} == {f"{config.run.run_id}-{step:08d}" for step in range(3)}
    assert all(len(b.prompt_text) == config.data.batch_size for b in batches)
    assert not feeder.service.done(), "the learner has settled nothing yet"
    again = started(FeederService(config, "feeder-2"), bus)  # a restarted feeder publishes the same batches
    ids = [m.batch_id for m in read_messages(bus, "prompts") if isinstance(m, PromptBatch)]
    assert sorted(ids) == sorted(2 * [b.batch_id for b in batches]), "the same ids: every consumer sees duplicates"
    first_step_1 = next(m for m in read_messages(bus, "prompts") if m.step == 1)
    assert first_step_1.prompt_text == again.service.batch(1).prompt_text, "the same prompts, by the run's seed"


def test_the_feeder_publishes_the_replacements_the_learner_asks_for_and_is_done_once_it_settled_them(bus, config):
    feeder = started(FeederService(config), bus)
    service = feeder.service
    (announcement,) = [a for a in announce_v1(config) if a.model == "actor"]
    announcement.lineage[LEARNER_REPLACEMENTS] = 1  # groups of a batch dropped as too stale: one batch more
    announcement.lineage[LEARNER_SETTLED] = 3
    assert service.on_weights(announcement)
    assert [b.step for b in service.tick()] == [3], "the next prompt batch of the schedule, once"
    assert service.tick() == [], "not twice"
    assert not service.done(), "the learner has settled 3 of the 4 prompt batches"
    announcement.lineage[LEARNER_SETTLED] = 4
    service.on_weights(announcement)
    assert service.done()
