"""Sparse attention (H3 MS Sparse Attention) on CPU: the settings, the per-block decisions, the sinks, the plumbing
through real CPU rank workers, the one-line dense fallback and the sampling-end reset message.

comfy-kitchen has no CPU sparse attention kernel (``sol_attn`` needs CUDA SM >= 8.0), so on CPU the kernel path
itself cannot run: a CPU split with sparse settings must run dense, say so in one log line and equal the dense split.
The kernel path (split == unsplit sparse, pooled statistics across steps) runs in tests/test_sparse_cuda.py, and on CPU
through the pack's stand-in for the kernel in tests/test_sparse_exactness.py (with the probe and verify).
"""
from __future__ import annotations

import logging
import math

import msgspec
import pytest
import torch

from h3ms_async.dit.layout import build_layout
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.sparse import DenseFallback, SparseSettings, UnsplitSparse, branch_key, parse_block_list
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.split import SplitEngine
from workers.dit import protocol as dit_protocol
from workers.dit.sparse import (PooledStats, SparseConfig, dense_reason, kernel_unavailable, sinks, sparse_step,
                                target_starts)
from workers.runtime.protocol import Dropped, decode, encode

CFG = DiTConfig(hidden=128, layers=2, heads=8, head_dim=32, ffn=192, t_dim=16, rope_pairs=12)


# --- settings ------------------------------------------------------------------------------------------------------

def test_block_list_parses_indices_and_ranges():
    assert parse_block_list("0, 1, 47-49") == (0, 1, 47, 48, 49)
    assert parse_block_list(" 5 ,3, 3-4,, ") == (3, 4, 5)
    assert parse_block_list("") == ()


@pytest.mark.parametrize("text, match", [("0, x", "'x' is not a block index"), ("9-3", "runs backwards"),
                                         ("1;2", "is not a block index"), ("-1", "is not a block index")])
def test_block_list_errors_name_the_input(text, match):
    with pytest.raises(ValueError, match=f"dense_blocks: .*{match}"):
        parse_block_list(text)


@pytest.mark.parametrize("kw, match", [
    ({"method": "vsa"}, "method='vsa'"), ({"tau": 5.0}, "tau=5"), ({"keep_percent": 0.1}, "keep_percent=0.1"),
    ({"start_percent": 1.5}, "start_percent=1.5"), ({"start_percent": 0.6, "end_percent": 0.5}, "end_percent=0.5"),
    ({"min_tokens": -1}, "min_tokens=-1"), ({"extra_tokens": 100}, "extra_tokens=100"),
    ({"sink_conditioning": "all"}, "sink_conditioning='all'"), ({"dense_blocks": "a"}, "dense_blocks"),
])
def test_settings_errors_name_the_input_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        SparseSettings(**kw)
    assert any(w in str(err.value) for w in ("must", "choose", "set", "write"))


def test_resolve_maps_the_window_to_sigmas_and_checks_blocks():
    s = SparseSettings(method="top-k", keep_percent=12.5, start_percent=0.2, end_percent=0.9, dense_blocks="0, 1")
    cfg = s.resolve(lambda p: 1.0 - p, layers=2)
    assert (cfg.topk_ratio, cfg.sigma_start, cfg.dense_blocks) == (0.125, 0.8, (0, 1))
    assert cfg.sigma_end == pytest.approx(0.1)
    assert cfg.method == "top-k"
    assert SparseSettings().resolve(None, 50).sigma_start == math.inf
    # ComfyUI's percent 0 is a sigma above any schedule: an open start
    assert SparseSettings(start_percent=0.0).resolve(lambda p: 999999999.9 if p <= 0 else 1 - p, 50).sigma_start \
        == math.inf
    with pytest.raises(ValueError, match=r"dense_blocks: block\(s\) \[2\] do not exist; the model has blocks 0-1"):
        SparseSettings(dense_blocks="2").resolve(None, layers=2)


