"""docs/architecture.md's "Follow one step": every hop links to a file of the repo and names a function or class
defined there (``Class.method`` both), so the walk-through stays true as the code moves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[`([\w.]+)`\]\(\.\./([\w/.]+\.py)\)")


def _section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    m = re.search(r"^## Follow one step\n(.*?)^## ", text, re.S | re.M)
    assert m, "docs/architecture.md lost its 'Follow one step' section"
    return m.group(1)


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b", source, re.M) is not None


def test_every_hop_links_to_a_definition() -> None:
    links = LINK.findall(_section())
    assert len(links) >= 20, f"too few hops found ({len(links)}): the link pattern or the section changed"
    wrong = []
    for name, path in links:
        file = ROOT / path
        if not file.is_file():
            wrong.append(f"{path} does not exist ({name})")
            continue
        source = file.read_text(encoding="utf-8")
        missing = [part for part in name.split(".") if not _defines(source, part)]
        if missing:
            wrong.append(f"{path} defines no {' / '.join(missing)} (linked as {name})")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_moved_function(tmp_path: Path) -> None:
    assert _defines("class A:\n    async def run(self):\n", "run") and _defines("def f():\n", "f")
    assert not _defines("def run_step():\n", "run") and not _defines("# def gone\n", "gone")
