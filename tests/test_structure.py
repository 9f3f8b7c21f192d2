"""The shape of the code: one role registry, one service lifecycle, no import cycles, no import-time side effects."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.schema import TOPIC_MESSAGE
from services.roles import COMPACTED_TOPICS, LOG_TOPIC, ROLES, STATUS_TOPIC, WEIGHTS_TOPIC, Role, pipeline_topics
from services.service import Service

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "services", "recipes")


def project_modules(packages=PACKAGES) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in ``path``, deferred (in-function) imports included; not those only a type
    checker reads (``if TYPE_CHECKING:``): a part that names the class it serves in its annotations (the runner's
    parts, the runner) runs without importing it."""
    found = set()
    tree = ast.parse(path.read_text())
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            # `from common import ppo` imports the module common.ppo; `from common.ppo import gae` imports common.ppo
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = project_modules((*PACKAGES, "benchmarks"))
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    # A package's __init__ re-exporting its own submodule is not a cycle: importing the submodule runs it first.
    for name in graph:
        graph[name] = {dep for dep in graph[name] if not dep.startswith(name + ".")}

    def reaches(start: str, target: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == target:
                    return [*path, dep]
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
        return None

    cycles = [cycle for name in graph if (cycle := reaches(name, name))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def room_of(name: str, role_packages: set[str]) -> tuple[int, str] | None:
    """The room of a project module and its height: a module may import only from its room and the rooms below."""
    if name.startswith(("common", "recipes")):
        return 0, "common"
    if name.startswith("services.transport"):
        return 1, "transport"
    if name in ("services", "services.roles", "services.service"):
        return 2, "the service contract"
    if name.startswith("services.runtime"):
        return 3, "runtime"
    if any(name == package or name.startswith(package + ".") for package in role_packages):
        return 4, "a role"
    if name.startswith("services.ops"):
        return 5, "ops"
    if name.startswith("services.launch"):
        return 6, "launch"
    if name == "services.cli" or name.startswith("services.cli."):
        return 7, "cli"
    return None


def test_the_rooms_import_downward_only():
    """common/ (and recipes/) < transport/ < the service contract (roles.py, service.py) < runtime/ < a role's folder
    < ops/ < launch/ < cli/: no module imports one of a room above its own, so nothing but the CLI imports launch/
    (what a host does), and the supervision contract (exit codes, restarts) is the runtime's, which the learner's ranks
    use too."""
    modules = project_modules()
    role_packages = {role.service.partition(":")[0] for role in ROLES.values()}
    upward = []
    for name, path in modules.items():
        here = room_of(name, role_packages)
        assert here is not None, f"{name} is in no room"
        for dep in imports_of(path, modules):
            there = room_of(dep, role_packages)
            if there[0] > here[0]:
                upward.append(f"{name} ({here[1]}) imports {dep} ({there[1]})")
    assert not upward, upward


def test_transport_knows_nothing_of_the_project_and_common_imports_no_service_and_no_recipe():
    """transport/ is a bus (an interface, memory, Kafka, a namespace; brokers/ to run): it imports nothing of the
    project but itself. common/ imports neither services nor recipes (builtin models are registered by the recipes'
    entry point); recipes/ imports no service; a role's folder imports no transport and no runner but the
    supervision contract: only the runtime touches the bus."""
    modules = project_modules()
    role_packages = {role.service.partition(":")[0] for role in ROLES.values()}
    runners = ("services.transport", "services.runtime", "services.launch")
    contract = {"services.runtime.exit_codes", "services.runtime.restarts"}
    for name, path in modules.items():
        imported = imports_of(path, modules)
        if name.startswith("services.transport"):
            bad = {dep for dep in imported if not dep.startswith("services.transport")} - {"services"}
            assert not bad, f"{name} imports {bad}"
        if name.startswith("common"):
            bad = {dep for dep in imported if dep.startswith(("services", "recipes"))}
            assert not bad, f"{name} imports {bad}"
        if name.startswith("recipes"):
            bad = {dep for dep in imported if dep.startswith("services")}
            assert not bad, f"{name} imports {bad}"
        if any(name.startswith(package) for package in role_packages):
            bad = {dep for dep in imported if dep.startswith(runners)} - contract | ({"kafka"} & imported)
            assert not bad, f"{name} imports {bad}"


def test_the_architecture_page_names_every_role_and_topic_the_registry_has():
    """docs/ARCHITECTURE.md's facts from services/roles.py: its first paragraph counts the roles every run has and
    names the others, and its topic table has a row for each topic pipeline_topics() makes."""
    import re

    page = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    first = page.split("\n\n")[1]
    always = [name for name, role in ROLES.items() if role.requirement == "" and name != "feeder"]
    counted = {"four": 4, "five": 5, "six": 6, "seven": 7}
    said = re.search(r"(\w+) in\s+every run, and the feeder", first)
    assert said and counted[said.group(1)] == len(always), (said and said.group(1), always)
    for name, role in ROLES.items():
        if role.requirement:
            assert {"environment": "environments"}.get(name, name) in first, f"{name} is not named"
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.MULTILINE))
    topics = {spec.name for spec in pipeline_topics() if not spec.name.endswith(".dlq")}
    assert topics <= rows | {"<topic>.dlq"}, topics - rows
    assert "<topic>.dlq" in rows


