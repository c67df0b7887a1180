"""What a weight load fixed (the store, the head plan, the compute dtype, the pattern) and where its
wall time went."""

from __future__ import annotations

from dataclasses import dataclass

from h3ms_async.dit.reference import DiTConfig
from h3ms_async.runtime.weight_store import GIB, Rewrite, WeightStore
from workers.dit import protocol as dit_protocol


@dataclass(frozen=True)
class ProbeAhead:
    """The first step's plan probe as the load ran it beside the store's fill (offsets in seconds
    from the load's start): ``probed`` False when its verdict was known already (this process or
    ``H3MS_INVARIANCE_CACHE``), so nothing ran on the ranks."""

    start_s: float
    end_s: float
    probed: bool

    @property
    def probe_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Placing:
    """What a load tells the ranks of the step about to run, so a CUDA rank places its resident
    blocks in VRAM as the store fills (``DitLoad``'s residency and tokens): the step's residency
    and, per rank, [tokens, the rank's tokens]."""

    residency: dit_protocol.Residency
    tokens: list[tuple[int, int]]


@dataclass(frozen=True)
class PatchRefill:
    """A weight-patch change (a LoRA's strength, a LoRA added or removed) taken in place: the
    store's rewrite of the patched tensors, then the ranks taking them in again (``ranks_s``, the
    most bytes one rank copied again: ``ranks_bytes``; VRAM copies, sliced qkv rows)."""

    store: Rewrite
    ranks_s: float
    ranks_bytes: int

    def line(self) -> str:
        s = self.store
        return (
            f"weights: LoRA change, refilled {s.tensors} of {s.of_tensors} tensors, "
            f"{s.bytes / GIB:.2f} GiB in {s.seconds:.2f} s ({s.read_s:.2f} s of it reading the "
            f"blocks); the ranks took them in again in "
            f"{self.ranks_s:.2f} s ({self.ranks_bytes / GIB:.2f} GiB copied on the busiest)"
        )


@dataclass(frozen=True)
class LoadTimes:
    """Where a weight load's wall time went (``SplitEngine.last_load``).  The workers start, the
    ranks take each block in and the first step's plan is probed while the store fills, so
    ``wall_s`` is about ``fill_s + start_wait_s + ranks_load_s``; the offsets (seconds from the
    load's start, one clock for every process) say what ran beside the fill."""

    #: the pool's start (0 when the workers were already up)
    workers_start_s: float
    fill_s: float
    fill_bytes: int
    #: the wait for the workers after the fill (the part of their start the fill did not hide)
    start_wait_s: float
    #: the ranks' load after the fill and the workers' start (the part the fill did not hide)
    ranks_load_s: float
    wall_s: float
    #: when the fill's last block was complete
    fill_end_s: float = 0.0
    #: of ``fill_s``, the reading thread's seconds in the block reader, and the writers' span from
    #: the first block's write to the last one's end, beside the reads
    #: (``WeightStore.read_seconds`` / ``copy_seconds``): a fill near the first waits on the
    #: reader
    fill_read_s: float = 0.0
    fill_copy_s: float = 0.0
    #: of ``fill_bytes``, those taken from the checkpoint file unchanged
    #: (``WeightStore.file_bytes``)
    fill_file_bytes: int = 0
    #: when the last rank to do so took its first block in, and its last (None: the ranks held
    #: these weights already)
    ranks_first_block_s: float | None = None
    ranks_last_block_s: float | None = None
    #: the first step's plan probe (None: no step was known at the load, or a single rank)
    probe: ProbeAhead | None = None
    #: a patch change rewritten in place (then ``fill_*`` are the rewrite's, ``ranks_load_s`` the
    #: ranks' refresh, nothing started); None: a full fill
    refill: PatchRefill | None = None
    #: why a patch change was filled in full instead (None: it was no patch change, or in place)
    full_because: str | None = None
    #: the bytes of a store kept from the last load (another plan: GPU set, shares, pattern or
    #: attention function) and loaded without a fill (then ``fill_*`` are 0); 0: filled
    kept_bytes: int = 0

    @property
    def fill_gbps(self) -> float:
        return self.fill_bytes / max(self.fill_s, 1e-9) / 1e9

    @property
    def probe_overlapped(self) -> bool:
        """Whether the plan probe ran on the ranks while the store filled."""
        return self.probe is not None and self.probe.probed and self.probe.start_s < self.fill_end_s

    def line(self) -> str:
        if self.refill is not None:
            return f"{self.refill.line()}, load {self.wall_s:.2f} s"
        out = "" if self.full_because is None else f"weights: LoRA change, {self.full_because}; "
        out += f"weights loaded in {self.wall_s:.2f}s: "
        if self.kept_bytes:
            out += (
                f"store of {self.kept_bytes / 1e9:.2f} GB kept from the last plan (no fill), "
                f"workers started in {self.workers_start_s:.2f}s, ranks loaded in "
                f"{self.ranks_load_s:.2f}s after them"
            )
        else:
            out += (
                f"store filled {self.fill_bytes / 1e9:.2f} GB in {self.fill_s:.2f}s "
                f"({self.fill_gbps:.2f} GB/s; reading {self.fill_read_s:.2f}s, writing "
                f"{self.fill_copy_s:.2f}s beside it, {self.fill_file_bytes / 1e9:.2f} GB of it "
                f"from the file), workers started in {self.workers_start_s:.2f}s beside it "
                f"({self.start_wait_s:.2f}s waited after the fill), ranks loaded in "
                f"{self.ranks_load_s:.2f}s after it"
            )
        if self.ranks_first_block_s is not None:
            out += f" (first block taken in at {self.ranks_first_block_s:.2f}s"
            if self.ranks_last_block_s is not None:
                out += f", last at {self.ranks_last_block_s:.2f}s"
            out += ")" if self.kept_bytes else f"; fill ended at {self.fill_end_s:.2f}s)"
        p = self.probe
        if p is None:
            return out + "; no plan probe at load"
        if not p.probed:
            return out + "; the first step's plan verdict was known (no probe)"
        beside = "beside the fill" if self.probe_overlapped else "after the fill"
        return out + (
            f"; plan probe {p.probe_s:.2f}s {beside} (from {p.start_s:.2f}s to {p.end_s:.2f}s)"
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
