"""A process that exits with running pools leaves nothing, whatever runtime module it imports first:
the coordinator releases the pools registered with it, each pool its workers, sockets, segments and
run dir."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The runtime modules with process-wide state, imported with the coordinator first and last.
ORDERS = {
    "coordinator first": ["coordinator", "rundir", "engines", "pool"],
    "coordinator last": ["pool", "engines", "rundir", "coordinator"],
}

SCRIPT = """
import importlib, json, sys
for name in sys.argv[1].split(","):
    importlib.import_module("h3ms_async.runtime." + name)
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from workers.runtime.protocol import Ping
from workers.runtime.shm import held_shm
pools = [WorkerPool(["cpu"] * 2, name=f"exit{i}") for i in range(2)]
coord = get_coordinator()
for pool in pools:
    coord.run(pool.start(), 120)
    coord.run(pool.all([Ping()] * 2, timeout=30), 60)
    pool.create_segment(1 << 20, "kept")
print(json.dumps({"pids": [w["pid"] for p in pools for w in p.snapshot()],
                  "run_dirs": [p.run_dir for p in pools], "shm": sorted(held_shm(os.getpid())),
                  "owner": os.getpid()}), flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", ORDERS.values(), ids=list(ORDERS))
def test_exit_with_running_pools_leaves_nothing_whatever_the_import_order(order: list[str],
                                                                          tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "H3MS_RUN_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", "import os\n" + SCRIPT, ",".join(order)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen["pids"]) == 4 and seen["shm"], seen  # the pools were up, holding segments
    assert all(Path(d).parent == tmp_path for d in seen["run_dirs"]), seen
    # released at exit, not reaped afterwards: gone by the time the interpreter has exited
    alive = [p for p in seen["pids"] if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == [], proc.stderr[-3000:]
    assert not glob.glob(f"/dev/shm/h3ms-{seen['owner']}-*")
    assert "failed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
