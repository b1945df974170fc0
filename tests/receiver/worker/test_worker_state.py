"""The worker process's state: built once, shared by its workers, and the GC settings
that come with it (receiver.worker.state)."""

from __future__ import annotations

import gc
from typing import Any

from receiver.metrics import Metrics
from receiver.redis import RedisConnector
from receiver.worker.process import Shared, shutdown, startup


async def test_the_gc_is_set_for_jobs_while_the_state_is_open_then_restored(
    make_settings: Any, redis_url: str
) -> None:
    before = gc.get_threshold()
    shared = Shared(RedisConnector.from_url(redis_url))
    contexts = [
        {"shared": shared, "settings": make_settings(redis_url=redis_url), "metrics": Metrics()}
        for _ in range(2)  # a process's two workers share one state
    ]
    for ctx in contexts:
        await startup(ctx)
    try:
        assert contexts[0]["state"] is contexts[1]["state"]
        assert gc.get_threshold() != before and gc.get_freeze_count() > 0
        await shutdown(contexts[0])
        assert shared.state is not None  # the other worker still runs
        assert gc.get_threshold() != before
    finally:
        await shutdown(contexts[1])
    assert shared.state is None
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