def test_config_round_trips_the_wire_and_validates():
    cfg = SparseSettings(dense_blocks="3-4").resolve(lambda p: 1.0 - p, 50)
    step = dit_protocol.SparseStepSettings(cfg, 0.5, "")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=dit_protocol.SparseStepSettings) == step
    open_start = SparseConfig()
    assert open_start.as_json()["sigma_start"] is None and msgspec.msgpack.decode(
        msgspec.msgpack.encode(open_start), type=SparseConfig) == open_start
    with pytest.raises(msgspec.ValidationError, match="tau"):  # the wire validates as the constructor does
        msgspec.msgpack.decode(msgspec.msgpack.encode({**open_start.as_json(), "sigma_start": 1.0, "tau": 99.0}),
                               type=SparseConfig)
    for kw, match in (({"topk_ratio": 1.0}, "topk_ratio"), ({"sigma_start": 0.1, "sigma_end": 0.5}, "sigma window"),
                      ({"extra_tokens": 65}, "extra_tokens"), ({"dense_blocks": (-1,)}, "dense_blocks")):
        with pytest.raises(ValueError, match=match):
            SparseConfig(**kw)


# --- per-block decisions and sinks ---------------------------------------------------------------------------------

def test_dense_where_the_settings_say_dense():
    cfg = SparseConfig(sigma_start=0.8, sigma_end=0.1, min_tokens=1000, dense_blocks=(0, 49))
    assert dense_reason(cfg, 0.5, 5000, 3) is None
    assert dense_reason(cfg, None, 5000, 3) is None  # no sigma (standalone): the window does not apply
    assert "outside" in dense_reason(cfg, 0.9, 5000, 3)
    assert "outside" in dense_reason(cfg, 0.05, 5000, 3)
    assert dense_reason(cfg, 0.8, 5000, 3) is None and dense_reason(cfg, 0.1, 5000, 3) is None  # bounds included
    assert "min_tokens" in dense_reason(cfg, 0.5, 999, 3)
    assert "dense_blocks" in dense_reason(cfg, 0.5, 5000, 49)


