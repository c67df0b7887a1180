"""The opt-in ``verify`` setting: a prompt's first split step, run again unsplit on the model's
device and compared.

The split step runs as usual, with the ranks digesting every op's output rows (``DitStep.trace``).
Then the same step runs unsplit on rank 0's device, block by block through the same block loop
(``workers.dit.loop``), each block's weights read from the shared-memory weight store and moved
there one block at a time (so the whole model never has to fit), digesting the same rows of the same
ops.  The answer is ``torch.equal`` on the step's output; the digests only name the first block and
op that differ.  The result is logged ("bit-exact on <devices>" or the max difference and where) and
recorded in the status document (``exactness.verify``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from h3ms_async.log import get_logger
from h3ms_async.observability.records import VerifyRecord, now_iso
from h3ms_async.observability.status import get_hub
from h3ms_async.runtime import plans
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit.loop import run_blocks
from workers.dit.weights import CpuWeights
from workers.transports.exchange import IdentityExchange

#: ``h3ms_async.dit.split.SplitEngine`` (which calls this module; typed loosely so the import points
#: one way).
Engine = Any

log = get_logger("MultiStream")

#: The ops each block traces, in block order (the first one whose digests differ is named).
TRACED_OPS = ("attn.qkv_proj", "attention", "attn.out_proj", "mlp.fc1", "mlp.fc2", "block")


def rank_part(
    op: str, out: torch.Tensor, plan: plans.SplitPlan, r: int, heads: int, head_dim: int
) -> torch.Tensor:
    """The part of an unsplit op output that rank ``r`` computes: its head group's columns (qkv rows
    are laid out ``[q | k | v]`` of the group, as ``slice_qkv_weights`` makes them) or its token
    rows."""
    g0, g1 = plan.head_bounds[r], plan.head_bounds[r + 1]
    if op == "attn.qkv_proj":
        return torch.cat(
            [out[:, s.start : s.stop] for s in dit_ops.head_rows(g0, g1, heads, head_dim)], dim=1
        )
    if op == "attention":
        return out[:, g0 * head_dim : g1 * head_dim]
    return out[plan.token_bounds[r] : plan.token_bounds[r + 1]]


def _attend(options: Any) -> dit_ops.Attend:
    if options.comfy_host is not None:
        from workers.runtime.comfy_host import comfy_attend

        return comfy_attend(options.comfy_host)
    return dit_ops.builtin_attend(options.attention)


def unsplit_step(
    engine: Engine,
    plan: plans.SplitPlan,
    x: torch.Tensor,
    t_emb: torch.Tensor,
    mod_segments: Sequence[tuple],
    rope_freqs: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, dict[tuple[int, str], str]]:
    """The step unsplit on ``device``, weights streamed block by block from the engine's store;
    returns the new residual stream and, per ``(rank, "block:op")``, the digest of the part that
    rank computes."""
    ld = engine._loaded
    assert ld is not None
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
        for a, b, row in mod_segments
    ]
    with torch.inference_mode():
        xr = x.to(device).clone()
        run_blocks(
            xr,
            t_emb.to(device),
            segs,
            rope_freqs.to(device),
            weights,
            IdentityExchange(),
            range(n),
            heads_local=cfg.heads,
            head_dim=cfg.head_dim,
            eps=cfg.eps,
            attend=attend,
            trace=trace,
        )
    return xr, ref


def first_difference(
    rank_traces: Sequence[dict], ref: dict[tuple[int, str], str], blocks: int
) -> tuple[str, int] | None:
    """``("block i op", rank)`` of the first op (block order, then op order, then rank) whose
    digests differ."""
    for i in range(blocks):
        for op in TRACED_OPS:
            for r, tr in enumerate(rank_traces):
                if tr.get(f"{i}:{op}") != ref.get((r, f"{i}:{op}")):
                    return f"block {i} {op}", r
    return None


def verify_step(
    engine: Engine,
    plan: plans.SplitPlan,
    opts: Any,
    x: torch.Tensor,
    t_emb: torch.Tensor,
    mod_segments: Sequence[tuple],
    rope_freqs: torch.Tensor,
    interrupt: Callable[[], bool] | None,
    sigma: float | None,
    progress: Callable[[int, int], None] | None,
    in_place: bool,
) -> torch.Tensor:
    """Run the split step (traced), then the unsplit one, compare, log and record; returns the split
    step's output. A failure of the unsplit run (e.g. out of memory on the model's device) is logged
    and the split result kept."""
    x0 = x.detach().clone()
    out = engine._step(
        plan,
        opts,
        x,
        t_emb,
        mod_segments,
        rope_freqs,
        interrupt,
        sigma,
        progress,
        in_place,
        trace=True,
    )
    device = torch.device(engine.devices[0])
    names = list(dict.fromkeys(fp["device"] for fp in engine._fingerprints)) or list(engine.devices)
    try:
        ref_out, ref = unsplit_step(engine, plan, x0, t_emb, mod_segments, rope_freqs, device)
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
    exact = bool(torch.equal(split_out, ref_out))
    diff = 0.0 if exact else float((split_out.float() - ref_out.float()).abs().max())
    blocks = len(engine._loaded.store.manifest) if engine._loaded else 0
    traces = [r.trace for r in engine.last_rank_results]
    where = None if exact else first_difference(traces, ref, blocks)
    first = where[0] if where else None
    if exact:
        log.info(
            "verify: bit-exact on %s (split step equals the same step unsplit on %s, %d blocks)",
            ", ".join(names),
            device,
            blocks,
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
