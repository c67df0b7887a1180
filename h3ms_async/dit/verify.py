"""The opt-in ``verify`` setting: a prompt's first split step, run again unsplit on the model's
device and compared.

The split step runs as usual, with the ranks digesting every op's output rows (``DitStep.trace``).
Then the same step runs unsplit on rank 0's device, block by block through the same block loop
(``workers.dit.loop``), each block's weights read from the shared-memory weight store and moved
there one block at a time (so the whole model never has to fit), digesting the same rows of the same
ops.  The answer is ``torch.equal`` on the step's output; the digests only name the first block and
op that differ.  The result is logged ("bit-exact on <devices>" or the max difference and where) and
recorded in the status document (``exactness.verify``).

With sparse attention the checked step is the prompt's first that runs the sparse kernel
(:func:`due`), and the unsplit run is the same sparse attention over every head
(``workers.dit.sparse.SparseStep``, as ``h3ms_async.dit.sparse.UnsplitSparse`` runs it).  Both
sides start it from fresh pooled statistics (the ranks drop any they hold first, as at a prompt's
end), and the statistics the step leaves for the next one are compared too: a step whose output is
equal but whose statistics differ is not bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from h3ms_async.dit.engine_view import EngineView
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.step import PlannedStep
from h3ms_async.log import get_logger
from h3ms_async.runtime import plans
from h3ms_async.status.hub import get_hub
from h3ms_async.status.records import VerifyRecord, now_iso
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit.loop import BlockInputs, LoopHooks, LoopPaths, RankBlocks, run_blocks
from workers.dit.protocol import SparseStepSettings
from workers.dit.sparse import PooledStats, dense_reason, sparse_step
from workers.dit.weights import CpuWeights
from workers.transports.exchange import IdentityExchange

log = get_logger("MultiStream")

#: The statistics a sparse block leaves for the next step (``[heads, 128]``, a rank its group's).
STATS_OPS = ("attention.kmean", "attention.vscale")
#: The ops each block traces, in block order (the first one whose digests differ is named).
TRACED_OPS = (
    "attn.qkv_proj",
    "attention",
    *STATS_OPS,
    "attn.out_proj",
    "mlp.fc1",
    "mlp.fc2",
    "block",
)


def due(sparse: SparseStepSettings | None, sigma: float | None, tokens: int, blocks: int) -> bool:
    """Whether a step of a prompt not yet verified is the one to verify, given its ``dit_step``
    ``sparse`` field: any step without sparse attention (not asked for, or it cannot run); with it,
    the first step that runs the kernel in some block, or one after which no step of the prompt can
    (the settings keep every block dense at this length, or ``sigma`` is below the window).  A step
    whose sigma is still above the window waits (sigmas fall while a prompt samples)."""
    if not sparse:
        return True
    cfg = sparse.config
    if all(dense_reason(cfg, None, tokens, i) is not None for i in range(blocks)):
        return True
    return sigma is None or sigma <= cfg.sigma_start


def rank_part(
    op: str, out: torch.Tensor, plan: plans.SplitPlan, r: int, heads: int, head_dim: int
) -> torch.Tensor:
    """The part of an unsplit op output that rank ``r`` computes: its head group's columns (qkv rows
    are laid out ``[q | k | v]`` of the group, as ``slice_qkv_weights`` makes them) or rows (the
    sparse statistics), or its token rows."""
    g0, g1 = plan.head_bounds[r], plan.head_bounds[r + 1]
    if op == "attn.qkv_proj":
        return torch.cat(
            [out[:, s.start : s.stop] for s in dit_ops.head_rows(g0, g1, heads, head_dim)], dim=1
        )
    if op == "attention":
        return out[:, g0 * head_dim : g1 * head_dim]
    if op in STATS_OPS:
        return out[g0:g1]
    return out[plan.token_bounds[r] : plan.token_bounds[r + 1]]


def _attend(options: SplitOptions) -> dit_ops.Attend:
    if options.comfy_host is not None:
        from workers.runtime.comfy_host import comfy_attend

        return comfy_attend(options.comfy_host)
    return dit_ops.builtin_attend(options.attention)


def unsplit_step(
    engine: EngineView, planned: PlannedStep, x: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, dict[tuple[int, str], str]]:
    """The step unsplit on ``device``, weights streamed block by block from the engine's store, with
    the ranks' sparse attention (``planned.sparse``) over every head from fresh statistics; returns
    the new residual stream and, per ``(rank, "block:op")``, the digest of the part that rank
    computes.  ``x``: the step's input as it was before the split step ran."""
    ld = engine.loaded
    assert ld is not None
    plan, step = planned.plan, planned.step
    cfg = ld.config
    n = len(ld.store.manifest)
    attend = _attend(engine.options)
    # a warm process, as the ranks are (see dit_ops.warm_up)
    dit_ops.warm_up(attend, device, [x.dtype])
    ref: dict[tuple[int, str], str] = {}

    def trace(i: int, op: str, out: torch.Tensor) -> None:
        for r in range(engine.ranks):
            ref[(r, f"{i}:{op}")] = invariance.digest(
                rank_part(op, out, plan, r, cfg.heads, cfg.head_dim)
            )

    weights = CpuWeights(
        lambda i: {k: v.to(device) for k, v in ld.store.block(i).items()},
        n,
        (0, cfg.heads),
        cfg.heads,
        cfg.head_dim,
        eager=False,
    )
    segs = [
        (int(a), int(b), row.to(device) if isinstance(row, torch.Tensor) else int(row))
        for a, b, row in step.mod_segments
    ]
    sparse = (
        sparse_step(planned.sparse, PooledStats(), (0, cfg.heads), segs) if planned.sparse else None
    )
    with torch.inference_mode():
        xr = x.to(device).clone()
        run_blocks(
            xr,
            BlockInputs(step.modulation.to(device), segs, step.rope_freqs.to(device)),
            RankBlocks(weights, IdentityExchange(), cfg.heads, cfg.head_dim, cfg.eps, attend),
            range(n),
            LoopPaths(sparse=sparse),
            LoopHooks(trace=trace),
        )
    return xr, ref


