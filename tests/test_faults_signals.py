"""Fault family: interrupts.  A storm of SIGINT (one every 50 ms) during a split step, and SIGTERM, sent to the real
``python -m h3ms_async demo`` process: one line on stderr, no traceback, exit 130 / 143, and nothing left (worker and
reaper processes, run dirs, shared memory); an engine whose step was interrupted runs the next step bit-exact.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.faults_common import MODEL_PRELUDE, ROOT, run_dirs

DEMO = [sys.executable, "-m", "h3ms_async", "demo", "--ranks", "cpu,cpu", "--tokens", "3000", "--layers", "1",
        "--hidden", "256", "--heads", "4", "--steps", "200"]


def _alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _run_demo_and_signal(tmp_path, sig: int, every_s: float | None) -> tuple[int, str, set[int]]:
    """Start the demo, wait until its ranks run steps, send ``sig`` (every ``every_s`` until it exits, or once).
    Returns (exit code, stderr, every descendant pid seen)."""
    proc = subprocess.Popen(DEMO, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "H3MS_RUN_DIR": str(tmp_path)},
                            start_new_session=True)
    seen: set[int] = set()
    try:
        me = psutil.Process(proc.pid)
        deadline = time.monotonic() + 180
        while True:  # two busy rank workers: the split steps are running
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the demo's ranks did not start within 180 s"
            kids = me.children(recursive=True)
            seen |= {k.pid for k in kids}
            workers = [k for k in kids if "workers" in " ".join(k.cmdline())]
            if len(workers) == 2 and sum(k.cpu_percent(0.2) for k in workers) > 20:
                break
        seen |= {k.pid for k in me.children(recursive=True)}
        stop = time.monotonic() + 3.0
        proc.send_signal(sig)
        while every_s is not None and proc.poll() is None and time.monotonic() < stop:
            time.sleep(every_s)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("sig,every_s,code,line", [
    (signal.SIGINT, 0.05, 130, "demo: interrupted (Ctrl-C); workers and shared memory released"),
    (signal.SIGTERM, None, 143, "demo: terminated (SIGTERM); workers and shared memory released"),
])
def test_demo_ends_cleanly_on_signals(tmp_path, sig, every_s, code, line):
    rc, err, seen = _run_demo_and_signal(tmp_path, sig, every_s)
    assert rc == code, err[-3000:]
    assert err.count(line) == 1 and "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 5
    while _alive(seen) or run_dirs(tmp_path):
        assert time.monotonic() < deadline, f"left behind: pids {_alive(seen)}, run dirs {run_dirs(tmp_path)}"
        time.sleep(0.05)


INTERRUPTED_STEP = """
import signal
import socket
from workers.runtime.shm import held_shm
presses = []

def on_sigint(signum, frame):
    presses.append(time.monotonic())
    if len(presses) == 1:  # the first press interrupts the step; the rest of the storm must do no harm
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_sigint)
engine = make_engine()
report(phase="ready")
try:
    while True:
        step(engine, 3000)
except KeyboardInterrupt:
    pass
ok = step(engine, 3000, seed=5)
engine.release()
signal.signal(signal.SIGINT, signal.SIG_IGN)  # interpreter shutdown would put back SIGINT's default: killed by it
report(phase="done", ok=ok, presses=len(presses), held=sorted(held_shm(os.getpid())), kids=len(__import__("psutil").Process().children()))
"""


def test_an_interrupted_step_leaves_the_engine_usable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", MODEL_PRELUDE + INTERRUPTED_STEP], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, env={**os.environ, "H3MS_RUN_DIR": str(tmp_path)},
                            start_new_session=True)
    try:
        assert "ready" in proc.stdout.readline(), proc.stderr.read()[-3000:]
        time.sleep(0.5)  # into a step
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1][7:])
    assert res["presses"] > 1 and res["ok"] is True and res["held"] == [] and res["kids"] == 0, res
    assert run_dirs(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_quietly_on_signals(sig):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "h3ms_async", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "serve did not listen within 60 s"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
