"""``nopoll results get|tail``: look at results over the results API (``/v1``), as a
consumer does, without curl or Python.

Both talk to a running nopoll at ``--url`` (default ``$NOPOLL_URL``, else
``http://127.0.0.1:8000``) with a consumer token (``--token`` or ``$NOPOLL_TOKEN``; one of
``consumer_tokens``), through :mod:`nopoll.client`. ``get`` prints one envelope as JSON;
``tail`` prints each envelope as it lands until ``--limit`` results or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from nopoll.envelope import DEFAULT_TENANT
from nopoll.exceptions import ConfigError
from nopoll.kinds import KINDS

_DEFAULT_URL = "http://127.0.0.1:8000"


def _connection(args: argparse.Namespace) -> tuple[str, str]:
    url = args.url or os.environ.get("NOPOLL_URL") or _DEFAULT_URL
    token = args.token or os.environ.get("NOPOLL_TOKEN")
    if not token:
        raise ConfigError(
            "no consumer token: give --token or set NOPOLL_TOKEN to one of the running "
            "nopoll's consumer_tokens (see docs/consumers.md)"
        )
    return url.rstrip("/"), token


def _refused(exc: Any, url: str) -> int:
    """Say why the results API refused, and the exit status: 2 for a token or request
    the server turned down (4xx), 1 when it could not answer."""
    print(f"nopoll results: {url}: {exc}", file=sys.stderr)
    status = getattr(exc, "status", None)
    return 2 if status is not None and 400 <= status < 500 else 1


async def _get(args: argparse.Namespace) -> int:
    import orjson

    from nopoll.client import Results, ResultsError

    url, token = _connection(args)
    async with Results(url, token) as results:
        try:
            if args.wait:
                env = await results.wait(args.provider, args.key, args.wait, tenant=args.tenant)
            else:
                env = await results.get(args.provider, args.key, tenant=args.tenant)
        except ResultsError as exc:
            return _refused(exc, url)
    if env is None:
        waited = f" within {args.wait:g} s" if args.wait else ""
        print(f"{args.provider}/{args.key} has not landed{waited}", file=sys.stderr)
        return 1
    print(orjson.dumps(env.to_dict(), option=orjson.OPT_INDENT_2).decode())
    return 0


def _line(env: Any) -> str:
    text = (env.output_text or env.error or "").replace("\n", " ")
    text = text if len(text) <= 80 else text[:79] + "…"
    tenant = "" if env.tenant == DEFAULT_TENANT else f" @{env.tenant}"
    return f"{env.provider}/{env.key}{tenant} {env.kind} {env.status} {text}".rstrip()


async def _tail(args: argparse.Namespace, shown: list[int]) -> int:
    import orjson

    from nopoll.client import Results, ResultsError

    url, token = _connection(args)
    async with Results(url, token) as results:
        stream = results.stream(
            tenant=args.tenant,
            provider=args.provider,
            kind=args.kind,
            status=args.status,
            last_event_id="0-0" if args.from_start else None,
        )
        try:
            async for env in stream:
                if args.json:
                    print(orjson.dumps(env.to_dict()).decode(), flush=True)
                else:
                    print(_line(env), flush=True)
                shown[0] += 1
                if args.limit and shown[0] >= args.limit:
                    break
        except ResultsError as exc:
            return _refused(exc, url)
    return 0


def _cmd_get(args: argparse.Namespace) -> int:
    return asyncio.run(_get(args))


def _cmd_tail(args: argparse.Namespace) -> int:
    shown = [0]
    try:
        return asyncio.run(_tail(args, shown))
    except KeyboardInterrupt:
        print(f"stopped after {shown[0]} result(s)", file=sys.stderr)
        return 130


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {value!r}")
    return number


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help=f"the nopoll to ask (default $NOPOLL_URL, else {_DEFAULT_URL})")
    p.add_argument("--token", help="a consumer token (default $NOPOLL_TOKEN)")
    p.add_argument(
        "--tenant", help="whose results (a token with a tenant sees only its own; default: default)"
    )


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    results = sub.add_parser(
        "results",
        help="look at results over the results API (a consumer token)",
        description="Read results from a running nopoll's results API (/v1) with a consumer "
        "token, as a consumer does. See docs/consumers.md.",
    )
    results_sub = results.add_subparsers(dest="results_command", required=True)
    p = results_sub.add_parser(
        "get",
        help="print one result's envelope as JSON",
        description="Print the envelope of PROVIDER's KEY as JSON. Exit status 0 when it "
        "landed, 1 when it has not (or nopoll could not be reached), 2 when the token or "
        "request was refused.",
    )
    p.add_argument("provider", metavar="PROVIDER")
    p.add_argument("key", metavar="KEY", help="a response id, batch id, or BATCH/ROW key")
    p.add_argument(
        "--wait", type=_positive, metavar="S", help="wait up to S seconds for it to land"
    )
    _common(p)
    p.set_defaults(func=_cmd_get)
    p = results_sub.add_parser(
        "tail",
        help="print results as they land, until --limit or Ctrl-C",
        description="Follow GET /v1/results/stream: one line per result as it lands "
        "(provider/key, kind, status, the start of its text), or --json lines. It "
        "reconnects by itself; Ctrl-C stops it (exit status 130).",
    )
    _common(p)
    p.add_argument("--provider", help="only this provider's results")
    rows_last = sorted(KINDS, key=lambda kind: KINDS[kind].row_of is not None)
    p.add_argument("--kind", choices=rows_last, help="only this kind")
    p.add_argument("--status", help="only results with this status (e.g. failed)")
    p.add_argument(
        "--from-start", action="store_true", help="begin with the oldest result still kept"
    )
    p.add_argument("--limit", type=int, default=0, help="stop after this many results")
    p.add_argument("--json", action="store_true", help="print each envelope as a JSON line")
    p.set_defaults(func=_cmd_tail)
