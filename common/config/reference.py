"""The configuration reference, in Markdown, generated from the sections' declarations
(``docs/config-reference.md``)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel

from common.config.base import section_model
from common.config.run import RunConfig


def reference() -> str:
    """Every setting of a run config as Markdown, section by section: its type, default, bounds and meaning, read
    from the sections' declarations (``docs/config-reference.md``, which ``streamppo config-reference --write``
    makes and a test holds equal to them)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `common/config/` by `streamppo config-reference --write`; `tests/common/test_config.py`",
        "holds it equal to the code. A run config is YAML, one mapping per section; every setting can be given on the",
        "command line as `--set section.key=value`. A mistyped key is refused with the nearest one it could be.",
    ]
    sections: list[tuple[str, type[BaseModel], str]] = [("", RunConfig, "")]
    while sections:
        prefix, model, about = sections.pop(0)
        rows, nested = [], []
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            inner = section_model(field.annotation)
            if inner is not None:
                nested.append((f"{path}.", inner, field.description or (inner.__doc__ or "").split("\n\n")[0]))
                continue
            cells = (f"`{path}`", _type_name(field), _default(field), _bounds(field), field.description or "")
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        if rows:
            title = prefix.rstrip(".") or "(top level)"
            lines += ["", f"## `{title}`", ""] + ([" ".join(about.split()), ""] if about else [])
            lines += ["| setting | type | default | bounds | meaning |", "|---|---|---|---|---|", *rows]
        sections = nested + sections
    return "\n".join(lines) + "\n"


def _type_name(field) -> str:
    def name(annotation) -> str:
        if get_origin(annotation) is Literal:
            return " / ".join(f"`{value}`" for value in get_args(annotation))
        if get_origin(annotation) in (Union, types.UnionType):
            return " or ".join(name(a) for a in get_args(annotation) if a is not type(None)) + " or null"
        if get_origin(annotation) in (list, dict):
            return f"{get_origin(annotation).__name__} of {', '.join(name(a) for a in get_args(annotation))}"
        return {Path: "path", Any: "any"}.get(annotation, getattr(annotation, "__name__", str(annotation)))

    declared = [m for m in field.metadata if isinstance(m, AfterValidator)]
    if declared:  # a declared variant (common.algorithms): its names
        kind = declared[0].func.__self__
        return " / ".join(f"`{variant}`" for variant in kind.variants)
    return name(field.annotation)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, Path) and value.is_relative_to(Path.home()):
        value = Path("~") / value.relative_to(Path.home())  # the reader's home, not this machine's
    return "null" if value is None else f"`{value}`"


def _bounds(field) -> str:
    said = []
    for item in field.metadata:
        for attribute, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "length ≥")):
            value = getattr(item, attribute, None)
            if value is not None:
                said.append(f"{sign} {value}")
        if getattr(item, "pattern", None):
            said.append(f"matches `{item.pattern}`")
    return ", ".join(said)
