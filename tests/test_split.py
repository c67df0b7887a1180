"""The transformer split on real CPU rank workers: bit-exact against the unsplit reference, errors, faults.

Every comparison is ``torch.equal`` over at least two steps with different inputs, so nothing stale from one step
(arena contents, sequence words, cached buffers) can survive into the next unnoticed.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import psutil
import pytest
import torch

from h3ms_async.dit.layout import build_layout, layout_for_tokens
from h3ms_async.runtime.plans import GPUSelectionError
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.errors import SplitError, SplitInterrupted, SplitUnsafe
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.split import SplitEngine
from h3ms_async.dit.pattern import pick_pattern
from workers.dit.protocol import Transport
from workers.runtime.shm import held_shm

from split_checks import Compared, engine_step
from split_proof import dit_step_failure

CFG = DiTConfig(hidden=128, layers=2, heads=8, head_dim=32, ffn=192, t_dim=16, rope_pairs=12)
CFG_UNEVEN = DiTConfig(hidden=160, layers=2, heads=10, head_dim=32, ffn=224, t_dim=16, rope_pairs=12)
TEXT_TAGS = [1, 1, 0, 0, 1, 1, 1, 0, 1]


def _layouts():
    """Two steps of differently shaped realistic layouts: text-tag runs, a keyframe (cond + cond audio), audio, video."""
    return [build_layout(9, 3, 4, 6, 8, keyframes=1, text_tags=TEXT_TAGS, sigma=0.7),
            build_layout(9, 3, 4, 6, 8, keyframes=1, text_tags=TEXT_TAGS, sigma=0.4)]


def _reference(model: ReferenceDiT, inp) -> torch.Tensor:
    return model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)


def _check_exact(engine: SplitEngine, model: ReferenceDiT, layouts, seen: Compared, *, seed=10,
                 **step_kw) -> None:
    """Each layout's step on the engine against the unsplit reference, where the engine accepts its plan here
    (split_checks: a refusal is counted in ``seen``, whose ``done()`` ends the test)."""
    for s, lay in enumerate(layouts):
        inp = make_step_inputs(model.config, lay, seed + s, model.dtype)
        engine_step(engine, model, inp, seen, _reference(model, inp), f"{model.weights} step {s} {step_kw}", **step_kw)


def _no_workers_alive() -> bool:
    kids = psutil.Process().children(recursive=True)
    return not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def int8_model():
    return ReferenceDiT(CFG, weights="int8", seed=5)


@pytest.fixture
def engine_factory():
    made: list[SplitEngine] = []

    def make(devices, **opts) -> SplitEngine:
        eng = SplitEngine(devices, SplitOptions(**opts))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.release()
    assert _no_workers_alive()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"h3ms-{os.getpid()}-")]


# the second CPU pass (scripts/h3ms.sh) takes one rank count: tests/test_dit_shards.py covers the others in-process
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.exactness), 5, 8])
def test_rank_counts_int8_exact(engine_factory, int8_model, ranks):
    seen = Compared()
    eng = engine_factory(["cpu"] * ranks)
    eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    _check_exact(eng, int8_model, _layouts(), seen)
    seen.done()


@pytest.mark.exactness
def test_three_ranks_chunks_and_weights(engine_factory, int8_model):
    """3 ranks: exchange_chunks 0, 1 and 8 (more chunks than some ranks' rows for the small layout), then fp32 and
    bf16 weights on the same workers (the store is refilled for the new key)."""
    seen = Compared()
    eng = engine_factory(["cpu"] * 3)
    eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    for chunks in (0, 1, 8):
        _check_exact(eng, int8_model, _layouts(), seen, exchange_chunks=chunks)
    # a long sequence so that 8 chunks are real pipelining
    _check_exact(eng, int8_model, [layout_for_tokens(700), layout_for_tokens(650)], seen, exchange_chunks=8)
    for kind in ("fp32", "bf16"):
        model = ReferenceDiT(CFG, weights=kind, seed=6)
        assert eng.load_weights(("t", kind, 6), CFG, model.block_weights)
        _check_exact(eng, model, _layouts(), seen, exchange_chunks=4)
    seen.done()


def test_shares_and_uneven_heads(engine_factory):
    """Shares 1,1,0.7 over 10 heads: head groups 4/4/2 and token ranges by the same shares."""
    seen = Compared()
    model = ReferenceDiT(CFG_UNEVEN, weights="int8", seed=7)
    eng = engine_factory(["cpu"] * 3, shares=(1.0, 1.0, 0.7))
    eng.load_weights(("t", "uneven"), CFG_UNEVEN, model.block_weights)
    _check_exact(eng, model, _layouts(), seen, exchange_chunks=2)
    seen.done()
    from h3ms_async.status.hub import get_hub
    heads = [r["heads"] for r in get_hub().recent_steps(1)[0]["ranks"]]
    assert heads == [[0, 4], [4, 8], [8, 10]]


def test_overlaps_uneven_groups_host_and_gloo(engine_factory):
    """Attention in 3 head pieces over head groups 4/4/2 (the 2-head group has an empty piece) and the qkv
    projection on each rank's rows as they arrive, through the host arena and over gloo (in one collective each):
    the unsplit output either way."""
    seen = Compared()
    model = ReferenceDiT(CFG_UNEVEN, weights="int8", seed=7)
    # one set of workers started for gloo: the exchange is a per-step setting (the host arena is always there)
    eng = engine_factory(["cpu"] * 3, shares=(1.0, 1.0, 0.7), exchange="nccl", head_pieces=3, gather_overlap=True)
    eng.load_weights(("t", "uneven"), CFG_UNEVEN, model.block_weights)
    for exchange in ("host", "nccl"):
        _check_exact(eng, model, _layouts(), seen, exchange=exchange)
    seen.done()


def test_ulysses_pattern_host_and_gloo(engine_factory):
    """The Ulysses pattern (every rank projects every head for its tokens, then an all-to-all of q, k, v) over
    uneven shares, host exchange chunked, and gloo: the unsplit output; "auto" picks it only where the speed model
    predicts it faster (tests/test_bench_model.py)."""
    from h3ms_async.status.hub import get_hub
    seen = Compared()
    model = ReferenceDiT(CFG_UNEVEN, weights="int8", seed=7)
    eng = engine_factory(["cpu"] * 3, shares=(1.0, 1.0, 0.7), exchange="nccl", pattern="ulysses")
    eng.load_weights(("t", "uneven"), CFG_UNEVEN, model.block_weights)
    for kw in ({"exchange": "host", "exchange_chunks": 3}, {}):
        _check_exact(eng, model, _layouts(), seen, **kw)
        assert get_hub().recent_steps(1)[0]["pattern"] == "ulysses"
    seen.done()
    with pytest.raises(ValueError, match="sparse attention runs with the all-gather pattern"):
        SplitOptions(pattern="ulysses", sparse=object())
    assert pick_pattern(SplitOptions(pattern="auto"), ["cpu"] * 2, Transport.HOST, CFG_UNEVEN) == "gather"


def test_ulysses_pattern_in_head_pieces_host_and_gloo(engine_factory):
    """The Ulysses pattern with attention in head pieces: q, k and v move in each rank's head pieces, each piece
    is normed, roped and attended as soon as it is here and its output moves back piece by piece (3 ranks of uneven
    shares, 4 + 4 + 2 heads, in 3 and in 5 pieces: the 2-head rank's extra pieces are empty; host exchange, with
    exchange_chunks, which this op does not use, and without; gloo): the unsplit output, recorded as the Ulysses
    pattern in that many pieces, and over the host exchange two chunks (a doorbell to each peer) per piece, its
    q/k/v and its output; verify finds every op's output (the pieces' q, k, v and attention put together) equal to
    the unsplit run's."""
    from h3ms_async.status.hub import get_hub
    seen = Compared()
    model = ReferenceDiT(CFG_UNEVEN, weights="int8", seed=7)
    # verify is an engine setting, the rest per step: the workers started for gloo also run the host-exchange steps
    verifying = engine_factory(["cpu"] * 3, shares=(1.0, 1.0, 0.7), exchange="host", pattern="ulysses", verify=True)
    plain = engine_factory(["cpu"] * 3, shares=(1.0, 1.0, 0.7), exchange="nccl", pattern="ulysses")
    runs = ((verifying, "host", {"head_pieces": 3, "exchange_chunks": 2}), (plain, "host", {"head_pieces": 5}),
            (plain, "nccl", {"head_pieces": 2}))
    for eng in (verifying, plain):
        eng.load_weights(("t", "uneven"), CFG_UNEVEN, model.block_weights)
    for eng, exchange, kw in runs:
        _check_exact(eng, model, _layouts(), seen, exchange=exchange, **kw)
        if eng is verifying:  # each op's output as the pieces put it together, against the unsplit run's
            verified = get_hub().status()["exactness"]["verify"][-1]
            assert verified["bit_exact"] and verified["first_difference"] is None, verified
        rec = get_hub().recent_steps(1)[0]
        assert (rec["pattern"], rec["head_pieces"]) == ("ulysses", kw["head_pieces"]), rec
        if exchange == "host":
            # a doorbell to each peer per chunk, and one per block where a rank comes to the block's op before a peer
            # has left the last one's (the buffers' reuse guard: each block's op writes the same two)
            chunks = 1 + CFG_UNEVEN.layers * 2 * kw["head_pieces"]
            signals = [r.signals for r in eng.last_rank_results]
            assert all(2 * chunks <= s <= 2 * (chunks + CFG_UNEVEN.layers) for s in signals), signals
    seen.done()


