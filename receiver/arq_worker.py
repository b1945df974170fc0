"""arq's Worker with a one-round-trip job claim.

arq claims each job it polled with its own optimistic transaction: WATCH the
in-progress key, EXISTS, ZSCORE, then MULTI/PSETEX/EXEC, about four round trips per job
before it runs. Under a steady stream of callbacks that is most of the worker's Redis
traffic. :class:`NopollWorker` claims every polled job in one Lua script with the same
rule (not already in progress, score due) and the same in-progress key and expiry, then
runs each exactly as arq does (``run_job``), so jobs, retries and results are arq's own.
"""

from __future__ import annotations

import time
from typing import Any

from arq.constants import in_progress_key_prefix
from arq.utils import timestamp_ms
from arq.worker import Worker

__all__ = ["NopollWorker"]

_CLAIM = """
local claimed = {}
local now = tonumber(ARGV[1])
for i = 3, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score and tonumber(score) <= now and redis.call('EXISTS', KEYS[2] .. id) == 0 then
    redis.call('PSETEX', KEYS[2] .. id, ARGV[2], '1')
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = score
  end
end
return claimed
"""


class NopollWorker(Worker):
    """An arq Worker whose job claim is one Lua call per poll instead of ~4 round trips per job."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._claim_script: Any = None
        self.last_beat: float | None = None
        """When this process last turned its poll loop (``nopoll worker --health-port``)."""

    async def heart_beat(self) -> None:
        await super().heart_beat()
        self.last_beat = time.monotonic()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        free = self.max_jobs - self.job_counter
        if free <= 0 or not job_ids:
            return
        if self._claim_script is None:
            self._claim_script = self.pool.register_script(_CLAIM)
        ids = [j.decode() for j in job_ids[:free]]
        timeout_ms = int(self.in_progress_timeout_s * 1000)
        claimed = await self._claim_script(
            keys=[self.queue_name, in_progress_key_prefix],
            args=[timestamp_ms(), timeout_ms, *ids],
        )
        for i in range(0, len(claimed), 2):
            job_id = claimed[i].decode()
            score = int(float(claimed[i + 1]))
            await self.sem.acquire()
            self.job_counter += 1
            task = self.loop.create_task(self.run_job(job_id, score))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task
