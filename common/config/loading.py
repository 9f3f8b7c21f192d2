"""A run config from its YAML file and ``--set`` overrides: unknown keys refused with the nearest one they could be,
paths made relative to the config's folder, every error named."""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from pydantic import ValidationError

from common.config.base import ConfigError, section_model
from common.config.run import RunConfig


def _apply_override(tree: dict, assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} is not of the form section.key=value")
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {part} is not a section")
    node[leaf] = yaml.safe_load(raw)


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "no such setting" + _nearest_setting(item["loc"])
        lines.append(f"  {where}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


def _nearest_setting(location: tuple) -> str:
    """``; did you mean `section.key`?`` for a mistyped key, from the settings its section has ('' if none is
    near)."""
    model = RunConfig
    for part in location[:-1]:
        field = model.model_fields.get(str(part))
        model = section_model(field.annotation) if field is not None else None
        if model is None:
            return ""
    known = list(model.model_fields)
    near = difflib.get_close_matches(str(location[-1]), known, n=1, cutoff=0.6)
    prefix = ".".join(str(p) for p in location[:-1])
    return (
        f"; did you mean `{prefix + '.' if prefix else ''}{near[0]}`?"
        if near
        else f" (the settings here: {', '.join(known)})"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config, apply ``section.key=value`` overrides, validate.

    Relative paths in the file (prompts, models, run dir) are taken relative to the file's folder when they
    exist there, else relative to the working directory.
    """
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        tree = loaded
        _resolve_relative(tree, path.parent)
    for assignment in overrides or []:
        _apply_override(tree, assignment)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


# Settings that name a file or folder, and settings that name a function by its file (``path/to/file.py:name``).
_PATHS = (
    ("data", "prompts"),
    ("model", "actor"),
    ("model", "reference"),
    ("model", "critic"),
    ("reward", "model"),
    ("eval", "prompts"),
)
_NAMED_BY_FILE = (("reward", "function"), ("gateway", "agent", "function"), ("environment", "name"))


def _resolve_relative(tree: dict, base: Path) -> None:
    """One rule for every relative path a config file names, a function's file included: from the config's folder,
    where that is there (else as given, from the working directory)."""

    def at(keys: tuple[str, ...]) -> tuple[dict | None, object]:
        node = tree
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        return (node, node.get(keys[-1])) if isinstance(node, dict) else (None, None)

    for keys in _PATHS:
        node, value = at(keys)
        if isinstance(value, str) and not value.startswith("builtin:") and not Path(value).is_absolute():
            candidate = base / value
            if candidate.exists():
                node[keys[-1]] = str(candidate)
    for keys in _NAMED_BY_FILE:
        node, value = at(keys)
        where, sep, name = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        by_file = sep and (where.endswith(".py") or "/" in where)
        if by_file and not Path(where).expanduser().is_absolute() and (base / where).is_file():
            node[keys[-1]] = f"{base / where}:{name}"
