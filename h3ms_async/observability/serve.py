"""Standalone HTTP server: the status/control routes, the live panel, and a Server-Sent-Events feed
of step records.

Inside ComfyUI the routes ride on ComfyUI's own server and steps reach the frontend over its
websocket; outside it (``python -m h3ms_async serve``, :mod:`h3ms_async.tools.serve`; or the demo
via :func:`start_background_server`) this module is the server, and ``GET /h3multistream/events``
is the live feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from h3ms_async.log import get_logger
from h3ms_async.observability.routes import (
    PREFIX,
    LogTail,
    action_clear_weights,
    action_release_workers,
    add_routes,
    request_refusal,
)
from h3ms_async.status.hub import RING_SIZE, StatusHub, get_hub

_log = get_logger("Serve")

# a stream closes after this; EventSource reconnects with ?after / Last-Event-ID
EVENTS_DEFAULT_S, EVENTS_MAX_S = 60, 300
HEARTBEAT_S = 15.0
CLIENT_POLL_S = 1.0  # how soon a stream notices that its client left (and frees its slot)
MAX_STREAMS = 16
# per stream; on overflow the oldest record is dropped and the client sees a seq gap
QUEUE_SIZE = 64

#: each open event stream's ``put`` (None ends the stream)
_STREAMS = web.AppKey("h3ms_streams", set[Callable[[dict | None], None]])


def _sse(rec: dict) -> bytes:
    data = json.dumps(rec, separators=(",", ":"))
    return f"id: {rec['seq']}\nevent: step\ndata: {data}\n\n".encode()


def _parse_int(raw: str | None) -> int | None:
    if raw in (None, ""):
        return None
    return int(raw)


def add_event_route(routes: web.RouteTableDef, *, hub: StatusHub | None = None) -> None:
    """``GET /h3multistream/events?after=SEQ&timeout=S``: step records as Server-Sent Events.

    Records with ``seq > after`` (or > the ``Last-Event-ID`` header) still in the ring are sent
    first, then new ones as they are recorded. A stream lives at most ``timeout`` seconds (default
    60, max 300), sends a comment every 15 s so proxies keep it open, and ends at once when the
    server shuts down. At most 16 streams at a time.
    """

    @routes.get(PREFIX + "/events")
    async def events(request: web.Request) -> web.StreamResponse:
        the_hub = hub or get_hub()
        try:
            # a reconnecting EventSource repeats its first URL's ?after but sends the newer
            # Last-Event-ID
            marks = [
                m
                for m in (
                    _parse_int(request.query.get("after")),
                    _parse_int(request.headers.get("Last-Event-ID")),
                )
                if m is not None
            ]
            after = max(marks) if marks else None
            timeout = _parse_int(request.query.get("timeout"))
        except ValueError:
            return web.json_response(
                {"error": "after and timeout must be integers (a step seq, seconds)"}, status=400
            )
        timeout = EVENTS_DEFAULT_S if timeout is None else max(1, min(EVENTS_MAX_S, timeout))
        streams = request.app[_STREAMS]
        if len(streams) >= MAX_STREAMS:
            return web.json_response(
                {
                    "error": f"too many event streams open (max {MAX_STREAMS}); poll GET "
                    f"{PREFIX}/steps?after=SEQ instead"
                },
                status=503,
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict | None] = asyncio.Queue(maxsize=QUEUE_SIZE)

        def put(item: dict | None) -> None:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(item)

        def on_step(rec: dict) -> None:
            # the loop closed between removal and this call: the stream is gone anyway
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(put, rec)

        # listen before reading the backlog so nothing recorded in between is lost; seq dedupes the
        # overlap
        remove = the_hub.add_listener(on_step)
        streams.add(put)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        try:
            await resp.prepare(request)
            await resp.write(b"retry: 2000\n\n")
            last = after
            if after is not None:
                for past in the_hub.recent_steps(RING_SIZE, after=after):
                    await resp.write(_sse(past))
                    last = past["seq"]
            deadline = loop.time() + timeout
            next_beat = loop.time() + HEARTBEAT_S
            while (remaining := deadline - loop.time()) > 0:
                if request.transport is None or request.transport.is_closing():
                    break  # the client left: free the slot now, not at the next keepalive write
                try:
                    rec = await asyncio.wait_for(queue.get(), min(remaining, CLIENT_POLL_S))
                except TimeoutError:
                    if loop.time() >= next_beat and deadline - loop.time() > 0:
                        await resp.write(b": keepalive\n\n")
                        next_beat = loop.time() + HEARTBEAT_S
                    continue
                if rec is None:  # server shutdown
                    break
                if last is not None and rec["seq"] <= last:
                    continue
                await resp.write(_sse(rec))
                last = rec["seq"]
        except (ConnectionResetError, ConnectionError):
            pass  # the client went away; nothing to clean beyond the finally
        finally:
            remove()
            streams.discard(put)
        return resp


@web.middleware
async def _guard_and_json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every route behind :func:`routes.request_refusal` (these routes stop workers; DNS rebinding
    and cross-site writes are refused), and the framework's own 404/405 answered as JSON errors like
    every other reply."""
    why = request_refusal(request)
    if why is not None:
        return web.json_response({"error": why}, status=403)
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status not in (404, 405) or exc.content_type == "application/json":
            raise
        what = "no such route" if exc.status == 404 else f"{request.method} is not allowed here"
        return web.json_response(
            {
                "error": f"{what}: {request.method} {request.path[:200]}; the panel is at "
                f"{PREFIX}/panel"
            },
            status=exc.status,
            headers=_allow_header(exc),
        )


