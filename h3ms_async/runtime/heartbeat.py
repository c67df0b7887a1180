"""Heartbeats: a ready worker sends one every :data:`HB_INTERVAL` s; a timer due when they are
``timeout`` s late marks a silent worker dead (a hung loop sends none, though its process and
channel live on)."""

from __future__ import annotations

import asyncio
import time

from h3ms_async.runtime.worker_handle import WorkerHandle, WorkerState
from workers.runtime import config, protocol

#: Seconds between a worker's heartbeats (sent to it in its welcome).
HB_INTERVAL = 1.0


def on_heartbeat(w: WorkerHandle, msg: protocol.Heartbeat) -> None:
    """Note a heartbeat of ``w``: its time and the memory it reports."""
    w.last_hb = time.monotonic()
    w.rss = msg.rss
    w.vram = msg.vram


def watch_heartbeat(w: WorkerHandle, timeout: float) -> None:
    """Mark a ready ``w`` dead when its last heartbeat is ``timeout`` s old, else re-arm the timer
    for that heartbeat's deadline."""
    w.hb_timer = None
    if w.state != WorkerState.READY:
        return
    late = time.monotonic() - w.last_hb
    if late > timeout:
        w.mark_dead(
            f"no heartbeat for {late:.1f} s "
            f"({config.HEARTBEAT_TIMEOUT.name}={timeout:g}); killed it"
        )
        return
    w.hb_timer = asyncio.get_running_loop().call_later(
        timeout - late + 0.01, watch_heartbeat, w, timeout
    )
