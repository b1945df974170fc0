"""How the provider simulator serves and creates each dialect's batches: one row per dialect
of :data:`~receiver.config.dialects.DIALECTS` (a test holds the two tables to the same
names, so a new dialect fails loudly until the simulator learns it).

The simulator's routes and :class:`~receiver.demo.batches.SimBatch` read these facts instead
of naming dialects; where a fact is the provider's own (where a request's body goes in an
item of ``requests``), it is read from the provider's class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from receiver.providers.sail import SailDialect
from receiver.providers.sference import SferenceDialect
from receiver.providers.valar import ValarDialect

__all__ = ["PROFILES", "SimProfile"]


@dataclass(frozen=True, slots=True)
class SimProfile:
    """How the simulator serves one dialect's batches, and how it takes their creation."""

    output_files: bool = False
    """OpenAI's Batch object (``endpoint``, ``input_file_id``, ``completion_window``, no
    ``cancelled`` count) naming an output and an error file, served at
    ``GET /v1/files/{id}/content``."""
    results_file: str | None = None
    """The rows are this JSONL file, ``GET /v1/batches/{id}/{results_file}``."""
    inline_results: bool = False
    """The rows are inline in the batch object's ``results`` (``inline=False``: ``results:
    null``, then per-row GETs); a pending object has every result field null."""
    request_status: bool = False
    """The batch object has a ``request_status`` map, each completed row served at
    ``GET /v1/batches/{id}/{custom_id}``."""
    message_batches: bool = False
    """Served as Anthropic Message Batches (:mod:`receiver.demo.anthropic`), not as a
    :class:`~receiver.demo.batches.SimBatch`."""
    created_from: Literal["file", "requests"] | None = "requests"
    """``POST /v1/batches`` creates it from an uploaded file (``input_file_id``) or from its
    ``requests``; None: not created there (Message Batches have routes of their own)."""
    request_part: str | None = None
    """Where a request's body is in an item of ``requests``: ``body``, a whole body (chat
    ``messages`` or an ``input``, one model for the batch, ``custom_id`` optional, the window
    the batch's ``window``); ``params``, Responses params (the window in each row's
    ``params.metadata``)."""
    window: str | None = None
    """The one completion window its create takes."""


PROFILES: dict[str, SimProfile] = {
    "openai": SimProfile(output_files=True, created_from="file", window="24h"),
    "sference": SimProfile(
        results_file="results.jsonl", request_part=SferenceDialect.request_part, window="24h"
    ),
    "sail": SimProfile(
        inline_results=True,
        request_status=True,
        request_part=SailDialect.request_part,
        window="flex",
    ),
    "valar": SimProfile(
        request_status=True, request_part=ValarDialect.request_part, window="standard"
    ),
    "anthropic": SimProfile(message_batches=True, created_from=None),
}
