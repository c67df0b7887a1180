"""``bench model``: the command end to end on a parts file, its byte counts against the plan and
against what the
real transports count, the N=1 identity, and the directions every prediction must move in."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_probe_cases
from h3ms_async.dit import speed_model as sm
from h3ms_async.runtime.plans import partition
from workers.transports.arena import ArenaLayout

ROOT = Path(__file__).resolve().parent.parent
PARTS = ROOT / "benchmarks" / "speed_parts_h200.json"
PARTS_DOC = json.loads(PARTS.read_text())


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3ms_async", "bench", "model", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report() -> dict:
    run = _bench("--parts", str(PARTS), "--ranks", "1,2,4,8")
    assert run.returncode == 0, run.stderr
    assert "not validated on a gpu in this run" in run.stderr.lower() and "nvlink-nccl" in run.stderr
    return json.loads(run.stdout)


def _pred(rep: dict, world: int, link: str, pattern: str = "gather", attention: str = "dense") -> dict:
    return next(p for p in rep["predictions"] if (p["world"], p["link"], p["pattern"], p["attention"])
                == (world, link, pattern, attention))


def test_byte_counts_follow_the_plan(report):
    shape = json.loads(PARTS.read_text())["shape"]
    S, W, e, D = shape["tokens"], shape["hidden"], 2, shape["head_dim"]
    C = shape["heads"] * D
    for n in (2, 4, 8):
        tb, hb = partition(S, [1.0] * n), partition(shape["heads"], [1.0] * n)
        host = _pred(report, n, "pcie5-host")["bytes_per_rank"]
        nccl = _pred(report, n, "nvlink-nccl")["bytes_per_rank"]
        uly = _pred(report, n, "pcie5-host", "ulysses")["bytes_per_rank"]
        p2p = _pred(report, n, "pcie5-p2p")["bytes_per_rank"]
        big = max(b - a for a, b in zip(tb, tb[1:]))
        for r in range(n):
            rows, cols = tb[r + 1] - tb[r], (hb[r + 1] - hb[r]) * D
            assert host[r]["all_gather_input_out"] == rows * W * e       # written once for every peer
            assert host[r]["all_gather_input_in"] == (S - rows) * W * e
            assert host[r]["all_to_all_attn_out"] == (S - rows) * cols * e
            assert host[r]["all_to_all_attn_in"] == rows * (C - cols) * e
            assert nccl[r]["all_gather_input_out"] == (n - 1) * big * W * e  # padded to the largest shard
            assert uly[r]["all_to_all_qkv_out"] == 3 * rows * (C - cols) * e
            assert p2p[r]["all_gather_input_out"] == (n - 1) * rows * W * e  # each peer copies it, unpadded
            assert p2p[r]["all_gather_input_in"] == (S - rows) * W * e
            assert (p2p[r]["all_to_all_attn_out"], p2p[r]["all_to_all_attn_in"]) == (
                host[r]["all_to_all_attn_out"], host[r]["all_to_all_attn_in"])
            assert uly[r]["all_to_all_qkv_in"] == 3 * (S - rows) * cols * e
    # the one-H200 figures of docs/performance.md: 407 MB gathered + 272 MB all-to-all out per rank
    # at N = 2
    two = _pred(report, 2, "pcie5-host")["bytes_per_rank"][0]
    assert round(two["all_gather_input_out"] / 1e6) == 407 and round(two["all_to_all_attn_out"] / 1e6) == 272


@pytest.mark.timeout(120)
def test_byte_counts_match_what_the_real_transports_move():
    """Uneven shares on 3 rank processes: the host exchange's and gloo's own byte counters equal
    the model's."""
    world, tokens, heads, d = 3, 29, 7, 4
    shares = [1.0, 1.0, 0.7]
    shape = sm.Shape(tokens, 12, heads, d, 1, "bfloat16")
    plan = sm.make_plan(shape, world, shares)
    lay = ArenaLayout.plan(world, list(plan.tokens), [h * d for h in plan.heads], shape.hidden, "bfloat16")
    recs = run_probe_cases(world, [{"transport": ["host", "gloo"], "layout": lay.to_dict(), "chunks": [0], "rounds": 1,
                                    "blocks": 1}])
    for rank, rec in enumerate(sorted(recs, key=lambda r: r["rank"])):
        by = {run["transport"]: run["stats"] for run in rec["cases"][0]["runs"]}
        w_host, r_host = (sum(o for o, _ in (sm.host_bytes(shape, plan, k)[rank] for k in ("gather", "a2a_out"))),
                          sum(i for _, i in (sm.host_bytes(shape, plan, k)[rank] for k in ("gather", "a2a_out"))))
        assert (by["host"]["bytes_written"], by["host"]["bytes_read"]) == (w_host, r_host)
        sent = sum(sm.nccl_bytes(shape, plan, k)[rank][0] for k in ("gather", "a2a_out"))
        got = sum(sm.nccl_bytes(shape, plan, k)[rank][1] for k in ("gather", "a2a_out"))
        assert (by["gloo"]["bytes_written"], by["gloo"]["bytes_read"]) == (sent, got)
    assert plan.n(2) < plan.n(0) and plan.h(0) < plan.h(1)  # the shares really were uneven


