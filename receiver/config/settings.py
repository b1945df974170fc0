"""The nopoll configuration: one YAML file, ``${VAR}`` interpolation, validated once at start-up.

``load_settings(path)`` returns a :class:`Settings`; every problem raises
:class:`~nopoll.exceptions.ConfigError` naming the exact key, never the value (it may be a
secret). ``load_settings(path, require_env=False)`` is the lenient load of read-only
commands: an unset ``${VAR}`` stays visible and becomes a note in
:attr:`Settings.notes`, and a value invalid only because of it is not checked.

See docs/configuration.md.
"""

from __future__ import annotations

import difflib
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from nopoll.envelope import DEFAULT_TENANT
from nopoll.exceptions import ConfigError
from nopoll.wire import decode_webhook_secret
from receiver.config.dialects import DIALECTS, DialectInfo, known_dialect
from receiver.config.sections import (
    MAX_RATE_LIMIT_RPS,
    ApiConfig,
    BatchConfig,
    CompletionWebhookConfig,
    ConfigModel,
    DeadLetterConfig,
    FeedConfig,
    HttpConfig,
    OtelConfig,
    RetryConfig,
    UiConfig,
    WatchConfig,
    WorkerConfig,
)
from receiver.config.source import (
    Interpolation,
    dotted,
    format_errors,
    is_secret_key,
    left_unset,
    problems,
    read_raw,
    redact_url,
    validate_lenient,
)
from receiver.config.tenants import (
    ConsumerToken,
    ResultsConfig,
    TenantConfig,
    TenantProviderConfig,
    check_distinct_tokens,
    check_tenant_names,
    token_problem,
)
from receiver.redis.config import RedisConfig
from sinks.base import ClaimCheckConfig, HoldsClaims, SinkConfig
from sinks.registry import sink_class, validate_sink_config

__all__ = [
    "ApiConfig",
    "BatchConfig",
    "CompletionWebhookConfig",
    "ConsumerToken",
    "FeedConfig",
    "HttpConfig",
    "OtelConfig",
    "ProviderConfig",
    "RedisConfig",
    "ResultsConfig",
    "RetryConfig",
    "RouteConfig",
    "Settings",
    "TenantConfig",
    "TenantProviderConfig",
    "UiConfig",
    "WatchConfig",
    "WorkerConfig",
    "decode_webhook_secret",
    "is_secret_key",
    "load_settings",
    "redact_url",
]

WEBHOOK_DIALECTS = tuple(name for name, info in DIALECTS.items() if info.sends_callbacks)
"""The dialects whose providers send signed callbacks (the others send none: nopoll polls
their results, see docs/watches.md)."""
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DATA_DIR = "./nopoll-data"


def _check_webhook_secret(secret: SecretStr) -> SecretStr:
    if secret.get_secret_value():  # empty: a rotation slot, dropped by ProviderConfig
        decode_webhook_secret(secret.get_secret_value())
    return secret


_WebhookSecret = Annotated[SecretStr, AfterValidator(_check_webhook_secret)]
"""One entry of ``webhook_secrets``, checked on its own so an error names its index."""


