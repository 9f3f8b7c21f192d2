"""What one environment turn costs over the bus: a model turn sent on ``turns``, answered by an environment replica
(the calculator), and the answer read back from ``observations``, over a real Kafka-protocol broker (the local
one), one turn in flight at a time. Prints the median and percentiles in milliseconds, and the calculator's own time.

    python benchmarks/environment_turn.py [--turns 200]

Compare with the model's time per turn (``examples/tools/evaluate.py`` prints its median, all episodes in flight).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config  # noqa: E402
from common.schema import EpisodeTurn, new_header  # noqa: E402
from services.environment import EnvironmentService  # noqa: E402
from services.environment.tools import calculate  # noqa: E402
from services.runtime import Replica  # noqa: E402
from services.runtime.run_bus import kafka_bus  # noqa: E402
from services.service import Service  # noqa: E402
from services.transport.brokers.local_broker import LocalBroker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class _Asker(Service):
    """A generator's side of the exchange alone: a service whose runner gives it the channel."""

    role = "generator"

    def channels(self):
        return {"environment": ("turns", "observations")}

    def connect(self, channels):
        self.channel = channels["environment"]

    def process(self, message):
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    with LocalBroker() as broker:
        config = load_config(
            REPO / "examples" / "vowels" / "config.yaml",
            [
                f"kafka.bootstrap={broker.bootstrap}",
                "kafka.idempotent_producer=false",
                "environment.tools=[calculator]",
                "generation.streaming=true",
                "run.run_id=turn-bench",
                f"run.dir={REPO / 'runs' / 'turn-bench'}",
            ],
        )
        serving = Replica(EnvironmentService(config, "environment-0"), lambda: kafka_bus(config)).start()
        environment = serving.runner
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                environment.poll_once(0.05)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        asker = _Asker(config, "generator-0")
        asking = Replica(asker, lambda: kafka_bus(config)).start()
        lineage = {"run.id": config.run.run_id}
        seconds = []
        for i in range(args.turns + 10):  # the first 10 warm the clients up
            turn = EpisodeTurn(
                **new_header("bench", "generator-0", 0, lineage),
                step=i % 4,
                episode=f"{i}/0#0",
                turn=0,
                reply_to="generator-0/bench",
                prompt_text="Calculate 1234 * 5678.",
                prompt_label="7006652",
                model_turns=["<calculator>1234 * 5678</calculator>"],
                observations=[],
            )
            started = time.perf_counter()
            asker.channel.send(turn)
            while not (replies := asker.channel.receive()):
                time.sleep(0.0005)
            if i >= 10:
                seconds.append(time.perf_counter() - started)
            assert replies[0].observation.strip() == "<result>\n7006652\n</result>"
        stop.set()
        server.join()
        asking.stop(finished=False)
        serving.stop(finished=False)
    started = time.perf_counter()
    for _ in range(1000):
        calculate("1234 * 5678")
    calculator_ms = time.perf_counter() - started  # 1000 calls: seconds = ms per call
    ms = np.array(seconds) * 1000
    print(
        json.dumps(
            {
                "turns": len(ms),
                "round_trip_ms_median": round(float(np.median(ms)), 2),
                "round_trip_ms_p90": round(float(np.percentile(ms, 90)), 2),
                "round_trip_ms_max": round(float(ms.max()), 2),
                "calculator_ms": round(calculator_ms, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
