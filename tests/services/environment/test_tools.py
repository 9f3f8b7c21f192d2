"""The built-in tools: the calculator (no eval), and Python in the sandbox, which the tests try to escape."""

import ast
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO

from common.config import EnvironmentSection, SandboxSection
from services.environment.sandbox import Sandbox, bwrap_available
from services.environment.tools import CalculatorError, ToolEnvironment, calculate


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12,345 * 678", "8369910"),
        ("(3 + 4) * 5", "35"),
        ("7 / 2", "3.5"),
        ("10 / 2", "5"),
        ("2^10", "1024"),
        ("-3 ** 2", "-9"),
        ("17 // 5 + 17 % 5", "5"),
        ("123456789 × 987654321 =", "121932631112635269"),
    ],
)
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('touch /tmp/x')", "not Call"),
        ("a + b", "not Name"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "more than 60 digits"),
        ("10 ** 59 * 100", "more than 60 digits"),
        ("", "empty expression"),
        ("1 +", "cannot parse"),
        ("1" * 300, "longer than 200"),
        ("[1, 2]", "not List"),
    ],
)
def test_the_calculator_refuses_anything_else_and_says_why(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)


ISOLATIONS = [
    pytest.param(
        "bwrap", marks=pytest.mark.skipif(bwrap_available() is not None, reason=f"no bwrap: {bwrap_available()}")
    ),
    "rlimits",
]


@pytest.fixture(params=ISOLATIONS)
def sandbox(request):
    return Sandbox(SandboxSection(isolation=request.param, cpu_seconds=1, wall_seconds=3, output_bytes=4096))


def test_auto_never_falls_to_the_escapable_sandbox_on_its_own(monkeypatch):
    """Without a bwrap that works, ``auto`` refuses to start with one line (it once fell to rlimits with a log line,
    which an outside audit escaped); ``rlimits`` chosen on purpose still runs."""
    from services.environment import sandbox as module

    monkeypatch.setattr(module, "bwrap_available", lambda: "bwrap cannot make its namespaces here: (simulated)")
    with pytest.raises(RuntimeError, match="is auto, but bwrap cannot make its namespaces.*rlimits on purpose"):
        Sandbox(SandboxSection(isolation="auto"))
    assert Sandbox(SandboxSection(isolation="rlimits")).isolation == "rlimits"


def test_the_fallback_refuses_the_module_that_starts_processes_unaudited():
    """The audit's escape under rlimits: ``_posixsubprocess.fork_exec`` started an interpreter without the hook."""
    sandbox = Sandbox(SandboxSection(isolation="rlimits", cpu_seconds=1, wall_seconds=3))
    result = sandbox.run_python("import _posixsubprocess\nprint('imported')")
    assert result.status == "error" and "importing _posixsubprocess is not allowed" in result.output
    assert "imported" not in result.output


def test_code_runs_and_writes_its_scratch_folder(sandbox):
    result = sandbox.run_python("open('notes.txt', 'w').write('kept'); print(open('notes.txt').read(), 6 * 7)")
    assert (result.status, result.output.strip()) == ("ok", "kept 42")


def test_no_network(sandbox):
    result = sandbox.run_python(
        "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('CONNECTED')"
    )
    assert result.status == "error" and "CONNECTED" not in result.output
    assert "Network is unreachable" in result.output or "socket" in result.output


def test_no_writing_outside_the_scratch_folder(sandbox):
    # Not under /tmp, which bwrap replaces with an empty one: a folder the sandbox sees, writable by anyone, so that
    # only the sandbox stands in the way.
    with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
        target = Path(folder)
        target.chmod(0o777)
        result = sandbox.run_python(f"open({str(target / 'escaped')!r}, 'w').write('x')")
        assert result.status == "error" and not (target / "escaped").exists()
    # bwrap: the folder is not there at all (nothing of the host is but the system's files); rlimits: refused.
    assert "No such file or directory" in result.output or "outside the scratch folder" in result.output