class ProviderConfig(ConfigModel):
    """One inference provider: where to fetch results and how its callbacks are signed.

    ``webhook_secrets`` empty (the default): this provider sends no callbacks, and
    ``/webhooks/<name>`` answers 404 for it.
    """

    dialect: Annotated[
        str,
        BeforeValidator(known_dialect),
        WithJsonSchema({"enum": list(DIALECTS), "type": "string", "title": "Dialect"}),
    ]
    """A row of :data:`~receiver.config.dialects.DIALECTS`."""
    base_url: str
    api_key: SecretStr | None = None
    api_version: str | None = Field(default=None, pattern=r"^\d{4}-\d{2}-\d{2}$")
    """``anthropic``: the ``anthropic-version`` header (default the official SDK's); a
    version before 2026-10-21 authenticates with ``x-api-key`` instead of a Bearer token."""
    webhook_secrets: list[_WebhookSecret] = Field(default_factory=list)
    tolerance_s: int = Field(default=300, ge=1, le=86_400)
    max_concurrency: int = Field(default=32, ge=1, le=1024)
    rate_limit_rps: float | None = Field(default=None, gt=0, le=MAX_RATE_LIMIT_RPS)
    """Requests per second to this provider account, every kind (polls, fetches, per-row
    GETs, result streams, creates) summed over every process. Left out: the dialect's
    documented limit (:attr:`DialectInfo.rate_limit_rps`); ``null``: no budget."""
    watch: WatchConfig = Field(default_factory=WatchConfig)
    completion_webhook: CompletionWebhookConfig = Field(default_factory=CompletionWebhookConfig)
    """Sail and Valar: completion webhooks, asked for when ``public_url`` is set."""
    feed: FeedConfig = Field(default_factory=FeedConfig)
    """sference: its completion feed, followed by the workers (on by default)."""

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")

    @field_validator("webhook_secrets")
    @classmethod
    def _drop_empty(cls, value: list[SecretStr]) -> list[SecretStr]:
        # "${OLD_SECRET:-}" for a rotation slot that is empty most of the time
        kept = [secret for secret in value if secret.get_secret_value()]
        if value and not kept:
            raise ValueError(
                "every entry is empty; write [] (or leave the key out) for a provider "
                "that sends no callbacks"
            )
        return kept

    @model_validator(mode="after")
    def _callbacks(self) -> ProviderConfig:
        info = DIALECTS[self.dialect]
        if self.webhook_secrets and not info.takes_webhook_secrets:
            raise ValueError(
                f"webhook_secrets: the {self.dialect} dialect sends no callbacks (its "
                "results are polled); leave webhook_secrets out"
            )
        if "completion_webhook" in self.model_fields_set and not info.completion_webhooks:
            having = [name for name, row in DIALECTS.items() if row.completion_webhooks]
            raise ValueError(
                f"completion_webhook: only the {' and '.join(having)} dialects push completions"
            )
        if "feed" in self.model_fields_set and not info.completion_feed:
            having = [name for name, row in DIALECTS.items() if row.completion_feed]
            raise ValueError(f"feed: only the {' and '.join(having)} dialect has one")
        if self.api_version is not None and not info.takes_api_version:
            having = [name for name, row in DIALECTS.items() if row.takes_api_version]
            raise ValueError(f"api_version: only the {' and '.join(having)} dialect has one")
        if "rate_limit_rps" not in self.model_fields_set:  # the provider's documented limit
            object.__setattr__(self, "rate_limit_rps", info.rate_limit_rps)
        return self

    @property
    def follows_feed(self) -> bool:
        """Its dialect has a completion feed and ``feed.enabled``."""
        return DIALECTS[self.dialect].completion_feed and self.feed.enabled

    @property
    def dialect_info(self) -> DialectInfo:
        """This provider's row of the dialect table."""
        return DIALECTS[self.dialect]

    def secret_keys(self) -> list[bytes]:
        """The HMAC keys of every accepted webhook secret (several while rotating)."""
        return [decode_webhook_secret(s.get_secret_value()) for s in self.webhook_secrets]


class RouteMatch(ConfigModel):
    """What a result must have for a route to take it; every given field must match."""

    model_config = ConfigDict(extra="allow", frozen=True)

    provider: str | list[str] | None = None
    tenant: str | list[str] | None = None
    kind: str | list[str] | None = None
    status: str | list[str] | None = None
    model: str | list[str] | None = None

    @model_validator(mode="after")
    def _metadata_keys(self) -> RouteMatch:
        for key in self.model_extra or {}:
            if not key.startswith("metadata."):
                close = difflib.get_close_matches(key, type(self).model_fields, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"unknown match key {key!r}: {hint}"
                    "use provider, tenant, kind, status, model or metadata.<key>"
                )
        return self


class RouteConfig(ConfigModel):
    """Send results that match to the named sinks."""

    match: RouteMatch = Field(default_factory=RouteMatch)
    sinks: list[str] = Field(min_length=1)


