"""Handlers of the test request kinds (``workers/testing/protocol.py``): sleep until aborted, crash,
block the loop, write raw bytes on the channel."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from workers.runtime.handlers import WorkerContext, WorkerUnusable, handler
from workers.runtime.protocol import Done
from workers.testing import protocol as test_protocol


@handler(test_protocol.Sleep)
async def _sleep(ctx: WorkerContext, msg: test_protocol.Sleep) -> test_protocol.Slept:
    """Sleep, but stop early with an error when the pool aborts (doorbell + abort generation)."""
    seconds = float(msg.seconds)
    gen = ctx.abort_generation()
    loop = asyncio.get_running_loop()
    rung = asyncio.Event()
    fd = ctx.doorbell_fds[ctx.rank]

    def _ring() -> None:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            return
        rung.set()

    loop.add_reader(fd, _ring)
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            rung.clear()
            try:
                await asyncio.wait_for(rung.wait(), left)
            except TimeoutError:
                break
            if ctx.abort_generation() != gen:
                raise RuntimeError(f"rank {ctx.rank}: sleep aborted by the pool")
    finally:
        loop.remove_reader(fd)
    return test_protocol.Slept(slept=seconds)


@handler(test_protocol.Crash)
async def _crash(ctx: WorkerContext, msg: test_protocol.Crash) -> Done:
    how = msg.how
    ctx.log.warning("test hook: crashing (%s)", how)
    for h in ctx.log.handlers + logging.getLogger().handlers:
        h.flush()
    if how == "exit":
        os._exit(int(msg.code))
    if how == "unusable":
        raise WorkerUnusable("test hook: this worker's GPU queue waits on a dead peer")
    os.kill(os.getpid(), signal.SIGKILL)
    return Done()


@handler(test_protocol.Hang)
async def _hang(ctx: WorkerContext, msg: test_protocol.Hang) -> Done:
    ctx.log.warning("test hook: blocking the loop for %.1f s", msg.seconds)
    time.sleep(float(msg.seconds))  # on purpose: the loop (and its heartbeats) stop
    return Done()


@handler(test_protocol.Inject)
async def _inject(ctx: WorkerContext, msg: test_protocol.Inject) -> Done:
    """Write raw bytes on this worker's channel (to test the coordinator's protocol checks)."""
    writer = ctx.state["_writer"]
    writer.write(bytes(msg.raw))
    if msg.close:
        writer.write_eof()
    await writer.drain()
    return Done()
