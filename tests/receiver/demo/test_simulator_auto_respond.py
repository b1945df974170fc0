"""The simulator's auto-respond mode: on for ``nopoll simulate``, off for everything else."""

from __future__ import annotations

import httpx

from receiver.demo.simulator import generated_response


def test_unknown_response_ids_are_404_by_default(provider_sim):
    sim = provider_sim()
    r = httpx.get(f"{sim.base_url}/responses/resp_unknown", timeout=5, trust_env=False)
    assert r.status_code == 404


def test_auto_respond_answers_any_response_id_the_same_way_every_time(provider_sim):
    sim = provider_sim(auto_respond=True)
    sim.add_response("resp_known", text="registered wins")
    with httpx.Client(timeout=5, trust_env=False) as client:
        a = client.get(f"{sim.base_url}/responses/resp_generated_1")
        b = client.get(f"{sim.base_url}/responses/resp_generated_1")
        known = client.get(f"{sim.base_url}/responses/resp_known")
        other = client.get(f"{sim.base_url}/responses/msg_not_a_response")
    assert a.status_code == 200 and a.json() == b.json()
    assert a.json() == generated_response("resp_generated_1")
    assert a.json()["id"] == "resp_generated_1" and a.json()["status"] == "completed"
    assert known.json()["output"][-1]["content"][0]["text"] == "registered wins"
    assert other.status_code == 404


def test_generated_responses_differ_by_id():
    texts = {generated_response(f"resp_{i}")["output"][-1]["content"][0]["text"] for i in range(20)}
    assert len(texts) > 1
