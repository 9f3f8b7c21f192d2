"""Apache Kafka, started by the project: the broker the design names, run from Maven Central's jars.

    python -m services.transport.brokers.apache_kafka fetch       the jars, once, into the cache (``make setup``)
    python -m services.transport.brokers.apache_kafka run DIR     one broker on DIR, in the foreground (Ctrl-C)
    python -m services.transport.brokers.apache_kafka probe PORT  exit 0 when a Kafka broker serves on PORT

The module imports nothing of streamppo: the Kafka image (deploy/docker/Dockerfile, target kafka) runs it as a file,
its jars in ``$STREAMPPO_KAFKA_HOME``.

The jars are ``org.apache.kafka:kafka_2.13`` and its dependencies, plus log4j2's SLF4J 1.x binding, which Kafka's POM
leaves out on purpose (``deploy/kafka/pom.xml``, the one list, fetched with Maven's ``dependency:copy-dependencies``)
into ``$STREAMPPO_KAFKA_HOME`` or ``~/.cache/streamppo/kafka-<version>``: outside the clone, fetched once per machine.

:class:`KafkaBroker` is one KRaft node, broker and controller in one JVM, on loopback ports, its log in a folder of
its own, formatted once (``kafka.tools.StorageTool format``): started again on the same folder, it has every record
it had, so a run's log outlives the broker's restart. :class:`KafkaCluster` is N such nodes, a quorum of N
controllers (``controller.quorum.voters``), for replication. Sized for a 2-core machine beside the tests: a small heap,
the client compiler only, two network and I/O threads, a small log-cleaner buffer and a cleaner that runs often (the
compacted ``weights`` topic), the first rebalance at once (``group.initial.rebalance.delay.ms=0``), and short consumer
sessions allowed (a killed replica's partitions move on in seconds). The broker's own log goes to ``broker.log`` in
its folder, never to the terminal. Without Java, or when the fetch fails, :class:`KafkaUnavailable` says so in a line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

__all__ = ["KAFKA_VERSION", "KafkaBroker", "KafkaCluster", "KafkaUnavailable", "jars", "kafka_available"]

KAFKA_VERSION = "4.4.0"
# The checkout's (services/transport/brokers/ is three folders down); the Kafka image runs this file alone, from a
# folder with fewer parents, and has its jars already.
_PARENTS = Path(__file__).resolve().parents
POM = _PARENTS[min(3, len(_PARENTS) - 1)] / "deploy" / "kafka" / "pom.xml"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the largest record (kafka.max_message_bytes's default): broker and topics
# The JVM of one node: heap, the client compiler alone (a broker's start is mostly class loading: C2 only costs CPU
# there), the serial collector (one core's worth of GC threads).
JVM_OPTIONS = ["-Xms96m", "-Xmx320m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:CICompilerCount=1",
               "-XX:MaxMetaspaceSize=160m", "-Xss512k", "-Djava.awt.headless=true"]  # fmt: skip
READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KafkaUnavailable(RuntimeError):
    """Apache Kafka cannot be run here: no Java, no jars and no Maven to fetch them, or a fetch that failed."""


def cache_dir() -> Path:
    return Path(
        os.environ.get("STREAMPPO_KAFKA_HOME") or Path.home() / ".cache" / "streamppo" / f"kafka-{KAFKA_VERSION}"
    )


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    found = (
        str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").exists() else shutil.which("java")
    )
    if found is None:
        raise KafkaUnavailable("no Java here (Apache Kafka needs Java 17 or later): `apt-get install openjdk-17-jre`")
    return found


def jars(fetch: bool = True) -> list[Path]:
    """The broker's jars in the cache, fetched first when missing (and ``fetch``)."""
    libs = cache_dir() / "libs"
    done = libs / ".complete"
    if not done.exists():
        if not fetch:
            raise KafkaUnavailable(f"Apache Kafka {KAFKA_VERSION}'s jars are not in {libs} (`make setup` fetches them)")
        _fetch(libs)
        done.write_text(KAFKA_VERSION + "\n")
    return sorted(libs.glob("*.jar"))


