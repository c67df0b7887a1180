"""The live panel and the ComfyUI extension in a real headless browser (Debian's chromium).

The standalone server runs on the core coordinator loop (``start_background_server``), exactly as the demo serves it.
Chromium's ``--virtual-time-budget`` lets the page's fetches and timers run before ``--dump-dom`` prints the DOM.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from h3ms_async.observability.routes import WEB_DIR, add_routes
from h3ms_async.observability.serve import start_background_server
from h3ms_async.status.hub import StatusHub
from h3ms_async.status.records import StepRecord
from tests.test_block_timing import recorded_cpu_step
from tests.test_status import make_record

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed: apt-get install -y chromium "
                                                "(the CI script installs it)"),
]


def chromium(args: list[str], profile: Path, timeout: float = 90.0) -> str:
    """Run headless chromium in its own process group; kill the whole group if it overruns (a start takes 1-3 s;
    on a 2-core CI box busy with worker processes it once took over 40 s)."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-crash-reporter", "--no-first-run", f"--user-data-dir={profile}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"chromium did not finish within {timeout} s: {' '.join(cmd)}") from None
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err[-2000:]}"
    return out


@pytest.fixture
def served(tmp_path):
    hub = StatusHub()
    for i, wall in enumerate([1.70, 1.55, 1.90, 1.625]):
        rec = make_record(i, wall=wall, ranks=2)
        rec.ranks[0].compute_s, rec.ranks[0].exchange_s, rec.ranks[0].wait_s = 1.234, 0.321, 0.045
        rec.ranks[1].compute_s, rec.ranks[1].exchange_s, rec.ranks[1].wait_s = 0.987, 0.211, 0.402
        rec.ranks[0].weights_vram_bytes, rec.ranks[0].resident_blocks, rec.ranks[0].streamed_blocks = 20 << 30, 40, 10
        hub.record_step(rec, log=False)
    log = tmp_path / "rank0.log"
    log.write_text("hello from rank 0\n")
    hub.register_provider("workers", lambda: [
        {"rank": 0, "device": "cuda:0", "pid": 5151, "state": "running", "uptime_s": 125.0, "rss_bytes": 3 << 30,
         "vram_bytes": 12 << 30, "jobs_done": 17, "log": str(log)},
        {"rank": 1, "device": "cuda:1", "pid": 5152, "state": "running", "uptime_s": 124.0, "rss_bytes": 3 << 30,
         "vram_bytes": 11 << 30, "jobs_done": 17, "log": None},
    ])
    url, stop = start_background_server(0, hub=hub)
    yield hub, url
    stop()


def rank_row(dom: str, rank: int) -> list[str]:
    m = re.search(rf'<tr id="h3ms-rank-{rank}"[^>]*>(.*?)</tr>', dom, re.S)
    assert m, f"no row for rank {rank} in the panel DOM"
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(1), re.S)]


def test_panel_shows_ranks_history_and_workers(served, tmp_path):
    hub, url = served
    dom = chromium(["--virtual-time-budget=2500", "--dump-dom", f"{url}/h3multistream/panel?feed=poll"],
                   tmp_path / "profile")
    assert 'data-loaded="1"' in dom
    r0, r1 = rank_row(dom, 0), rank_row(dom, 1)
    assert r0[:4] == ["0", "cuda:0", "0–500 (500)", "0–28 (28)"]
    assert r0[5:] == ["1.234", "0.321", "0.045", "512.0 MiB", "10.00 GiB", "20.00 GiB in VRAM · 40 resident, 10 streamed"]
    assert rank_row(dom, 1)[-1] == "host store"  # a CPU rank's weights are views of the host store
    assert r1[5:8] == ["0.987", "0.211", "0.402"]
    assert "step 3 · sigma 0.9375 · 1000 tokens × 50 blocks on cuda:0+cuda:1 · 1.625 s" in dom
    assert re.findall(r'data-seq="(\d+)"', dom) == ["3", "2", "1", "0"]
    # the per-rank chart: one line per rank with a point per step, and the dashed wall-time line
    lines = re.findall(r'<polyline ([^>]*)>', dom)
    ranks = {re.search(r'data-rank="(\d+)"', a).group(1): a for a in lines if "h3ms-chart-rank" in a}
    assert sorted(ranks) == ["0", "1"] and sum("h3ms-chart-wall" in a for a in lines) == 1
    assert all(len(re.search(r'points="([^"]*)"', a).group(1).split()) == 4 for a in ranks.values())
    w0 = re.search(r'<tr id="h3ms-worker-0">(.*?)</tr>', dom, re.S).group(1)
    assert "5151" in w0 and "2m05s" in w0 and "12.00 GiB" in w0 and "/h3multistream/workers/0/log?lines=200" in w0
    assert ">idle<" in dom and "polling" in dom

    shot = Path(os.environ.get("H3MS_PANEL_SCREENSHOT", tmp_path / "panel.png"))
    chromium(["--virtual-time-budget=2500", "--window-size=1200,1000", f"--screenshot={shot}",
              f"{url}/h3multistream/panel?feed=poll"], tmp_path / "profile")
    assert shot.stat().st_size > 10_000


