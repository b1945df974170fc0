"""The Dockerfile read as data: its instructions by stage, its base image, and the build
context .dockerignore lets through (for tests/deploy/test_image*.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.deploy.chart import (
    ROOT,
)

DOCKERFILE = ROOT / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    out = []
    for line in logical:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions by build stage name."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions():
        if word == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else str(len(result))
            current = result.setdefault(name, [])
        if current is not None:
            current.append((word, rest))
    return result


def base_image() -> str:
    [arg] = [r for w, r in instructions() if w == "ARG" and r.startswith("PYTHON_IMAGE=")]
    return arg.split("=", 1)[1]


# --- .dockerignore: the build context ----------------------------------------------------


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def build_context(root: Path = ROOT) -> list[str]:
    """Files Docker would send as the build context, per Docker's .dockerignore rules.

    The last matching pattern wins, ``!`` re-includes, and a pattern that matches a
    directory matches everything below it. Enough of the rules for this repository's
    allowlist (directories excluded with no ``!`` pattern inside them are not walked).
    """
    rules = []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern(line.lstrip("!").strip("/"))))
    negated = [
        line.strip().lstrip("!").strip("/")
        for line in (root / ".dockerignore").read_text().splitlines()
        if line.strip().startswith("!")
    ]

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        result = False
        for negate, rx in rules:
            if any(rx.match(p) for p in prefixes):
                result = not negate
        return result

    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [
            d
            for d in dirnames
            if not excluded(rel_dir + d)
            or any(n == rel_dir + d or n.startswith(rel_dir + d + "/") for n in negated)
        ]
        files += [rel_dir + f for f in filenames if not excluded(rel_dir + f)]
    return sorted(files)
