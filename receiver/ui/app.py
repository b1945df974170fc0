"""``/ui``: the status page, served by the API process.

Login with an admin token (one of ``admin_tokens``; none configured: ``/ui`` is 404, like
``/admin/v1``). The session lives in a signed cookie (:mod:`receiver.ui.session`: a key of
its own, eight hours from login, ended for every copy at log-out): ``HttpOnly``,
``SameSite=Strict``, ``Secure`` when ``public_url`` is https, scoped to ``/ui``. It holds
a fingerprint of the token (an HMAC under the session key), never the token, so removing
a token from the config ends its sessions. Every state-changing request is a POST carrying
the session's CSRF token.

Pages read through :class:`receiver.console.Console`, the same calls as the admin API.
Each page's content is also served alone (``?part=1``), which htmx fetches every few
seconds to keep the page live.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from receiver.auth import TokenBook
from receiver.config.settings import Settings
from receiver.console import MAX_OFFSET, Console
from receiver.ui.charts import PALETTE, bar_chart, stacked_chart
from receiver.ui.session import SessionCookies, Sessions

__all__ = ["MAX_FORM", "ui_routes"]

_HERE = Path(__file__).parent
_PAGE = 50
MAX_FORM = 64 * 1024
"""The most of a form's body read (bytes); the app's :class:`receiver.webhooks.wire.BoundedBodies`
holds every POST to it."""


def _fingerprint(key: bytes, token: bytes) -> str:
    return hmac.new(key, token, hashlib.sha256).hexdigest()[:32]


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Ui:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.console = Console(settings, redis)
        self.tokens = [t.get_secret_value().encode() for t in settings.admin_tokens]
        self.book = TokenBook.of(settings)
        self.sessions = Sessions(settings, redis)
        self.secure = (settings.public_url or "").startswith("https://")
        env = Environment(
            loader=FileSystemLoader(_HERE / "templates"),
            autoescape=select_autoescape(["html"]),
            enable_async=False,
        )
        env.filters["ago"] = _ago
        env.filters["num"] = lambda n: f"{round(n):,}" if isinstance(n, int | float) else "—"
        env.globals["now"] = time.time
        self.env = env

    # --- session, login, CSRF -------------------------------------------------------
    def _csrf(self, request: Request) -> str:
        token = request.session.get("csrf")
        if not isinstance(token, str):
            token = request.session["csrf"] = secrets.token_urlsafe(32)
        return token

    async def _signed_in(self, request: Request) -> bool:
        """A live session of a configured token, not logged out (remembered for the page)."""
        request.state.signed_in = False
        live = self.sessions.live(request.session)
        if live is None or not live[0].isascii():
            return False
        key = await self.sessions.key()
        ok = False
        for token in self.tokens:  # every token compared: no early exit
            ok |= hmac.compare_digest(live[0].encode(), _fingerprint(key, token).encode())
        request.state.signed_in = ok and not await self.sessions.ended(live[1])
        return bool(request.state.signed_in)

    async def _form(self, request: Request) -> dict[str, str] | Response:
        """The POSTed form's fields, or the 403 to answer when its CSRF token is missing or
        not this session's. (Its size and how long it takes are bounded before it gets
        here: :data:`MAX_FORM`.)"""
        form = await request.form(max_files=0, max_fields=100)
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        expected = request.session.get("csrf")
        given = fields.get("csrf", "")
        if (
            isinstance(expected, str)
            and given.isascii()  # a token is ASCII; compare_digest takes no other str
            and hmac.compare_digest(given.encode(), expected.encode())
        ):
            return fields
        return self.refuse(
            request,
            403,
            "The form's CSRF token is missing or wrong: reload the page and try again.",
        )

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        context.setdefault("signed_in", getattr(request.state, "signed_in", False))
        context["csrf"] = self._csrf(request)
        context["path"] = request.url.path
        html = self.env.get_template(name).render(**context)
        return HTMLResponse(html, status, headers=_HEADERS)

    def refuse(self, request: Request, status: int, message: str) -> Response:
        return self.render(request, "message.html", status, title="Refused", message=message)

    def _login_first(self, request: Request) -> Response:
        if request.headers.get("hx-request"):  # a live refresh after the session ended
            return Response(status_code=401, headers={"HX-Redirect": "/ui/login", **_HEADERS})
        return RedirectResponse("/ui/login", 303)

    async def login_page(self, request: Request) -> Response:
        if await self._signed_in(request):
            return RedirectResponse("/ui/", 303)
        return self.render(request, "login.html", error=None)

    async def login(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        typed = (await request.form()).getlist("token")  # exactly one token field
        holder = None
        if len(typed) == 1 and isinstance(typed[0], str):
            holder = self.book.identify(typed[0].strip(), "admin")
        if holder is None:
            return self.render(request, "login.html", 401, error="That is not an admin token.")
        match = self.tokens[holder.index]
        self.sessions.begin(request.session, _fingerprint(await self.sessions.key(), match))
        return RedirectResponse("/ui/", 303)

    async def logout(self, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        await self.sessions.end(request.session)  # every copy of the cookie ends too
        return RedirectResponse("/ui/login", 303)

    # --- pages ----------------------------------------------------------------------
    async def _page(self, request: Request, name: str, data: dict[str, Any]) -> Response:
        """The page ``name``: its content alone with ``?part=1`` (what htmx refreshes), else
        inside the layout, refreshed every few seconds when it is a live page."""
        if request.query_params.get("part") == "1":
            return self.render(request, f"_{name}.html", page=name, **data)
        if name in _LIVE:
            title, every_s = _LIVE[name]
            path = request.url.path
            return self.render(
                request, "live.html", page=name, title=title, every_s=every_s, live_url=path, **data
            )
        return self.render(request, f"{name}.html", page=name, **data)

    async def _guard(self, request: Request) -> Response | None:
        return None if await self._signed_in(request) else self._login_first(request)

    async def overview(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        data = await self.console.overview()
        activity = data["activity"]
        data["charts"] = {
            "callbacks": bar_chart([m["callbacks"] for m in activity], title="Callbacks"),
            "results": bar_chart([m["results"] for m in activity], title="Results landed"),
        }
        data["last"] = activity[-1] if activity else {}
        data["token_models"] = _token_series(data["tokens"]["models"])
        data["charts"]["tokens"] = stacked_chart(
            {m["model"]: m["hours"] for m in data["token_models"]},
            title="Tokens by model",
            unit="per hour",
        )
        return await self._page(request, "overview", data)

    async def batches(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        data = await self.console.batches()
        return await self._page(
            request, "batches", {**data, "sinks": list(self.console.settings.sinks)}
        )

    async def watches(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        data = {
            "counts": await self.console.watch_counts(),
            "next": await self.console.next_polls(),
        }
        return await self._page(request, "watches", data)

    async def dead_letters(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        q = request.query_params
        raw = q.get("page", "1")
        page = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else None
        if page is None or (page - 1) * _PAGE > MAX_OFFSET:
            return self.refuse(request, 400, f"There is no page {raw[:20]!r}.")
        page = max(page, 1)
        sink = q.get("sink") or None
        if sink is not None and sink not in self.console.sink_names():
            return self.refuse(request, 400, f"There is no sink {sink[:64]!r}.")
        found = await self.console.dead_letters(offset=(page - 1) * _PAGE, limit=_PAGE, sink=sink)
        pages = max((found["total"] + _PAGE - 1) // _PAGE, 1)

        def link(n: int) -> str:
            return "/ui/deadletters?" + urlencode({"page": n, **({"sink": sink} if sink else {})})

        data = {
            **found,
            "page_no": page,
            "pages": pages,
            "prev": link(page - 1) if page > 1 else None,
            "next": link(page + 1) if page < pages else None,
            "sink": sink,
            "sink_names": self.console.sink_names(),
            "outcome": request.session.pop("outcome", None),
        }
        return await self._page(request, "deadletters", data)

    async def replay(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        letter, sink = form.get("id"), form.get("sink") or None
        if sink is not None and sink not in self.console.sink_names():
            return self.refuse(request, 400, f"There is no sink {sink[:64]!r}.")
        if letter:
            done = await self.console.replay(ids=[letter[:64]])
            what = f"dead letter {letter[:64]}"
        elif form.get("scope") in ("sink", "all"):
            done = await self.console.replay(sink=sink if form["scope"] == "sink" else None)
            what = (
                f"every dead letter of {sink}"
                if form["scope"] == "sink" and sink
                else "every dead letter"
            )
        else:
            return self.refuse(request, 400, "Say which dead letters to replay.")
        request.session["outcome"] = f"Replayed {done['replayed']} ({what}); " + (
            f"{done['kept']} could not be redone and are kept."
            if done["kept"]
            else "a worker delivers them now."
        )
        back = "/ui/deadletters" + (
            f"?{urlencode({'sink': form['back_sink']})}" if form.get("back_sink") else ""
        )
        return RedirectResponse(back, 303)


def _token_series(models: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The busiest models, each with its colour, hourly tokens and total; the rest summed
    as "other" (one colour each: the chart stays readable)."""
    shown = list(models.items())
    if len(shown) > len(PALETTE):
        rest = shown[len(PALETTE) - 1 :]
        other = [sum(hour) for hour in zip(*(v for _, v in rest), strict=True)]
        shown = [*shown[: len(PALETTE) - 1], (f"other ({len(rest)} models)", other)]
    return [
        {"model": name, "colour": colour, "hours": hours, "total": sum(hours)}
        for colour, (name, hours) in zip(PALETTE, shown, strict=False)
    ]


