"""HTTP routes on a real aiohttp test server: JSON shapes, busy refusals, log tails, bounds, the panel files, SSE."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from h3ms_async.observability.routes import LINES_MAX, add_routes, tail_file
from h3ms_async.observability.serve import build_app
from h3ms_async.status.hub import StatusHub
from tests.test_status import make_record

pytestmark = pytest.mark.fast


def app_for(hub: StatusHub, **kw) -> web.Application:
    routes = web.RouteTableDef()
    add_routes(routes, hub=hub, **kw)
    app = web.Application()
    app.add_routes(routes)
    return app


@pytest.fixture
def hub(tmp_path):
    h = StatusHub()
    for i in range(5):
        h.record_step(make_record(i, wall=1.0 + i), log=False)
    log0 = tmp_path / "rank0.log"
    log0.write_text("".join(f"line {i}\n" for i in range(5000)))
    h.register_provider("workers", lambda: [
        {"rank": 0, "device": "cpu", "pid": 4321, "state": "running", "log": str(log0)},
        {"rank": 1, "device": "cpu", "pid": 4322, "state": "starting", "log": str(tmp_path / "rank1.log")},
    ])
    return h


@pytest.mark.asyncio
async def test_status_and_steps_shapes(aiohttp_client, hub):
    client = await aiohttp_client(app_for(hub))
    r = await client.get("/h3multistream/status")
    assert r.status == 200 and r.content_type == "application/json"
    st = await r.json()
    assert st["last_step"]["seq"] == 4 and st["steps_recorded"] == 5 and st["running"] is False
    assert [w["rank"] for w in st["workers"]] == [0, 1]

    body = await (await client.get("/h3multistream/steps")).json()
    assert [s["seq"] for s in body["steps"]] == [0, 1, 2, 3, 4] and body["n"] == 50 and body["latest_seq"] == 4
    body = await (await client.get("/h3multistream/steps?n=2")).json()
    assert [s["seq"] for s in body["steps"]] == [3, 4]
    body = await (await client.get("/h3multistream/steps?n=100000")).json()
    assert body["n"] == 256 and len(body["steps"]) == 5
    body = await (await client.get("/h3multistream/steps?n=-3")).json()
    assert body["n"] == 1 and [s["seq"] for s in body["steps"]] == [4]
    body = await (await client.get("/h3multistream/steps?after=2")).json()
    assert [s["seq"] for s in body["steps"]] == [3, 4]
    body = await (await client.get("/h3multistream/steps?after=4")).json()
    assert body["steps"] == [] and body["latest_seq"] == 4
    for bad in ("n=abc", "n=1.5", "after=x"):
        r = await client.get(f"/h3multistream/steps?{bad}")
        assert r.status == 400 and r.content_type == "application/json"
        assert "must be an integer" in (await r.json())["error"]


@pytest.mark.asyncio
async def test_status_with_a_broken_provider_still_answers(aiohttp_client, hub):
    hub.register_provider("hooks", lambda: (_ for _ in ()).throw(RuntimeError("hook table locked")))
    client = await aiohttp_client(app_for(hub))
    st = await (await client.get("/h3multistream/status")).json()
    assert st["hooks"] == {"error": "RuntimeError: hook table locked"}


@pytest.mark.asyncio
async def test_log_tail_bounds(aiohttp_client, hub):
    client = await aiohttp_client(app_for(hub))
    body = await (await client.get("/h3multistream/workers/0/log")).json()
    assert body["rank"] == 0 and len(body["lines"]) == 200 and body["lines"][-1] == "line 4999"
    assert body["lines"][0] == "line 4800"
    body = await (await client.get("/h3multistream/workers/0/log?lines=3")).json()
    assert body["lines"] == ["line 4997", "line 4998", "line 4999"]
    body = await (await client.get("/h3multistream/workers/0/log?lines=0")).json()
    assert body["lines"] == ["line 4999"]  # clamped up to 1
    body = await (await client.get("/h3multistream/workers/0/log?lines=999999")).json()
    assert len(body["lines"]) == LINES_MAX and body["lines"][0] == "line 3000"
    body = await (await client.get("/h3multistream/workers/1/log")).json()
    assert body["lines"] == []  # the worker has not written its log yet

    r = await client.get("/h3multistream/workers/7/log")
    assert r.status == 404 and "no worker with rank 7" in (await r.json())["error"]
    for bad in ("-1", "abc", "0x1", "1.0", "%D9%A3", "%2E%2E%2F0"):  # %D9%A3: an Arabic-Indic digit three
        r = await client.get(f"/h3multistream/workers/{bad}/log")
        assert r.status == 400, bad
        assert "rank must be a non-negative integer" in (await r.json())["error"]
    # ".." is resolved by the URL layer before routing: it names another path, which is not a route of ours
    assert (await client.get("/h3multistream/workers/../0/log")).status == 404
    r = await client.get("/h3multistream/workers/0/log?lines=ten")
    assert r.status == 400 and "lines must be an integer in 1..2000" in (await r.json())["error"]


@pytest.mark.asyncio
async def test_log_tail_callable_is_used(aiohttp_client):
    calls = []

    def tail(rank, lines):
        calls.append((rank, lines))
        if rank != 3:
            raise KeyError(rank)
        return ["a", "b"]
    client = await aiohttp_client(app_for(StatusHub(), log_tail=tail))
    assert (await (await client.get("/h3multistream/workers/3/log?lines=5")).json())["lines"] == ["a", "b"]
    assert (await client.get("/h3multistream/workers/2/log")).status == 404
    assert calls == [(3, 5), (2, 200)]


class CountingReads:
    """Wraps a real file object and counts the bytes read (to prove the tail never reads the whole file)."""

    def __init__(self, f):
        self.f, self.read_bytes = f, 0

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def read(self, n=-1):
        data = self.f.read(n)
        self.read_bytes += len(data)
        return data


def test_tail_file_reads_from_the_end(tmp_path, monkeypatch):
    big = tmp_path / "big.log"
    with open(big, "w") as f:
        for i in range(400_000):  # ~7 MB
            f.write(f"worker line {i:07d}\n")
    opened = []
    real_open = open

    def counting_open(path, mode="r", *a, **kw):
        w = CountingReads(real_open(path, mode, *a, **kw))
        opened.append(w)
        return w
    import h3ms_async.log as log_module  # where tail_file lives
    monkeypatch.setattr(log_module, "open", counting_open, raising=False)
    lines = tail_file(big, 10)
    assert lines == [f"worker line {i:07d}" for i in range(399_990, 400_000)]
    assert opened[0].read_bytes <= 64 * 1024
    # a line cut at the block boundary is dropped, not returned half
    lines = tail_file(big, 2000)
    assert len(lines) == 2000 and lines[0] == "worker line 0398000"


def test_tail_file_edge_cases(tmp_path):
    p = tmp_path / "x.log"
    assert tail_file(p, 5) == []
    p.write_bytes(b"")
    assert tail_file(p, 5) == []
    p.write_bytes(b"one\ntwo\nthree")  # no trailing newline
    assert tail_file(p, 2) == ["two", "three"]
    assert tail_file(p, 50) == ["one", "two", "three"]
    p.write_bytes(b"bad \xff\xfe bytes\n")
    assert tail_file(p, 1) == ["bad \ufffd\ufffd bytes"]


@pytest.mark.asyncio
async def test_mutating_routes_refuse_while_busy_and_run_actions(aiohttp_client, hub):
    calls = []
    busy = {"v": True}
    hub.set_busy_probe(lambda: busy["v"])
    hub.register_action("release_workers", lambda: calls.append("release") or {"released": 2, "message": "2 released"})
    hub.register_action("clear_weights", lambda: calls.append("clear") or {"freed_bytes": 10, "message": "freed"})
    client = await aiohttp_client(app_for(hub))
    paths = ("/h3multistream/workers/release", "/h3multistream/cache/clear_weights", "/h3multistream/hooks/detach")
    for p in paths:
        r = await client.post(p)
        body = await r.json()
        assert r.status == 200 and body["busy"] is True and "a prompt is running" in body["message"]
        assert (await client.get(p)).status == 405  # mutating routes are POST only
    assert calls == []
    busy["v"] = False
    assert await (await client.post(paths[0])).json() == {"busy": False, "released": 2, "message": "2 released"}
    assert (await (await client.post(paths[1])).json())["freed_bytes"] == 10
    body = await (await client.post(paths[2])).json()  # no detach_hooks action registered
    assert body["busy"] is False and "nothing to do" in body["message"]
    assert calls == ["release", "clear"]

    hub.register_action("detach_hooks", lambda: 1 / 0)
    r = await client.post(paths[2])
    assert r.status == 500 and "detach_hooks failed: ZeroDivisionError" in (await r.json())["error"]


@pytest.mark.asyncio
async def test_actions_run_off_the_server_loop(aiohttp_client, hub):
    """An action may block (join processes, wait on another loop); the server must still answer meanwhile."""
    release = threading.Event()
    hub.register_action("release_workers", lambda: {"waited": release.wait(10)})
    client = await aiohttp_client(app_for(hub))
    pending = asyncio.ensure_future(client.post("/h3multistream/workers/release"))
    r = await asyncio.wait_for(client.get("/h3multistream/steps?n=1"), 5)
    assert r.status == 200
    release.set()
    assert (await (await asyncio.wait_for(pending, 10)).json())["waited"] is True


@pytest.mark.asyncio
async def test_panel_and_static_whitelist(aiohttp_client):
    client = await aiohttp_client(app_for(StatusHub()))
    r = await client.get("/h3multistream/panel")
    assert r.status == 200 and r.content_type == "text/html"
    assert 'id="h3ms-panel"' in await r.text()
    r = await client.get("/h3multistream/web/panel.js")
    assert r.status == 200 and r.content_type == "text/javascript"
    assert (await client.get("/h3multistream/web/panel.css")).content_type == "text/css"
    for bad in ("h3ms_async.js", "..%2F..%2Fh3ms_async%2Fstatus.py", "%2E%2E%2Fpyproject.toml", "../pyproject.toml",
                "..%5Cpyproject.toml", "panel.js%00.txt", "/etc/passwd"):
        r = await client.get(f"/h3multistream/web/{bad}")
        assert r.status == 404, bad
        if r.content_type == "application/json":
            assert "no such panel file" in (await r.json())["error"]
    # a path that climbs out of /web/ is simply not one of our routes
    r = await client.get("/h3multistream/web/../status")
    assert r.status in (200, 404)
    if r.status == 200:  # normalised by the client to /h3multistream/status: still only our JSON
        assert "version" in await r.json()


@pytest.mark.asyncio
async def test_panel_missing_file_is_a_json_404(aiohttp_client, tmp_path):
    routes = web.RouteTableDef()
    add_routes(routes, hub=StatusHub(), web_dir=tmp_path)
    app = web.Application()
    app.add_routes(routes)
    client = await aiohttp_client(app)
    r = await client.get("/h3multistream/panel")
    assert r.status == 404 and "panel file panel.html is missing" in (await r.json())["error"]


@pytest.mark.asyncio
async def test_standalone_app_events_stream(aiohttp_client, hub):
    client = await aiohttp_client(build_app(hub=hub))
    r = await client.get("/")
    assert r.status == 200 and r.url.path == "/h3multistream/panel"

    resp = await client.get("/h3multistream/events?after=2&timeout=5")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")

    async def next_event():
        data, ident = None, None
        while True:
            line = (await asyncio.wait_for(resp.content.readline(), 5)).decode().rstrip("\n")
            if line.startswith("id: "):
                ident = int(line[4:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and data is not None:
                return ident, data
    assert (await next_event())[0] == 3  # backlog after seq 2
    assert (await next_event())[0] == 4
    await asyncio.get_running_loop().run_in_executor(None, lambda: hub.record_step(make_record(5), log=False))
    ident, rec = await next_event()
    assert ident == 5 and rec["ranks"][1]["compute_s"] == 1.125
    resp.close()

    # Last-Event-ID wins over a stale ?after of a reconnecting EventSource
    resp = await client.get("/h3multistream/events?after=0&timeout=1", headers={"Last-Event-ID": "4"})
    assert (await next_event())[0] == 5
    text = (await asyncio.wait_for(resp.content.read(), 5)).decode()  # closes by itself after timeout=1
    assert "event: step" not in text
    assert (await client.get("/h3multistream/events?after=x")).status == 400


@pytest.mark.asyncio
async def test_standalone_refuses_cross_origin_posts(aiohttp_client):
    client = await aiohttp_client(build_app(hub=StatusHub()))
    r = await client.post("/h3multistream/workers/release", headers={"Origin": "http://evil.example"})
    assert r.status == 403 and "cross-origin POST" in (await r.json())["error"]
    host = f"{client.host}:{client.port}"
    r = await client.post("/h3multistream/workers/release", headers={"Origin": f"http://{host}"})
    assert r.status == 200 and "no split workers were running" in (await r.json())["message"]


def test_panel_files_exist_and_are_whitelisted():
    from h3ms_async.observability.routes import PANEL_FILES, WEB_DIR
    for name in PANEL_FILES:
        assert (WEB_DIR / name).is_file(), name
    assert Path(WEB_DIR, "h3ms_async.js").is_file()
