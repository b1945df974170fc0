"""The one OpenAPI document of nopoll's HTTP APIs, served publicly at ``GET /openapi.json``:
the results API (``/v1``, consumer tokens) next to the admin API (``/admin/v1``, admin
tokens; :data:`receiver.admin.routes.OPENAPI`). It describes routes, never a secret."""

from __future__ import annotations

import copy
from typing import Any

from nopoll.envelope import COLUMNS, SCHEMA
from nopoll.kinds import kind_names
from receiver.admin.routes import OPENAPI as ADMIN_OPENAPI
from receiver.responses import ERROR_RESPONSE

__all__ = ["openapi_document"]

_TYPES = {
    "text": {"type": "string"},
    "integer": {"type": "integer"},
    "boolean": {"type": "boolean"},
    "json": {"type": "object"},
    "timestamp": {"type": "string", "format": "date-time"},
}


def _envelope_schema() -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for column in COLUMNS:
        schema: dict[str, Any] = dict(_TYPES[column.type])
        if column.nullable:
            schema["type"] = [schema["type"], "null"]
        properties[column.name] = schema
    properties["kind"]["enum"] = list(kind_names())
    return {
        "title": "Envelope",
        "description": f"one result ({SCHEMA}); see docs/envelope.md",
        "type": "object",
        "properties": properties,
        "required": [c.name for c in COLUMNS if not c.nullable],
    }


_ERROR = ERROR_RESPONSE
_AUTH = {
    "401": {**_ERROR, "description": "no bearer token, or not a consumer token"},
    "404": {**_ERROR, "description": "no consumer token is configured (every /v1 route)"},
}


def _query(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema or {"type": "string"},
    }


_TENANT = "the tenant (default `default`); a token limited to a tenant sees only that one"
_FILTER = "only entries with this value (repeat it, or separate values with commas)"

_V1_PATHS: dict[str, Any] = {
    "/v1/results/{provider}/{key}": {
        "get": {
            "summary": "The latest envelope of one result; with ?wait, wait for it to land",
            "security": [{"consumer": []}],
            "parameters": [
                {"name": "provider", "in": "path", "required": True, "schema": {"type": "string"}},
                {
                    "name": "key",
                    "in": "path",
                    "required": True,
                    "description": "the rest of the path: a response id, a batch id, or "
                    "`{batch_id}/{custom_id}` for a batch row",
                    "schema": {"type": "string"},
                },
                _query(
                    "wait",
                    "seconds to hold the request until the result lands (at most "
                    "results.max_wait_s); then 404 if it did not",
                    {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                ),
                _query("tenant", _TENANT),
            ],
            "responses": {
                "200": {
                    "description": "the envelope",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Envelope"}}
                    },
                },
                "400": {**_ERROR, "description": "a bad parameter (named in `error`)"},
                "404": {
                    **_ERROR,
                    "description": "`not landed` (also: another tenant's result, or no "
                    "consumer token configured)",
                },
                "401": _AUTH["401"],
                "503": {**_ERROR, "description": "Redis unreachable, retry later"},
            },
        }
    },
    "/v1/results/stream": {
        "get": {
            "summary": "Server-Sent Events of every envelope that lands, resumable",
            "description": "Each `event: result` has `id` = the stream entry id and `data` = "
            "the envelope JSON. Send `Last-Event-ID` (or `?last_event_id=`) to resume "
            "strictly after that entry; without it the stream starts with new entries. "
            "When entries after it were trimmed, an `event: reset` comes first (data: "
            "`reason`, `last_event_id`, `resume_after`, `oldest_retained_id`). Comments "
            "(`: ping`) keep the connection alive.",
            "security": [{"consumer": []}],
            "parameters": [
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                },
                _query("last_event_id", "as the Last-Event-ID header (the header wins)"),
                _query("tenant", f"{_FILTER}; a tenant-limited token gets its tenant only"),
                _query("provider", _FILTER),
                _query("kind", f"{_FILTER}: {', '.join(kind_names())}"),
                _query("status", f"{_FILTER}: completed, incomplete, failed, cancelled, expired"),
            ],
            "responses": {
                "200": {
                    "description": "the event stream",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                "400": {**_ERROR, "description": "a bad parameter (named in `error`)"},
                "403": {**_ERROR, "description": "tenant: the token is limited to another one"},
                "401": _AUTH["401"],
                "404": _AUTH["404"],
                "503": {**_ERROR, "description": "Redis unreachable, retry later"},
            },
        }
    },
    "/openapi.json": {
        "get": {
            "summary": "This document (no token needed)",
            "security": [],
            "responses": {"200": {"description": "OpenAPI 3.1"}},
        }
    },
}


def openapi_document(max_wait_s: float = 60.0) -> dict[str, Any]:
    """The merged document: /v1 (security scheme ``consumer``) and /admin/v1 (``bearer``);
    ``max_wait_s`` is ``results.max_wait_s``, the largest ``?wait``."""
    doc = copy.deepcopy(ADMIN_OPENAPI)
    doc["info"] = {
        "title": "nopoll API",
        "version": "1",
        "description": "/v1: the results API (bearer tokens from consumer_tokens); "
        "/admin/v1: the admin API (bearer tokens from admin_tokens).",
    }
    schemes = doc["components"]["securitySchemes"]
    schemes["bearer"]["description"] = "a token from admin_tokens (/admin/v1)"
    schemes["consumer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "a token from consumer_tokens (/v1)",
    }
    doc["components"]["schemas"]["Envelope"] = _envelope_schema()
    paths = copy.deepcopy(_V1_PATHS)
    for parameter in paths["/v1/results/{provider}/{key}"]["get"]["parameters"]:
        if parameter["name"] == "wait":
            parameter["schema"]["maximum"] = max_wait_s
    doc["paths"] = {**paths, **doc["paths"]}
    return doc
