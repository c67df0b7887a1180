"""Starting one worker process: ``python -m workers`` with its rank, the pool's socket and its
device on the command line, the pack on PYTHONPATH, its CUDA devices, its log as stdout and the pool
key on stdin; its exit is watched (:mod:`h3ms_async.runtime.exit_watch`) from the moment it runs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from h3ms_async import PACK_ROOT
from h3ms_async.runtime.exit_watch import watch_exit
from h3ms_async.runtime.visibility import visible_entries
from h3ms_async.runtime.worker_handle import WorkerHandle
from workers.runtime import auth


def cpu_thread_env(devices: Sequence[str]) -> dict[str, str]:
    """CPU ranks share the machine's cores: more intra-op threads than cores make OpenMP spin
    against itself."""
    n_cpu = sum(1 for d in devices if d == "cpu")
    if not n_cpu or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n_cpu))}


def worker_env(device: str, overrides: Mapping[str, str], also_visible: Sequence[str]) -> dict:
    """The environment of a worker on ``device``: this process's, the pool's ``overrides``, the
    pack on PYTHONPATH and, on CUDA, the devices it sees."""
    env = dict(os.environ)
    env.update(overrides)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PACK_ROOT) + (os.pathsep + old if old else "")
    env["PYTHONUNBUFFERED"] = "1"
    if device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_entries(device, also_visible))
    return env


def spawn(
    w: WorkerHandle,
    *,
    program: str | None,
    world_size: int,
    socket_path: str,
    key: bytes,
    run_dir: str,
    doorbells: Sequence[int],
    env: dict,
) -> None:
    """Start ``w``'s process (``w.proc``) in ``run_dir``, watch its exit and hand it ``key``."""
    local_device = "cuda:0" if w.device.startswith("cuda") else "cpu"
    cmd = [
        sys.executable,
        "-m",
        "workers",
        "--rank",
        str(w.rank),
        "--world-size",
        str(world_size),
        "--socket",
        socket_path,
        "--parent-pid",
        str(os.getpid()),
        "--device",
        local_device,
    ]
    if program is not None:
        cmd += ["--program", program]
    with open(w.log_path, "ab") as logf:
        logf.write(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} coordinator: starting rank {w.rank} on "
            f"{w.device} (pool {w.pool!r}, program {program or 'none'}, parent pid "
            f"{os.getpid()})\n".encode()
        )
        logf.flush()
        # New session: a terminal's Ctrl-C goes to the parent, which stops the workers itself.
        w.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=run_dir,
            pass_fds=doorbells,
            start_new_session=True,
        )
    w.started_at = time.monotonic()
    watch_exit(w)
    stdin = w.proc.stdin
    assert stdin is not None  # spawned with stdin=PIPE
    # a broken pipe means it died at once: its pidfd reports the exit, the start's wait the log
    with contextlib.suppress(BrokenPipeError):
        stdin.write(auth.key_line(key))
        stdin.close()