def test_one_rank_is_the_unsplit_step(report):
    for p in (q for q in report["predictions"] if q["world"] == 1):
        assert p["exchange_block_s"] == 0.0 and p["speedup"] == pytest.approx(1.0, abs=1e-12)
        assert p["step_s"] == pytest.approx(p["unsplit_step_s"])
        assert all(v == 0 for row in p["bytes_per_rank"] for k, v in row.items() if k.endswith(("_in", "_out")))


def test_predictions_move_the_right_way(report):
    for n in (2, 4, 8):
        for pattern in sm.PATTERNS:
            for attn in ("dense", "sparse") if pattern == "gather" else ("dense",):
                s4, s5, nv = (_pred(report, n, ln, pattern, attn)["speedup"]
                              for ln in ("pcie4-host", "pcie5-host", "nvlink-nccl"))
                assert s4 <= s5 <= nv and s4 < nv
                # at most N, or more where the measured shard is cheaper than an even share of the block
                assert 1.0 < nv <= n * max(1.0, PARTS_DOC["unsplit_block_s"] / (n * PARTS_DOC["shard_block_s"][str(n)]))
        # sparse steps compute less, so the same exchange weighs more; they run the all-gather pattern only (the
        # split refuses Ulysses with sparse attention), so the model predicts no Ulysses sparse step
        assert _pred(report, n, "pcie4-host", "gather", "sparse")["speedup"] < \
            _pred(report, n, "pcie4-host", "gather")["speedup"]
    assert not [p for p in report["predictions"] if p["pattern"] == "ulysses" and p["attention"] == "sparse"]
    for link in ("pcie5-host", "nvlink-nccl"):
        steps = [_pred(report, n, link)["step_s"] for n in (1, 2, 4, 8)]
        assert steps == sorted(steps, reverse=True)
    # the all-gather moves W per token, Ulysses 3 x heads x head_dim / N: it prefers the gather at
    # 2 ranks on PCIe
    # and Ulysses at 8
    pref = {(q["world"], q["link"], q["attention"]): q["pattern"] for q in report["preferred_pattern"]}
    assert pref[(2, "pcie4-host", "dense")] == "gather" and pref[(8, "pcie4-host", "dense")] == "ulysses"


def test_overlap_and_bandwidth_options_change_the_prediction():
    full = _bench("--parts", str(PARTS), "--ranks", "4", "--overlap", "1")
    slow = _bench("--parts", str(PARTS), "--ranks", "4", "--pcie4-gbps", "5")
    assert full.returncode == 0 and slow.returncode == 0, full.stderr + slow.stderr
    hidden, narrow = json.loads(full.stdout), json.loads(slow.stdout)
    p = _pred(hidden, 4, "pcie4-host")
    assert p["exposed_block_s"] == 0.0 and p["block_s"] == pytest.approx(p["compute_block_s"])
    assert _pred(narrow, 4, "pcie4-host")["exchange_block_s"] > _pred(narrow, 4, "pcie5-host")["exchange_block_s"]


