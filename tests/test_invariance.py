"""Invariance measured, not assumed: the probe (``workers.dit.invariance``), the engine's plan decisions
(``h3ms_async.dit.exactness``) and ``verify`` (``h3ms_async.dit.verify``), on real CPU rank workers.

A test hook (``H3MS_TEST_SHAPE_FAULT``, ``workers.testing.faults.ShapeFault``) makes one
call shape round differently on
purpose, so neither the probe nor ``verify`` can pass vacuously.
"""
from __future__ import annotations

import json

import pytest
import torch

from h3ms_async.dit import exactness, tested_paths
from h3ms_async.dit.layout import build_layout
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.errors import SplitUnsafe
from h3ms_async.dit.overlap_tuner import overlap_options
from h3ms_async.dit.plan_probe import PlanProbe
from h3ms_async.dit.split import SplitEngine
from h3ms_async.status.hub import get_hub
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit.protocol import ProbeShard
from workers.testing.faults import ShapeFault
from split_checks import FAULT_TOKENS, fault_engines, fault_step

CFG = DiTConfig(hidden=128, layers=2, heads=8, head_dim=32, ffn=192, t_dim=16, rope_pairs=12)
TOKENS = FAULT_TOKENS  # two equal ranks: 100 rows each; fc2's input features (ffn) are 192, unique among the linears
FC2_FAULT = f"linear:{TOKENS // 2}:{CFG.ffn}"
#: The ops a plan's probe reports when no overlap and no sparse attention are asked for.
PLAN_OPS = [op for op in invariance.OP_ORDER if op not in {**exactness.OVERLAP_OPS, **exactness.SPARSE_OPS}]
#: ... and with head pieces and the gather overlap.
OVERLAP_PLAN_OPS = [op for op in invariance.OP_ORDER if op not in {**exactness.SPARSE_OPS, **dict.fromkeys(exactness.TAIL_OPS)}]


@pytest.fixture(scope="module")
def model():
    # int8: kitchen's int8 GEMMs are row-invariant on every CPU measured, so only the fault can make a shard differ
    return ReferenceDiT(CFG, weights="int8", seed=5)


@pytest.fixture
def engine(monkeypatch):
    yield from fault_engines(monkeypatch)


def _ops() -> list:
    man = [{n: ("float32", s) for n, s in CFG.block_shapes().items()}]
    return invariance.block_ops(man, lambda i: {})


def test_probe_sees_a_shape_fault_and_only_at_its_shape(monkeypatch):
    """In process: the faulty row count on fc2 differs, every other shard and op stays exact; a ``:step`` fault is
    invisible to the probe (verify's job)."""
    kw = dict(tokens=TOKENS, shards=[ProbeShard([(0, 100), (0, 96), (96, 200)], (0, 4))], total_heads=CFG.heads,
              head_dim=CFG.head_dim, dtype=torch.bfloat16, attend=dit_ops.builtin_attend("sdpa"),
              device=torch.device("cpu"))
    [clean] = invariance.run_probe(_ops(), **kw)
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault.parse(FC2_FAULT))
    [faulty] = invariance.run_probe(_ops(), **kw)
    by_op = {v.op: v for v in faulty.ops}
    assert by_op["mlp.fc2"].exact == [False] + clean.ops[-1].exact[1:] and by_op["mlp.fc2"].max_abs_diff[0] > 0
    assert [v.op for v in faulty.ops] == PLAN_OPS
    for v, c in zip(faulty.ops, clean.ops):
        if v.op != "mlp.fc2":
            assert v.exact == c.exact and v.digest == c.digest
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault.parse(FC2_FAULT + ":step"))
    assert [v.exact for v in invariance.run_probe(_ops(), **kw)[0].ops] == [v.exact for v in clean.ops]
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault.parse("attention:4"))
    assert {v.op: v.exact for v in invariance.run_probe(_ops(), **kw)[0].ops}["attention"] == [False]


def test_digest_and_fault_text():
    a = torch.randn(64, 33).to(torch.bfloat16)
    b = a.clone()
    assert invariance.digest(a) == invariance.digest(b)
    b.view(torch.int16)[17, 5] ^= 1  # one bit
    assert invariance.digest(a) != invariance.digest(b)
    with pytest.raises(ValueError, match=r"linear:ROWS:IN_FEATURES\[:OUT_FEATURES\]"):
        ShapeFault.parse("linear:10")


