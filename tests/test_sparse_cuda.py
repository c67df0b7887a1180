"""Sparse attention in the split on CUDA (skipped without a GPU; run on the device machine by
``benchmarks/device_run.sh sparse``).

Exactness here means: the split with sparse attention gives the same bits as the same sparse attention computed on
one GPU (the engine's unsplit path, ``ReferenceDiT.forward_blocks(sparse=UnsplitSparse(...))``), not the same as dense
attention. Each rank runs comfy-kitchen's ``sol_attn_chunked`` over its own heads with every token of them, so per-head
block selection is the unsplit run's. Covered: 2, 3 (uneven shares 1, 2, 1) and 4 logical ranks on cuda:0 and the
one-rank engine; Sol-Attn (tau) and top-k; the first step after the workers start; several steps of two conditioning
branches so the pooled statistics are reused (and checked to be: ``stats_reused``); a dense block and a step outside
the sigma window; the reset at sampling end (the next step starts from fresh statistics again); the invariance probe's
sparse ops and ``verify`` of the first sparse step against the same sparse attention unsplit.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: comfy-kitchen's sparse attention "
                                 "kernel (sol_attn) needs CUDA SM >= 8.0 and has no CPU version; run these on a GPU "
                                 "machine, e.g. benchmarks/device_run.sh sparse")]

from h3ms_async.dit import exactness  # noqa: E402
from h3ms_async.dit.layout import layout_for_tokens  # noqa: E402
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs  # noqa: E402
from h3ms_async.dit.sparse import UnsplitSparse  # noqa: E402
from h3ms_async.dit.options import SplitOptions  # noqa: E402
from h3ms_async.dit.split import SplitEngine  # noqa: E402
from h3ms_async.status.hub import get_hub  # noqa: E402
from workers.dit.sparse import SparseConfig, kernel_unavailable  # noqa: E402

CFG = DiTConfig(hidden=1024, layers=3, heads=16, head_dim=128, ffn=2816, t_dim=256, rope_pairs=48)
TOKENS = 8192
#: Sol-Attn and top-k; block 1 dense; sparse between sigma 0.95 and 0.2
METHODS = {"sol-attn": SparseConfig(tau=1.3, sigma_start=0.95, sigma_end=0.2, min_tokens=4096, dense_blocks=(1,)),
           "top-k": SparseConfig(topk_ratio=0.1, sigma_start=0.95, sigma_end=0.2, min_tokens=4096, dense_blocks=(1,),
                                 extra_tokens=0, sink_conditioning="exact_kv")}
#: (sigma, conditioning branch) per step: two branches as a CFG sampler runs them, then a step past the window
STEPS = [(0.9, "cond"), (0.9, "uncond"), (0.6, "cond"), (0.6, "uncond"), (0.3, "cond"), (0.1, "cond")]


@pytest.fixture(scope="module")
def model():
    if kernel_unavailable(torch.device("cuda:0")) is not None:
        pytest.skip(f"sparse kernel unavailable: {kernel_unavailable(torch.device('cuda:0'))}")
    m = ReferenceDiT(CFG, weights="int8", seed=31, device="cuda")
    inp = make_step_inputs(CFG, layout_for_tokens(TOKENS), 1, m.dtype)
    m.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda())  # warm (tests/test_cuda.py)
    return m


def _inputs(s: int):
    return make_step_inputs(CFG, layout_for_tokens(TOKENS, sigma=STEPS[s][0]), 100 + s, torch.bfloat16)


def _reference(model: ReferenceDiT, cfg: SparseConfig) -> list[torch.Tensor]:
    """The unsplit sparse run of every step, from fresh statistics, in order."""
    unsplit = UnsplitSparse(cfg)
    outs = []
    for s, (sigma, branch) in enumerate(STEPS):
        inp = _inputs(s)
        outs.append(model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda(),
                                         sparse=unsplit, sigma=sigma, branch=branch).cpu())
    assert len(unsplit.stats) == 2 * (CFG.layers - 1)  # (block, rows, heads, branch): blocks 0, 2 x two branches
    return outs


def _check_split(eng: SplitEngine, model: ReferenceDiT, refs: list[torch.Tensor], what: str) -> None:
    seen: set[str] = set()
    for s, (sigma, branch) in enumerate(STEPS):
        inp = _inputs(s)
        out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, sigma=sigma,
                             sparse_branch=branch,
                             exchange_chunks=8)
        diff = (out.float() - refs[s].float()).abs().max().item()
        assert torch.equal(out, refs[s]), f"{what} step {s} (sigma {sigma}, {branch}): max |diff| {diff:g}"
        counts = [r.sparse for r in eng.last_rank_results]
        inside = 0.2 <= sigma <= 0.95
        assert all(c["sparse_blocks"] == (2 if inside else 0) for c in counts), counts
        assert all(c["stats_reused"] == (2 if inside and branch in seen else 0) for c in counts), (s, counts)
        if inside:
            seen.add(branch)
    assert eng.end_sampling() == eng.ranks * 2 * (CFG.layers - 1)
    assert eng.end_sampling() == 0


@pytest.fixture(scope="module")
def refs(model):
    return {name: _reference(model, cfg) for name, cfg in METHODS.items()}


@pytest.mark.parametrize("method", list(METHODS))
def test_sparse_differs_from_dense(model, method):
    """The settings really attend sparse (else every comparison below would be dense == dense), and the unsplit
    sparse run is deterministic (run twice from fresh statistics: the same bits)."""
    inp = _inputs(0)
    dense = model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda())
    runs = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda(),
                                 sparse=UnsplitSparse(METHODS[method]), sigma=STEPS[0][0]) for _ in range(2)]
    assert torch.equal(runs[0], runs[1]), "the sparse kernel is not deterministic run to run"
    assert not torch.equal(dense, runs[0])


@pytest.mark.parametrize("ranks, shares", [(1, None), (2, None), (3, (1.0, 2.0, 1.0)), (4, None)])
def test_split_sparse_equals_unsplit_sparse(model, refs, ranks, shares):
    """Fresh workers (first step after start included), both methods on the same workers: the second one starts
    after end_sampling, i.e. from fresh statistics again."""
    eng = SplitEngine(["cuda:0"] * ranks, SplitOptions(shares=shares))
    try:
        eng.load_weights(("sparse-cuda", "int8"), CFG, model.block_weights)
        for name, cfg in METHODS.items():
            eng.options = replace(eng.options, sparse=cfg)
            _check_split(eng, model, refs[name], f"{ranks} ranks {name}")
    finally:
        eng.release()


def test_bf16_weights_two_ranks(model):
    bf16 = ReferenceDiT(CFG, weights="bf16", seed=31, device="cuda")
    cfg = METHODS["sol-attn"]
    refs = _reference(bf16, cfg)
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(sparse=cfg))
    try:
        eng.load_weights(("sparse-cuda", "bf16"), CFG, bf16.block_weights)
        _check_split(eng, bf16, refs, "2 ranks bf16 sol-attn")
    finally:
        eng.release()


def test_sparse_ops_are_probed_and_the_first_sparse_step_verified(model, refs, monkeypatch):
    """verify with sparse attention on 2 logical ranks: the probe measures the sparse ops (the qkv projection in the
    kernel's row chunks, the kernel per head group from fresh and pooled statistics) exact on the GPU, the prompt's
    first step (inside the window) is verified bit-exact against the same sparse attention unsplit on cuda:0, and every
    step still equals the unsplit sparse run."""
    hub = get_hub()
    seen: list[dict] = []
    record = hub.record_verify
    monkeypatch.setattr(hub, "record_verify", lambda rec: seen.append(record(rec)) or seen[-1])
    exactness.VERDICTS.clear()  # probe this plan here, whatever the tests above cached
    eng = SplitEngine(["cuda:0"] * 2, SplitOptions(sparse=METHODS["sol-attn"], verify=True))
    try:
        eng.load_weights(("sparse-cuda", "int8"), CFG, model.block_weights)
        _check_split(eng, model, refs["sol-attn"], "2 ranks sol-attn verified")
        assert len(seen) == 1 and seen[0]["bit_exact"] and seen[0]["first_difference"] is None, seen
        rows = [r for r in hub.status()["exactness"]["verdicts"] if r["op"] in exactness.SPARSE_OPS][-2:]
        assert [r["op"] for r in rows] == list(exactness.SPARSE_OPS) and {r["verdict"] for r in rows} == {"exact"}
    finally:
        eng.release()
