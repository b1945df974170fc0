"""Batches for the provider simulator, in every dialect's shape, generated row by row.

Rows are computed from their index, never stored, so a 100,000-row, 1 GiB batch costs the
simulator no memory: files and inline ``results`` are streamed as they are written.

A batch that is not finished yet (``pending_times``, ``pending_until``) is part way: its rows
end one after another in output order as its wait goes by, so a batch object in progress
shows some rows ended and the rest running or pending, as providers' objects do; a cancel
(sference) ends the unfinished rows ``cancelled``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from receiver.demo.answers import Oversize, Part
from receiver.demo.profiles import PROFILES, SimProfile
from receiver.demo.responses import make_response

__all__ = ["SimBatch", "cost_micros", "iso"]


def cost_micros(prompt_tokens: int, completion_tokens: int) -> int:
    """What the simulator charges for tokens, in micro-dollars (sference's ``*_cost_micros``):
    2 a prompt token, 8 a completion token."""
    return 2 * prompt_tokens + 8 * completion_tokens


def iso(t: float) -> str:
    """``t`` as sference writes times: ISO-8601 in UTC with its offset."""
    return datetime.fromtimestamp(int(t), tz=UTC).isoformat()


@dataclass
class SimBatch:
    """A batch the simulator serves; what each row is follows from its index."""

    dialect: str
    batch_id: str
    n_rows: int
    status: str = "completed"
    """Its status once ended (a dialect whose objects have a status)."""
    failed_every: int = 0
    """Every k-th row (k > 0) failed."""
    cancelled_every: int = 0
    """Every k-th row was cancelled (request_status dialects)."""
    no_custom_id_every: int = 0
    """Every k-th sference row has no custom_id (its key is then its line index)."""
    body_bytes: int = 0
    """Extra text in each answer, to make rows as large as real ones."""
    shape: str | None = None
    """``"guide"``: Sail's older guide shape (see :attr:`SimProfile.guide_shape`); None:
    the dialect's reference shape."""
    inline: bool = True
    """The guide shape: results inline; False: ``results: null`` and per-row GETs."""
    label: str | None = None
    """Sail's and Valar's ``label`` (absent when None)."""
    shuffled: bool = True
    """Output order differs from input order (matching must go by custom_id)."""
    row_failures: dict[str, int] = field(default_factory=dict)
    """custom_id → how many 500s its per-row GET answers first."""
    row_delay_s: float = 0.0
    pending_times: int = 0
    """Answer the first N ``GET /batches/{id}`` with the batch still running."""
    pending_status: str | None = None
    """Its status while running (None: the dialect's, see :attr:`SimProfile.batch_statuses`)."""
    pending_until: float | None = None
    """Unix time before which ``GET /batches/{id}`` finds it still running."""
    created_at: float = field(default_factory=time.time)
    object_served: int = 0
    custom_ids: dict[int, str | None] = field(default_factory=dict)
    """Row index → its custom_id (None: it has none), instead of ``row-000042``."""
    gzip: bool = False
    """Send every answer of this batch with ``Content-Encoding: gzip``."""
    oversize: Oversize | None = None
    """The row at position ``oversize_at`` of the results file (openai output, sference) or
    of the inline ``results`` (sail's guide shape) is this large; ``endless`` ends the answer
    there."""
    oversize_at: int = 3
    row_oversize: dict[str, Oversize] = field(default_factory=dict)
    """custom_id → how its per-row GET (Sail, Valar) is too large."""
    served: dict[str, int] = field(default_factory=dict)
    input_file_id: str | None = None
    """openai: the uploaded input file (else ``file-in-{batch_id}``)."""
    endpoint: str = "/v1/responses"
    """openai: the batch's endpoint; ``/v1/chat/completions`` answers chat completions."""
    cancelled_at: float | None = field(default=None, init=False)
    _cancelled_from: int | None = field(default=None, init=False, repr=False)
    _ended_at: float | None = field(default=None, init=False, repr=False)
    _order: list[int] | None = field(default=None, init=False, repr=False)
    _position: list[int] | None = field(default=None, init=False, repr=False)
    _by_custom_id: dict[str | None, int] = field(default_factory=dict, init=False, repr=False)
    _indexed: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        profile = self.profile
        if self.shape not in (None, "guide") or (self.shape and not profile.guide_shape):
            raise ValueError(f"{self.dialect} batches have no shape {self.shape!r}")
        if not self._has_status and (self.status != "completed" or self.pending_status):
            raise ValueError(f"{self.dialect} batch objects have no status to set")

    @property
    def profile(self) -> SimProfile:
        """How the simulator serves this batch's dialect."""
        return PROFILES[self.dialect]

    @property
    def guide(self) -> bool:
        return self.shape == "guide"

    @property
    def _has_status(self) -> bool:
        return bool(self.profile.batch_statuses) or self.guide

    # --- rows ---------------------------------------------------------------------------
    def custom_id(self, i: int) -> str | None:
        if i in self.custom_ids:
            return self.custom_ids[i]
        if self.no_custom_id_every and i % self.no_custom_id_every == self.no_custom_id_every - 1:
            return None
        return f"row-{i:06d}"

    def index_of(self, custom_id: str) -> int | None:
        """The row index whose custom_id this is, or None (an index of ``custom_ids``, built
        once, keeps per-row GETs of a 100,000-row created batch fast)."""
        if self._indexed != len(self.custom_ids):
            self._by_custom_id, self._indexed = {}, len(self.custom_ids)
            for i, cid in self.custom_ids.items():
                self._by_custom_id.setdefault(cid, i)
        if custom_id in self._by_custom_id:
            return self._by_custom_id[custom_id]
        if custom_id.startswith("row-") and custom_id[4:].isdigit():
            i = int(custom_id[4:])
            if i < self.n_rows and self.custom_id(i) == custom_id:
                return i
        return None

    def row_status(self, i: int) -> str:
        """Row ``i``'s status once it has ended (as if the batch ran to its end)."""
        if self.failed_every and i % self.failed_every == self.failed_every - 1:
            return "failed"
        if self.cancelled_every and i % self.cancelled_every == self.cancelled_every - 2:
            return "cancelled"
        return "completed"

    def text(self, i: int) -> str:
        pad = ("lorem ipsum " * (self.body_bytes // 12 + 1))[: self.body_bytes]
        return f"answer {i}" + (f" {pad}" if pad else "")

    def response_body(self, i: int) -> dict[str, Any]:
        return make_response(
            f"resp_{self.batch_id}_{i}", text=self.text(i), metadata={"row": str(i)}
        )

    def chat_body(self, i: int) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.batch_id}-{i}",
            "object": "chat.completion",
            "created": 1_790_000_000,
            "model": "sim-chat-1",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": self.text(i)},
                }
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
        }

    def order(self) -> list[int]:
        """Row indexes in output order (computed once)."""
        if self._order is None:
            ids = list(range(self.n_rows))
            missing = self.no_custom_id_every or None in self.custom_ids.values()
            if self.shuffled and not (self.profile.results_file and missing):
                random.Random(self.batch_id).shuffle(ids)  # sference rows without custom_id:
            self._order = ids  # their key is their line index, so they keep input order
        return self._order

    def position(self, i: int) -> int:
        """Row ``i``'s place in output order: rows end in this order."""
        if self._position is None:
            position = [0] * self.n_rows
            for n, index in enumerate(self.order()):
                position[index] = n
            self._position = position
        return self._position[i]

    def counts(self, ended: int | None = None) -> dict[str, int]:
        """Rows per status (``ended``: of the first rows in output order that have ended)."""
        rows = self.order()[: self.ended() if ended is None else ended]
        statuses = [self.final_status(i) for i in rows]
        failed, cancelled = statuses.count("failed"), statuses.count("cancelled")
        return {
            "total": self.n_rows,
            "completed": len(statuses) - failed - cancelled,
            "failed": failed,
            "cancelled": cancelled,
        }

    # --- progress -----------------------------------------------------------------------
    def poll(self) -> float:
        """A ``GET /batches/{id}`` of the batch object: counted, then :meth:`progress`."""
        self.object_served += 1
        return self.progress()

    def progress(self) -> float:
        """How far the batch is, 0 to 1 (1: ended): by the time waited before
        ``pending_until``, or by the GETs of its object so far against ``pending_times``."""
        if self.cancelled_at is not None:
            return 1.0
        now, done = time.time(), 1.0
        if self.pending_until is not None and now < self.pending_until:
            span = self.pending_until - self.created_at
            done = min(max((now - self.created_at) / span, 0.0), 0.99) if span > 0 else 0.0
        elif self.pending_times and self.object_served <= self.pending_times:
            done = max(self.object_served - 1, 0) / self.pending_times
        if done >= 1.0 and self._ended_at is None:
            self._ended_at = min(now, self.pending_until or now)
        return done

    def ended(self) -> int:
        """How many rows have ended (the first ones in output order)."""
        if self._cancelled_from is not None:
            return self.n_rows
        progress = self.progress()
        return self.n_rows if progress >= 1.0 else int(self.n_rows * progress)

    def cancel(self) -> None:
        """End the batch now: the rows that have not ended are cancelled (sference)."""
        if self.cancelled_at is None and self.progress() < 1.0:
            self._cancelled_from = self.ended()
            self.cancelled_at = self._ended_at = time.time()
            self.status = "cancelled"

    def final_status(self, i: int) -> str:
        """Row ``i``'s status once ended, a cancel included."""
        if self._cancelled_from is not None and self.position(i) >= self._cancelled_from:
            return "cancelled"
        return self.row_status(i)

    def row_state(self, i: int, ended: int) -> str:
        """Row ``i``'s status when ``ended`` rows have: its own once it has ended, else
        ``running`` for the next tenth of the batch and ``pending`` after."""
        position = self.position(i)
        if position < ended:
            return self.final_status(i)
        return "running" if position < ended + max(1, self.n_rows // 10) else "pending"

    def batch_status(self, progress: float, ended: int) -> str:
        """The batch object's status (dialects whose object has one)."""
        if progress >= 1.0:
            return self.status
        if self.pending_status is not None:
            return self.pending_status
        if self.guide:
            return "in_progress"
        statuses = self.profile.batch_statuses
        return statuses[0] if ended == 0 or len(statuses) == 1 else statuses[1]

    # --- dialect shapes -----------------------------------------------------------------
    def batch_object(self, progress: float | None = None) -> dict[str, Any]:
        """``GET /batches/{id}`` as JSON (for the guide shape, without its ``results``)."""
        progress = self.progress() if progress is None else progress
        ended = self.ended()
        profile = self.profile
        if profile.results_file:
            return self._sference_object(progress, ended)
        if profile.request_status:
            return self._responses_api_object(progress, ended)
        return self._openai_object(progress)

    def created_object(self) -> dict[str, Any]:
        """The answer of the ``POST /batches`` that created it."""
        if self.profile.request_status and not self.guide:
            return self.summary()
        return self.batch_object(0.0)

    def summary(self) -> dict[str, Any]:
        """Sail's and Valar's batch summary (their create answer and list items)."""
        obj: dict[str, Any] = {
            "id": self.batch_id,
            "request_counts": self.n_rows,
            "created_at": int(self.created_at),
        }
        if self.label is not None:
            obj["label"] = self.label
        return obj

    def _openai_object(self, progress: float) -> dict[str, Any]:
        pending = progress < 1.0
        counts = self.counts(self.n_rows)
        obj: dict[str, Any] = {
            "id": self.batch_id,
            "object": "batch",
            "status": self.batch_status(progress, 0),
            "created_at": int(self.created_at),
            "request_counts": {k: counts[k] for k in ("total", "completed", "failed")},
            "metadata": {"label": "sim"},
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id or f"file-in-{self.batch_id}",
            "completion_window": "24h",
            "output_file_id": None if pending else f"file-out-{self.batch_id}",
            "error_file_id": None,
        }
        if not pending and any(self.row_status(i) != "completed" for i in range(self.n_rows)):
            obj["error_file_id"] = f"file-err-{self.batch_id}"
        return obj

    def _sference_object(self, progress: float, ended: int) -> dict[str, Any]:
        completed = self.counts(ended)["completed"]
        prompt, completion = 11 * completed, 3 * completed  # each row's chat_body usage
        done = progress >= 1.0
        ended_at = self._ended_at if done and self._ended_at is not None else None
        return {
            "id": self.batch_id,
            "status": self.batch_status(progress, ended),
            "window": "24h",
            "request_count": self.n_rows,
            "created_at": iso(self.created_at),
            "updated_at": iso(ended_at if ended_at is not None else time.time()),
            "completed_at": iso(ended_at) if ended_at is not None else None,
            "total_prompt_tokens": prompt,
            "total_completion_tokens": completion,
            "total_tokens": prompt + completion,
            "total_cost_micros": cost_micros(prompt, completion),
        }

    def _responses_api_object(self, progress: float, ended: int) -> dict[str, Any]:
        obj = self.summary()
        guide = self.guide
        if guide:
            counts = self.counts(ended)
            obj["status"] = self.batch_status(progress, ended)
            obj["request_counts"] = {k: counts[k] for k in ("total", "completed", "failed")}
        statuses: dict[str | None, dict[str, str]] = {}
        for i in range(self.n_rows):
            state = self.row_state(i, ended)
            if guide and state == "pending":
                continue  # the guide: the list "may be incomplete while the batch is running"
            statuses[self.custom_id(i)] = {"status": state.upper()}
        obj["request_status"] = statuses
        return obj

    def _row_parts(self, n: int, obj: dict[str, Any], end: bytes) -> list[Part]:
        """The ``n``-th row of a results answer as parts (``oversize`` at ``oversize_at``)."""
        if self.oversize is not None and n == self.oversize_at:
            return self.oversize.parts(obj, end)
        return [orjson.dumps(obj) + end]

    def _ends_here(self, n: int) -> bool:
        return (
            self.oversize is not None and self.oversize.kind == "endless" and n == self.oversize_at
        )

    @property
    def gzipped_results(self) -> bool:
        """Whether results answers are gzip-encoded (``gzip``, or an oversized gzip bomb)."""
        return self.gzip or (self.oversize is not None and self.oversize.kind == "gzip_bomb")

    def openai_lines(self, errors: bool) -> Iterator[Part]:
        n = 0
        for i in self.order():
            failed = self.row_status(i) != "completed"
            if failed != errors:
                continue
            line: dict[str, Any] = {"id": f"batch_req_{i}", "custom_id": self.custom_id(i)}
            if failed:
                line["response"] = {
                    "status_code": 500,
                    "request_id": f"req_{i}",
                    "body": {"error": {"code": "server_error", "message": "boom"}},
                }
                line["error"] = None
            else:
                chat = self.endpoint == "/v1/chat/completions"  # the endpoint's own object
                line["response"] = {
                    "status_code": 200,
                    "request_id": f"req_{i}",
                    "body": self.chat_body(i) if chat else self.response_body(i),
                }
                line["error"] = None
            yield from self._row_parts(-1 if errors else n, line, b"\n")
            if not errors and self._ends_here(n):
                return
            n += 1

    def sference_lines(self) -> Iterator[Part]:
        """``results.jsonl``: a line per row that has ended."""
        for n, i in enumerate(self.order()[: self.ended()]):
            status = self.final_status(i)
            row: dict[str, Any] = {"status": status}
            cid = self.custom_id(i)
            if cid is not None:
                row["custom_id"] = cid
            if status == "completed":
                row["result_json"] = self.chat_body(i)
                row["error_json"] = None
            else:
                row["result_json"] = None
                row["error_json"] = {"code": f"row_{status}", "message": f"row {i} {status}"}
            yield from self._row_parts(n, row, b"\n")
            if self._ends_here(n):
                return

    def guide_document(self, progress: float) -> Iterator[Part]:
        """The guide shape's batch object, its inline ``results`` streamed row by row."""
        obj = self.batch_object(progress)
        if progress < 1.0 or not self.inline:
            obj["results"] = None
            if progress >= 1.0:
                obj["error"] = {"message": "results too large to inline; fetch them per custom_id"}
            yield orjson.dumps(obj)
            return
        head = orjson.dumps(obj)[:-1]  # without the closing brace
        yield head + b',"results":['
        for n, i in enumerate(self.order()):
            entry: dict[str, Any] = {"custom_id": self.custom_id(i)}
            if self.row_status(i) == "completed":
                entry["response"] = {"body": self.row_body(i, "completed")}
                entry["error"] = None
            else:
                entry["response"] = None
                entry["error"] = {"code": "failed", "message": f"row {i} failed"}
            if n:
                yield b","
            yield from self._row_parts(n, entry, b"")
            if self._ends_here(n):
                return
        yield b"]}"

    def row_body(self, i: int, state: str) -> dict[str, Any]:
        """Row ``i`` as the dialect's Responses object, in ``state`` (a lower-case row
        status: ``pending`` and ``running`` have no output yet)."""
        body = self.response_body(i)
        shape = self.profile.shape_response
        if state in ("pending", "running"):
            return shape(body, state)
        if state != "completed":
            failure = {"code": f"row_{state}", "message": f"row {i} {state}"}
            body = {**body, "status": state, "output": None, "usage": None}
            body["error"] = failure if state == "failed" else None
        return shape(body, None)

    def row_object(self, custom_id: str) -> tuple[int, dict[str, Any] | None]:
        """(status code, body) of a per-row GET (Sail, Valar): the row's Responses object
        as it is now, or 404 for a custom_id the batch does not have."""
        i = self.index_of(custom_id)
        if i is None:
            return 404, None
        self.served[custom_id] = self.served.get(custom_id, 0) + 1
        if self.served[custom_id] <= self.row_failures.get(custom_id, 0):
            return 500, None
        return 200, self.row_body(i, self.row_state(i, self.ended()))
