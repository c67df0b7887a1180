"""Which split paths have a passing bit-exactness test on which device kind.

A path (the Ulysses pattern, attention in head pieces, the qkv projection as gathered rows
arrive, the cross-block overlap, the GPU-direct exchange) runs on a device kind only once a test
there compared its split step with the unsplit step with ``torch.equal``, from fresh workers,
first step included; ``pattern="auto"`` and ``exchange="auto"`` never pick an untested one, and
asking for one is refused with one line.  The table below names the test behind each entry; an
entry is added when that test passed on that kind (its log in ``docs/device_runs/`` for CUDA).
``H3MS_ALLOW_UNTESTED_PATHS=1`` lets the tests and benchmarks that measure a path there run it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import StrEnum

from workers.runtime import config


class SplitPath(StrEnum):
    ULYSSES = "the Ulysses pattern"
    #: the Ulysses pattern's q/k/v all-to-all in head pieces, each attended as it arrives
    ULYSSES_PIECES = "the Ulysses pattern with attention in head pieces"
    HEAD_PIECES = "attention in head pieces"
    GATHER_OVERLAP = "the gather overlap"
    GATHER_AHEAD = "the cross-block overlap (gather ahead)"
    CUDA_IPC = "the GPU-direct exchange (cuda_ipc)"
    #: the same exchange between distinct GPUs: peer-to-peer copies, not one GPU's own memory
    CUDA_IPC_P2P = "the GPU-direct exchange across GPUs (cuda_ipc, peer to peer)"
    #: the GPU-direct exchange's copies ordered by CUDA IPC events instead of host waits
    CUDA_IPC_EVENTS = "the GPU-direct exchange ordered by CUDA IPC events (ipc_sync events)"


_NO_PATTERN_PATHS = (
    "use pattern 'gather' (or 'auto') without head pieces, the gather overlap or gather ahead"
)
#: How to leave each path out, for the refusal.
_FIX = {
    SplitPath.ULYSSES: _NO_PATTERN_PATHS,
    SplitPath.ULYSSES_PIECES: (
        "use pattern 'gather' (or 'auto'), or the Ulysses pattern without head pieces"
    ),
    SplitPath.HEAD_PIECES: _NO_PATTERN_PATHS,
    SplitPath.GATHER_OVERLAP: _NO_PATTERN_PATHS,
    SplitPath.GATHER_AHEAD: _NO_PATTERN_PATHS,
    SplitPath.CUDA_IPC: "set exchange to host (or auto)",
    SplitPath.CUDA_IPC_P2P: "set exchange to host (or auto)",
    SplitPath.CUDA_IPC_EVENTS: "set ipc_sync to host (or auto)",
}


#: device kind -> path -> the test that passed there
TESTED: dict[str, dict[SplitPath, str]] = {
    "cpu": {
        SplitPath.ULYSSES: "tests/test_split.py::test_ulysses_pattern_host_and_gloo",
        SplitPath.ULYSSES_PIECES: (
            "tests/test_split.py::test_ulysses_pattern_in_head_pieces_host_and_gloo"
        ),
        SplitPath.HEAD_PIECES: (
            "tests/test_invariance.py::test_head_pieces_run_exact_and_are_recorded"
        ),
        SplitPath.GATHER_OVERLAP: (
            "tests/test_invariance.py::test_gather_overlap_runs_exact_and_is_recorded"
        ),
        SplitPath.GATHER_AHEAD: (
            "tests/test_gather_ahead.py::test_gather_ahead_runs_exact_and_is_recorded"
        ),
    },
    # Ulysses, head pieces and the GPU-direct exchange passed on one H200 at 131efbe
    # (docs/device_runs/h200_s12_131efbe_*); the gather overlap, both overlaps and every
    # gather-ahead case (host, all overlaps, GPU-direct, streamed weights) on one H100 at f2383e5
    # (docs/device_runs/h100_s13_f2383e5_*); the GPU-direct exchange ordered by CUDA IPC events
    # (chunked and not, an interrupt and a killed rank, every collective) on one H100 at c24a884
    # (docs/device_runs/h100_s16_c24a884_*); the Ulysses pattern in head pieces (its q/k/v in and
    # its output back by pieces), host-staged and GPU-direct, on one H100 at 53d12c4
    # (docs/device_runs/h100_s27_53d12c4_*). The exchange across GPUs has no pass yet: no machine
    # with several GPUs was lent (its test: tests/test_cuda.py::test_split_across_gpus_is_exact
    # [cuda_ipc], run by benchmarks/device_run.sh gpus).
    "cuda": {
        SplitPath.ULYSSES: (
            "tests/test_cuda.py::test_split_paths_on_logical_ranks_are_exact[ulysses]"
        ),
        SplitPath.HEAD_PIECES: (
            "tests/test_cuda.py::test_split_paths_on_logical_ranks_are_exact[pieces4]"
        ),
        SplitPath.ULYSSES_PIECES: (
            "tests/test_cuda.py::test_split_paths_on_logical_ranks_are_exact[ulysses-pieces8]"
        ),
        SplitPath.GATHER_OVERLAP: (
            "tests/test_cuda.py::test_split_paths_on_logical_ranks_are_exact[gather-overlap]"
        ),
        SplitPath.GATHER_AHEAD: (
            "tests/test_cuda.py::test_gather_ahead_on_logical_ranks_is_exact[ahead4]"
        ),
        # (and the cuda-ipc line of tests/test_exchange_conformance.py)
        SplitPath.CUDA_IPC: (
            "tests/test_cuda.py::test_gpu_direct_exchange_on_logical_ranks_is_exact[host-0]"
        ),
        SplitPath.CUDA_IPC_EVENTS: (
            "tests/test_cuda.py::test_gpu_direct_exchange_on_logical_ranks_is_exact[events-0]"
        ),
    },
}


class UntestedPath(ValueError):
    """A split path asked for on a device kind where no test of it has passed."""


def device_kind(devices: Sequence[str]) -> str:
    """ "cuda" when any rank is a GPU (a path must hold on every rank's kind), else "cpu"."""
    return "cuda" if any(d.startswith("cuda") for d in devices) else "cpu"


def is_tested(path: SplitPath, devices: Sequence[str]) -> bool:
    return path in TESTED[device_kind(devices)] or bool(config.ALLOW_UNTESTED_PATHS.get())


def asked_paths(
    pattern: str, head_pieces: int, gather_overlap: bool, gather_ahead: int = 0
) -> list[SplitPath]:
    """The paths a setting asks for ("auto" asks for none: it picks among the tested)."""
    return [
        p
        for p, on in (
            (SplitPath.ULYSSES, pattern == "ulysses"),
            (SplitPath.HEAD_PIECES, head_pieces > 1),
            (SplitPath.ULYSSES_PIECES, pattern == "ulysses" and head_pieces > 1),
            (SplitPath.GATHER_OVERLAP, gather_overlap),
            (SplitPath.GATHER_AHEAD, gather_ahead > 0),
        )
        if on
    ]


def tested_overlap(
    devices: Sequence[str], head_pieces: int, gather: bool, ahead: int = 0, pattern: str = "gather"
) -> tuple[int, bool, int]:
    """``(head_pieces, gather, ahead)`` less the overlaps with no passing test on these devices
    under ``pattern`` (what the engine may pick among when it picks the overlaps itself: it leaves
    an untested one out rather than refuse the step)."""
    pieces_tested = is_tested(SplitPath.HEAD_PIECES, devices) and (
        pattern != "ulysses" or is_tested(SplitPath.ULYSSES_PIECES, devices)
    )
    return (
        head_pieces if head_pieces > 1 and pieces_tested else 0,
        gather and is_tested(SplitPath.GATHER_OVERLAP, devices),
        ahead if ahead > 0 and is_tested(SplitPath.GATHER_AHEAD, devices) else 0,
    )


def require(path: SplitPath, devices: Sequence[str]) -> None:
    """Refuse ``path`` in one line (naming it and the fix) unless it is tested on these
    devices."""
    if not is_tested(path, devices):
        raise UntestedPath(
            f"{path.value} has no passing bit-exactness test on {device_kind(devices)} yet, so it "
            f"does not run there: {_FIX[path]}"
        )


def check(
    devices: Sequence[str],
    pattern: str,
    head_pieces: int,
    gather_overlap: bool,
    gather_ahead: int = 0,
) -> None:
    """Refuse, in one line, the first asked-for path with no passing test on these devices."""
    for path in asked_paths(pattern, head_pieces, gather_overlap, gather_ahead):
        require(path, devices)


def allow_untested_paths() -> None:
    """For a benchmark's process: measuring a path on a device kind comes before its test there, so
    the benchmarks run every path unless the caller set the variable itself."""
    os.environ.setdefault(config.ALLOW_UNTESTED_PATHS.name, "1")
