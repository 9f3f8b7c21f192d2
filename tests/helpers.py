"""Helpers the test modules share: reading and writing a bus's topics, the test broker's overrides."""

from common.schema import decode


def read_all(bus, topic) -> list[bytes]:
    """Every record's value on ``topic`` of the in-memory bus, from the beginning."""
    return [r.value for r in bus.consumer(topic, None, "reader").poll(0.0, max_records=1000)]


def read_messages(bus, topic) -> list:
    """Every message on ``topic`` of the in-memory bus, decoded."""
    return [decode(value) for value in read_all(bus, topic)]


def publish(bus, topic, *payloads, key=b"k", partition=None):
    """Raw payloads onto ``topic``."""
    producer = bus.producer("test")
    for payload in payloads:
        producer.send(topic, payload, key=key, partition=partition)
    producer.flush()


def run_settings(tmp_path, model_cache, steps: int, run_id: str) -> list[str]:
    """The overrides of a test's run of ``steps`` under ``tmp_path/run``, with the session's model cache."""
    return [
        f"run.steps={steps}",
        f"run.dir={tmp_path / 'run'}",
        f"run.run_id={run_id}",
        f"model.cache_dir={model_cache}",
    ]


def broker_address(kafka_broker: list[str]) -> str:
    """The bootstrap address in the ``kafka_broker`` fixture's overrides."""
    return next(o for o in kafka_broker if o.startswith("kafka.bootstrap=")).split("=", 1)[1]


def is_local_broker(kafka_broker: list[str]) -> bool:
    """Whether the ``kafka_broker`` fixture's broker is the local one (tansu): its overrides turn idempotence off."""
    return "kafka.idempotent_producer=false" in kafka_broker
