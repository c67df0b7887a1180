"""Where each block's time goes (workers/dit/block_clock.py): the four numbers per rank and block (compute, exchange
copy, the copy hidden behind compute, the exposed wait) from real CPU rank workers into the step records, and the
interval arithmetic the CUDA clock reads its events with."""
from __future__ import annotations

import msgspec
import pytest

from h3ms_async.dit.errors import SplitUnsafe
from h3ms_async.dit.layout import layout_for_tokens
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.split import SplitEngine
from h3ms_async.status.hub import get_hub
from h3ms_async.status.records import StepRecord
from workers.dit.block_clock import block_timings
from workers.dit.protocol import BlockTiming

CFG = DiTConfig(hidden=128, layers=3, heads=8, head_dim=32, ffn=192, t_dim=16, rope_pairs=12)


def real_step(engine: SplitEngine, seed: int = 1, **kw) -> dict:
    """One step of 300 tokens on ``engine``: its step record (the hub's JSON form)."""
    model = ReferenceDiT(CFG, weights="int8", seed=5)
    inp = make_step_inputs(CFG, layout_for_tokens(300), seed, model.dtype)
    try:
        engine.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, **kw)
    except SplitUnsafe as exc:
        pytest.skip(f"the engine refused this plan on this CPU: {exc}")
    return get_hub().recent_steps(1)[-1]


def started_engine() -> SplitEngine:
    """Two CPU rank workers with CFG's int8 weights loaded (the caller releases them)."""
    eng = SplitEngine(["cpu", "cpu"], SplitOptions())
    try:
        eng.load_weights(("bt", "int8", 5), CFG, ReferenceDiT(CFG, weights="int8", seed=5).block_weights)
    except BaseException:
        eng.release()
        raise
    return eng


def recorded_cpu_step(**kw) -> dict:
    """The step record of one real step on two CPU rank workers."""
    eng = started_engine()
    try:
        return real_step(eng, **kw)
    finally:
        eng.release()


@pytest.fixture(scope="module")
def cpu_engine():
    eng = started_engine()
    try:
        yield eng
    finally:
        eng.release()


@pytest.mark.parametrize("kw", [{}, {"exchange_chunks": 4}, {"head_pieces": 2}, {"gather_overlap": True},
                                {"exchange": "nccl"}], ids=["host", "host-x4", "pieces2", "gather", "gloo"])
def test_records_carry_where_each_blocks_time_went(cpu_engine, kw):
    rec = real_step(cpu_engine, **kw)
    typed = msgspec.convert(rec, StepRecord)  # validated: one timing per block, hidden <= copy
    assert typed.blocks == CFG.layers and len(typed.ranks) == 2
    for r, raw in zip(typed.ranks, cpu_engine.last_rank_results):
        assert r.per_block == raw.per_block and len(r.per_block) == CFG.layers
        # the blocks tile the rank's block loop: compute + exposed per block add up to the loop's span (the rank's
        # wall less its set-up and tail, whose ends are read a few statements around the loop)
        loop_s = raw.wall_s - raw.setup_s - raw.tail_s
        blocks_s = sum(b.compute_s + b.exposed_s for b in r.per_block)
        assert blocks_s == pytest.approx(loop_s, rel=0.05, abs=0.003), (r.per_block, raw)
        for b in r.per_block:
            assert b.compute_s > 0 and b.copy_s > 0, b  # two ranks: every block moves rows
            # a CPU rank copies on its compute thread: nothing is hidden, every copy is exposed
            assert b.hidden_s == 0 and b.exposed_s >= b.copy_s - 2e-6, b
    # the step's exchange seconds are the blocks' ones (plus what runs outside the blocks)
    for r in typed.ranks:
        assert sum(b.copy_s for b in r.per_block) <= r.exchange_s + 1e-5


def test_cuda_timeline_to_block_timings():
    """The CUDA clock's arithmetic on a hand-drawn timeline (seconds): block 0 spans 0-10 with one exchange window
    2-6 in which compute (a head piece) runs 3-4, its copies on the copy streams 2-5 and 3.5-8; block 1 spans 10-14,
    a window 12-14 with a copy 12-13 and nothing computing."""
    got = block_timings(
        [0.0, 10.0, 14.0],
        windows=[(0, 2.0, 6.0), (1, 12.0, 14.0)],
        busy=[(0, 3.0, 4.0)],
        copies=[(0, 2.0, 5.0), (0, 3.5, 8.0), (1, 12.0, 13.0)])
    # block 0: idle 2-3 and 4-6 (3 s exposed), compute 7 s; copy 3 + 4.5 s, hidden where compute ran:
    # 2-5 meets 3-4 (1 s), 3.5-8 meets 3.5-4 and 6-8 (2.5 s)
    assert got[0] == BlockTiming(compute_s=7.0, copy_s=7.5, hidden_s=3.5, exposed_s=3.0)
    assert got[1] == BlockTiming(compute_s=2.0, copy_s=1.0, hidden_s=0.0, exposed_s=2.0)
    # overlapping windows count once; a copy longer than the compute it hides behind is capped at its length
    assert block_timings([0.0, 4.0], [(0, 1.0, 3.0), (0, 2.0, 3.0)], [], [(0, 0.0, 4.0)]) == [
        BlockTiming(compute_s=2.0, copy_s=4.0, hidden_s=2.0, exposed_s=2.0)]


def test_a_timing_refuses_more_hidden_than_copied():
    with pytest.raises(msgspec.ValidationError, match="hidden_s 0.2 exceeds copy_s 0.1"):
        msgspec.convert({"compute_s": 1.0, "copy_s": 0.1, "hidden_s": 0.2, "exposed_s": 0.0}, BlockTiming)
    with pytest.raises(ValueError, match="exceeds copy_s"):
        BlockTiming(compute_s=1.0, copy_s=0.0, hidden_s=0.1, exposed_s=0.0)
