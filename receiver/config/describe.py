"""What a configuration sets up, in words, with every credential hidden (a sink says
where it writes with its config's ``location()``: of a URL only the scheme, host and port).

Used for the start-up summary of ``nopoll serve|api|worker`` (one log line per item:
what runs, the config file and data_dir, the HTTP surfaces that are on and off, which
Redis, each provider with its webhook path, each sink, the routes). Paths are absolute.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from receiver.config.settings import Settings, redact_url
from receiver.redis.connector import RedisConnector

__all__ = ["describe"]


def _version() -> str:
    try:
        return version("nopoll")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "source"


def _surfaces(settings: Settings, base: str) -> str:
    """Which HTTP surfaces the API serves, and why the optional ones are off."""
    on = ["POST /webhooks/{provider}", "/healthz", "/readyz", "/metrics"]
    off = []
    consumers = len(settings.consumer_tokens)
    admins = len(settings.admin_tokens)
    if consumers:
        on.append(f"results API {base}/v1 ({consumers} consumer token(s))")
    else:
        off.append("/v1 (no consumer_tokens)")
    if admins:
        on.append(f"admin API {base}/admin/v1 and status page {base}/ui ({admins} admin token(s))")
    else:
        off.append("/admin/v1 and /ui (no admin_tokens)")
    return "http: " + ", ".join(on) + (f"; off: {', '.join(off)}" if off else "")


def describe(
    settings: Settings,
    redis: RedisConnector,
    *,
    api: tuple[str, int] | None,
    worker: bool,
    config: str | None = None,
) -> list[str]:
    """The start-up summary, one line per item; ``config`` is the config file's path."""
    roles = []
    if api is not None:
        roles.append(f"API on http://{api[0]}:{api[1]}")
    if worker:
        roles.append(
            f"worker ({settings.worker.max_jobs} jobs, {settings.batch.max_jobs} batches at once)"
        )
    lines = [f"nopoll {_version()}: {' and '.join(roles)}"]
    source = str(Path(config).absolute()) if config else "none (the built-in defaults)"
    lines.append(f"config: {source}; data_dir: {settings.data_dir.absolute()}")
    if api is not None:
        lines.append(_surfaces(settings, f"http://{api[0]}:{api[1]}"))
    if settings.embedded_redis:
        lines.append(
            f"redis: embedded valkey at {redis.masked_url} (data in {settings.data_dir.absolute()})"
        )
    else:
        lines.append(f"redis: {redis.masked_url}")
    if not settings.providers:
        lines.append("providers: none configured: every callback answers 404")
    for name, p in settings.providers.items():
        callbacks = (
            f"callbacks at POST /webhooks/{name} ({len(p.webhook_secrets)} secret(s))"
            if p.webhook_secrets
            else "no webhook secrets: takes no callbacks"
        )
        budget = (
            f"; at most {p.rate_limit_rps:g} requests/s to the account"
            if p.rate_limit_rps is not None
            else ""
        )
        base = redact_url(p.base_url)
        lines.append(f"provider {name} ({p.dialect}): {callbacks}; fetches from {base}{budget}")
    for name, sink in settings.sinks.items():
        where = sink.location()
        lines.append(f"sink {name}: {sink.type}" + (f" -> {where}" if where else ""))
    if settings.routes:
        for i, route in enumerate(settings.routes):
            match = route.match.model_dump(exclude_none=True) or "everything"
            lines.append(f"route {i}: {match} -> {', '.join(route.sinks)}")
    else:
        lines.append("routes: none (every result goes to every sink)")
    return lines
