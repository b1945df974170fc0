"""``helm test``: nopoll answers a correctly signed callback and rejects a forged one.

For every configured provider, posts a Standard Webhooks callback of type ``nopoll.test``
signed with the provider's first webhook secret to ``$NOPOLL_TEST_URL/webhooks/<name>``.
nopoll verifies it and, as the type is not one it handles, answers 202 without queueing
anything: this proves the secrets, the service and signature verification end to end
without calling a provider. The same body with a wrong signature must answer 401, and
/readyz must answer 200 (Redis reachable).

With ``NOPOLL_TEST_RESPONSE_ID`` (the chart's ``tests.roundTrip.responseId``) it also posts
a signed ``response.completed`` callback for that id to the first provider and waits until
the result has landed in the sinks, asking the results API (``GET /v1/results/...?wait=``)
with the first consumer token: the workers, the provider and the sinks, end to end.
Exit status 0 when all of that holds.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from datetime import UTC, datetime

import httpx
import orjson
from standardwebhooks.webhooks import Webhook

from nopoll.wire import decode_webhook_secret
from receiver.config.settings import Settings, load_settings

_WAIT_S = 60.0


def _get_ready(client: httpx.Client, base: str) -> str | None:
    """None once /readyz answers 200 (waiting up to a minute), else the last answer."""
    deadline = time.monotonic() + _WAIT_S
    last = "no answer"
    while True:
        try:
            resp = client.get(f"{base}/readyz")
            if resp.status_code == 200:
                return None
            last = f"{resp.status_code} {resp.text}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            return last
        time.sleep(1)


def _signed(secret: str, body: bytes, *, forged: bool = False) -> dict[str, str]:
    msg_id = f"msg_nopolltest_{uuid.uuid4().hex}"
    now = datetime.now(tz=UTC)
    signature = Webhook(decode_webhook_secret(secret)).sign(msg_id, now, body.decode())
    if forged:
        signature = "v1," + "A" * 43 + "="
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
        "content-type": "application/json",
    }


def _round_trip(client: httpx.Client, base: str, settings: Settings, response_id: str) -> str:
    """'' when the callback for ``response_id`` answered 2xx and its result landed."""
    providers, tokens = settings.providers, settings.consumer_tokens
    if not providers or not tokens:
        return "round trip: needs a provider and config.consumer_tokens (the results API)"
    name, provider = next(iter(providers.items()))
    body = orjson.dumps(
        {
            "id": f"evt_nopolltest_{uuid.uuid4().hex}",
            "type": "response.completed",
            "created_at": int(time.time()),
            "data": {"id": response_id},
        }
    )
    secret = provider.webhook_secrets[0].get_secret_value()
    resp = client.post(f"{base}/webhooks/{name}", content=body, headers=_signed(secret, body))
    if resp.status_code // 100 != 2:
        return f"round trip: the callback answered {resp.status_code}"
    token = tokens[0].token.get_secret_value()
    deadline = time.monotonic() + float(os.environ.get("NOPOLL_TEST_TIMEOUT_S") or _WAIT_S)
    last = "no answer"
    while time.monotonic() < deadline:
        wait = max(1, min(30, int(deadline - time.monotonic())))
        try:
            got = client.get(
                f"{base}/v1/results/{name}/{response_id}",
                params={"wait": wait},
                headers={"authorization": f"Bearer {token}"},
                timeout=wait + 10,
            )
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(1)
            continue
        if got.status_code == 200 and got.json().get("key") == response_id:
            print(f"ok: {name}: {response_id} landed")
            return ""
        last = f"{got.status_code} {got.text[:200]}"
        if got.status_code != 404:
            time.sleep(1)
    return f"round trip: {response_id} did not land: {last}"


def main() -> int:
    base = os.environ["NOPOLL_TEST_URL"].rstrip("/")
    settings = load_settings(os.environ.get("NOPOLL_CONFIG") or "/etc/nopoll/nopoll.yaml")
    failures: list[str] = []
    with httpx.Client(timeout=10) as client:
        problem = _get_ready(client, base)
        if problem is not None:
            failures.append(f"GET /readyz: expected 200, got {problem}")
        else:
            print("ok: /readyz answers 200")
        for name, provider in settings.providers.items():
            url = f"{base}/webhooks/{name}"
            body = orjson.dumps(
                {
                    "id": f"evt_nopolltest_{uuid.uuid4().hex}",
                    "type": "nopoll.test",
                    "created_at": int(time.time()),
                    "data": {"id": "nopoll_helm_test"},
                }
            )
            secret = provider.webhook_secrets[0].get_secret_value()
            resp = client.post(url, content=body, headers=_signed(secret, body))
            if resp.status_code == 202 and resp.json().get("status") == "ignored":
                print(f"ok: {name}: a signed test callback answers 202")
            else:
                failures.append(f"{name}: signed callback: expected 202, got {resp.status_code}")
            resp = client.post(url, content=body, headers=_signed(secret, body, forged=True))
            if resp.status_code == 401:
                print(f"ok: {name}: a forged signature answers 401")
            else:
                failures.append(f"{name}: forged callback: expected 401, got {resp.status_code}")
        response_id = os.environ.get("NOPOLL_TEST_RESPONSE_ID", "")
        if response_id and not failures:
            problem = _round_trip(client, base, settings, response_id)
            if problem:
                failures.append(problem)
    if not settings.providers:
        print("no providers configured: only /readyz was checked")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
