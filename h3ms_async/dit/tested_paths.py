"""Which split paths have a passing bit-exactness test on which device kind.

A path (the Ulysses pattern, attention in head pieces, the qkv projection as gathered rows
arrive) runs on a device kind only once a test there compared its split step with the unsplit
step with ``torch.equal``, from fresh workers, first step included; ``pattern="auto"`` never
picks an untested one, and asking for one is refused with one line.  The table below names the
test behind each entry; an entry is added when that test passed on that kind (its log in
``docs/device_runs/`` for CUDA).  ``H3MS_ALLOW_UNTESTED_PATHS=1`` lets the tests and benchmarks
that measure a path there run it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import StrEnum

from workers.runtime import config


class SplitPath(StrEnum):
    ULYSSES = "the Ulysses pattern"
    HEAD_PIECES = "attention in head pieces"
    GATHER_OVERLAP = "the gather overlap"


#: device kind -> path -> the test that passed there
TESTED: dict[str, dict[SplitPath, str]] = {
    "cpu": {
        SplitPath.ULYSSES: "tests/test_split.py::test_ulysses_pattern_host_and_gloo",
        SplitPath.HEAD_PIECES: (
            "tests/test_invariance.py::test_head_pieces_run_exact_and_are_recorded"
        ),
        SplitPath.GATHER_OVERLAP: (
            "tests/test_invariance.py::test_gather_overlap_runs_exact_and_is_recorded"
        ),
    },
    # tests/test_cuda.py::test_split_paths_on_logical_ranks_are_exact has not run on a GPU yet
    "cuda": {},
}


class UntestedPath(ValueError):
    """A split path asked for on a device kind where no test of it has passed."""


def device_kind(devices: Sequence[str]) -> str:
    """ "cuda" when any rank is a GPU (a path must hold on every rank's kind), else "cpu"."""
    return "cuda" if any(d.startswith("cuda") for d in devices) else "cpu"


def is_tested(path: SplitPath, devices: Sequence[str]) -> bool:
    return path in TESTED[device_kind(devices)] or bool(config.ALLOW_UNTESTED_PATHS.get())


def asked_paths(pattern: str, head_pieces: int, gather_overlap: bool) -> list[SplitPath]:
    """The paths a setting asks for ("auto" asks for none: it picks among the tested)."""
    return [
        p
        for p, on in (
            (SplitPath.ULYSSES, pattern == "ulysses"),
            (SplitPath.HEAD_PIECES, head_pieces > 1),
            (SplitPath.GATHER_OVERLAP, gather_overlap),
        )
        if on
    ]


def tested_overlap(devices: Sequence[str], head_pieces: int, gather: bool) -> tuple[int, bool]:
    """``(head_pieces, gather)`` less the overlaps with no passing test on these devices (what the
    engine may pick among when it picks the overlaps itself: it leaves an untested one out rather
    than refuse the step)."""
    return (
        head_pieces if head_pieces > 1 and is_tested(SplitPath.HEAD_PIECES, devices) else 0,
        gather and is_tested(SplitPath.GATHER_OVERLAP, devices),
    )


def check(devices: Sequence[str], pattern: str, head_pieces: int, gather_overlap: bool) -> None:
    """Refuse, in one line, the first asked-for path with no passing test on these devices."""
    for path in asked_paths(pattern, head_pieces, gather_overlap):
        if not is_tested(path, devices):
            kind = device_kind(devices)
            raise UntestedPath(
                f"{path.value} has no passing bit-exactness test on {kind} yet, so it does not run "
                f"there: use pattern 'gather' (or 'auto') without head pieces or the gather "
                f"overlap"
            )


def allow_untested_paths() -> None:
    """For a benchmark's process: measuring a path on a device kind comes before its test there, so
    the benchmarks run every path unless the caller set the variable itself."""
    os.environ.setdefault(config.ALLOW_UNTESTED_PATHS.name, "1")
