"""IPC benchmark: control round trip, pipelined message rate, shm->tensor copy, pool start time (CPU
workers).

``python -m h3ms_async bench ipc`` (through the CLI) or ``run_bench_ipc()`` print one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Sequence

from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.runtime.visibility import rank_devices
from h3ms_async.tools.cli import ArgParser, int_list, positive_int
from workers.runtime.protocol import Ping, TensorDesc


async def _rtt(pool: WorkerPool, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        await pool.request(0, Ping(), timeout=10)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


async def _pipelined(pool: WorkerPool, messages: int, window: int) -> float:
    sem = asyncio.Semaphore(window)

    async def one() -> None:
        async with sem:
            await pool.request(0, Ping(), timeout=30)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(messages)))
    return messages / (time.perf_counter() - t0)


def _shm_copy_gb_s(copy_mib: int, reps: int) -> float:
    import torch

    from workers.runtime.shm import Segment

    nbytes = copy_mib << 20
    with Segment.create(nbytes, "bench") as seg:
        src = seg.tensor(TensorDesc(seg=seg.name, off=0, dtype="uint8", shape=[nbytes]))
        src.fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault in both sides before timing
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        dt = time.perf_counter() - t0
        del src
    return nbytes * reps / dt / 1e9


async def _start(n: int, device: str, program: str | None) -> dict:
    """Start ``n`` workers on ``device`` running ``program``: the wall time, and the slowest rank's
    phases (``StartTimes``)."""
    pool = WorkerPool([device] * n, name=f"bench{n}", program=program)
    t0 = time.perf_counter()
    await pool.start()
    dt = time.perf_counter() - t0
    times = [t for t in pool.start_times() if t is not None]
    await pool.release()
    slowest = max(times, key=lambda t: t.total_s)
    return {"wall_s": round(dt, 3)} | {
        k: round(v, 3) for k, v in dataclasses.asdict(slowest).items()
    }


def _device(text: str) -> str:
    """argparse type: one worker device (``cpu``, ``cuda``, ``cuda:N``)."""
    try:
        return rank_devices([text])[0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N") from None


def _program(text: str) -> str:
    """argparse type: a rank program, a package ``workers/<name>/`` with a ``rank.py``."""
    try:
        found = importlib.util.find_spec(f"workers.{text}.rank") is not None
    except ImportError:
        found = False
    if not found:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no rank program (there is no module workers.{text}.rank; e.g. dit)"
        )
    return text


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_bench_ipc(
    samples: int = 2000,
    messages: int = 20000,
    window: int = 256,
    copy_mib: int = 64,
    copy_reps: int = 5,
    pool_sizes: Sequence[int] = (1, 4, 8),
    start_device: str = "cpu",
    program: str | None = None,
    timeout: float = 600.0,
) -> dict:
    """Run every measurement, print the JSON result on stdout and return it.  The pools whose start
    is timed run ``program`` on ``start_device`` (every rank on it)."""
    coord = get_coordinator()
    pool = WorkerPool(["cpu"], name="benchipc")
    coord.run(pool.start(), timeout, what="starting the bench worker")
    try:
        coord.run(_rtt(pool, 50), timeout, what="warm-up pings")
        rtt = coord.run(_rtt(pool, samples), timeout, what=f"{samples} pings")
        rate = coord.run(
            _pipelined(pool, messages, window), timeout, what=f"{messages} pipelined pings"
        )
    finally:
        coord.run(pool.release(), timeout, what="releasing the bench worker")
    starts = {
        str(n): coord.run(_start(n, start_device, program), timeout, what=f"starting {n} workers")
        for n in pool_sizes
    }
    result = {
        "bench": "ipc",
        "loop": coord.backend,
        "control_rtt_us": {
            "samples": samples,
            "p50": round(_pct(rtt, 0.50), 1),
            "p99": round(_pct(rtt, 0.99), 1),
            "mean": round(statistics.fmean(rtt), 1),
        },
        "messages_per_s": round(rate, 1),
        "pipeline_window": window,
        "shm_copy_gb_s": round(_shm_copy_gb_s(copy_mib, copy_reps), 2),
        "shm_copy_mib": copy_mib,
        "pool_start": {"device": start_device, "program": program, "by_size": starts},
    }
    print(json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="python -m h3ms_async bench ipc", description=__doc__)
    p.add_argument(
        "--samples", type=positive_int, default=2000, help="sequential pings timed (default 2000)"
    )
    p.add_argument(
        "--messages", type=positive_int, default=20000, help="pipelined pings (default 20000)"
    )
    p.add_argument(
        "--window", type=positive_int, default=256, help="pipelined pings in flight (default 256)"
    )
    p.add_argument(
        "--copy-mib",
        type=positive_int,
        default=64,
        help="shm->tensor copy size in MiB (default 64)",
    )
    p.add_argument(
        "--pool-sizes",
        type=int_list,
        default=[1, 4, 8],
        help="worker counts whose start time is measured",
    )
    p.add_argument(
        "--start-device",
        type=_device,
        default="cpu",
        help="the device of every worker whose start is timed (default cpu; e.g. cuda:0)",
    )
    p.add_argument(
        "--program",
        type=_program,
        default=None,
        help="the rank program those workers import (e.g. dit; default: none, the runtime only)",
    )
    args = p.parse_args(argv)
    sizes = args.pool_sizes
    if min(sizes) < 1:
        p.error(
            f"argument --pool-sizes: {min(sizes)} workers; every pool size must be >= 1 (e.g. "
            "1,4,8)"
        )
    run_bench_ipc(
        samples=args.samples,
        messages=args.messages,
        window=args.window,
        copy_mib=args.copy_mib,
        pool_sizes=sizes,
        start_device=args.start_device,
        program=args.program,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
