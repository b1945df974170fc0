"""``nopoll simulate`` and ``nopoll send-test``: try nopoll against your own instance.

``simulate`` runs the provider simulator on its own and prints what to paste into a config
and a shell; ``send-test`` signs one callback with a configured provider's webhook secret,
exactly as that provider would, POSTs it to a running nopoll and says what the answer means.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import secrets
import shlex
import signal
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from nopoll.exceptions import ConfigError
from nopoll.kinds import KINDS
from receiver.cli._common import add_config_option, config_path
from receiver.config.dialects import DIALECTS
from receiver.config.settings import load_settings
from receiver.providers import safe_id

if TYPE_CHECKING:
    import httpx

    from receiver.config.settings import ProviderConfig, Settings

_SIM_NAME = "sim"
_DEFAULT_SIM_PORT = 8001
_DEFAULT_URL = "http://127.0.0.1:8000"
_MAX_BATCH_ROWS = 1_000_000
_TIMEOUT_S = 10.0


# --- nopoll simulate -------------------------------------------------------------------
def _batch_spec(value: str) -> tuple[str, int]:
    batch_id, sep, rows = value.rpartition(":")
    if not sep or not safe_id(batch_id) or not rows.isdigit():
        raise argparse.ArgumentTypeError(f"expected ID:ROWS (e.g. batch_1:100), got {value!r}")
    if not 1 <= int(rows) <= _MAX_BATCH_ROWS:
        raise argparse.ArgumentTypeError(f"ROWS must be 1 to {_MAX_BATCH_ROWS:,}, got {rows}")
    return batch_id, int(rows)


def _per_minute(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of requests, got {value!r}")
    return int(value)


def _name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,63}", value):
        raise argparse.ArgumentTypeError(
            f"expected a provider name of letters, digits and _ (e.g. sim2), got {value!r}"
        )
    return value


def _instructions(args: argparse.Namespace, base_url: str, api_key: str, secret: str | None) -> str:
    """What to paste: ``secret`` is None for a dialect whose provider sends no webhooks
    (its results are polled: no secret, no send-test, a submit to try instead)."""
    name, dialect, batches = args.name, args.dialect, args.batch
    batches_only = not DIALECTS[dialect].single_responses  # no single responses to fetch
    var = name.upper()
    served = "; ".join(f"batch {b} ({n} rows)" for b, n in batches)
    lines = [
        f"provider simulator ({dialect} dialect) at {base_url}",
        (
            "every Message Batch submitted to it ends at once"
            if batches_only
            else "every resp_... id answers a generated completed response"
        )
        + (f"; {served}" if served else ""),
    ]
    if (per_min := _rate_limit(args)) is not None:
        lines.append(
            f"each API key may send {per_min} requests a minute (X-RateLimit-* headers, then "
            "429 with Retry-After; --rate-limit 0 turns this off)"
        )
    if secret is None:
        lines.append(
            f"{dialect} sends no webhooks: nopoll polls its results, so there is no webhook "
            "secret and nothing for send-test to sign"
        )
    lines += [
        "",
        "1. In the shell where you run nopoll:",
        "",
        f"export {var}_API_KEY={shlex.quote(api_key)}",
    ]
    if secret is not None:
        lines.append(f"export {var}_WEBHOOK_SECRET={shlex.quote(secret)}")
    lines += [
        "",
        f"2. Save as nopoll.yaml (or add the {name} provider to your own config):",
        "",
        "providers:",
        f"  {name}:",
        f"    dialect: {dialect}",
        f"    base_url: {base_url}",
        f"    api_key: ${{{var}_API_KEY}}",
    ]
    if secret is not None:
        lines.append(f'    webhook_secrets: ["${{{var}_WEBHOOK_SECRET}}"]')
    if DIALECTS[dialect].rate_limit_rps is not None:  # the real provider's, not this one's
        lines.append("    rate_limit_rps: null           # the simulator has no request limit")
    lines += [
        "sinks:",
        '  db: {type: sql, url: "sqlite:///nopoll-data/results.db"}',
        "",
    ]
    line = DIALECTS[dialect].sample_line
    if secret is not None:
        lines += [
            "3. Start nopoll, then send it a signed callback from another shell (same exports):",
            "",
            "nopoll serve --config nopoll.yaml",
            f"nopoll send-test --config nopoll.yaml {name}",
        ]
        lines += [
            f"nopoll send-test --config nopoll.yaml {name} --batch-id {b}" for b, _ in batches
        ]
        # this simulator calls nobody back: without --poll, submit --wait would wait
        # reconcile_after_s for a callback before its first poll
        lines += [
            "",
            "or submit a request; the simulator sends no callbacks itself, so --poll polls it "
            "at once:",
            "",
            f"echo '{line}' > requests.jsonl",
            f"nopoll submit --config nopoll.yaml {name} requests.jsonl --wait --poll",
        ]
    else:
        lines += [
            "3. Start nopoll, then submit a request from another shell (same export); nopoll "
            "polls it until it is done:",
            "",
            "nopoll serve --config nopoll.yaml",
            f"echo '{line}' > requests.jsonl",
            f"nopoll submit --config nopoll.yaml {name} requests.jsonl"
            + (" --batch" if batches_only else "")
            + " --wait",
        ]
        lines += [f"nopoll watch --config nopoll.yaml {name} batch {b} --wait" for b, _ in batches]
    lines += [
        "",
        "4. Look at the rows:",
        "",
        "sqlite3 nopoll-data/results.db "
        "'SELECT kind, key, status, output_text FROM nopoll_results'",
        "",
        "A second simulator next to this one needs a name and port of its own, e.g. "
        f"nopoll simulate --name other --port {_DEFAULT_SIM_PORT + 1} (its variables are "
        "then OTHER_...).",
        "Ctrl-C stops the simulator (the key above is new on every start)."
        if secret is None
        else "Ctrl-C stops the simulator (the secret and key above are new on every start).",
    ]
    return "\n".join(lines)


def _rate_limit(args: argparse.Namespace) -> int | None:
    """Requests a minute per API key: ``--rate-limit``, else the dialect's documented limit
    (Valar's 60; None, also for 0: no limit)."""
    from receiver.demo.profiles import PROFILES

    chosen = args.rate_limit
    if chosen is None:
        chosen = PROFILES[args.dialect].rate_limit_per_min
    return chosen or None


def _cmd_simulate(args: argparse.Namespace) -> int:
    from receiver.demo.simulator import ProviderSimulator

    api_key = "sk-sim-" + secrets.token_hex(20)
    secret: str | None = None
    if DIALECTS[args.dialect].sends_callbacks:
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    try:
        sim = ProviderSimulator(
            api_key=api_key,
            port=args.port,
            host=args.host,
            auto_respond=True,
            dialect=args.dialect,
            rate_limit_per_min=_rate_limit(args),
        )
    except OSError as exc:
        print(
            f"nopoll: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} "
            "(choose another --port)",
            file=sys.stderr,
        )
        return 1
    for batch_id, rows in args.batch:
        sim.add_batch(args.dialect, batch_id, rows)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with sim:
            base_url = sim.host_url + DIALECTS[args.dialect].base_path
            print(_instructions(args, base_url, api_key, secret))
            print(flush=True)
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"simulator stopped after {sim.request_count()} request(s)", flush=True)
    return 0


