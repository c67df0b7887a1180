"""The pack in a running ComfyUI, driven through ComfyUI's real frontend in a real browser.

A real ``main.py`` server from the ComfyUI tree (``tests/comfy_tree.py``) with the pack in ``custom_nodes/``, two CPU
ranks (``H3MS_RANK_MAP=cpu,cpu``) and tiny models under the file names of the example workflows
(``tests/browser_comfy.py``); Playwright drives Debian's chromium (``executable_path``: there is no browser
download). One test walks what a user does:

1. the H3 MultiStream entry in ComfyUI's main menu lists the pack's commands; *Open live panel* opens the panel
   page; the H3 MultiStream sidebar tab opens the same panel next to the pack's example workflow, which the
   frontend finds ready to run (no "issues found": every model its loaders name is there);
2. a sampling prompt queued through ``POST /prompt``: the page and the tab show each rank's compute / exchange /
   wait per step as the steps arrive over ComfyUI's websocket (every step, in order: the 3 s status poll could
   not) and plot them per rank; screenshots mid-run (the page, and ComfyUI with the tab);
3. the worker-log view shows the tail of rank 1's log file; the GPU plan, hooks, caches and text-encoder outputs
   are readable rows (no JSON, no Python reprs) holding the status route's values; the exactness section shows
   its rows or its empty state;
4. a second sampling prompt whose rank 1 hangs mid-run (SIGSTOP; the pool's heartbeat check kills it and fails the
   job): ComfyUI's page, whose client id the prompts carry, shows a toast naming the rank and its log;
5. the tab's *Release workers* frees the rank the failed run left and says so, and the page shows it; a
   screenshot;
6. a third prompt, *H3 MS Release Resources*, finds nothing left to free and says so.

Then the server stops; no process, shm segment or run dir of it may be left. Screenshots and ComfyUI's log go to
``$H3MS_BROWSER_OUT`` (default ``.out/browser_comfy`` in the checkout); ``H3MS_DOCS_SCREENSHOTS=1`` also refreshes
the README's copies in ``docs/``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests import comfy_tree
from tests.browser_comfy import (TESTS_ENV, ComfyServer, comfy_server, release_workflow, sample_workflow,
                                 write_models_dir)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - scripts/h3ms.sh installs it
    sync_playwright = None

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(420),  # ~75 s on 2 idle cores; a loaded machine is much slower
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed: apt-get install -y chromium "
                                                "(scripts/h3ms.sh test installs it where it can)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: run `bash scripts/h3ms.sh test`"),
    pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason())),
]

OUT = Path(os.environ.get("H3MS_BROWSER_OUT", comfy_tree.ROOT / ".out" / "browser_comfy"))
DOCS = comfy_tree.ROOT / "docs"
MENU_LABELS = ["Show status", "Open live panel", "Show live panel tab", "Release workers", "Clear weight store",
               "Detach hooks"]
STEPS_A = 12
NUM = r"\d+\.\d{3}"
HEARTBEAT_S = 4  # a stopped worker is declared dead this soon (mid-step: a sampling step comes every ~1 s)


@pytest.fixture
def comfy(tmp_path):
    """A real ComfyUI server with the pack, in a private user dir, models dir and run-dir base."""
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = write_models_dir(tmp_path / "models")
    env = {**TESTS_ENV, "H3MS_RANK_MAP": "cpu,cpu", "H3MS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)}
    with comfy_server(tmp_path, cfg, env, OUT / "comfyui.log") as server:
        yield server


def wait_until(what: str, probe, timeout_s: float, server: ComfyServer, every: float = 0.1):
    """Poll ``probe()`` until it returns something truthy; fail naming ``what`` with the server's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what} within {timeout_s:g} s\n--- ComfyUI log ---\n{server.log_tail()}")


def shoot(page, name: str, docs: bool = False) -> Path:
    """A full-page screenshot into OUT (and, with ``docs`` and H3MS_DOCS_SCREENSHOTS=1, into docs/ too)."""
    path = OUT / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 20_000, f"{path} is nearly empty"
    if docs and os.environ.get("H3MS_DOCS_SCREENSHOTS") == "1":
        shutil.copy(path, DOCS / name)
    return path


# The panel's state in a page: the standalone page's, or ComfyUI's page with the sidebar tab (one panel each).
PANEL_STATE = """() => ({
  feed: document.getElementById("h3ms-feed").textContent,
  running: document.getElementById("h3ms-running").textContent,
  seqs: [...document.querySelectorAll("#h3ms-history tr[data-seq]")].map((tr) => Number(tr.dataset.seq)),
  ranks: [...document.querySelectorAll("#h3ms-ranks tbody tr")].map((tr) =>
    [...tr.querySelectorAll("td")].map((td) => td.textContent)),
  lines: [...document.querySelectorAll("#h3ms-chart polyline.h3ms-chart-rank")].map((l) =>
    [l.dataset.rank, l.getAttribute("points").trim().split(/\\s+/).length]),
})"""
# The readable rows of each status section: {section: [[label, text], ...]}, and the exactness tables' state.
SECTION_ROWS = """() => Object.fromEntries([...document.querySelectorAll(".h3ms-rows")].map((box) =>
  [box.id.replace("h3ms-section-", ""), [...box.querySelectorAll("dt")].map((dt) =>
    [dt.textContent, dt.nextElementSibling.textContent])]))"""
