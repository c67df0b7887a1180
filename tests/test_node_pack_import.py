"""The pack root (``__init__.py``) as ComfyUI imports it: by path, as a package named after its folder."""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STANDIN = Path(__file__).resolve().parent / "comfy_standin"
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


@pytest.mark.asyncio
async def test_with_prompt_server_routes_busy_and_step_push(pack_names, monkeypatch, aiohttp_client):
    from aiohttp import web
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "server", raising=False)
    import server
    instance = server.PromptServer()
    pack_names.append("h3ms_pack_comfy")
    try:
        import_pack(ROOT, "h3ms_pack_comfy")
        from h3ms_async.status import get_hub
        routes = {(r.method, r.path) for r in instance.routes}
        assert ("GET", "/h3multistream/status") in routes and ("POST", "/h3multistream/workers/release") in routes
        assert sys.modules["h3ms_pack_comfy.nodes.routes"].register(instance) is False  # once per server
        hub = get_hub()
        assert hub.busy() is False
        instance.prompt_queue.running.append(("prompt-1",))
        assert hub.busy() is True

        app = web.Application()
        app.add_routes(instance.routes)
        client = await aiohttp_client(app)
        answer = await (await client.post("/h3multistream/hooks/detach")).json()
        assert answer["busy"] is True  # a prompt is running: refused
        instance.prompt_queue.running.clear()
        answer = await (await client.post("/h3multistream/hooks/detach")).json()
        assert answer["busy"] is False and "detached" in answer["message"]
        status = await (await client.get("/h3multistream/status")).json()
        assert isinstance(status["hooks"], list)

        rec = {"at": "2026-01-01T00:00:00", "seq": hub.next_seq(), "kind": "dit", "sigma": 0.5, "tokens": 4,
               "blocks": 2, "devices": ["cpu"], "exchange": "host", "chunks": 1, "wall_s": 0.1, "moved_bytes": 0,
               "weight_store": "warm", "ranks": [{"rank": 0, "device": "cpu", "tokens": [0, 4], "heads": [0, 4],
                                                  "compute_s": 0.1, "exchange_s": 0.0, "wait_s": 0.0,
                                                  "moved_bytes": 0, "vram_peak_bytes": None}]}
        hub.record_step(rec, log=False)
        assert [(e, d["seq"]) for e, d, _ in instance.sent] == [("h3multistream.step", rec["seq"])]
    finally:
        routes_mod = sys.modules.get("h3ms_pack_comfy.nodes.routes")
        if routes_mod is not None:
            routes_mod.unregister(instance)
        server.PromptServer.instance = None
        del sys.modules["server"]
