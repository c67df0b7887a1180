"""A worker's exit, reported the moment it happens: the coordinator loop watches each worker's
pidfd, which turns readable once its process has exited; a worker that exits while starting or
serving is marked dead."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from h3ms_async.runtime.worker_handle import WorkerHandle, WorkerState, exit_text


def watch_exit(w: WorkerHandle) -> None:
    """Have the loop report ``w``'s exit (:func:`_on_exit`) the moment its process exits."""
    assert w.proc is not None  # called right after the spawn started it
    try:
        w.pidfd = os.pidfd_open(w.proc.pid)
    except OSError as exc:
        w.proc.kill()
        raise RuntimeError(
            f"pidfd_open failed ({exc}): H3 MultiStream watches its workers through pidfds, "
            "which need Linux 5.3 or newer (and, in a container, a seccomp profile that "
            "allows pidfd_open)"
        ) from None
    asyncio.get_running_loop().add_reader(w.pidfd, _on_exit, w)


def unwatch_exit(w: WorkerHandle) -> None:
    """Stop watching ``w``'s pidfd and close it (no-op once it exited or was never watched)."""
    if w.pidfd >= 0:
        asyncio.get_running_loop().remove_reader(w.pidfd)
        os.close(w.pidfd)
        w.pidfd = -1


def _on_exit(w: WorkerHandle) -> None:
    # A pidfd turns readable only once its process has exited, so poll() reaps it here.
    assert w.proc is not None  # only a spawned worker's pidfd is watched
    code = w.proc.poll()
    if code is None:
        return
    unwatch_exit(w)
    w.exited.set()
    if w.state in (WorkerState.STARTING, WorkerState.READY):
        during = " during start" if w.state == WorkerState.STARTING else ""
        w.mark_dead(exit_text(code) + during)


async def wait_exits(workers: Sequence[WorkerHandle], timeout: float) -> None:
    """Wait up to ``timeout`` s for every watched worker's exit (reported by its pidfd)."""
    waits = [asyncio.ensure_future(w.exited.wait()) for w in workers if w.pidfd >= 0]
    if not waits:
        return
    try:
        await asyncio.wait(waits, timeout=timeout)
    finally:
        for t in waits:
            t.cancel()