EXACTNESS = """() => ({
  verdicts: document.querySelectorAll("#h3ms-verdicts tbody tr").length,
  verify: document.querySelectorAll("#h3ms-verify tbody tr").length,
  empty: [document.getElementById("h3ms-verdicts-empty").textContent,
          document.getElementById("h3ms-verify-empty").textContent],
  text: [...document.querySelectorAll(".h3ms-rows, #h3ms-exactness, #h3ms-attention-summary, .summary")]
    .map((e) => e.textContent).join("\\n"),
})"""


def test_pack_in_running_comfyui_frontend(comfy):
    server = comfy
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            ctx = browser.new_context(viewport={"width": 1280, "height": 900})
            ctx.set_default_timeout(60_000)
            comfy_page = ctx.new_page()
            comfy_page.goto(server.url)
            comfy_page.wait_for_function("window.app && window.app.graph && window.app.extensionManager")
            # prompts carry the page's client id, as the frontend's own Run does: ComfyUI sends a prompt's errors
            # only to its client
            client = comfy_page.evaluate("async () => (await import('/scripts/api.js')).api.clientId")
            assert client, "ComfyUI's page has no websocket client id"

            # 1. the menu entry and the panel
            comfy_page.locator(".comfyui-logo").first.click()
            comfy_page.get_by_role("menuitem", name="H3 MultiStream", exact=True).hover()
            for label in MENU_LABELS:
                comfy_page.get_by_role("menuitem", name=label, exact=True).wait_for()
            with ctx.expect_page() as opened:
                comfy_page.get_by_role("menuitem", name="Open live panel", exact=True).click()
            panel = opened.value
            assert panel.url == f"{server.url}/api/h3multistream/panel"
            panel.wait_for_selector('#h3ms-panel[data-loaded="1"]')
            panel.wait_for_function('document.getElementById("h3ms-feed").textContent === "live (websocket)"')
            # the graph next to the tab: the pack's own example workflow, as the template browser opens it
            comfy_page.evaluate("""async () => window.app.loadGraphData(await (await fetch(
                "/api/workflow_templates/h3_multistream_async/h3_text_to_video_audio_multistream.json")).json())""")
            comfy_page.get_by_test_id("h3multistream-tab-button").click()
            comfy_page.wait_for_selector('.h3ms-tab[data-loaded="1"]')
            assert comfy_page.locator(".h3ms-tab #h3ms-feed").text_content() == "live (websocket)"

            # 2. a prompt runs: every step reaches the panel as it happens
            prompt_a = server.queue(sample_workflow(STEPS_A, seed=1), client)
            mid = wait_until("the panel showed 5 steps of the running prompt", lambda: (
                (st := panel.evaluate(PANEL_STATE)) and len(st["seqs"]) >= 5 and st["running"] == "running" and st),
                120, server)
            assert mid["feed"] == "live (websocket)"
            assert len(mid["ranks"]) == 2, mid["ranks"]
            for rank, row in enumerate(mid["ranks"]):
                assert row[0] == str(rank) and row[1] == "cpu", row
                assert all(re.fullmatch(NUM, v) for v in row[5:8]), f"compute/exchange/wait of rank {rank}: {row}"
            assert [r for r, _ in mid["lines"]] == ["0", "1"], mid["lines"]
            shoot(panel, "panel_midrun.png", docs=True)
            tab_mid = wait_until("the sidebar tab showed 5 steps of the running prompt", lambda: (
                (st := comfy_page.evaluate(PANEL_STATE)) and len(st["seqs"]) >= 5 and st), 30, server)
            assert len(tab_mid["ranks"]) == 2 and [r for r, _ in tab_mid["lines"]] == ["0", "1"], tab_mid
            assert all(re.fullmatch(NUM, v) for row in tab_mid["ranks"] for v in row[5:8]), tab_mid["ranks"]
            # the workflow is ready to run: the frontend found every model its loaders name (no "issues found")
            assert comfy_page.get_by_test_id("error-overlay").count() == 0, comfy_page.get_by_test_id(
                "error-overlay").all_text_contents()
            shoot(comfy_page, "comfyui_sidebar_tab.png", docs=True)
            assert server.wait_done(prompt_a, 120)["status"]["status_str"] == "success"
            final = wait_until("the panel showed every step", lambda: (
                (st := panel.evaluate(PANEL_STATE)) and len(st["seqs"]) >= STEPS_A and st), 10, server)
            # the history lists newest first; STEPS_A consecutive seqs: the websocket delivered each step
            assert final["seqs"][:STEPS_A] == list(range(final["seqs"][0], final["seqs"][0] - STEPS_A, -1))
            assert all(n >= STEPS_A for _, n in final["lines"]), final["lines"]
            assert final["seqs"][0] == server.get("/h3multistream/steps?n=1")["latest_seq"]
            tab_final = wait_until("the tab showed every step", lambda: (
                (st := comfy_page.evaluate(PANEL_STATE)) and st["seqs"][:1] == final["seqs"][:1] and st), 10, server)
            assert tab_final["seqs"][:STEPS_A] == final["seqs"][:STEPS_A], tab_final["seqs"]

            # 3. the worker-log view: the tail of rank 1's own log file
            status = server.get("/h3multistream/status")
            pid_of = {w["rank"]: w["pid"] for w in status["workers"]}
            log1 = Path(next(w["log"] for w in status["workers"] if w["rank"] == 1))
            panel.locator("#h3ms-worker-1 a", has_text="tail").click()
            panel.wait_for_function('document.getElementById("h3ms-log").textContent.startsWith("rank 1 log")')
            shown = panel.locator("#h3ms-log").text_content().splitlines()
            assert shown[1:] and shown[1:] == log1.read_text().splitlines()[-len(shown[1:]):], shown

            # 3b. the status sections are readable rows with the status route's values, in the page and the tab
            route = server.get("/h3multistream/status")
            te = route["text_encoder_outputs"]
            want_te = f"entries {te['entries']} · hits {te['hits']} · misses {te['misses']}"
            for where in (panel, comfy_page):
                rows = wait_until("the text-encoder output row", lambda: (
                    (r := where.evaluate(SECTION_ROWS)) and r["text_encoder_outputs"] and r), 10, server)
                assert rows["text_encoder_outputs"][0][1].startswith(want_te), rows["text_encoder_outputs"]
                hooks = dict(rows["hooks"])
                assert "exchange host" in hooks["dit_split"] and "devices cpu, cpu" in hooks["dit_split"], hooks
                assert [k for k, _ in rows["plans"]] == ["dit on cpu + cpu"], rows["plans"]
                ex = where.evaluate(EXACTNESS)
                for bad in ("{", "SplitOptions(", "[object"):
                    assert bad not in ex["text"], f"{bad!r} in the panel: {ex['text'][:3000]}"
                exactness = route.get("exactness") or {}
                assert ex["verdicts"] == len(exactness.get("verdicts", [])), ex
                assert ex["verify"] == len(exactness.get("verify", [])), ex
                assert all(e for e in ex["empty"]) == (not exactness.get("verdicts") and not exactness.get("verify"))

            # 4. a worker hangs mid-run (SIGSTOP: it misses its heartbeats and the step's answer): the pool kills it
            #    and fails the prompt; a toast on ComfyUI's page (the prompt's client) names the rank and its log
            prompt_b = server.queue(sample_workflow(40, seed=2), client)
            wait_until("a step of the second prompt", lambda: server.get("/h3multistream/steps?n=1")[
                "latest_seq"] > final["seqs"][0], 120, server, every=0.05)
            os.kill(pid_of[1], signal.SIGSTOP)
            assert server.wait_done(prompt_b, 60)["status"]["status_str"] == "error"
            toast = comfy_page.locator('[data-testid="toast"][data-toast-kind="error"]',
                                       has_text="H3 MultiStream: worker rank 1 failed")
            toast.wait_for()
            text = toast.text_content()
            assert f"log: {log1}" in text and "rank 1 on cpu" in text and "no heartbeat" in text, text
            shoot(comfy_page, "comfyui_worker_error.png")

            # 5. the panel's release frees the workers the failed run left (rank 0) and says so
            left = {w["rank"]: w["state"] for w in server.get("/h3multistream/status")["workers"]}
            assert left.get(1) == "dead" and left.get(0) not in (None, "dead"), left
            comfy_page.wait_for_selector(".h3ms-tab #h3ms-worker-1 td:text-is('dead')")
            comfy_page.locator(".h3ms-tab").get_by_role("button", name="Release workers").click()
            comfy_page.wait_for_function('document.getElementById("h3ms-action-result").textContent'
                                         '.includes("split workers released (1 engine(s))")')
            comfy_page.wait_for_selector(".h3ms-tab #h3ms-workers td:text('no workers running')")
            panel.wait_for_selector("#h3ms-workers td:text('no workers running')")
            assert server.get("/h3multistream/status")["workers"] == []
            shoot(panel, "panel_released.png", docs=True)

            # 6. Release Resources in a prompt of its own: nothing is left to free, and it says so
            prompt_c = server.queue(release_workflow(), client)
            done = server.wait_done(prompt_c, 60)
            assert done["status"]["status_str"] == "success"
            assert "no split workers were running" in json.dumps(done["outputs"]), done["outputs"]
        finally:
            browser.close()
