"""Benchmarks at minimal sizes: the split bench's JSON shape and bit-exactness on 2 CPU ranks, its input errors,
and the exchange bench's report shape (the IPC bench has its smoke test in test_pool.py)."""
from __future__ import annotations

import glob
import os

import psutil
import pytest

from h3ms_async.tools.bench.exchange import run_bench_exchange
from h3ms_async.tools.bench.split import main as bench_split_main
from h3ms_async.tools.bench.split import run_bench_split
from workers.runtime.shm import held_shm

RANK_KEYS = {"rank", "device", "tokens", "heads", "compute_s", "exchange_copy_s", "wait_s", "moved_bytes",
             "signals_per_step", "signals_per_block", "wait_per_block_ms", "signalling_per_block_us_est",
             "vram_peak_bytes", "block_ms"}
BLOCK_KEYS = {"compute_ms", "copy_ms", "hidden_ms", "exposed_ms", "block_ms", "exposed_pct"}


def _ours() -> set:
    """This process's child pids, shm segments and run dirs (other tests in the session may hold some already, so
    the tests compare before and after)."""
    pid = os.getpid()
    return ({c.pid for c in psutil.Process().children(recursive=True)}
            | held_shm(pid) | set(glob.glob(f"/tmp/h3ms-{pid}-*")))


@pytest.mark.timeout(120)
def test_bench_split_tiny_two_cpu_ranks():
    before = _ours()
    rep = run_bench_split(ranks=["cpu", "cpu"], tokens=300, layers=2, hidden=64, heads=4, head_dim=16,
                          weights="int8", steps=1, warmup=1, chunks=(0, 2), exchanges=("host", "nccl", "none"),
                          probe_rounds=5, print_json=False)
    assert rep["bench"] == "split"
    assert rep["bit_exact"] is True and rep["max_abs_diff"] == 0.0
    assert rep["machine"]["cpu_count"] == os.cpu_count() and rep["machine"]["torch"]
    assert rep["config"]["tokens"] == 300 and rep["config"]["ranks"] == ["cpu", "cpu"]
    un = rep["unsplit"]
    assert len(un["step_s"]) == 1 and un["block_mean_s"] == pytest.approx(un["step_mean_s"] / 2)

    labels = [v["label"] for v in rep["split"]]
    assert labels == ["host x1", "host x2", "gloo", "none"]
    by = {v["label"]: v for v in rep["split"]}
    assert by["none"]["bit_exact"] is None  # the baseline's ranks exchange nothing: its output is not compared
    for v in rep["split"]:
        assert v["bit_exact"] in (True, None) and len(v["step_s"]) == 1 and v["step_mean_s"] > 0
        # where a block's time went, averaged: per rank and over the ranks, compute + exposed being the block
        for block in [v["block_ms"], *(r["block_ms"] for r in v["ranks"])]:
            assert set(block) == BLOCK_KEYS and block["compute_ms"] > 0
            assert block["block_ms"] == pytest.approx(block["compute_ms"] + block["exposed_ms"])
            assert block["hidden_ms"] <= block["copy_ms"]
        exchanged = v["exchange"] != "none"
        assert (v["block_ms"]["copy_ms"] > 0) == exchanged and (v["block_ms"]["exposed_pct"] > 0) == exchanged
        assert len(v["ranks"]) == 2 and all(set(r) == RANK_KEYS for r in v["ranks"])
        assert [r["tokens"] for r in v["ranks"]] == [[0, 150], [150, 300]]
        assert (v["moved_bytes_per_step"] > 0) == exchanged
    # Doorbells: more chunks, more signals per block; torch.distributed sends none of ours.
    host1, host2 = by["host x1"]["ranks"][0], by["host x2"]["ranks"][0]
    assert 0 < host1["signals_per_block"] < host2["signals_per_block"]
    assert by["gloo"]["ranks"][0]["signals_per_block"] == 0
    assert by["gloo"]["ranks"][0]["signalling_per_block_us_est"] is None
    # The same bytes cross between ranks whatever the transport or chunking.
    assert by["host x1"]["moved_bytes_per_step"] == by["host x2"]["moved_bytes_per_step"] \
        == by["gloo"]["moved_bytes_per_step"]

    probe = rep["signal_probe"]
    assert probe["world"] == 2 and probe["signals_per_chunk_round_per_rank"] == pytest.approx(1.0)
    assert probe["per_signal_us"] is not None
    assert host2["signalling_per_block_us_est"] == pytest.approx(host2["signals_per_block"] * probe["per_signal_us"])
    assert set(rep["comparisons"]["unsplit_over_split"]) == set(labels)
    assert set(rep["comparisons"]["host_serial_over_chunked"]) == {"host x2"}
    assert "host_serial_over_gloo" in rep["comparisons"]
    assert set(rep["comparisons"]["block_over_no_exchange"]) == {"host x1", "host x2", "gloo"}

    assert _ours() <= before


@pytest.mark.parametrize("argv, message", [
    (["--chunks", "40"], "exchange_chunks=40"),
    (["--exchange", "tcp"], "exchange ['tcp']"),
    (["--ranks", "cpu,cpu", "--tokens", "300", "--heads", "1"], "1 attention heads"),
])
def test_bench_split_rejects_bad_input_before_starting_anything(argv, message, capsys):
    before = _ours()
    assert bench_split_main(argv) == 2
    assert message in capsys.readouterr().err
    assert _ours() <= before


