from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.helpers import Processes


@pytest.fixture
def procs(tmp_path: Path, webhook_secret: str) -> Iterator[Processes]:
    env = {**os.environ, "SIM_SECRET": webhook_secret}
    p = Processes(tmp_path, env)
    yield p
    p.stop_all()