def test_rank_bars_show_a_real_steps_block_timings(tmp_path):
    """The stacked bar per rank (compute | compute with hidden copy | exposed wait) from a step two real CPU rank
    workers ran: its parts are the record's per-block numbers added up, its widths those seconds over the slowest
    rank's blocks, its tooltip one line per block."""
    rec = recorded_cpu_step(head_pieces=2)
    hub = StatusHub()
    hub.record_step(msgspec.convert(rec, StepRecord), log=False)
    url, stop = start_background_server(0, hub=hub)
    try:
        dom = chromium(["--virtual-time-budget=2500", "--dump-dom", f"{url}/h3multistream/panel?feed=poll"],
                       tmp_path / "profile")
    finally:
        stop()
    assert 'data-loaded="1"' in dom
    totals = [{"compute": sum(b["compute_s"] - min(b["hidden_s"], b["compute_s"]) for b in r["per_block"]),
               "hidden": sum(min(b["hidden_s"], b["compute_s"]) for b in r["per_block"]),
               "exposed": sum(b["exposed_s"] for b in r["per_block"])} for r in rec["ranks"]]
    scale = max(sum(t.values()) for t in totals)
    for r, want in zip(rec["ranks"], totals):
        row = re.search(rf'<tr id="h3ms-rank-{r["rank"]}"[^>]*>(.*?)</tr>', dom, re.S).group(1)
        bar = re.search(r'<div class="h3ms-bar" title="([^"]*)"', row, re.S).group(1)
        assert bar.startswith(f"rank {r['rank']}: ") and bar.count("\nblock ") == rec["blocks"] == len(r["per_block"])
        segs = re.findall(r'<div class="h3ms-seg (\w+)" data-part="\w+" data-seconds="([\d.]+)" style="width: '
                          r'([\d.]+)%', row)
        assert [s[0] for s in segs] == ["compute", "hidden", "exposed"]
        for part, seconds, width in segs:
            assert float(seconds) == pytest.approx(want[part], abs=1e-6)
            assert float(width) == pytest.approx(100 * want[part] / scale, abs=0.01)
    # the CPU ranks copy on their compute thread: no hidden part, and the exchange shows as exposed wait
    assert all(t["hidden"] == 0 and t["exposed"] > 0 for t in totals)
    assert "compute with hidden copy" in dom and "exposed wait" in dom


def test_panel_live_feed_over_events(served, tmp_path):
    """Steps recorded while the page is open arrive over the SSE stream (the status poll only shows the last)."""
    hub, url = served

    def record_later():
        time.sleep(0.4)
        for seq in (7, 8):
            hub.record_step(make_record(seq, wall=2.5), log=False)
    t = threading.Thread(target=record_later)
    t.start()
    try:
        # each stream lasts 1 s of real time (virtual time stands still while it is open), then EventSource reconnects
        dom = chromium(["--virtual-time-budget=2500", "--dump-dom", f"{url}/h3multistream/panel?stream_s=1"],
                       tmp_path / "profile")
    finally:
        t.join(10)
    assert "live (events)" in dom
    assert re.findall(r'data-seq="(\d+)"', dom)[:3] == ["8", "7", "3"]