def test_a_fork_bomb_is_contained_and_leaves_nothing_running(sandbox):
    result = sandbox.run_python("import os\nwhile True:\n    os.fork()")
    assert result.status != "ok"

    def left() -> list[str]:
        found = subprocess.run(["pgrep", "-f", "streamppo-sandbox-"], capture_output=True, text=True).stdout.split()
        return [pid for pid in found if int(pid) != os.getpid()]

    # The kernel tears the sandbox's PID namespace down after its first process ends: give it a moment.
    for _ in range(50):
        if not left():
            break
        time.sleep(0.1)
    assert not left(), "processes of the sandbox still run"


def test_an_infinite_loop_stops_at_the_cpu_limit(sandbox):
    result = sandbox.run_python("while True:\n    pass")
    assert result.status == "cpu_limit" and "CPU time limit" in result.observation()


def test_code_that_never_ends_stops_at_the_wall_clock_limit(sandbox):
    result = sandbox.run_python("import time\ntime.sleep(60)")
    assert result.status == "timeout" and result.seconds < 30


def test_huge_output_is_cut_at_the_limit(sandbox):
    result = sandbox.run_python("while True:\n    print('x' * 1000)")
    assert result.status == "output_limit" and len(result.output) <= 4096
    assert result.observation().endswith("[output cut: output limit]")


def test_a_crash_is_reported_with_its_exit_code(sandbox):
    result = sandbox.run_python("import sys\nprint('partial')\nsys.exit(3)")
    assert (result.status, result.exit_code) == ("error", 3)
    assert result.observation() == "partial\n[exit code 3]"


def test_the_tool_environment_runs_calls_and_ends_on_an_answer():
    env = ToolEnvironment(
        EnvironmentSection(tools=["calculator", "python"], sandbox=SandboxSection(isolation="rlimits"))
    )
    env.reset("What is 1234 * 5678?", "7006652")
    assert env.stop == ("</calculator>", "</python>")
    step = env.step("Let me compute. <calculator>1234 * 5678</calculator>")
    assert (step.observation, step.done, step.info) == (
        "\n<result>\n7006652\n</result>\n",
        False,
        {"tool": "calculator", "status": "ok"},
    )
    step = env.step("<calculator>1234 * x</calculator>")
    assert "error: only numbers" in step.observation and step.info["status"] == "error" and not step.done
    step = env.step("oops </calculator>")
    assert "without <calculator>" in step.observation and step.info["status"] == "malformed"
    step = env.step("<python>print(sum(range(10)))</python>")
    assert step.observation == "\n<result>\n45\n</result>\n" and not step.done
    step = env.step("The answer is 7006652.")
    assert step.done and step.observation == "" and step.info == {"calls": 4}


def test_an_unknown_tool_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown \\['shell'\\]; built-in tools are \\['calculator', 'python'\\]"):
        ToolEnvironment(EnvironmentSection(tools=["shell"]))


def test_a_call_the_prompt_opens_is_closed_by_the_models_first_turn():
    env = ToolEnvironment(EnvironmentSection(tools=["calculator"]))
    env.reset("Calculate 6 * 7.<|im_end|>\n<|im_start|>assistant\n<calculator>", "42")
    assert env.step("6 * 7</calculator>").observation == "\n<result>\n42\n</result>\n"
    # A later call starts after the result: nothing before it is read as its expression.
    step = env.step("so the answer is 42. Check: 40 + 2</calculator>")
    assert step.info["status"] == "malformed"


ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="a user per run needs root (the service as root in its image)")


def _zombies_of_run_users() -> list[str]:
    """Zombies of the sandbox's run users below this process: the tests on the other xdist worker run sandboxes too,
    whose processes are zombies for an instant between their exit and their reaping."""
    from services.environment.sandbox import _RunUsers

    first = _RunUsers.BASE - 1
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,uid=,stat=,comm="], capture_output=True, text=True).stdout
    parent = {}
    processes = []
    for line in rows.splitlines():
        pid, ppid, uid, stat, *comm = line.split()
        parent[int(pid)] = int(ppid)
        processes.append((int(pid), int(uid), stat, " ".join(comm)))

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False

    return [f"{pid} {stat} {comm}" for pid, uid, stat, comm in processes if uid >= first and "Z" in stat and ours(pid)]