def test_sinks_cover_the_conditioning_prefix():
    lay = build_layout(9, 3, 4, 6, 8, keyframes=1, sigma=0.7)
    kinds = [k for _, _, k in lay.segments]
    audio = next(a for a, _, k in lay.segments if k == "audio")
    video = next(a for a, _, k in lay.segments if k == "video")
    assert kinds[-2:] == ["audio", "video"] and target_starts(lay.mod_segments) == (audio, video)
    both = sinks(SparseConfig(), (audio, video))
    assert both == ((0, -(-video // 64)), (audio // 64, -(-video // 64)))
    assert sinks(SparseConfig(sink_conditioning="exact_kv"), (audio, video)) == ((0, -(-video // 64)), (0, 0))
    assert sinks(SparseConfig(sink_conditioning="off"), (audio, video)) == ((0, 0), (0, 0))
    assert sinks(SparseConfig(), (0, 0)) == ((0, 0), (0, 0))
    assert target_starts([(0, 5, 0)]) is None


def test_sparse_step_from_the_wire_and_branch_keys():
    lay = build_layout(9, 3, 4, 6, 8, keyframes=1, sigma=0.7)
    cfg = SparseConfig(topk_ratio=0.1)
    wire = dit_protocol.SparseStepSettings(cfg, 0.5, branch_key(["u1", "u2"]))
    step = sparse_step(wire, PooledStats(), (2, 5), lay.mod_segments)
    assert (step.config, step.sigma, step.branch, step.heads) == (cfg, 0.5, "u1,u2", (2, 5))
    assert (step.sink_blocks, step.sink_q) == sinks(cfg, target_starts(lay.mod_segments))


def test_dit_step_carries_the_sparse_field():
    lay = build_layout(9, 3, 4, 6, 8, sigma=0.7)
    wire = dit_protocol.SparseStepSettings(SparseConfig(), None, "")
    desc = dict(seg="h3ms-1-0000abcd-step", off=0, dtype="bfloat16", shape=[1])
    from workers.runtime.protocol import TensorDesc
    msg = dit_protocol.DitStep(job=1, x=TensorDesc(**desc), modulation=TensorDesc(**desc), rope=TensorDesc(**desc),
                               segments=[tuple(s) for s in lay.mod_segments], tokens=(0, 1), arena="", layout={},
                               exchange="none", chunks=0, abort_gen=0, deadline_s=1.0, blocks=(0, 1),
                               residency="auto", sparse=wire)
    back = decode(encode(msg)[4:])
    assert back.sparse == wire and back.sparse.config == SparseConfig()
    assert decode(encode(dit_protocol.DitSparseReset())[4:]).kind == "dit_sparse_reset"


# --- the dense fallback line ----------------------------------------------------------------------------------------

def test_kernel_cannot_run_on_cpu():
    reason = kernel_unavailable(torch.device("cpu"))
    assert "not a CUDA device" in reason and "no CPU sparse attention kernel" in reason


def test_fallback_logs_one_line_per_reason(caplog):
    fb = DenseFallback()
    with caplog.at_level(logging.WARNING, logger="h3_multistream"):
        for _ in range(3):
            assert fb.blocked(torch.bfloat16, 128, [None, "rank 1 cannot"]) == "rank 1 cannot"
        assert "float32" in fb.blocked(torch.float32, 128, [None])
        assert "head_dim is 64" in fb.blocked(torch.bfloat16, 64, [None])
        assert fb.blocked(torch.bfloat16, 128, [None, None]) is None
    lines = [r.getMessage() for r in caplog.records if "sparse attention cannot run" in r.getMessage()]
    assert len(lines) == 3, lines


def test_unsplit_reference_on_cpu_runs_dense_with_one_line(caplog):
    model = ReferenceDiT(CFG, weights="int8", seed=5)
    lay = build_layout(9, 3, 4, 6, 8, keyframes=1, sigma=0.7)
    inp = make_step_inputs(CFG, lay, 3, model.dtype)
    dense = model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)
    sparse = UnsplitSparse(SparseConfig(min_tokens=0))
    with caplog.at_level(logging.WARNING, logger="h3_multistream"):
        for _ in range(2):
            out = model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs, sparse=sparse,
                                       sigma=0.5)
            assert torch.equal(out, dense)
    lines = [r.getMessage() for r in caplog.records if "sparse attention cannot run" in r.getMessage()]
    assert len(lines) == 1 and "cpu is not a CUDA device" in lines[0]
    assert len(sparse.stats) == 0 and sparse.end_sampling() == 0


def test_cpu_split_with_sparse_settings_runs_dense_says_so_once_and_equals_the_dense_split(caplog):
    """The plumbing through real rank workers: the ranks report that the kernel cannot run on them (dit_load), the
    engine logs it once, sends dense steps (every rank agrees), and the result is the dense split's, bit for bit."""
    model = ReferenceDiT(CFG, weights="int8", seed=5)
    lay = build_layout(9, 3, 4, 6, 8, keyframes=1, sigma=0.7)
    eng = SplitEngine(["cpu"] * 3, SplitOptions(sparse=SparseConfig(min_tokens=0)))
    try:
        eng.load_weights(("sparse-cpu",), CFG, model.block_weights)
        assert eng._sparse_kernel and all("not a CUDA device" in r for r in eng._sparse_kernel)
        with caplog.at_level(logging.WARNING, logger="h3_multistream"):
            for s in range(2):
                inp = make_step_inputs(CFG, lay, 20 + s, model.dtype)
                ref = model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)
                out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, sigma=0.5,
                                     sparse_branch="b")
                assert torch.equal(out, ref), f"step {s}"
                assert all(r.sparse is None for r in eng.last_rank_results)
        lines = [r.getMessage() for r in caplog.records if "sparse attention cannot run" in r.getMessage()]
        assert len(lines) == 1, lines
        assert eng.end_sampling() == 0  # nothing ran sparse: no message
        assert eng.snapshot()["options"]["sparse"]["min_tokens"] == 0
    finally:
        eng.release()


def test_reset_message_reaches_every_rank():
    """``dit_sparse_reset`` is served by every rank (what end_sampling sends once a step ran sparse)."""
    from h3ms_async.runtime.coordinator import get_coordinator
    model = ReferenceDiT(CFG, weights="int8", seed=5)
    eng = SplitEngine(["cpu"] * 2, SplitOptions())
    try:
        eng.load_weights(("sparse-reset",), CFG, model.block_weights)
        results = get_coordinator().run(eng.pool.all([dit_protocol.DitSparseReset()] * 2, 30.0), 60, "reset")
        assert results == [Dropped(dropped=0), Dropped(dropped=0)]
    finally:
        eng.release()
