"""The pack's HTTP surface, registered on any aiohttp ``RouteTableDef``.

Inside ComfyUI the nodes layer passes ``PromptServer.instance.routes`` (ComfyUI mirrors every route
under ``/api``); the standalone server (:mod:`h3ms_async.observability.serve`) passes its own table.
Every answer is JSON except the panel's files.

Providers and actions may block (they can wait on the coordinator loop, or join worker processes),
so they run in the default executor: the server loop stays responsive, and the standalone server —
which runs *on* the coordinator loop — cannot deadlock on a provider that waits for that same loop.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from h3ms_async import PACK_ROOT
from h3ms_async.log import get_logger, tail_file
from h3ms_async.status.hub import RING_SIZE, StatusHub, get_hub

_log = get_logger("Status")

PREFIX = "/h3multistream"
WEB_DIR = PACK_ROOT / "web"
# The only files the panel routes serve; anything else is a 404, so no request can name a path of
# its own.
PANEL_FILES = {
    "panel.html": "text/html",
    "panel.js": "text/javascript",
    "panel.css": "text/css",
}
STEPS_DEFAULT, STEPS_MAX = 50, RING_SIZE
LINES_DEFAULT, LINES_MAX = 200, 2000

LogTail = Callable[[int, int], list[str]]

# (route suffix, action name, what "busy" leaves in place) for the mutating routes
MUTATING = (
    ("/workers/release", "release_workers", "a prompt is running; workers left running"),
    ("/cache/clear_weights", "clear_weights", "a prompt is running; weight store left in place"),
    ("/hooks/detach", "detach_hooks", "a prompt is running; hooks left attached"),
    (
        "/cache/clear_text",
        "clear_text_cache",
        "a prompt is running; text-encoder outputs left in place",
    ),
)


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


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _is_loopback_name(hostname: str) -> bool:
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def request_refusal(request: web.Request) -> str | None:
    """Why a browser-borne request must be refused, or None.  Two attacks, both from a web page on
    this machine:

    * DNS rebinding: a page whose name resolves to 127.0.0.1 is "same-origin" with itself, so the
      browser lets it read and write; its ``Host`` header still names the attacker's domain.  A
      request that reached us over loopback must name a loopback host (localhost, 127.0.0.1, [::1]).
    * Cross-site writes: any page can POST to 127.0.0.1.  A state-changing request with an
      ``Origin`` must come from this very origin; ``Origin: null`` (sandboxed iframes, data: URLs)
      and a ``Sec-Fetch-Site`` of cross-site or same-site are refused.  Clients that send no Origin
      (curl, scripts) are not browsers and pass.

    Reads stay unreadable cross-site because no route sends CORS headers.
    """
    host = request.host or ""
    sockname = (
        request.transport.get_extra_info("sockname") if request.transport is not None else None
    )
    local_ip = sockname[0] if isinstance(sockname, tuple) and sockname else None
    if local_ip is not None and _is_loopback_name(local_ip.split("%", 1)[0]):
        hostname = urlsplit("//" + host).hostname or ""
        if not _is_loopback_name(hostname):
            return (
                f"Host {host[:80]!r} is not a loopback name but this request came over loopback (a "
                "DNS rebinding page?); open the panel as http://127.0.0.1:<port> or "
                "http://localhost:<port>"
            )
    if request.method not in SAFE_METHODS:
        origin = request.headers.get("Origin")
        if origin == "null":
            return (
                "Origin: null (a sandboxed frame or a local file) may not change state; use the "
                "panel served by this server, or a client without an Origin header"
            )
        if request.headers.get("Sec-Fetch-Site") in ("cross-site", "same-site"):
            return (
                f"a {request.headers['Sec-Fetch-Site']} {request.method} may not change state; use "
                "the panel served by this server"
            )
        if origin is not None and urlsplit(origin).netloc != host:
            return (
                f"cross-origin {request.method} from {origin[:80]} refused; use the panel served "
                "by this server, or a client without an Origin header"
            )
    return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guarded(handler: Handler) -> Handler:
    """``handler`` behind :func:`request_refusal` (403 with a JSON error)."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        why = request_refusal(request)
        if why is not None:
            return _json_error(403, why)
        return await handler(request)

    return wrapper


def action_release_workers() -> dict:
    """Release every engine of every rank program alive in this process: its workers and resident
    state (the split's weight store and step buffers, the attention helpers' buffers, ...)."""
    from h3ms_async.runtime.engines import release_engines

    done = [f"{reg.label} released ({n} engine(s))" for reg, n, _busy in release_engines() if n]
    return {"message": "; ".join(done) or "no split workers were running"}


def action_clear_weights() -> dict:
    """Drop every live engine's shared-memory weight store (the workers stay up and reload it on the
    next step) and every pinned copy of the VAE / text-encoder weight caches (refilled at ComfyUI's
    next unload).  ``caches`` says what the weight caches gave back
    (:class:`h3ms_async.caches.Freed`): a copy that is the host weights of a model ComfyUI has
    unloaded stays in RAM with that model (``kept_bytes``)."""
    from h3ms_async.caches import weight_cache
    from h3ms_async.runtime.engines import live_engines

    n = sum(eng.release_weights() for eng in live_engines())
    freed = weight_cache().clear()
    store = (
        f"weight store cleared ({n} dropped; workers kept, the next step refills it)"
        if n
        else "no weight store was held"
    )
    return {"message": f"{store}; weight caches: {freed.text()}", "caches": freed.as_dict()}


