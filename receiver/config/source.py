"""Reading a config file: ``${VAR}`` interpolation, secret recognition, error messages.

The models live in :mod:`receiver.config.settings`; this module turns a file into the raw mapping
they validate, and validation errors into messages that name the key (never the value,
which may be a secret), with a "did you mean" for unknown keys. It also holds the
lenient validation of read-only commands, where values still holding an unset
``${VAR}`` are left unchecked. The models it validates are passed in, so it imports none.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError, ValidationInfo

from nopoll.exceptions import ConfigError, SinkUnavailable
from nopoll.wire import url_credentials_masked
from sinks.registry import sink_class

__all__ = [
    "Interpolation",
    "Loc",
    "dotted",
    "format_errors",
    "is_secret_key",
    "left_unset",
    "problems",
    "read_raw",
    "redact_url",
    "validate_lenient",
]

_M = TypeVar("_M", bound=BaseModel)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECRET_NAME = re.compile(
    r"secret|passw|token|api[-_]?key|credential|authorization|(^|[-_])keys?$|^sig(nature)?$",
    re.IGNORECASE,
)

Loc = tuple[str | int, ...]
"""A place in the config: ``("providers", "x", "webhook_secrets", 0)``."""


def dotted(loc: Sequence[str | int]) -> str:
    return ".".join(str(part) for part in loc)


def is_secret_key(loc: Sequence[str | int]) -> bool:
    """Whether the value at ``loc`` is a secret by its key's name (``api_key``,
    ``webhook_secrets``, ``password``, ``token``, ...), or an HTTP header value."""
    names = [part for part in loc if isinstance(part, str)]
    return bool(names) and (bool(_SECRET_NAME.search(names[-1])) or "headers" in names[:-1])


def left_unset(text: str, info: ValidationInfo) -> bool:
    """Whether a validator sees a value that still holds a ``${VAR}`` placeholder left by a
    lenient load (:func:`validate_lenient`): its real value, so its length, is not known."""
    return bool(info.context and info.context.get("lenient") and _VAR.search(text))


def redact_url(url: str) -> str:
    """``url`` with its password, and the values of secret-looking query parameters,
    replaced by ``***``: a URL as it may be shown."""
    return url_credentials_masked(url, secret_param=lambda name: bool(_SECRET_NAME.search(name)))


def _secret_reference(loc: Loc, template: str, name: str) -> bool:
    """Whether ``${name}`` in the value ``template`` at ``loc`` stands for a secret: a
    secret-looking key, or the credentials of a URL (its password, a query parameter, or
    the whole URL of a connection such as ``redis_url`` or a sink's ``url``)."""
    if is_secret_key(loc):
        return True
    key = next((part for part in reversed(loc) if isinstance(part, str)), "")
    if not key.endswith("url"):
        return False
    if _VAR.fullmatch(template.strip()):
        return key not in ("base_url", "endpoint_url")
    _, sep, rest = template.partition("://")
    userinfo = rest.split("/", 1)[0].rpartition("@")[0] if sep else ""
    query = template.partition("?")[2]
    return f"${{{name}" in userinfo or f"${{{name}" in query


def read_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML mapping of a config file, or a ConfigError saying what is wrong with it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping")
    return raw


class Interpolation:
    """Replaces ``${VAR}`` and ``${VAR:-default}`` in every string of the raw config.

    As in the shell, a default applies when the variable is unset or empty. A bare
    ``${VAR}`` that is unset or empty is an error naming the key and the variable; in a
    lenient load it stays as written (a visible placeholder) and is recorded in ``unset``.
    """

    def __init__(self, env: Mapping[str, str], *, require_env: bool) -> None:
        self.env = env
        self.require_env = require_env
        self.unset: dict[Loc, list[tuple[str, str]]] = {}
        """key -> (variable, "is not set" | "is set but empty") for every placeholder left."""
        self.errors: list[str] = []
        """In a strict load, every unset variable, so that all are reported at once."""

    def apply(self, value: Any, loc: Loc = ()) -> Any:
        if isinstance(value, dict):
            return {k: self.apply(v, (*loc, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [self.apply(v, (*loc, i)) for i, v in enumerate(value)]
        if not isinstance(value, str):
            return value
        return _VAR.sub(lambda m: self._replace(m, value, loc), value)

    def _replace(self, m: re.Match[str], template: str, loc: Loc) -> str:
        name, default = m.group(1), m.group(2)
        value = self.env.get(name)
        if value:
            return value
        if default is not None:
            return default
        problem = "is not set" if value is None else "is set but empty"
        if not self.require_env:
            self.unset.setdefault(loc, []).append((name, problem))
            return m.group(0)
        if _secret_reference(loc, template, name):
            hint = "set it in the environment: secrets never live in the file"
        elif value is None:
            hint = f"set it, or write ${{{name}:-default}} to give a default"
        else:
            hint = f"give it a value, or write ${{{name}:-}} where empty is meant"
        self.errors.append(f"{dotted(loc)}: environment variable {name} {problem} ({hint})")
        return m.group(0)


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X`` (the first model or container of a union)."""
    if get_origin(tp) in (Union, types.UnionType):
        for arg in get_args(tp):
            if arg is not type(None):
                return arg
    return tp


def _model_at(loc: Loc, root: type[BaseModel]) -> type[BaseModel] | None:
    """The config model whose fields live at ``loc`` under ``root``."""
    current: Any = root
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) in (dict, list):
            current = get_args(current)[-1]
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


class _Problem(NamedTuple):
    loc: Loc
    message: str
    unknown_key: bool = False


def _problem(err: Mapping[str, Any], root: type[BaseModel], prefix: Loc) -> _Problem:
    """One pydantic error of validating ``root``, never with the offending value; an
    unknown key gets the closest field of its model as a suggestion."""
    loc: Loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        model = _model_at(loc[:-1], root)
        close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields) if model else [])
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return _Problem((*prefix, *loc), f"unknown key{hint}", unknown_key=True)
    return _Problem((*prefix, *loc), str(err["msg"]).removeprefix("Value error, "))


def problems(exc: ValidationError, root: type[BaseModel], prefix: Loc = ()) -> list[_Problem]:
    errors = exc.errors(include_input=False, include_url=False)
    return [_problem(e, root, prefix) for e in errors]


def format_errors(problems: Sequence[_Problem], source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    lines += [f"  {dotted(p.loc)}: {p.message}" if p.loc else f"  {p.message}" for p in problems]
    return "\n".join(lines)


def _real(problems: Sequence[_Problem], unset: set[Loc]) -> list[_Problem]:
    """The problems a placeholder left by a lenient load cannot explain: every one that is
    not at (or inside) a value holding a placeholder, and every unknown key."""
    return [
        p
        for p in problems
        if p.unknown_key or not p.loc or not any(p.loc[: len(u)] == u for u in unset)
    ]


def validate_lenient(
    raw: dict[str, Any],
    unset: set[Loc],
    source: str,
    root: type[_M],
    provider_model: type[BaseModel],
) -> _M:
    """Settings from a config that still holds placeholders: what is invalid only because
    of a placeholder is left unchecked (a provider or sink as written; any other key at
    its default); every other error is raised as usual."""
    raw = copy.deepcopy(raw)  # entries are replaced and dropped below
    for section in ("providers", "sinks"):
        entries = raw.get(section)
        if not isinstance(entries, dict):
            continue
        for name, entry in list(entries.items()):
            if isinstance(entry, dict) and any(p[:2] == (section, name) for p in unset):
                entries[name] = _unit(section, name, entry, unset, source, provider_model)
    for _ in range(len(unset) + 1):
        try:  # the context lets validators skip placeholders (see left_unset)
            return root.model_validate(raw, context={"lenient": True})
        except ValidationError as exc:
            found = problems(exc, root)
            real = _real(found, unset)
            if real or not all(_drop(raw, p.loc) for p in found):
                raise ConfigError(format_errors(real or found, source)) from None
    raise ConfigError(f"invalid configuration in {source}")  # pragma: no cover - bounded


def _unit(
    section: str,
    name: str,
    entry: dict[str, Any],
    unset: set[Loc],
    source: str,
    provider_model: type[BaseModel],
) -> Any:
    """One provider or sink of a lenient load: validated if it can be; if it is invalid
    only where placeholders are, built as written, each field coerced where it can be."""
    model: type[BaseModel] = provider_model
    if section == "sinks":
        try:
            model = sink_class(str(entry.get("type"))).config_model
        except (ConfigError, SinkUnavailable):
            return entry  # an unknown type or a missing driver: reported as usual
    try:
        return model.model_validate(entry)
    except ValidationError as exc:
        real = _real(problems(exc, model, (section, name)), unset)
    if real:
        raise ConfigError(format_errors(real, source))
    values = {}
    for key, value in entry.items():
        values[key] = value
        field = model.model_fields.get(key)
        if field is not None and field.annotation is not None:
            with contextlib.suppress(ValidationError):
                values[key] = TypeAdapter(field.annotation).validate_python(value)
    return model.model_construct(**values)


def _drop(raw: Any, loc: Loc) -> bool:
    """Remove the key at ``loc`` from the raw config, so its default applies."""
    for part in loc[:-1]:
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    if isinstance(raw, dict) and loc and loc[-1] in raw:
        del raw[loc[-1]]
        return True
    return False
