"""The README as a new user follows it: its commands run as written, its code runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[tuple[int, str]]:
    """(offset in the README, text) of every fenced block in ``language``."""
    return [
        (m.start(), m.group(1))
        for m in re.finditer(rf"^```{language}\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)
    ]


def test_a_bare_nopoll_command_comes_after_saying_to_activate_the_venv():
    """The install line puts nopoll into .venv; a shell block that runs a bare ``nopoll``
    works only in a shell where that venv is active, so the README says so first."""
    activate = README.find("source .venv/bin/activate")
    bare = [
        (at, line)
        for at, block in _blocks("bash")
        for line in block.splitlines()
        if re.match(r"^nopoll\b", line)
    ]
    assert bare, "the README runs no bare nopoll command any more: drop this test"
    assert activate != -1, "the README never says to activate .venv"
    early = [line for at, line in bare if at < activate]
    assert not early, f"run before the README says to activate .venv: {early}"
