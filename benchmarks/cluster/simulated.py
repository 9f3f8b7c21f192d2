"""Simulated compute: the real services with each model call replaced by a wait from a cost model.

Each class here is the role's real service (its runner, bus, broker, delivery rules, commits, checkpoints, weight
store and announcements unchanged), built on the tiny built-in model, with the one call that runs a large model
swapped for a stand-in that returns tensors of the profile's batch shape after the seconds the profile prices it
at. The messages are as large as the profile's batch; the weight snapshots are the tiny model's, real and
digested, and writing and reading one of the profile's size is a wait.

Run one replica as its own process (what ``benchmarks/cluster/bench.py`` does)::

    python -m benchmarks.cluster.simulated ROLE --profile 0.5b-balanced --scale 0.05 \\
        --config examples/vowels/config.yaml --bootstrap HOST:PORT [--set key=value ...]

or a fleet's replica serving every run whose config is in a folder (``benchmarks/cluster/fleets.py``)::

    python -m benchmarks.cluster.simulated ROLE --runs DIR --profile ... --scale ... --bootstrap HOST:PORT

A learner given ``--device-lock FILE`` trains only while it holds that file's lock: the learners of several runs
sharing one trainer accelerator, taking turns at it.

Nothing here is reachable from a run config: ``services/roles.py`` names the real classes only, and
``tests/test_structure.py`` checks that no product module imports ``benchmarks``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import logging
import time
import zlib
from collections import deque
from pathlib import Path

import numpy as np
import torch
from kafka.coordinator.assignors.range import RangePartitionAssignor

from benchmarks.cluster.profiles import PROFILES, CostModel
from common.config import load_config
from common.sampling import Samples
from common.schema import PromptBatch
from services.advantage import AdvantageService
from services.feeder import FeederService
from services.generator import GeneratorService
from services.launch.process import serve_service
from services.learner import LearnerService
from services.learner.experience import Experience
from services.runtime.run_bus import kafka_bus
from services.scorer import ScorerService

VOCAB = 47  # builtin:tiny-char-llama's: stand-in token ids are ones its models can look up
FIRST_TOKEN = 3  # ids below are pad, bos and eos
TRAINED_ROWS, TRAINED_TOKENS = 4, 8  # the slice of each batch the tiny learner really trains on


def wait_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (the real work done before it counts toward it)."""
    time.sleep(max(0.0, deadline - time.perf_counter()))


class Simulated:
    """What every simulated service adds: its cost model (seeded per replica, so replicas do not jitter alike)."""

    def simulate(self, cost: CostModel) -> None:
        self.cost = cost


class SimulatedFeeder(FeederService, Simulated):
    """Prompt batches of the profile's size: the dataset's texts, with ``prompt_tokens`` random token ids each."""

    def batch(self, step: int) -> PromptBatch:
        batch = super().batch(step)
        rows, width = len(batch.prompt_text), self.cost.profile.prompt_tokens
        batch.prompt_tokens = np.random.default_rng(step).integers(FIRST_TOKEN, VOCAB, (rows, width), dtype=np.int32)
        batch.prompt_lengths = np.full(rows, width, dtype=np.int32)
        return batch


