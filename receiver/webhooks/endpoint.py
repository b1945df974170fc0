"""The webhook endpoint: ``POST /webhooks/{provider}`` (and a tenant's ``/webhooks/t/{token}``).

A callback gets a 2xx only once its job is durably in Redis; anything else tells the
provider to retry, every 4xx body says why, and nothing a client sends makes a 500.
Reading the request is :mod:`receiver.webhooks.wire`. :class:`WebhookEndpoint` is a plain
ASGI endpoint in front of the Starlette app (no Request object, routing or middleware:
about a third of the server's CPU per callback).

See docs/http.md (the status codes) and docs/security.md.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nopoll.exceptions import VerificationError
from nopoll.kinds import KINDS
from receiver.config.accounts import DEFAULT_TENANT, scoped
from receiver.config.settings import Settings
from receiver.logs import Throttle
from receiver.metrics import Metrics
from receiver.providers import dialect_type
from receiver.providers.base import BadCallback, Callback, standard_callback
from receiver.providers.push import PushTokens
from receiver.queue.enqueue import (
    CallbackJob,
    EnqueueOutcome,
    Enqueuer,
    NotReplicated,
    QueueBusy,
)
from receiver.queue.jobs import fetch_payload
from receiver.redis.link import RedisLink
from receiver.tracing import enabled as tracing_enabled
from receiver.tracing import span, traceparent
from receiver.webhooks.limits import WebhookLimits, client_address
from receiver.webhooks.push import PUSH_ID_PREFIX, bearer_token, push_callback, takes_pushes
from receiver.webhooks.tenants import TENANT_PREFIX, TenantEndpoint, TenantEndpoints
from receiver.webhooks.verify import Verifier
from receiver.webhooks.wire import (
    ReadDeadlines,
    Reply,
    Then,
    answer_and_close,
    callback_headers,
    read_body,
)

__all__ = ["BATCH_EVENTS", "RESPONSE_EVENTS", "WebhookDispatch", "WebhookEndpoint"]

log = logging.getLogger("nopoll.app")

RESPONSE_EVENTS = KINDS["response"].callback_events
BATCH_EVENTS = KINDS["batch"].callback_events
_WEBHOOK_ID = re.compile(r"[\x21-\x7e]{1,256}")
_PREFIX = "/webhooks/"
_CONTENT_TYPE = (b"content-type", b"application/json")


class WebhookEndpoint:
    """ASGI endpoint for ``POST /webhooks/{provider}``: verify, parse, enqueue, answer.
    :meth:`tenant` serves a tenant's ``POST /webhooks/t/{token}`` the same way."""

    def __init__(
        self, settings: Settings, enqueuer: Enqueuer, metrics: Metrics, push_tokens: PushTokens
    ) -> None:
        self._verifiers = {
            name: Verifier(cfg.secret_keys(), cfg.tolerance_s)
            for name, cfg in settings.providers.items()
            if cfg.webhook_secrets
        }
        # How each provider's callbacks read: its dialect's (the dialects' modules imported now)
        self._parsers = {
            name: dialect_type(cfg.dialect).parse_callback
            for name, cfg in settings.providers.items()
        }
        # Configured, but sends no callbacks (results come by polling): a clear 404.
        self._no_callbacks = {n for n, cfg in settings.providers.items() if not cfg.webhook_secrets}
        # Pushes completions (a bearer token, not a signature): trusted bodies land as sent
        self._pushes = {
            name: cfg.completion_webhook.trust_body
            for name, cfg in settings.providers.items()
            if takes_pushes(settings, name)
        }
        self._push_tokens = push_tokens
        self._enqueuer = enqueuer
        self._max_body = settings.max_body_bytes
        self._too_large = f"body is larger than {settings.max_body_bytes} bytes"
        self._deadlines = ReadDeadlines(settings.api.body_timeout_s)
        self._callbacks = metrics.callbacks
        self._verify_seconds = metrics.verify_seconds
        self._enqueue_seconds = metrics.enqueue_seconds
        self._tenants = TenantEndpoints(settings)
        self._accepted = {
            p: metrics.callbacks.labels(p, "accepted")
            for p in (*self._verifiers, *self._tenants.providers, *self._pushes)
        }
        self._link = RedisLink("api")
        self._rejections = Throttle(log)
        limits = WebhookLimits(settings.api)
        self._limits = limits if limits.enabled else None
        self._traced = tracing_enabled()

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, endpoint: TenantEndpoint | None = None
    ) -> None:
        if not self._traced:  # tracing off: nothing more on the hot path
            await self._answer(scope, receive, send, endpoint)
            return
        path = scope["path"][:80] if endpoint is None else TENANT_PREFIX + "..."  # no token
        with span("webhook", {"url.path": path}, kind="server") as traced:
            assert traced is not None

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    traced.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self._answer(scope, receive, send_traced, endpoint)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, endpoint: TenantEndpoint | None
    ) -> None:
        if endpoint is None:  # POST /webhooks/{provider}: the hot path, nothing more to do
            provider, tenant = scope["path"][len(_PREFIX) :], DEFAULT_TENANT
            verifier = self._verifiers.get(provider)
        else:
            provider, tenant, verifier = endpoint.provider, endpoint.tenant, endpoint.verifier
        try:
            status, payload = await self._handle(provider, tenant, verifier, scope, receive)
        except Reply as reply:
            label = provider if provider in self._accepted else "unknown"
            self._callbacks.labels(label, reply.outcome).inc()
            if reply.status >= 400:
                where = provider if tenant == DEFAULT_TENANT else f"t/... ({tenant}, {provider})"
                self._log_rejection(label, where, scope, reply)
            if reply.then is not Then.KEEP_ALIVE:
                await answer_and_close(reply, receive, send)
                return
            status, payload = reply.status, reply.payload
        body = orjson.dumps(payload)
        headers = [_CONTENT_TYPE, (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def tenant(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /webhooks/t/{token}``: a token that is not genuine is 404 at once, before
        the body is read or Redis is touched; else as ``/webhooks/{provider}``, with the
        tenant's secrets."""
        try:
            if self._limits is not None:  # before the token costs an HMAC
                self._limits.check_client(client_address(scope))
            endpoint = self._tenants.resolve(scope["path"][len(TENANT_PREFIX) :])
            if endpoint is None:
                raise Reply(404, {"error": "unknown endpoint"}, then=Then.DRAIN_AND_CLOSE)
        except Reply as reply:
            self._callbacks.labels("unknown", reply.outcome).inc()
            self._log_rejection("unknown", "t/...", scope, reply)
            await answer_and_close(reply, receive, send)
            return
        await self(scope, receive, send, endpoint)

    def _log_rejection(self, label: str, where: str, scope: Scope, reply: Reply) -> None:
        """One line per provider and status every 10 s at most, with the reason (a tenant
        endpoint's token is not logged: it is the endpoint's address)."""
        self._rejections.log(
            logging.WARNING,
            (label, reply.status),
            "callback to /webhooks/%s answered %d: %s (from %s)",
            where[:160],
            reply.status,
            reply.payload.get("error") or reply.payload.get("reason"),
            client_address(scope),
        )

    async def _handle(
        self, provider: str, tenant: str, verifier: Verifier | None, scope: Scope, receive: Receive
    ) -> tuple[int, dict[str, Any]]:
        if self._limits is not None:
            if tenant == DEFAULT_TENANT:  # a tenant's address was counted by tenant()
                self._limits.check_client(client_address(scope))
            self._limits.check_provider(provider, tenant)
        if verifier is None:
            if provider in self._pushes:
                return await self._push(provider, tenant, scope, receive)
            if tenant != DEFAULT_TENANT:
                reason = "this endpoint takes no callbacks (no webhook_secrets)"
            elif provider in self._no_callbacks:
                reason = f"provider {provider!r} takes no callbacks (it has no webhook_secrets)"
            else:
                reason = "unknown provider"
            raise Reply(404, {"error": reason}, then=Then.DRAIN_AND_CLOSE)
        headers, declared = callback_headers(scope["headers"])
        body = await read_body(receive, declared, self._max_body, self._too_large, self._deadlines)

        started = time.perf_counter()
        try:
            webhook_id = verifier.verify(headers, body)
        except VerificationError as exc:
            raise Reply(401, {"error": str(exc)}) from None
        finally:
            self._verify_seconds.observe(time.perf_counter() - started)
        if not _WEBHOOK_ID.fullmatch(webhook_id):
            raise Reply(400, {"error": "webhook-id must be 1-256 printable ASCII characters"})

        try:
            event = orjson.loads(body)  # orjson rejects invalid UTF-8
        except orjson.JSONDecodeError:
            raise Reply(400, {"error": "body is not UTF-8 JSON"}) from None
        if not isinstance(event, dict):
            raise Reply(400, {"error": "body must be a JSON object with a string 'type'"})
        try:
            callback = self._parsers.get(provider, standard_callback)(event)
        except BadCallback as exc:
            raise Reply(400, {"error": str(exc)}) from None
        if callback is None:
            reason = f"event type {event.get('type')!r} is not handled"
            log.debug("callback %s to /webhooks/%s ignored: %s", webhook_id, provider, reason)
            raise Reply(202, {"status": "ignored", "reason": reason}, "ignored")
        event_type, object_id = callback.event_type, callback.object_id

        outcome = await self._enqueue(_job(provider, webhook_id, callback, tenant))
        if outcome is EnqueueOutcome.DUPLICATE:
            raise Reply(200, {"status": "duplicate"}, "duplicate")
        self._accepted[provider].inc()
        status = "queued" if outcome is EnqueueOutcome.ENQUEUED else "already_queued"
        if log.isEnabledFor(logging.DEBUG):
            log.debug("callback %s: %s %s %s", webhook_id, event_type, object_id, status)
        return 202, {"status": status, "id": object_id}

    async def _push(
        self, provider: str, tenant: str, scope: Scope, receive: Receive
    ) -> tuple[int, dict[str, Any]]:
        """A completion webhook (:mod:`receiver.webhooks.push`): the account's bearer token,
        then the body under the callbacks' limits, deduped by its response id."""
        token = bearer_token(scope["headers"])
        if token is None:
            error = "a completion webhook needs one Authorization: Bearer <webhook_token> header"
            raise Reply(401, {"error": error}, then=Then.DRAIN_AND_CLOSE)
        _, declared = callback_headers(scope["headers"])
        try:
            genuine = await self._push_tokens.check(scoped(provider, tenant), token)
        except (RedisError, OSError) as exc:
            self._link.lost(exc)
            down = {"error": "queue unavailable, retry later"}
            raise Reply(503, down, "unavailable", then=Then.DRAIN_AND_CLOSE) from None
        if not genuine:
            error = "the bearer token is not the webhook_token nopoll gave this endpoint"
            raise Reply(401, {"error": error}, then=Then.DRAIN_AND_CLOSE)
        body = await read_body(receive, declared, self._max_body, self._too_large, self._deadlines)
        try:
            pushed = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise Reply(400, {"error": "body is not UTF-8 JSON"}) from None
        try:
            callback = push_callback(pushed)
        except BadCallback as exc:
            raise Reply(400, {"error": str(exc)}) from None
        push_id = PUSH_ID_PREFIX + callback.object_id
        trusted = pushed if self._pushes[provider] else None
        outcome = await self._enqueue(_job(provider, push_id, callback, tenant, pushed=trusted))
        if outcome is EnqueueOutcome.DUPLICATE:
            raise Reply(200, {"status": "duplicate"}, "duplicate")
        self._accepted[provider].inc()
        status = "queued" if outcome is EnqueueOutcome.ENQUEUED else "already_queued"
        return 202, {"status": status, "id": callback.object_id}

    async def _enqueue(self, job: CallbackJob) -> EnqueueOutcome:
        """Queue the job durably; Redis down, or a flood already waiting for it, is a 503."""
        started = time.perf_counter()
        try:
            outcome = await self._enqueuer.enqueue(job)
        except NotReplicated as exc:  # in Redis, but not on enough replicas to promise it
            self._link.lost(exc)
            reason = "queued, but not yet on enough Redis replicas: retry later"
            raise Reply(503, {"error": reason}, "unavailable") from None
        except (RedisError, OSError) as exc:
            self._link.lost(exc)  # logged once per outage, not once per callback
            raise Reply(503, {"error": "queue unavailable, retry later"}, "unavailable") from None
        except QueueBusy:  # too many callbacks wait for Redis already: shed, do not queue
            raise Reply(503, {"error": "queue busy, retry later"}, "unavailable") from None
        except Exception:  # a bug of ours must not look like the client's fault, nor lose it
            log.exception("enqueue failed unexpectedly, answering 503")
            raise Reply(503, {"error": "queue unavailable, retry later"}, "unavailable") from None
        self._enqueue_seconds.observe(time.perf_counter() - started)
        if not self._link.up:
            self._link.back()
        return outcome


def _job(
    provider: str,
    webhook_id: str,
    callback: Callback,
    tenant: str = DEFAULT_TENANT,
    *,
    pushed: dict[str, Any] | None = None,
) -> CallbackJob:
    """The fetch job a callback asks for, on its job's queue (a response's on the short
    queue, a batch's on the batch queue). Another tenant's job ids and webhook-ids are its
    own (:func:`scoped`). ``pushed``: a trusted completion webhook's object, landed as it
    came (no GET)."""
    context = traceparent()  # None unless tracing is on: then the job continues this trace
    more = {"pushed": pushed} if pushed is not None else {}
    return fetch_payload(callback.kind.name).callback(
        provider,
        callback.object_id,
        webhook_id,
        tenant=tenant,
        event_type=callback.event_type,
        traceparent=context,
        **more,
    )


class WebhookDispatch:
    """POST /webhooks/<name> and /webhooks/t/<token> go to the endpoint; everything else
    to ``app``: the Starlette app ``starlette``, its bodies bounded as a callback's
    (:class:`receiver.webhooks.wire.BoundedBodies`)."""

    def __init__(self, webhooks: WebhookEndpoint, starlette: Starlette, app: ASGIApp) -> None:
        self.webhooks, self.starlette, self.app = webhooks, starlette, app

    @property
    def routes(self) -> list[Any]:
        """The Starlette routes (the webhook route among them), for introspection."""
        return list(self.starlette.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"].startswith(_PREFIX)
        ):
            if "/" not in scope["path"][len(_PREFIX) :]:
                await self.webhooks(scope, receive, send)
                return
            if scope["path"].startswith(TENANT_PREFIX):
                await self.webhooks.tenant(scope, receive, send)
                return
        await self.app(scope, receive, send)
