"""docs/architecture.md is the map of the code: every module on disk is on it and everything on it
exists.  Imports point one way (nodes -> h3ms_async -> workers), ComfyUI only where its code runs,
with no module cycles: the ``[tool.importlinter]`` contracts of pyproject.toml, checked by
``lint-imports``, and a cycle check on its import graph."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("h3ms_async", "workers", "nodes")
MISSING_TOOL = ("import-linter is a test requirement: pip install import-linter "
                "(scripts/h3ms.sh test installs it)")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def test_every_module_is_on_the_map_and_the_map_names_only_real_modules() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    mapped = set(re.findall(r"`((?:h3ms_async|workers|nodes)/[\w/]+\.py)`", text))
    on_disk = {str(p.relative_to(ROOT)) for p in _modules().values() if p.name != "__init__.py" or p.parent == ROOT}
    on_disk |= {str(p.relative_to(ROOT)) for p in _modules().values()
                if p.name == "__init__.py" and p.parent.name in PACKAGES}
    assert not on_disk - mapped, f"modules missing from docs/architecture.md: {sorted(on_disk - mapped)}"
    assert not mapped - on_disk - {str(p.relative_to(ROOT)) for p in _modules().values()}, \
        f"docs/architecture.md names modules that do not exist: {sorted(mapped - on_disk)}"
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in _modules().values()
                if p.name == "__init__.py" and p.parent.name not in PACKAGES}
    missing = {pkg for pkg in packages if f"`{pkg}`" not in text}
    assert not missing, f"sub-packages without a heading or row in docs/architecture.md: {sorted(missing)}"


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    assert exe is not None, MISSING_TOOL
    proc = subprocess.run([exe, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_module_import_cycles() -> None:
    """No module reaches itself through imports (function-level ones included).  import-linter's own
    cycle contract works on packages, where the workers' runtime and transports and their dit use
    each other's modules."""
    try:
        import grimp  # import-linter's import graph
    except ImportError:
        raise AssertionError(MISSING_TOOL) from None
    sys.path.insert(0, str(ROOT))
    try:
        graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))
    edges = {(m, d) for m in graph.modules for d in graph.find_modules_directly_imported_by(m)}
    for m, d in edges:
        if m.startswith(d + "."):  # a module reading its own package's __init__ (PACK_ROOT)
            graph.remove_import(importer=m, imported=d)
    cycles = []
    for m, d in sorted(edges):
        if m.startswith(d + "."):
            continue
        if back := graph.find_shortest_chain(importer=d, imported=m):
            cycles.append(" -> ".join((m, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
