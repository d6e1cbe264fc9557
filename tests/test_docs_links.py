"""The README is a front door, not a wall, and the documents stand on their own: every relative link in
README.md, docs/*.md and bench/README.md resolves (file and heading) inside the repository, no document points
outside it, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\n(?!\n))*?\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
OUTSIDE = [(re.compile(r"\.\./shared|(?<![\w.])shared/(traces|engines|research)"), "the shared folder"),
           (re.compile(r"\b[Ii]ssue[ -]?#?\d+"), "an issue number"),
           (re.compile(r"research §|§\s?\d"), "a research note")]


def _prose(path: Path) -> str:
    return FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert doc.is_file()
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_points_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    found = [f"{what}: {m.group(0)!r}" for pattern, what in OUTSIDE for m in pattern.finditer(text)]
    assert not found, f"{doc.relative_to(ROOT)} points outside the repository:\n" + "\n".join(found)


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move the depth to docs/"
    top = "\n".join(lines[:12])
    assert ".venv/bin/kvroute demo" in top and "bash tests/run.sh" in top, "the two set-up commands come first"


def test_ci_runs_the_readmes_test_command() -> None:
    assert "bash tests/run.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_anchor_rule() -> None:
    sample = ROOT / "docs" / "reference.md"
    assert "apps-on-a-proxy-without-litellms-database-kvrouteapps" in anchors(sample)
