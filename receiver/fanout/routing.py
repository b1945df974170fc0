"""Routes: which sinks a result goes to.

Without routes every result goes to every sink. With routes, a result goes to the union
of the sinks of every route whose ``match`` it satisfies; one that matches none goes
nowhere and is counted (``nopoll_unrouted_results``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nopoll.envelope import Envelope
from receiver.config.settings import RouteConfig

__all__ = ["Router"]


def _as_set(value: str | list[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    return frozenset([value] if isinstance(value, str) else value)


class _Rule:
    __slots__ = ("fields", "metadata", "sinks")

    def __init__(self, route: RouteConfig) -> None:
        m = route.match
        self.fields = {
            name: allowed
            for name in ("provider", "tenant", "kind", "status", "model")
            if (allowed := _as_set(getattr(m, name))) is not None
        }
        self.metadata = {
            key.removeprefix("metadata."): _as_set(value)
            for key, value in (m.model_extra or {}).items()
        }
        self.sinks = tuple(route.sinks)

    def matches(self, env: Envelope) -> bool:
        for name, allowed in self.fields.items():
            if getattr(env, name) not in allowed:
                return False
        for key, wanted in self.metadata.items():
            value: Any = env.metadata.get(key)
            if wanted is not None and (value is None or str(value) not in wanted):
                return False
        return True


class Router:
    """Maps each envelope to the names of the sinks that take it."""

    def __init__(self, routes: Sequence[RouteConfig], sinks: Sequence[str]) -> None:
        self._rules = [_Rule(r) for r in routes]
        self._all = tuple(sinks)

    def sinks_for(self, env: Envelope) -> tuple[str, ...]:
        if not self._rules:
            return self._all
        chosen: dict[str, None] = {}
        for rule in self._rules:
            if rule.matches(env):
                chosen.update(dict.fromkeys(rule.sinks))
        return tuple(chosen)
