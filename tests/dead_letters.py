"""Dead letters for the tests: one call per letter, provider ``sim``."""

from __future__ import annotations

from typing import Any

from receiver.queue.deadletter import DeadLetter, DeadLetters


async def keep_letter(
    store: DeadLetters,
    function: str,
    sink: str = "fetch",
    keys: list[str] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    attempts: int = 3,
    error: str | None = None,
) -> DeadLetter:
    """Keep one letter of ``function``'s work (``kwargs``, by default ``{provider: sim}``)."""
    return await store.add(
        sink=sink,
        provider="sim",
        keys=keys or ["x"],
        attempts=attempts,
        error=error or f"{sink} failed",
        function=function,
        kwargs={"provider": "sim"} if kwargs is None else kwargs,
    )