def _allow_header(exc: web.HTTPException) -> dict:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}


async def _close_streams(app: web.Application) -> None:
    for put in app[_STREAMS].copy():
        put(None)


def build_app(*, hub: StatusHub | None = None, log_tail: LogTail | None = None) -> web.Application:
    """The standalone aiohttp application: :func:`h3ms_async.observability.routes.add_routes` plus
    the event stream."""
    app = web.Application(middlewares=[_guard_and_json_errors])
    app[_STREAMS] = set()
    the_hub = hub or get_hub()
    # Outside ComfyUI nobody else registers the release actions: release what this process shows.
    for name, fn in (
        ("release_workers", action_release_workers),
        ("clear_weights", action_clear_weights),
    ):
        if the_hub.action(name) is None:
            the_hub.register_action(name, fn)
    routes = web.RouteTableDef()
    add_routes(routes, hub=hub, log_tail=log_tail, guard=False)
    add_event_route(routes, hub=hub)

    @routes.get("/")
    async def root(request: web.Request) -> web.Response:
        raise web.HTTPFound(PREFIX + "/panel")

    app.add_routes(routes)
    app.on_shutdown.append(_close_streams)
    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 8189,
    *,
    hub: StatusHub | None = None,
    log_tail: LogTail | None = None,
) -> None:
    """Run the standalone server in the calling thread until interrupted (Ctrl-C)."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        _log.warning(
            "serving on %s: these routes have no authentication and can stop workers; prefer "
            "127.0.0.1 behind an SSH tunnel",
            host,
        )
    # logged once the socket is bound (run_app's print hook), so a bind error is the only line a
    # user sees
    web.run_app(
        build_app(hub=hub, log_tail=log_tail),
        host=host,
        port=port,
        shutdown_timeout=5.0,
        print=lambda _: _log.info("live panel on http://%s:%d%s/panel", host, port, PREFIX),
    )


RunOnLoop = Callable[[Coroutine[Any, Any, Any], float], Any]


def _coordinator_runner() -> RunOnLoop:
    from h3ms_async.runtime.coordinator import get_coordinator

    return get_coordinator().run


def start_background_server(
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    hub: StatusHub | None = None,
    log_tail: LogTail | None = None,
    run: RunOnLoop | None = None,
) -> tuple[str, Callable[[], None]]:
    """Serve the routes and panel from a running loop, through ``run(coro, timeout)`` (default: the
    coordinator's ``run``).

    Returns ``(base_url, stop)``: ``base_url`` names the port actually bound (``port=0`` picks a
    free one); ``stop()`` closes open event streams and the listening socket, within 10 s.
    """
    run = run or _coordinator_runner()
    app = build_app(hub=hub, log_tail=log_tail)

    async def start() -> tuple[web.AppRunner, int]:
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        return runner, runner.addresses[0][1]

    runner, bound = run(start(), 30.0)
    url = f"http://{host}:{bound}"
    _log.info("live panel on %s%s/panel", url, PREFIX)
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            run(runner.cleanup(), 10.0)

    return url, stop