@pytest.mark.timeout(120)
def test_bench_exchange_minimal_report():
    before = _ours()
    rep = run_bench_exchange(world=(2,), tokens=64, width=32, chunks=(0, 2), transport=("host", "gloo"), rounds=2)
    assert rep["unix_msgpack_rtt_us"] > 0
    assert {(r["transport"], r["chunks"]) for r in rep["results"]} == {("host", 0), ("host", 2), ("gloo", 0),
                                                                       ("gloo", 2)}
    for r in rep["results"]:
        assert r["world"] == 2 and r["block_ms"] > 0 and r["bytes_per_block"] > 0
    assert [s["mode"] for s in rep["signalling"]] == ["no spin", "spin 50 us"]
    assert "Direct signalling" in rep["choice"]
    assert _ours() <= before


@pytest.mark.timeout(300)
def test_bench_invariance_tiny_and_a_faulty_shape(monkeypatch):
    """The CPU variant's table: every linear at every row count (start, middle, end), attention per head count,
    the engine's decision per size and the probe's cost; a shape made to round differently on purpose shows up in
    all three places where it should, and nowhere else."""
    from h3ms_async.tools.bench.invariance import TINY, run_bench_invariance
    from workers.dit import ops as dit_ops
    from workers.testing.faults import ShapeFault
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault("linear", (5, TINY.ffn)))
    rep = run_bench_invariance(tiny=True, rows=(2, 5, 16), kinds=("int8",), print_json=False)
    assert rep["bench"] == "invariance" and rep["machine"]["device"].startswith("cpu ")
    by_op = {t["op"]: t for t in rep["linears"]}
    assert set(by_op) == {"attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"}
    assert by_op["mlp.fc2"]["rows"]["5"] == {"start": False, "middle": False, "end": False,
                                             "max_abs_diff": by_op["mlp.fc2"]["rows"]["5"]["max_abs_diff"]}
    assert by_op["mlp.fc2"]["rows"]["5"]["max_abs_diff"] > 0
    engine = {e["rows"]: e["engine"] for e in rep["engine"]}
    assert engine[5] == "adjusted to [16, 184]" and engine[16] == "exact"
    assert [a["kernel"] for a in rep["attention"]] == ["sdpa"]
    assert set(rep["attention"][0]["heads"]) == {"1", "2", "3"}
    cost = rep["probe_cost"][0]
    assert cost["probe_ms"] > 0 and cost["step_ms_est"] == pytest.approx(cost["block_ms"] * TINY.layers)


def test_bench_gpu_names_every_exchange_it_times():
    """Each exchange ``bench gpu --exchange`` takes, and the no-exchange baseline it adds, resolves to the transport
    and ordering the split then runs (``cuda_ipc_events`` is no transport's own name: the GPU-direct exchange ordered
    by CUDA IPC events)."""
    from h3ms_async.tools.bench.gpu import STAGED, staged
    from workers.dit.protocol import IpcSync, Transport
    assert {name: staged(name) for name in [*STAGED, "none"]} == {
        "host": (Transport.HOST, None), "cuda_ipc": (Transport.CUDA_IPC, IpcSync.HOST),
        "cuda_ipc_events": (Transport.CUDA_IPC, IpcSync.EVENTS), "none": (Transport.NONE, None)}


def test_bench_gpu_summarizes_every_rank_count_against_its_own_baseline():
    """``bench gpu --ranks 2,4`` divides each split by the no-exchange baseline of the same ranks: its runs at 4
    logical ranks are summarized with the 4-rank baseline, not the 2-rank one, under ``split4_`` keys."""
    from h3ms_async.tools.bench.gpu import summarize

    def run(mode, exchange, per_block, overlap="none", chunks=8, residency="resident"):
        return {"kind": "int8", "tokens": 75794, "mode": mode, "residency": residency, "exchange": exchange,
                "chunks": chunks, "overlap": overlap, "overlap_ran": overlap, "per_block_s": per_block,
                "bit_exact": exchange == "none" or None, "block_ms": {"block_ms": per_block * 1e3, "exposed_pct": 1.0}}

    runs = [{"kind": "int8", "tokens": 75794, "mode": "unsplit", "per_block_s": 0.5},
            run("split2", "host", 0.64), run("split2", "cuda_ipc", 0.62), run("split2", "none", 0.60),
            run("split4", "host", 0.68), run("split4", "cuda_ipc", 0.63, "gather+pieces4+ahead4"),
            run("split4", "none", 0.62), run("split4", "host", 0.70, residency="stream")]
    case = summarize({"runs": runs, "copy_bandwidth": {}})["by_case"][0]
    assert case["split2_best_vs_baseline"] == pytest.approx(0.62 / 0.60)
    assert case["split4_best_vs_baseline"] == pytest.approx(0.63 / 0.62)
    assert case["split4_baseline_vs_unsplit"] == pytest.approx(0.62 / 0.5)
    assert case["split4_cuda_ipc_x8_gather+pieces4+ahead4_block_vs_baseline"] == pytest.approx(0.63 / 0.62)
    assert case["split4_x8_block_vs_baseline"] == pytest.approx(0.68 / 0.62)
    assert case["split4_stream_vs_resident"] == pytest.approx(0.70 / 0.68) and "split2_stream_vs_resident" not in case
