"""What a weight load fixed (the store, the head plan, the compute dtype, the pattern) and where its
wall time went."""

from __future__ import annotations

from dataclasses import dataclass

from h3ms_async.dit.reference import DiTConfig
from h3ms_async.runtime.weight_store import WeightStore
from workers.dit import protocol as dit_protocol


@dataclass(frozen=True)
class LoadTimes:
    """Where a weight load's wall time went (``SplitEngine.last_load``): the workers start while
    the store fills, so ``wall_s`` is about ``fill_s + start_wait_s + ranks_load_s``."""

    #: the pool's start (0 when the workers were already up)
    workers_start_s: float
    fill_s: float
    fill_bytes: int
    #: the wait for the workers after the fill (the part of their start the fill did not hide)
    start_wait_s: float
    #: every rank mapping the store and placing its weights (``dit_load``)
    ranks_load_s: float
    wall_s: float

    @property
    def fill_gbps(self) -> float:
        return self.fill_bytes / max(self.fill_s, 1e-9) / 1e9

    def line(self) -> str:
        return (
            f"weights loaded in {self.wall_s:.2f}s: store filled {self.fill_bytes / 1e9:.2f} GB in "
            f"{self.fill_s:.2f}s ({self.fill_gbps:.2f} GB/s), workers started in "
            f"{self.workers_start_s:.2f}s beside it ({self.start_wait_s:.2f}s waited after the "
            f"fill), ranks loaded in {self.ranks_load_s:.2f}s"
        )


@dataclass
class LoadedWeights:
    """The filled weight store an engine's ranks load from, and what was fixed with it."""

    store: WeightStore
    config: DiTConfig
    head_bounds: tuple[int, ...]
    compute_dtype: str
    pattern: dit_protocol.Pattern = dit_protocol.Pattern.GATHER
    # the block stack's distinct linears, for the probe (lazily)
    ops: list[dit_protocol.LinearOp] | None = None
