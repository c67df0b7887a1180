"""The pack root (``__init__.py``) as ComfyUI imports it, outside ComfyUI: by path, as a package named after its folder.

Inside real ComfyUI (its own loader, a real ``PromptServer``, routes registered once) see
``tests/comfy_node_checks.py``.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODES = {"H3MultiStreamAsync": "H3 MultiStream", "H3MSGPUSetAsync": "H3 MS GPU Set",
         "H3MSReleaseResourcesAsync": "H3 MS Release Resources", "H3MSVAESplitDecodeAsync": "H3 MS VAE Split Decode",
         "H3MSVAECacheAsync": "H3 MS VAE Cache", "H3MSTextEncoderCacheAsync": "H3 MS Text Encoder Cache",
         "H3AttentionParallelAsync": "H3 Attention Parallel", "H3MSSparseAttentionAsync": "H3 MS Sparse Attention"}


def import_pack(root: Path, name: str):
    """What ComfyUI's custom-node loader does: a module spec from the folder's __init__.py, registered by name."""
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pack_names():
    names: list[str] = []
    yield names
    for name in [m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names)]:
        del sys.modules[name]


def test_import_outside_comfyui_registers_nodes_and_nothing_else(pack_names, monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    path_before = list(sys.path)
    pack_names.append("h3ms_pack_plain")
    pack = import_pack(ROOT, "h3ms_pack_plain")
    assert sys.path == path_before  # the pack root never goes on sys.path
    assert pack.WEB_DIRECTORY == "./web" and (ROOT / "web").is_dir()
    assert {k: pack.NODE_DISPLAY_NAME_MAPPINGS[k] for k in pack.NODE_CLASS_MAPPINGS} == NODES
    assert "h3ms_pack_plain.nodes.routes" not in sys.modules  # no server: no routes
    # the core is one copy, under its own name
    assert sys.modules["h3ms_async"].__file__ == str(ROOT / "h3ms_async" / "__init__.py")
    assert "h3ms_pack_plain.h3ms_async" not in sys.modules


def test_a_broken_node_is_left_out_with_one_error(tmp_path, pack_names, caplog, monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    copy = tmp_path / "pack"
    (copy / "nodes").mkdir(parents=True)
    (copy / "__init__.py").write_text((ROOT / "__init__.py").read_text())
    for f in (ROOT / "nodes").glob("*.py"):
        (copy / "nodes" / f.name).write_text(f.read_text())
    (copy / "nodes" / "gpu_set_node.py").write_text("raise RuntimeError('broken on purpose')\n")
    for core in ("h3ms_async", "workers", "web"):
        os.symlink(ROOT / core, copy / core)
    pack_names.append("h3ms_pack_broken")
    with caplog.at_level(logging.ERROR, logger="h3_multistream"):
        pack = import_pack(copy, "h3ms_pack_broken")
    assert set(pack.NODE_CLASS_MAPPINGS) == set(NODES) - {"H3MSGPUSetAsync"}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "H3MSGPUSetAsync" in errors[0] and "broken on purpose" in errors[0]


def test_importing_the_pack_leaves_comfy_kitchens_backends_alone():
    """ComfyUI's process owns comfy-kitchen's backend policy (``comfy.quant_ops``, with ``--enable-triton-backend``);
    importing the pack and everything its nodes load (the split, the reference ops) must not enable or disable any
    backend there. Workers apply a policy in their own process only. A fresh process: other tests build reference
    models, which apply the standalone policy in this one."""
    import subprocess
    code = f"""
import importlib.util, json, sys
import comfy_kitchen as ck
state = lambda: {{k: v["disabled"] for k, v in ck.list_backends().items()}}
for name in list(state()):
    ck.enable_backend(name)  # all on: a policy applied at import would switch some off
before = state()
spec = importlib.util.spec_from_file_location("h3ms_pack", {str(ROOT / "__init__.py")!r},
                                              submodule_search_locations=[{str(ROOT)!r}])
pack = importlib.util.module_from_spec(spec)
sys.modules["h3ms_pack"] = pack
spec.loader.exec_module(pack)
import h3ms_async.dit.split, h3ms_async.dit.reference, workers.dit.ops, workers.runtime.comfy_host
print(json.dumps([before, state(), sorted(m for m in sys.modules if m.startswith("workers."))]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    before, after, loaded = json.loads(r.stdout.splitlines()[-1])
    assert not any(before.values()) and after == before
    assert "workers.dit.ops" in loaded and "workers.dit.rank" not in loaded  # the rank module is the workers' own


def test_requirements_leave_comfyuis_own_packages_to_comfyui():
    """A pack's requirements.txt is installed into ComfyUI's environment: torch, comfy-kitchen and comfy-aimdo are
    ComfyUI's own (a pack must not replace its torch); the standalone install declares them instead."""
    import re
    names = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    assert names and not {"torch", "comfy-kitchen", "comfy-aimdo"} & set(names), names
    standalone = (ROOT / "pyproject.toml").read_text() + (ROOT / "scripts" / "h3ms.sh").read_text()
    for pkg in ("torch", "comfy-kitchen", "comfy-aimdo"):
        assert pkg in standalone, f"the standalone install does not declare {pkg}"


def test_requires_comfyui_is_the_tested_version():
    """pyproject's requires-comfyui claims the ComfyUI the tests run in (tests/comfy_tree.py), not a newer one."""
    import re
    sys.path.insert(0, str(ROOT / "tests"))
    import comfy_tree
    if comfy_tree.skip_reason() is not None:
        pytest.skip(str(comfy_tree.skip_reason()))
    version = re.search(r'__version__ = "([^"]+)"', (comfy_tree.ensure_tree() / "comfyui_version.py").read_text())
    claim = re.search(r'^requires-comfyui = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version and claim and claim.group(1) == f">={version.group(1)}", (claim, version)