def action_clear_text_cache() -> dict:
    """Drop every cached text-encoder output (the hit/miss counters stay); ``text_encoder_outputs``
    says how many and what that gave back (:class:`h3ms_async.caches.Freed`)."""
    from h3ms_async.caches import output_cache

    n, freed = output_cache().clear()
    return {
        "message": f"text-encoder output cache cleared ({n} entries): {freed.text()}",
        "text_encoder_outputs": {"entries": n, **freed.as_dict()},
    }


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter clamped into [lo, hi]; a non-integer raises a 400 with a JSON
    body."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        msg = f"query parameter {name} must be an integer in {lo}..{hi}, got {raw[:40]!r}"
        raise web.HTTPBadRequest(
            text=json.dumps({"error": msg}), content_type="application/json"
        ) from None
    return max(lo, min(hi, v))


async def _off_loop(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def add_routes(
    routes: web.RouteTableDef,
    *,
    hub: StatusHub | None = None,
    log_tail: LogTail | None = None,
    web_dir: str | os.PathLike | None = None,
    guard: bool = True,
) -> None:
    """Register the status, steps, worker-log, control and panel routes on ``routes``.

    ``log_tail(rank, lines)`` returns the tail of a worker's log and raises KeyError for an unknown
    rank; by default it reads the ``log`` path the hub's workers provider reports for that rank.
    ``web_dir`` is where the panel's files are (the pack's ``web/``). ``guard``: put every route
    behind :func:`request_refusal` (a server whose middleware already does that, the standalone one,
    passes False).
    """
    the_hub = hub

    def log_path(rank: int) -> str | None:
        # the process hub is looked up per call, so a replaced hub is followed
        return (the_hub or get_hub()).worker_log_path(rank)

    tail: LogTail = log_tail or log_tail_from_paths(log_path)
    files_dir = Path(web_dir) if web_dir is not None else WEB_DIR

    def get(path: str) -> Callable[[Handler], Handler]:
        return lambda fn: routes.get(path)(guarded(fn) if guard else fn)

    def post(path: str) -> Callable[[Handler], Handler]:
        return lambda fn: routes.post(path)(guarded(fn) if guard else fn)

    def h() -> StatusHub:
        # resolved per request so that a hub=None table follows get_hub() (tests may build their own
        # hubs)
        return the_hub or get_hub()

    @get(PREFIX + "/status")
    async def status(request: web.Request) -> web.Response:
        try:
            return web.json_response(await _off_loop(h().status))
        except Exception as exc:  # noqa: BLE001 - answered, not raised: the panel shows it
            _log.exception("status failed")
            return _json_error(500, f"status failed: {type(exc).__name__}: {exc}")

    @get(PREFIX + "/steps")
    async def steps(request: web.Request) -> web.Response:
        n = _int_param(request, "n", STEPS_DEFAULT, 1, STEPS_MAX)
        after_raw = request.query.get("after")
        after = None
        if after_raw not in (None, ""):
            try:
                after = int(after_raw)
            except ValueError:
                return _json_error(
                    400,
                    f"query parameter after must be an integer step seq, got {after_raw[:40]!r}",
                )
        recs = h().recent_steps(n, after=after)
        return web.json_response(
            {"n": n, "steps": recs, "latest_seq": recs[-1]["seq"] if recs else after}
        )

    @get(PREFIX + "/workers/{rank}/log")
    async def worker_log(request: web.Request) -> web.Response:
        raw = request.match_info["rank"]
        if not raw.isdigit() or not raw.isascii():
            return _json_error(400, f"rank must be a non-negative integer, got {raw[:40]!r}")
        rank = int(raw)
        lines = _int_param(request, "lines", LINES_DEFAULT, 1, LINES_MAX)
        try:
            got = await _off_loop(lambda: tail(rank, lines))
        except KeyError:
            return _json_error(
                404, f"no worker with rank {rank}; see GET {PREFIX}/status for the running ranks"
            )
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
                return web.json_response(
                    {
                        "busy": False,
                        "message": f"nothing to do: no {action} handler in this process (no worker "
                        "pool or weight store has started)",
                    }
                )
            try:
                result = await _off_loop(fn)
            except Exception as exc:  # noqa: BLE001
                _log.exception("%s failed", action)
                return _json_error(500, f"{action} failed: {type(exc).__name__}: {exc}")
            if not isinstance(result, dict):
                return _json_error(
                    500, f"{action} returned {type(result).__name__}, expected a dict"
                )
            return web.json_response({"busy": False, **result})

        handler.__name__ = action
        return handler

    for suffix, action, busy_msg in MUTATING:
        post(PREFIX + suffix)(make_mutating(action, busy_msg))

    def panel_file(name: str) -> web.Response:
        path = files_dir / name
        try:
            body = path.read_bytes()
        except OSError:
            return _json_error(404, f"panel file {name} is missing from {files_dir}")
        return web.Response(
            body=body, content_type=PANEL_FILES[name], headers={"Cache-Control": "no-cache"}
        )

    @get(PREFIX + "/panel")
    async def panel(request: web.Request) -> web.Response:
        return panel_file("panel.html")

    @get(PREFIX + "/web/{name}")
    async def panel_static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in PANEL_FILES:
            return _json_error(
                404, f"no such panel file; served files: {', '.join(sorted(PANEL_FILES))}"
            )
        return panel_file(name)
