"""A webhook subscriber for the ``http`` sink's tests: a Starlette app under uvicorn on
127.0.0.1 that verifies every POST with the ``standardwebhooks`` package and records it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.servers import free_port

__all__ = ["Delivery", "Subscriber"]


@dataclasses.dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes
    verified: bool

    @property
    def payload(self) -> Any:
        return orjson.loads(self.body)


class Subscriber:
    """A webhook consumer: verifies each POST with ``standardwebhooks`` (401 when it does not
    verify), records it, then answers ``status`` with ``headers`` after ``delay_s``; the
    statuses in ``script`` are answered first, one per POST, with ``answer`` as the body.
    With ``body_bytes`` the answer
    has a body of that many bytes, streamed; ``body_sent`` counts what was handed to the
    connection (it stops growing once the client closes it)."""

    def __init__(
        self,
        secret: str | bytes,
        *,
        status: int = 200,
        headers: dict[str, str] | None = None,
        delay_s: float = 0.0,
        script: list[int] | None = None,
        answer: bytes = b"",
        body_bytes: int = 0,
    ) -> None:
        self.secret = secret
        self.script = list(script or [])
        self.status = status
        self.headers = headers or {}
        self.delay_s = delay_s
        self.answer, self.body_bytes, self.body_sent = answer, body_bytes, 0
        self.deliveries: list[Delivery] = []
        self.port = free_port()
        self._release = asyncio.Event()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _hook(self, request: Request) -> Response:
        body = await request.body()
        headers = dict(request.headers)
        try:
            Webhook(self.secret).verify(body, headers)
            verified = True
        except WebhookVerificationError:
            verified = False
        self.deliveries.append(Delivery(headers, body, verified))
        if not verified:
            return Response(status_code=401)
        if self.delay_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), self.delay_s)
        status = self.script.pop(0) if self.script else self.status
        if self.body_bytes:
            headers = {**self.headers, "content-length": str(self.body_bytes)}
            return StreamingResponse(self._body(), status_code=status, headers=headers)
        return Response(self.answer, status_code=status, headers=self.headers)

    async def _body(self) -> AsyncIterator[bytes]:
        chunk = b"x" * 65536
        for start in range(0, self.body_bytes, len(chunk)):
            part = chunk[: self.body_bytes - start]
            yield part
            self.body_sent += len(part)  # resumed: the send of ``part`` returned
            # let Starlette see a disconnect: uvicorn's send returns at once after one
            await asyncio.sleep(0)

    async def start(self) -> Subscriber:
        app = Starlette(routes=[Route("/{path:path}", self._hook, methods=["POST"])])
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        assert self._server.started, "subscriber did not start"
        return self

    async def stop(self) -> None:
        self._release.set()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 10)
            self._server = self._task = None