def test_gloo_exchange_matches_host(engine_factory, int8_model):
    """exchange=nccl on CPU ranks runs torch.distributed over gloo: same bits as host, 2 and 4 ranks."""
    seen = Compared()
    for ranks in (2, 4):
        eng = engine_factory(["cpu"] * ranks, exchange="nccl")
        assert eng.transport == "gloo"
        eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
        _check_exact(eng, int8_model, _layouts(), seen)
        _check_exact(eng, int8_model, _layouts(), seen, exchange="host", exchange_chunks=3)
    seen.done()


def test_the_no_exchange_baseline_starts_every_rank_together(engine_factory, int8_model, monkeypatch):
    """The no-exchange baseline (``exchange="none"``, what ``bench gpu`` and ``bench model --validate`` divide by)
    gives its ranks one start instant past their setups: each waits for it, outside its wall, so the ranks share
    their device for the whole step as a split's ranks do instead of drifting apart. A step that exchanges (its
    ranks meet at every exchange) gets none."""
    from h3ms_async.dit import split as split_mod
    from h3ms_async.dit.errors import SplitUnsafe
    monkeypatch.setattr(split_mod, "BASELINE_START_LEAD_S", 1.0)  # far past a tiny step's setup, even on a busy box
    eng = engine_factory(["cpu"] * 2)
    eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    inp = make_step_inputs(CFG, _layouts()[0], 7, int8_model.dtype)
    try:
        eng.run_blocks(inp.x.clone(), int8_model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    except SplitUnsafe:
        pytest.skip("this machine refuses the tiny plan (measured), so no split step runs here")
    assert [r.start_wait_s for r in eng.last_rank_results] == [0.0, 0.0]
    t = time.monotonic()
    eng.run_blocks(inp.x.clone(), int8_model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, exchange="none")
    took = time.monotonic() - t
    waits = [r.start_wait_s for r in eng.last_rank_results]
    assert all(0 < w < 1.1 for w in waits), waits  # the sleep each had, which a busy machine stretches a little
    assert all(r.wall_s + w <= took for r, w in zip(eng.last_rank_results, waits))  # the wall leaves the wait out


def test_bad_plans_fail_before_workers_start(int8_model):
    with pytest.raises(GPUSelectionError, match="attention heads"):
        SplitEngine(["cpu"] * 9).load_weights(("t",), CFG, int8_model.block_weights)
    with pytest.raises(GPUSelectionError, match="shares"):
        SplitEngine(["cpu"] * 3, SplitOptions(shares=(1.0, 1.0)))
    with pytest.raises(ValueError, match="exchange_chunks"):
        SplitOptions(exchange_chunks=33)
    with pytest.raises(ValueError, match="head_pieces=17 must be between 0 and 16"):
        SplitOptions(head_pieces=17)
    with pytest.raises(ValueError, match="nccl"):
        SplitEngine(["cuda:0", "cuda:0"], SplitOptions(exchange="nccl"))
    assert _no_workers_alive()


def test_fewer_tokens_than_ranks(engine_factory, int8_model):
    eng = engine_factory(["cpu"] * 4)
    eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    inp = make_step_inputs(CFG, _layouts()[0], 1, torch.bfloat16)
    three = [(0, 3, inp.segments[0][2])]
    with pytest.raises(GPUSelectionError, match="cannot split 3 tokens across 4"):
        eng.run_blocks(inp.x[:3], int8_model.modulation(inp.t_emb), three, inp.rope_freqs[:, :3])
    # 12 tokens: one rank gets 3 rows, which the old fixed rule (MIN_SHARD_TOKENS, now a prior) refused; the engine
    # measures it on the ranks instead and runs it split only where those shapes are exact on this CPU
    twelve = [(0, 12, inp.segments[0][2])]
    ref = int8_model.forward_blocks(inp.x[:12].clone(), inp.t_emb, twelve, inp.rope_freqs[:, :12])
    try:
        out = eng.run_blocks(inp.x[:12], int8_model.modulation(inp.t_emb), twelve, inp.rope_freqs[:, :12])
    except SplitUnsafe as exc:
        assert "3-row shard" in str(exc) and "cpu " in str(exc)
    else:
        assert torch.equal(out, ref)
        from h3ms_async.status.hub import get_hub
        assert [r["tokens"][1] - r["tokens"][0] for r in get_hub().recent_steps(1)[0]["ranks"]] == [3, 3, 3, 3]


def test_workers_start_while_the_store_fills(engine_factory, int8_model):
    """The workers' start overlaps the weight-store fill: the last block is read only once every worker is up (the
    reader waits for them; were the start queued after the fill, it would wait out its deadline), and the load's
    phases say so. A second load of the same key fills nothing."""
    eng = engine_factory(["cpu"] * 2)
    seen_up = []

    def read(i: int):
        if i == CFG.layers - 1:
            deadline = time.monotonic() + 60
            while not eng.pool.running and time.monotonic() < deadline:
                time.sleep(0.02)
            seen_up.append(eng.pool.running and all(p is not None for p in eng.pool.worker_pids()))
        return int8_model.block_weights(i)

    assert eng.load_weights(("t", "int8", 5), CFG, read)
    assert seen_up == [True]
    load = eng.last_load
    assert load is not None and load.fill_bytes > 0 and load.workers_start_s > 0
    assert load.fill_s >= load.workers_start_s  # the fill waited for the start inside the reader
    assert load.start_wait_s < load.workers_start_s
    assert not eng.load_weights(("t", "int8", 5), CFG, read)  # nothing refilled, nothing restarted
    assert eng.last_load is load


def test_a_patch_change_rewrites_the_patched_tensors_in_place(engine_factory):
    """A key that differs from the held one in its patches only (``PatchedKey``) rewrites just the tensors of the
    patched modules of both patch sets, keeping the store segment and the workers, and the step then equals the same
    weights filled anew; a patch set that would change the blocks' layout is filled anew, saying why."""
    from h3ms_async.runtime.weight_store import PatchedKey
    model = ReferenceDiT(CFG, weights="fp32", seed=4)
    eng = engine_factory(["cpu"] * 2)

    def patched(scale: float, dtype=torch.float32):
        def read(i: int):
            w = model.block_weights(i)
            if scale != 1.0 or dtype != torch.float32:
                w["attn.qkv_proj.weight"] = (w["attn.qkv_proj.weight"] * scale).to(dtype)
            return w
        return read

    def key(patch: str) -> PatchedKey:
        touched = frozenset((i, "attn.qkv_proj.weight") for i in range(CFG.layers)) if patch else frozenset()
        return PatchedKey(("t", "patch"), patch, touched)

    inp = make_step_inputs(CFG, _layouts()[0], 6, model.dtype)
    step = (inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    assert eng.load_weights(key("a"), CFG, patched(1.5))
    segment, pids = eng.loaded.store.segment.name, eng.pool.worker_pids()
    eng.run_blocks(*step)
    qkv_bytes = CFG.layers * 3 * CFG.heads * CFG.head_dim * CFG.hidden * 4
    outs = {}
    for patch, scale in (("b", 0.5), ("", 1.0)):
        assert eng.load_weights(key(patch), CFG, patched(scale))
        refill = eng.last_load.refill
        assert refill is not None and eng.last_load.full_because is None, eng.last_load.line()
        assert refill.store.blocks == tuple((i, ("attn.qkv_proj.weight",)) for i in range(CFG.layers))
        assert refill.store.bytes == qkv_bytes and refill.ranks_bytes > 0, eng.last_load.line()
        assert eng.loaded.store.segment.name == segment and eng.pool.worker_pids() == pids
        outs[patch] = eng.run_blocks(*step)
        eng.release_weights()  # the same weights filled anew
        assert eng.load_weights(key(patch), CFG, patched(scale)) and eng.last_load.refill is None
        assert torch.equal(eng.run_blocks(*step), outs[patch]), patch
        segment = eng.loaded.store.segment.name
    assert not torch.equal(outs["b"], outs[""])
    assert eng.load_weights(key("c"), CFG, patched(2.0, torch.bfloat16))  # the qkv weight's dtype changes
    assert eng.last_load.refill is None and "layout" in eng.last_load.full_because, eng.last_load.line()
    assert eng.loaded.store.segment.name != segment and "full refill" in eng.last_load.line()
    assert eng.loaded.store.block(0)["attn.qkv_proj.weight"].dtype == torch.bfloat16


def _holders(segment: str, pids) -> list[int]:
    """Which of ``pids`` map or hold the shm segment ``segment`` (an unnamed tmpfs file: found by its inode)."""
    ino = int(segment.split("-")[2][8:], 16)
    return [pid for pid in pids if any(h.startswith(f"/dev/shm/#{ino} ") for h in held_shm(pid))]


def _wait(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.02)


def test_the_first_steps_plan_is_probed_while_the_store_fills(engine_factory, int8_model, monkeypatch, tmp_path):
    """Given the first step at the load, its plan is probed on the ranks beside the fill: the last block is read only
    once the probe's verdict is in (were the probe run after the fill, or at the step, it would start after the
    fill's end), and the step then finds the verdict without a probe round trip.  A second load, in a process that
    measured nothing yet but reads the verdict file, probes nothing at all."""
    from h3ms_async.dit import exactness
    from h3ms_async.dit.step import Step
    monkeypatch.setenv("H3MS_INVARIANCE_CACHE", str(tmp_path / "verdicts.json"))
    exactness.VERDICTS.clear()
    eng = engine_factory(["cpu"] * 2)
    inp = make_step_inputs(CFG, _layouts()[0], 3, int8_model.dtype)

    def read(i: int):
        if i == CFG.layers - 1:
            _wait((tmp_path / "verdicts.json").exists, "the plan probe's verdict", 60)
            time.sleep(0.3)  # the probe's own end (its verdict is stored last thing before it returns)
        return int8_model.block_weights(i)

    step = Step(inp.x.clone(), int8_model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    assert eng.load_weights(("t", "ahead"), CFG, read, first_step=step)
    load = eng.last_load
    assert load.probe is not None and load.probe.probed, load.line()
    assert 0 < load.probe.start_s < load.probe.end_s < load.fill_end_s, load.line()
    assert load.probe_overlapped and "plan probe" in load.line() and "beside the fill" in load.line()
    rounds = eng.probe.rounds
    assert rounds >= 1
    try:
        out = eng.run_step(step)
    except SplitUnsafe:
        out = None  # refused here as measured: the step runs unsplit in the caller
    assert eng.probe.rounds == rounds, "the first step probed its plan again"
    if out is not None:
        assert torch.equal(out, _reference(int8_model, inp))

    eng.release_weights()
    exactness.VERDICTS.clear()  # as in a new process: only the verdict file knows the plan
    assert eng.load_weights(("t", "ahead", 2), CFG, int8_model.block_weights, first_step=step)
    assert eng.last_load.probe is not None and not eng.last_load.probe.probed
    assert eng.probe.rounds == rounds and "verdict was known" in eng.last_load.line()


def test_the_ranks_take_each_block_in_while_the_store_fills(engine_factory):
    """A rank takes a block in once it is complete, not after the whole fill: the last block is read only once every
    rank maps the store (its load request is in), and the ranks' first block was in before the fill ended."""
    cfg = replace(CFG, layers=4)
    model = ReferenceDiT(cfg, weights="bf16", seed=3)
    eng = engine_factory(["cpu"] * 2)

    def read(i: int):
        if i == cfg.layers - 1:
            store = eng.loaded.store.segment.name
            _wait(lambda: eng.pool.running and len(_holders(store, eng.pool.worker_pids())) == eng.ranks,
                  "every rank mapping the store")
            time.sleep(0.5)
        return model.block_weights(i)

    assert eng.load_weights(("t", "blocks"), cfg, read)
    load = eng.last_load
    assert load.ranks_first_block_s is not None and load.ranks_last_block_s is not None, load.line()
    assert load.ranks_first_block_s < load.fill_end_s <= load.ranks_last_block_s, load.line()
    assert "first block taken in at" in load.line()
    inp = make_step_inputs(cfg, _layouts()[1], 4, model.dtype)
    seen = Compared()
    engine_step(eng, model, inp, seen, _reference(model, inp), "blocks taken in during the fill")
    seen.done()


@pytest.mark.parametrize("ranks_waiting", [True, False], ids=["ranks-waiting", "workers-starting"])
def test_a_fill_that_fails_midway_stops_every_ranks_load(engine_factory, int8_model, ranks_waiting):
    """A reader that raises midway fails the load with its own error, after every rank stopped its load with one line
    saying the fill failed (at once, not at a deadline); the store is mapped by no process after, and the next load
    works on the same workers."""
    eng = engine_factory(["cpu"] * 2)
    seen = []

    def read(i: int):
        if i == 0:  # sizes the store
            return int8_model.block_weights(i)
        store = eng.loaded.store.segment.name
        seen.append(store)
        if ranks_waiting:
            _wait(lambda: eng.pool.running and len(_holders(store, eng.pool.worker_pids())) == eng.ranks,
                  "every rank mapping the store")
        raise RuntimeError(f"checkpoint read failed at block {i}")

    t = time.monotonic()
    with pytest.raises(RuntimeError, match="checkpoint read failed at block 1"):
        eng.load_weights(("t", "broken"), CFG, read)
    assert time.monotonic() - t < 60
    assert eng.loaded is None and eng.pool.running
    pids = eng.pool.worker_pids()
    assert _holders(seen[0], [os.getpid(), *pids]) == [], (os.getpid(), pids)
    if ranks_waiting:
        for w in eng.pool.snapshot():
            with open(w["log"]) as fh:
                assert "the weight store's fill failed before block 1 of 2" in fh.read(), w["log"]
    assert eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    assert eng.pool.worker_pids() == pids
    inp = make_step_inputs(CFG, _layouts()[0], 7, int8_model.dtype)
    cmp = Compared()
    engine_step(eng, int8_model, inp, cmp, _reference(int8_model, inp), "after a failed fill")
    cmp.done()


def test_a_refused_store_starts_no_workers(engine_factory, int8_model):
    """The workers start only once the store passed its RAM check: a refused fill leaves nothing running."""
    from h3ms_async.runtime.weight_store import WeightStoreRefused
    eng = engine_factory(["cpu"] * 2, cache_ram_reserve_gb=1e6)
    with pytest.raises(WeightStoreRefused, match="cache_ram_reserve_gb=1e"):
        eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    assert not eng.pool.running and _no_workers_alive()


def test_the_filled_store_outlives_a_new_plan_and_a_new_gpu_set(int8_model):
    """A load for another plan of the same weights keeps the filled store and only reloads the ranks: another pattern
    on the same workers, then (``get_engine``) another GPU set with shares, whose new engine takes the store the old
    one hands over as its workers stop. Neither reads a block, each step equals the unsplit output, and the load says
    it kept the store. Other weights fill anew and unlink the old store; an engine that cannot be made releases the
    store handed to it; nothing is left."""
    from h3ms_async.dit.split import engines, get_engine, release_all_engines

    reads: list[int] = []

    def reader(i: int) -> dict:
        reads.append(i)
        return int8_model.block_weights(i)

    seen = Compared()
    key = ("t", "int8", 5)
    try:
        eng = get_engine(["cpu"] * 2, SplitOptions())
        assert eng.load_weights(key, CFG, reader)
        filled, name = len(reads), eng.loaded.store.segment.name
        assert filled == CFG.layers and eng.last_load.kept_bytes == 0
        _check_exact(eng, int8_model, _layouts()[:1], seen)
        pids = [w["pid"] for w in eng.pool.snapshot()]

        assert get_engine(["cpu"] * 2, SplitOptions(pattern="ulysses")) is eng  # same workers
        assert eng.load_weights(key, CFG, reader)
        assert len(reads) == filled and eng.loaded.store.segment.name == name and eng.loaded.pattern == "ulysses"
        assert eng.last_load.fill_bytes == 0 and eng.last_load.kept_bytes == eng.loaded.store.nbytes > 0
        assert "kept from the last plan (no fill)" in eng.last_load.line()
        _check_exact(eng, int8_model, _layouts()[:1], seen)
        assert [w["pid"] for w in eng.pool.snapshot()] == pids

        three = get_engine(["cpu"] * 3, SplitOptions(shares=(1.0, 2.0, 1.0)))
        assert three is not eng and not eng.pool.running and eng.loaded is None
        assert three.load_weights(key, CFG, reader)
        assert len(reads) == filled and three.loaded.store.segment.name == name and three.last_load.fill_bytes == 0
        _check_exact(three, int8_model, _layouts(), seen)
        holders = [os.getpid()] + [w["pid"] for w in three.pool.snapshot()]
        assert _holders(name, holders) == holders  # the new ranks map the store this process kept

        other = ReferenceDiT(CFG, weights="int8", seed=6)
        assert three.load_weights(("t", "int8", 6), CFG, other.block_weights)
        assert three.last_load.kept_bytes == 0 and _holders(name, holders) == []
        name = three.loaded.store.segment.name
        with pytest.raises(GPUSelectionError, match="shares"):
            get_engine(["cpu"] * 2, SplitOptions(shares=(1.0, 1.0, 1.0)))
        assert engines() == [] and _holders(name, [os.getpid()]) == []
    finally:
        release_all_engines()
    seen.done()
    assert _no_workers_alive() and held_shm(os.getpid()) == set()


BIG = DiTConfig(hidden=384, layers=8, heads=8, head_dim=48, ffn=1024, t_dim=32, rope_pairs=12)


@pytest.fixture(scope="module")
def big_model():
    # bf16: these tests time kills and interrupts, and int8 GEMMs are tens of times slower on CPUs without VNNI
    return ReferenceDiT(BIG, weights="bf16", seed=9)


def _long_step(eng: SplitEngine, model: ReferenceDiT):
    """A step of 8 blocks whose ``progress`` (block by block, from the arena's sequence words) is passed on: the
    tests below act once its first block is done, so they hit the middle of the step on a CPU of any speed."""
    inp = make_step_inputs(BIG, layout_for_tokens(3000), 3, torch.bfloat16)
    mod = model.modulation(inp.t_emb)
    return lambda **controls: eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs, **controls)


def _assert_a_short_step_is_exact(eng: SplitEngine, model: ReferenceDiT) -> None:
    """The engine runs on after a failed or interrupted step: a short step (its own plan) runs split on every rank and
    equals the unsplit one."""
    from h3ms_async.status.hub import get_hub
    inp = make_step_inputs(BIG, layout_for_tokens(600), 4, torch.bfloat16)
    out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    assert torch.equal(out, _reference(model, inp))
    why = dit_step_failure(get_hub().recent_steps(1)[0], eng.devices, tokens=inp.x.shape[0], blocks=BIG.layers)
    assert why is None, why


def test_worker_killed_mid_step_fails_fast_then_recovers(engine_factory, big_model):
    eng = engine_factory(["cpu"] * 3)
    eng.load_weights(("t", "big"), BIG, big_model.block_weights)
    step = _long_step(eng, big_model)
    victim = eng.pool.snapshot()[1]["pid"]
    killed: list[tuple[int, float]] = []

    def kill_after_the_first_block(done: int, total: int) -> None:
        if done >= 1 and not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append((done, time.monotonic()))

    with pytest.raises(SplitError) as ei:
        step(progress=kill_after_the_first_block)
    assert killed and killed[0][0] < 8, killed  # the kill came mid-step
    elapsed = time.monotonic() - killed[0][1]
    assert elapsed < 5.0, f"failure took {elapsed:.1f}s after the kill"
    msg = str(ei.value)
    assert "rank 1" in msg and "last lines" in msg
    # every other rank is idle again (the abort reached them), and the next step restarts the pool and is exact
    _assert_a_short_step_is_exact(eng, big_model)
    assert victim not in [w["pid"] for w in eng.pool.snapshot()]


def test_interrupt_aborts_every_rank(engine_factory, big_model):
    eng = engine_factory(["cpu"] * 2, exchange_chunks=4)
    eng.load_weights(("t", "big"), BIG, big_model.block_weights)
    step = _long_step(eng, big_model)
    from h3ms_async.status.hub import get_hub
    busy_seen = []
    done_blocks: list[int] = []
    fired: list[float] = []

    def interrupt() -> bool:
        busy_seen.append(get_hub().busy())  # the status routes see the running job (standalone too)
        if done_blocks and not fired:
            fired.append(time.monotonic())
        return bool(fired)

    with pytest.raises(SplitInterrupted):
        step(interrupt=interrupt, progress=lambda done, total: done_blocks.append(done) if done else None)
    assert fired and max(done_blocks) < 8, done_blocks  # the interrupt came mid-step
    t = time.monotonic() - fired[0]
    assert t < 2.0, f"interrupt took {t:.2f}s"
    assert busy_seen and all(busy_seen) and not get_hub().busy()
    states = [w["state"] for w in eng.pool.snapshot()]
    assert all(st in ("ready", "busy") for st in states), states  # alive: nobody was killed for it
    _assert_a_short_step_is_exact(eng, big_model)


def test_an_interrupt_during_the_plan_probe_ends_it_on_every_rank(engine_factory, big_model):
    """A step's new plan is probed on the ranks before its first block. An interrupt then (ComfyUI's cancel) ends the
    probe on every rank and keeps no verdict: the same step probes again, and is interrupted there again. (The
    probe's wait polled no interrupt: a cancel at a new shape waited for the whole probe, over a second at full width
    on a GPU, minutes for long steps on a CPU.)"""
    eng = engine_factory(["cpu"] * 2)
    eng.load_weights(("t", "big"), BIG, big_model.block_weights)
    inp = make_step_inputs(BIG, layout_for_tokens(6000), 3, torch.bfloat16)
    mod = big_model.modulation(inp.t_emb)
    for attempt in range(2):
        rounds = eng.probe.rounds
        fired: list[float] = []
        blocks: list[int] = []

        def cancel_once_the_probe_is_sent() -> None:  # as ComfyUI's cancel button: from another thread
            deadline = time.monotonic() + 60.0
            while eng.probe.rounds == rounds and time.monotonic() < deadline:
                time.sleep(0.002)
            fired.append(time.monotonic())

        canceller = threading.Thread(target=cancel_once_the_probe_is_sent)
        canceller.start()
        with pytest.raises(SplitInterrupted, match="invariance interrupted"):
            eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs, interrupt=lambda: bool(fired),
                           progress=lambda done, total: blocks.append(done))
        took = time.monotonic() - fired[0]
        canceller.join(5.0)
        assert took < 2.0 and not blocks, (attempt, took, blocks)  # ended in the probe, no block ran
        assert eng.probe.rounds == rounds + 1, attempt
    logs = [w["log"] for w in eng.pool.snapshot()]

    def every_rank_stopped_its_probe() -> bool:  # at its next call: the current one is not cut short
        return all("plan probe aborted by the coordinator" in open(p, encoding="utf-8").read() for p in logs)

    _wait(every_rank_stopped_its_probe, "every rank to stop its probe", 60)
    _assert_a_short_step_is_exact(eng, big_model)


def test_ck_int8_attention_unavailable_on_cpu_is_a_clear_error(engine_factory, int8_model):
    """INT8 attention (ComfyUI's --use-ck-attention) exists only on CUDA; a CPU rank says so and names the fix."""
    eng = engine_factory(["cpu"], attention="ck_int8")
    with pytest.raises(SplitError, match="attention='sdpa'"):  # the ranks warm their attention up at load
        eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)