FAKE_APP = """
window.__toasts = [];
window.__tabs = [];
window.__commands = [];
export const app = {
  extensions: [],
  extensionManager: {
    toast: { add: (t) => window.__toasts.push(t) },
    registerSidebarTab: (t) => window.__tabs.push(t),
    command: { execute: (id) => window.__commands.push(id) },
  },
  registerExtension(ext) { this.extensions.push(ext); },
};
"""
# ComfyUI's api: an EventTarget whose fetchApi prefixes /api; our routes are mounted on both, like ComfyUI does.
FAKE_API = """
class Api extends EventTarget {
  apiURL(p) { return "/api" + p; }
  fetchApi(p, opts) { return fetch(this.apiURL(p), opts); }
}
export const api = new Api();
"""
HARNESS = """<!DOCTYPE html><html><body><pre id="out"></pre><div id="sidebar"></div><div id="exact"></div>
<script type="module">
const EXACTNESS = EXACTNESS_JSON;
import { app } from "/scripts/app.js";
import { api } from "/scripts/api.js";
await import("/extensions/h3ms/h3ms_async.js");
const ext = app.extensions[0];
ext.setup();
const run = async (id) => ext.commands.find((c) => c.id === id).function();
await run("H3MultiStreamAsync.Status");
await run("H3MultiStreamAsync.ReleaseWorkers");
await run("H3MultiStreamAsync.DetachHooks");
await run("H3MultiStreamAsync.ShowTab");
// the frontend mounts the tab when it opens (what ShowTab's command does there)
const tab = window.__tabs[0];
tab.render(document.getElementById("sidebar"));
const rec = (await (await api.fetchApi("/h3multistream/steps?n=1")).json()).steps[0];
api.dispatchEvent(new CustomEvent("h3multistream.step", { detail: { ...rec, seq: rec.seq + 1 } }));
await new Promise((r) => setTimeout(r, 300));
// the exactness section as STATUS_CONTRACT.md shapes it, rendered by the panel the tab and the page share
const { Panel } = await import("/extensions/h3ms/panel.js");
const st = await (await api.fetchApi("/h3multistream/status")).json();
st.exactness = EXACTNESS;
new Panel(document.getElementById("exact"), api.apiURL("/h3multistream/")).renderStatus(st);
document.getElementById("out").textContent = JSON.stringify({
  name: ext.name, ids: ext.commands.map((c) => c.id), menu: ext.menuCommands, toasts: window.__toasts,
  tab: { id: tab.id, title: tab.title, type: tab.type }, executed: window.__commands });
document.body.setAttribute("data-done", "1");
</script></body></html>"""


#: An exactness section shaped as STATUS_CONTRACT.md says (the probe and VAE helpers produce it).
EXACTNESS = {
    "verdicts": [
        {"program": "dit", "op": "mlp.fc2", "device": "cuda:0 NVIDIA H200", "dtype": "bfloat16",
         "shape": "78491x14336x5376", "shards": [39246, 39245], "verdict": "exact",
         "detail": "row shards give the same bits", "probe_ms": 12.5, "at": "2026-12-03T19:00:00"},
        {"program": "dit", "op": "attn.qkv_proj", "device": "cuda:1 NVIDIA H200", "dtype": "int8",
         "shape": "78491x5376x16128", "shards": [39248, 39243], "verdict": "adjusted",
         "detail": "shard boundary moved to a multiple of 16 rows", "probe_ms": 8.25, "at": "2026-12-03T19:00:01"}],
    "verify": [{"at": "2026-12-03T19:05:00", "devices": ["cuda:0 NVIDIA H200", "cuda:1 NVIDIA H200"],
                "bit_exact": True, "max_abs_diff": 0.0, "first_difference": None, "steps_checked": 1}],
}


