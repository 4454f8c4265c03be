"""A nested config dict validated against a schema class, and pydantic's first complaint as one
`ConfigError` line: the dotted key, what is wrong, and the fix. The root class comes in as an
argument, so `schema` (whose `Config.derive` validates) uses this without importing `reading`."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, TypeVar, Union

import pydantic
from pydantic import BaseModel

from trainer.errors import ConfigError

Root = TypeVar("Root", bound=BaseModel)


def validated(root: type[Root], tree: dict[str, Any]) -> Root:
    """`tree` as a `root` instance, or a one-line `ConfigError` for its first problem."""
    try:
        return root.model_validate(tree)
    except pydantic.ValidationError as err:
        raise ConfigError(describe(err, root)) from None


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Write `value` at the dotted `key` (`optim.lr`), making the sections on the way."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def keyed_fields(section: type[BaseModel]) -> dict[str, Any]:
    """A schema class's fields by the key a config spells (`async`, not `async_`)."""
    return {field.alias or name: field for name, field in section.model_fields.items()}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The schema class an annotation holds: `MixtureSource` in `list[MixtureSource] | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (list, Union):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def section_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """Schema class under `root` that owns the key at `loc` (None for free-form dict fields); list
    indices (a `data.mixture` entry) stay in the list's item class."""
    section: type[BaseModel] | None = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = section.model_fields.get(str(part))
        section = _model_in(getattr(field, "annotation", None))
        if section is None:
            return None
    return section


def _dotted(loc: tuple) -> str:
    """`("data", "mixture", 0, "path")` as `data.mixture[0].path`."""
    key = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for an error in a mapping's key, not its value
            continue
        name = part if part != "" else "''"  # an empty mapping key, e.g. `model.args: {"": 1}`
        key += f"[{part}]" if isinstance(part, int) else f"{'.' if key else ''}{name}"
    return key


def describe(err: pydantic.ValidationError, root: type[BaseModel]) -> str:
    """One line for the first problem of validating `root`: the dotted key, what is wrong, and
    the fix."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = _dotted(loc)
    if first["type"] == "extra_forbidden":
        section = section_at(root, loc)
        valid = list(keyed_fields(section)) if section else []
        prefix = key[: -len(str(loc[-1]))]
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        if close:
            hint = f"did you mean {prefix}{close[0]}?"
        else:
            hint = "valid keys: " + ", ".join(prefix + name for name in valid)
        return f"unknown key {key}; {hint}"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error":  # our own validators already name their keys
        return message
    if first["type"] == "missing":
        return f"{key} is required; add it to the config"
    got = first.get("input")
    if first["type"] == "model_type":  # pydantic names our class; the user wrote a section
        got = as_typed(got)
        return f"{key}={got} is not a mapping of keys; write {key} as {{key: value, ...}}"
    shown = "" if isinstance(got, dict) else f" (got {as_typed(got)})"
    fix = next((fix for kind, fix in _TYPE_FIXES.items() if first["type"].startswith(kind)), None)
    return f"{key}: {message}{shown}" + (f"; {fix}" if fix else "")


def as_typed(value: Any) -> str:
    """`value` as a config spells it: true, not Python's True (`yes` and `on` read as true)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


# The fix for a value of the wrong type, by pydantic error type prefix; the first match wins.
_TYPE_FIXES = {
    "bool_": "use true or false",
    "int_": "use a whole number",
    "float_": "use a number, e.g. 0.5 or 3e-4",
    "finite_number": "use a finite number (.inf and .nan are not)",
    "string_too_short": "give it a value, or leave the key out for its default",
    "string_": "use text (quote it in YAML)",
    "list_": "use a list, e.g. [a, b]",
    "dict_": "use a mapping, e.g. {key: value}",
    "tuple_": "use a list, e.g. [a, b]",
}
