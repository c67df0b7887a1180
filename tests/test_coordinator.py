"""The coordinator loop thread and its thread-safe API; clean shutdown at interpreter exit."""
import asyncio
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from h3ms_async.runtime.coordinator import Coordinator, get_coordinator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.fast
def test_singleton_on_a_daemon_thread_with_uvloop():
    coord = get_coordinator()
    assert get_coordinator() is coord
    assert coord.thread.daemon and coord.thread.is_alive()
    assert coord.backend == "uvloop"
    assert type(coord.loop).__module__.startswith("uvloop")
    seen = {}

    async def where():
        seen["thread"] = threading.current_thread()
        return asyncio.get_running_loop()

    assert coord.run(where(), 5) is coord.loop and seen["thread"] is coord.thread


@pytest.mark.fast
def test_submit_returns_a_concurrent_future():
    async def add(a, b):
        await asyncio.sleep(0.01)
        return a + b

    fut = get_coordinator().submit(add(2, 3))
    assert isinstance(fut, cf.Future) and fut.result(5) == 5


@pytest.mark.fast
def test_errors_propagate_unchanged():
    class Boom(ValueError):
        pass

    async def fail():
        raise Boom("bad input x=3")

    with pytest.raises(Boom, match="bad input x=3"):
        get_coordinator().run(fail(), 5)

    async def own_timeout():  # a TimeoutError raised by the coroutine is not our deadline
        raise TimeoutError("worker 2 did not answer")

    with pytest.raises(TimeoutError, match="worker 2 did not answer"):
        get_coordinator().run(own_timeout(), 5)


@pytest.mark.fast
def test_timeout_cancels_and_names_the_coroutine():
    state = {}

    async def slow_step():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"slow_step did not finish within 0.2 s"):
        get_coordinator().run(slow_step(), 0.2)
    assert time.monotonic() - t0 < 3 and state == {"cancelled": True}
    with pytest.raises(TimeoutError, match="the VAE decode"):
        get_coordinator().run(slow_step(), 0.05, what="the VAE decode")


@pytest.mark.fast
def test_cancel():
    started = threading.Event()

    async def forever():
        started.set()
        await asyncio.sleep(30)

    coord = get_coordinator()
    fut = coord.submit(forever())
    assert started.wait(5)
    assert coord.cancel(fut) and fut.cancelled()


@pytest.mark.fast
def test_a_cancelled_coroutine_that_fails_afterwards_prints_nothing(caplog):
    """Cancelling an aborted step's dispatch makes its rank requests fail rather than end cancelled (the ranks were
    aborted): nobody reads that error, and asyncio must not print it as "Task exception was never retrieved" (it
    did, as a traceback under the demo's one Ctrl-C line)."""
    import gc
    coord = get_coordinator()
    started = threading.Event()

    async def fails_when_cancelled() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("rank aborted") from None

    fut = coord.submit(fails_when_cancelled())
    assert started.wait(5) and coord.cancel(fut)
    del fut  # the task lives as long as its future's callbacks do
    gc.collect()
    coord.run(asyncio.sleep(0.05), 5)
    assert "never retrieved" not in caplog.text and "rank aborted" not in caplog.text

    async def fails() -> None:
        raise RuntimeError("rank failed")

    with pytest.raises(RuntimeError, match="rank failed"):  # a failure nobody cancelled still reaches its caller
        coord.submit(fails()).result(5)


@pytest.mark.fast
def test_run_on_the_loop_thread_is_refused():
    coord = get_coordinator()

    async def nested():
        async def inner():
            return 1
        return coord.run(inner(), 1)

    with pytest.raises(RuntimeError, match="on the coordinator thread"):
        coord.run(nested(), 5)


@pytest.mark.fast
def test_shutdown_stops_the_thread():
    coord = Coordinator()
    assert coord.run(asyncio.sleep(0, result=7), 5) == 7
    coord.shutdown()
    assert not coord.thread.is_alive() and coord.closed and coord.loop.is_closed()
    with pytest.raises(RuntimeError, match="shut down"):
        coord.submit(asyncio.sleep(0))


EXITER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
pool = WorkerPool(["cpu", "cpu"], name="atexit")
get_coordinator().run(pool.start(), 120)
print(json.dumps({"pids": [w["pid"] for w in pool.snapshot()], "run_dir": pool.run_dir}), flush=True)
# no release: the coordinator's atexit handler must do it
"""


def test_interpreter_exit_releases_pools():
    proc = subprocess.run([sys.executable, "-c", EXITER, ROOT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    assert not os.path.exists(info["run_dir"])
    for pid in info["pids"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
