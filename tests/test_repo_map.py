"""docs/architecture.md is the map of the code: every module on disk is on it and everything on it exists; imports
point one way (nodes → h3ms_async → workers) with no cycles."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("h3ms_async", "workers", "nodes")
#: ComfyUI's top-level modules: the core never imports them, workers only to run ComfyUI's own code.
COMFY_MODULES = {"comfy", "comfy_extras", "comfy_api", "folder_paths", "server", "execution", "nodes", "main",
                 "latent_preview", "node_helpers", "comfy_execution"}
#: The worker modules that import a ComfyUI (the parent's root, at run time) to run its attention or its VAE.
WORKERS_RUNNING_COMFY = {"workers.runtime.comfy_host", "workers.vae.rank"}


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


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (function-level imports included), absolute; relative ones resolved."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(name, path):
            # "from pkg import mod" names a module; "from mod import func" names the module itself
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and not (mods[imp].name == "__init__.py" and name.startswith(imp + ".")):
                deps.add(imp)
        graph[name] = deps
    return graph


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


def test_imports_point_one_way() -> None:
    mods = _modules()
    wrong = []
    for name, path in mods.items():
        top = name.split(".")[0]
        for imp in _imports(name, path):
            head = imp.split(".")[0]
            if top == "workers" and head in ("h3ms_async", "nodes"):
                wrong.append(f"{name} imports {imp} (workers never import the core or the nodes)")
            if top == "h3ms_async" and head in COMFY_MODULES:
                wrong.append(f"{name} imports {imp} (the core never imports ComfyUI or the nodes)")
            if top == "workers" and head in COMFY_MODULES and name not in WORKERS_RUNNING_COMFY:
                wrong.append(f"{name} imports {imp} (only {sorted(WORKERS_RUNNING_COMFY)} run ComfyUI's code)")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