@pytest.mark.slow
@pytest.mark.soak
@ROOT
def test_a_thousand_runs_in_one_process_all_run_and_leave_nothing(sandbox):
    """Each run as a user of its own, every process it left killed and reaped: bwrap's own child, which outlived each
    run as a zombie, counted against the one user of every run until none could start (from the 14th run on). The
    fallback, where bwrap's child never was, 200 runs."""
    for i in range(1000 if sandbox.isolation == "bwrap" else 200):
        result = sandbox.run_python("print('hi')")
        assert (result.status, result.output) == ("ok", "hi\n"), (i, result)
    assert not _zombies_of_run_users()


@pytest.mark.slow
@ROOT
def test_a_fork_bomb_starves_no_other_run(sandbox):
    """A fork bomb uses up its own run's processes, not those of the runs beside it or after it."""
    import threading

    beside = []
    bomb = threading.Thread(target=lambda: sandbox.run_python("import os\nwhile True:\n    os.fork()"))
    bomb.start()
    time.sleep(0.5)  # the bomb at its limit: a run that shared its user could not start a process now
    for _ in range(3):
        beside.append(sandbox.run_python("print(1)"))
    bomb.join()
    after = sandbox.run_python("print(1)")
    assert [(r.status, r.output) for r in [*beside, after]] == [("ok", "1\n")] * 4
    assert not _zombies_of_run_users()


@pytest.mark.slow
@ROOT
@pytest.mark.skipif(bwrap_available() is not None, reason=f"no bwrap: {bwrap_available()}")
def test_runs_in_a_container_without_an_init_leave_no_zombie():
    """The service as PID 1 of its namespace, as in a container without an init: nothing reaps orphans but it."""
    code = (
        "from common.config import SandboxSection\n"
        "from services.environment.sandbox import Sandbox\n"
        "import os, subprocess\n"
        "assert os.getpid() == 1\n"
        "sandbox = Sandbox(SandboxSection(isolation='bwrap'))\n"
        "bad = [i for i in range(200) if sandbox.run_python('print(1)').status != 'ok']\n"
        "ps = subprocess.run(['ps', '-eo', 'stat='], capture_output=True, text=True).stdout.split()\n"
        "print(len(bad), sum('Z' in s for s in ps))\n"
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "0"], "every run ran, and no zombie is left"


@pytest.mark.skipif(bwrap_available() is not None, reason=f"no bwrap: {bwrap_available()}")
def test_the_code_sees_the_system_s_files_and_its_scratch_folder_only():
    """Not the service's files, the run directories, homes, /etc: a key at mode 0644 beside the project is unseen."""
    sandbox = Sandbox(SandboxSection(isolation="bwrap"))
    readme = REPO / "README.md"
    result = sandbox.run_python(f"print(open({str(readme)!r}).read())")
    assert result.status == "error" and "No such file or directory" in result.output
    listing = sandbox.run_python("import os; print(sorted(os.listdir('/')))")
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    assert set(ast.literal_eval(listing.output)) <= system
    etc = sandbox.run_python("import os; print(os.listdir('/etc'))")
    assert etc.output.strip() in ("['ld.so.cache']", "[]")


@pytest.mark.skipif(bwrap_available() is not None, reason=f"no bwrap: {bwrap_available()}")
def test_processes_that_probe_bwrap_at_once_all_find_it():
    """Each probe runs as a user of its own process: with one user between them, two processes probing at once (two
    environment replicas on one host, two test workers) killed each other's probe, and one found bwrap not working,
    which now stops its service."""
    code = (
        "from services.environment.sandbox import bwrap_available\n"
        "import sys\n"
        "results = [bwrap_available.__wrapped__() for _ in range(5)]\n"
        "sys.exit(0 if all(r is None for r in results) else print(results) or 1)\n"
    )
    probes = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO) for _ in range(4)]
    assert [p.wait(timeout=300) for p in probes] == [0, 0, 0, 0]