def _fetch(libs: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailable(f"Apache Kafka {KAFKA_VERSION}'s jars are not in {libs}, and there is no Maven to fetch "
                               "them (`apt-get install maven`)")  # fmt: skip
    if not POM.exists():
        raise KafkaUnavailable(f"no {POM} to fetch Apache Kafka's jars with (an installed streamppo has none)")
    partial = libs.with_name("libs.partial")
    shutil.rmtree(partial, ignore_errors=True)
    command = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={partial}",
               "-DincludeScope=runtime"]  # fmt: skip
    fetched = subprocess.run(command, capture_output=True, text=True)
    if fetched.returncode != 0 or not list(partial.glob("kafka_2.13-*.jar")):
        said = (fetched.stdout + fetched.stderr).strip().splitlines()[-3:]
        raise KafkaUnavailable(
            f"fetching Apache Kafka {KAFKA_VERSION}'s jars from Maven Central failed: {' / '.join(said)}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)


def kafka_available() -> str | None:
    """None where Apache Kafka can be run here (Java, and its jars or Maven to fetch them), else why not."""
    try:
        java()
        if not (cache_dir() / "libs" / ".complete").exists() and shutil.which("mvn") is None:
            raise KafkaUnavailable("no jars of Apache Kafka here and no Maven to fetch them")
    except KafkaUnavailable as exc:
        return str(exc)
    return None


_LOG4J2 = """Configuration:
  status: warn
  Appenders:
    RollingFile:
      name: file
      fileName: "{log}"
      filePattern: "{log}.%i"
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
      Policies:
        SizeBasedTriggeringPolicy:
          size: 20 MB
      DefaultRolloverStrategy:
        max: 2
  Loggers:
    Root:
      level: INFO
      AppenderRef:
        - ref: file
    Logger:
      - name: kafka.request.logger
        level: WARN
      - name: org.apache.kafka.controller
        level: WARN
      - name: state.change.logger
        level: WARN
"""


class KafkaBroker:
    """One KRaft node (broker and controller) on loopback, its log in ``directory``.

    ``start()`` formats the folder the first time and starts the JVM; ``stop()`` shuts it down cleanly (SIGTERM),
    ``kill()`` as a crash would (SIGKILL); ``start()`` again takes up the same log. In a :class:`KafkaCluster` its
    quorum is the cluster's.
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        controller_port: int | None = None,
        node_id: int = 1,
        voters: str | None = None,
        cluster_id: str | None = None,
        replication: int = 1,
        settings: dict[str, str] | None = None,
    ):
        self.directory = Path(directory)
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        self.node_id = node_id
        self.voters = voters  # "1@127.0.0.1:p1,2@..." in a cluster; None: a quorum of this node alone
        self.cluster_id = cluster_id
        self.replication = replication
        self.settings = settings or {}
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "broker.log"

    def properties(self) -> dict[str, str]:
        quorum = (
            {"controller.quorum.voters": self.voters}
            if self.voters
            else {"controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}"}
        )
        replicated = str(min(3, self.replication))
        return {
            "node.id": str(self.node_id),
            "process.roles": "broker,controller",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            **quorum,
            "log.dirs": str(self.directory / "data"),
            # The services make their topics (partitions, a compacted weights topic, .dlq): none made by a client.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            "default.replication.factor": replicated,
            "offsets.topic.replication.factor": replicated,
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": replicated,
            "transaction.state.log.min.isr": "2" if self.replication >= 3 else "1",
            "share.coordinator.state.topic.replication.factor": replicated,
            "share.coordinator.state.topic.min.isr": "2" if self.replication >= 3 else "1",
            "min.insync.replicas": "2" if self.replication >= 3 else "1",
            "group.initial.rebalance.delay.ms": "0",
            "group.min.session.timeout.ms": "1000",  # the services' short sessions (up, the tests): allowed
            # A broker that stops answering (its host lost, its link cut, no connection reset) is fenced in
            # seconds, and a follower that falls behind leaves the in-sync set in seconds (deploy/contract.yaml).
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "3000",
            "replica.lag.time.max.ms": "6000",
            "controller.quorum.fetch.timeout.ms": "2000",
            "controller.quorum.election.timeout.ms": "1000",
            "message.max.bytes": str(MAX_MESSAGE_BYTES),
            "replica.fetch.max.bytes": str(MAX_MESSAGE_BYTES),
            "replica.fetch.response.max.bytes": str(2 * MAX_MESSAGE_BYTES),
            "socket.request.max.bytes": str(2 * MAX_MESSAGE_BYTES),
            "num.network.threads": "2",
            "num.io.threads": "2",
            "num.replica.fetchers": "1",
            "background.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
            # The log cleaner (the compacted weights topic): a buffer a small heap holds, run often.
            "log.cleaner.threads": "1",
            "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
            "log.cleaner.io.buffer.size": str(512 * 1024),
            "log.cleaner.backoff.ms": "1000",
            "log.cleaner.min.compaction.lag.ms": "0",
            "log.retention.check.interval.ms": "30000",
            **self.settings,
        }

    def _write_config(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "server.properties"
        path.write_text("".join(f"{key}={value}\n" for key, value in self.properties().items()))
        (self.directory / "log4j2.yaml").write_text(_LOG4J2.format(log=self.log_path))
        return path

    def _java(self, main: str, *args: str) -> list[str]:
        classpath = os.pathsep.join(str(jar) for jar in jars())
        log4j = f"-Dlog4j2.configurationFile={self.directory / 'log4j2.yaml'}"
        return [java(), *JVM_OPTIONS, log4j, "-cp", classpath, main, *args]

    @property
    def formatted(self) -> bool:
        return (self.directory / "data" / "meta.properties").exists()

    def format(self) -> None:
        """Format the log folder, once (a node with a log keeps it)."""
        config = self._write_config()
        if self.formatted:
            return
        cluster = self.cluster_id or uuid.uuid4().hex[:22]
        quorum = [] if self.voters else ["--standalone"]
        command = self._java(
            "kafka.tools.StorageTool", "format", *quorum, "-t", _kafka_uuid(cluster), "-c", str(config)
        )
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).strip().splitlines()[-2:]
            raise KafkaUnavailable(f"formatting Kafka's log in {self.directory} failed: {' / '.join(said)}")

    def launch(self) -> KafkaBroker:
        """Start the JVM (formatted first if need be) without waiting for it to listen."""
        self.format()
        self._write_config()
        with open(self.directory / "jvm.out", "ab") as out:
            self.process = subprocess.Popen(
                self._java("kafka.Kafka", str(self.directory / "server.properties")),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the terminal is for the services: the broker stops last
                preexec_fn=_stop_with_parent,
            )
        return self

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> KafkaBroker:
        """Start the broker and wait until it serves (a client's metadata request is answered)."""
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KafkaUnavailable(
                    f"Apache Kafka exited with code {self.process.returncode} at start: {self._first_error()} "
                    f"(its log: {self.log_path})"
                )
            if _answers(self.port):
                return
            time.sleep(0.1)
        self.kill()
        raise KafkaUnavailable(
            f"Apache Kafka did not serve on {self.bootstrap} within {timeout_s:.0f} s ({self.log_path})"
        )

    def _first_error(self) -> str:
        """The log's first ERROR and the exception under it ("... Socket server failed to bind to 127.0.0.1:9093:
        Address already in use."): the cause, where the log's last lines are a stack trace's end."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        for i, line in enumerate(lines):
            if " ERROR " in line:
                cause = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].startswith("[") else ""
                return " / ".join(part for part in (line.split(" ERROR ", 1)[1], cause) if part)
        return " / ".join(lines[-3:]) or "no log written"

    def stop(self, timeout_s: float = 30.0) -> None:
        """A clean shutdown (its log is flushed and closed); killed if it takes longer than ``timeout_s``."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def kill(self) -> None:
        """``kill -9``, as a crash: the log keeps what was written (and fsynced by the OS)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class KafkaCluster:
    """``size`` KRaft nodes on loopback, each broker and controller, with replication ``size`` (3: min.insync 2)."""

    def __init__(self, directory: Path, size: int = 3, settings: dict[str, str] | None = None):
        ports = [(free_port(), free_port()) for _ in range(size)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{controller}" for i, (_, controller) in enumerate(ports))
        cluster = uuid.uuid4().hex[:22]
        self.nodes = [
            KafkaBroker(Path(directory) / f"node-{i + 1}", port, controller, i + 1, voters, cluster, size, settings)
            for i, (port, controller) in enumerate(ports)
        ]
        self.bootstrap = ",".join(node.bootstrap for node in self.nodes)

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> KafkaCluster:
        for node in self.nodes:  # all at once: a controller quorum forms only with a majority up
            node.launch()
        for node in self.nodes:
            node.wait_ready(timeout_s)
        return self

    def node(self, node_id: int) -> KafkaBroker:
        return self.nodes[node_id - 1]

    def controller(self) -> int:
        """The node id of the active controller: the leader of the newest epoch the live nodes' quorum-state files
        name (one node's file may be a term behind)."""
        known = []
        for node in self.nodes:
            state = node.directory / "data" / "__cluster_metadata-0" / "quorum-state"
            if node.running and state.exists():
                data = json.loads(state.read_text())
                if data.get("leaderId", -1) > 0:
                    known.append((data.get("leaderEpoch", 0), data["leaderId"]))
        if not known:
            raise KafkaUnavailable("no node of the cluster knows the quorum's leader")
        return max(known)[1]

    def leaders(self, topic: str) -> set[int]:
        """The node ids that lead ``topic``'s partitions."""
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","), client_id="streamppo-leaders")
        try:
            (described,) = admin.describe_topics([topic])
            return {partition["leader_id"] for partition in described["partitions"]}
        finally:
            admin.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_with_parent() -> None:
    """In the broker's process, before Java starts: SIGTERM (a clean shutdown, its log closed) once the process that
    started it is gone, however it went (`up` killed by -9 left its broker running, holding its port and log)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _kafka_uuid(seed: str) -> str:
    """A cluster id in Kafka's form (22 characters of URL-safe base64 of 16 bytes), from ``seed``. Never one that
    starts with "-": kafka-storage's command line reads it as an option (1 start in 64 failed), and Kafka's own
    ``Uuid.randomUuid`` draws again for the same reason."""
    import base64
    import hashlib

    digest = hashlib.md5(seed.encode()).digest()
    while (found := base64.urlsafe_b64encode(digest).decode().rstrip("="))[0] == "-":
        digest = hashlib.md5(digest).digest()
    return found


def _answers(port: int) -> bool:
    """Whether a Kafka broker serves on ``port``: its answer to an ApiVersions request (not just an open socket:
    the listener opens before the broker has caught up with its quorum)."""
    request = (
        (18).to_bytes(2, "big")
        + (0).to_bytes(2, "big")
        + (1).to_bytes(4, "big")
        + (9).to_bytes(2, "big")
        + b"streamppo"
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as conn:
            conn.sendall(len(request).to_bytes(4, "big") + request)
            size = int.from_bytes(_read(conn, 4), "big")
            answer = _read(conn, size)
            return int.from_bytes(answer[4:6], "big") == 0  # correlation id, then error code 0
    except OSError:
        return False


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="fetch Apache Kafka's jars into the cache, once")
    run = sub.add_parser("run", help="one broker in the foreground, its log in DIR")
    run.add_argument("dir", type=Path)
    run.add_argument("--port", type=int, default=9092)
    run.add_argument("--controller-port", type=int, default=None, help="the controller's listener (PORT + 1)")
    probe = sub.add_parser("probe", help="exit 0 when a Kafka broker serves on PORT (a container's health check)")
    probe.add_argument("port", type=int)
    args = parser.parse_args(argv)
    if args.command == "probe":
        return 0 if _answers(args.port) else 1
    try:
        if args.command == "fetch":
            found = jars()
            print(f"Apache Kafka {KAFKA_VERSION}: {len(found)} jars in {found[0].parent}")
            java()
            return 0
        broker = KafkaBroker(args.dir, args.port, args.controller_port or args.port + 1).start()
    except KafkaUnavailable as exc:
        print(f"kafka: {exc}", file=sys.stderr)
        return 1
    print(f"Apache Kafka {KAFKA_VERSION} serving on {broker.bootstrap} (its log: {broker.log_path}); Ctrl-C stops it",
          flush=True)  # fmt: skip
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `docker stop`: a clean shutdown, as Ctrl-C
    try:
        return broker.process.wait()
    except KeyboardInterrupt:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
