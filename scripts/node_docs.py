"""Write ComfyUI's node docs (``web/docs/<NODE_CLASS_MAPPINGS key>.md``, shown in the frontend's node-docs panel)
from README.md's node sections, so the two say the same: ``python scripts/node_docs.py`` after editing a section.
``tests/test_node_docs.py`` fails when a doc differs from what this writes, or a section misses a node's input."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "web" / "docs"
#: A node section's heading: "### <display name> (`<class key>`) — <what it takes and gives>".
HEADING = re.compile(r"^### (?P<display>.+?) \(`(?P<key>\w+)`\) — (?P<kind>.+)$")
#: A link to a file of the repository ("[text](docs/x.md)"): outside the repository it reads as its path.
RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:)([^)]+)\)")


def sections(readme: str) -> dict[str, tuple[str, str, str]]:
    """Class key -> (display name, kind, body) for every node section under README's "## Nodes"."""
    lines = readme.split("\n")
    start = lines.index("## Nodes")
    found: dict[str, tuple[str, str, str]] = {}
    current: re.Match | None = None
    body: list[str] = []
    for line in lines[start + 1:] + ["## end"]:
        heading = HEADING.match(line)
        if heading or line.startswith("## ") or line.startswith("### "):
            if current:
                found[current["key"]] = (current["display"], current["kind"], "\n".join(body).strip())
            current, body = heading, []
            if line.startswith("## "):
                break
        elif current:
            body.append(line)
    return found


def render(display: str, key: str, kind: str, body: str) -> str:
    """One node's doc page."""
    body = RELATIVE_LINK.sub(lambda m: f"{m[1]} (`{m[2]}` in the H3 MultiStream pack)"
                             if m[1].strip("`") != m[2] else f"`{m[2]}` (in the H3 MultiStream pack)", body)
    return (f"# {display}\n\n`{key}` — {kind}\n\n{body}\n\n"
            "<!-- generated from README.md by scripts/node_docs.py; edit the README and run it -->\n")


def expected() -> dict[str, str]:
    """File name -> content of every node doc, from README.md."""
    found = sections((ROOT / "README.md").read_text(encoding="utf-8"))
    return {f"{key}.md": render(display, key, kind, body) for key, (display, kind, body) in found.items()}


def main() -> int:
    DOCS.mkdir(parents=True, exist_ok=True)
    want = expected()
    for name in sorted(set(p.name for p in DOCS.glob("*.md")) - set(want)):
        (DOCS / name).unlink()
    for name, text in want.items():
        (DOCS / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(want)} node docs to {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