def test_auto_residency_keeps_what_fits_in_the_ranks_share_of_the_gpu():
    """``vram_residency auto`` (workers.dit.cuda): every block when all fit (no streaming slots then), else as many
    as fit next to two streaming slots; ranks on one GPU split its free memory (they measure it at the same time)."""
    from workers.dit.cuda import auto_resident_blocks
    gib = 1 << 30
    assert auto_resident_blocks(4, gib, 20 * gib, 8 * gib, 2 * gib) == 4
    assert auto_resident_blocks(4, gib, 14 * gib, 8 * gib, 2 * gib) == 4  # exactly fits: no slots needed
    assert auto_resident_blocks(4, gib, 13 * gib, 8 * gib, 2 * gib) == 1  # 3 GiB left: 2 slots + 1 block
    assert auto_resident_blocks(4, gib, 40 * gib, 8 * gib, 2 * gib, sharing=2) == 4
    assert auto_resident_blocks(4, gib, 24 * gib, 8 * gib, 2 * gib, sharing=2) == 0  # 12 GiB each: 2 left = slots
    assert auto_resident_blocks(60, gib, 140 * gib, 12 * gib, 2 * gib, sharing=2) == 54
    assert auto_resident_blocks(4, gib, gib, 8 * gib, 2 * gib) == 0


