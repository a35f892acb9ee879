"""The docs hold together: every relative link in the README and docs/ reaches a file and, where it
names one, a heading; every section the code cites by title (docs/<page>.md, "Title") exists."""
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CITATION = re.compile(r"docs/(\w+)\.md,? \(?\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def headings(page: Path) -> tuple[str, ...]:
    """The page's headings, outside code blocks (read once per page: many links share a target)."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return tuple(found)


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors GitHub gives the page's headings; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(page):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return frozenset(out)


def test_slug_follows_githubs_rule():
    assert slug("Eq. 7's encoder weight: 10, and what it costs") == "eq-7s-encoder-weight-10-and-what-it-costs"
    assert slug("q_ψ's prior") == "q_ψs-prior"
    assert slug("Mask (A)") == "mask-a"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_every_section_the_code_cites_by_title_exists():
    missing = []
    sources = [ROOT / "cli.py", *sorted((ROOT / "vase").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]
    for source in sources + sorted(p for p in (ROOT / ".ci").iterdir() if p.is_file()):
        # A citation may break across lines of a comment or a docstring.
        text = re.sub(r"\n\s*#?\s*", " ", source.read_text())
        for name, title in CITATION.findall(text):
            page = ROOT / "docs" / f"{name}.md"
            wanted = title.replace("psi", "ψ").lower()
            if not page.exists() or not any(h.lower().startswith(wanted) for h in headings(page)):
                missing.append(f"{source.name}: docs/{name}.md, {title!r}")
    assert not missing, missing
