"""ComfyUI's node docs (``web/docs/<NODE_CLASS_MAPPINGS key>.md``) are README's node sections, written by
``scripts/node_docs.py``: a doc that differs from what it writes, a node without a section, an input without its
README row or a section without its wiring fails here."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from tests.node_history import ROOT, node_classes  # noqa: E402

pytestmark = pytest.mark.fast

_spec = importlib.util.spec_from_file_location("node_docs", ROOT / "scripts" / "node_docs.py")
node_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(node_docs)
CLASSES = node_classes()
SECTIONS = node_docs.sections((ROOT / "README.md").read_text(encoding="utf-8"))


def test_every_node_has_a_readme_section_and_a_doc():
    assert set(SECTIONS) == set(CLASSES)
    assert sorted(p.name for p in node_docs.DOCS.glob("*.md")) == sorted(f"{k}.md" for k in CLASSES)


@pytest.mark.parametrize("key", sorted(CLASSES))
def test_doc_is_the_readme_section(key):
    got = (node_docs.DOCS / f"{key}.md").read_text(encoding="utf-8")
    assert got == node_docs.expected()[f"{key}.md"], f"web/docs/{key}.md is stale: run python scripts/node_docs.py"


@pytest.mark.parametrize("key", sorted(CLASSES))
def test_section_has_every_input_and_a_wiring(key):
    display, _kind, body = SECTIONS[key]
    spec = CLASSES[key].INPUT_TYPES()
    for part in ("required", "optional"):
        for name in spec.get(part, {}):
            row = f"| `{name}`" + (" (optional)" if part == "optional" else "") + " |"
            assert row in body, f"README's {display} table has no row {row!r}"
    assert "**Wiring:**" in body, f"README's {display} section has no **Wiring:** line"
