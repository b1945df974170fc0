"""The base of every contract model: strict, closed, and read from the bytes on the wire.

Strict in the sense of issue 31: no unknown and no missing required field. Every model is
``extra="forbid"`` with the contract's own ``required`` list, even where the provider's
schema leaves an object open (``additionalProperties`` absent or true): what the simulator
serves is held to the fields the contract names, so it cannot invent one that nopoll then
comes to rely on. Types are strict too (no ``"1"`` for ``1``), as JSON carries them.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, TypeAdapter

__all__ = ["IsoTime", "Strict", "Uuid", "parse"]

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class Strict(BaseModel):
    """A contract object: unknown fields and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _uuid(value: str) -> str:
    if not _UUID.fullmatch(value):
        raise ValueError(f"not a lower-case UUID: {value!r}")
    return value


def _iso(value: str) -> str:
    if datetime.fromisoformat(value).tzinfo is None:
        raise ValueError(f"an ISO-8601 time without its UTC offset: {value!r}")
    return value


Uuid = Annotated[str, AfterValidator(_uuid)]
"""A UUID in its canonical text form."""
IsoTime = Annotated[str, AfterValidator(_iso)]
"""An ISO-8601 date and time with its offset (``2026-04-04T10:12:09+00:00``)."""

T = TypeVar("T")


def parse(kind: type[T] | Any, content: bytes | str) -> T:
    """``content`` (an answer's body) as ``kind``: a model, or a type such as
    ``list[Model]``; raises pydantic's ``ValidationError`` naming every wrong field."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate_json(content)  # type: ignore[return-value]
    return TypeAdapter(kind).validate_json(content)  # type: ignore[no-any-return]
