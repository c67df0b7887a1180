"""WorkerPool with real worker processes on the CPU: start, ping, 64 MiB through shm, errors, release, no leaks."""
import hashlib
import os
import threading
import time

import msgspec
import psutil
import pytest
import torch

from h3ms_async.runtime import rundir
from h3ms_async.tools.bench.ipc import run_bench_ipc
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import PoolBusy, WorkerPool
from h3ms_async.runtime.visibility import cuda_visible_for
from h3ms_async.runtime.worker_handle import WorkerError, WorkerTimeout
from workers.runtime.protocol import DropReleased, Echo, Ping, TensorDesc
from workers.testing.protocol import Sleep
from workers.runtime.shm import Segment, held_shm

MiB = 1 << 20


def run(coro, timeout=60):
    return get_coordinator().run(coro, timeout)


def worker_children():
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "workers" in " ".join(p.cmdline())]


def assert_released(pool, run_dir, pids):
    assert pool.run_dir is None and not os.path.exists(run_dir)
    deadline = time.monotonic() + 5
    while worker_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_children() == []
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert held_shm(os.getpid()) == set()
    assert all(w["state"] == "stopped" for w in pool.snapshot())


@pytest.mark.parametrize("n", [1, 3, 8])
def test_pool_start_ping_echo_release(n):
    pool = WorkerPool(["cpu"] * n, name=f"t{n}")
    run(pool.start(), 120)
    try:
        snap = pool.snapshot()
        assert [w["rank"] for w in snap] == list(range(n))
        assert all(w["state"] == "ready" and w["device"] == "cpu" and w["vram_bytes"] is None for w in snap)
        pids = [w["pid"] for w in snap]
        # where each worker's start went: every phase measured, a CPU rank pins no device, and the phases
        # add up to no more than the pool's own start
        starts = pool.start_times()
        assert all(s is not None and s.device_s == 0.0 and s.program_s > 0 and s.python_s > 0 for s in starts)
        assert all(s.connect_s >= 0 and s.welcome_s > 0 and s.total_s <= pool.start_s for s in starts), starts
        run_dir = pool.run_dir
        assert os.stat(run_dir).st_mode & 0o777 == 0o700
        assert os.path.basename(run_dir).startswith(f"h3ms-{os.getpid()}-")
        answers = run(pool.all([Ping()] * n, timeout=10))
        assert [a.pid for a in answers] == pids and all(a.pong for a in answers)

        # 64 MiB of bfloat16 in, one 64 MiB copy back per rank, bit-exact
        src_seg = Segment.create(64 * MiB, "src")
        dst_seg = pool.create_segment(n * 64 * MiB, "dst")
        try:
            src_d = TensorDesc(seg=src_seg.name, off=0, dtype="bfloat16", shape=[4096, 8192])
            src = src_seg.tensor(src_d)
            src.view(torch.int16).copy_(torch.randint(-32768, 32767, (4096, 8192), dtype=torch.int16))
            dst_ds = [msgspec.structs.replace(src_d, seg=dst_seg.name, off=r * 64 * MiB) for r in range(n)]
            res = run(pool.all([Echo(src=src_d, dst=d) for d in dst_ds], timeout=60), 90)
            want = hashlib.sha256(src.view(torch.uint8).numpy()).hexdigest()
            for r, (a, d) in enumerate(zip(res, dst_ds)):
                # a CPU rank has nothing to pin
                assert (a.bytes, a.sha256, a.registered) == (64 * MiB, want, False)
                assert a.seconds > 0
                assert torch.equal(dst_seg.tensor(d).view(torch.int16), src.view(torch.int16)), f"rank {r}"
            assert [w["jobs_done"] for w in pool.snapshot()] == [2] * n
            del src
        finally:
            src_seg.close()
            src_seg.unlink()
            dst_seg.close()
    finally:
        run(pool.release(), 60)
    assert_released(pool, run_dir, pids)


@pytest.fixture(scope="module")
def pool2():
    pool = WorkerPool(["cpu", "cpu"], name="pool2")
    run(pool.start(), 120)
    yield pool
    run(pool.release(), 60)
    assert held_shm(os.getpid()) == set()


def test_worker_error_carries_traceback_and_log(pool2):
    seg = pool2.create_segment(8192, "bad")
    small = TensorDesc(seg=seg.name, off=0, dtype="uint8", shape=[16])
    with pytest.raises(WorkerError) as ei:
        run(pool2.request(1, Echo(src=small, dst=msgspec.structs.replace(small, shape=[8])), timeout=10))
    msg = str(ei.value)
    assert ei.value.rank == 1 and ei.value.device == "cpu"
    assert "worker rank 1 on cpu" in msg and "src has 16 bytes but dst has 8" in msg
    assert "Traceback (most recent call last)" in msg and "rank1.log" in msg
    # a handler error does not kill the worker
    assert run(pool2.request(1, Ping(), timeout=5)).pong
    assert pool2.snapshot()[1]["state"] == "ready"


def test_drop_released_unmaps_the_segments_the_owner_let_go(pool2):
    seg = Segment.create(8192, "drop")
    d = TensorDesc(seg=seg.name, off=0, dtype="uint8", shape=[4096])
    run(pool2.request(0, Echo(src=d, dst=msgspec.structs.replace(d, off=4096)), timeout=10))
    seg.close()
    seg.unlink()
    answers = run(pool2.all([DropReleased()] * 2, timeout=10))
    assert [a.dropped for a in answers] == [1, 0]


