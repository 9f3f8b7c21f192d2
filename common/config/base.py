"""What every section of a run config is built on: the error that names every bad field, a section's model
configuration (unknown keys refused, frozen once made), and secrets read by reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """The configuration is invalid; the message names every bad field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def read_secret(env: str | None, file: Path | None, what: str) -> str:
    """A secret given by reference: the environment variable ``env``, else the file ``file``; ConfigError naming the
    one that is missing (``what``: whose secret). Never logged."""
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise ConfigError(f"{what}: environment variable {env} is not set")
        return value
    try:
        return file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {file}: {exc.strerror}") from None


def section_model(annotation) -> type[BaseModel] | None:
    """The section (a model) a field holds, if it holds one (optional ones too); None for a plain setting."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