def test_common_holds_what_two_roles_or_more_share():
    """A module of common/ that only one role's folder imports belongs in that folder."""
    from services.roles import ROLES

    modules = project_modules()
    role_packages = {role.service.partition(":")[0] for role in ROLES.values()}
    users: dict[str, set[str]] = {name: set() for name in modules if name.startswith("common.")}
    for name, path in modules.items():
        owner = next((p for p in role_packages if name.startswith(p)), name)
        for dep in imports_of(path, modules):
            if dep in users and owner != dep:
                users[dep].add(owner)
    only_one_role = {dep: who for dep, who in users.items() if len(who) == 1 and who <= role_packages}
    assert not only_one_role, only_one_role


def test_simulated_compute_cannot_be_selected_by_a_product_config(make_config):
    """The simulated services (benchmarks/cluster) are reachable from the benchmark alone: no product module imports
    benchmarks, every role names a class of services/, and no config key or value selects a stand-in."""
    from common.config import ConfigError

    for name, path in project_modules().items():
        tree = ast.parse(path.read_text())
        imported = {
            alias.name if isinstance(node, ast.Import) else node.module or ""
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not {m for m in imported if m.split(".")[0] == "benchmarks"}, f"{name} imports benchmarks"
    for role in ROLES.values():
        cls = role.service_class()
        assert role.service.startswith("services.") and cls.__module__.startswith("services."), role.service
        assert "Simulated" not in cls.__name__
    for override in ("generation.backend=simulated", "simulate.profile=0.5b-balanced", "pipeline.simulate=true"):
        with pytest.raises(ConfigError):
            make_config(override)


def test_runners_name_no_role_and_no_topic():
    """Roles and topics are named once (services/roles.py, common/schema/): the runtime, the launchers (a fleet's
    included), the CLI and the service contract only read the registry."""
    names = set(ROLES) | {alias for role in ROLES.values() for alias in role.aliases} | set(TOPIC_MESSAGE)
    paths = [*(REPO / "services" / "runtime").glob("*.py"), *(REPO / "services" / "launch").glob("*.py")]
    paths += [*(REPO / "services" / "cli").glob("*.py"), REPO / "services" / "service.py"]
    assert len(paths) > 12
    for path in paths:
        module = path.relative_to(REPO / "services").with_suffix("")
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body
            if isinstance(node.body[0], ast.Expr)
        }
        literals = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        }
        assert not literals & names, f"services/{module}.py names {literals & names}"


def test_only_the_runtime_builds_a_runner_and_only_a_replica_stops_one():
    """A replica's life is written once (services/runtime/replica.py): no other module (tests and benchmarks
    included) builds a ServiceRunner or calls what a replica's start and stop do, in some order of its own, and the
    runner has no stop of its own."""
    from services.runtime import ServiceRunner

    assert not hasattr(ServiceRunner, "close"), "a second way to stop: Replica.stop() is the one"
    tests = {f"tests.{path.stem}": path for path in (REPO / "tests").rglob("*.py")}
    for name, path in {**project_modules((*PACKAGES, "benchmarks")), **tests}.items():
        if name in ("services.runtime.replica", "tests.test_structure"):
            continue
        text = path.read_text()
        if not name.startswith("services.runtime"):
            assert "ServiceRunner(" not in text, f"{name} builds a runner: a Replica does"
        for call in (".settle()", ".disconnect()", ".leave_for_new_log("):
            assert call not in text, f"{name} calls {call}: a replica's stop does, in its one order"