def test_busy_release_refused_and_abort_stops_ranks(pool2):
    fut = get_coordinator().submit(pool2.all([Sleep(seconds=30)] * 2, timeout=60))
    deadline = time.monotonic() + 5
    while not (pool2.busy and all(w["state"] == "busy" for w in pool2.snapshot())):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(PoolBusy, match="force=True"):
        run(pool2.release(), 10)
    gen = pool2.abort_generation
    t0 = time.monotonic()
    threading.Thread(target=pool2.abort).start()  # abort is thread-safe
    with pytest.raises(WorkerError, match="sleep aborted by the pool"):
        fut.result(5)
    assert time.monotonic() - t0 < 5
    assert pool2.abort_generation == gen + 2  # ours, then all()'s own fail-fast abort
    assert not pool2.busy
    assert run(pool2.all([Ping(), Ping()], timeout=5))[0].pong


def test_log_path_and_snapshot(pool2):
    path = pool2.log_path(0)
    assert path.startswith(pool2.run_dir)
    deadline = time.monotonic() + 5
    while "ready on cpu" not in open(path).read():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text = open(path).read()
    assert "coordinator: starting rank 0 on cpu" in text
    snap = pool2.snapshot()[0]
    assert set(snap) == {"rank", "device", "pid", "state", "uptime_s", "rss_bytes", "vram_bytes", "log", "jobs_done"}
    assert snap["log"] == path and snap["uptime_s"] > 0 and snap["rss_bytes"] > 10 * MiB
    assert pool2.world_size == 2 and pool2.devices == ["cpu", "cpu"]
    with pytest.raises(IndexError):
        pool2.log_path(2)


def test_pool_must_run_on_coordinator_loop():
    import asyncio

    with pytest.raises(RuntimeError, match="coordinator loop"):
        asyncio.run(WorkerPool(["cpu"]).start())


def test_bad_device_lists():
    for bad in ([], "cpu", ["gpu0"], ["cuda:x"], [0]):
        with pytest.raises(ValueError):
            WorkerPool(bad)
    with pytest.raises(ValueError, match="pool name"):
        WorkerPool(["cpu"], name="a b")


def test_cuda_visible_devices_translation():
    assert cuda_visible_for("cuda:1", None) == "1"
    assert cuda_visible_for("cuda", None) == "0"
    assert cuda_visible_for("cuda:1", "2,3") == "3"
    assert cuda_visible_for("cuda:0", "GPU-aaaa, GPU-bbbb") == "GPU-aaaa"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='2,3'"):
        cuda_visible_for("cuda:2", "2,3")


def test_start_timeout_from_env_and_deadline(monkeypatch):
    monkeypatch.setenv("H3MS_WORKER_START_TIMEOUT", "7")
    assert WorkerPool(["cpu"]).start_timeout == 7.0
    monkeypatch.setenv("H3MS_WORKER_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="H3MS_WORKER_START_TIMEOUT"):
        WorkerPool(["cpu"])
    monkeypatch.delenv("H3MS_WORKER_START_TIMEOUT")
    segs_before = held_shm(os.getpid())
    pool = WorkerPool(["cpu"], start_timeout=0.05)
    with pytest.raises(WorkerTimeout, match="did not start within 0.05 s") as ei:
        run(pool.start())
    assert ei.value.rank == 0
    assert pool.snapshot()[0]["pid"] not in [p.pid for p in worker_children()]
    assert pool.run_dir is None and held_shm(os.getpid()) == segs_before


def test_socket_path_limit_names_the_fix(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("H3MS_RUN_DIR", str(deep))
    segs_before = held_shm(os.getpid())
    pool = WorkerPool(["cpu"])
    with pytest.raises(rundir.RunDirError, match="H3MS_RUN_DIR"):
        run(pool.start())
    assert os.listdir(deep) == [] and held_shm(os.getpid()) == segs_before


def test_rundir_sweep_removes_unlocked_dirs_only(tmp_path, monkeypatch):
    import fcntl

    abandoned = tmp_path / "h3ms-1-abc"  # its owner's lock is free: the owner is gone, whatever its pid
    abandoned.mkdir()
    (abandoned / rundir.LOCK_NAME).write_text("")
    (abandoned / "rank0.log").write_text("x")
    held = tmp_path / f"h3ms-{os.getpid() + 1}-live"  # a live owner, maybe in another PID namespace
    held.mkdir()
    fd = os.open(held / rundir.LOCK_NAME, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (tmp_path / "h3ms-2-nolock").mkdir()  # no lock file: not ours to judge
    (tmp_path / "unrelated").mkdir()
    monkeypatch.setenv("H3MS_RUN_DIR", str(tmp_path))
    try:
        made = rundir.create()
        try:
            assert sorted(os.listdir(tmp_path)) == sorted([held.name, "h3ms-2-nolock", "unrelated",
                                                           os.path.basename(made)])
            assert rundir.sweep_dead(str(tmp_path)) == []  # our own dir is locked by us
        finally:
            rundir.remove(made)
        assert not os.path.exists(made)
    finally:
        os.close(fd)


def test_bench_ipc_smoke():
    out = run_bench_ipc(samples=200, messages=500, copy_mib=64, pool_sizes=(1,), program="dit")
    assert out["control_rtt_us"]["samples"] == 200
    assert 0 < out["control_rtt_us"]["p50"] <= out["control_rtt_us"]["p99"]
    assert out["messages_per_s"] > 0 and out["shm_copy_gb_s"] > 0
    start = out["pool_start"]
    assert start["device"] == "cpu" and start["program"] == "dit" and set(start["by_size"]) == {"1"}
    for size in start["by_size"].values():
        phases = [size[k] for k in ("python_s", "program_s", "connect_s", "welcome_s")]
        assert all(p >= 0 for p in phases) and size["program_s"] > 0, size
        # the slowest rank's phases lie within the pool's start
        assert sum(phases) + size["device_s"] <= size["wall_s"], size