# --- nopoll send-test ------------------------------------------------------------------
def _signing_key(secret: str) -> str | bytes:
    """What the provider signs with: ``whsec_`` secrets as Standard Webhooks decodes them,
    any other secret as its UTF-8 bytes (the OpenAI SDK's rule, as nopoll verifies it)."""
    return secret if secret.startswith("whsec_") else secret.encode()


def _row_hint(settings: Settings, provider: str, kind: str, object_id: str) -> str | None:
    """Where to look for the row: the query for the first ``sql`` sink, if any."""
    # a summary's own row and its rows' all name the batch; a single result is its own key
    column = "batch_id" if KINDS[kind].summary else "key"
    where = f"{column} = '{object_id}'"
    for sink in settings.sinks.values():
        if sink.type != "sql":
            continue
        query = (
            f"SELECT kind, key, status, output_text FROM {sink.table} "
            f"WHERE provider = '{provider}' AND {where}"
        )
        # Names and ids are safe tokens ([A-Za-z0-9_.:-]), so double quotes are enough.
        url: str = sink.url.get_secret_value()
        if url.startswith("sqlite"):
            path = url.split(":///", 1)[1] if ":///" in url else url
            return f'sqlite3 {shlex.quote(path)} "{query}"'
        return f'psql <your database URL> -c "{query}"'  # the URL may hold a password
    return None


