"""The plain sections of the configuration: retries, provider HTTP, batches, the API,
the status page, the worker and watches (re-exported by :mod:`receiver.config.settings`,
documented in docs/configuration.md)."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from receiver.backoff import Backoff

__all__ = [
    "MAX_RATE_LIMIT_RPS",
    "ApiConfig",
    "BatchConfig",
    "HttpConfig",
    "OtelConfig",
    "RetryConfig",
    "UiConfig",
    "WatchConfig",
    "WorkerConfig",
]


MAX_RATE_LIMIT_RPS = 10_000
"""The highest request rate a rate limit may be set to (``watch.rate_limit_rps``, a provider
account's ``rate_limit_rps``)."""


class ConfigModel(BaseModel):
    """The base of every config model: unknown keys are errors, a loaded config is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class WatchConfig(ConfigModel):
    """How nopoll polls this provider's watched ids (results without callbacks)."""

    first_poll_s: float = Field(default=1.0, gt=0, le=3600)
    """The first poll, this long after the watch starts."""
    max_interval_s: float = Field(default=60.0, gt=0, le=86_400)
    """Polls back off exponentially (with jitter) up to this interval."""
    rate_limit_rps: float = Field(default=20.0, gt=0, le=MAX_RATE_LIMIT_RPS)
    """Polls per second to this provider, summed over every worker process."""
    expire_after_s: float = Field(default=86_400.0, gt=0)
    """A watch still pending after this long ends as a dead letter (``expired``)."""
    reconcile_after_s: float = Field(default=900.0, ge=0)
    """For ids that expect a callback: poll only when none came by then."""

    @model_validator(mode="after")
    def _order(self) -> WatchConfig:
        if self.first_poll_s > self.max_interval_s:
            raise ValueError("first_poll_s must not be above max_interval_s")
        return self


class CompletionWebhookConfig(ConfigModel):
    """Completion webhooks of a provider that pushes finished responses (Sail, Valar): with
    ``public_url`` set, nopoll's creates ask the provider to POST each finished response to
    nopoll (see docs/watches.md#completion-webhooks)."""

    enabled: bool = True
    """Ask for them (only where ``public_url`` is set); False: every result is polled."""
    trust_body: bool = False
    """Land the pushed Response object as it came; False: fetch it by id from ``base_url``
    (one GET per result, the provider's own answer)."""


class FeedConfig(ConfigModel):
    """A provider's completion feed (sference's ``GET /responses/events``): one worker at
    a time follows each account's feed and lands what it names (see
    docs/watches.md#the-completion-feed)."""

    enabled: bool = True
    """Follow it; False: results come by callbacks and polls only."""
    wait_ms: int = Field(default=20_000, ge=0, le=30_000)
    """How long one request waits for new completions (a long poll; sference caps it at
    30 s). Kept below ``http.read_timeout_s``."""
    limit: int = Field(default=100, ge=1, le=1000)
    """Completions asked for per request."""
    min_interval_ms: int = Field(default=500, ge=0, le=60_000)
    """While completions keep coming (a page answered before it was full), a feed is read
    at most this often, so that each request brings many: the cost of a result is a share
    of a request, its wait at most this much more."""
    lease_s: float = Field(default=10.0, ge=2.0, le=300.0)
    """A feed's holder renews its hold this often times three; a holder silent this long
    (killed) leaves the feed to another worker."""


class DeadLetterConfig(ConfigModel):
    """How many dead letters one tenant keeps, and for how long."""

    max_per_tenant: int = Field(default=10_000, ge=1, le=10_000_000)
    """Letters one tenant (``default``: the providers' own accounts) keeps; a new one
    beyond it drops that tenant's oldest (counted in ``nopoll_dead_letters_dropped``)."""
    ttl_s: int | None = Field(default=30 * 86_400, ge=1)
    """A letter older than this is dropped (counted); None: kept until replayed."""


class RetryConfig(ConfigModel):
    """A job's retries: ``max_tries`` tries, waiting with :class:`~receiver.backoff.Backoff`
    (full jitter up to ``base_delay_s * 2**(try-1)``, capped at ``max_delay_s``)."""

    max_tries: int = Field(default=8, ge=1, le=100)
    base_delay_s: float = Field(default=1.0, ge=0.0)
    max_delay_s: float = Field(default=300.0, ge=0.0)

    def backoff(self, max_s: float | None = None) -> Backoff:
        """This rule's backoff; ``max_s`` caps it lower (a wait inside a running job)."""
        cap = self.max_delay_s if max_s is None else min(max_s, self.max_delay_s)
        return Backoff(self.base_delay_s, cap)

    def delay(self, job_try: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before try ``job_try + 1``: random up to the backoff's ceiling,
        never less than a provider's Retry-After (itself capped at ``max_delay_s``)."""
        return self.backoff().delay(job_try, retry_after_s)


class HttpConfig(ConfigModel):
    """The pooled httpx client used for provider requests."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=100, ge=1)
    transport: Literal["aiohttp", "httpcore"] = "aiohttp"
    """The httpx transport: aiohttp (httpx-aiohttp) or httpx's own httpcore."""
    lanes: int = Field(default=8, ge=1, le=64)
    """With ``transport: httpcore``: pools the connections are spread over."""
    attempts: int = Field(default=3, ge=1, le=10)
    """Tries of one request inside a batch job before the job itself is retried later (a
    single response's fetch is tried once per job try: the job's retries are its retries)."""
    max_retry_after_s: float = Field(default=10.0, ge=0)
    """The longest in-job wait for a Retry-After; a longer one defers the whole job."""
    max_response_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """The largest JSON answer read whole (a response, a batch object, one per-row result),
    counted before and after decompression; a larger one is a dead letter naming the cap."""
    max_line_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """The longest line of a streamed JSONL result file (one batch row)."""


class BatchConfig(ConfigModel):
    """How batch results are streamed into the sinks."""

    chunk_size: int = Field(default=1000, ge=1, le=100_000)
    """Rows per chunk: the unit of sink writes, progress and resumption."""
    chunk_bytes: int = Field(default=2 * 1024 * 1024, ge=0, le=1024**3)
    """A chunk also ends once its rows' raw bytes reach this (whichever of the two comes
    first), so big rows make smaller chunks; 0: by rows only. Like ``chunk_size``, fixed
    by the batch's first run. Per-row dialects (``valar``, Sail without inline results)
    count each row as 8 KiB: a row's size is known only once it is fetched."""
    inflight_bytes: int = Field(default=16 * 1024 * 1024, ge=0)
    """Raw bytes of chunks a worker process holds at once, across all its batches (fetched
    and not yet written by every sink); a batch's stream waits while the rest of the
    process holds this much. A chunk larger than this goes alone. 0: no bound."""
    job_timeout_s: float = Field(default=6 * 3600, gt=1)
    lease_s: float = Field(default=60.0, ge=1)
    """A killed worker's batch is picked up again after at most this long."""
    max_jobs: int = Field(default=2, ge=1)
    sink_attempts: int = Field(default=3, ge=1, le=20)
    """Tries of a chunk within the batch job before it is handed to its own delivery job."""
    sink_queue_chunks: int = Field(default=2, ge=1, le=64)
    """Chunks that may wait for one sink before the stream waits for it."""


class ApiConfig(ConfigModel):
    """The HTTP server in front of the webhook route."""

    limit_concurrency: int = Field(default=1000, ge=1)
    """Connections open at once; a request on the connection that reaches it is answered
    503 (retry)."""
    reserved_for_webhooks: int = Field(default=250, ge=1)
    """Of ``limit_concurrency``, the connections kept for ``/webhooks``: any other request
    is answered 503 once ``limit_concurrency - reserved_for_webhooks`` connections are
    open, and the results API's held requests (streams and ``?wait``) never take them.
    Unset: a quarter of ``limit_concurrency``."""
    max_connections_per_client: int | None = Field(default=None, ge=1)
    """Connections one client address may hold at once (trusted proxies excepted); one
    beyond it takes no slot and its first request is answered 503. Unset:
    ``limit_concurrency - reserved_for_webhooks``."""
    operator_port: int | None = Field(default=None, ge=1, le=65535)
    """A second port of ``nopoll api`` (same host) serving ``/metrics`` and ``/readyz`` with
    the sinks' error text, for Prometheus and operators only; the public port's
    ``/metrics`` then answers 404. None: ``/metrics`` is on the public port."""
    body_timeout_s: float = Field(default=10.0, gt=0)
    """A callback body must arrive whole within this long (slow senders hold memory)."""
    client_rps: int | None = Field(default=None, ge=1)
    """Webhook requests one client address may send a second (sliding window, per API
    process); beyond it 429 before the body is read. None: no limit."""
    provider_rps: int | None = Field(default=None, ge=1)
    """Webhook requests one provider's route takes a second (per API process); None: no
    limit."""
    trusted_proxies: list[str] = Field(default_factory=list, max_length=256)
    """Addresses and networks (CIDR) of the proxies in front of the API (an ingress
    controller's pods). From them only, ``X-Forwarded-For`` names the client; empty: the
    header is ignored and the client is the connection's peer."""

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        networks = []
        for item in value:
            try:
                networks.append(str(ipaddress.ip_network(item.strip(), strict=False)))
            except ValueError:
                raise ValueError(
                    f"{item[:64]!r} is not an IP address or a CIDR network (e.g. 10.42.0.0/16)"
                ) from None
        return networks


class UiConfig(ConfigModel):
    """The status page, ``/ui``."""

    session_secret: SecretStr | None = None
    """Signs the session cookie (at least 32 characters). None: a random key made once
    and kept in Redis, shared by every API process."""

    @field_validator("session_secret")
    @classmethod
    def _session_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():  # "${VAR:-}" left empty
            return None
        if len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters long")
        return value


class WorkerConfig(ConfigModel):
    """arq worker settings that matter for latency, locking and shutdown."""

    poll_delay_s: float = Field(default=0.02, gt=0, le=5)
    """How often a worker whose job slots are all taken looks for room and new jobs."""
    idle_wait_s: float | None = Field(default=1.0, gt=0, le=5)
    """An idle worker waits on its queue's bell, rung by every queued job, and looks at the
    queue anyway after this long (or when its next deferred job is due). None: no bell, a
    worker polls every ``poll_delay_s`` (for a Redis proxy without blocking commands)."""
    max_jobs: int = Field(default=64, ge=1)
    response_job_timeout_s: float = Field(default=120.0, gt=1)
    health_check_interval_s: float = Field(default=10.0, gt=0)
    shutdown_wait_s: float = Field(default=20.0, ge=0)


class OtelConfig(ConfigModel):
    """OpenTelemetry traces (:mod:`receiver.tracing`): off unless ``enabled`` here or the
    standard ``OTEL_TRACES_EXPORTER`` variable names an exporter. Needs ``nopoll[otel]``."""

    enabled: bool = False
    service_name: str = Field(default="nopoll", min_length=1, max_length=200)
    """``service.name`` of the spans (``OTEL_SERVICE_NAME`` wins when set)."""
    exporter: str | None = Field(default=None, pattern=r"^[a-z0-9_]{1,64}$")
    """``otlp`` (OTLP over HTTP), ``console``, or an installed exporter's entry-point
    name; unset: ``OTEL_TRACES_EXPORTER``, else ``otlp``."""
    endpoint: str | None = Field(default=None, pattern=r"^https?://")
    """The OTLP collector's base URL (``/v1/traces`` is added); unset: the
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` variables, else ``http://localhost:4318``."""
