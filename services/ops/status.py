"""``streamppo status``: what a running pipeline is doing, read from the broker alone.

Every replica publishes a :class:`~common.schema.ReplicaStatus` on the status topic every 30 s (and when it stops);
the weights topic holds the newest announcements, the dead-letter topics what was rejected. This reads the three,
keeps the run's own records, and prints one table: per replica its state, lag, held input and what it waits for,
its counters and loaded weight versions, and where it serves clients (the gateway's URL); then the newest weight
versions and the dead letters per topic.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common.schema import (
    REPORT_EVERY_S,
    RUN_ID,
    TOPIC_MESSAGE,
    ReplicaStatus,
    SchemaError,
    WeightAnnouncement,
    decode,
    encode,
)
from services.roles import LOG_TOPIC, ROLES, STATUS_TOPIC, WEIGHTS_TOPIC, pipeline_topics
from services.transport import Bus, Record, dlq_topic

__all__ = [
    "PipelineStatus",
    "format_replication",
    "format_status",
    "from_the_run_directory",
    "read_saved_status",
    "read_status",
    "save_status",
    "wait_for_run",
]

SILENT_AFTER_S = 2 * REPORT_EVERY_S + 5  # a replica whose newest report is older than this is not heard from
SAVED_STATUS = "status.json"  # <run.dir>/status.json: the status last read from the broker, for when it does not answer


@dataclass
class PipelineStatus:
    run_id: str
    replicas: dict[str, ReplicaStatus] = field(default_factory=dict)  # newest report per replica
    weights: dict[str, int] = field(default_factory=dict)  # model -> newest announced version
    dead_letters: dict[str, int] = field(default_factory=dict)  # "<topic>.dlq" -> records (all runs)
    read_at: float = field(default_factory=time.time)
    brokers: int = 0  # the cluster's brokers (0: not asked)
    replication: dict[str, int] = field(default_factory=dict)  # topic -> copies of its partitions (the fewest)


def _read_all(bus: Bus, topic: str, timeout_s: float) -> list[Record]:
    """Every record of ``topic`` from the beginning, read without joining a group: until a poll finds nothing more
    and nothing left (the lag, from the fetch's high watermark), or ``timeout_s``."""
    consumer = bus.consumer(topic, None, "streamppo-status")
    records, empty, deadline = [], 0, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            batch = consumer.poll(0.3, max_records=10_000)
            records += batch
            # An empty topic's high watermark may not be known after its first poll: a second one says so.
            if not batch and not consumer.lag() and (records or empty):
                break
            empty = 0 if batch else empty + 1
    finally:
        consumer.close()
    return records


def read_status(bus: Bus, run_id: str, timeout_s: float = 20.0) -> PipelineStatus:
    """The status, weights and dead-letter topics, read at once (one reader each, in threads): a call takes about
    as long as reading the longest of them."""
    topics = [STATUS_TOPIC, WEIGHTS_TOPIC, *(dlq_topic(topic) for topic in TOPIC_MESSAGE)]
    with ThreadPoolExecutor(max_workers=len(topics)) as pool:
        read = dict(zip(topics, pool.map(lambda topic: _read_all(bus, topic, timeout_s), topics)))
    status = PipelineStatus(run_id)
    for record in read[STATUS_TOPIC]:
        try:
            report = decode(record.value, expected=ReplicaStatus)
        except SchemaError:
            continue
        current = status.replicas.get(report.replica)
        if report.run_id == run_id and (current is None or report.created_at >= current.created_at):
            status.replicas[report.replica] = report
    for record in read[WEIGHTS_TOPIC]:
        try:
            announcement = decode(record.value, expected=WeightAnnouncement)
        except SchemaError:
            continue
        if announcement.lineage.get(RUN_ID) == run_id:
            newest = max(status.weights.get(announcement.model, -1), announcement.policy_version)
            status.weights[announcement.model] = newest
    for topic in TOPIC_MESSAGE:
        status.dead_letters[dlq_topic(topic)] = len(read[dlq_topic(topic)])
    status.brokers, status.replication = bus.replication([spec.name for spec in pipeline_topics()])
    return status


def format_replication(brokers: int, replication: dict[str, int]) -> str:
    """One line of the run's topics' copies, and a warning where a cluster of several brokers holds a topic in one
    copy (a broker's loss loses its partitions)."""
    counts = sorted(set(replication.values()))
    line = (
        f"topics: {'/'.join(map(str, counts)) or '?'} cop{'y' if counts == [1] else 'ies'} each on {brokers} broker(s)"
    )
    single = sorted(topic for topic, copies in replication.items() if copies == 1)
    if brokers > 1 and single:
        line += (
            f"\nWARNING: {len(single)} topic(s) keep one copy on a cluster of {brokers} brokers "
            f"({', '.join(single[:4])}{', ...' if len(single) > 4 else ''}): a broker's loss loses their partitions; "
            "topics made by streamppo take the cluster's replication unless kafka.replication_factor says otherwise"
        )
    return line


def save_status(run_dir: Path, status: PipelineStatus) -> None:
    """Keep ``status`` in the run directory (where it exists here): what ``status`` shows when the broker does not
    answer."""
    if not Path(run_dir).is_dir():
        return
    saved = {
        "run_id": status.run_id,
        "read_at": status.read_at,
        "replicas": [encode(report).hex() for report in status.replicas.values()],
        "weights": status.weights,
        "dead_letters": status.dead_letters,
        "brokers": status.brokers,
        "replication": status.replication,
    }
    with contextlib.suppress(OSError):
        (Path(run_dir) / SAVED_STATUS).write_text(json.dumps(saved))


def read_saved_status(run_dir: Path) -> PipelineStatus | None:
    """The status :func:`save_status` kept, its replicas' reports as they were (None if there is none)."""
    try:
        saved = json.loads((Path(run_dir) / SAVED_STATUS).read_text())
        reports = [decode(bytes.fromhex(report), expected=ReplicaStatus) for report in saved["replicas"]]
        return PipelineStatus(
            saved["run_id"],
            {report.replica: report for report in reports},
            saved["weights"],
            saved["dead_letters"],
            time.time(),  # ages shown from now: every replica's report is as old as it is
            saved["brokers"],
            saved["replication"],
        )
    except (OSError, ValueError, KeyError, TypeError, SchemaError):
        return None


def from_the_run_directory(run_dir: Path) -> str:
    """What the run directory tells of a run whose broker does not answer: its last update and the status last read
    from the broker (:func:`save_status`)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    try:
        last = json.loads(metrics.read_text().splitlines()[-1])
        lines = [f"last update: step {last['step']}, {time.time() - metrics.stat().st_mtime:.0f} s ago ({metrics})"]
    except (OSError, IndexError, ValueError, KeyError):
        lines = [f"no update in {run_dir} yet"]
    saved = read_saved_status(run_dir)
    if saved is None:
        lines.append("no status was read from the broker before (it is kept in the run directory when one is)")
    else:
        lines += ["the status last read from the broker, every report as old as it is:", format_status(saved)]
    return "\n".join(lines)


def format_status(status: PipelineStatus) -> str:
    order = {name: i for i, name in enumerate(ROLES)}
    replicas = sorted(status.replicas.values(), key=lambda r: (order.get(r.role, len(order)), r.replica))
    signed = {r.counters.get("signed") for r in replicas} - {None}
    signing = (
        "messages signed" if signed == {1} else
        "UNSIGNED: any client of the broker can forge its records (pipeline.run_key or signing_key_env signs them)"
        if signed == {0} else "some replicas sign and some do not" if signed else "signing unknown"
    )  # fmt: skip
    lines = [f"run {status.run_id}: {len(replicas)} replica(s) reporting; {signing}"]
    header = f"{'replica':<28}{'state':<10}{'lag':>6}{'held':>6}{'processed':>11}{'dropped':>9}{'dlq':>5}  weights"
    lines.append(header)
    for r in replicas:
        counters = r.counters
        versions = ", ".join(
            f"{k.removeprefix('weights.')} v{v}" for k, v in counters.items() if k.startswith("weights.")
        )
        age = status.read_at - r.created_at
        silent = r.state in ("serving", "waiting") and age > SILENT_AFTER_S
        state = "silent" if silent else r.state
        lines.append(
            f"{r.replica:<28}{state:<10}{r.lag:>6}{r.held:>6}{counters.get('processed', 0):>11}"
            f"{counters.get('dropped', 0):>9}{counters.get('dead_letters', 0):>5}  {versions or '-'}"
            f"  ({age:.0f} s ago)"
        )
        if silent:
            lines.append(
                f"    no report for {age:.0f} s (a replica reports every {REPORT_EVERY_S:.0f} s): stopped, gone, or in "
                f"one long batch; it last said {r.state}"
            )
        if r.url:
            lines.append(f"    serving {r.url}")
        if "fleet.runs" in counters:
            lines.append("    " + _fleet_share(counters))
        if r.waiting_for:
            lines.append(f"    waiting on {r.waiting_for}")
    per_role = {}
    for r in replicas:
        per_role[r.role] = per_role.get(r.role, 0) + r.lag
    lines.append("lag per role: " + (", ".join(f"{role} {lag}" for role, lag in per_role.items()) or "-"))
    lines.append("newest weights: " + (", ".join(f"{m} v{v}" for m, v in sorted(status.weights.items())) or "none"))
    lines.append("dead letters: " + ", ".join(f"{t} {n}" for t, n in status.dead_letters.items()))
    if status.brokers and status.replication:
        lines.append(format_replication(status.brokers, status.replication))
    return "\n".join(lines)


def _fleet_share(counters: dict) -> str:
    """A fleet replica's line for this run: its share of the replica, and what it used."""
    quota = counters.get("fleet.quota_tokens_per_s")
    return (
        f"fleet replica of {counters['fleet.runs']} run(s): this run's share {counters['fleet.share']:g} "
        f"({counters['fleet.share_fraction']:.0%} of the shares), used {counters['fleet.compute_fraction']:.0%} of "
        f"its compute, {counters['fleet.tokens_per_s']:g} tokens/s"
        + (f" (quota {quota:g})" if quota is not None else "")
    )


def _finished(status: PipelineStatus, ending: set[str]) -> bool:
    """The newest report of each role that ends the run says ``done`` (an older replica of it, one replaced by a new
    container, may have said ``stopped``)."""
    for role in ending:
        reports = [r for r in status.replicas.values() if r.role == role]
        if not reports or max(reports, key=lambda r: r.created_at).state != "done":
            return False
    return True


def wait_for_run(
    bus: Bus,
    run_id: str,
    ending: set[str],
    steps: int,
    timeout_s: float | None = None,
    report_every_s: float = 30.0,
    poll_s: float = 2.0,
    say=print,
) -> PipelineStatus | None:
    """Follow a run that other processes serve until every role in ``ending`` is done (``streamppo wait``): a line
    for each new actor version, every ``report_every_s`` the status table (what each replica waits for). Returns the
    last status, or None after ``timeout_s`` (having said what the run waited for)."""
    started = time.monotonic()
    next_report, version, status = started + report_every_s, None, None
    while True:
        if bus.log_identity(LOG_TOPIC) is None:
            waiting = f"the log of run {run_id!r}: no service has made it on this broker yet"
        else:
            status = read_status(bus, run_id, timeout_s=10.0)
            if _finished(status, ending):
                return status
            if status.weights.get("actor") != version:
                version = status.weights.get("actor")
                say(f"actor v{version} of {steps} published", flush=True)
            waiting = (
                "; ".join(
                    f"{r.replica}: {r.state}{f' ({r.waiting_for})' if r.waiting_for else ''}"
                    for r in status.replicas.values()
                    if r.role in ending
                )
                or f"a report of {', '.join(sorted(ending))}"
            )
        now = time.monotonic()
        if timeout_s is not None and now - started >= timeout_s:
            say(f"streamppo wait: the run is not done after {timeout_s:.0f} s; waiting for {waiting}", flush=True)
            return None
        if now >= next_report:
            next_report = now + report_every_s
            say(format_status(status) if status is not None else f"waiting for {waiting}", flush=True)
        time.sleep(poll_s)