def first_difference(
    rank_traces: Sequence[dict],
    ref: dict[tuple[int, str], str],
    blocks: int,
    ops: Sequence[str] = TRACED_OPS,
) -> tuple[str, int] | None:
    """``("block i op", rank)`` of the first op of ``ops`` (block order, then op order, then rank)
    whose digests differ."""
    for i in range(blocks):
        for op in ops:
            for r, tr in enumerate(rank_traces):
                if tr.get(f"{i}:{op}") != ref.get((r, f"{i}:{op}")):
                    return f"block {i} {op}", r
    return None


def verify_step(engine: EngineView, planned: PlannedStep) -> torch.Tensor:
    """Run the split step (traced), then the unsplit one, compare, log and record; returns the split
    step's output. A failure of the unsplit run (e.g. out of memory on the model's device) is logged
    and the split result kept."""
    x0 = planned.step.x.detach().clone()
    if planned.sparse:  # the ranks start the step from fresh statistics, as the reference does
        engine.drop_sparse_stats()
    out = engine.run_planned(replace(planned, trace=True))
    device = torch.device(engine.devices[0])
    names = list(dict.fromkeys(fp["device"] for fp in engine.fingerprints)) or list(engine.devices)
    try:
        ref_out, ref = unsplit_step(engine, planned, x0, device)
    except Exception as exc:  # noqa: BLE001
        # verify is a check on the side; the split step's result stands
        log.warning(
            "verify: the unsplit run on %s failed (%s: %s); this prompt's step is not verified",
            device,
            type(exc).__name__,
            exc,
        )
        return out
    split_out = out.to(device)
    same = bool(torch.equal(split_out, ref_out))
    diff = 0.0 if same else float((split_out.float() - ref_out.float()).abs().max())
    blocks = len(engine.loaded.store.manifest) if engine.loaded else 0
    traces = [r.trace for r in engine.last_rank_results]
    stats = first_difference(traces, ref, blocks, STATS_OPS)
    exact = same and stats is None
    where = None if exact else first_difference(traces, ref, blocks)
    first = where[0] if where else None
    if exact:
        log.info(
            "verify: bit-exact on %s (split step equals the same step unsplit on %s, %d blocks)",
            ", ".join(names),
            device,
            blocks,
        )
    elif stats is not None:
        log.warning(
            "verify: the split step's output equals the same step unsplit on %s, but the sparse "
            "attention statistics it leaves for the next step differ: first at %s (rank %d, %s)",
            device,
            stats[0],
            stats[1],
            engine.devices[stats[1]],
        )
    else:
        at = (
            f"; first difference at {first} (rank {where[1]}, {engine.devices[where[1]]})"
            if where
            else ""
        )
        log.warning(
            "verify: the split step differs from the same step unsplit on %s: max abs difference "
            "%g%s",
            device,
            diff,
            at,
        )
    get_hub().record_verify(
        VerifyRecord(
            at=now_iso(),
            devices=names,
            bit_exact=exact,
            max_abs_diff=diff,
            first_difference=first,
            steps_checked=1,
        )
    )
    return out
