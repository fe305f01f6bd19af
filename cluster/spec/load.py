"""Loading a job spec: a YAML file (or a dict) and ``key=value`` overrides, each value checked against its
field's type, then validated (``cluster.spec.validate``) before anything is started or written.

``load_config`` rejects unknown keys, wrong types and impossible values with one :class:`ConfigError` that
names the key and says what to change.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

import yaml

from cluster.core.errors import ConfigError
from cluster.spec.config import FaultSpec, JobConfig
from cluster.spec.validate import validate

# Short aliases accepted by --set, as users type them on the command line.
ALIASES = {
    "storage": "storage.url",
    "epochs": "training.epochs",
    "workers": "scaling.num_workers",
    "num_workers": "scaling.num_workers",
    "seed": "training.seed",
    "batch": "training.global_batch_size",
}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _accepts(tp: Any) -> str:
    """What a value of annotation ``tp`` may be, for messages."""
    if tp is bool:
        return "true or false"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return f"a {_type_name(tp)}"


def type_label(tp: Any) -> str:
    """A field's type as the config reference shows it (a Literal's choices, else the type's name)."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return _type_name(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), key)
    if origin is Literal:
        args = typing.get_args(tp)
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {choices}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of its fields, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if origin in (list, dict):
        return _coerce_container(value, origin, typing.get_args(tp), key)
    if tp is Any:
        return value
    check = _SCALARS.get(tp)
    if check is None:  # pragma: no cover
        raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")
    accepted, what = check
    if not accepted(value):
        got = repr(value) if tp is bool else f"{type(value).__name__} {value!r}"
        raise ConfigError(f"{key} must be {what}, got {got}")
    return float(value) if tp is float else value


_SCALARS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce_union(value: Any, args: tuple[Any, ...], key: str) -> Any:
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    if len(inner) == 1:
        return _coerce(value, inner[0], key)
    for alternative in inner:
        try:
            return _coerce(value, alternative, key)
        except ConfigError:
            continue
    raise ConfigError(f"{key}={value!r} is not allowed; use {' or '.join(_accepts(a) for a in inner)}")


def _coerce_container(value: Any, origin: Any, args: tuple[Any, ...], key: str) -> Any:
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping, got {type(value).__name__} {value!r}")
    if args and args[1] is not Any:
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    return dict(value)


def _build(cls: Any, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            where = f"{prefix}.{key}" if prefix else str(key)
            hint = _closest(str(key), known)
            raise ConfigError(
                f"unknown key {where!r}"
                + (f"; did you mean {(prefix + '.' if prefix else '') + hint!r}?" if hint else "")
                + f" Valid keys here: {', '.join(sorted(known))}"
            )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def _closest(word: str, options: set[str]) -> str | None:
    import difflib

    match = difflib.get_close_matches(word, sorted(options), n=1, cutoff=0.6)
    return match[0] if match else None


def parse_override(text: str) -> tuple[str, Any]:
    """``"training.epochs=5"`` -> ``("training.epochs", 5)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value, e.g. training.epochs=5")
    key, raw = text.split("=", 1)
    key = ALIASES.get(key.strip(), key.strip())
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        key, value = parse_override(text)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(
    path: str | None = None, overrides: list[str] | None = None, data: dict[str, Any] | None = None
) -> JobConfig:
    """Load a YAML file (or a dict), apply ``key=value`` overrides, validate; raise ConfigError on any
    fault."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as fh:
                loaded = yaml.safe_load(fh)
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path!r} does not exist; pass --config with a YAML file"
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {path!r} must hold a mapping of sections, not {type(loaded).__name__}"
            )
        raw = loaded or {}
    if data is not None:
        raw = {**raw, **data}
    raw = apply_overrides(raw, overrides or [])
    cfg = _build(JobConfig, raw)
    validate(cfg)
    return cfg


def from_dict(data: dict[str, Any]) -> JobConfig:
    """Build and validate a JobConfig from a (possibly partial) nested dict."""
    return load_config(data=data)


def parse_fault_env(text: str, num_workers: int) -> FaultSpec:
    """Parse ``CLUSTER_INJECT_FAULT="rank:step:kind[:attempt]"``."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ConfigError(f"CLUSTER_INJECT_FAULT={text!r} must look like rank:step:kind, e.g. 1:30:crash")
    try:
        data: dict[str, Any] = {"rank": int(parts[0]), "step": int(parts[1]), "kind": parts[2]}
        if len(parts) == 4:
            data["attempt"] = int(parts[3])
    except ValueError:
        raise ConfigError(f"CLUSTER_INJECT_FAULT={text!r}: rank, step and attempt must be integers") from None
    spec: FaultSpec = _build(FaultSpec, data, "CLUSTER_INJECT_FAULT")
    if not 0 <= spec.rank < num_workers:
        raise ConfigError(
            f"CLUSTER_INJECT_FAULT rank {spec.rank} is not a rank of this job (0..{num_workers - 1})"
        )
    return spec