class Settings(ConfigModel):
    """The whole validated configuration, built once at start-up and passed down."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    """Which Redis and each role's timeouts; the top-level ``redis_url`` key is an alias of
    ``redis.url`` (see :meth:`_redis_url_alias`)."""
    data_dir: Path = Path(_DATA_DIR)
    """Relative: to the config file's folder (:func:`load_settings`)."""
    max_body_bytes: int = Field(default=262_144, ge=1024, le=64 * 1024 * 1024)
    dedupe_ttl_s: int = Field(default=7 * 86_400, ge=60)
    """How long a webhook-id is remembered; providers retry for up to 72 hours."""
    job_expiry_s: int = Field(default=7 * 86_400, ge=3600)
    journey_ttl_s: int = Field(default=7 * 86_400, ge=0)
    """How long an id's journey (its callbacks, fetches, sinks, dead letters) is kept after
    its last event; 0 keeps none."""
    providers: dict[str, ProviderConfig] = Field(default_factory=dict)
    sinks: dict[str, Any] = Field(default_factory=dict)
    routes: list[RouteConfig] = Field(default_factory=list)
    fetch_retry: RetryConfig = Field(default_factory=RetryConfig)
    dead_letters: DeadLetterConfig = Field(default_factory=DeadLetterConfig)
    sink_retry: RetryConfig = Field(
        default_factory=lambda: RetryConfig(max_tries=12, base_delay_s=2.0, max_delay_s=600.0)
    )
    http: HttpConfig = Field(default_factory=HttpConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    admin_tokens: list[SecretStr] = Field(default_factory=list)
    """Bearer tokens of the admin API (``/admin/v1``); none: the admin API is 404."""
    ui: UiConfig = Field(default_factory=UiConfig)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    """Teams with their own provider accounts, each behind signed ``/webhooks/t/{token}``."""
    tenant_keys: list[SecretStr] = Field(default_factory=list)
    """Keys of the tenant endpoint tokens: the first signs, every one verifies."""
    public_url: str | None = None
    """The URL providers reach nopoll at (``nopoll endpoint`` prints full URLs with it)."""
    consumer_tokens: list[ConsumerToken] = Field(default_factory=list)
    """Bearer tokens of the results API (``/v1``); none: ``/v1`` is 404."""
    results: ResultsConfig = Field(default_factory=ResultsConfig)
    otel: OtelConfig = Field(default_factory=OtelConfig)
    """OpenTelemetry traces, opt-in (docs/configuration.md#traces)."""
    redis_policy_check: Literal["refuse", "warn"] = "refuse"
    """A Redis whose ``maxmemory-policy`` may evict keys can drop queued jobs: refuse to
    start (default), or only warn."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    """JSON lines (with event, response and batch ids) or readable text."""

    _unset: dict[str, tuple[str, ...]] = PrivateAttr(default_factory=dict)
    _notes: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("providers", "sinks")
    @classmethod
    def _names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if not _NAME.match(name):
                raise ValueError(f"name {name!r} must match [A-Za-z0-9_-]{{1,64}}")
        return value

    @model_validator(mode="after")
    def _sinks_and_routes(self) -> Settings:
        if not self.sinks:
            object.__setattr__(self, "sinks", _default_sinks(self.data_dir))
        validated = {}
        for name, raw in self.sinks.items():
            try:
                validated[name] = validate_sink_config(name, raw)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        object.__setattr__(self, "sinks", validated)
        for name, sink in self.sinks.items():
            if not isinstance(sink, ClaimCheckConfig) or (target := sink.claim_check) is None:
                continue
            holder = self.sinks.get(target)
            if holder is None or not issubclass(sink_class(holder.type), HoldsClaims):
                what = f"a {holder.type} sink" if holder is not None else "not a configured sink"
                raise ValueError(
                    f"sinks.{name}.claim_check: {target!r} is {what}; name an s3 sink "
                    "(it keeps the bodies too large for a message)"
                )
        for i, route in enumerate(self.routes):
            for sink in route.sinks:
                if sink not in self.sinks:
                    raise ValueError(
                        f"routes.{i}.sinks: unknown sink {sink!r} (configured: "
                        f"{', '.join(sorted(self.sinks)) or 'none'})"
                    )
        return self

    @field_validator("consumer_tokens")
    @classmethod
    def _consumer_tokens(cls, value: list[ConsumerToken]) -> list[ConsumerToken]:
        return [t for t in value if t.token.get_secret_value()]

    @field_validator("tenant_keys")
    @classmethod
    def _tenant_keys(cls, value: list[SecretStr], info: ValidationInfo) -> list[SecretStr]:
        if any(len(t) < 32 for t in _checked(value, info)):
            raise ValueError("a tenant key must be at least 32 characters long")
        return [t for t in value if t.get_secret_value()]

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/") if value else None

    @model_validator(mode="after")
    def _tenants(self) -> Settings:
        check_tenant_names(self.tenants, set(self.providers))
        if self.tenants and not self.tenant_keys:
            raise ValueError("tenants need tenant_keys (the keys that sign their endpoints)")
        _check_tenant_keys(self)
        known = {*self.tenants, DEFAULT_TENANT}
        for i, consumer in enumerate(self.consumer_tokens):
            if consumer.tenant is not None and consumer.tenant not in known:
                raise ValueError(f"consumer_tokens.{i}.tenant: no tenant {consumer.tenant!r}")
        for i, route in enumerate(self.routes):
            wanted = route.match.tenant
            for tenant in [wanted] if isinstance(wanted, str) else wanted or []:
                if tenant not in known:
                    raise ValueError(f"routes.{i}.match.tenant: no tenant {tenant!r}")
        return self

    @field_validator("admin_tokens")
    @classmethod
    def _admin_tokens(cls, value: list[SecretStr], info: ValidationInfo) -> list[SecretStr]:
        for token in _checked(value, info):
            if (problem := token_problem(token, "an admin token")) is not None:
                raise ValueError(problem)
        return [t for t in value if t.get_secret_value()]  # "${TOKEN:-}" left empty

    @model_validator(mode="before")
    @classmethod
    def _redis_url_alias(cls, data: Any) -> Any:
        """``redis_url: …`` (the key nopoll always had) is ``redis: {url: …}``."""
        if not isinstance(data, dict) or "redis_url" not in data:
            return data
        data = dict(data)
        url = data.pop("redis_url")
        section = data.get("redis")
        section = {} if section is None else section
        if isinstance(section, dict):
            if "url" in section:
                raise ValueError("redis_url and redis.url are the same setting: give one")
            data["redis"] = {**section, "url": url}
        elif isinstance(section, RedisConfig):
            if section.url.get_secret_value():
                raise ValueError("redis_url and redis.url are the same setting: give one")
            data["redis"] = section.model_copy(update={"url": SecretStr(str(url))})
        return data

    @model_validator(mode="before")
    @classmethod
    def _distinct_tokens(cls, data: Any) -> Any:
        check_distinct_tokens(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """Settings that compare with each other, checked once every section is valid on
        its own: windows and timeouts."""
        self._check_replay_window()
        self._settle_timeouts()
        self._settle_held_requests()
        return self

    def _check_replay_window(self) -> None:
        """A webhook-id must be remembered for the whole window its callback is accepted in
        (``tolerance_s`` either side of its timestamp), or a copy could be replayed."""
        for name, p in self.providers.items():
            if self.dedupe_ttl_s < 2 * p.tolerance_s:
                raise ValueError(
                    f"dedupe_ttl_s ({self.dedupe_ttl_s} s) must be at least twice providers."
                    f"{name}.tolerance_s ({p.tolerance_s} s), the window a callback is accepted in"
                )

    def _settle_timeouts(self) -> None:
        """Timeouts that contradict each other would let a job die silently: a write or a
        request that may take as long as the whole job could never be retried. Unset timeouts
        follow a short job timeout down (set on ``settings`` in place), so shortening one is
        enough."""
        job_s = self.worker.response_job_timeout_s
        derived = {
            name: sink.model_copy(update={"timeout_s": min(sink.timeout_s, job_s / 2)})
            for name, sink in self.sinks.items()
            if "timeout_s" not in sink.model_fields_set
        }
        if derived:
            object.__setattr__(self, "sinks", {**self.sinks, **derived})
        http_update = {
            name: min(getattr(self.http, name), job_s * share)
            for name, share in (("connect_timeout_s", 0.25), ("read_timeout_s", 0.5))
            if name not in self.http.model_fields_set
        }
        if http_update:
            object.__setattr__(self, "http", self.http.model_copy(update=http_update))
        for name, sink in self.sinks.items():
            if sink.timeout_s >= job_s:
                raise ValueError(
                    f"sinks.{name}.timeout_s ({sink.timeout_s:g} s) must be below "
                    f"worker.response_job_timeout_s ({job_s:g} s)"
                )
        request_s = self.http.connect_timeout_s + self.http.read_timeout_s
        if request_s >= job_s:
            raise ValueError(
                f"http.connect_timeout_s + http.read_timeout_s ({request_s:g} s) must be below "
                f"worker.response_job_timeout_s ({job_s:g} s)"
            )
        if self.batch.lease_s >= self.batch.job_timeout_s:
            raise ValueError(
                f"batch.lease_s ({self.batch.lease_s:g} s) must be below "
                f"batch.job_timeout_s ({self.batch.job_timeout_s:g} s)"
            )

    def _settle_held_requests(self) -> None:
        """The results API's held requests (streams, ``?wait``) may never take the connections
        kept for ``/webhooks``. A request on the connection that reaches
        ``api.limit_concurrency`` is answered 503 (every open connection counts,
        :mod:`receiver.webhooks.slots`), so consumers may hold at
        most ``limit_concurrency - 1 - reserved_for_webhooks``. Unset, the reserve is a
        quarter of the limit and ``results.max_held`` all that is left (set on ``settings``
        in place); set, they are checked."""
        api, results = self.api, self.results
        limit = api.limit_concurrency
        if "reserved_for_webhooks" not in api.model_fields_set:
            api = api.model_copy(update={"reserved_for_webhooks": max(1, limit // 4)})
            object.__setattr__(self, "api", api)
        elif api.reserved_for_webhooks >= limit:
            raise ValueError(
                f"api.reserved_for_webhooks ({api.reserved_for_webhooks}) must be below "
                f"api.limit_concurrency ({limit})"
            )
        if api.max_connections_per_client is None:
            per_client = max(1, limit - api.reserved_for_webhooks)
            api = api.model_copy(update={"max_connections_per_client": per_client})
            object.__setattr__(self, "api", api)
        room = max(0, limit - 1 - api.reserved_for_webhooks)
        if "max_held" not in results.model_fields_set:
            object.__setattr__(self, "results", results.model_copy(update={"max_held": room}))
        elif results.max_held > room:
            raise ValueError(
                f"results.max_held ({results.max_held}) leaves no room for "
                f"api.reserved_for_webhooks ({api.reserved_for_webhooks}): at most "
                f"api.limit_concurrency - 1 - api.reserved_for_webhooks ({room}) held requests; "
                "beyond api.limit_concurrency even callbacks are answered 503"
            )

    @property
    def redis_url(self) -> SecretStr:
        """``redis.url`` (the top-level ``redis_url`` key is its alias)."""
        return self.redis.url

    @property
    def embedded_redis(self) -> bool:
        """True when no Redis URL is set: nopoll starts its own Redis-compatible server."""
        return not self.redis.url.get_secret_value()

    @property
    def unset_env(self) -> Mapping[str, tuple[str, ...]]:
        """After a lenient load: each key (``providers.x.api_key``) whose value still holds
        a ``${VAR}`` placeholder, with the names of its unset variables. Empty otherwise."""
        return types.MappingProxyType(self._unset)

    @property
    def notes(self) -> tuple[str, ...]:
        """After a lenient load: what must still be set before nopoll can run."""
        return self._notes


def _checked(values: list[SecretStr], info: ValidationInfo) -> list[str]:
    """The secrets of a list to check: not left empty, and not a ``${VAR}`` a lenient
    load left unset (its value is not known, so neither is its length)."""
    texts = [value.get_secret_value() for value in values]
    return [text for text in texts if text and not left_unset(text, info)]


def _canonical(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """Where a key of the file lives in :class:`Settings` (``redis_url`` is ``redis.url``)."""
    return ("redis", "url", *loc[1:]) if loc[:1] == ("redis_url",) else loc


def _check_tenant_keys(settings: Settings) -> None:
    """Refuse a tenant account whose api_key is the provider's own or another tenant's at
    that provider: it could fetch the other's results (a replayed callback of theirs sent
    to its endpoint lands under it). Names both keys, never the value."""
    for provider, config in settings.providers.items():
        own = f"providers.{provider}.api_key"
        holders: dict[str, str] = {}
        if config.api_key is not None and config.api_key.get_secret_value():
            holders[config.api_key.get_secret_value()] = own
        for tenant, tenant_config in settings.tenants.items():
            account = tenant_config.providers.get(provider)
            key = account.api_key.get_secret_value() if account and account.api_key else ""
            if not key:
                continue
            here = f"tenants.{tenant}.providers.{provider}.api_key"
            if key in holders:
                other = holders[key]
                said = (
                    f"the provider's own api_key ({own})"
                    if other == own
                    else f"the same key as {other}"
                )
                raise ValueError(
                    f"{here}: {said}: a tenant's account needs a key of its own, or it could "
                    "read the other's results"
                )
            holders[key] = here


def _rebased(settings: Settings, base: Path) -> Settings:
    """``settings`` with the relative paths of its sinks made absolute under ``base``."""
    sinks = {
        name: sink.rebased(base) if isinstance(sink, SinkConfig) else sink
        for name, sink in settings.sinks.items()
    }
    object.__setattr__(settings, "sinks", sinks)
    return settings


def _default_sinks(data_dir: Path) -> dict[str, Any]:
    return {
        "db": {"type": "sql", "url": f"sqlite+aiosqlite:///{data_dir / 'results.db'}"},
        "files": {"type": "jsonl", "dir": str(data_dir / "results")},
    }


def load_settings(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    require_env: bool = True,
) -> Settings:
    """Read, interpolate and validate the config file (``None``: the embedded defaults).

    ``require_env=False`` is the lenient load of read-only commands: unset variables
    become :attr:`Settings.notes` instead of errors (see the module docstring).
    """
    env = os.environ if env is None else env
    source = str(path) if path is not None else "the built-in defaults"
    raw: Any = read_raw(path) if path is not None else {}
    interpolation = Interpolation(env, require_env=require_env)
    raw = interpolation.apply(raw)
    if interpolation.errors:
        lines = "\n".join(f"  {e}" for e in interpolation.errors)
        raise ConfigError(f"invalid configuration in {source}:\n{lines}")
    if overrides:
        raw = {**raw, **overrides}
    # relative paths are the config file's folder's (without a file: the current folder's)
    base = Path(os.path.abspath(path)).parent if path is not None else Path.cwd()
    data_dir = raw.get("data_dir", _DATA_DIR)
    if isinstance(data_dir, str | os.PathLike):
        raw = {**raw, "data_dir": str(base / data_dir)}
    unset = interpolation.unset
    if not unset:
        try:
            return _rebased(Settings.model_validate(raw), base)
        except ValidationError as exc:
            raise ConfigError(format_errors(problems(exc, Settings), source)) from None
    settings = _rebased(validate_lenient(raw, set(unset), source, Settings, ProviderConfig), base)
    settings._unset = {
        dotted(_canonical(loc)): tuple(n for n, _ in found) for loc, found in unset.items()
    }
    settings._notes = tuple(
        f"{dotted(loc)}: {name} {problem} (needed to run)"
        for loc, found in unset.items()
        for name, problem in found
    )
    return settings
