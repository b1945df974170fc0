"""Tenants' provider accounts: which account a tenant's work uses, and the name its Redis
keys and job ids go by.

:func:`tenant_provider` gives a tenant's account: its own ``api_key`` (required),
``webhook_secrets`` and ``rate_limit_rps`` over the provider's ``dialect``, ``base_url``
and settings. :func:`scoped` names everything keyed by provider in Redis (dedupe, job
ids, batch progress, watches, submit records, idempotency keys): the provider for the
default tenant, ``provider@tenant`` (which no provider name can be) for the others.

See docs/tenants.md (what the tenant changes).
"""

from __future__ import annotations

from typing import Any

from nopoll.envelope import DEFAULT_TENANT
from receiver.config.settings import ProviderConfig, Settings

__all__ = ["DEFAULT_TENANT", "scoped", "tenant_problem", "tenant_provider", "tenant_providers"]


def scoped(provider: str, tenant: str) -> str:
    """The name a provider's Redis keys and job ids use for ``tenant``: the provider's own
    for the default tenant, ``provider@tenant`` for the others."""
    return provider if tenant == DEFAULT_TENANT else f"{provider}@{tenant}"


def tenant_provider(settings: Settings, tenant: str, provider: str) -> ProviderConfig | None:
    """``provider``'s config as ``tenant`` uses it (its own ``api_key``, and
    ``webhook_secrets`` and ``rate_limit_rps`` where given); None when the tenant or
    provider is unknown, or the tenant has no account at that provider."""
    config = settings.providers.get(provider)
    if config is None or tenant == DEFAULT_TENANT:
        return config
    team = settings.tenants.get(tenant)
    account = team.providers.get(provider) if team is not None else None
    if account is None:
        return None
    update: dict[str, Any] = {}
    if account.api_key is not None:
        update["api_key"] = account.api_key
    if account.webhook_secrets:
        update["webhook_secrets"] = list(account.webhook_secrets)
    if "rate_limit_rps" in account.model_fields_set:
        update["rate_limit_rps"] = account.rate_limit_rps
    return config.model_copy(update=update)


def tenant_providers(settings: Settings) -> dict[tuple[str, str], ProviderConfig]:
    """Every ``(tenant, provider)`` account of the non-default tenants, resolved."""
    found = {}
    for tenant, team in settings.tenants.items():
        for provider in team.providers:
            config = tenant_provider(settings, tenant, provider)
            if config is not None:
                found[(tenant, provider)] = config
    return found


def tenant_problem(settings: Settings, tenant: str, provider: str) -> str | None:
    """Why ``tenant`` cannot use ``provider`` (unknown tenant, no account there), or None."""
    if tenant == DEFAULT_TENANT:
        return None
    if tenant not in settings.tenants:
        known = ", ".join(sorted(settings.tenants)) or "none"
        return f"unknown tenant {tenant!r} (configured: default, {known})"
    if provider not in settings.tenants[tenant].providers:
        return f"tenant {tenant!r} has no account at provider {provider!r}"
    return None
