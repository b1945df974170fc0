"""The ``/ui`` session: a small dict in a signed cookie, and what the server keeps of it.

The cookie is signed (itsdangerous, HMAC-SHA256) with a key of its own:
``ui.session_secret``, else a random key kept in Redis (``nopoll:ui:session-key``), never
derived from a token. A session records its login time (``since``), its id (``sid``) and,
for a tenant's consumer token, its ``tenant``. It ends eight hours after login, and at
log-out, which marks ``nopoll:ui:ended:<sid>`` until those eight hours are up, so earlier
copies of the cookie are refused too.

See docs/security.md (the ``/ui`` status page) and docs/ui.md.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

from itsdangerous import BadData, URLSafeTimedSerializer
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from receiver.config.settings import Settings

__all__ = ["COOKIE", "LIFETIME_S", "SALT", "SessionCookies", "Sessions", "serializer"]

COOKIE = "nopoll_ui"
LIFETIME_S = 8 * 3600
"""A session's whole life, from login."""
SALT = "nopoll.ui-session.v1"
_KEY = "nopoll:ui:session-key"
_ENDED = "nopoll:ui:ended:"
_KEY_RELOAD_S = 60.0
_CLOCK_SKEW_S = 300


def serializer(key: bytes) -> URLSafeTimedSerializer:
    """How a session dict becomes the cookie's value and back."""
    return URLSafeTimedSerializer(key, salt=SALT, signer_kwargs={"digest_method": hashlib.sha256})


class Sessions:
    """What the server keeps of ``/ui`` sessions: the signing key, the ended sessions."""

    def __init__(self, settings: Settings, redis: Redis) -> None:
        secret = settings.ui.session_secret
        self._configured = secret.get_secret_value().encode() if secret is not None else None
        self._redis = redis
        self._key: bytes | None = None
        self._loaded = 0.0

    async def key(self) -> bytes:
        """The signing key. A generated one is read again every minute, so a key Redis
        lost (and a process made anew) reaches every process."""
        if self._configured is not None:
            return self._configured
        now = time.monotonic()
        if self._key is None or now - self._loaded > _KEY_RELOAD_S:
            await self._redis.set(_KEY, secrets.token_hex(32), nx=True)
            key = await self._redis.get(_KEY)
            if key is None:  # removed between the two calls
                raise RedisError("the /ui session key vanished from Redis")
            self._key = key if isinstance(key, bytes) else key.encode()
            self._loaded = now
        return self._key

    @staticmethod
    def live(session: dict[str, Any]) -> tuple[str, str] | None:
        """(token fingerprint, session id) of a signed-in session within its lifetime."""
        admin, since, sid = session.get("admin"), session.get("since"), session.get("sid")
        if not (isinstance(admin, str) and isinstance(since, int) and isinstance(sid, str)):
            return None
        if not -_CLOCK_SKEW_S <= time.time() - since < LIFETIME_S:
            return None
        return admin, sid

    @staticmethod
    def tenant(session: dict[str, Any]) -> str | None:
        """The one tenant a session is limited to (None: an admin's, every tenant)."""
        tenant = session.get("tenant")
        return tenant if isinstance(tenant, str) else None

    @staticmethod
    def begin(session: dict[str, Any], fingerprint: str, tenant: str | None = None) -> None:
        """Make ``session`` a fresh signed-in one (limited to ``tenant`` when given):
        nothing carried over."""
        session.clear()
        session.update(
            admin=fingerprint,
            since=int(time.time()),
            sid=secrets.token_urlsafe(16),
            csrf=secrets.token_urlsafe(32),
        )
        if tenant is not None:
            session["tenant"] = tenant

    async def ended(self, sid: str) -> bool:
        return bool(await self._redis.exists(_ENDED + sid))

    async def end(self, session: dict[str, Any]) -> None:
        """Log ``session`` out: its id is refused until its lifetime is over, then forgotten."""
        since, sid = session.get("since"), session.get("sid")
        if isinstance(since, int) and isinstance(sid, str):
            left = since + LIFETIME_S + _CLOCK_SKEW_S - int(time.time())
            if left > 0:
                await self._redis.set(_ENDED + sid, 1, ex=left)
        session.clear()


class SessionCookies:
    """ASGI middleware: ``scope["session"]`` read from the signed cookie, and the cookie
    written back only when the session changed; its ``Max-Age`` is what is left of the
    session's lifetime, never more."""

    def __init__(self, app: ASGIApp, sessions: Sessions, secure: bool, path: str) -> None:
        self.app, self._sessions = app, sessions
        self._flags = f"; Path={path}; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            signer = serializer(await self._sessions.key())
        except (RedisError, OSError):
            reason = "Redis is unreachable right now; this page comes back once it answers."
            await PlainTextResponse(reason, 503)(scope, receive, send)
            return
        session: dict[str, Any] = {}
        cookie = HTTPConnection(scope).cookies.get(COOKIE)
        if cookie:
            try:
                loaded = signer.loads(cookie, max_age=LIFETIME_S)
            except BadData:
                loaded = None
            if isinstance(loaded, dict):
                session = loaded
        scope["session"] = session
        before = dict(session)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and scope["session"] != before:
                headers = MutableHeaders(scope=message)
                headers.append("set-cookie", self._cookie(signer, scope["session"]))
            await send(message)

        await self.app(scope, receive, sending)

    def _cookie(self, signer: URLSafeTimedSerializer, session: dict[str, Any]) -> str:
        if not session:
            return f"{COOKIE}=; Max-Age=0{self._flags}"
        since = session.get("since")
        left = LIFETIME_S
        if isinstance(since, int):
            left = max(since + LIFETIME_S - int(time.time()), 0)
        return f"{COOKIE}={signer.dumps(session)}; Max-Age={left}{self._flags}"
