"""Bearer tokens: who is asking. One check for the admin API (``admin_tokens``), the
results API (``consumer_tokens``) and ``/ui``'s login form.

:func:`bearer_auth` puts the APIs behind Starlette's ``AuthenticationMiddleware`` with
:class:`BearerTokens`; a route finds its :class:`TokenUser` in ``request.user``, and a
role with no token answers 404. :class:`TokenBook` keeps SHA-256 digests and compares
with ``hmac.compare_digest`` against every digest of the role. The ``Authorization``
header is read strictly; a refusal is a 401 with ``WWW-Authenticate: Bearer`` that
never names the token.

See docs/http.md (bearer tokens) and docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import SecretStr
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    BaseUser,
)
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import Response

from receiver.config.settings import ConsumerToken, Settings
from receiver.responses import json_error

__all__ = [
    "BearerTokens",
    "Holder",
    "Refusal",
    "Role",
    "TokenBook",
    "TokenUser",
    "bearer_auth",
]

Role = Literal["admin", "consumer"]
_REALM: dict[Role, str] = {"admin": "nopoll admin", "consumer": "nopoll results"}
_TOKEN = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class Holder:
    """Who presented a token: ``role``, the token's place in its config list (``index``,
    among the entries in use) and, for a consumer limited to one tenant, that tenant."""

    role: Role
    index: int
    tenant: str | None = None


@dataclass(frozen=True)
class Refusal:
    """Why a request is not let in: ``reason`` for the body, ``challenge`` for
    ``WWW-Authenticate``."""

    reason: str
    challenge: str

    def response(self) -> Response:
        """The 401 to answer: ``{"error": reason}`` with the challenge."""
        return json_error(401, self.reason, {"www-authenticate": self.challenge})


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenBook:
    """Every configured bearer token as a digest, with the identity it stands for."""

    def __init__(
        self, admin_tokens: Sequence[SecretStr], consumer_tokens: Sequence[ConsumerToken]
    ) -> None:
        self._entries: dict[Role, list[tuple[bytes, Holder]]] = {
            "admin": [
                (_digest(t.get_secret_value()), Holder("admin", i))
                for i, t in enumerate(admin_tokens)
            ],
            "consumer": [
                (_digest(c.token.get_secret_value()), Holder("consumer", i, c.tenant))
                for i, c in enumerate(consumer_tokens)
            ],
        }

    @classmethod
    def of(cls, settings: Settings) -> TokenBook:
        return cls(settings.admin_tokens, settings.consumer_tokens)

    def configured(self, role: Role) -> bool:
        """Whether any token of ``role`` is configured (none: its routes are 404)."""
        return bool(self._entries[role])

    def identify(self, token: str, role: Role) -> Holder | None:
        """The holder of ``token`` among the tokens of ``role``, or ``None``."""
        given = _digest(token)
        found: Holder | None = None
        for digest, holder in self._entries[role]:  # every one: no early exit to time
            if hmac.compare_digest(given, digest):
                found = holder
        return found

    def authenticate(self, headers: Headers, role: Role) -> Holder | Refusal:
        """The holder of the request's bearer token, or why it is refused."""
        realm = f'Bearer realm="{_REALM[role]}"'

        def refused(reason: str, error: str | None) -> Refusal:
            if error is None:  # no credentials at all: no error code (RFC 6750 3.1)
                return Refusal(reason, realm)
            return Refusal(reason, f'{realm}, error="{error}"')

        values = headers.getlist("authorization")
        if not values:
            return refused("Authorization: missing; send 'Authorization: Bearer <token>'", None)
        if len(values) > 1:
            return refused("Authorization: sent more than once; send one", "invalid_request")
        value = values[0]
        if not value.isascii():  # the header's bytes, read as latin-1
            return refused("Authorization: not ASCII; a bearer token is ASCII", "invalid_request")
        scheme, _, rest = value.partition(" ")
        if scheme.lower() != "bearer":
            return refused("Authorization: the scheme must be Bearer, as in 'Bearer <token>'", None)
        token = rest.strip(" ")
        if not _TOKEN.fullmatch(token):
            return refused(
                "Authorization: expected 'Bearer <token>', one token of printable ASCII",
                "invalid_request",
            )
        holder = self.identify(token, role)
        if holder is None:
            return refused(f"Authorization: not a valid {role} bearer token", "invalid_token")
        return holder


class TokenUser(BaseUser):
    """``request.user`` behind :func:`bearer_auth`: the :class:`Holder` of the token."""

    def __init__(self, holder: Holder) -> None:
        self.holder = holder

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.identity

    @property
    def identity(self) -> str:
        """The role and the token's place in its list (never the token)."""
        return f"{self.holder.role}:{self.holder.index}"


class _Refused(AuthenticationError):
    """Raised by :class:`BearerTokens` with the answer to give."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class BearerTokens(AuthenticationBackend):
    """The bearer-token check of one role's routes, as a Starlette authentication backend:
    a 404 when no token of the role is configured, the :class:`Refusal` 401 for a missing,
    malformed or wrong token, else the :class:`TokenUser` with the role as its scope."""

    def __init__(self, book: TokenBook, role: Role) -> None:
        self.book, self.role = book, role

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser]:
        if not self.book.configured(self.role):
            raise _Refused(json_error(404, "not found"))
        holder = self.book.authenticate(conn.headers, self.role)
        if isinstance(holder, Refusal):
            raise _Refused(holder.response())
        return AuthCredentials([self.role]), TokenUser(holder)


def _refused(conn: HTTPConnection, exc: AuthenticationError) -> Response:
    assert isinstance(exc, _Refused)
    return exc.response


def bearer_auth(book: TokenBook, role: Role) -> list[Middleware]:
    """The middleware of a route that takes ``role``'s bearer tokens (``Route(...,
    middleware=bearer_auth(book, role))``): it answers before the route reads anything."""
    return [
        Middleware(AuthenticationMiddleware, backend=BearerTokens(book, role), on_error=_refused)
    ]