def test_one_function_builds_a_rollouts_record():
    """The generator's groups and the gateway's episodes become records by one builder (common/rollouts.py): the
    oldest-token rule and the record's fields are written once."""
    builders = [
        name for name, path in project_modules().items()
        if "RolloutBatch(" in path.read_text() and not name.startswith("common.schema") and name != "common.rollouts"
    ]  # fmt: skip
    assert not builders, builders


def test_services_shows_its_rooms():
    """`ls services`: the role folders, the contract (service.py, roles.py), the CLI, and four rooms: the runtime every
    role shares, how replicas are launched, the operator's read-only commands, the transports."""
    entries = {p.name for p in (REPO / "services").iterdir() if p.name != "__pycache__"}
    roles = {role.service.partition(":")[0].split(".")[1] for role in ROLES.values()}
    rooms = {"__init__.py", "cli", "roles.py", "service.py", "runtime", "launch", "ops", "transport"}
    assert entries == rooms | roles, entries ^ (rooms | roles)


def test_the_registry_is_consistent_with_the_wire_contract():
    for name, role in ROLES.items():
        cls = role.service_class()
        assert issubclass(cls, Service) and cls.role == name
        for topic in (role.input_topic, role.output_topic):
            assert topic is None or topic in TOPIC_MESSAGE, (name, topic)
    specs = {spec.name: spec for spec in pipeline_topics(3)}
    assert set(specs) == set(TOPIC_MESSAGE) | {f"{t}.dlq" for t in TOPIC_MESSAGE} | {STATUS_TOPIC, LOG_TOPIC}
    assert {spec.name for spec in specs.values() if spec.compacted} == COMPACTED_TOPICS  # what the runner reads so
    for compacted in (WEIGHTS_TOPIC, STATUS_TOPIC, LOG_TOPIC):
        assert specs[compacted].compacted and specs[compacted].partitions == 1
    # Every run's roles form a chain; an optional role (environments) answers a channel of one of them instead.
    chain = [role for role in ROLES.values() if not role.requirement]
    assert [role.output_topic for role in chain][:-1] == [role.input_topic for role in chain][1:], "a chain"
    assert ROLES["environment"].requirement and (
        ROLES["environment"].input_topic,
        ROLES["environment"].output_topic,
    ) == (
        "turns",
        "observations",
    )


@pytest.fixture
def extra_role(monkeypatch):
    """A role added the way the registry says: one entry."""
    role = Role(
        "auditor", "test_structure:Auditor", "audits experience", input_topic="experience", output_topic="experience"
    )
    monkeypatch.setitem(ROLES, role.name, role)
    return role


class Auditor(Service):
    """Reads every experience batch (its own consumer group) and records the lifecycle calls it receives."""

    role = "auditor"
    calls: list[str] = []

    def __init__(self, config, replica_id=None):
        super().__init__(config, replica_id)
        Auditor.calls = ["init"]
        self.seen: list[str] = []

    def start(self):
        Auditor.calls.append("start")
        return []

    def process(self, message):
        Auditor.calls.append("process")
        self.seen.append(message.batch_id)
        return []

    def done(self):
        return len(self.seen) >= self.config.run.steps

    def finish(self):
        Auditor.calls.append("finish")
        (Path(self.config.run.dir) / "audit.json").write_text(json.dumps(self.seen))

    def close(self):
        Auditor.calls.append("close")


def test_an_added_role_is_a_cli_command_and_a_cluster_role(extra_role):
    from services.cli import build_parser
    from services.launch.cluster import parse_replicas

    args = build_parser().parse_args(["auditor", "--config", "run.yaml", "--replica-id", "a-1"])
    assert args.role == "auditor" and args.replica_id == "a-1"
    assert parse_replicas(["auditor=3"])["auditor"] == 3
    assert build_parser().parse_args(["feed", "--config", "x.yaml"]).role == "feeder", "aliases still work"
    with pytest.raises(ValueError, match="at most 1"):
        parse_replicas(["learner=2"])


