"""The VAE split's exactness check: a temporal chunk's decode must not depend on the rank that runs
it.

A chunk decoded by a worker equals rank 0's decode only where the worker's device and kernels give
the same bits, which is measured, not assumed: before a plan's chunks are dealt, every worker rank
without a verdict decodes one random latent of each of the plan's chunk shapes (the kernels depend
on the shapes, not the values) and its digest is compared with rank 0's decode of the same latent.
A rank whose decode differs is probed once more before it is judged: the first call of a kernel in a
fresh process can take another path than every later call (measured for SDPA on the H200), and the
real chunks are decoded after the probe.  A rank whose second decode still differs is dropped from
the deal (its chunks go to the others, rank 0 at least) with one warning naming its device.
Verdicts are kept for the life of the process per (rank, its worker's pid, its device, rank 0's
device, torch, dtype, chunk shape, decoder weight key), so a restarted worker is probed again: the
cost is one chunk decode per worker and new shape (two where the first differs).  Each verdict goes
to the status document's ``exactness.verdicts`` (program "vae").
"""

from __future__ import annotations

import functools
import platform
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h3ms_async.log import get_logger
from h3ms_async.status.hub import record_verdict
from workers.runtime.shm import dtype_name

log = get_logger("VAE split")

#: Seed of the probe latents: the same latent on every rank.
PROBE_SEED = 20260
_verdicts: dict[tuple, bool] = {}
_lock = threading.Lock()


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        return platform.processor()


def device_label(device: str) -> str:
    """``"cuda:1 NVIDIA H200"`` or ``"cpu <CPU model>"``: the device and what it is."""
    if device.startswith("cuda"):
        return f"{device} {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu {_cpu_model() or platform.machine()}".rstrip()


def verdict_key(
    rank: int,
    devices: Sequence[str],
    dtype: torch.dtype,
    shape: Sequence[int],
    weights: tuple,
    pid: int | None,
) -> tuple:
    """What a rank's verdict for one chunk shape depends on; ``pid``: the rank's worker process."""
    return (
        rank,
        pid,
        device_label(devices[rank]),
        device_label(devices[0]),
        torch.__version__,
        dtype_name(dtype),
        tuple(shape),
        weights,
    )


def known(key: tuple) -> bool | None:
    """The kept verdict (True: the rank decodes as rank 0), or None when that rank and shape were
    never probed."""
    with _lock:
        return _verdicts.get(key)


def probe_latent(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The random latent every rank decodes for ``shape`` (on the CPU)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(PROBE_SEED)).to(dtype)


@dataclass(frozen=True)
class Outcome:
    """One probed rank and shape."""

    rank: int
    device: str
    shape: tuple[int, ...]
    equal: bool
    probe_ms: float
    #: the first probe differed and this outcome is the second's
    retried: bool = False


def settle(
    outcomes: Sequence[Outcome],
    keys: dict[tuple[int, tuple[int, ...]], tuple],
    devices: Sequence[str],
    dtype: torch.dtype,
    shards: list[int],
    workers_left: int,
) -> None:
    """Keep the verdicts of ``outcomes``, warn once per differing rank and record every verdict in
    the status document; ``workers_left``: the worker ranks that still decode after the differing
    ones are dropped."""
    ref = device_label(devices[0])
    warned: set[int] = set()
    for o in outcomes:
        with _lock:
            _verdicts[keys[(o.rank, o.shape)]] = o.equal
        shape = "x".join(map(str, o.shape))
        label = device_label(o.device)
        if o.equal:
            verdict, detail = (
                "exact",
                f"rank {o.rank} decodes a {shape} chunk as rank 0 ({ref}) does"
                + (" from its second decode on (the first differed)" if o.retried else ""),
            )
            if o.retried:
                log.info("%s (%s)", detail, dtype_name(dtype))
        else:
            verdict = "adjusted" if workers_left else "unsplit"
            detail = (
                f"rank {o.rank} ({label}) decodes a {shape} chunk differently from rank 0 ({ref}); "
                + (
                    "its chunks go to the other ranks"
                    if workers_left
                    else "rank 0 decodes every chunk"
                )
            )
            if o.rank not in warned:
                log.warning("%s (%s)", detail, dtype_name(dtype))
                warned.add(o.rank)
        record_verdict(
            "vae",
            "vae.chunk",
            label,
            dtype_name(dtype),
            shape,
            shards,
            verdict,
            detail,
            round(o.probe_ms, 3),
        )
