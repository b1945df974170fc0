"""``POST /admin/v1/submit``: ``nopoll submit`` for services that call nopoll over HTTP.

``{"provider", "requests": [create bodies]}`` creates background responses (each body as
one line of a ``nopoll submit`` file), ``{"provider", "batch": [batch-input lines]}`` one
batch (as ``nopoll submit --batch``). The content's hash takes the file's place in the
idempotency keys, so sending the same request again submits nothing new. An optional
``"tenant"`` creates them with that tenant's account (its records and keys are its own).
The answer comes once every create call was answered (at most 10,000 bodies per request).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from receiver.admin._http import account_problem, read_model
from receiver.config.accounts import DEFAULT_TENANT, tenant_provider
from receiver.config.settings import Settings
from receiver.responses import json_answer, json_error

__all__ = ["SUBMIT_OPENAPI", "SubmitRequest", "submit_endpoint"]

MAX_BODY = 64 * 1024 * 1024
MAX_REQUESTS = 10_000


class SubmitRequest(BaseModel):
    """``POST /admin/v1/submit``: create bodies, or the lines of one batch."""

    model_config = ConfigDict(extra="forbid")

    provider: str = Field(description="a provider name from the config")
    requests: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=MAX_REQUESTS,
        description="Responses create bodies (custom_id goes to metadata.custom_id)",
    )
    batch: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=100_000,
        description='OpenAI batch-input lines {"custom_id","method","url","body"}',
    )
    concurrency: int = Field(default=50, ge=1, le=200, description="create calls in flight")
    tenant: str = Field(
        default=DEFAULT_TENANT,
        description="the tenant whose account creates them (from tenants:, or default)",
    )

    @model_validator(mode="after")
    def _one(self) -> SubmitRequest:
        if (self.requests is None) == (self.batch is None):
            raise ValueError("give exactly one of requests and batch")
        if not (self.requests or self.batch):
            raise ValueError("requests or batch: must not be empty")
        return self


def digest_of(items: list[dict[str, Any]], kind: str) -> str:
    """The content's hash: the same bodies (keys in any order) give the same keys."""
    digest = hashlib.sha256(kind.encode())
    for item in items:
        digest.update(orjson.dumps(item, option=orjson.OPT_SORT_KEYS) + b"\n")
    return digest.hexdigest()


def submit_endpoint(settings: Settings, redis: Redis) -> Callable[[Request], Awaitable[Response]]:
    """The route's endpoint (behind the admin API's token check, a route middleware)."""

    async def submit(request: Request) -> Response:
        body = await read_model(request, SubmitRequest)
        if isinstance(body, Response):
            return body
        if (problem := account_problem(settings, body.provider, body.tenant)) is not None:
            return problem
        config = tenant_provider(settings, body.tenant, body.provider)
        if body.requests is not None and config and not config.dialect_info.single_responses:
            return json_error(
                400,
                f"requests: {body.provider} speaks the {config.dialect} dialect, which has "
                "batches only (no single background requests): send the lines as batch",
            )
        try:
            return await _run(settings, redis, body)
        except (RedisError, OSError):
            return json_error(503, "Redis unreachable, retry later")

    return submit


async def _run(settings: Settings, redis: Redis, body: SubmitRequest) -> Response:
    from receiver.providers.budget import account_budget
    from receiver.providers.client import ProviderClient
    from receiver.providers.push import PushTokens
    from receiver.submit.batch import submit_batch
    from receiver.submit.creates import Submitter
    from receiver.webhooks.push import push_target

    config = tenant_provider(settings, body.tenant, body.provider)
    assert config is not None  # checked: a known tenant with an account there
    budget = account_budget(redis, body.provider, body.tenant, config)
    client = ProviderClient(body.provider, config, settings.http, budget=budget)
    push = await push_target(settings, PushTokens(redis), body.provider, body.tenant)
    submitter = Submitter(
        body.provider,
        config,
        client,
        redis,
        concurrency=body.concurrency,
        tenant=body.tenant,
        push=push,
    )
    try:
        if body.batch is not None:
            lines = [(n, orjson.dumps(item)) for n, item in enumerate(body.batch, 1)]
            digest = digest_of(body.batch, "batch")
            batch = await submit_batch(submitter, lines, digest, "admin-api")
            return json_answer(
                200 if batch.batch_id else 422,
                {
                    "batch_id": batch.batch_id,
                    "rows": batch.rows,
                    "already": batch.already,
                    "rejected": [r.to_dict() for r in batch.rejected],
                },
            )
        assert body.requests is not None
        lines = [(n, orjson.dumps(item)) for n, item in enumerate(body.requests, 1)]
        result = await submitter.submit_lines(lines, digest_of(body.requests, "responses"))
        return json_answer(
            200,
            {
                "submitted": result.submitted,
                "already": result.already,
                "rejected": [r.to_dict() for r in result.rejected],
                "ids": result.ids,
            },
        )
    finally:
        await client.aclose()


_ANSWER = {
    "type": "object",
    "properties": {
        "submitted": {"type": "integer", "description": "bodies created by this request"},
        "already": {"type": "integer", "description": "bodies an earlier request created"},
        "rejected": {"type": "array", "items": {"type": "object"}},
        "ids": {"type": "array", "items": {"type": "string"}},
        "batch_id": {"type": ["string", "null"]},
        "rows": {"type": "integer"},
    },
}
SUBMIT_OPENAPI: dict[str, Any] = {
    "post": {
        "summary": "Submit create bodies (or one batch) and watch every result",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/SubmitRequest"}}
            },
        },
        "responses": {
            "200": {
                "description": "every create call answered; rejected bodies listed",
                "content": {"application/json": {"schema": _ANSWER}},
            },
            "400": {"description": "bad input: the error names the field"},
            "401": {"description": "no valid admin bearer token (the reason is in error)"},
            "404": {"description": "no admin token is configured"},
            "413": {"description": "body too large"},
            "422": {"description": "the batch was not created: rejected lists why"},
            "503": {"description": "Redis unreachable"},
        },
    }
}
