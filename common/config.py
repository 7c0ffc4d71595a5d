"""Run configuration: YAML files and dotted command-line overrides into typed dataclasses.

A config is a tree of `@dataclass(kw_only=True)` sections, one per component (`engine`,
`engine.spec`, `train`, ...). `load_config` reads a YAML file (optionally extending another
through a top-level `base:` key), applies overrides such as `engine.spec.enabled=false`, and
builds the tree with `from_dict`, which checks every key and value against the field annotations:
an unknown key, a value of the wrong type, a value outside a `Literal`, or a missing required
field raises `ValueError` naming the full dotted key. After a section is built its `validate()`
method, if it defines one, is called for range checks. `save_config` writes the resolved config
next to a run so that it can be reproduced with `load_config` alone.

Supported field types: bool, int, float (an int is accepted), str, `X | None`, `list[X]`,
`tuple[X, ...]` / `tuple[X, Y]`, `Literal[...]` and nested dataclasses. YAML values are never
converted between types (the string "16" is not an int); an override's value is parsed as YAML,
so `16`, `0.9`, `false`, `null` and `[1, 2]` arrive typed, and `key="16"` forces a string.
Unlike plain YAML 1.1, `1e-4` reads as a float, as learning rates are usually written.

A string value of `???` marks a setting the file cannot know and the user must give (a model
folder on a cluster): the config loads, and `missing_keys` lists those keys for the commands
that need them set (`launch.train` and the Slurm preflight refuse to start without them).

This module knows nothing about the sections themselves: their fields, defaults and range
checks live with the component that owns them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

_OVERRIDE_HINT = "expected the form section.key=value, e.g. engine.spec.enabled=false"
_DOTTED_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*$")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` as a float; YAML 1.1 wants `1.0e-4` and gives a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass `cls` from a nested dict, checking keys and value types.

    `path` is the dotted prefix of this section, used only in error messages.
    """
    if not isinstance(data, dict):
        raise ValueError(f"config section '{path or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = _join(path, str(unknown[0]))
        close = difflib.get_close_matches(str(unknown[0]), fields, n=1)
        hint = f" (did you mean '{_join(path, close[0])}'?)" if close else ""
        raise ValueError(
            f"unknown config key '{key}'{hint}; valid keys under '{path or '<root>'}': "
            f"{', '.join(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        key = _join(path, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"missing required config key '{key}'")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against annotation `tp` and return it in the field's type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _convert(arm, value, key)
            except ValueError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ValueError(errors[0])
        raise _type_error(key, tp, value)
    if origin is Literal:
        # `type(...) is` keeps True from matching a Literal[1] and 1 from matching Literal[True].
        if any(value == a and type(value) is type(a) for a in args):
            return value
        allowed = ", ".join(repr(a) for a in args)
        raise ValueError(f"config key '{key}' must be one of {allowed}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(key, tp, value)
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, tp, value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(
                f"config key '{key}' expects {len(args)} items ({_type_name(tp)}), got {value!r}"
            )
        return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(key, tp, value)
    if tp in (bool, int, str):
        # bool is a subclass of int, so `enabled: true` must not pass as an int.
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise _type_error(key, tp, value)
    raise TypeError(f"config key '{key}': unsupported field annotation {tp!r}")


def _type_error(key: str, tp: Any, value: Any) -> ValueError:
    return ValueError(
        f"config key '{key}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__})"
    )


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a", "b", "c"], value), parsing value as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _DOTTED_KEY.match(key):
        raise ValueError(f"malformed override {text!r}: {_OVERRIDE_HINT}")
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: value is not valid YAML ({e})") from e
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override set, creating sections as needed.

    Keys are not checked here; `from_dict` reports an unknown override key by its dotted name.
    """
    out = _deep_merge({}, data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for i, k in enumerate(keys[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                section = ".".join(keys[: i + 1])
                raise ValueError(f"override {text!r}: '{section}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge `top` over `base` recursively into a new dict; a non-dict value replaces."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict):
            out[k] = _deep_merge(out[k] if isinstance(out.get(k), dict) else {}, v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file as a dict, merging it over its `base:` file (relative to it)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ValueError(f"config files extend each other in a cycle: {chain}")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must contain a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ValueError(f"config file {path}: 'base' must be a file path, got {base!r}")
    return _deep_merge(read_yaml(path.parent / base, (*_seen, path)), data)


def load_config(
    cls: type[T], path: str | Path | None, overrides: typing.Iterable[str] = ()
) -> T:
    """Load `path` (or only defaults when None), apply dotted overrides, build `cls`."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides))


MISSING = "???"


def missing_keys(obj: Any, path: str = "") -> list[str]:
    """Dotted keys of the config tree still set to `???` (required, not yet given)."""
    out: list[str] = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), _join(path, f.name)
        if dataclasses.is_dataclass(value):
            out += missing_keys(value, key)
        elif value == MISSING:
            out.append(key)
    return out


def require_keys(obj: Any, source: str) -> None:
    """Raise ValueError naming every `???` key of `obj` and how to set it."""
    keys = missing_keys(obj)
    if keys:
        sets = " ".join(f"{k}=..." for k in keys)
        raise ValueError(f"{source} leaves {', '.join(keys)} to be set (???): add {sets} to the command line "
                         f"(or set them in a config file that extends {source} with `base:`)")


def to_dict(obj: Any) -> dict[str, Any]:
    """The config as plain YAML-safe data (tuples become lists)."""
    return _untuple(dataclasses.asdict(obj))


def _untuple(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untuple(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_untuple(v) for v in value]
    return value


def save_config(obj: Any, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically, so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(to_dict(obj), f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def override_args(argv: typing.Iterable[str]) -> tuple[list[str], list[str]]:
    """Split CLI args into dotted overrides (`key=value`, no leading dash) and the rest."""
    overrides: list[str] = []
    rest: list[str] = []
    for arg in argv:
        key, sep, _ = arg.partition("=")
        is_override = bool(sep) and not arg.startswith("-") and bool(_DOTTED_KEY.match(key))
        (overrides if is_override else rest).append(arg)
    return overrides, rest
