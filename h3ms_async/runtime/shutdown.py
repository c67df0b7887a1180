"""Stopping a pool's workers: each ready one is asked to shut down, a worker still running after
the grace period is killed, and every one ends stopped with its channel closed and its pidfd
unwatched."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from h3ms_async.log import get_logger
from h3ms_async.runtime.channel import Channel, ChannelClosed, RemoteError
from h3ms_async.runtime.exit_watch import unwatch_exit, wait_exits
from h3ms_async.runtime.worker_handle import WorkerHandle, WorkerState
from workers.runtime import protocol

log = get_logger("pool")


async def stop_workers(workers: Sequence[WorkerHandle], grace: float, pool: str) -> None:
    """Ask every ready worker to shut down, kill those still running after ``grace`` s, and wait
    for every exit (up to 5 s more)."""
    live = [w.channel for w in workers if w.state == WorkerState.READY and w.channel is not None]
    for w in workers:
        if w.hb_timer is not None:
            w.hb_timer.cancel()
            w.hb_timer = None
        if w.state != WorkerState.DEAD:
            w.state = WorkerState.STOPPING

    async def _ask(ch: Channel) -> None:
        with contextlib.suppress(ChannelClosed, RemoteError, TimeoutError, OSError):
            await ch.request(protocol.Shutdown(), timeout=grace)

    if live:
        await asyncio.gather(*(_ask(ch) for ch in live))
    await wait_exits(workers, grace)
    for w in workers:
        if w.proc is not None and w.proc.poll() is None:
            log.warning(
                "pool %r: rank %d (pid %d) did not exit within %g s; killing it",
                pool,
                w.rank,
                w.pid,
                grace,
            )
            w.proc.kill()
    await wait_exits(workers, 5.0)
    for w in workers:
        unwatch_exit(w)
        if w.channel is not None:
            w.channel.close("pool released")
        w.state = WorkerState.STOPPED
