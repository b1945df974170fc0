"""The extras in pyproject.toml exist: pip warns about, and skips, an extra a package lacks
(``aiobotocore[boto3]`` after aiobotocore dropped it), so a dependency silently goes missing."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def test_every_requested_extra_is_provided_by_its_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"]]
    for group in project["optional-dependencies"].values():
        requirements += group
    checked = 0
    for line in requirements:
        req = Requirement(line)
        if not req.extras or req.name == "nopoll":
            continue
        try:
            provided = set(metadata(req.name).get_all("Provides-Extra") or [])
        except PackageNotFoundError:  # not installed here: nothing to compare with
            continue
        checked += 1
        assert req.extras <= provided, f"{line}: {req.name} has no extra {req.extras - provided}"
    assert checked >= 2


def test_sql_postgres_extra_is_named_in_the_docs() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert "pip install 'nopoll[postgres]'" in doc
