"""What a setting names in code: ``module:attribute`` (a module on the path) or ``path/to/file.py:attribute`` (a file
of yours, relative to the working directory or absolute), loaded with an error that says what was tried."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["NamedError", "load_named"]


class NamedError(ValueError):
    """What a setting names cannot be loaded; the text says what was tried."""


def load_named(spec: str, setting: str) -> Any:
    """The object ``spec`` names (see the module's docstring); ``setting`` is the setting's name, for the error."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise NamedError(f"{setting} {spec!r} must be written module:name or path/to/file.py:name")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _from_file(Path(where), spec, setting)
    else:
        module = _from_path(where, spec, setting)
    try:
        return getattr(module, name)
    except AttributeError:
        raise NamedError(f"{setting} {spec!r} cannot be loaded: {where} has no {name!r}") from None


def _from_file(path: Path, spec: str, setting: str):
    path = path.expanduser()
    resolved = path if path.is_absolute() else Path.cwd() / path
    if not resolved.is_file():
        raise NamedError(f"{setting} {spec!r} cannot be loaded: no file {resolved}")
    module_name = f"streamppo_named_{resolved.stem}_{abs(hash(str(resolved))) % 10**8}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise NamedError(f"{setting} {spec!r} cannot be loaded: {resolved} raised {type(exc).__name__}: {exc}") from exc
    return module


def _from_path(module_name: str, spec: str, setting: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name.split(".")[0] and exc.name != module_name:
            raise NamedError(f"{setting} {spec!r} cannot be loaded: importing {module_name} failed: {exc}") from exc
        # The working directory, where a user's own module lies, is not on the path of an installed command.
        if Path(module_name.replace(".", "/") + ".py").is_file() or Path(module_name.split(".")[0]).is_dir():
            sys.path.insert(0, str(Path.cwd()))
            try:
                return importlib.import_module(module_name)
            except Exception as again:
                raise NamedError(f"{setting} {spec!r} cannot be loaded: {module_name} raised {again}") from again
        searched = ", ".join(sys.path[:4])
        raise NamedError(
            f"{setting} {spec!r} cannot be loaded: no module {module_name!r} on the Python path ({searched}, ...) or "
            f"in the working directory {Path.cwd()}; name a file as path/to/file.py:name"
        ) from None
    except Exception as exc:
        raise NamedError(
            f"{setting} {spec!r} cannot be loaded: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from exc
