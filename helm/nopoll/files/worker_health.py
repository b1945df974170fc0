"""Liveness probe of a nopoll worker pod: exit 0 while a worker heartbeat is in Redis.

arq workers refresh the key ``nopoll:jobs:health-check`` every
``worker.health_check_interval_s`` seconds with a time-to-live one second longer. The key
is shared by every worker of the queue, so this proves that some worker is looping, not
necessarily this one (docs/deployment.md). Redis being unreachable exits 0: restarting the
worker would not bring Redis back, and the API's /readyz already reports it.

Run inside the nopoll image: ``python /etc/nopoll/worker_health.py`` (config from
``$NOPOLL_CONFIG``, default /etc/nopoll/nopoll.yaml).
"""

from __future__ import annotations

import os
import sys

import redis

from receiver.config import load_settings
from receiver.worker import HEALTH_CHECK_KEY


def main() -> int:
    settings = load_settings(os.environ.get("NOPOLL_CONFIG") or "/etc/nopoll/nopoll.yaml")
    url = settings.redis_url.get_secret_value()
    if not url:
        print("no redis_url: the embedded Redis is not shared, nothing to check", file=sys.stderr)
        return 0
    client = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        alive = client.exists(HEALTH_CHECK_KEY)
    except (redis.RedisError, OSError) as exc:
        print(f"redis unreachable ({type(exc).__name__}): not the worker's fault", file=sys.stderr)
        return 0
    finally:
        client.close()
    if alive:
        print("worker heartbeat ok")
        return 0
    print(f"no worker heartbeat: {HEALTH_CHECK_KEY} is not in Redis", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
