"""The next nopoll, as far as a worker of this one can tell: ``receiver/queue/jobs.py``
with its job-payload version raised to 3 and its batch-progress version to 2, still
reading every older version. Used to run a rolling upgrade for real, from a copied tree
(``tests/e2e``) or a derived image (``tests/deploy``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "receiver" / "queue" / "jobs.py"

_RAISED = (
    (r"^PAYLOAD_VERSION = 1$", "PAYLOAD_VERSION = 3"),
    (r"^STATE_VERSION = 1$", "STATE_VERSION = 2"),
    (
        r"^_READS_VERSIONS = frozenset\(\{PAYLOAD_VERSION, PUSHED_VERSION\}\)$",
        "_READS_VERSIONS = frozenset({1, PAYLOAD_VERSION, PUSHED_VERSION})",
    ),
    (
        r"^_READS_STATE_VERSIONS = frozenset\(\{STATE_VERSION\}\)$",
        "_READS_STATE_VERSIONS = frozenset({1, STATE_VERSION})",
    ),
)


def newer_jobs_source() -> str:
    """This tree's jobs.py with its versions raised (fails when the lines moved)."""
    text = JOBS.read_text()
    for old, new in _RAISED:
        text, n = re.subn(old, new, text, flags=re.MULTILINE)
        assert n == 1, f"jobs.py no longer has {old!r}: update tests/newer.py"
    return text


def newer_tree(tmp: Path) -> Path:
    """A copy of ``receiver/`` with the newer jobs.py: put it first on PYTHONPATH."""
    where = tmp / "newer"
    shutil.copytree(ROOT / "receiver", where / "receiver", ignore=shutil.ignore_patterns("*.pyc"))
    (where / "receiver" / "queue" / "jobs.py").write_text(newer_jobs_source())
    return where