def test_auto_residency_streams_the_last_blocks_when_others_took_the_room_since_the_load():
    """Before each ``auto`` step (workers.dit.cuda ``CudaWeights._shed``): the blocks chosen at the load stay while
    the rank's share of the free memory plus its own unused cache covers the step's working set and the reserve;
    else the last ones are streamed, making room for the two streaming slots when all were resident."""
    from workers.dit.cuda import resident_blocks_that_still_fit as fit
    gib = 1 << 30
    assert fit(4, 4, gib, 10 * gib, 0, 8 * gib, 2 * gib) == 4  # still exactly fits
    assert fit(4, 4, gib, 4 * gib, 6 * gib, 8 * gib, 2 * gib) == 4  # the rank's own cache counts
    assert fit(4, 4, gib, 9 * gib, 0, 8 * gib, 2 * gib) == 1  # 1 GiB short, + 2 slots: 3 go
    assert fit(3, 4, gib, 9 * gib, 0, 8 * gib, 2 * gib) == 2  # slots already there: only the 1 GiB
    assert fit(3, 4, gib, 8 * gib + 1, 0, 8 * gib, 2 * gib) == 1  # short by a byte under 2 GiB: 2 go
    assert fit(4, 4, gib, 16 * gib, 0, 8 * gib, 2 * gib, sharing=2) == 0  # 8 GiB each: 2 short, + slots
    assert fit(4, 4, gib, 0, 0, 8 * gib, 2 * gib) == 0
    assert fit(0, 4, gib, 0, 0, 8 * gib, 2 * gib) == 0