_LIVE = {"overview": ("Overview", 5), "batches": ("Batches", 2), "watches": ("Watches", 5)}
"""The live pages: their title and how often htmx refreshes their content (seconds)."""

_HEADERS = {
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "content-security-policy": "default-src 'self'; style-src 'self'; script-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
}


def ui_routes(settings: Settings, redis: Redis) -> list[BaseRoute]:
    """``/ui`` (a 404 for every path when no admin token is configured)."""
    if not settings.admin_tokens:
        return []
    ui = _Ui(settings, redis)

    def safe(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                result: Response = await handler(request)
            except (RedisError, OSError):
                return ui.refuse(
                    request,
                    503,
                    "Redis is unreachable right now; this page "
                    "comes back by itself once it answers.",
                )
            return result

        return endpoint

    routes = [
        Route("/", safe(ui.overview), methods=["GET"]),
        Route("/login", safe(ui.login_page), methods=["GET"]),
        Route("/login", safe(ui.login), methods=["POST"]),
        Route("/logout", safe(ui.logout), methods=["POST"]),
        Route("/batches", safe(ui.batches), methods=["GET"]),
        Route("/watches", safe(ui.watches), methods=["GET"]),
        Route("/deadletters", safe(ui.dead_letters), methods=["GET"]),
        Route("/deadletters/replay", safe(ui.replay), methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    middleware = [Middleware(SessionCookies, sessions=ui.sessions, secure=ui.secure, path="/ui")]
    return [Mount("/ui", routes=routes, middleware=middleware)]