def test_adjusted_bounds_keep_shares_close():
    cands = exactness.adjusted_bounds((0, 10, 20000))
    assert cands[0] == (0, 16, 20000) and (0, 32, 20000) in cands and (0, 10, 20000) not in cands
    assert all(min(exactness.sizes(c)) >= 16 for c in cands)
    assert exactness.adjusted_bounds((0, 3, 6)) == []  # too few tokens for any safe size
    assert exactness.adjusted_bounds((0, 100, 200))[0] == (0, 96, 200)


def test_exact_plan_runs_split_and_is_recorded(engine, model):
    eng = engine()
    eng.load_weights(("inv", 1), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    rows = get_hub().status()["exactness"]["verdicts"][-len(PLAN_OPS):]
    assert [r["op"] for r in rows] == PLAN_OPS
    assert {r["verdict"] for r in rows} == {"exact"} and all(r["program"] == "dit" for r in rows)
    assert rows[-1]["shards"] == [100, 100] and rows[-1]["shape"] == f"{TOKENS}x{CFG.hidden}x{CFG.ffn}"


def test_faulty_shard_is_adjusted_and_stays_exact(engine, model, caplog):
    """fc2 rounds differently at the plan's 100-row shards on both ranks: the engine moves the boundary to a
    measured safe place (96/104) and the split equals the unsplit output; the status names the op."""
    eng = engine(FC2_FAULT)
    eng.load_weights(("inv", 2), CFG, model.block_weights)
    for seed in (3, 4):  # the second step reuses the cached verdict
        out, ref = fault_step(eng, model, seed)
        assert torch.equal(out, ref)
    assert [r["tokens"] for r in get_hub().recent_steps(1)[0]["ranks"]] == [[0, 96], [96, 200]]
    fc2 = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "mlp.fc2"][-1]
    assert fc2["verdict"] == "adjusted" and "100-row shard" in fc2["detail"] and "[96, 104]" in fc2["detail"]


def test_ranks_of_one_device_share_one_probe(engine, model, monkeypatch):
    """Grouped as the logical ranks of one GPU are (``plan_probe.probe_groups``; CPU ranks each probe alone, having
    cores of their own, so here the grouping is forced): rank 0 probes both ranks' shards and rank 1 gets no probe
    request, and the fault is still found on both shards, adjusted and exact as when each rank probes its own."""
    from h3ms_async.dit import plan_probe
    monkeypatch.setattr(plan_probe, "probe_groups", lambda devices, sparse: [list(range(len(devices)))])
    eng = engine(FC2_FAULT)
    eng.load_weights(("inv", 21), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    assert [r["tokens"] for r in get_hub().recent_steps(1)[0]["ranks"]] == [[0, 96], [96, 200]]
    jobs = [w["jobs_done"] for w in eng.pool.snapshot()]
    assert eng.probe.rounds > 0 and jobs[0] == jobs[1] + eng.probe.rounds, jobs


def test_unfixable_fault_runs_unsplit_with_one_warning(engine, model):
    """Attention differs for a 4-head group: no token adjustment helps, the step is refused (the caller runs it
    unsplit) naming the op, the shard and the device; the second step is refused from the cache, first=False."""
    eng = engine("attention:4")
    eng.load_weights(("inv", 3), CFG, model.block_weights)
    with pytest.raises(SplitUnsafe, match=r"attention .* heads \[0, 4\) .* on cpu ") as first:
        fault_step(eng, model)
    assert first.value.first
    with pytest.raises(SplitUnsafe) as again:
        fault_step(eng, model, 4)
    assert not again.value.first
    att = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "attention"][-1]
    assert att["verdict"] == "unsplit"


