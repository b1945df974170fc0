"""Token usage through a real ``nopoll serve``: ``nopoll_tokens_total`` on /metrics from the
landed results' usage, and the overview's tokens by model (read back from Redis, where
every process adds its own)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import await_ready, logged_in_as, post, wait_for, write_config
from tests.servers import free_port

ADMIN = "tokens-admin-token-0123456789abcdef"


def _tokens(text: str) -> dict[tuple[str, ...], float]:
    """``nopoll_tokens_total`` samples by (provider, model, tenant, kind, direction)."""
    labels = ("provider", "model", "tenant", "kind", "direction")
    return {
        tuple(s.labels[k] for k in labels): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "nopoll_tokens_total"
    }


async def test_landed_usage_is_counted_and_shown_by_model(
    procs, tmp_path, provider_sim, redis_url, signed_callback
):
    sim = provider_sim()
    sim.add_response("resp_t1")  # make_response's usage: 21 input, 7 output tokens
    sim.add_response("resp_t2", model="sim-model-2")
    sim.add_response("resp_t3", model="sim-model-2")
    config = write_config(
        tmp_path, sim.base_url, redis_url=redis_url, extra=f"admin_tokens: ['{ADMIN}']\n"
    )
    port = free_port()
    procs.start("serve", "--config", str(config), "--port", str(port))
    await await_ready(port)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        for rid in ("resp_t1", "resp_t2", "resp_t3"):
            assert (await post(base, *signed_callback(rid))).status_code == 202

        async def counted():
            found = _tokens((await client.get("/metrics")).text)
            return found if sum(found.values()) >= 3 * 28 else None

        tokens = await wait_for(counted, timeout=30)
        assert tokens == {
            ("sim", "sim-model-1", "default", "response", "input"): 21.0,
            ("sim", "sim-model-1", "default", "response", "output"): 7.0,
            ("sim", "sim-model-2", "default", "response", "input"): 42.0,
            ("sim", "sim-model-2", "default", "response", "output"): 14.0,
        }

        await logged_in_as(client, ADMIN)

        async def shown():  # the activity recorder adds them to Redis every 5 s
            page = (await client.get("/ui/")).text
            return page if "sim-model-2" in page and ">56<" in page else None

        page = await wait_for(shown, timeout=30)
        table = page.split('data-testid="tokens"', 1)[1].split("</table>", 1)[0]
        rows = [r for r in table.split("<tr>")[2:]]
        assert "sim-model-2" in rows[0] and "<td>56</td>" in rows[0]  # the busiest first
        assert "sim-model-1" in rows[1] and "<td>28</td>" in rows[1]
        assert 'aria-label="Tokens by model, last 24 hours: 84 in all' in page

        overview = await client.get(
            "/admin/v1/overview", headers={"authorization": f"Bearer {ADMIN}"}
        )
        models = overview.json()["tokens"]["models"]
        assert {m: sum(v) for m, v in models.items()} == {"sim-model-2": 56, "sim-model-1": 28}
