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
         "H3AttentionParallelAsync": "H3 Attention Parallel"}


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
