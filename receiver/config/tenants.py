"""Configuration of tenants (teams with their own provider accounts) and of the results
API's consumers (re-exported by :mod:`receiver.config.settings`, documented in
docs/configuration.md)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from nopoll.envelope import DEFAULT_TENANT
from nopoll.wire import decode_webhook_secret
from receiver.config.sections import MAX_RATE_LIMIT_RPS, ConfigModel
from receiver.config.source import left_unset

__all__ = [
    "ConsumerToken",
    "ResultsConfig",
    "TenantConfig",
    "TenantProviderConfig",
    "check_distinct_tokens",
    "token_problem",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
MIN_TOKEN = 16


def token_problem(token: str, what: str) -> str | None:
    """What is wrong with a bearer token (``what``: "an admin token"), or ``None``: at
    least :data:`MIN_TOKEN` characters of printable ASCII without spaces, so that it can
    travel in an ``Authorization`` header as it is."""
    if len(token) < MIN_TOKEN:
        return f"{what} must be at least {MIN_TOKEN} characters long"
    if not _VISIBLE_ASCII.fullmatch(token):
        return f"{what} must be printable ASCII without spaces (it is sent in a header)"
    return None


def _kept(value: list[SecretStr]) -> list[SecretStr]:
    """Entries left empty by ``${VAR:-}`` are dropped (a rotation slot not in use)."""
    return [v for v in value if v.get_secret_value()]


class TenantProviderConfig(ConfigModel):
    """A tenant's own account at one provider: its own key (required: with the provider's
    key it could fetch the default tenant's results) and, optionally, its own webhook
    secrets and request rate (the provider's ``dialect``, ``base_url`` and settings stay)."""

    api_key: SecretStr | None = None
    webhook_secrets: list[SecretStr] = Field(default_factory=list)
    rate_limit_rps: float | None = Field(default=None, gt=0, le=MAX_RATE_LIMIT_RPS)
    """Requests per second to the tenant's account (a budget of its own, whatever the
    provider's account uses). Left out: the provider's ``rate_limit_rps``; ``null``: none."""

    @field_validator("webhook_secrets")
    @classmethod
    def _secrets(cls, value: list[SecretStr]) -> list[SecretStr]:
        kept = _kept(value)
        for i, secret in enumerate(kept):
            try:
                decode_webhook_secret(secret.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"entry {i}: {exc}") from None
        return kept


class TenantConfig(ConfigModel):
    """One tenant: ``providers`` maps provider names (from ``providers:``) to its account."""

    providers: dict[str, TenantProviderConfig] = Field(default_factory=dict)


class ConsumerToken(ConfigModel):
    """A bearer token of the results API; ``tenant`` set: it sees that tenant's results only."""

    token: SecretStr
    tenant: str | None = None

    @field_validator("token")
    @classmethod
    def _long(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        text = value.get_secret_value()
        problem = token_problem(text, "a consumer token")
        if text and not left_unset(text, info) and problem is not None:
            raise ValueError(problem)
        return value


class ResultsConfig(ConfigModel):
    """The results API (``/v1/results``): how long landed envelopes stay readable."""

    stream_max_entries: int = Field(default=100_000, ge=100, le=100_000_000)
    """The live stream keeps at most this many envelopes (older ones are trimmed); so does
    each tenant's own stream."""
    stream_retention_s: int = Field(default=86_400, ge=60)
    """... and none older than this. A client that reconnects with an older Last-Event-ID
    gets a ``reset`` event."""
    stream_inline_bytes: int = Field(default=262_144, ge=1024, le=64 << 20)
    """An envelope larger than this (as JSON) is sent on the stream as a ``result-ref``
    event naming where to read it, not whole: a reader catching up through large
    envelopes holds a small event each, and the stream keeps no copy of them."""
    latest_ttl_s: int = Field(default=7 * 86_400, ge=60)
    """``GET /v1/results/{provider}/{key}`` finds an envelope this long after it landed."""
    max_wait_s: float = Field(default=60.0, gt=0, le=60)
    """The longest ``?wait=`` a request may ask for."""
    max_held: int = Field(default=749, ge=0)
    """Held requests (streams and waits) one API process serves at once, all tokens
    together; beyond it 429. Unset: what ``api.limit_concurrency`` leaves after
    ``api.reserved_for_webhooks`` (an explicit value must leave it too)."""
    max_held_per_token: int = Field(default=20, ge=1)
    """Held requests one consumer token may have at once on one API process; beyond it
    429."""


def check_tenant_names(tenants: dict[str, TenantConfig], providers: set[str]) -> None:
    """Tenant names are safe tokens; every provider a tenant names is configured, and the
    tenant has its own ``api_key`` there."""
    for name, tenant in tenants.items():
        if not _NAME.match(name):
            raise ValueError(f"tenants.{name[:64]}: a name must match [A-Za-z0-9_-]{{1,64}}")
        if name == DEFAULT_TENANT:
            raise ValueError("tenants.default: 'default' is the providers' own account, reserved")
        for provider, account in tenant.providers.items():
            if provider not in providers:
                raise ValueError(f"tenants.{name}.providers.{provider}: no such provider")
            if account.api_key is None or not account.api_key.get_secret_value():
                raise ValueError(
                    f"tenants.{name}.providers.{provider}.api_key: required: a tenant's "
                    "account fetches and polls with its own key (the provider's key would "
                    "reach the default tenant's results)"
                )


def check_distinct_tokens(raw: Any) -> None:
    """Each bearer token is configured once, in ``admin_tokens`` or in ``consumer_tokens``.

    A token listed twice would have two identities (an admin and a consumer, or a consumer
    limited to a tenant and one that is not) and only one of them could win. The error
    names both keys, never the token. Runs on the raw config, so the keys are the file's
    own (before entries left empty are dropped)."""
    if not isinstance(raw, dict):
        return
    places: list[tuple[str, Any]] = []
    admin = raw.get("admin_tokens")
    if isinstance(admin, list):
        places += [(f"admin_tokens.{i}", token) for i, token in enumerate(admin)]
    consumers = raw.get("consumer_tokens")
    if isinstance(consumers, list):
        for i, consumer in enumerate(consumers):
            token = consumer.get("token") if isinstance(consumer, dict) else None
            places.append((f"consumer_tokens.{i}.token", getattr(consumer, "token", token)))
    seen: dict[str, str] = {}
    for key, token in places:
        text = token.get_secret_value() if isinstance(token, SecretStr) else token
        if not isinstance(text, str) or not text:
            continue
        if text in seen:
            raise ValueError(
                f"{key}: the same token as {seen[text]} (a token has one identity: "
                "give each entry its own token)"
            )
        seen[text] = key
