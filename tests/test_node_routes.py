"""nodes/routes.py on the stand-in PromptServer, with a real split on CPU rank workers behind the routes.

The routes answer through aiohttp's test client on the route table the pack registered on
``PromptServer.instance.routes``; "busy" comes from the stand-in prompt queue; step records reach the frontend
through ``send_sync("h3multistream.step", record)``.
"""
from __future__ import annotations

import sys
import time

import pytest
from aiohttp import web

from tests.test_nodes import STANDIN, _leftovers, _patch_node, _reference_patcher, h3_inputs, sample

ROUTES = {("GET", "/h3multistream/status"), ("GET", "/h3multistream/steps"),
          ("GET", "/h3multistream/workers/{rank}/log"), ("POST", "/h3multistream/workers/release"),
          ("POST", "/h3multistream/cache/clear_weights"), ("POST", "/h3multistream/hooks/detach"),
          ("GET", "/h3multistream/panel"), ("GET", "/h3multistream/web/{name}")}


@pytest.fixture
def comfy_server(monkeypatch):
    """A stand-in PromptServer with the pack's routes registered; everything undone and released afterwards."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delenv("H3MS_RANK_MAP", raising=False)
    for name in [m for m in sys.modules if m == "server" or m == "comfy" or m.startswith("comfy.")]:
        monkeypatch.delitem(sys.modules, name)
    import server
    from h3ms_async import split
    from nodes import routes
    instance = server.PromptServer()
    assert routes.register(instance) is True
    try:
        yield instance
    finally:
        routes.unregister(instance)
        server.PromptServer.instance = None
        split.release_all_engines()
        for name in [m for m in sys.modules if m == "server" or m == "comfy" or m.startswith("comfy.")]:
            del sys.modules[name]
    deadline = time.monotonic() + 5.0
    while (left := _leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left behind: {left}"


def _routes_of(instance) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in instance.routes]


def test_register_is_once_per_server_and_probes_the_prompt_queue(comfy_server):
    from h3ms_async.status import get_hub
    from nodes import routes
    got = _routes_of(comfy_server)
    assert set(got) == ROUTES and len(got) == len(ROUTES)
    assert routes.register(comfy_server) is False and len(_routes_of(comfy_server)) == len(ROUTES)
    hub = get_hub()
    assert hub.busy() is False
    comfy_server.prompt_queue.queued.append(("waiting",))
    assert hub.busy() is False  # only a running prompt holds the split
    comfy_server.prompt_queue.running.append(("prompt-1",))
    assert hub.busy() is True and routes.queue_busy(comfy_server) is True


@pytest.mark.asyncio
async def test_routes_over_a_running_split(comfy_server, aiohttp_client, monkeypatch):
    app = web.Application()
    app.add_routes(comfy_server.routes)
    client = await aiohttp_client(app)

    async def get(path: str, status: int = 200) -> dict:
        r = await client.get(path)
        assert r.status == status, await r.text()
        return await r.json()

    async def post(path: str) -> dict:
        r = await client.post(path)
        assert r.status == 200, await r.text()
        return await r.json()

    patcher = _reference_patcher("bf16")
    patched = _patch_node(patcher, "cpu,cpu", monkeypatch)
    inputs = h3_inputs()
    sample(patched, *inputs)
    sample(patched, *inputs)

    pushed = [(event, rec) for event, rec, _sid in comfy_server.sent]
    assert [e for e, _ in pushed] == ["h3multistream.step"] * 2
    assert all(rec["kind"] == "dit" and rec["devices"] == ["cpu", "cpu"] for _, rec in pushed)

    st = await get("/h3multistream/status")
    assert st["running"] is False and st["last_step"]["seq"] == pushed[-1][1]["seq"]
    assert [(w["rank"], w["state"]) for w in st["workers"]] == [(0, "ready"), (1, "ready")]
    pids = [w["pid"] for w in st["workers"]]
    assert st["weight_store"]["state"] == "warm" and st["weight_store"]["blocks"] == 3
    assert st["plans"]["dit"][0]["devices"] == ["cpu", "cpu"]
    assert any(h["devices"] == ["cpu", "cpu"] and not h["detached"] for h in st["hooks"])

    steps = await get("/h3multistream/steps?n=1")
    assert [s["seq"] for s in steps["steps"]] == [pushed[-1][1]["seq"]]
    log = await get("/h3multistream/workers/1/log?lines=50")
    assert log["rank"] == 1 and any("rank 1: weights" in line for line in log["lines"])
    assert "no worker with rank 7" in (await get("/h3multistream/workers/7/log", 404))["error"]
    r = await client.get("/h3multistream/panel")
    assert r.status == 200 and r.content_type == "text/html"

    # while ComfyUI runs a prompt every mutating route refuses and changes nothing
    comfy_server.prompt_queue.running.append(("prompt-1",))
    for path in ("/h3multistream/workers/release", "/h3multistream/cache/clear_weights",
                 "/h3multistream/hooks/detach"):
        answer = await post(path)
        assert answer["busy"] is True and "a prompt is running" in answer["message"]
    st = await get("/h3multistream/status")
    assert st["running"] is True and [w["pid"] for w in st["workers"]] == pids
    assert st["weight_store"]["state"] == "warm" and not all(h["detached"] for h in st["hooks"])
    comfy_server.prompt_queue.running.clear()

    answer = await post("/h3multistream/cache/clear_weights")
    assert answer["busy"] is False and "weight store cleared" in answer["message"]
    st = await get("/h3multistream/status")
    assert st["weight_store"]["state"] == "empty" and [w["pid"] for w in st["workers"]] == pids  # workers kept

    answer = await post("/h3multistream/hooks/detach")
    assert answer["busy"] is False and "detached" in answer["message"]
    assert all(h["detached"] for h in (await get("/h3multistream/status"))["hooks"])
    n_sent = len(comfy_server.sent)
    assert all(a.equal(b) for a, b in zip(sample(patcher, *inputs), sample(patched, *inputs)))
    assert len(comfy_server.sent) == n_sent  # detached: plain ComfyUI, no split step

    answer = await post("/h3multistream/workers/release")
    assert answer["busy"] is False and "released (1 engine" in answer["message"]
    assert (await get("/h3multistream/status"))["workers"] == []
