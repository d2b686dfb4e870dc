"""Typed configs: dataclass schemas validated through OmegaConf structured configs.

Every verb has a dataclass; `load_config` merges a YAML recipe and dotted command-line
overrides (`train.lr=1e-4`) onto it. Unknown keys and wrong types fail naming the key and
the file; value checks live in each dataclass's `__post_init__` (see `errors.require`).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf, StringNode
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError, PocketdiffError, require

T = TypeVar("T")

DATA_SOURCES = ("shapes", "openmoji", "cifar10", "imagefolder", "hub")


@dataclasses.dataclass
class DataConfig:
    """Where captioned images come from. `source` picks the loader (see pocketdiff.data)."""

    source: str = "shapes"
    path: Optional[str] = None  # folder / zip folder / hub id, depending on source
    image_column: str = "image"
    caption_column: str = "text"
    split: str = "train"
    resolution: int = 32
    max_samples: Optional[int] = None
    seed: int = 0  # shuffling and procedural generation
    shapes_count: int = 2048  # size of the procedural set

    def __post_init__(self) -> None:
        require(self.source in DATA_SOURCES, "data.source", f"must be one of {DATA_SOURCES}, got {self.source!r}")
        require(self.resolution >= 8, "data.resolution", f"must be >= 8, got {self.resolution}")
        require(self.max_samples is None or self.max_samples > 0, "data.max_samples", "must be positive")
        require(self.shapes_count > 0, "data.shapes_count", "must be positive")
        if self.source in ("imagefolder", "hub"):
            require(bool(self.path), "data.path", f"is required for source={self.source!r}")


_DEPRECATIONS_SAID: set[str] = set()


def deprecated(old: str, new: str) -> None:
    """One warning line per process: `old` (a config key or value) is now `new`."""
    line = f"warning: {old} is deprecated, use {new}"
    if line not in _DEPRECATIONS_SAID:
        _DEPRECATIONS_SAID.add(line)
        print(line, file=sys.stderr)


def renamed_value(value: Any, key: str, renames: dict) -> Any:
    """`value` under its current name: an old one (a key of `renames`) is mapped, with one deprecation line."""
    if isinstance(value, str) and value in renames:
        deprecated(f"{key}: {value}", f"{key}: {renames[value]}")
        return renames[value]
    return value


def off_at_null(value: Optional[float], key: str) -> Optional[float]:
    """A cap that is off at null: the old off value 0 is taken as null, with one deprecation line."""
    if value is not None and value == 0:
        deprecated(f"{key}: 0", f"{key}: null (no cap)")
        return None
    return value


def _renamed_keys(schema: Any) -> dict[str, str]:
    return dict(getattr(schema, "RENAMED_KEYS", None) or {})


def _rename_raw(raw: dict, renames: dict[str, str]) -> dict:
    """The YAML mapping with old dotted keys moved to their new names (one deprecation line each)."""
    for old, new in renames.items():
        *path, leaf = old.split(".")
        node = raw
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            deprecated(old, new)
            value = node.pop(leaf)
            target = raw
            *new_path, new_leaf = new.split(".")
            for part in new_path:
                target = target.setdefault(part, {})
            target.setdefault(new_leaf, value)
    return raw


def _rename_override(item: str, renames: dict[str, str]) -> str:
    key, _, value = item.partition("=")
    if key in renames:
        deprecated(key, renames[key])
        return f"{renames[key]}={value}"
    return item


def _format_omegaconf_error(err: OmegaConfBaseException, where: str) -> str:
    key = getattr(err, "full_key", None) or ""
    msg = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "Key '" in msg and "not in" in msg:
        msg = "unknown key"
    return f"{where}: {key + ': ' if key else ''}{msg}"


def _check_sections(cfg, raw: dict, where: str, prefix: str = "") -> None:
    """A plain value where the schema has a section (a dataclass of fields) is named by its key (OmegaConf's
    merge names none: "str is not a subclass of ..."), e.g. another verb's config given to this one."""
    for key, value in raw.items():
        node = cfg._get_node(key) if isinstance(cfg, DictConfig) and isinstance(key, str) and key in cfg else None
        if not isinstance(node, DictConfig) or value is None:
            continue
        section = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(section):
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {prefix}{key}: must be a section of {section.__name__} fields (key: value lines), "
                              f"got {type(value).__name__} {str(value)[:60]!r} (is this another verb's config?)")
        _check_sections(node, value, where, f"{prefix}{key}.")


def _override(cfg, item: str):
    """`key=value` as a config to merge. Values are YAML-typed, except for string fields,
    which keep the text as written ("007" stays "007", not 7; "null" means None only where
    the field is Optional)."""
    key, value = item.split("=", 1)
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    leaf = node._get_node(parts[-1]) if isinstance(node, DictConfig) and parts[-1] in node else None
    if isinstance(leaf, StringNode) and not (leaf._is_optional() and value in ("null", "~")):
        nested: Any = value
        for part in reversed(parts):
            nested = {part: nested}
        return OmegaConf.create(nested)
    return OmegaConf.from_dotlist([item])


def load_config(schema: type[T], path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> T:
    """Build a validated `schema` instance from a YAML file and dotted overrides."""
    cfg = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{path}: invalid YAML: {first}") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
        raw = _rename_raw(raw, _renamed_keys(schema))
        _check_sections(cfg, raw, str(path))
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(raw))
        except OmegaConfBaseException as e:
            raise ConfigError(_format_omegaconf_error(e, str(path))) from None
    return _finish(cfg, overrides, str(path) if path is not None else "config")


def with_overrides(obj: T, overrides: list[str]) -> T:
    """A validated copy of the config dataclass `obj` with dotted `key=value` overrides, typed and
    checked as on the command line (`obj` itself is not changed)."""
    return _finish(OmegaConf.structured(obj), overrides, "config")


def _finish(cfg, overrides: Optional[list[str]], where: str):
    renames = _renamed_keys(OmegaConf.get_type(cfg))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command line: override {item!r} must look like key=value")
        item = _rename_override(item, renames)
        try:
            change = _override(cfg, item)
            _check_sections(cfg, OmegaConf.to_container(change), f"command line override {item!r}")
            cfg = OmegaConf.merge(cfg, change)
        except OmegaConfBaseException as e:
            raise ConfigError(_format_omegaconf_error(e, f"command line override {item!r}")) from None
        except yaml.YAMLError as e:  # the value is parsed as YAML (e.g. an unclosed list "[a, b")
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"command line override {item!r}: invalid YAML value: {first}") from None
    try:
        obj = OmegaConf.to_object(cfg)
        OmegaConf.structured(obj)  # re-check element types that merge lets through (e.g. a dict in list[str])
    except OmegaConfBaseException as e:
        raise ConfigError(_format_omegaconf_error(e, where)) from None
    except PocketdiffError as e:
        raise ConfigError(f"{where}: {e}") from None
    return obj


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (written to DIR/config.yaml by every verb)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