def test_a_new_t_emb_shape_replaces_only_the_side_segment(engine_factory, int8_model):
    """H3's first step has one modulation row and the next ones two: a t_emb (or per-token row) shape change between
    steps replaces the side segment (the adaLN rows) only; the step segment and the arena, which every rank has
    mapped (and CUDA ranks registered), stay. Each step is still exact."""
    eng = engine_factory(["cpu", "cpu"])
    eng.load_weights(("t", "int8", 5), CFG, int8_model.block_weights)
    lay = _layouts()[0]
    names = []
    for s, extra_rows in enumerate((0, 1, 1)):
        inp = make_step_inputs(CFG, lay, 30 + s, int8_model.dtype)
        t_emb = torch.cat([inp.t_emb, torch.randn(extra_rows, CFG.t_dim).to(inp.t_emb.dtype)])
        ref = int8_model.forward_blocks(inp.x.clone(), t_emb, inp.segments, inp.rope_freqs)
        out = eng.run_blocks(inp.x, int8_model.modulation(t_emb), inp.segments, inp.rope_freqs)
        assert torch.equal(out, ref), f"step {s}"
        buf = eng.step_buffers.current
        names.append((buf.step.name, buf.arena.name, buf.side.name))
        assert eng.last_phases["new_buffers"] == (s == 0) and eng.last_phases["new_side"] == (s < 2)
    assert names[0][:2] == names[1][:2] == names[2][:2] and names[0][2] != names[1][2] == names[2][2]


