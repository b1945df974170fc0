"""``nopoll config check``: validate a config file and say what it configures.

``--redacted`` prints the effective configuration (defaults included) as YAML with every
secret masked, for a bug report; it needs no secret in the environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from nopoll.wire import url_masked
from receiver.cli._common import add_config_option, config_path, load
from receiver.config.settings import Settings, is_secret_key, redact_url

_MASK = "***"


def _redacted(value: Any, loc: tuple[str | int, ...], unset: Mapping[str, Any]) -> Any:
    """``value`` as plain YAML data, every secret masked; a secret that is still an unset
    ``${VAR}`` shows as such."""
    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        fields.update(value.model_extra or {})
        return {k: _redacted(v, (*loc, k), unset) for k, v in fields.items()}
    if isinstance(value, Mapping):
        return {str(k): _redacted(v, (*loc, str(k)), unset) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v, (*loc, i), unset) for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if not isinstance(value, str | SecretStr):
        return value
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if ".".join(map(str, loc)) in unset and text.startswith("${") and text.endswith("}"):
        return f"{text} (not set)"
    if is_secret_key(loc):
        return _MASK if text else ""
    if "://" in text:  # a sink's URL may hide a token anywhere: its path and query too
        return url_masked(text) if loc[:1] == ("sinks",) else redact_url(text)
    if isinstance(value, SecretStr):
        return _MASK if text else ""
    return text


def _print_redacted(settings: Settings, source: str) -> None:
    import yaml

    data = _redacted(settings, (), settings.unset_env)
    print(f"# the effective configuration of {source}, every secret masked")
    print(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), end="")


def _cmd_config_check(args: argparse.Namespace) -> int:
    if args.redacted:
        settings = load(args, require_env=False)
        _print_redacted(settings, config_path(args) or "the built-in defaults")
        if settings.notes:
            print(
                f"nopoll: config valid but for {len(settings.notes)} unset variable(s) "
                "(notes above)",
                file=sys.stderr,
            )
        return 0
    settings = load(args)
    print("config OK")
    print(
        "  redis: "
        + (f"embedded (under {settings.data_dir})" if settings.embedded_redis else "external")
    )
    url = settings.redis.url.get_secret_value()
    if url.partition("://")[0].lower().endswith("+sentinel"):  # asked now: which primary
        import asyncio

        from receiver.redis.sentinel import find_primary

        print(f"  redis: {asyncio.run(find_primary(url))}")
    if settings.redis.min_replicas_acked:
        print(
            f"  redis: a callback's 2xx waits for {settings.redis.min_replicas_acked} "
            f"replica(s), at most {settings.redis.wait_timeout_ms} ms"
        )
    for name, p in settings.providers.items():
        callbacks = (
            f"{len(p.webhook_secrets)} webhook secret(s)"
            if p.webhook_secrets
            else "no callbacks (no webhook_secrets)"
        )
        print(
            f"  provider {name}: dialect {p.dialect}, {redact_url(p.base_url)}, "
            f"{callbacks}, tolerance {p.tolerance_s}s"
        )
    for name, s in settings.sinks.items():
        print(f"  sink {name}: {s.type}")
    if settings.routes:
        for i, r in enumerate(settings.routes):
            print(f"  route {i}: {r.match.model_dump(exclude_none=True)} -> {', '.join(r.sinks)}")
    else:
        print("  routes: none (every result goes to every sink)")
    return 0


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("check", help="validate a config file and print what it configures")
    add_config_option(p)
    p.add_argument(
        "--redacted",
        action="store_true",
        help="print the effective configuration with every secret masked (for bug reports); "
        "unset variables are notes, not errors",
    )
    p.set_defaults(func=_cmd_config_check)
