"""How the provider simulator speaks each dialect's API: a :class:`SimProfile` per dialect,
named by its row of :data:`~receiver.config.dialects.DIALECTS` (``simulator``), from which
:data:`PROFILES` is built.

The simulator's routes, :class:`~receiver.demo.batches.SimBatch` and the create side read
these facts instead of naming dialects. Each fact is the provider's published contract
(sference's ``contract/openapi.json``, Sail's and Valar's OpenAPI references, Valar's
limits page: ``tests/contracts`` names the files and commits), or, where a fact is nopoll's
own (where a request's body goes in an item of ``requests``), read from the provider's
class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from receiver.config.dialects import DIALECTS
from receiver.demo.errors import ErrorBody, litestar_error, openai_error
from receiver.demo.responses import openai_shape, responses_object_shape, sference_shape
from receiver.providers.sail import SailDialect
from receiver.providers.sference import SferenceDialect
from receiver.providers.valar import ValarDialect

__all__ = ["ANTHROPIC", "OPENAI", "PROFILES", "SAIL", "SFERENCE", "VALAR", "SimProfile"]

_RESPONSES_ID = r"[a-z0-9][a-z0-9_-]{0,63}"
"""Sail's and Valar's ``custom_id``: ``^[a-z0-9][a-z0-9_-]*$``, 1 to 64 characters."""
_LABEL = r"[a-zA-Z0-9_-]{1,128}"
"""Sail's and Valar's ``label``: ``^[a-zA-Z0-9_-]+$``, at most 128 characters."""


@dataclass(frozen=True, slots=True)
class SimProfile:
    """How the simulator serves one dialect's objects, and how it takes their creation."""

    # --- how its batches are served -------------------------------------------------------
    output_files: bool = False
    """OpenAI's Batch object (``endpoint``, ``input_file_id``, ``completion_window``, no
    ``cancelled`` count) naming an output and an error file, served at
    ``GET /v1/files/{id}/content``."""
    results_file: str | None = None
    """The rows are this JSONL file, ``GET /v1/batches/{id}/{results_file}``; the batch
    object is sference's ``BatchResponse`` (``request_count``, token totals, ISO times)."""
    request_status: bool = False
    """The batch object is the reference's ``{id, request_counts, created_at, label?,
    request_status}``: an integer total, no ``status``, no ``results``; each row is served
    at ``GET /v1/batches/{id}/{custom_id}`` as a Responses object."""
    guide_shape: bool = False
    """A batch may also take the older shape of Sail's requests-at-scale guide
    (``shape="guide"``): a top-level ``status``, a ``request_counts`` object, inline
    ``results`` (or ``results: null`` and an ``error``)."""
    message_batches: bool = False
    """Served as Anthropic Message Batches (:mod:`receiver.demo.anthropic`), not as a
    :class:`~receiver.demo.batches.SimBatch`."""
    batch_statuses: tuple[str, ...] = ()
    """The batch object's ``status`` before it ends: one for the whole wait, or two (no row
    has ended yet; some have). Empty: the object has no ``status``."""
    created_batch_status: str | None = None
    """The status of a batch it created, while it runs (None: as :attr:`batch_statuses`)."""
    batch_list: Literal["items", "array"] | None = None
    """``GET /v1/batches``: ``{"items": [...]}`` of every batch, or a bare array paged by
    ``after_id``/``before_id``/``limit`` (1-200, default 25); None: not served."""
    cancel: bool = False
    """``POST /v1/batches/{id}/cancel`` ends a batch ``cancelled``, its unfinished rows too."""
    # --- how its batches are created -----------------------------------------------------
    created_from: Literal["file", "requests"] | None = "requests"
    """``POST /v1/batches`` creates it from an uploaded file (``input_file_id``) or from its
    ``requests``; None: not created there (Message Batches have routes of their own)."""
    request_part: str | None = None
    """Where a request's body is in an item of ``requests``: ``body``, a whole body (chat
    ``messages`` or an ``input``, one model for the batch, ``custom_id`` optional, the window
    the batch's ``window``); ``params``, Responses params (the window in each row's
    ``params.metadata``)."""
    windows: tuple[str, ...] = ()
    """The completion windows its batch create takes (the batch's ``window``, or each row's
    ``params.metadata.completion_window``; the first is the default)."""
    batch_keys: tuple[str, ...] | None = None
    """The only keys a batch create body may have (``additionalProperties: false``); None:
    unknown keys are ignored."""
    item_keys: tuple[str, ...] | None = None
    """The only keys an item of its ``requests`` may have; None: unknown keys are ignored."""
    custom_id_pattern: str | None = None
    """A batch row's ``custom_id`` must match this (whole); None: any non-empty string."""
    label_pattern: str | None = None
    """A batch's optional ``label`` must match this (whole); None: no label."""
    batch_create_status: int = 200
    """The status of a created batch's answer."""
    # --- single responses ----------------------------------------------------------------
    ids: Literal["prefixed", "uuid"] = "prefixed"
    """Ids of what it creates: ``resp_…``/``batch_…``, or UUIDv7."""
    shape_response: Callable[[dict[str, Any], str | None], dict[str, Any]] = openai_shape
    """A Responses object (as :func:`~receiver.demo.responses.make_response` builds it) in
    this API's own shape; the second argument is the status it is served with while it is not
    finished (None: finished)."""
    response_statuses: tuple[str, str, str] = ("queued", "in_progress", "in_progress")
    """A response's status when created, in the first half of its wait, in the second."""
    response_create_status: int = 200
    """The status of a background create's answer."""
    response_windows: tuple[str, ...] | None = None
    """The ``metadata.completion_window`` values a response create takes (None: any)."""
    metadata_keys: int | None = None
    """A create's ``metadata`` has at most this many keys (None: no limit)."""
    string_metadata: bool = True
    """``metadata`` values must be strings."""
    custom_id_param: bool = True
    """A top-level ``custom_id`` on a response create is refused as an unknown parameter."""
    param_values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Create parameters that take only these values (an ``enum`` of the reference)."""
    streams: bool = False
    """``GET /v1/responses?stream_id=&limit=`` lists responses; ``POST /v1/streams`` and
    ``GET /v1/streams[/{id}]`` serve streams counting the responses created in them."""
    # --- every answer ----------------------------------------------------------------------
    error_body: ErrorBody = openai_error
    """Its error answers' body."""
    idempotency_conflict: tuple[int, str | None] = (422, None)
    """(status, error type) of a create reusing an ``Idempotency-Key`` with another body."""
    idempotency: bool = True
    """A create repeating an answered ``Idempotency-Key`` replays that answer; False (the
    provider documents no idempotency): every create is made anew, the key ignored."""
    rate_limit_per_min: int | None = None
    """Its documented request rate per API key, the default of ``nopoll simulate`` (None: no
    limit); the simulator itself limits only when told (``rate_limit_per_min=``)."""


