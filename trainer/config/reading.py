"""Reading a config: defaults <- YAML file <- `section.key=value` overrides, validated as one
tree. A YAML file that repeats a key, or an override that is not `section.key=value`, is a
one-line `ConfigError`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trainer.config.schema import Config
from trainer.config.validation import keyed_fields, section_at, set_dotted, validated
from trainer.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides, validated as one tree."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_yaml(Path(path))
    for override in overrides or []:
        _apply_override(tree, override)
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Validate a nested dict (e.g. a saved `config.yaml`) into a `Config`."""
    from trainer.hf.config import fill_model_section

    return validated(Config, fill_model_section(tree))  # hf:PATH init_from: model.* from it


def saved_config(tree: dict[str, Any], source: Path) -> Config:
    """The config a run saved in `source` (a checkpoint's: export and generate rebuild its model
    from it). One that this version refuses (a key since removed, a value since refused) is one
    line naming that file, where the fix is to be made."""
    try:
        return config_from_dict(tree)
    except ConfigError as err:
        raise ConfigError(
            f"{source} holds a saved config that this version of the trainer refuses ({err}); "
            "edit that key in the file, or use the trainer version that saved it"
        ) from None


class _RepeatedKeyError(Exception):
    """A YAML mapping that gives `key` twice: at line `line`, first at line `first`."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(key, line, first)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML whose mappings refuse a repeated key: PyYAML keeps the last one silently, so a second
    `optim:` section dropped every key of the first. Merge keys (`<<: *base`) may still be
    overridden."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in first_lines:
                raise _RepeatedKeyError(key, line, first_lines[key])
            first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    """The file's mapping of sections, or one line saying what is wrong with the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass --config configs/<name>.yaml")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass --config configs/<name>.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file {path} is not text (not UTF-8); pass --config a YAML file such as "
            "configs/demo.yaml"
        ) from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path} ({err.strerror}); check it") from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _RepeatedKeyError as err:
        raise ConfigError(
            f"config file {path} line {err.line} repeats the key {err.key} (first on line "
            f"{err.first}), and YAML would keep only the last; give each key once (a section "
            "once, holding all its keys)"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML; fix the syntax") from None
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections, e.g. `run: {{...}}`"
        )
    return tree


def _apply_override(tree: dict[str, Any], override: str) -> None:
    """Write one `section.key=value` override into `tree`."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not section.key=value; e.g. optim.lr=1e-3")
    set_dotted(tree, key, _override_value(key, raw))


def _override_value(key: str, raw: str) -> Any:
    """The YAML value of `raw`; for a text field (run.name, data.path) a number, bool or date
    stays the text typed, so `run.name=0123` is the name "0123", not the octal number 83."""
    if not raw.strip():
        return None
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader)
    except _RepeatedKeyError as err:
        raise ConfigError(f"override {key}={raw} repeats the key {err.key}; give it once") from None
    except yaml.YAMLError:
        raise ConfigError(
            f"override {key}={raw} is not a valid YAML value; write lists as [a, b] and "
            "mappings as {k: v}, and quote the whole override for the shell"
        ) from None
    scalar = not isinstance(value, str | list | dict | None)  # a number, bool or date YAML typed
    return raw.strip() if scalar and _is_text_field(key.split(".")) else value


def _is_text_field(parts: list[str]) -> bool:
    """Whether the schema types the dotted key `parts` as text (`str` or `str | None`)."""
    section = section_at(Config, tuple(parts))
    field = keyed_fields(section).get(parts[-1]) if section else None
    return field is not None and field.annotation in (str, str | None)
