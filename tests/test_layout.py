"""The tree's layout: module docstrings say what a module holds; the design prose is in docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nopoll", "sinks", "receiver")
MAX_DOCSTRING_WORDS = 100
DOCS_PATH = re.compile(r"docs/[A-Za-z0-9_./-]*?\.md")


def _module_docstrings() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            if doc:
                found.append((path.relative_to(ROOT).as_posix(), doc))
    return found


DOCSTRINGS = _module_docstrings()


def test_the_packages_have_module_docstrings() -> None:
    assert len(DOCSTRINGS) > 50


@pytest.mark.parametrize(("module", "doc"), DOCSTRINGS, ids=[m for m, _ in DOCSTRINGS])
def test_a_module_docstring_is_at_most_100_words(module: str, doc: str) -> None:
    words = len(doc.split())
    assert words <= MAX_DOCSTRING_WORDS, (
        f"{module}: its docstring is {words} words; keep what the module holds and "
        "move the design prose to docs/ (link it as 'See docs/<page>.md')"
    )


@pytest.mark.parametrize(("module", "doc"), DOCSTRINGS, ids=[m for m, _ in DOCSTRINGS])
def test_every_docs_page_a_module_docstring_names_exists(module: str, doc: str) -> None:
    missing = [p for p in DOCS_PATH.findall(doc) if not (ROOT / p).is_file()]
    assert not missing, f"{module} names docs pages that do not exist: {missing}"
