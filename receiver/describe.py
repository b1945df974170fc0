"""What a configuration sets up, in words, with every credential hidden (of a sink's
URL only the scheme, host and port are shown).

Used for the start-up summary of ``nopoll serve|api|worker`` (one log line per item:
what runs, which Redis, each provider with its webhook path, each sink, the routes).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pydantic import SecretStr

from nopoll.wire import url_origin
from receiver.config import Settings, redact_url

__all__ = ["describe"]

_WHERE = ("url", "bucket", "bootstrap_servers", "dir", "endpoint_url")


def _version() -> str:
    try:
        return version("nopoll")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "source"


def describe(
    settings: Settings, redis_url: str, *, api: tuple[str, int] | None, worker: bool
) -> list[str]:
    """The start-up summary, one line per item."""
    roles = []
    if api is not None:
        roles.append(f"API on http://{api[0]}:{api[1]}")
    if worker:
        roles.append(
            f"worker ({settings.worker.max_jobs} jobs, {settings.batch.max_jobs} batches at once)"
        )
    lines = [f"nopoll {_version()}: {' and '.join(roles)}"]
    if settings.embedded_redis:
        lines.append(f"redis: embedded valkey at {redis_url} (data in {settings.data_dir})")
    else:
        lines.append(f"redis: {redact_url(redis_url)}")
    if not settings.providers:
        lines.append("providers: none configured: every callback answers 404")
    for name, p in settings.providers.items():
        callbacks = (
            f"callbacks at POST /webhooks/{name} ({len(p.webhook_secrets)} secret(s))"
            if p.webhook_secrets
            else "no webhook secrets: takes no callbacks"
        )
        lines.append(f"provider {name} ({p.dialect}): {callbacks}; fetches from {p.base_url}")
    for name, sink in settings.sinks.items():
        value = next((getattr(sink, f) for f in _WHERE if getattr(sink, f, None) is not None), "")
        where = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        if "://" in where:
            where = url_origin(where)
        lines.append(f"sink {name}: {sink.type}" + (f" -> {where}" if where else ""))
    if settings.routes:
        for i, route in enumerate(settings.routes):
            match = route.match.model_dump(exclude_none=True) or "everything"
            lines.append(f"route {i}: {match} -> {', '.join(route.sinks)}")
    else:
        lines.append("routes: none (every result goes to every sink)")
    return lines
