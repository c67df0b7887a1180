"""Faults against live worker pools: killed and hung workers, a killed parent, bad peers and bad frames."""
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import msgpack
import psutil
import pytest

from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.worker_handle import WorkerError, WorkerTimeout
from workers.runtime import auth, protocol
from workers.testing import protocol as test_protocol
from workers.runtime.shm import held_shm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(coro, timeout=60):
    return get_coordinator().run(coro, timeout)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def pool3():
    pool = WorkerPool(["cpu"] * 3, name="faults")
    run(pool.start(), 120)
    yield pool
    run(pool.release(force=True), 60)
    assert held_shm(os.getpid()) == set()


def test_sigkill_mid_job_fails_fast_then_restarts(pool3):
    run(pool3.start(), 120)
    old_pids = [w["pid"] for w in pool3.snapshot()]
    starts = pool3.starts
    fut = get_coordinator().submit(pool3.all([test_protocol.Sleep(seconds=60)] * 3, timeout=120))
    deadline = time.monotonic() + 5
    while not all(w["state"] == "busy" for w in pool3.snapshot()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    os.kill(old_pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError) as ei:
        fut.result(5)
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert ei.value.rank == 1 and "worker rank 1 on cpu" in msg and "killed by SIGKILL" in msg
    assert "last lines of" in msg and "rank1 INFO rank 1/3 ready on cpu" in msg  # the worker's own log lines
    assert not pool3.busy
    # the next job restarts the whole pool and succeeds
    answers = run(pool3.all([protocol.Ping()] * 3, timeout=10), 120)
    new_pids = [a.pid for a in answers]
    assert pool3.starts == starts + 1 and not set(new_pids) & set(old_pids)
    assert all(gone(p) for p in old_pids)


def test_crash_hook_exit_code_is_reported(pool3):
    with pytest.raises(WorkerError, match=r"worker rank 2 on cpu .*exited with code 7") as ei:
        run(pool3.request(2, test_protocol.Crash(how="exit", code=7), timeout=10))
    assert "test hook: crashing (exit)" in str(ei.value)
    assert run(pool3.request(2, protocol.Ping(), timeout=10), 120).pong


def test_an_unusable_worker_answers_then_ends_and_the_next_job_gets_a_fresh_one(pool3):
    """A handler that fails with WorkerUnusable (a GPU queue stuck on a dead peer's CUDA IPC event,
    workers/dit/cuda.py's drain) is answered with its error, then the worker closes its channel and exits: the
    pool marks it dead, no process stays behind, and the next request starts a fresh worker."""
    run(pool3.start(), 120)
    old = pool3.worker_pids()[1]
    with pytest.raises(WorkerError, match=r"WorkerUnusable: test hook: this worker's GPU queue waits on a dead peer"):
        run(pool3.request(1, test_protocol.Crash(how="unusable"), timeout=10))
    end = time.monotonic() + 10
    while not (gone(old) and pool3.snapshot()[1]["state"] == "dead") and time.monotonic() < end:
        time.sleep(0.05)
    assert gone(old) and pool3.snapshot()[1]["state"] == "dead"
    assert run(pool3.request(1, protocol.Ping(), timeout=10), 120).pong
    assert pool3.worker_pids()[1] != old


def test_hung_worker_hits_the_deadline(pool3):
    run(pool3.start(), 120)
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"rank 0 on cpu .*did not answer 'hang' within 1 s") as ei:
        run(pool3.request(0, test_protocol.Hang(seconds=60), timeout=1.0), 10)
    assert isinstance(ei.value, TimeoutError) and time.monotonic() - t0 < 4
    assert pool3.snapshot()[0]["state"] == "dead"
    assert run(pool3.request(0, protocol.Ping(), timeout=10), 120).pong


def test_missing_heartbeats_mark_a_worker_dead(monkeypatch):
    monkeypatch.setenv("H3MS_HEARTBEAT_TIMEOUT", "1.5")
    pool = WorkerPool(["cpu"], name="hb")
    run(pool.start(), 120)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="no heartbeat for"):
            run(pool.request(0, test_protocol.Hang(seconds=60), timeout=60), 20)
        assert time.monotonic() - t0 < 5
    finally:
        run(pool.release(), 30)


PARENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
pool = WorkerPool(["cpu", "cpu"], name="orphans")
get_coordinator().run(pool.start(), 120)
print(json.dumps({"pids": [w["pid"] for w in pool.snapshot()], "run_dir": pool.run_dir}), flush=True)
time.sleep(120)
"""


def test_parent_sigkill_takes_workers_down():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, ROOT], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in info["pids"]):
        assert time.monotonic() < deadline, "workers outlived their parent by 5 s"
        time.sleep(0.05)
    # the run dir goes with its owner (its reaper sees the owner's pipe close); shm: tests/test_faults_shm.py
    while os.path.exists(info["run_dir"]):
        assert time.monotonic() < deadline, "the run dir outlived its owner by 5 s"
        time.sleep(0.05)


def _raw_peer(pool):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(pool.socket_path)
    (n,) = struct.unpack(">I", _recv_exact(s, 4))
    challenge = protocol.decode(_recv_exact(s, n))
    assert isinstance(challenge, protocol.Challenge)
    return s, challenge.nonce


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "peer closed early"
        buf += chunk
    return buf


def _read_to_eof(s) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_wrong_key_is_refused_and_logged(pool3, caplog):
    run(pool3.start(), 120)
    caplog.set_level(logging.ERROR, logger="h3_multistream")
    s, nonce = _raw_peer(pool3)
    with s:
        s.sendall(protocol.encode(protocol.Auth(rank=0, pid=os.getpid(), mac=auth.response(auth.new_key(), nonce, 0))))
        reply = _read_to_eof(s)
    answer = protocol.decode(reply[4:])
    assert isinstance(answer, protocol.Refused) and "wrong key" in answer.error
    assert any("refused a connection" in r.getMessage() and "wrong key" in r.getMessage() for r in caplog.records)
    assert [a.pong for a in run(pool3.all([protocol.Ping()] * 3, timeout=10))] == [True] * 3


def _frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return protocol.HEADER.pack(len(body)) + body


#: case -> (raw bytes, what the coordinator's log / error must say)
BAD_FRAMES = {
    "oversized": (struct.pack(">I", protocol.MAX_FRAME_BYTES + 1), "exceeds"),  # MAX_FRAME_BYTES, or the pre-auth limit
    "truncated": (struct.pack(">I", 100) + b"x" * 10, "truncated frame"),
    "not msgpack": (struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", "not one valid msgpack map"),
    "unknown kind": (_frame({"k": "bogus", "id": 1}), "unknown message kind"),
    "wrong types": (_frame({"k": "hb", "id": 0, "rss": "lots", "vram": None, "busy": True}), "Expected `int`, got `str` - at `$.rss`"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_bad_frames_before_auth_close_that_connection_only(pool3, caplog, case):
    run(pool3.start(), 120)
    caplog.set_level(logging.ERROR, logger="h3_multistream")
    raw, needle = BAD_FRAMES[case]
    s, _ = _raw_peer(pool3)
    with s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        _read_to_eof(s)  # the coordinator closes it
    assert any("refused a connection" in r.getMessage() and needle in r.getMessage() for r in caplog.records)
    assert [a.pong for a in run(pool3.all([protocol.Ping()] * 3, timeout=10))] == [True] * 3


def test_bad_frames_on_authenticated_channels(caplog):
    """Ranks 1..5 each send one kind of bad frame on their channel while rank 0 runs a job: each bad channel
    is closed with a logged protocol error and its worker is marked dead, while rank 0's job finishes."""
    caplog.set_level(logging.ERROR, logger="h3_multistream")
    pool = WorkerPool(["cpu"] * 6, name="inject")
    run(pool.start(), 120)
    try:
        coord = get_coordinator()
        job = coord.submit(pool.request(0, test_protocol.Sleep(seconds=1.0), timeout=30))
        cases = list(BAD_FRAMES)
        futs = [coord.submit(pool.request(r, test_protocol.Inject(raw=BAD_FRAMES[c][0],
                                                                  close=c == "truncated"),
                                          timeout=30)) for r, c in enumerate(cases, start=1)]
        for r, (case, fut) in enumerate(zip(cases, futs), start=1):
            with pytest.raises(WorkerError, match=f"worker rank {r} on cpu") as ei:
                fut.result(10)
            assert "protocol error" in str(ei.value) and BAD_FRAMES[case][1] in str(ei.value), case
        assert job.result(10) == test_protocol.Slept(slept=1.0)  # the coordinator kept serving rank 0
        logged = " ".join(r.getMessage() for r in caplog.records)
        for r, case in enumerate(cases, start=1):
            assert f"rank {r} (cpu): protocol error" in logged and BAD_FRAMES[case][1] in logged
        assert [w["state"] for w in pool.snapshot()] == ["ready"] + ["dead"] * 5
    finally:
        run(pool.release(force=True), 60)
