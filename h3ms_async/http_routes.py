"""The pack's HTTP surface, registered on any aiohttp ``RouteTableDef``.

Inside ComfyUI the nodes layer passes ``PromptServer.instance.routes`` (ComfyUI mirrors every route under ``/api``);
the standalone server (:mod:`h3ms_async.serve`) passes its own table. Every answer is JSON except the panel's files.

Providers and actions may block (they can wait on the coordinator loop, or join worker processes), so they run in
the default executor: the server loop stays responsive, and the standalone server — which runs *on* the coordinator
loop — cannot deadlock on a provider that waits for that same loop.
"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from h3ms_async.log import get_logger
from h3ms_async.status import RING_SIZE, StatusHub, get_hub

_log = get_logger("Status")

PREFIX = "/h3multistream"
WEB_DIR = Path(__file__).resolve().parent.parent / "web"
# The only files the panel routes serve; anything else is a 404, so no request can name a path of its own.
PANEL_FILES = {
    "panel.html": "text/html",
    "panel.js": "text/javascript",
    "panel.css": "text/css",
}
STEPS_DEFAULT, STEPS_MAX = 50, RING_SIZE
LINES_DEFAULT, LINES_MAX = 200, 2000
_TAIL_BLOCK = 64 * 1024
_TAIL_MAX_BYTES = 8 * 1024 * 1024  # 2000 lines of 4 KiB each; a log with longer lines is cut at this many bytes

LogTail = Callable[[int, int], list[str]]

# (route suffix, action name, what "busy" leaves in place) for the mutating routes
MUTATING = (
    ("/workers/release", "release_workers", "a prompt is running; workers left running"),
    ("/cache/clear_weights", "clear_weights", "a prompt is running; weight store left in place"),
    ("/hooks/detach", "detach_hooks", "a prompt is running; hooks left attached"),
)


def tail_file(path: str | os.PathLike, lines: int) -> list[str]:
    """The last ``lines`` lines of a text file, read backwards in blocks from the end (never the whole file).

    At most 8 MiB are read, so a pathological file with no newlines costs a bounded read. A missing file (a worker
    that has not written yet) gives an empty list. Undecodable bytes are replaced, not fatal.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    with f:
        f.seek(0, os.SEEK_END)
        pos = f.tell()
        buf = b""
        # lines + 1 newlines guarantee `lines` complete lines (the last line may lack its newline)
        while pos > 0 and buf.count(b"\n") <= lines and len(buf) < _TAIL_MAX_BYTES:
            step = min(_TAIL_BLOCK, pos, _TAIL_MAX_BYTES - len(buf))
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
    text = buf.decode("utf-8", errors="replace")
    out = text.splitlines()
    if pos > 0 and out:
        out = out[1:]  # the first line is cut at a block boundary
    return out[-lines:] if lines > 0 else []


def log_tail_from_paths(path_of: Callable[[int], str | os.PathLike | None]) -> LogTail:
    """A ``log_tail`` callable from ``path_of(rank) -> log path`` (KeyError for an unknown rank).

    The path comes from the pool (inside its private run dir), never from the request.
    """
    def tail(rank: int, lines: int) -> list[str]:
        path = path_of(rank)
        return [] if path is None else tail_file(path, lines)
    return tail


def _json_error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": msg}, status=status)


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter clamped into [lo, hi]; a non-integer raises a 400 with a JSON body."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        msg = f"query parameter {name} must be an integer in {lo}..{hi}, got {raw[:40]!r}"
        raise web.HTTPBadRequest(text=json.dumps({"error": msg}), content_type="application/json") from None
    return max(lo, min(hi, v))


