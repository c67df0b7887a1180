"""Split-vs-unsplit checks that use the shard sizes the engine accepts on this machine, never sizes that only happen
to be exact on the CPU the tests were written on.

A token split is exact only where every GEMM gives a row the same bits whatever the rows computed with it, a head
split only where attention gives a head the same bits whatever the other heads; kernel libraries choose by shape and
CPU.  So a check asks first: an in-process split (``SimulatedSplit``) asks the invariance probe
(``workers.dit.invariance``, what the engine measures before it uses a plan) about each rank's shard and head group;
an engine step asks the engine, which refuses a plan it cannot keep exact (``SplitUnsafe``: the caller runs that step
unsplit).  Whatever splits must equal the unsplit reference bit for bit; a check whose every plan was refused skips
with the refusal, so it never passes without having compared anything.
"""
from __future__ import annotations

import pytest
import torch

import os
from collections.abc import Callable, Iterator

import psutil

from h3ms_async.dit import exactness
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.layout import build_layout
from h3ms_async.dit.reference import ReferenceDiT, StepInputs, make_step_inputs
from h3ms_async.dit.errors import SplitUnsafe
from h3ms_async.dit.split import SplitEngine
from h3ms_async.runtime.plans import SplitPlan
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit.protocol import ProbeShard
from workers.runtime.shm import dtype_name


def probe_refusals(model: ReferenceDiT, plan: SplitPlan, dtype: torch.dtype,
                   attention: str = "sdpa") -> list[str]:
    """What the invariance probe finds inexact on this CPU for ``plan`` over ``model``'s blocks computed in
    ``dtype``; empty when every op gives the unsplit call's bits.  Every token shard is a candidate of one probe call
    (the token-split linears' full products are made once), and each rank's head group gets the head-split ops."""
    c = model.config
    ranks = len(plan.token_bounds) - 1
    if ranks == 1:
        return []
    blocks = [model.block_weights(i) for i in range(c.layers)]
    manifest = [{k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in b.items()} for b in blocks]
    ops = invariance.block_ops(manifest, lambda i: dit_ops.block_quant(blocks[i]))
    shards = list(zip(plan.token_bounds, plan.token_bounds[1:]))
    # every rank's head group, the token shards once (rank 0's candidates): each unsplit call made once
    asked = [ProbeShard(shards if r == 0 else [], (plan.head_bounds[r], plan.head_bounds[r + 1])) for r in range(ranks)]
    reports = invariance.run_probe(
        ops, tokens=plan.token_bounds[-1], shards=asked, total_heads=c.heads, head_dim=c.head_dim, dtype=dtype,
        attend=dit_ops.builtin_attend(attention), device=torch.device("cpu"))
    return [f"{v.op} ({v.dtype}, {v.shape}, {v.split} {shard}) max |diff| {d:g}"
            for report in reports for v in report.ops
            for ok, shard, d in zip(v.exact, v.shards, v.max_abs_diff) if not ok]


class Compared:
    """Counts what a check compared and why plans were refused; :meth:`done` skips a check that compared nothing."""

    def __init__(self) -> None:
        self.compared = 0
        self.refused: list[str] = []

    def equal(self, out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        assert out.dtype == ref.dtype and out.shape == ref.shape, what
        diff = (out.float() - ref.float()).abs().max().item()
        assert torch.equal(out, ref), f"{what}: split differs from unsplit (max |diff| {diff:g})"
        self.compared += 1

    def done(self) -> None:
        if not self.compared:
            pytest.skip(f"every plan of this check is refused on this machine, e.g. {self.refused[0]}")


def engine_step(engine: SplitEngine, model: ReferenceDiT, inp: StepInputs, seen: Compared, ref: torch.Tensor,
                what: str, **step_kw: object) -> None:
    """One engine step of ``model`` (whose modulation rows it gets) against ``ref``: a refused plan (``SplitUnsafe``)
    is the engine's verdict for this machine, and the engine must stay usable after it (the caller's next step
    runs)."""
    try:
        out = engine.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, **step_kw)
    except SplitUnsafe as exc:
        seen.refused.append(f"{what}: {exc}")
        return
    seen.equal(out, ref, what)


#: Tokens of :func:`fault_step`'s layout: two equal ranks hold 100 rows each.
FAULT_TOKENS = 200


def fault_step(eng: SplitEngine, model: ReferenceDiT, seed: int = 3, **step_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``(split, unsplit)``: one step of ``model`` on ``eng`` over a fixed 200-token layout (88 video tokens, 3 audio,
    4 text, ...), and the model's own step on the same inputs."""
    inp = make_step_inputs(model.config, build_layout(88, 3, 4, 6, 8, keyframes=1, sigma=0.7), seed, model.dtype)
    assert inp.x.shape[0] == FAULT_TOKENS
    ref = model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)
    return eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, **step_kw), ref


def fault_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., SplitEngine]]:
    """For a fixture (``yield from``): a maker of engines on two CPU ranks, each measuring its own plans, optionally
    with a shape fault (``workers.testing.faults.ShapeFault`` text) its workers read when they start; afterwards every
    engine released, no worker process and no shm segment of this process left."""
    made: list[SplitEngine] = []

    def make(fault: str | None = None, **opts) -> SplitEngine:
        if fault is not None:
            monkeypatch.setenv("H3MS_TEST_SHAPE_FAULT", fault)  # read by the workers when they start
        exactness.VERDICTS.clear()  # the verdict cache is per process: each test measures its own plans
        eng = SplitEngine(["cpu", "cpu"], SplitOptions(**opts))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.release()
    kids = [k for k in psutil.Process().children(recursive=True) if k.status() != psutil.STATUS_ZOMBIE]
    assert not kids
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"h3ms-{os.getpid()}-")]
