"""Tenants: teams with their own provider accounts, each behind signed endpoints.

A tenant's callbacks come to ``POST /webhooks/t/{token}``: an itsdangerous
``URLSafeSerializer`` payload ``{"t": tenant, "p": provider}`` with its own salt
(:data:`TOKEN_SALT`), signed by the first of ``tenant_keys`` and verified by any. A token
that does not verify, or names no configured tenant and provider, answers 404 before
anything touches Redis. Accounts and key scoping are :mod:`receiver.config.accounts`.

See docs/tenants.md (the endpoint token, rotating its keys).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from itsdangerous import BadData, URLSafeSerializer

from nopoll.envelope import DEFAULT_TENANT
from nopoll.exceptions import ConfigError
from receiver.config.accounts import tenant_problem, tenant_providers
from receiver.config.settings import Settings
from receiver.webhooks.verify import Verifier

__all__ = [
    "TENANT_PREFIX",
    "TOKEN_SALT",
    "TenantEndpoint",
    "TenantEndpoints",
    "TokenReader",
    "endpoint_path",
    "endpoint_token",
    "read_token",
]

TOKEN_SALT = "nopoll.tenant-endpoint.v1"
"""Separates endpoint tokens from anything else the same keys could sign."""
TENANT_PREFIX = "/webhooks/t/"
_TOKEN = re.compile(r"[A-Za-z0-9_.-]{1,512}")
_KNOWN_TOKENS = 4096
"""Valid tokens remembered by an endpoint (only ever the ones nopoll signed)."""


def _serializer(settings: Settings) -> URLSafeSerializer | None:
    keys = [key.get_secret_value() for key in settings.tenant_keys]
    if not keys:
        return None
    # itsdangerous signs with the last key and verifies with all: ours signs with the first
    return URLSafeSerializer(list(reversed(keys)), salt=TOKEN_SALT)


def endpoint_token(settings: Settings, tenant: str, provider: str) -> str:
    """The token of ``tenant``'s endpoint for ``provider`` (signed by the first key)."""
    if tenant == DEFAULT_TENANT:
        raise ConfigError(f"the default tenant's endpoint is /webhooks/{provider}, no token")
    if provider not in settings.providers:
        known = ", ".join(sorted(settings.providers)) or "none"
        raise ConfigError(f"unknown provider {provider!r} (configured: {known})")
    problem = tenant_problem(settings, tenant, provider)
    if problem is not None:
        raise ConfigError(problem)
    serializer = _serializer(settings)
    if serializer is None:
        raise ConfigError("no tenant_keys are configured: they sign the tenant endpoints")
    token = serializer.dumps({"t": tenant, "p": provider})
    assert isinstance(token, str)
    return token


def endpoint_path(token: str) -> str:
    """The endpoint's path: ``/webhooks/t/{token}``."""
    return f"{TENANT_PREFIX}{token}"


class TokenReader:
    """Reads endpoint tokens with the settings' keys (built once, used per request)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._serializer = _serializer(settings)

    def read(self, token: str) -> tuple[str, str] | None:
        """``(tenant, provider)`` of a genuine token naming a configured tenant's account
        at a configured provider; None for anything else."""
        if self._serializer is None or not _TOKEN.fullmatch(token):
            return None
        try:
            payload = self._serializer.loads(token)
        except (BadData, ValueError, TypeError):
            return None
        if not isinstance(payload, dict) or set(payload) != {"t", "p"}:
            return None
        tenant, provider = payload["t"], payload["p"]
        if not isinstance(tenant, str) or not isinstance(provider, str):
            return None
        if tenant == DEFAULT_TENANT or provider not in self._settings.providers:
            return None
        if tenant_problem(self._settings, tenant, provider) is not None:
            return None
        return tenant, provider


def read_token(settings: Settings, token: str) -> tuple[str, str] | None:
    """``(tenant, provider)`` of a genuine endpoint token, None otherwise (see
    :meth:`TokenReader.read`)."""
    return TokenReader(settings).read(token)


@dataclass(frozen=True, slots=True)
class TenantEndpoint:
    """What ``/webhooks/t/{token}`` is: a tenant's account at a provider, and its secrets'
    verifier (None: no webhook secrets, it takes no callbacks)."""

    tenant: str
    provider: str
    verifier: Verifier | None


class TenantEndpoints:
    """Resolves endpoint tokens for the web app: each genuine token is verified once, then
    remembered (only tokens nopoll signed are, so the memory is bounded by them)."""

    def __init__(self, settings: Settings) -> None:
        self._reader = TokenReader(settings)
        self._verifiers = {
            key: Verifier(config.secret_keys(), config.tolerance_s)
            for key, config in tenant_providers(settings).items()
            if config.webhook_secrets
        }
        self.providers = frozenset(provider for _, provider in self._verifiers)
        """Providers some tenant takes callbacks for."""
        self._known: dict[str, TenantEndpoint] = {}

    def resolve(self, token: str) -> TenantEndpoint | None:
        """The endpoint ``token`` names, or None for a token that is not genuine."""
        known = self._known.get(token)
        if known is not None:
            return known
        found = self._reader.read(token)
        if found is None:
            return None
        endpoint = TenantEndpoint(*found, self._verifiers.get(found))
        if len(self._known) < _KNOWN_TOKENS:
            self._known[token] = endpoint
        return endpoint