async def _off_loop(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def add_routes(routes: web.RouteTableDef, *, hub: StatusHub | None = None, log_tail: LogTail | None = None,
               web_dir: str | os.PathLike | None = None) -> None:
    """Register the status, steps, worker-log, control and panel routes on ``routes``.

    ``log_tail(rank, lines)`` returns the tail of a worker's log and raises KeyError for an unknown rank; by default
    it reads the ``log`` path the hub's workers provider reports for that rank. ``web_dir`` is where the panel's
    files are (the pack's ``web/``).
    """
    the_hub = hub
    tail: LogTail = log_tail or log_tail_from_paths(lambda r: (the_hub or get_hub()).worker_log_path(r))
    files_dir = Path(web_dir) if web_dir is not None else WEB_DIR

    def h() -> StatusHub:
        # resolved per request so that a hub=None table follows get_hub() (tests may build their own hubs)
        return the_hub or get_hub()

    @routes.get(PREFIX + "/status")
    async def status(request: web.Request) -> web.Response:
        try:
            return web.json_response(await _off_loop(h().status))
        except Exception as exc:  # noqa: BLE001 - answered, not raised: the panel shows it
            _log.exception("status failed")
            return _json_error(500, f"status failed: {type(exc).__name__}: {exc}")

    @routes.get(PREFIX + "/steps")
    async def steps(request: web.Request) -> web.Response:
        n = _int_param(request, "n", STEPS_DEFAULT, 1, STEPS_MAX)
        after_raw = request.query.get("after")
        after = None
        if after_raw not in (None, ""):
            try:
                after = int(after_raw)
            except ValueError:
                return _json_error(400, f"query parameter after must be an integer step seq, got {after_raw[:40]!r}")
        recs = h().recent_steps(n, after=after)
        return web.json_response({"n": n, "steps": recs, "latest_seq": recs[-1]["seq"] if recs else after})

    @routes.get(PREFIX + "/workers/{rank}/log")
    async def worker_log(request: web.Request) -> web.Response:
        raw = request.match_info["rank"]
        if not raw.isdigit() or not raw.isascii():
            return _json_error(400, f"rank must be a non-negative integer, got {raw[:40]!r}")
        rank = int(raw)
        lines = _int_param(request, "lines", LINES_DEFAULT, 1, LINES_MAX)
        try:
            got = await _off_loop(lambda: tail(rank, lines))
        except KeyError:
            return _json_error(404, f"no worker with rank {rank}; see GET {PREFIX}/status for the running ranks")
        except OSError as exc:
            return _json_error(500, f"cannot read the log of rank {rank}: {exc}")
        return web.json_response({"rank": rank, "lines": got})

    def make_mutating(action: str, busy_msg: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            hub_ = h()
            if await _off_loop(hub_.busy):
                return web.json_response({"busy": True, "message": busy_msg})
            fn = hub_.action(action)
            if fn is None:
                return web.json_response({"busy": False, "message": f"nothing to do: no {action} handler in this "
                                          "process (no worker pool or weight store has started)"})
            try:
                result = await _off_loop(fn)
            except Exception as exc:  # noqa: BLE001
                _log.exception("%s failed", action)
                return _json_error(500, f"{action} failed: {type(exc).__name__}: {exc}")
            if not isinstance(result, dict):
                return _json_error(500, f"{action} returned {type(result).__name__}, expected a dict")
            return web.json_response({"busy": False, **result})
        handler.__name__ = action
        return handler

    for suffix, action, busy_msg in MUTATING:
        routes.post(PREFIX + suffix)(make_mutating(action, busy_msg))

    def panel_file(name: str) -> web.Response:
        path = files_dir / name
        try:
            body = path.read_bytes()
        except OSError:
            return _json_error(404, f"panel file {name} is missing from {files_dir}")
        return web.Response(body=body, content_type=PANEL_FILES[name], headers={"Cache-Control": "no-cache"})

    @routes.get(PREFIX + "/panel")
    async def panel(request: web.Request) -> web.Response:
        return panel_file("panel.html")

    @routes.get(PREFIX + "/web/{name}")
    async def panel_static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in PANEL_FILES:
            return _json_error(404, f"no such panel file; served files: {', '.join(sorted(PANEL_FILES))}")
        return panel_file(name)