def test_the_implemented_overlaps_hide_what_they_can():
    """A pipeline hides every stage but the slowest behind it, but for the first and last piece; host staging's two
    hops are two stages (its copy streams run them at once), so pieces hide an op longer than the compute beside it
    as long as each hop is shorter; the split's overlaps as modelled: pieces hide the all-to-all behind attention,
    the gather overlap the own rows' qkv, each at most its own op, never below the compute, and in the Ulysses pattern
    the q/k/v all-to-all behind attention; a wrong schedule name fails naming the forms."""
    assert sm.pipelined(10.0, (2.0,), 1) == 12.0 and sm.pipelined(10.0, (2.0,), 4) == pytest.approx(10.5)
    assert sm.pipelined(2.0, (10.0,), 4) == pytest.approx(10.5)
    assert sm.pipelined(10.0, (6.0, 6.0), 1) == 22.0 and sm.pipelined(10.0, (6.0, 6.0), 4) == pytest.approx(13.0)
    assert sm.pipelined(2.0, (6.0, 10.0), 4) == pytest.approx(12.0)
    parts = sm.parts_from_dict(json.loads(PARTS.read_text()))
    link = sm.Link("pcie4", "host", 25.0, 40e-6, "test", True)
    plain, pieces, gather, both = (sm.predict(parts, 2, link, head_pieces=p, gather_overlap=g)
                                   for p, g in ((0, False), (4, False), (0, True), (4, True)))
    assert plain.schedule == "none" and both.schedule == "gather+pieces4"
    assert plain.block_s == pytest.approx(plain.compute_block_s + plain.exchange_block_s)
    a2a, gath = plain.ops["all_to_all_attn"], plain.ops["all_gather_input"]
    # the pieces' smaller kernels cost the measured fraction of compute
    assert parts.overlap_compute_frac > 0
    cost = plain.compute_block_s * parts.overlap_compute_frac
    assert pieces.compute_block_s == pytest.approx(plain.compute_block_s + cost)
    assert plain.block_s - pieces.block_s == pytest.approx(a2a * 3 / 4 - cost)  # attention outlasts each move
    assert 0 < plain.block_s + cost - gather.block_s <= gath
    assert both.block_s < min(pieces.block_s, gather.block_s) and both.block_s > both.compute_block_s
    ulysses = sm.predict(parts, 2, link, pattern="ulysses", gather_overlap=True, gather_ahead=4)
    assert ulysses.schedule == "none"  # the gather overlap and the gather-ahead belong to the all-gather pattern
    # the Ulysses pattern's pieces: q/k/v move in and the output moves back piece by piece beside attention, the
    # two ways taking turns on each hop's copy stream
    u_pieces = sm.predict(parts, 8, link, pattern="ulysses", head_pieces=8)
    u_plain = sm.predict(parts, 8, link, pattern="ulysses")
    att = parts.unsplit_block_s * (1 + parts.overlap_compute_frac) * parts.attention_fraction / 8
    plan8 = sm.make_plan(parts.shape, 8)
    q_hops = sm.op_hops(parts.shape, plan8, "a2a_qkv", link, parts.host_mem_gbps)
    o_hops = sm.op_hops(parts.shape, plan8, "a2a_out", link, parts.host_mem_gbps)
    assert len(q_hops) == len(o_hops) == 2  # host staging: out to the arena, in from it
    slowest = max(att, q_hops[0] + o_hops[0], q_hops[1] + o_hops[1])
    wall = (att + sum(q_hops) + sum(o_hops) + 7 * slowest) / 8
    assert u_pieces.block_s == pytest.approx(u_pieces.compute_block_s + wall - att)
    assert u_pieces.block_s < u_plain.block_s and u_pieces.schedule == "pieces8"
    # the gather-ahead: the next block's gather moves behind this block's tail (all but attention and qkv), in pieces
    ahead = sm.predict(parts, 2, link, head_pieces=4, gather_overlap=True, gather_ahead=4)
    assert ahead.schedule == "pieces4+ahead4"  # the next block's rows are gathered already: no gather overlap
    unit = parts.unsplit_block_s * (1 + parts.overlap_compute_frac)  # the overlaps' kernels cost compute
    tail = unit * (1 - parts.attention_fraction - sm.QKV_FRACTION) / 2
    hops = sm.op_hops(parts.shape, sm.make_plan(parts.shape, 2), "gather", link, parts.host_mem_gbps)
    assert len(hops) == 2 and sum(hops) == pytest.approx(gath)  # out to the arena, then in from it
    assert ahead.block_s == pytest.approx(pieces.block_s - gath + sm.pipelined(tail, hops, 4) - tail)
    assert ahead.block_s < pieces.block_s
    # NCCL moves each op as one collective once its input is whole (workers/transports/dist.py): every overlap's
    # pieces cost their compute and hide nothing, in either pattern
    nccl = sm.Link("nvlink", "nccl", 150.0, 20e-6, "test", True)
    for pattern in ("gather", "ulysses"):
        none = sm.predict(parts, 4, nccl, pattern=pattern)
        every = sm.predict(parts, 4, nccl, pattern=pattern, head_pieces=8, gather_overlap=True, gather_ahead=8)
        assert every.compute_block_s == pytest.approx(none.compute_block_s * (1 + parts.overlap_compute_frac))
        assert every.exposed_block_s == pytest.approx(none.exposed_block_s) == pytest.approx(none.exchange_block_s)
    run = _bench("--parts", str(PARTS), "--ranks", "2", "--schedule", "gather+pieces4")
    assert run.returncode == 0 and "schedule gather+pieces4" in run.stderr, run.stderr
    assert json.loads(run.stdout)["schedule"]["overlaps"] == "gather+pieces4"
    bad = _bench("--parts", str(PARTS), "--schedule", "pieces1")
    assert bad.returncode == 2 and "--schedule" in bad.stderr and "gather+piecesN" in bad.stderr


