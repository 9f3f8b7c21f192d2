import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "vowels"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A cache dir shared by the session's tests, so the builtin tiny model is built once."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> Path:
    from common.models import resolve_model

    return resolve_model("builtin:tiny-char-llama", model_cache)


@pytest.fixture
def make_config(tmp_path, model_cache):
    """The example config with a private run dir and the shared model cache, plus overrides."""
    from common.config import load_config

    def make(*overrides: str, **kwargs):
        base = [f"run.dir={tmp_path / 'run'}", f"model.cache_dir={model_cache}"]
        return load_config(EXAMPLE / "config.yaml", base + list(overrides), **kwargs)

    return make