class SimulatedSampler:
    """The generator's sampler: random responses of the profile's lengths, after the cost model's seconds. Sampled
    whole (batch mode), or streamed through a simulated continuous-batching ``engine``: each group is labelled with
    the version loaded when it was submitted (its oldest token's, had new weights landed while it decoded)."""

    backend = "simulated"
    updates_in_flight = True

    def __init__(self, real, cost: CostModel, engine: ContinuousBatching | None = None):
        self.real, self.cost, self.engine = real, cost, engine
        self.skeleton = real.skeleton
        self.version = 0
        self.submitted: dict[str, tuple[np.ndarray, int]] = {}  # per group in the engine: (lengths, version)

    def sample(self, prompt_tokens: torch.Tensor, prompt_lengths: torch.Tensor, params) -> Samples:
        started = time.perf_counter()
        lengths = self.cost.response_lengths()
        samples = self.made(lengths, len(prompt_tokens))
        wait_until(started + self.cost.generate_s(lengths))
        return samples

    def made(self, lengths: np.ndarray, prompts: int) -> Samples:
        """Random responses of ``lengths`` (``prompts`` groups of ``len(lengths) / prompts``), as wide as the longest,
        as an engine returns them."""
        rows, width = len(lengths), max(1, int(lengths.max()))
        tokens = self.cost.rng.integers(FIRST_TOKEN, VOCAB, (rows, width))
        mask = np.arange(width)[None, :] < lengths[:, None]
        finished = lengths < int(self.cost.profile.max_response_tokens)
        tokens[np.arange(rows)[finished], lengths[finished] - 1] = 2  # a finished response ends with its EOS
        logprobs = np.where(mask, -self.cost.rng.exponential(1.0, (rows, width)), 0.0).astype(np.float32)
        return Samples(
            group_index=torch.arange(prompts).repeat_interleave(rows // prompts),
            response_tokens=torch.from_numpy(tokens * mask),
            response_lengths=torch.from_numpy(lengths),
            finished=torch.from_numpy(finished),
            behaviour_logprobs=torch.from_numpy(logprobs),
        )

    def submit(self, key: str, prompt: list[int], params) -> None:
        self.submitted[key] = (self.cost.response_lengths(count=params.n), self.version)
        self.engine.add(key, self.submitted[key][0])

    def step(self, seconds: float) -> list[tuple[str, Samples]]:
        deadline = time.perf_counter() + seconds
        done = self.engine.advance()
        while not done and time.perf_counter() < deadline:
            time.sleep(0.002)
            done = self.engine.advance()
        finished = []
        for key in done:
            lengths, version = self.submitted.pop(key)
            samples = self.made(lengths, 1)
            finished.append((key, dataclasses.replace(samples, token_versions=samples.labelled(version))))
        return finished

    def in_flight(self) -> int:
        return len(self.submitted)

    def load_snapshot(self, chain: list[str], version: int | None = None) -> None:
        started = time.perf_counter()
        self.real.load_snapshot(chain)  # the tiny model's snapshot: verified and loaded for real
        wait_until(started + self.cost.weight_sync_s())  # reading one of the profile's size
        if self.engine is not None:  # nothing decoded while the weights loaded
            self.engine.pause(time.perf_counter() - started)
        if version is not None:
            self.version = version

    def join_broadcast(self, *args) -> None:
        raise NotImplementedError("the simulated cluster moves weights through the store")

    def load_broadcast(self, *args) -> bool:
        return False

    def close(self) -> None:
        self.real.close()


class ContinuousBatching:
    """A continuous-batching engine, simulated on the wall clock: ``slots`` sequences decode together, one token
    each per step of ``step_s`` seconds however many there are; a finished sequence's slot goes at once to the next
    one waiting. Nothing decodes while weights load (:meth:`pause`)."""

    def __init__(self, slots: int, step_s: float, now=time.perf_counter):
        self.slots, self.step_s, self.now = slots, step_s, now
        self.waiting: deque[tuple[object, int]] = deque()  # (group, length) of sequences without a slot
        self.active: list[list] = []  # [group, tokens left]
        self.left: dict[object, int] = {}  # per group: sequences not finished
        self.clock = now()  # the engine's time: decoded up to here
        self.carry = 0.0  # seconds of a decode step begun

    def add(self, group, lengths: np.ndarray) -> None:
        if not self.active:  # idle until now: nothing decoded meanwhile
            self.clock, self.carry = self.now(), 0.0
        self.left[group] = len(lengths)
        self.waiting.extend((group, int(length)) for length in lengths)
        self._fill()

    def pause(self, seconds: float) -> None:
        self.clock += seconds

    def advance(self) -> list:
        """Decode up to now; the groups whose last sequence finished, in the order they finished."""
        now = self.now()
        steps, self.carry = divmod(self.carry + now - self.clock, self.step_s)
        self.clock, steps, done = now, int(steps), []
        while steps > 0 and self.active:
            step = min(steps, min(seq[1] for seq in self.active))
            steps -= step
            for seq in self.active:
                seq[1] -= step
            for group, _ in [seq for seq in self.active if seq[1] == 0]:
                self.left[group] -= 1
                if self.left[group] == 0:
                    del self.left[group]
                    done.append(group)
            self.active = [seq for seq in self.active if seq[1] > 0]
            self._fill()
        return done

    def _fill(self) -> None:
        while self.waiting and len(self.active) < self.slots:
            group, length = self.waiting.popleft()
            self.active.append([group, length])


class SimulatedGenerator(GeneratorService, Simulated):
    """The real generator with a simulated sampler; with ``generation.streaming``, streaming through a
    continuous-batching engine (:class:`ContinuousBatching`) of one prompt batch's sequences, each costing its own
    length."""

    def simulate(self, cost: CostModel) -> None:
        super().simulate(cost)
        p = cost.profile
        engine = ContinuousBatching(p.prompts * p.n, p.generate_s * cost.scale / p.response_tokens)
        self.sampler = SimulatedSampler(self.sampler, cost, engine)


class SimulatedScorer(ScorerService, Simulated):
    def _reference_logprobs(self, message) -> torch.Tensor:
        started = time.perf_counter()
        lengths = message.response_lengths
        mask = np.arange(message.response_tokens.shape[1])[None, :] < lengths[:, None]
        logprobs = np.where(mask, -self.cost.rng.exponential(1.0, mask.shape), 0.0).astype(np.float32)
        wait_until(started + self.cost.score_s(lengths))  # the reference and the reward model
        return torch.from_numpy(logprobs)


class SimulatedAdvantage(AdvantageService, Simulated):
    def _values(self, message, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        values = torch.from_numpy(self.cost.rng.normal(0.0, 0.1, tokens.shape).astype(np.float32))
        wait_until(started + self.cost.critic_s(lengths.numpy()))
        return values


class SimulatedTrainer:
    """The learner's trainer: a real update of the tiny model on a slice of the batch, so versions, optimizer state,
    checkpoints and snapshots are real, taking the cost model's seconds for the whole batch; with ``device_lock``, only
    while it holds that file's lock (one accelerator that several runs' learners take turns at)."""

    def __init__(self, real, cost: CostModel, device_lock: Path | None = None):
        self.real, self.cost, self.device_lock = real, cost, device_lock

    def __getattr__(self, name):
        return getattr(self.real, name)

    def train(self, exp: Experience) -> dict[str, float]:
        with self._device():
            started = time.perf_counter()
            stats = self.real.train(_slice(exp))
            wait_until(started + self.cost.train_s(exp.response_lengths.numpy()))
        return stats

    @contextlib.contextmanager
    def _device(self):
        if self.device_lock is None:
            yield
            return
        with open(self.device_lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _slice(exp: Experience) -> Experience:
    """The first ``TRAINED_ROWS`` sequences, their prompts and responses cut to ``TRAINED_TOKENS`` tokens."""
    fields = {}
    for field in dataclasses.fields(exp):
        value = getattr(exp, field.name)
        if isinstance(value, torch.Tensor):
            value = value[:TRAINED_ROWS, :TRAINED_TOKENS] if value.dim() == 2 else value[:TRAINED_ROWS]
        fields[field.name] = value
    for name in ("prompt_lengths", "response_lengths"):
        fields[name] = fields[name].clamp(max=TRAINED_TOKENS)
    return Experience(**fields)


class SimulatedLearner(LearnerService, Simulated):
    device_lock: Path | None = None

    def simulate(self, cost: CostModel) -> None:
        super().simulate(cost)
        self.trainer = SimulatedTrainer(self.trainer, cost, self.device_lock)

    def announce(self):
        started = time.perf_counter()
        announcements = super().announce()
        wait_until(started + self.cost.weight_sync_s())  # writing the profile's snapshot
        return announcements


SIMULATED = {
    cls.role: cls
    for cls in (SimulatedFeeder, SimulatedGenerator, SimulatedScorer, SimulatedAdvantage, SimulatedLearner)
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one replica of a role, its model calls simulated")
    parser.add_argument("role", choices=sorted(SIMULATED))
    parser.add_argument("--profile", choices=sorted(PROFILES), required=True)
    parser.add_argument("--scale", type=float, required=True, help="× every simulated second")
    parser.add_argument("--config", help="the run's config (not with --runs)")
    parser.add_argument("--runs", type=Path, help="a fleet's replica: a config file per run in this folder")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--device-lock", type=Path, help="learner: train only while holding this file's lock")
    parser.add_argument(
        "--assignment",
        choices=("roundrobin", "range"),
        default="roundrobin",
        help="how the group deals partitions: range is how it did before (a block of consecutive partitions each)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cost = CostModel(PROFILES[args.profile], args.scale, seed=zlib.crc32(args.replica_id.encode()))
    SimulatedLearner.device_lock = args.device_lock

    def create(config, replica_id):
        service = SIMULATED[args.role](config, replica_id)
        service.simulate(cost)
        return service

    if args.runs is not None:  # the fleet's runs share the replica, and so its accelerator: one cost model
        from services.launch.fleet import RunsFolder, serve_fleet

        runs = RunsFolder(args.runs, args.overrides)
        return serve_fleet(args.role, runs, {}, args.bootstrap, args.replica_id, create=create, rescan_s=0.5)
    config = load_config(args.config, args.overrides)
    service = create(config, args.replica_id)
    bus = kafka_bus(config, args.bootstrap)
    if args.assignment == "range":
        bus.settings = dataclasses.replace(bus.settings, partition_assignment=(RangePartitionAssignor,))
    return serve_service(service, config, args.bootstrap, bus=bus)


if __name__ == "__main__":
    raise SystemExit(main())
