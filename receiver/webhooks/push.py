"""Completion webhooks (Sail, Valar): a pushed Response object with a bearer token.

A provider whose dialect pushes completions takes them on the endpoints of signed
callbacks (``/webhooks/{provider}``, a tenant's ``/webhooks/t/{token}``), unless its
``completion_webhook.enabled`` is false. The ``Authorization: Bearer`` token must be the
account's (:class:`~receiver.providers.push.PushTokens`); the body is read under the same
limits as a callback's; the response id is the dedupe key (a push has no webhook-id and
may come more than once). :func:`push_target` is where creates ask for the pushes.

See docs/watches.md (completion webhooks) and docs/http.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nopoll.envelope import DEFAULT_TENANT
from nopoll.kinds import KINDS
from nopoll.status import final_status
from nopoll.wire import safe_id
from receiver.config.accounts import scoped, tenant_provider
from receiver.config.settings import Settings
from receiver.providers.base import BadCallback, Callback
from receiver.providers.push import PushTarget, PushTokens
from receiver.webhooks.tenants import endpoint_path, endpoint_token

__all__ = ["PUSH_ID_PREFIX", "bearer_token", "push_callback", "push_target", "takes_pushes"]

PUSH_ID_PREFIX = "push:"
"""A push's dedupe id is this and its response id (``push:resp_...``)."""
_RESPONSE = KINDS["response"]


def takes_pushes(settings: Settings, provider: str) -> bool:
    """``provider`` is configured, its dialect pushes completions and they are enabled."""
    config = settings.providers.get(provider)
    return (
        config is not None
        and config.dialect_info.completion_webhooks
        and config.completion_webhook.enabled
    )


def bearer_token(raw: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of the one ``Authorization: Bearer <token>`` header; None when there is
    none, it is another scheme, or it is repeated."""
    found: str | None = None
    count = 0
    for name, value in raw:
        if name != b"authorization":
            continue
        count += 1
        scheme, _, token = value.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            found = token.strip()
    return found if count == 1 else None


def push_callback(obj: Any) -> Callback:
    """The fetch a pushed Response object asks for; :class:`BadCallback` (a 400) when the
    body is not one."""
    if not isinstance(obj, dict):
        raise BadCallback("body must be a JSON object (the finished Response object)")
    response_id = obj.get("id")
    if not safe_id(response_id):
        raise BadCallback("id must match [A-Za-z0-9_.:-]{1,256}")
    assert isinstance(response_id, str)
    # the event it stands for: its final status (a push of an unfinished one is fetched
    # again until it is final, as any callback's object is)
    status = final_status(obj.get("status")) or "completed"
    return Callback(f"response.{status}", _RESPONSE, response_id)


async def push_target(
    settings: Settings, tokens: PushTokens, provider: str, tenant: str = DEFAULT_TENANT
) -> PushTarget | None:
    """Where ``tenant``'s account at ``provider`` asks for its completions to be pushed:
    ``public_url`` and the account's endpoint, with its token (made now if it has none);
    None when the provider takes no pushes or ``public_url`` is not set."""
    if not settings.public_url or not takes_pushes(settings, provider):
        return None
    if tenant_provider(settings, tenant, provider) is None:
        return None
    if tenant == DEFAULT_TENANT:
        path = f"/webhooks/{provider}"
    else:
        path = endpoint_path(endpoint_token(settings, tenant, provider))
    token = await tokens.token(scoped(provider, tenant))
    return PushTarget(settings.public_url.rstrip("/") + path, token)