_RESPONSES_API = SimProfile(
    request_status=True,
    batch_list="array",
    windows=("standard", "flex"),
    batch_keys=("endpoint", "requests", "label"),
    item_keys=("custom_id", "params"),
    custom_id_pattern=_RESPONSES_ID,
    label_pattern=_LABEL,
    shape_response=responses_object_shape,
    response_statuses=("pending", "pending", "running"),
    response_create_status=202,
    custom_id_param=False,
    idempotency_conflict=(400, "idempotency_error"),
)
"""What Sail's and Valar's references share (Valar's is Sail's, renamed)."""

OPENAI = SimProfile(
    output_files=True,
    batch_statuses=("finalizing",),
    created_batch_status="in_progress",
    created_from="file",
    windows=("24h",),
    metadata_keys=16,
)
SFERENCE = SimProfile(
    results_file="results.jsonl",
    batch_statuses=("pending", "running"),
    batch_list="items",
    cancel=True,
    request_part=SferenceDialect.request_part,
    windows=("24h",),
    batch_create_status=201,
    ids="uuid",
    shape_response=sference_shape,
    response_statuses=("in_progress", "in_progress", "in_progress"),
    response_windows=("24h",),
    string_metadata=False,
    custom_id_param=False,
    streams=True,
    error_body=litestar_error,
    idempotency_conflict=(400, None),
    idempotency=False,
)
SAIL = replace(
    _RESPONSES_API,
    guide_shape=True,
    request_part=SailDialect.request_part,
    response_windows=("asap", "priority", "standard", "balanced", "flex"),
    param_values={"truncation": ("disabled",)},
)
VALAR = replace(
    _RESPONSES_API,
    request_part=ValarDialect.request_part,
    response_windows=("asap", "standard", "flex"),
    param_values={"store": (True,), "stream": (False,), "truncation": ("disabled",)},
    rate_limit_per_min=60,
)
ANTHROPIC = SimProfile(message_batches=True, created_from=None)


def _profile(ref: str) -> SimProfile:
    """The profile a dialect's row names (``"module:name"``)."""
    module, _, name = ref.partition(":")
    profile = getattr(importlib.import_module(module), name)
    assert isinstance(profile, SimProfile), ref
    return profile


PROFILES: dict[str, SimProfile] = {name: _profile(d.simulator) for name, d in DIALECTS.items()}
"""Every dialect's profile, by dialect name."""