def test_head_pieces_run_exact_and_are_recorded(engine, model):
    """Attention in 3 head pieces per rank (4 heads: 1+1+2), each moved by the all-to-all while the next one
    computes: equal to the unsplit output, the pieces' verdict recorded, one exchange chunk per piece."""
    eng = engine(head_pieces=3)
    eng.load_weights(("inv", 7), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    # to the one peer: the job's begin, then per block the all-gather's one chunk and the all-to-all's three
    assert [r.signals for r in eng.last_rank_results] == [1 + CFG.layers * 4] * 2
    assert get_hub().recent_steps(1)[0]["head_pieces"] == 3
    rows = get_hub().status()["exactness"]["verdicts"][-(len(OVERLAP_PLAN_OPS) - 1):]
    assert [r["op"] for r in rows] == [op for op in OVERLAP_PLAN_OPS if op != "attn.qkv_proj.rows"]
    assert {r["verdict"] for r in rows} == {"exact"} and rows[2]["shards"] == [1, 1, 2, 1, 1, 2]  # attention.pieces
    inp = make_step_inputs(CFG, build_layout(88, 3, 4, 6, 8, keyframes=1, sigma=0.7), 5, model.dtype)
    one_call = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, head_pieces=0)
    assert torch.equal(one_call, model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs))
    assert [r.signals for r in eng.last_rank_results] == [1 + CFG.layers * 2] * 2


def test_a_differing_head_piece_runs_attention_in_one_call(engine, model, caplog):
    """Attention of a 1-head piece rounds differently: the plan stays split and exact, attention runs in one call
    per rank, one warning names the piece, the status shows it adjusted."""
    eng = engine("attention:1", head_pieces=3)
    eng.load_weights(("inv", 8), CFG, model.block_weights)
    for seed in (3, 4):  # the second step reuses the cached verdict
        out, ref = fault_step(eng, model, seed)
        assert torch.equal(out, ref)
        assert [r.signals for r in eng.last_rank_results] == [1 + CFG.layers * 2] * 2
        assert get_hub().recent_steps(1)[0]["head_pieces"] == 0
    warned = [r.getMessage() for r in caplog.records if "attention runs in one call" in r.getMessage()]
    assert len(warned) == 1 and "attention.pieces" in warned[0] and "heads [0, 1)" in warned[0], warned
    pieces = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "attention.pieces"][-1]
    assert pieces["verdict"] == "adjusted" and "one call per rank" in pieces["detail"]


def test_gather_overlap_runs_exact_and_is_recorded(engine, model):
    """Each rank's qkv projection on every rank's rows as they arrive (its own first): equal to the unsplit
    output, the row ranges' verdict recorded, and so is what the step ran."""
    eng = engine(gather_overlap=True, head_pieces=2)
    eng.load_weights(("inv", 9), CFG, model.block_weights)
    for seed in (3, 4):
        out, ref = fault_step(eng, model, seed)
        assert torch.equal(out, ref)
        rec = get_hub().recent_steps(1)[0]
        assert rec["gather_overlap"] is True and rec["head_pieces"] == 2
    rows = {r["op"]: r for r in get_hub().status()["exactness"]["verdicts"][-len(OVERLAP_PLAN_OPS):]}
    assert list(rows) == OVERLAP_PLAN_OPS and {r["verdict"] for r in rows.values()} == {"exact"}
    assert rows["attn.qkv_proj.rows"]["shards"] == [100, 100, 100, 100]  # each rank: both ranks' ranges


def test_a_differing_row_range_projects_after_the_whole_gather(engine, model, caplog):
    """The qkv projection of rank 0's group (2 of 8 heads: 192 outputs) rounds differently on a 50-row range:
    the plan stays split and exact, the projection waits for the whole gather, one warning names the range."""
    eng = engine("linear:50:128:192", gather_overlap=True, shares=(1.0, 3.0))
    eng.load_weights(("inv", 10), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    rec = get_hub().recent_steps(1)[0]
    assert rec["gather_overlap"] is False and [r["tokens"] for r in rec["ranks"]] == [[0, 50], [50, 200]]
    warned = [r.getMessage() for r in caplog.records if "waits for the whole gather" in r.getMessage()]
    assert len(warned) == 1 and "attn.qkv_proj.rows" in warned[0] and "tokens [0, 50)" in warned[0], warned
    row = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "attn.qkv_proj.rows"][-1]
    assert row["verdict"] == "adjusted" and "waits for the whole gather" in row["detail"]