def test_bad_inputs_fail_with_one_line(tmp_path):
    doc = json.loads(PARTS.read_text())
    doc["attention_fraction"] = 1.5
    bad = tmp_path / "parts.json"
    bad.write_text(json.dumps(doc))
    run = _bench("--parts", str(bad))
    assert run.returncode == 2 and "attention_fraction" in run.stderr and "Traceback" not in run.stderr
    if not torch.cuda.is_available():
        run = _bench("--validate", "--parts", str(PARTS))
        assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


def test_validated_on_gpu_only_within_the_bound(report):
    """``validated_on_gpu`` says the model held its stated error bound on every measured world size, nothing less:
    a parts file alone never validates, and one size off by more than the bound fails the whole validation."""
    from h3ms_async.tools.bench.model import VALIDATION_BOUND_PCT, within_bound

    assert report["validated_on_gpu"] is False
    ok = {"world": 2, "error_pct": VALIDATION_BOUND_PCT - 0.1}
    assert within_bound([ok, {**ok, "world": 4, "error_pct": -VALIDATION_BOUND_PCT}])
    assert not within_bound([ok, {**ok, "world": 4, "error_pct": -12.3}])  # the round-3 H200 figure at 2 ranks
    assert not within_bound([])
    # the table's verdict names the rank counts it checked, and says so when the bound was missed
    from h3ms_async.tools.bench.model import table

    rows = [ok, {**ok, "world": 4}, {**ok, "world": 8}]
    report = {**report, "validation_bound_pct": VALIDATION_BOUND_PCT}
    held = table({**report, "validation": rows, "validated_on_gpu": within_bound(rows)})
    assert "Validated on this GPU" in held and "at 2, 4, 8 logical ranks" in held
    rows[2] = {**ok, "world": 8, "error_pct": 7.0}
    missed = table({**report, "validation": rows, "validated_on_gpu": within_bound(rows)})
    assert "NOT validated" in missed and "at 2, 4, 8 logical ranks" in missed
    assert "Not validated on a GPU in this run" in table(report)
    ulysses = [{**r, "pattern": "ulysses"} for r in rows]
    assert "at 2, 4, 8 logical ranks with the ulysses pattern" in table({**report, "validation": ulysses,
                                                                         "validated_on_gpu": False})


