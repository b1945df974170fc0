"""Batches for the provider simulator, in all four dialects, generated row by row.

Rows are computed from their index, never stored, so a 100,000-row, 1 GiB batch costs the
simulator no memory: files and inline ``results`` are streamed as they are written.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from receiver.demo.answers import Oversize, Part
from receiver.demo.profiles import PROFILES, SimProfile
from receiver.demo.responses import make_response

__all__ = ["SimBatch"]


@dataclass
class SimBatch:
    """A finished batch the simulator serves; what each row is follows from its index."""

    dialect: str
    batch_id: str
    n_rows: int
    status: str = "completed"
    failed_every: int = 0
    """Every k-th row (k > 0) failed."""
    cancelled_every: int = 0
    """Every k-th row was cancelled (request_status dialects)."""
    no_custom_id_every: int = 0
    """Every k-th sference row has no custom_id (its key is then its line index)."""
    body_bytes: int = 0
    """Extra text in each answer, to make rows as large as real ones."""
    inline: bool = True
    """Sail: results inline; False: ``results: null`` and per-row GETs."""
    shuffled: bool = True
    """Output order differs from input order (matching must go by custom_id)."""
    row_failures: dict[str, int] = field(default_factory=dict)
    """custom_id → how many 500s its per-row GET answers first."""
    row_delay_s: float = 0.0
    pending_times: int = 0
    """Answer the first N ``GET /batches/{id}`` with the batch still ``pending_status``."""
    pending_status: str = "finalizing"
    pending_until: float | None = None
    """Unix time before which ``GET /batches/{id}`` finds it still ``pending_status``."""
    object_served: int = 0
    custom_ids: dict[int, str | None] = field(default_factory=dict)
    """Row index → its custom_id (None: it has none), instead of ``row-000042``."""
    gzip: bool = False
    """Send every answer of this batch with ``Content-Encoding: gzip``."""
    oversize: Oversize | None = None
    """The row at position ``oversize_at`` of the results file (openai output, sference) or
    of the inline ``results`` (sail) is this large; ``endless`` ends the answer there."""
    oversize_at: int = 3
    row_oversize: dict[str, Oversize] = field(default_factory=dict)
    """custom_id → how its per-row GET (Sail fallback, Valar) is too large."""
    served: dict[str, int] = field(default_factory=dict)
    input_file_id: str | None = None
    """openai: the uploaded input file (else ``file-in-{batch_id}``)."""
    endpoint: str = "/v1/responses"
    """openai: the batch's endpoint; ``/v1/chat/completions`` answers chat completions."""
    _by_custom_id: dict[str | None, int] = field(default_factory=dict, init=False, repr=False)
    _indexed: int = field(default=-1, init=False, repr=False)

    @property
    def profile(self) -> SimProfile:
        """How the simulator serves this batch's dialect."""
        return PROFILES[self.dialect]

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
        ids = list(range(self.n_rows))
        if self.shuffled:
            random.Random(self.batch_id).shuffle(ids)
        return ids

    def counts(self) -> dict[str, int]:
        failed = sum(1 for i in range(self.n_rows) if self.row_status(i) == "failed")
        cancelled = sum(1 for i in range(self.n_rows) if self.row_status(i) == "cancelled")
        return {
            "total": self.n_rows,
            "completed": self.n_rows - failed - cancelled,
            "failed": failed,
            "cancelled": cancelled,
        }

    # --- dialect shapes -----------------------------------------------------------------
    def batch_object(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            "id": self.batch_id,
            "object": "batch",
            "status": self.status,
            "created_at": int(time.time()),
            "request_counts": self.counts(),
            "metadata": {"label": "sim"},
        }
        profile = self.profile
        if profile.output_files:  # the fields OpenAI's Batch object always has
            base["endpoint"] = self.endpoint
            base["input_file_id"] = self.input_file_id or f"file-in-{self.batch_id}"
            base["completion_window"] = "24h"
            counts = base["request_counts"]  # total, completed, failed: no cancelled
            base["request_counts"] = {k: counts[k] for k in ("total", "completed", "failed")}
            base["output_file_id"] = f"file-out-{self.batch_id}"
            has_errors = any(self.row_status(i) != "completed" for i in range(self.n_rows))
            base["error_file_id"] = f"file-err-{self.batch_id}" if has_errors else None
        if profile.request_status:
            base["request_status"] = {
                self.custom_id(i): {"status": self.row_status(i).upper()}
                for i in range(self.n_rows)
            }
        return base

    def pending_object(self) -> dict[str, Any]:
        """The batch object while it is not terminal: no results, no files yet."""
        obj = self.batch_object()
        obj["status"] = self.pending_status
        for name in ("output_file_id", "error_file_id", "results"):
            if name in obj or self.profile.inline_results:
                obj[name] = None
        if "request_status" in obj:
            obj["request_status"] = {k: {"status": "IN_PROGRESS"} for k in obj["request_status"]}
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
        missing = self.no_custom_id_every or None in self.custom_ids.values()
        for n, i in enumerate(range(self.n_rows) if missing else self.order()):
            status = self.row_status(i)
            row: dict[str, Any] = {"status": status}
            cid = self.custom_id(i)
            if cid is not None:
                row["custom_id"] = cid
            if status == "completed":
                row["result_json"] = self.chat_body(i)
                row["error_json"] = None
            else:
                row["result_json"] = None
                row["error_json"] = {"code": "row_failed", "message": f"row {i} failed"}
            yield from self._row_parts(n, row, b"\n")
            if self._ends_here(n):
                return

    def sail_document(self) -> Iterator[Part]:
        obj = self.batch_object()
        if not self.inline:
            obj["results"] = None
            obj["error"] = {"message": "results too large to inline; fetch them per custom_id"}
            yield orjson.dumps(obj)
            return
        head = orjson.dumps(obj)[:-1]  # without the closing brace
        yield head + b',"results":['
        for n, i in enumerate(self.order()):
            entry: dict[str, Any] = {"custom_id": self.custom_id(i)}
            if self.row_status(i) == "completed":
                entry["response"] = {"status_code": 200, "body": self.response_body(i)}
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

    def row_object(self, custom_id: str) -> tuple[int, dict[str, Any] | None]:
        """(status code, body) of a per-row GET (Sail fallback, Valar)."""
        i = self.index_of(custom_id)
        if i is None or self.row_status(i) != "completed":
            return 404, None
        self.served[custom_id] = self.served.get(custom_id, 0) + 1
        if self.served[custom_id] <= self.row_failures.get(custom_id, 0):
            return 500, None
        return 200, self.response_body(i)