def _explain(
    response: httpx.Response, args: argparse.Namespace, kind: str, object_id: str
) -> tuple[bool, str]:
    """(success, the answer in words)."""
    try:
        payload: Any = response.json()
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        payload = {}
    why = str(payload.get("error") or payload.get("reason") or response.text[:200] or "no reason")
    code, state = response.status_code, payload.get("status")
    lands = (
        "its rows, then its summary, land in your sinks"
        if KINDS[kind].summary
        else "its row lands in your sinks"
    )
    if code == 202 and state == "queued":
        return (
            True,
            f"202 queued: nopoll verified the signature and queued {kind} {object_id}; "
            + (f"{lands} once the worker has fetched it"),
        )
    if code == 202 and state == "already_queued":
        return True, f"202 queued: a fetch of {kind} {object_id} was already pending and covers it"
    if code == 202 and state == "ignored":
        return True, f"202 ignored: {why}; nothing was queued"
    if code == 200 and state == "duplicate":
        return True, "200 duplicate: nopoll already had this webhook-id; nothing new was queued"
    if response.is_success:
        return True, f"{code}: {payload or response.text[:200]}"
    hints = {
        401: f"401 rejected: {why}. send-test signed with the first webhook secret of "
        f"providers.{args.provider}; does the nopoll at {args.url} run with the same config "
        "and environment?",
        404: f"404 not found: {why}. The nopoll at {args.url} has no provider "
        f"{args.provider!r} that takes callbacks: does it run with this config?",
        400: f"400 bad request: {why}",
        413: f"413 too large: {why}",
        503: f"503 unavailable: {why} (nopoll cannot reach its Redis; a provider would retry)",
    }
    return False, hints.get(code, f"{code}: {why}")


def _refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(10):  # the cause chain, bounded
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _signing_provider(settings: Settings, name: str, source: str) -> ProviderConfig:
    """The provider a test callback is sent for; it must take callbacks (have a secret)."""
    provider = settings.providers.get(name)
    if provider is None:
        configured = ", ".join(sorted(settings.providers)) or "none"
        raise ConfigError(f"provider {name!r} is not in {source} (configured: {configured})")
    if not provider.webhook_secrets:
        raise ConfigError(
            f"providers.{name} has no webhook_secrets in {source}: it takes no "
            "callbacks, so there is no secret to sign a test callback with"
        )
    return provider


def _load_for(args: argparse.Namespace, name: str) -> Settings:
    """The config as send-test needs it: only ``providers.<name>`` must be complete; an
    unset variable elsewhere (another provider's key, a sink's URL) is not its business."""
    settings = load_settings(config_path(args), require_env=False)
    needed = [
        f"{key}: environment variable {var} "
        f"{'is not set' if os.environ.get(var) is None else 'is set but empty'} "
        f"(send-test signs with providers.{name})"
        for key, names in settings.unset_env.items()
        if key == f"providers.{name}" or key.startswith(f"providers.{name}.")
        for var in names
    ]
    if needed:
        raise ConfigError("\n".join(needed))
    return settings


def _post_callback(
    url: str, target: str, body: bytes, headers: dict[str, str]
) -> httpx.Response | None:
    """POST the callback; None (after saying why) when nopoll could not be reached."""
    import httpx

    try:
        with httpx.Client(timeout=_TIMEOUT_S, trust_env=False) as client:
            return client.post(target, content=body, headers=headers)
    except httpx.ConnectError as exc:
        if _refused(exc):
            print(f"connection refused: is nopoll running at {url}?", file=sys.stderr)
        else:
            print(f"cannot connect to {url}: {exc}", file=sys.stderr)
    except httpx.TimeoutException:
        print(f"no answer from {url} within {_TIMEOUT_S:g} s", file=sys.stderr)
    except httpx.HTTPError as exc:
        print(f"request to {target} failed: {exc}", file=sys.stderr)
    return None


