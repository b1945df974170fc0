from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.helpers import Processes
from tests.e2e.losses import BATCH


@pytest.fixture
def procs(tmp_path: Path, webhook_secret: str) -> Iterator[Processes]:
    env = {**os.environ, "SIM_SECRET": webhook_secret}
    p = Processes(tmp_path, env)
    yield p
    p.stop_all()


@pytest.fixture
def loss_stack(make_settings, redis_url, provider_sim, pg_url, pg_table, tmp_path):
    """Factory: (settings, simulator) for one provider ``sim`` in ``dialect``, Postgres (or
    ``sinks``) and small batches (``BATCH``): the loss-path tests' set-up."""

    def make(dialect: str = "openai", *, sinks: dict | None = None, **overrides):
        sim = provider_sim(api_key="sk-test-not-a-real-key")
        settings = make_settings(
            sim.base_url,
            redis_url=redis_url,
            sinks=sinks or {"warehouse": {"type": "sql", "url": pg_url, "table": pg_table}},
            batch=overrides.pop("batch", BATCH),
            **overrides,
        )
        provider = settings.providers["sim"].model_copy(update={"dialect": dialect})
        return settings.model_copy(update={"providers": {"sim": provider}}), sim

    return make
