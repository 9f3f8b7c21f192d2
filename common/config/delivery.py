"""The sections of how the pipeline moves what it makes: delivery (staleness, held input, stores, signing), weights
(snapshots, the broadcast), and Kafka (the broker, its retention, its security)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from common.config.base import ConfigError, DType, Section, read_secret
from common.schema import TOPIC_MESSAGE, BatchMessage
from common.signing import make_run_key


class PipelineSection(Section):
    max_staleness: int = Field(0, ge=0, description="0: strictly on-policy; k: generation may run k versions ahead.")
    stale_reserve: float = Field(
        0.5,
        ge=0,
        description="Groups dropped as too stale (an agent's episode that outlasted updates, a learner rolled back "
        "by a crash) are replaced by prompt batches past the run's own, published as the drops happen, up to this "
        "fraction of the run's prompt batches: a run still makes run.steps updates. 0: none (the run ends short).",
    )
    keep_snapshots: int = Field(3, gt=0, description="Weight snapshots kept per model in the weight store.")
    weight_store: Path | None = Field(None, description="Shared weight directory; default: <run.dir>/weights.")
    inline_max_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="A batch that encodes to more bytes travels by reference: written to the batch store, with a "
        "small record on its topic pointing to it. Above ~1 MB that hop is the faster one (benchmarks/RESULTS.md, "
        "section 9), and every record then fits a broker's default limit (Apache Kafka: 1 MB); a 7B experience "
        "batch is ~84 MB. At most kafka.max_message_bytes − 64 KiB.",
    )
    batch_store: Path | None = Field(
        None, description="Shared directory of batches sent by reference; default: <run.dir>/batches."
    )
    hold_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="A service that holds input (waiting for newer weights, or an earlier step) and handles nothing "
        "else for this long dead-letters the held record furthest ahead, so that what sits behind it in its "
        "partition can flow. Above the longest update a run can take.",
    )
    held_per_partition: int = Field(
        4,
        gt=0,
        description="Input records a service keeps aside per partition while it is not ready for them (a prompt "
        "batch waiting for newer weights, experience of a later step), reading on past them; with this many, the "
        "partition is paused. Input is committed only below the oldest record kept aside.",
    )
    dedupe_window: int = Field(
        4096,
        gt=0,
        description="Idempotency keys each replica remembers to recognise re-deliveries: prompt batch ids, and past "
        "the generator one key per group (the learner keeps them in its checkpoint, so a checkpoint never grows with "
        "the run). Keep it above the groups a crash can bring back: those in flight and since the last checkpoint.",
    )
    signing_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the run's signing key: every message a service "
        "publishes is signed with it (HMAC-SHA256), and what is unsigned or signed with another key is refused. "
        "Unset (and no signing_key_file): messages are not signed.",
    )
    signing_key_file: Path | None = Field(None, description="File whose content is the run's signing key.")
    run_key: bool = Field(
        False,
        description="Sign with a key made for the run when no signing_key_env or signing_key_file names one: the "
        "first service to start writes a random key to <run.dir>/signing.key (mode 0600), every other reads it. "
        "streamppo up, the compose file and the chart turn it on, so that a client of the broker cannot forge a "
        "record; false there is an unsigned run, which streamppo status shows.",
    )

    @model_validator(mode="after")
    def _one_key_source(self):
        if self.signing_key_env is not None and self.signing_key_file is not None:
            raise ValueError("set at most one of pipeline.signing_key_env and pipeline.signing_key_file")
        return self

    def signing_key(self, run_dir: Path | None = None) -> bytes | None:
        """The run's signing key, read now (ConfigError naming the variable or file when it cannot be); None when
        messages are not signed. With ``run_key`` and no other source, the run's own key in ``run_dir``, made by
        whoever asks first. Never logged."""
        if self.signing_key_env is None and self.signing_key_file is None:
            if not self.run_key or run_dir is None:
                return None
            try:
                path = make_run_key(Path(run_dir))
            except OSError as exc:
                raise ConfigError(f"pipeline.run_key: cannot make the run's key in {run_dir}: {exc.strerror}") from None
            return read_secret(None, path, "the run's signing key").encode()
        return read_secret(self.signing_key_env, self.signing_key_file, "pipeline signing key").encode()


class BroadcastSection(Section):
    """The broadcast path: the learner sends each actor version straight to the generators (torch.distributed, gloo)
    besides writing it to the store, which late joiners and every fallback read."""

    address: str | None = Field(
        None,
        pattern=r"^\S+:\d{1,5}$",
        description="HOST:PORT where the learner's rank 0 listens for the generators (a port of its own, not "
        "torchrun's); unset: weights go by the store alone.",
    )
    receivers: int = Field(
        1,
        ge=1,
        description="How many receivers make the group: generator replicas (× generation.vllm.tensor_parallel_size "
        "with vLLM, whose every worker receives); the learner sends once all have joined.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for any step of a broadcast (a round to fill, a tensor to go): a receiver that "
        "died or hangs costs the learner this once, then the update goes by the store and a new group forms.",
    )


class WeightsSection(Section):
    dtype: DType = Field(
        "float32",
        description="dtype of the actor and critic snapshots the learner publishes (bfloat16 halves them; the "
        "learner's master weights stay float32).",
    )
    digest: Literal["blake3", "sha256"] = Field(
        "blake3",
        description="Digest of each snapshot, named in its announcement: blake3 (multi-threaded, several times faster: "
        "benchmarks/RESULTS.md, section 5) "
        "or sha256. Readers check either.",
    )
    full_every: int = Field(
        1,
        ge=1,
        description="Write a full snapshot every this many versions and deltas (the changed elements) between; 1: "
        "always full. Pays with bfloat16 snapshots and small learning rates, where few elements change per update; "
        "float32 weights change everywhere, and a delta not under half the full size is written full anyway.",
    )
    broadcast: BroadcastSection = BroadcastSection()


class TopicRetention(Section):
    hours: float | None = Field(None, gt=0, description="Hours this topic's records are kept; none: the default.")
    bytes: int | None = Field(None, gt=0, description="Per partition, as Kafka's retention.bytes.")


class RetentionSection(Section):
    """How long the log is kept. Set on the data topics (and their dead letters) when streamppo creates them, and
    kept by the batch store for the files of batches that travel by reference: a record and its file go together."""

    hours: float | None = Field(
        168.0,
        gt=0,
        description="Kafka's retention.ms of the data topics, in hours (its default: 7 days); null: forever.",
    )
    bytes: int | None = Field(None, gt=0, description="Kafka's retention.bytes (per partition); null: no limit.")
    topics: dict[str, TopicRetention] = Field(
        {}, description="Per topic (prompts, rollouts, scored, experience), what differs from the above."
    )
    remove_committed_batches: bool = Field(
        False,
        description="Remove a referenced batch's file as soon as its reader commits past its record (the log then "
        "cannot replay or export that record): for disks that cannot keep a run's batches for its retention.",
    )

    @model_validator(mode="after")
    def _known_topics(self):
        data = [topic for topic, cls in TOPIC_MESSAGE.items() if issubclass(cls, BatchMessage)]
        unknown = sorted(set(self.topics) - set(data))
        if unknown:
            raise ValueError(f"retention of unknown topic(s) {unknown}; data topics: {data}")
        return self

    def of(self, topic: str) -> tuple[float | None, int | None]:
        """``(hours, bytes)`` for ``topic`` (a data topic or its dead letters)."""
        own = self.topics.get(topic.removesuffix(".dlq"))
        hours = own.hours if own is not None and own.hours is not None else self.hours
        size = own.bytes if own is not None and own.bytes is not None else self.bytes
        return hours, size


class KafkaSection(Section):
    """How the services reach Kafka when they run as processes (``--bootstrap`` overrides ``bootstrap``)."""

    bootstrap: str | None = Field(None, description="HOST:PORT[,HOST:PORT]")
    namespace: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,180}$",
        description="Prefix of the run's topics and consumer groups (<namespace>.prompts, ...): runs of other "
        "namespaces on one cluster share nothing. Default: run.run_id.",
    )
    partitions: int = Field(4, gt=0, description="Partitions of the data topics when streamppo creates them.")
    replication_factor: int | None = Field(
        None,
        gt=0,
        description="Copies of each partition when streamppo creates its topics. Default: the brokers' "
        "default.replication.factor, but at least 3 on a cluster of 3 brokers or more (1 on one broker). Each topic "
        "gets min.insync.replicas 2 from 3 copies on (1 below): with the producers' acks=all a record is on two "
        "brokers before it counts as sent, and one broker's loss loses nothing.",
    )
    retention: RetentionSection = RetentionSection()
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0, description="The largest record the clients send or fetch.")
    session_timeout_ms: int = Field(
        6000,
        gt=0,
        description="How long a silent consumer keeps its partitions; "
        "Apache Kafka accepts ≥ 6000 unless its group.min.session.timeout.ms is lowered.",
    )
    heartbeat_interval_ms: int = Field(1000, gt=0, description="How often a consumer tells its group it is alive.")
    static_members: bool = Field(
        True,
        description="A replica joins its consumer group under its replica id (Kafka's group.instance.id): started "
        "again, it is the same member, and the supervisor that saw it die (streamppo up) removes it from the group "
        "at once rather than after the session timeout. Off for a broker without static membership (the local "
        "test broker).",
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a service waits for an unreachable broker "
        "(one that is still starting) before it stops with an error.",
    )
    request_timeout_ms: int = Field(
        5000,
        gt=100,
        description="How long a client waits for a broker's answer before it gives up on that broker and asks the "
        "cluster for the partitions' new leaders: a broker that stops answering without closing its connections "
        "(its host lost, its link cut) costs this much, not kafka-python's 30 s. A healthy broker answers every "
        "request the services send within a second; raise it where records of many MB cross a slow link.",
    )
    reconnect_backoff_max_ms: int = Field(
        1000,
        gt=0,
        description="The longest wait between attempts to reconnect to a broker (kafka-python's own: 30 s), so "
        "that a broker back after a cut is used again within a second.",
    )
    metadata_max_age_ms: int = Field(
        3000,
        gt=0,
        description="How often each client asks the cluster for the partitions' leaders. kafka-python looks them up "
        "again after a request to a broker that stopped answering timed out only on this cadence (its own: 5 "
        "minutes): a silent broker's partitions were stuck 15 s at 5 minutes, 5 s at 3 s (benchmarks/RESULTS.md, 7).",
    )
    fetch_max_wait_ms: int = Field(
        100,
        ge=0,
        description="Longest a broker may hold an empty fetch. Brokers that do not answer early when data "
        "arrives (the local test broker) make this the per-hop latency; Kafka's own default is 500.",
    )
    idempotent_producer: bool = Field(
        True,
        description="acks=all plus idempotence; turn off only for a broker whose idempotence kafka-python "
        "cannot use (the local test broker).",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How the clients reach the brokers."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="With SASL_*: the mechanism."
    )
    sasl_username: str | None = Field(
        None, description="With SASL_*: the user (its password by sasl_password_env or _file)."
    )
    sasl_password_env: str | None = Field(None, description="Name of the environment variable with the password.")
    sasl_password_file: Path | None = Field(None, description="File whose content is the password.")
    ssl_cafile: Path | None = Field(None, description="With SSL: the CA bundle that signed the brokers' certificates.")
    ssl_certfile: Path | None = Field(None, description="With SSL: the client's certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(None, description="With SSL: the client certificate's key.")
    ssl_password_env: str | None = Field(None, description="Environment variable with the key's password.")

    @model_validator(mode="after")
    def _a_request_outlasts_an_empty_fetch(self):
        if self.request_timeout_ms <= self.fetch_max_wait_ms:
            raise ValueError(
                f"request_timeout_ms ({self.request_timeout_ms}) must exceed fetch_max_wait_ms "
                f"({self.fetch_max_wait_ms}): the broker may hold a fetch that long before it answers"
            )
        return self

    @model_validator(mode="after")
    def _security_is_complete(self):
        if self.security_protocol.startswith("SASL"):
            if self.sasl_mechanism is None or self.sasl_username is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism and sasl_username")
            if (self.sasl_password_env is None) == (self.sasl_password_file is None):
                raise ValueError("set exactly one of sasl_password_env and sasl_password_file")
        elif self.sasl_mechanism is not None:
            raise ValueError("sasl_mechanism is set but security_protocol is not SASL_PLAINTEXT or SASL_SSL")
        return self

    def client_options(self) -> dict:
        """kafka-python security options, with secrets read from the environment or files now.

        Raises ConfigError naming the variable or file when a secret is missing. The values returned must not be
        logged; only their names appear in config and messages.
        """
        options: dict = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            options.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=read_secret(self.sasl_password_env, self.sasl_password_file, "kafka SASL password"),
            )
        if self.security_protocol in ("SSL", "SASL_SSL"):
            for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                path = getattr(self, key)
                if path is not None:
                    if not path.is_file():
                        raise ConfigError(f"kafka.{key}: file not found: {path}")
                    options[key] = str(path)
            if self.ssl_password_env is not None:
                options["ssl_password"] = read_secret(self.ssl_password_env, None, "kafka SSL key password")
        return options