def test_a_step_with_a_known_plan_is_one_round_trip(engine_factory, int8_model, monkeypatch):
    """Once the ranks have loaded and the plan's verdict is known, a step goes to the coordinator once (the step
    itself): the verdict is looked up here, not after a separate round trip that starts the ranks."""
    from h3ms_async.runtime.coordinator import Coordinator
    eng = engine_factory(["cpu"] * 2)
    eng.load_weights(("t", "trips"), CFG, int8_model.block_weights)
    inp = make_step_inputs(CFG, _layouts()[0], 3, int8_model.dtype)
    try:
        eng.run_blocks(inp.x, int8_model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)  # measures the plan
    except SplitUnsafe:
        pytest.skip("this CPU refuses the plan (measured); the round trips are those of an unsplit step")
    submitted: list[str] = []
    real = Coordinator.submit
    monkeypatch.setattr(Coordinator, "submit", lambda self, coro: submitted.append(coro.__qualname__) or real(self, coro))
    out = eng.run_blocks(inp.x, int8_model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
    assert submitted == ["SplitEngine._dispatch"], submitted
    assert torch.equal(out, _reference(int8_model, inp))


def test_the_load_names_the_first_step_to_the_ranks():
    """load_weights(first_step=...) tells each rank the step's residency and [tokens, its tokens in the nominal
    plan], so a CUDA rank places its resident blocks in VRAM while the store fills (tests/test_cuda.py runs that on
    a GPU); without a step, or with fewer tokens than ranks, the first step decides."""
    from h3ms_async.dit.loaded import Placing
    from h3ms_async.dit.step import Step
    from workers.dit.protocol import DitLoad, Residency
    from workers.runtime.protocol import ProtocolError, TensorDesc
    eng = SplitEngine(["cpu"] * 3, SplitOptions(shares=(2.0, 1.0, 1.0), vram_residency="stream"))
    x = torch.zeros(10, CFG.hidden)
    step = Step(x, torch.zeros(CFG.layers, 1, 18 * CFG.hidden), [(0, 10, 0)], torch.zeros(1, 10, 1, 4, 2, 2))
    # the nominal plan: 10 tokens by shares 2:1:1, a tie going to the higher rank (plans.partition)
    assert eng._placing(step) == Placing(Residency.STREAM, [(10, 5), (10, 2), (10, 3)])
    assert eng._placing(replace(step, x=torch.zeros(2, CFG.hidden))) is None
    assert eng._placing(None) is None
    with pytest.raises(ProtocolError, match=r"dit_load tokens must be \[tokens, this rank's tokens <= tokens\]"):
        seg = "h3ms-1-0000abcd-store"
        DitLoad(store=seg, manifest=[], config={}, heads=(0, 1), key="k", deadline_s=1.0, residency=Residency.AUTO,
                progress=TensorDesc(seg=seg, off=0, dtype="int64", shape=[1]), tokens=(4, 5))
