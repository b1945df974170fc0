"""Batch row keys from provider data: a row without custom_id and a row whose custom_id
looks like its index are two rows, through the dialect and into a real sink."""

from __future__ import annotations

import sqlite3

from nopoll.envelope import envelope_from_row
from receiver.cli import main
from receiver.config.settings import HttpConfig, ProviderConfig
from receiver.providers import BatchFetch, ProviderClient, dialect_for

# Row 3 has no custom_id (its key is its line index); rows 5 and 4 have custom_ids that
# look like that index.
CUSTOM_IDS = {3: None, 5: "3", 4: "~3"}
KEYS = {
    "batch_k/row-000000",
    "batch_k/row-000001",
    "batch_k/row-000002",
    "batch_k/~3",
    "batch_k/~~3",
    "batch_k/3",
}


async def test_sference_index_row_and_custom_id_3_get_distinct_keys(provider_sim):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sference", "batch_k", 6, custom_ids=CUSTOM_IDS)
    cfg = ProviderConfig(
        dialect="sference", base_url=sim.base_url, api_key="sk-test", webhook_secrets=["x"]
    )
    client = ProviderClient("sim", cfg, HttpConfig())
    envelopes = []
    async for _, chunk in dialect_for("sference", client).batch_chunks(BatchFetch("batch_k")):
        envelopes += [
            envelope_from_row(r, provider="sim", batch_id="batch_k", received_at="t", event_id=None)
            for r in chunk
        ]
    await client.aclose()
    assert {e.key for e in envelopes} == KEYS and len(envelopes) == 6
    by_key = {e.key: e for e in envelopes}
    assert by_key["batch_k/~3"].custom_id is None
    assert by_key["batch_k/3"].custom_id == "3" and by_key["batch_k/~~3"].custom_id == "~3"
    assert by_key["batch_k/~3"].output_text == "answer 3"
    assert by_key["batch_k/3"].output_text == "answer 5"


def test_both_rows_land_in_the_sql_sink(provider_sim, redis_url, tmp_path, capsys):
    sim = provider_sim(api_key="sk-test")
    sim.add_batch("sference", "batch_k", 6, custom_ids=CUSTOM_IDS)
    db = tmp_path / "results.db"
    config = tmp_path / "nopoll.yaml"
    config.write_text(
        f"redis_url: '{redis_url}'\n"
        f"data_dir: {tmp_path / 'data'}\n"
        "providers:\n"
        "  sim: {dialect: sference, base_url: '" + sim.base_url + "', api_key: sk-test,"
        " webhook_secrets: [whsec_aGk=]}\n"
        f"sinks:\n  db: {{type: sql, url: 'sqlite+aiosqlite:///{db}', table: results}}\n"
    )
    assert main(["fetch-batch", "--config", str(config), "sim", "batch_k"]) == 0
    assert "6 rows delivered" in capsys.readouterr().out
    with sqlite3.connect(db) as conn:
        rows = dict(conn.execute("SELECT key, custom_id FROM results WHERE kind = 'batch_row'"))
    assert set(rows) == KEYS
    assert rows["batch_k/~3"] is None and rows["batch_k/3"] == "3" and rows["batch_k/~~3"] == "~3"
