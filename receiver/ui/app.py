"""``/ui``: the status page, served by the API process.

Login takes an admin token, or a consumer token limited to a tenant (that session sees
and replays its tenant's work only); with no ``admin_tokens`` ``/ui`` is 404. The session
is a signed cookie (:mod:`receiver.ui.session`) holding a fingerprint of the token, never
the token; every state change is a POST with the session's CSRF token. Pages read
through :class:`receiver.console.Console`, take ``?tenant=``, and serve their content
alone at ``?part=1`` for htmx's live refresh.

See docs/ui.md and docs/security.md (the ``/ui`` status page).
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
from receiver.providers.client import provider_said
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


def _duration(seconds: float | None, *, coarse: bool = False) -> str:
    """How long something took, as precisely as is worth reading: ``0.4 s``, ``1.4 s``,
    ``42 s``, ``2 min 3 s``, ``1 h 5 min``; ``coarse`` (how long ago or until) rounds to
    one unit: ``42 s``, ``3 min``, ``1.5 h``."""
    if seconds is None:
        return "—"
    seconds = max(seconds, 0.0)
    if seconds < 10 and not coarse:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if coarse:
        return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
    whole = round(seconds)
    if whole < 3600:
        minutes, rest = divmod(whole, 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(whole // 60, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def _ago(seconds: float | None) -> str:
    return _duration(seconds, coarse=True)


class _Ui:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.console = Console(settings, redis)
        self.tokens = [t.get_secret_value().encode() for t in settings.admin_tokens]
        self.consumers = [
            (c.token.get_secret_value().encode(), c.tenant) for c in settings.consumer_tokens
        ]
        self.book = TokenBook.of(settings)
        self.sessions = Sessions(settings, redis)
        self.secure = (settings.public_url or "").startswith("https://")
        env = Environment(
            loader=FileSystemLoader(_HERE / "templates"),
            autoescape=select_autoescape(["html"]),
            enable_async=False,
        )
        env.filters["ago"] = _ago
        env.filters["duration"] = _duration
        env.filters["said"] = provider_said
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
        """A live session of a configured token, not logged out (remembered for the page,
        with the tenant it is limited to: an admin token's session sees every tenant, a
        consumer token's only the tenant that token is limited to)."""
        request.state.signed_in = False
        request.state.tenant = tenant = self.sessions.tenant(request.session)
        live = self.sessions.live(request.session)
        if live is None or not live[0].isascii():
            return False
        key = await self.sessions.key()
        tokens = self.tokens if tenant is None else [t for t, of in self.consumers if of == tenant]
        ok = False
        for token in tokens:  # every token compared: no early exit
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
        context.setdefault("limited", getattr(request.state, "tenant", None))
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
            if holder is None:  # a consumer token opens its tenant's view only
                holder = self.book.identify(typed[0].strip(), "consumer")
        if holder is None or (holder.role == "consumer" and holder.tenant is None):
            error = "That is not an admin token."
            if any(of is not None for _, of in self.consumers):
                error += " (A consumer token limited to a tenant logs in too.)"
            return self.render(request, "login.html", 401, error=error)
        if holder.role == "admin":
            match, tenant = self.tokens[holder.index], None
        else:
            match, tenant = self.consumers[holder.index][0], holder.tenant
        key = await self.sessions.key()
        self.sessions.begin(request.session, _fingerprint(key, match), tenant)
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
            query = {k: v for k, v in request.query_params.items() if k != "part"}
            live_url = f"{request.url.path}?{urlencode({**query, 'part': '1'})}"
            return self.render(
                request,
                "live.html",
                page=name,
                title=title,
                every_s=every_s,
                live_url=live_url,
                **data,
            )
        return self.render(request, f"{name}.html", page=name, **data)

    async def _guard(self, request: Request) -> Response | None:
        return None if await self._signed_in(request) else self._login_first(request)

    def _tenant(self, request: Request, asked: str | None) -> str | Response | None:
        """The tenant whose rows to show: ``asked`` (``?tenant=``; empty or ``*`` for
        every tenant's) within what the session may see, or the refusal to answer."""
        limited: str | None = request.state.tenant
        if not asked or asked == "*":
            return limited
        if limited is not None and asked != limited:
            return self.refuse(request, 403, f"This session sees tenant {limited!r} only.")
        if asked not in self.console.tenants():
            return self.refuse(request, 400, f"There is no tenant {asked[:64]!r}.")
        return asked

    def _tenant_choice(self, tenant: str | None) -> dict[str, Any]:
        """What a page's tenant filter shows: the tenants to choose from, the one chosen."""
        return {"tenant": tenant, "tenant_names": self.console.tenants()}

    async def overview(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        data = await self.console.overview(tenant=request.state.tenant)
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
        tenant = self._tenant(request, request.query_params.get("tenant"))
        if isinstance(tenant, Response):
            return tenant
        data = await self.console.batches(tenant=tenant)
        return await self._page(
            request,
            "batches",
            {**data, "sinks": list(self.console.settings.sinks), **self._tenant_choice(tenant)},
        )

    async def watches(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        tenant = self._tenant(request, request.query_params.get("tenant"))
        if isinstance(tenant, Response):
            return tenant
        data = {
            "counts": await self.console.watch_counts(tenant),
            "next": await self.console.next_polls(tenant=tenant),
            **self._tenant_choice(tenant),
        }
        return await self._page(request, "watches", data)

    def _letters_scope(
        self, request: Request, fields: Any
    ) -> tuple[str | None, str | None] | Response:
        """(sink, tenant) a dead letters request names (``fields``: its query or form), or
        the refusal to answer."""
        sink = fields.get("sink") or None
        if sink is not None and sink not in self.console.sink_names():
            return self.refuse(request, 400, f"There is no sink {sink[:64]!r}.")
        tenant = self._tenant(request, fields.get("tenant"))
        if isinstance(tenant, Response):
            return tenant
        return sink, tenant

    async def dead_letters(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        q = request.query_params
        raw = q.get("page", "1")
        page = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else None
        if page is None or (page - 1) * _PAGE > MAX_OFFSET:
            return self.refuse(request, 400, f"There is no page {raw[:20]!r}.")
        page = max(page, 1)
        scope = self._letters_scope(request, q)
        if isinstance(scope, Response):
            return scope
        sink, tenant = scope
        found = await self.console.dead_letters(
            offset=(page - 1) * _PAGE, limit=_PAGE, sink=sink, tenant=tenant
        )
        pages = max((found["total"] + _PAGE - 1) // _PAGE, 1)

        def link(n: int) -> str:
            return "/ui/deadletters?" + urlencode({"page": n, **_filters(sink, tenant)})

        data = {
            **found,
            "page_no": page,
            "pages": pages,
            "prev": link(page - 1) if page > 1 else None,
            "next": link(page + 1) if page < pages else None,
            "sink": sink,
            "sink_names": self.console.sink_names(),
            "outcome": request.session.pop("outcome", None),
            **self._tenant_choice(tenant),
        }
        return await self._page(request, "deadletters", data)

    async def confirm_replay(self, request: Request) -> Response:
        """The step before replaying every letter a filter shows: how many, and a button
        that replays them (nothing is replayed by coming here)."""
        if (denied := await self._guard(request)) is not None:
            return denied
        scope = self._letters_scope(request, request.query_params)
        if isinstance(scope, Response):
            return scope
        sink, tenant = scope
        found = await self.console.dead_letters(limit=1, sink=sink, tenant=tenant)
        back = "/ui/deadletters" + (
            f"?{urlencode(_filters(sink, tenant))}" if _filters(sink, tenant) else ""
        )
        return self.render(
            request,
            "confirm.html",
            page="deadletters",
            total=found["total"],
            sink=sink,
            tenant=tenant,
            back=back,
        )

    async def replay(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        scope = self._letters_scope(request, form)
        if isinstance(scope, Response):
            return scope
        sink, tenant = scope
        letter = form.get("id")
        if letter:
            done = await self.console.replay(ids=[letter[:64]], tenant=request.state.tenant)
            what = f"dead letter {letter[:64]}"
        elif form.get("scope") in ("sink", "all"):
            sink = sink if form["scope"] == "sink" else None
            done = await self.console.replay(sink=sink, tenant=tenant)
            what = "every dead letter" + (f" of {sink}" if sink else "")
            what += f" of tenant {tenant}" if tenant else ""
        else:
            return self.refuse(request, 400, "Say which dead letters to replay.")
        request.session["outcome"] = f"Replayed {done['replayed']} ({what}); " + (
            f"{done['kept']} could not be redone and are kept."
            if done["kept"]
            else "a worker delivers them now."
        )
        back = _filters(form.get("back_sink") or None, form.get("back_tenant") or None)
        if form.get("back_q"):  # replayed from a journey page: back to it
            asked = {"q": form["back_q"][:600], "tenant": form.get("back_tenant", "")[:64]}
            return RedirectResponse(
                "/ui/journey?" + urlencode({k: v for k, v in asked.items() if v}), 303
            )
        return RedirectResponse("/ui/deadletters" + (f"?{urlencode(back)}" if back else ""), 303)

    async def journey(self, request: Request) -> Response:
        """Where is my result? ``q`` (an id, row key or webhook-id) at the first configured
        provider, and tenant unless ``tenant`` is given, that knows it. A session limited
        to a tenant looks in that tenant only."""
        if (denied := await self._guard(request)) is not None:
            return denied
        q = request.query_params.get("q", "").strip()[:600]
        tenant = self._tenant(request, request.query_params.get("tenant"))
        if isinstance(tenant, Response):
            return tenant
        found = await self.console.find_journey(q, tenant) if q else None
        data = {
            "q": q,
            "tenant": tenant,
            "j": found,
            "ttl_days": f"{self.console.settings.journey_ttl_s / 86_400:g}",
            "outcome": request.session.pop("outcome", None),
        }
        return self.render(request, "journey.html", 200 if found or not q else 404, **data)


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
        Route("/deadletters/replay", safe(ui.confirm_replay), methods=["GET"]),
        Route("/deadletters/replay", safe(ui.replay), methods=["POST"]),
        Route("/journey", safe(ui.journey), methods=["GET"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    middleware = [Middleware(SessionCookies, sessions=ui.sessions, secure=ui.secure, path="/ui")]
    return [Mount("/ui", routes=routes, middleware=middleware)]


def _filters(sink: str | None, tenant: str | None) -> dict[str, str]:
    """The query of a dead letters page filtered by ``sink`` and ``tenant``."""
    return {
        **({"sink": sink} if sink else {}),
        **({"tenant": tenant} if tenant else {}),
    }
