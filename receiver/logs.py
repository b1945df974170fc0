"""Structured logs: one JSON object per line, with the ids of the work at hand.

``bind(event_id=..., response_id=...)`` puts ids in a context variable for a job's
duration; every record logged meanwhile carries them. Nothing here formats a config
value, and neither format lets provider data forge a line: JSON escapes it, and the text
format escapes control characters and the backslash and quotes a value holding a space,
``=`` or ``"``.

See docs/security.md (secrets: logs).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson

__all__ = ["JsonFormatter", "TextFormatter", "Throttle", "bind", "configure_logging"]

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "nopoll_log_context", default=None
)
# uvicorn adds ``color_message``, the message with ANSI colour codes: not for a log file.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: whatever a
# terminal or a log viewer may take for the end of a line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
_NEEDS_QUOTES = re.compile(r'[\s="]')


def bind(**fields: Any) -> contextlib.AbstractContextManager[None]:
    """Add ``fields`` (ids, never secrets) to every log record in this context."""
    return _Bound(fields)


class _Bound:
    """:func:`bind`'s context manager: a class, not a generator (it wraps every job)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        added = {k: v for k, v in self._fields.items() if v is not None}
        current = _context.get()
        self._token = _context.set({**current, **added} if current else added)

    def __exit__(self, *exc: object) -> None:
        _context.reset(self._token)


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


class Throttle:
    """At most one line per key every ``every_s`` seconds; the next line of that key says how
    many were left out meanwhile. Keys should come from a small set (a provider and a
    status): a flood of rejected requests then costs a few lines, not a full disk."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0, max_keys: int = 1024):
        self._logger = logger
        self._every_s = every_s
        self._max_keys = max_keys
        self._last: dict[Any, tuple[float, int]] = {}

    def log(self, level: int, key: Any, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(key, (float("-inf"), 0))
        if now - last < self._every_s:
            self._last[key] = (last, skipped + 1)
            return
        if skipped:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, skipped, now - last)
        if len(self._last) >= self._max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        self._logger.log(level, msg, *args)


def _escape(text: str) -> str:
    """``text`` with every control character (and the backslash) written as an escape: one
    line, always, and never ambiguous."""
    return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or f"\\u{ord(m[0]):04x}", text)


def _field(value: Any) -> str:
    text = _escape(str(value))
    if text and not _NEEDS_QUOTES.search(text):
        return text
    return '"' + text.replace('"', '\\"') + '"'


class TextFormatter(logging.Formatter):
    """``time LEVEL logger message key=value ...``: one line per record, whatever the message
    and the bound ids hold; a traceback follows on lines indented by two spaces."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = _escape(record.getMessage())
        record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        context = _context.get()
        if context:
            text += " " + " ".join(f"{_field(k)}={_field(v)}" for k, v in context.items())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for extra in (record.exc_text, record.stack_info):
            if extra:
                # Indented: a line a message smuggled in cannot start at column 0.
                text += "".join(f"\n  {_escape(line)}" for line in extra.splitlines())
        return text


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Log to stderr as JSON lines (``fmt="json"``) or readable text (``"text"``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
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