def test_comfyui_extension_commands_and_sidebar_tab(tmp_path):
    """h3ms_async.js against stand-ins for ComfyUI's app.js/api.js (the real frontend: tests/test_browser_comfy.py)."""
    hub = StatusHub()
    rec = make_record(0, wall=1.5)
    rec.ranks[1].compute_s = 0.777
    hub.record_step(rec, log=False)
    hub.set_busy_probe(lambda: True)

    def start_app():
        app = web.Application()
        for prefix in ("", "/api"):
            routes = web.RouteTableDef()
            add_routes(routes, hub=hub)
            app.add_routes([web.route(r.method, prefix + r.path, r.handler) for r in routes])
        js = {"/scripts/app.js": FAKE_APP, "/scripts/api.js": FAKE_API,
              "/extensions/h3ms/h3ms_async.js": (WEB_DIR / "h3ms_async.js").read_text(),
              "/extensions/h3ms/panel.js": (WEB_DIR / "panel.js").read_text(),
              "/extensions/h3ms/panel.css": (WEB_DIR / "panel.css").read_text()}
        def static(body: str, ctype: str):
            async def handler(request: web.Request) -> web.Response:
                return web.Response(text=body, content_type=ctype)
            return handler
        for path, body in js.items():
            app.router.add_get(path, static(body, "text/css" if path.endswith(".css") else "text/javascript"))
        app.router.add_get("/harness.html", static(HARNESS.replace("EXACTNESS_JSON", json.dumps(EXACTNESS)),
                                                   "text/html"))
        return app

    # reuse the standalone server's loop plumbing: serve this app on the coordinator loop
    from h3ms_async.runtime.coordinator import get_coordinator
    coord = get_coordinator()

    async def up():
        runner = web.AppRunner(start_app(), handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, runner.addresses[0][1]
    runner, port = coord.run(up(), 30)
    try:
        dom = chromium(["--virtual-time-budget=2500", "--dump-dom", f"http://127.0.0.1:{port}/harness.html"],
                       tmp_path / "profile")
    finally:
        coord.run(runner.cleanup(), 10)
    assert 'data-done="1"' in dom, dom[-3000:]
    out = json.loads(re.search(r'<pre id="out">(.*?)</pre>', dom, re.S).group(1).replace("&amp;", "&")
                     .replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"'))
    assert out["name"] == "H3MultiStreamAsync.Controls"
    assert out["menu"] == [{"path": ["H3 MultiStream"], "commands": out["ids"]}]
    assert out["ids"] == ["H3MultiStreamAsync.Status", "H3MultiStreamAsync.OpenPanel", "H3MultiStreamAsync.ShowTab",
                          "H3MultiStreamAsync.ReleaseWorkers", "H3MultiStreamAsync.ClearWeightStore",
                          "H3MultiStreamAsync.DetachHooks"]
    assert out["executed"] == ["Workspace.ToggleSidebarTab.h3multistream"]
    assert out["tab"] == {"id": "h3multistream", "title": "H3 MultiStream", "type": "custom"}
    status, release, detach = out["toasts"]
    assert status["severity"] == "info" and status["summary"] == "H3 MultiStream status"
    lines = status["detail"].split("\n")
    assert lines[0] == "GPUs: no plan yet"
    assert lines[1].startswith("Last step: 1.500s on cuda:0+cuda:1 (1000 tokens, exchange host x4; "
                               "compute 1.000/0.777s")
    assert lines[2] == "Workers: none" and lines[-1].startswith("RAM available")
    assert release["severity"] == "warn" and "workers left running" in release["detail"]
    assert detach["severity"] == "warn" and "hooks left attached" in detach["detail"]
    # the sidebar tab: the recorded step, then the one the websocket event brought, as the page shows them
    tab = re.search(r'<div id="sidebar">(.*)<div id="exact"', dom, re.S).group(1)
    assert 'class="h3ms-tab h3ms-panel"' in tab and 'data-loaded="1"' in tab
    assert re.findall(r'data-seq="(\d+)"', tab) == ["1", "0"]
    assert rank_row(tab, 1)[5] == "0.777" and "live (websocket)" in tab
    assert "no plan probed yet" in tab and "no verify run yet" in tab  # the hub has no exactness section
    # the exactness rows, newest first, in words
    exact = re.search(r'<div id="exact"[^>]*>(.*)', dom, re.S).group(1)
    rows = [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in re.findall(r'<tr class="verdict [^"]*">(.*?)</tr>', exact, re.S)]
    assert rows[0] == ["dit", "attn.qkv_proj", "cuda:1 NVIDIA H200", "int8", "78491x5376x16128", "39248, 39243",
                       "adjusted", "shard boundary moved to a multiple of 16 rows", "8.3 ms", "2026-12-03T19:00:01"]
    assert rows[1][6] == "exact" and rows[1][5] == "39246, 39245"
    assert rows[2] == ["2026-12-03T19:05:00", "cuda:0 NVIDIA H200, cuda:1 NVIDIA H200", "yes", "0", "none", "1"]
    # the status sections are rows of words: no JSON braces, no reprs
    sections = re.search(r'class="cols">(.*?)</section>', exact, re.S).group(1)
    assert "{" not in sections and "GPU plan" in sections and "no plan yet" in sections, sections
