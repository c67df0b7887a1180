"""Every ``§`` the code cites names one of the repo's own pages (``docs/<page>.md §N``) and a
section that page has: ``§N`` a heading ``N. ...``; ``§N.M`` item ``M.`` of section N's numbered
list, or a heading ``N.M ...``."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
CODE = ("h3ms_async", "workers", "nodes", "tests", "web", "scripts", "benchmarks")
SUFFIXES = {".py", ".js", ".sh", ".css", ".html"}
#: a doc named this close before a ``§`` is the page it cites
NEAR = 300
DOC = re.compile(r"docs/([\w-]+\.md)")
ANCHOR = re.compile(r"§(\d+)(?:\.(\d+))?")


def _anchors(page: Path) -> set[str]:
    """``N`` per heading ``N. title``; ``N.M`` per heading ``N.M title``, per item ``M.`` of N."""
    found: set[str] = set()
    section = None
    for line in page.read_text(encoding="utf-8").splitlines():
        if heading := re.match(r"#+\s+(\d+)(?:\.(\d+))?\.?\s", line):
            section = heading[1]
            found.add(section if heading[2] is None else f"{section}.{heading[2]}")
        elif line.startswith("#"):
            section = None
        elif section is not None and (item := re.match(r"(\d+)\.\s", line)):
            found.add(f"{section}.{item[1]}")
    return found


def _citations() -> list[tuple[str, str | None, str]]:
    """``(where, page, anchor)`` per ``§`` in the code; page None when none is named just before."""
    out = []
    for top in CODE:
        for path in sorted((ROOT / top).rglob("*")):
            own = path.name == Path(__file__).name
            if path.suffix not in SUFFIXES or own or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for m in ANCHOR.finditer(text):
                named = DOC.findall(text[max(0, m.start() - NEAR):m.start()])
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{path.relative_to(ROOT)}:{line}", named[-1] if named else None,
                            m[1] if m[2] is None else f"{m[1]}.{m[2]}"))
    return out


def test_every_section_the_code_cites_exists_in_the_named_doc() -> None:
    cites = _citations()
    assert cites, "no § citations found: the scan is broken"
    wrong = []
    for where, page, anchor in cites:
        if page is None:
            wrong.append(f"{where}: §{anchor} names no page (write docs/<page>.md §{anchor})")
        elif not (ROOT / "docs" / page).is_file():
            wrong.append(f"{where}: docs/{page} does not exist")
        elif anchor not in _anchors(ROOT / "docs" / page):
            wrong.append(f"{where}: docs/{page} has no section §{anchor}")
    assert not wrong, "\n".join(wrong)


def test_the_anchor_reader_finds_headings_and_numbered_items(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n## 1. One\n\n1. **a.** x\n2. **b.** y\n   3. not an item\n\n"
                    "## Two\n\n4. no\n### 3.2 Sub\n", encoding="utf-8")
    assert _anchors(page) == {"1", "1.1", "1.2", "3.2"}
