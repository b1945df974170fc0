"""Package boundaries: what imports what, and the public surface."""

from __future__ import annotations

import subprocess
import sys

import receiver


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return set(out.split())


def test_the_service_never_loads_the_demo_or_the_simulator() -> None:
    loaded = _modules_after(
        "import receiver.runtime, receiver.worker.process, receiver.app, receiver.worker.state"
    )
    assert not {m for m in loaded if m.startswith("receiver.demo")}


def test_the_core_and_the_sinks_do_not_import_the_service() -> None:
    loaded = _modules_after("import nopoll, nopoll.wire, sinks, sinks.sql, sinks.jsonl")
    assert not {m for m in loaded if m == "receiver" or m.startswith("receiver.")}


def test_the_public_surface_resolves() -> None:
    for name in receiver.__all__:
        assert getattr(receiver, name) is not None
    assert sorted(dir(receiver)) == sorted(receiver.__all__)
