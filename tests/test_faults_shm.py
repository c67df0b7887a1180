"""Fault family: shared-memory pressure and lifetime, measured on a private tmpfs mounted on /dev/shm.

* a /dev/shm too small for a step's buffers fails that step before its plan is probed, with an error naming
  /dev/shm, its size and ``--shm-size`` (no SIGBUS, no dead rank), and the next step that fits succeeds bit-exact; a
  new shape's buffers need room only for themselves (the old ones are unmapped everywhere first);
* a SIGKILLed owner with a filled weight store, and a script that built an engine directly and just exits, leave
  nothing within 5 s: /dev/shm back to 0 bytes used, no worker or reaper process, no run dir.
"""
import os

import pytest

from tests.faults_common import (BASE_PRELUDE, MODEL_PRELUDE, private_shm_refusal, run_dirs,
                                 run_with_private_shm)

pytestmark = [pytest.mark.skipif(private_shm_refusal() is not None, reason=private_shm_refusal() or ""),
              pytest.mark.timeout(600)]  # seconds on a quiet machine; generous for a shared, loaded one

PRESSURE = """
engine = make_engine()
loaded = shm_used()
rounds = engine.probe.rounds
try:
    step(engine, 9000)
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
probed_first = engine.probe.rounds - rounds
after_error = [w["state"] for w in engine.pool.snapshot()]
ok = step(engine, 3000) and step(engine, 3000, seed=2)
# Shrink /dev/shm to what is used now plus 60 % of one step's buffers: a new shape's buffers fit only if the old
# ones are given back (by the coordinator and by every rank) before the new ones are reserved.
used = shm_used()
import subprocess
size_kib = (used + (used - loaded) * 6 // 10) // 1024
subprocess.run(["mount", "-o", f"remount,size={size_kib}k", "/dev/shm"], check=True)
ok_new_shape = step(engine, 3100)
engine.release()
report(error=error, probed_first=probed_first, ok=ok, ok_new_shape=ok_new_shape, loaded=loaded, states=after_error,
       used_after=shm_used())
"""

#: The owner: an engine built directly (not through get_engine), weights filled, one step run; then ``{tail}``.
OWNER = """
engine = make_engine(("cpu",))
assert step(engine, 3000)
report(pids=[w["pid"] for w in engine.pool.snapshot()], run_dir=engine.pool.run_dir, used=shm_used())
{tail}
"""

#: Runs the owner, kills it (or lets it exit), then watches for 5 s until nothing of it is left.
WATCHER = """
import signal, subprocess

def mentions(text):
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out

owner = subprocess.Popen([sys.executable, "-c", os.environ["FAULT_OWNER"]], stdout=subprocess.PIPE, text=True)
info = json.loads(next(line for line in owner.stdout if line.startswith("RESULT "))[7:])
if os.environ["FAULT_MODE"] == "kill":
    owner.send_signal(signal.SIGKILL)
code = owner.wait(120)
t0 = time.monotonic()
while time.monotonic() - t0 < 5 and (shm_used() or mentions(info["run_dir"]) or os.path.exists(info["run_dir"])):
    time.sleep(0.05)
report(code=code, held=info["used"], used=shm_used(), procs=mentions(info["run_dir"]),
       run_dir_left=os.path.exists(info["run_dir"]), seconds=time.monotonic() - t0)
"""


def test_small_shm_fails_the_step_clearly_then_the_next_step_succeeds(tmp_path):
    res = run_with_private_shm(PRESSURE, 6, {"H3MS_RUN_DIR": str(tmp_path)})
    err = res["error"]
    assert err is not None and "ShmError" in err, res
    assert "/dev/shm is too small" in err and "MiB free of 6.0 MiB" in err and "--shm-size" in err, err
    assert res["states"] == ["ready", "ready"]  # no rank died (no SIGBUS): the failure was at creation
    assert res["probed_first"] == 0  # refused before its plan was probed (the probe would only delay the error)
    assert res["ok"] is True  # the next steps run, bit-exact
    assert res["ok_new_shape"] is True  # old buffers are freed before new ones are reserved
    assert res["loaded"] > 0 and res["used_after"] == 0
    assert run_dirs(tmp_path) == []


@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_owner_death_or_plain_exit_leaves_nothing(tmp_path, mode):
    owner = MODEL_PRELUDE + OWNER.format(tail="time.sleep(300)" if mode == "kill" else "")
    # the watcher needs no model: only the owner imports torch and builds one
    res = run_with_private_shm(WATCHER, 64, {"H3MS_RUN_DIR": str(tmp_path), "FAULT_OWNER": owner,
                                            "FAULT_MODE": mode}, prelude=BASE_PRELUDE)
    assert res["code"] == (-9 if mode == "kill" else 0), res
    assert res["held"] > 1 << 20, res  # the weight store and step buffers were really there
    assert res["used"] == 0, f"{res['used']} bytes of /dev/shm still used 5 s after the owner ended: {res}"
    assert res["procs"] == [] and res["run_dir_left"] is False, res
    assert run_dirs(tmp_path) == []