def test_up_shares_the_machine_s_cores_among_its_children_unless_the_user_chose(monkeypatch):
    import os

    from services.launch.cluster import child_environment

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert child_environment(6, {})["OMP_NUM_THREADS"] == "2"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert child_environment(6, {"PATH": "/bin"}) == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert child_environment(6, {"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_an_added_role_runs_in_the_embedded_run_through_the_whole_lifecycle(extra_role, make_config):
    from services.launch.embedded import run_embedded

    config = make_config("run.steps=2", "data.eval_prompts=0")
    run_embedded(config, progress=False)
    audited = json.loads((config.run.dir / "audit.json").read_text())
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    trained = [batch_id for line in lines for batch_id in line["batch_ids"]]
    assert sorted(audited) == sorted(trained) and len(trained) == 2
    assert Auditor.calls == ["init", "start", "process", "process", "finish", "close"]


def test_a_service_that_skips_the_base_constructor_is_refused(make_config):
    from services.runtime import Replica
    from services.transport import MemoryBus

    class Forgetful(Service):
        role = "scorer"

        def __init__(self, config, replica_id=None):
            self.config = config  # no super().__init__: no run id, which would silently skip every message

        def process(self, message):
            return []

    with pytest.raises(TypeError, match="not initialised by Service.__init__"):
        Replica(Forgetful(make_config()), MemoryBus).start()


def test_the_base_constructor_sets_the_identity(make_config):
    class Minimal(Service):
        role = "scorer"

        def process(self, message):
            return []

    config = make_config()
    service = Minimal(config, "scorer-7")
    assert (service.run_id, service.replica_id) == (config.run.run_id, "scorer-7")
    assert (service.input_topic, service.output_topic) == (ROLES["scorer"].input_topic, ROLES["scorer"].output_topic)
    assert Minimal(config).replica_id == "scorer-0"


# Modules that only vLLM's own processes import (its plugin registers them by path), where vLLM has set up its
# environment already: importing vllm sets environment variables, which is vLLM's business there.
LOADED_BY_VLLM = {"services.generator.vllm_transfer"}


def test_importing_the_project_changes_no_global_state():
    # A package's __main__ is the command itself (python -m services.cli), run, not imported.
    modules = sorted(name for name in set(project_modules()) - LOADED_BY_VLLM if not name.endswith(".__main__"))
    code = f"""
import logging, os
import torch, transformers, peft  # peft's import sets TORCHINDUCTOR_CACHE_DIR (torch's inductor): not the project's
before_env, before_level = dict(os.environ), transformers.logging.get_verbosity()
before_bars = transformers.utils.logging.is_progress_bar_enabled()
import importlib
for name in {modules!r}:
    importlib.import_module(name)
assert dict(os.environ) == before_env, set(os.environ.items()) ^ set(before_env.items())
assert transformers.logging.get_verbosity() == before_level
assert transformers.utils.logging.is_progress_bar_enabled() == before_bars
assert not logging.getLogger().handlers, "logging configured at import"
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# The math is one module of pure functions, kept whole as verl keeps core_algos.py; nothing else grows past this.
LONGEST_MODULE_LINES = 500
KEPT_WHOLE = {"common/ppo.py"}


def test_no_module_of_the_project_is_over_500_lines_but_the_math():
    """A module that grows past 500 lines does several jobs: it splits along its seams (the runner's parts, the
    config's sections, the schema's messages)."""
    long = {
        str(path.relative_to(REPO)): n
        for package in ("common", "services", "recipes")
        for path in (REPO / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > LONGEST_MODULE_LINES
    }
    assert set(long) <= KEPT_WHOLE, {k: v for k, v in long.items() if k not in KEPT_WHOLE}


# Test folders that are not a package's: runs of processes, deployment files, long runs, the benchmarks' and the
# recipes' scripts.
TEST_ROOMS = {"e2e", "deploy", "soak", "benchmarks", "recipes", "agents"}


def test_the_tests_mirror_the_packages_and_the_tiers_select_by_marker_alone():
    """tests/common/ and tests/services/<room>/ mirror the packages they test; every other folder is one of
    TEST_ROOMS. A tier is a marker expression (the Makefile's targets name no path), so a test moved between
    folders stays in its tier."""
    for path in (REPO / "tests").rglob("test_*.py"):
        folder = path.parent.relative_to(REPO / "tests")
        if folder.parts and folder.parts[0] in ("common", "services"):
            assert (REPO / folder).is_dir(), f"{path.relative_to(REPO)} mirrors no package: {folder} is not one"
        else:
            assert not folder.parts or folder.parts[0] in TEST_ROOMS, f"{path.relative_to(REPO)}: not a test room"
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), "test modules share a name: pytest imports them by name"
    makefile = (REPO / "Makefile").read_text()
    for line in makefile.splitlines():
        if "$(PYTEST)" in line:
            assert "tests/" not in line, f"a tier names a path: {line.strip()}"