def _cmd_send_test(args: argparse.Namespace) -> int:
    import orjson

    from receiver.demo.simulator import sign_callback

    settings = _load_for(args, args.provider)
    source = args.config or os.environ.get("NOPOLL_CONFIG") or "the built-in defaults"
    provider = _signing_provider(settings, args.provider, source)
    kind = "batch" if args.batch_id else "response"
    object_id = args.batch_id or args.response_id or f"resp_{uuid.uuid4().hex}"
    event = args.event or ("batch.completed" if kind == "batch" else "response.completed")
    url = args.url.rstrip("/")
    target = f"{url}/webhooks/{args.provider}"
    msg_id = f"msg_{uuid.uuid4().hex}"
    body = orjson.dumps(
        {
            "id": f"evt_{uuid.uuid4().hex}",
            "type": event,
            "created_at": int(time.time()),
            "data": {"id": object_id},
        }
    )
    secret = provider.webhook_secrets[0].get_secret_value()
    headers = sign_callback(_signing_key(secret), msg_id, body)
    print(f"POST {target}")
    print(f"  {event} for {kind} {object_id}, webhook-id {msg_id}")
    print(f"  signed with the first webhook secret of providers.{args.provider}")
    response = _post_callback(url, target, body, headers)
    if response is None:
        return 1
    ok, words = _explain(response, args, kind, object_id)
    if not ok:
        print(words, file=sys.stderr)
        return 1
    print(words)
    hint = _row_hint(settings, args.provider, kind, object_id)
    if hint and words.startswith("202 queued"):
        print(f"see it: {hint}")
    for sink, state in _failing_sinks(url).items():
        print(f"but sink {sink} is {state}: the result waits and is retried; check sinks.{sink}")
    return 0


def _failing_sinks(url: str) -> dict[str, str]:
    """Sinks the running nopoll reports as failing in ``/readyz`` (none if it cannot say)."""
    import httpx

    try:
        with httpx.Client(timeout=_TIMEOUT_S, trust_env=False) as client:
            sinks = client.get(f"{url}/readyz").json().get("sinks") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    return {
        str(name): str(state)
        for name, state in sinks.items()
        if isinstance(state, str) and state.startswith("failing")
    }


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    _register_simulate(sub)
    _register_send_test(sub)


def _register_simulate(sub: Any) -> None:
    about = (
        "Run the provider simulator until Ctrl-C, and print its base URL, a new API key "
        "(and webhook secret, for a dialect whose provider sends webhooks), and the provider "
        "block for your config."
    )
    summary = "run a provider simulator to try nopoll with your own config"
    p = sub.add_parser("simulate", help=summary, description=about)
    p.add_argument(
        "--port", type=int, default=_DEFAULT_SIM_PORT, help=f"default {_DEFAULT_SIM_PORT}"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--dialect", choices=DIALECTS, default="openai", help="provider API to speak (openai)"
    )
    p.add_argument(
        "--name",
        type=_name,
        default=_SIM_NAME,
        help=f"the provider's name in the printed config, and of its variables "
        f"(NAME_API_KEY); default {_SIM_NAME}: give a second simulator another one",
    )
    p.add_argument(
        "--rate-limit",
        type=_per_minute,
        default=None,
        metavar="N",
        help="requests a minute per API key, with Valar's X-RateLimit-* headers and 429s "
        "(default: the dialect's documented limit, 60 for valar, none for the others; 0: off)",
    )
    p.add_argument(
        "--batch",
        type=_batch_spec,
        action="append",
        default=[],
        metavar="ID:ROWS",
        help="serve a completed batch of ROWS rows under ID (repeatable)",
    )
    p.set_defaults(func=_cmd_simulate)


def _register_send_test(sub: Any) -> None:
    p = sub.add_parser(
        "send-test",
        help="send a running nopoll one callback signed as PROVIDER would sign it",
        description="Sign a callback with PROVIDER's first webhook secret (Standard "
        "Webhooks), POST it to URL/webhooks/PROVIDER and say what the answer means. Exit "
        "status 0 on 2xx, 1 otherwise, 2 for a config problem.",
    )
    add_config_option(p)
    p.add_argument("provider", metavar="PROVIDER", help="a provider name from the config")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--response-id", help="the response id (default: a random resp_...)")
    which.add_argument("--batch-id", help="send a batch event for this batch id instead")
    p.add_argument("--url", default=_DEFAULT_URL, help=f"nopoll's address (default {_DEFAULT_URL})")
    p.add_argument(
        "--event",
        help="event type (default response.completed, or batch.completed with --batch-id)",
    )
    p.set_defaults(func=_cmd_send_test)