def test_the_overlaps_compute_is_timed_on_the_shard_alone(monkeypatch):
    """``ShardClock`` runs the largest rank's shard with each overlap's own kernels (head pieces, the qkv projection
    per gathered part, the tail in row pieces feeding the next block) and without, with nothing exchanged: its cost
    is what ``measure_parts`` puts in ``overlap_compute_frac`` when ``--validate`` names a schedule.  On CPU at a small
    width, each schedule runs the loop through its own exchange op and gives a finite, non-negative fraction."""
    from h3ms_async.dit.exactness import Overlap
    from h3ms_async.dit.reference import DiTConfig, ReferenceDiT
    from h3ms_async.tools.bench.model import ShardClock
    from workers.transports.exchange import NoExchange

    cfg = DiTConfig(hidden=128, layers=3, heads=8, head_dim=32, ffn=192, t_dim=16, rope_pairs=12)
    clock = ShardClock(ReferenceDiT(cfg, "bf16", 3).materialize(), cfg, 300, torch.device("cpu"))
    called: list[str] = []
    # 3 pieces of a rank's 4 heads: pieces of whole heads, not of equal columns
    ops = {"pieces3": "all_to_all_heads", "gather": "all_gather_rows_each", "ahead4": "all_gather_rows_produced"}
    for op in ops.values():
        def spy(self, *a, _real=getattr(NoExchange, op), _op=op, **k):
            called.append(_op)
            return _real(self, *a, **k)

        monkeypatch.setattr(NoExchange, op, spy)
    assert clock.seconds(2, blocks=3) > 0 and not called  # no overlap: none of their ops
    for name, op in ops.items():
        called.clear()
        frac = clock.overlap_cost(Overlap.from_name(name), 3)
        # a fraction of time, not a timing bound: a loaded CPU may make the small pieces cost any multiple
        assert op in called and 0.0 <= frac < math.inf, (name, called, frac)
    called.clear()
    assert 0.0 <= clock.overlap_cost(Overlap.from_name("gather+pieces4+ahead4"), 3) < math.inf
    assert {"all_to_all_heads", "all_gather_rows_produced"} <= set(called)


def test_validation_takes_the_time_slicing_over_the_overlapped_compute():
    """The no-exchange baseline of logical ranks runs the step's overlaps too, so the time-slicing term is that
    baseline over the model's compute *with* the overlaps' cost, and the checked prediction is the overlapped block
    plus it; the error is against the measured block; a Ulysses validation row takes the Ulysses prediction."""
    from h3ms_async.dit.exactness import Overlap
    from h3ms_async.tools.bench.model import validation_row

    parts = sm.parts_from_dict(json.loads(PARTS.read_text()))
    link = sm.Link("one-gpu", "host", 55.0, 40e-6, "test", False, d2h_gbps=55.0, shared=True)
    every = Overlap.from_name("gather+pieces4+ahead4")
    row = validation_row(parts, 2, link, every, 0.61, 0.65, [1.0, 0.7])
    pred = sm.predict(parts, 2, link, head_pieces=4, gather_overlap=True, gather_ahead=4)
    assert pred.compute_block_s > sm.predict(parts, 2, link).compute_block_s  # the overlaps cost compute
    assert row["sharing_s"] == pytest.approx(0.61 - pred.compute_block_s)
    assert row["predicted_shared_block_s"] == pytest.approx(pred.block_s + row["sharing_s"])
    assert row["error_pct"] == pytest.approx((row["predicted_shared_block_s"] - 0.65) / 0.65 * 100)
    assert validation_row(parts, 2, link, every, 0.0, 0.65, [])["sharing_s"] == 0.0  # never negative
    # the Ulysses pattern (--validate-pattern ulysses) is checked against its own prediction
    pieces = Overlap.from_name("pieces8")
    u_row = validation_row(parts, 4, link, pieces, 0.64, 0.66, [], "ulysses")
    u_pred = sm.predict(parts, 4, link, pattern="ulysses", head_pieces=8)
    assert u_row["pattern"] == "ulysses" and u_row["predicted_block_s"] == pytest.approx(u_pred.block_s)
    assert u_pred.block_s != pytest.approx(sm.predict(parts, 4, link, head_pieces=8).block_s)


