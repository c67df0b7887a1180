"""The coordinator: a private asyncio loop (uvloop when importable) on a daemon thread.

Synchronous callers (ComfyUI's prompt thread, CLI code) use one thread-safe API::

    coord = get_coordinator()
    fut = coord.submit(coro)            # concurrent.futures.Future
    result = coord.run(coro, timeout=60)  # waits; on timeout cancels the coroutine and raises
    TimeoutError coord.cancel(fut)

At interpreter exit the coordinator releases the pools registered with it, stops its loop and
joins its thread: the runtime's one exit hook, registered by the coordinator itself.  Each pool
releases what it owns (workers, sockets, run dir, segments), so the order of imports plays no part.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from h3ms_async.log import get_logger

log = get_logger("coordinator")
T = TypeVar("T")


class _Releasable(Protocol):
    async def release(self, grace: float = 5.0, force: bool = False) -> None: ...


async def _unless_abandoned(coro: Coroutine[Any, Any, T], handle: list[cf.Future[T]]) -> T:
    """``coro``'s result; an exception raised after its caller cancelled the future (an aborted
    step's ranks fail as they are aborted) ends the task as cancelled, since nobody will read it and
    asyncio would otherwise print it as "Task exception was never retrieved"."""
    try:
        return await coro
    except Exception as exc:
        if handle and handle[0].cancelled():
            log.debug("an abandoned coroutine failed: %s", exc)
            raise asyncio.CancelledError from exc
        raise


class Coordinator:
    """Owns the loop thread.  Create it through :func:`get_coordinator`."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            self.backend = "uvloop"
        except ImportError:
            self.loop = asyncio.new_event_loop()
            self.backend = "asyncio"
        self._pools: list[_Releasable] = []
        self._lock = threading.Lock()
        self._closed = False
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._run_loop, args=(ready,), name="h3ms-coordinator", daemon=True
        )
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("the coordinator loop thread did not start within 10 s")
        atexit.register(self.shutdown)
        log.info("coordinator loop started (%s)", self.backend)

    def _run_loop(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Schedule ``coro`` on the loop; thread-safe."""
        if self._closed:
            coro.close()
            raise RuntimeError("the coordinator is shut down (interpreter exiting)")
        handle: list[cf.Future[T]] = []
        fut = asyncio.run_coroutine_threadsafe(_unless_abandoned(coro, handle), self.loop)
        handle.append(fut)
        return fut

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str | None = None) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout`` seconds for its result.

        On timeout the coroutine is cancelled and ``TimeoutError`` names it (``what`` or the
        coroutine's name). Exceptions of the coroutine (e.g. a worker's error with its traceback
        text) are re-raised as they are. An interrupt of the waiting thread (KeyboardInterrupt)
        cancels the coroutine too.
        """
        label = what or getattr(coro, "__qualname__", None) or repr(coro)
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                f"Coordinator.run({label}) called on the coordinator thread; await it instead"
            )
        fut = self.submit(coro)
        try:
            # Wait first, then read the result: a TimeoutError raised *by* the coroutine must not be
            # mistaken for our deadline (concurrent.futures.TimeoutError is the same class).
            done, _ = cf.wait([fut], timeout)
        except BaseException:  # interrupted while waiting
            self.cancel(fut)
            raise
        if not done:
            self.cancel(fut)
            raise TimeoutError(f"{label} did not finish within {timeout:g} s (cancelled)")
        return fut.result()

    def cancel(self, fut: cf.Future[Any], wait: float = 2.0) -> bool:
        """Cancel a submitted coroutine and wait up to ``wait`` s for it to unwind; True if it was
        cancelled."""
        cancelled = fut.cancel()
        if not self.in_loop_thread():
            cf.wait([fut], timeout=wait)
        return cancelled

    def register_pool(self, pool: _Releasable) -> None:
        """Release ``pool`` at interpreter exit (unless unregistered first)."""
        with self._lock:
            if pool not in self._pools:
                self._pools.append(pool)

    def unregister_pool(self, pool: _Releasable) -> None:
        with self._lock:
            if pool in self._pools:
                self._pools.remove(pool)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Release registered pools, stop the loop, join the thread (idempotent)."""
        if self._closed:
            return
        atexit.unregister(self.shutdown)
        with self._lock:
            pools = list(self._pools)
            self._pools.clear()
        for pool in pools:
            try:
                self.run(pool.release(grace=2.0, force=True), timeout, what=f"releasing {pool!r}")
            except BaseException as exc:  # noqa: BLE001 - exiting: log and go on with the others
                log.error("releasing %r at exit failed: %s", pool, exc)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("coordinator thread did not stop within %g s", timeout)


_instance: Coordinator | None = None
_instance_lock = threading.Lock()


def get_coordinator() -> Coordinator:
    """The process-wide coordinator, started on first use."""
    global _instance  # noqa: PLW0603 - one coordinator loop per process, built on first use
    with _instance_lock:
        if _instance is None or _instance.closed:
            _instance = Coordinator()
        return _instance
