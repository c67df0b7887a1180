"""Fault family: two PID namespaces sharing /dev/shm and the run-dir base (two containers with ``--ipc=host``).

A pool starting in the other namespace sweeps the shared run-dir base while our pool is live: our pid means nothing
there, so a pid-based rule would delete our run dir (and, before segments were unnamed, our segments).  Ownership
is a lock now, and segments have no names, so our pool keeps working, including a rank restart that maps our
control segment again; the other namespace's pool works too (attaching through its own /proc).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from tests.faults_common import ROOT, run_dirs
from workers.runtime.protocol import Echo, Echoed
from workers.runtime.shm import held_shm, Arena


def _pidns_refusal() -> str | None:
    try:
        proc = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not usable here: {exc}"
    return None if proc.returncode == 0 else f"cannot make a PID namespace here: {proc.stderr.strip()}"


pytestmark = pytest.mark.skipif(_pidns_refusal() is not None, reason=_pidns_refusal() or "")

OTHER_NAMESPACE = """
import json, os, sys
sys.path.insert(0, {root!r})
from h3ms_async.runtime import rundir
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from workers.runtime.protocol import Ping
import msgspec
removed = rundir.sweep_dead()
pool = WorkerPool(["cpu"], name="otherns")
coord = get_coordinator()
coord.run(pool.start(), 120)
pong = coord.run(pool.request(0, Ping(), timeout=60), 90)
coord.run(pool.release(), 60)
pong_fields = sorted(msgspec.structs.asdict(pong))
result = {{"pid": os.getpid(), "removed": removed, "pong": pong_fields}}
print("RESULT " + json.dumps(result), flush=True)
"""


def _echo(pool: WorkerPool, arena: Arena, payload: bytes) -> Echoed:
    src = arena.alloc("uint8", [len(payload)])
    dst = arena.alloc("uint8", [len(payload)])
    with arena.segment.buffer(src.off, len(payload)) as mv:
        mv[:] = payload
    return get_coordinator().run(pool.request(0, Echo(src=src, dst=dst), timeout=60), 90)


def test_a_sweep_in_another_pid_namespace_leaves_our_pool_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("H3MS_RUN_DIR", str(tmp_path))
    coord = get_coordinator()
    pool = WorkerPool(["cpu"], name="ourns")
    coord.run(pool.start(), 120)
    try:
        ours = pool.run_dir
        arena = Arena(pool.create_segment(1 << 20, "ours"))
        proc = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c",
                               OTHER_NAMESPACE.format(root=str(ROOT))], capture_output=True, text=True, timeout=240,
                              env={**os.environ, "H3MS_RUN_DIR": str(tmp_path)}, stdin=subprocess.DEVNULL)
        lines = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        other = json.loads(lines[-1])
        assert other["pid"] < 10 and other["pid"] != os.getpid()  # really another PID namespace
        assert other["removed"] == [] and "pid" in other["pong"]
        assert os.path.isdir(ours) and os.path.exists(pool.socket_path)
        assert _echo(pool, arena, b"still ours").bytes == 10
        # a rank that starts now maps our segments again: kill it, the next request restarts the pool
        os.kill(pool.snapshot()[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pool.snapshot()[0]["state"] != "dead":
            assert time.monotonic() < deadline, "the killed rank was not noticed"
            time.sleep(0.05)
        assert _echo(pool, arena, b"after a restart").bytes == 15
        assert pool.starts == 2
    finally:
        coord.run(pool.release(force=True), 60)
    assert run_dirs(tmp_path) == [] and held_shm(os.getpid()) == set()
