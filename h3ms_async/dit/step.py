"""One denoising step of the split, as one typed object from the caller to the ranks: what it
computes on and how the caller drives it (:class:`Step`), the step as planned (:class:`PlannedStep`:
shards, the options it runs with, the pattern), and the record it leaves in the status hub."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.overlap_tuner import TuningPhase
from h3ms_async.runtime import plans
from h3ms_async.status.hub import get_hub
from h3ms_async.status.records import RankRecord, StepRecord, now_iso
from workers.dit import protocol as dit_protocol
from workers.dit.protocol import IpcSync, SparseStepSettings, Transport

#: ``progress(blocks_done, blocks_total)``: called from the caller's thread while a step runs
#: (progress bars).
StepProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class Step:
    """One step's inputs and controls.

    ``x`` [S, hidden] residual stream, ``mod_segments`` (a, b, row) and ``rope_freqs``, as H3's
    block loop takes them; ``modulation`` [blocks, M, 18·hidden]: every block's raw adaLN output
    for the step's M timestep rows, computed once by the process that owns the model (ComfyUI's
    own ``adaln_proj`` modules, or ``workers.dit.ops.adaln_rows`` standalone), so the ranks hold no
    adaLN weights.  ``block_options``: per-block
    transformer_options adjustments captured from user patches (plain data only).  ``sigma``
    decides sparse attention's window; ``sparse_branch``: the conditioning branch
    (``h3ms_async.dit.sparse.branch_key``) whose pooled statistics a sparse step reuses.
    ``progress``: see :data:`StepProgress`.  ``in_place``: write the result into ``x`` (H3's
    blocks update the stream in place too).  ``exchange``, ``ipc_sync``, ``exchange_chunks``,
    ``head_pieces``, ``gather_overlap``, ``gather_ahead`` (None: the engine's options) override
    the engine's options for this step (benchmarks compare them side by side on the same
    workers)."""

    x: torch.Tensor
    modulation: torch.Tensor
    mod_segments: Sequence[tuple]
    rope_freqs: torch.Tensor
    block_options: list[dict] | None = None
    interrupt: Callable[[], bool] | None = None
    sigma: float | None = None
    progress: StepProgress | None = None
    in_place: bool = False
    sparse_branch: str = ""
    exchange: Transport | None = None
    ipc_sync: IpcSync | None = None
    exchange_chunks: int | None = None
    head_pieces: int | None = None
    gather_overlap: bool | None = None
    gather_ahead: int | None = None

    def options(self, base: SplitOptions) -> SplitOptions:
        """``base`` with this step's overrides."""
        opts = base
        if self.exchange is not None:
            opts = replace(opts, exchange=self.exchange)
        if self.ipc_sync is not None:
            opts = replace(opts, ipc_sync=self.ipc_sync)
        if self.exchange_chunks is not None:
            opts = replace(opts, exchange_chunks=self.exchange_chunks)
        if self.head_pieces is not None:
            opts = replace(opts, head_pieces=self.head_pieces)
        if self.gather_overlap is not None:
            opts = replace(opts, gather_overlap=self.gather_overlap)
        if self.gather_ahead is not None:
            opts = replace(opts, gather_ahead=self.gather_ahead)
        return opts


@dataclass(frozen=True)
class PlannedStep:
    """A step as it runs: its shards (as measured), the options with the overlaps that measured
    exact, the loaded pattern and the transport as it runs on these devices; ``sparse``: its sparse
    attention as the ranks get it (``dit_step``'s field; {}: dense: not asked for, the kernel
    cannot run, or measured inexact on this plan); ``trace``: the ranks also digest each op's output
    (``verify``); ``overlap_phase``: where the engine's own choice of overlaps stands on this plan
    (None: the options fixed them); ``ipc_sync``: how the GPU-direct exchange orders its copies."""

    step: Step
    plan: plans.SplitPlan
    options: SplitOptions
    pattern: dit_protocol.Pattern
    transport: Transport
    sparse: SparseStepSettings | None = None
    trace: bool = False
    overlap_phase: TuningPhase | None = None
    ipc_sync: IpcSync = IpcSync.HOST


def record_step(
    planned: PlannedStep,
    devices: Sequence[str],
    results: Sequence[dit_protocol.DitStepped],
    wall_s: float,
    blocks: int,
    weight_store: str,
) -> None:
    """Record a step the ranks answered in the status hub (its log line, the panel's feed)."""
    hub = get_hub()
    plan, opts = planned.plan, planned.options
    ranks = [
        RankRecord(
            rank=r,
            device=devices[r],
            tokens=[plan.token_bounds[r], plan.token_bounds[r + 1]],
            heads=[plan.head_bounds[r], plan.head_bounds[r + 1]],
            compute_s=res.compute_s,
            exchange_s=res.exchange_s,
            wait_s=res.wait_s,
            moved_bytes=res.moved_bytes,
            vram_peak_bytes=res.vram_peak_bytes,
            per_block=res.per_block,
            **_residency(res.weights),
        )
        for r, res in enumerate(results)
    ]
    staged = planned.transport in (Transport.HOST, Transport.CUDA_IPC)
    chunks = opts.exchange_chunks if staged else 0
    rec = StepRecord(
        at=now_iso(),
        seq=hub.next_seq(),
        sigma=planned.step.sigma,
        tokens=int(planned.step.x.shape[0]),
        blocks=blocks,
        devices=list(devices),
        exchange=planned.transport,
        chunks=max(chunks, 1),
        head_pieces=opts.head_pieces,
        gather_overlap=opts.gather_overlap,
        gather_ahead=opts.gather_ahead if planned.pattern == "gather" else 0,
        overlap_tuning=planned.overlap_phase.value if planned.overlap_phase else "",
        pattern=planned.pattern,
        ipc_sync=planned.ipc_sync if planned.transport is Transport.CUDA_IPC else None,
        wall_s=wall_s,
        moved_bytes=sum(r.moved_bytes for r in ranks),
        weight_store=weight_store,
        ranks=ranks,
    )
    hub.record_step(rec)


def _residency(weights: dict | None) -> dict[str, int | None]:
    """A GPU rank's residency fields of its rank record, from the weights summary it answered
    (``workers.dit.cuda.CudaWeights.timer``); none on a CPU rank."""
    if not weights or "resident_blocks" not in weights:
        return {}
    resident = int(weights["resident_blocks"])
    return {
        "weights_vram_bytes": resident * int(weights["block_bytes"]),
        "resident_blocks": resident,
        "streamed_blocks": int(weights["streamed_blocks"]),
    }