def test_auto_pattern_is_the_faster_prediction_with_the_overlaps_it_may_run():
    """``pattern: auto`` loads the pattern the model predicts faster (``choose_pattern``, the H100 parts in the
    package): without overlaps that is the all-gather up to 6 host-staged ranks (its gather moves fewer bytes than
    Ulysses' q/k/v there); with the 8 head pieces (and, for the all-gather, 8 row pieces) that ``overlaps: auto``
    runs, Ulysses from 4 on PCIe Gen4 host staging, where its pieces hide both all-to-alls. NCCL hides nothing
    behind pieces: the all-gather up to 4 either way."""
    from h3ms_async.dit.exactness import NO_OVERLAP, Overlap

    none = {"gather": NO_OVERLAP, "ulysses": NO_OVERLAP}
    pieces = {"gather": Overlap(8, True, 8), "ulysses": Overlap(8)}

    def picks(transport: str, overlaps: dict, ranks=range(2, 9)) -> list[str]:
        return [sm.choose_pattern(5376, 56, 128, n, transport, overlaps) for n in ranks]

    assert picks("host", none) == ["gather"] * 5 + ["ulysses"] * 2
    assert picks("host", pieces) == ["gather"] * 2 + ["ulysses"] * 5
    assert picks("nccl", none) == picks("nccl", pieces) == ["gather"] * 3 + ["ulysses"] * 4
    # a pattern left out is not a choice; uneven shares are the model's too
    assert sm.choose_pattern(5376, 56, 128, 8, "host", {"gather": NO_OVERLAP}) == "gather"
    assert sm.choose_pattern(5376, 56, 128, 3, "host", pieces, shares=(1.0, 1.0, 0.5)) in ("gather", "ulysses")
    # each pick is the faster of the two predictions on the transport's usual link
    parts, link = sm.reference_parts(), sm.usual_link("host")
    for n, overlaps in ((4, pieces), (6, none), (7, none)):
        step = {p: sm.predict(parts, n, link, pattern=p, head_pieces=o.head_pieces, gather_overlap=o.gather,
                              gather_ahead=o.ahead).step_s for p, o in overlaps.items()}
        assert sm.choose_pattern(5376, 56, 128, n, "host", overlaps) == min(step, key=step.get), (n, step)
    with pytest.raises(ValueError, match="transport 'gloo'"):
        sm.usual_link("gloo")


def test_the_reference_parts_scale_to_another_width():
    """Another model width keeps the token count: the linears' time goes with hidden², attention's with heads x
    head_dim; at H3's own width the parts are the file's."""
    ref = sm.reference_parts()
    assert sm.parts_for_width(ref, 5376, 56, 128) == ref
    half = sm.parts_for_width(ref, 2688, 28, 128)
    a = ref.attention_fraction
    scale = (1 - a) / 4 + a / 2
    assert math.isclose(half.unsplit_block_s, ref.unsplit_block_s * scale)
    assert math.isclose(half.attention_fraction, a / 2 / scale)
    assert half.shape.hidden == 2688 and half.shape.columns == 28 * 128 and half.shape.tokens == ref.shape.tokens
    assert all(math.isclose(half.shard_block_s[n], t * scale) for n, t in ref.shard_block_s.items())