def test_ulysses_probes_every_heads_qkv_on_the_token_shards(engine, model):
    """Under the Ulysses pattern a rank projects every head (768 outputs) for its own 100 tokens: the probe checks that
    call as a token-split op, a fault there moves the shards (96/104) and the split stays exact; the same fault never
    fires under the all-gather pattern, whose qkv calls have every token and one head group."""
    fault = f"linear:{TOKENS // 2}:{CFG.hidden}:{3 * CFG.heads * CFG.head_dim}"
    eng = engine(fault, pattern="ulysses")
    eng.load_weights(("inv", 11), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    rec = get_hub().recent_steps(1)[0]
    assert rec["pattern"] == "ulysses" and [r["tokens"] for r in rec["ranks"]] == [[0, 96], [96, 200]]
    qkv = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "attn.qkv_proj"][-1]
    assert qkv["verdict"] == "adjusted" and "100-row shard" in qkv["detail"], qkv
    eng.release()
    eng = engine(fault)
    eng.load_weights(("inv", 12), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref) and [r["tokens"] for r in get_hub().recent_steps(1)[0]["ranks"]] == [[0, 100],
                                                                                                      [100, 200]]


def test_verify_reports_bit_exact_then_names_the_faulty_block_and_op(engine, model, monkeypatch):
    """verify on a clean split says bit-exact; with a fault the probe cannot see (``:step``) it reports the max
    difference and the first block and op that differ (block 0, mlp.fc2), and the split result is returned."""
    hub = get_hub()
    seen: list[dict] = []
    record = hub.record_verify
    monkeypatch.setattr(hub, "record_verify", lambda rec: seen.append(record(rec)) or seen[-1])
    eng = engine(verify=True)
    eng.load_weights(("inv", 4), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    assert len(seen) == 1 and seen[0]["bit_exact"] and seen[0]["max_abs_diff"] == 0.0
    assert seen[0]["first_difference"] is None and seen[0]["devices"][0].startswith("cpu ")
    fault_step(eng, model, 4)  # the same prompt: not verified again
    eng.new_prompt()
    fault_step(eng, model, 5)
    assert len(seen) == 2 and seen[1]["bit_exact"]
    eng.release()

    eng = engine(FC2_FAULT + ":step", verify=True)
    eng.load_weights(("inv", 5), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert not torch.equal(out, ref)
    v = seen[-1]
    assert len(seen) == 3 and v == get_hub().status()["exactness"]["verify"][-1]
    assert not v["bit_exact"] and v["max_abs_diff"] > 0 and v["first_difference"] == "block 0 mlp.fc2"


def test_verdicts_persist_in_the_cache_file(engine, model, monkeypatch, tmp_path):
    """H3MS_INVARIANCE_CACHE keeps the measured verdicts across processes: with the memory cleared (as in a new
    process) the adjusted plan is taken from the file, not probed again, and still equals the unsplit output."""
    path = tmp_path / "verdicts.json"
    monkeypatch.setenv("H3MS_INVARIANCE_CACHE", str(path))
    eng = engine(FC2_FAULT)
    eng.load_weights(("inv", 6), CFG, model.block_weights)
    out, ref = fault_step(eng, model)
    assert torch.equal(out, ref)
    assert [v["verdict"] for v in json.loads(path.read_text()).values()] == ["adjusted"]
    exactness.VERDICTS.clear()
    monkeypatch.setattr(PlanProbe, "_probe_round", lambda *a: pytest.fail("a cached plan was probed again"))
    out, ref = fault_step(eng, model, 4)
    assert torch.equal(out, ref)
    assert [r["tokens"] for r in get_hub().recent_steps(1)[0]["ranks"]] == [[0, 96], [96, 200]]


@pytest.mark.fast
def test_the_verdict_file_is_on_by_default(monkeypatch, tmp_path):
    """Unset, H3MS_INVARIANCE_CACHE means the user's cache folder (a restarted ComfyUI probes nothing it measured
    before); `off` keeps verdicts in memory; a path is that file."""
    monkeypatch.delenv("H3MS_INVARIANCE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert exactness.cache_path() == str(tmp_path / "h3_multistream" / "invariance.json")
    cache = exactness.VerdictCache()
    cache.put("k", exactness.PlanVerdict((0, 5, 10), "exact", "measured exact", 1.0))
    assert json.loads((tmp_path / "h3_multistream" / "invariance.json").read_text())["k"]["verdict"] == "exact"
    monkeypatch.setenv("H3MS_INVARIANCE_CACHE", "off")
    assert exactness.cache_path() is None
    monkeypatch.setenv("H3MS_INVARIANCE_CACHE", str(tmp_path / "v.json"))
    assert exactness.cache_path() == str(tmp_path / "v.json")


def _overlaps_seen(eng: SplitEngine, model: ReferenceDiT, steps: int) -> list[tuple[str, int, bool, int]]:
    """Run ``steps`` steps, each equal to the unsplit output; per step what its record says the overlaps were."""
    seen = []
    for seed in range(3, 3 + steps):
        out, ref = fault_step(eng, model, seed)
        assert torch.equal(out, ref)
        rec = get_hub().recent_steps(1)[0]
        seen.append((rec["overlap_tuning"], rec["head_pieces"], rec["gather_overlap"], rec["gather_ahead"]))
    return seen


def test_auto_overlaps_time_each_exact_combination_then_run_the_fastest(engine, model):
    """The node's default (overlaps "auto"): a plan's first step runs without overlaps, each exact combination then
    runs one step, and later steps run the one that took the least time per block; every step is bit-exact."""
    eng = engine(**overlap_options("auto"))
    eng.load_weights(("inv", 11), CFG, model.block_weights)
    seen = _overlaps_seen(eng, model, 11)
    assert seen[:9] == [("warming", 0, False, 0)] + [("measuring", p, g, a) for a in (0, 8) for g in (False, True)
                                                     for p in (0, 8)]
    (tuned,) = eng.overlaps.snapshot()
    fastest = min(tuned["ms_per_block"], key=tuned["ms_per_block"].get)
    assert tuned["phase"] == "fastest" and tuned["choice"] == fastest
    assert tuned["plan"] == "tokens 0-100-200, heads 0-4-8, gather over host, dense"
    assert sorted(tuned["ms_per_block"]) == ["ahead8", "gather", "gather+ahead8", "gather+pieces8",
                                             "gather+pieces8+ahead8", "none", "pieces8", "pieces8+ahead8"]
    expect = exactness.Overlap.from_name(fastest)
    assert seen[9:] == [("fastest", expect.head_pieces, expect.gather, expect.ahead)] * 2


def test_auto_overlaps_leave_out_what_the_probe_measured_inexact(engine, model):
    """Attention of a 1-head piece rounds differently on purpose: "auto" times only none and the gather overlap."""
    eng = engine("attention:1", **overlap_options("auto"))
    eng.load_weights(("inv", 12), CFG, model.block_weights)
    seen = _overlaps_seen(eng, model, 6)
    assert [s[0] for s in seen] == ["warming"] + ["measuring"] * 4 + ["fastest"]
    assert {s[1] for s in seen} == {0} and [s[2:] for s in seen[1:5]] == [(False, 0), (True, 0), (False, 8), (True, 8)]
    assert sorted(eng.overlaps.snapshot()[0]["ms_per_block"]) == ["ahead8", "gather", "gather+ahead8", "none"]


def test_auto_overlaps_leave_out_paths_untested_on_the_device_kind(monkeypatch):
    """Where only head pieces have a passing test, "auto" asks for no other overlap (an explicit choice of one is
    refused); with none tested, for none."""
    monkeypatch.delenv("H3MS_ALLOW_UNTESTED_PATHS", raising=False)
    gpus = ["cuda:0", "cuda:1"]
    assert tested_paths.tested_overlap(gpus, 4, True, 4) == (4, True, 4)  # every overlap's CUDA test has passed
    assert tested_paths.tested_overlap(["cpu", "cpu"], 4, True, 4) == (4, True, 4)
    assert tested_paths.tested_overlap(gpus, 4, True, 4, pattern="ulysses") == (4, True, 4)
    # the Ulysses pattern's head pieces have a CUDA test of their own: without it, that pattern runs no pieces
    cuda = {p: t for p, t in tested_paths.TESTED["cuda"].items() if p is not tested_paths.SplitPath.ULYSSES_PIECES}
    with monkeypatch.context() as mp:
        mp.setitem(tested_paths.TESTED, "cuda", cuda)
        assert tested_paths.tested_overlap(gpus, 4, True, 4, pattern="ulysses") == (0, True, 4)
        assert tested_paths.tested_overlap(gpus, 4, True, 4) == (4, True, 4)
        with pytest.raises(tested_paths.UntestedPath, match="the Ulysses pattern with attention in head pieces has"):
            tested_paths.check(gpus, "ulysses", 4, False)
        tested_paths.check(gpus, "ulysses", 0, False)
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {tested_paths.SplitPath.HEAD_PIECES: "tests/test_cuda.py::x"})
    assert tested_paths.tested_overlap(gpus, 4, True, 4) == (4, False, 0)
    with pytest.raises(tested_paths.UntestedPath, match="the gather overlap has no passing"):
        tested_paths.check(gpus, "gather", 4, True)
    monkeypatch.setitem(tested_paths.TESTED, "cuda", {})
    assert tested_paths.tested_overlap(gpus, 4, True, 4) == (0, False, 0)
    with pytest.raises(tested_paths.UntestedPath, match="attention in head pieces has no passing"):
        tested_paths.check(gpus, "gather", 4, False)
    monkeypatch.setenv("H3MS_ALLOW_UNTESTED_PATHS", "1")
    assert tested_paths.tested_overlap(gpus, 4, True, 4) == (4, True, 4)


def test_overlap_choices_map_onto_the_options():
    assert overlap_options("auto") == {"head_pieces": 8, "gather_overlap": True, "gather_ahead": 8,
                                       "overlap_tuning": True}
    assert overlap_options("off") == {"head_pieces": 0, "gather_overlap": False, "gather_ahead": 0,
                                      "overlap_tuning": False}
    assert overlap_options("both") == {"head_pieces": 8, "gather_overlap": True, "gather_ahead": 0,
                                       "overlap_tuning": False}
    assert overlap_options("gather ahead") == {"head_pieces": 0, "gather_overlap": False, "gather_ahead": 8,
                                               "overlap_tuning": False}
    assert overlap_options("all") == {"head_pieces": 8, "gather_overlap": True, "gather_ahead": 8,
                                      "overlap_tuning": False}
    with pytest.raises(ValueError, match="overlaps='fast' is not one of 'auto', 'off'"):
        overlap_options("fast")


def test_one_probe_for_several_shards_equals_a_probe_per_shard(monkeypatch):
    """The probe that logical ranks of one GPU share (each unsplit call made once for every rank's shard) gives each
    shard the verdicts its own probe gives, a fault included; h3ms_async/dit/plan_probe.py groups the ranks."""
    from h3ms_async.dit.plan_probe import probe_groups
    asked = [ProbeShard([(0, 96), (0, 100)], (0, 4), [(0, 48), (48, 96)]), ProbeShard([(96, 200), (100, 200)], (4, 8))]
    kw = dict(tokens=TOKENS, total_heads=CFG.heads, head_dim=CFG.head_dim, dtype=torch.bfloat16, pieces=2,
              gather_ranges=[(0, 96), (96, 200)], attend=dit_ops.builtin_attend("sdpa"), device=torch.device("cpu"))
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault.parse(FC2_FAULT))
    together = invariance.run_probe(_ops(), shards=asked, **kw)
    alone = [invariance.run_probe(_ops(), shards=[sh], **kw)[0] for sh in asked]

    def verdicts(rep) -> list[tuple]:
        return [(v.op, v.split, v.shards, v.exact, v.max_abs_diff, v.digest) for v in rep.ops]

    assert [verdicts(r) for r in together] == [verdicts(r) for r in alone]
    assert {v.op: v.exact for v in together[0].ops}["mlp.fc2"] == [True, False]  # the fault's 100-row shard
    assert {v.op for v in together[0].ops} >= {"attention.pieces", "attn.qkv_proj.rows", "mlp.fc2.tail"}
    assert probe_groups(["cuda:0", "cuda:1", "cuda:0", "cpu", "cpu", "cuda"], sparse=False) == [[0, 2, 5], [1], [3], [4]]
    assert probe_groups(["cuda:0", "cuda:0"], sparse=True) == [[0], [1]]
