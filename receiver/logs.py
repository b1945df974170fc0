"""Structured logs: one JSON object per line, with the ids of the work at hand.

``bind(event_id=..., response_id=...)`` puts ids in a context variable for the duration
of a job; every record logged meanwhile, by nopoll or by the libraries it calls, carries
them. Nothing here ever formats a config value, so secrets cannot reach a log line.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson

__all__ = ["JsonFormatter", "bind", "configure_logging"]

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "nopoll_log_context", default=None
)
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


@contextlib.contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (ids, never secrets) to every log record in this context."""
    current = _context.get() or {}
    token = _context.set({**current, **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    """``{"ts","level","logger","msg", ...context, ...extra}``, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_context.get() or {})
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        context = _context.get()
        if context:
            text += " " + " ".join(f"{k}={v}" for k, v in context.items())
        return text


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Log to stderr as JSON lines (``fmt="json"``) or readable text (``"text"``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if level != "debug":
        # arq logs two lines per job; at hundreds of callbacks a second, metrics say it better.
        logging.getLogger("arq.worker").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
