"""Object ids as each provider makes them: ``resp_…``/``batch_…`` (OpenAI-style, Sail and
Valar's examples) or UUIDv7 (sference's responses, batches and streams)."""

from __future__ import annotations

import hashlib
import os
import time
import uuid

__all__ = ["prefixed_id", "uuid7", "uuid7_at"]

_SEEDED_MS = 1_767_225_600_000
"""The time part of a seeded :func:`uuid7`: 2026-01-01, fixed, so the id is too."""


def uuid7(seed: str | None = None) -> str:
    """A UUIDv7 (RFC 9562: 48 bits of Unix milliseconds, then random bits): a new one, or,
    given ``seed``, always the same one for it (tests that name their objects)."""
    if seed is None:
        ms, rest = time.time_ns() // 1_000_000, os.urandom(10)
    else:
        ms, rest = _SEEDED_MS, hashlib.sha256(seed.encode()).digest()[:10]
    value = (ms & (2**48 - 1)) << 80 | int.from_bytes(rest, "big")
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # the RFC variant
    return str(uuid.UUID(int=value))


def uuid7_at(ms: int, seed: str) -> str:
    """The UUIDv7 of millisecond ``ms`` whose random bits come from ``seed``: ids made for
    one time sort by it, whenever they are made."""
    rest = hashlib.sha256(seed.encode()).digest()[:10]
    value = (ms & (2**48 - 1)) << 80 | int.from_bytes(rest, "big")
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # the RFC variant
    return str(uuid.UUID(int=value))


def prefixed_id(prefix: str) -> str:
    """``{prefix}_`` and 32 random hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"
