"""Batches for the provider simulator, in all four dialects, generated row by row.

Rows are computed from their index, never stored, so a 100,000-row, 1 GiB batch costs
the simulator no memory: files and inline ``results`` are streamed as they are written.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from receiver.simulator import make_response

__all__ = ["SimBatch"]

_BLOCK = 256 * 1024


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
    served: dict[str, int] = field(default_factory=dict)

    # --- rows ---------------------------------------------------------------------------
    def custom_id(self, i: int) -> str | None:
        if self.no_custom_id_every and i % self.no_custom_id_every == self.no_custom_id_every - 1:
            return None
        return f"row-{i:06d}"

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
        if self.dialect == "openai":
            base["output_file_id"] = f"file-out-{self.batch_id}"
            has_errors = any(self.row_status(i) != "completed" for i in range(self.n_rows))
            base["error_file_id"] = f"file-err-{self.batch_id}" if has_errors else None
        if self.dialect in ("valar", "sail"):
            base["request_status"] = {
                self.custom_id(i): {"status": self.row_status(i).upper()}
                for i in range(self.n_rows)
            }
        return base

    def openai_lines(self, errors: bool) -> Iterator[bytes]:
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
                line["response"] = {
                    "status_code": 200,
                    "request_id": f"req_{i}",
                    "body": self.response_body(i),
                }
                line["error"] = None
            yield orjson.dumps(line) + b"\n"

    def sference_lines(self) -> Iterator[bytes]:
        for i in self.order() if self.no_custom_id_every == 0 else range(self.n_rows):
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
            yield orjson.dumps(row) + b"\n"

    def sail_document(self) -> Iterator[bytes]:
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
            yield (b"," if n else b"") + orjson.dumps(entry)
        yield b"]}"

    def row_object(self, custom_id: str) -> tuple[int, dict[str, Any] | None]:
        """(status code, body) of a per-row GET (Sail fallback, Valar)."""
        if not custom_id.startswith("row-") or not custom_id[4:].isdigit():
            return 404, None
        i = int(custom_id[4:])
        if i >= self.n_rows or self.row_status(i) != "completed":
            return 404, None
        self.served[custom_id] = self.served.get(custom_id, 0) + 1
        if self.served[custom_id] <= self.row_failures.get(custom_id, 0):
            return 500, None
        return 200, self.response_body(i)


async def blocks(lines: Iterator[bytes]) -> AsyncIterator[bytes]:
    """Join small pieces into ~256 KiB blocks for a streaming response."""
    buffer: list[bytes] = []
    size = 0
    for piece in lines:
        buffer.append(piece)
        size += len(piece)
        if size >= _BLOCK:
            yield b"".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield b"".join(buffer)
