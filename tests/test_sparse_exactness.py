"""Sparse attention measured like dense, on real CPU rank workers: the invariance probe covers the sparse ops (the
qkv projection in the kernel's row chunks, the kernel over each head group, from fresh and from pooled statistics) and
``verify`` compares a split sparse step with the same sparse attention unsplit on the model's device.

comfy-kitchen's chunked kernel (``sol_attn_chunked``) is CUDA-only; here the ranks and this process run the pack's CPU
stand-in for it (``workers.testing.ck_sparse_cpu``: kitchen's eager ``sol_attn`` behind the chunked call, the pooled
statistics used and returned), so the split path, the probe and verify run end to end. A one-ulp fault in the sparse
kernel's output (``H3MS_TEST_SHAPE_FAULT=sparse:HEADS``, ``workers.testing.faults.ShapeFault``) shows the probe and
verify catch a difference, so neither passes vacuously.
"""
from __future__ import annotations

import logging

import pytest
import torch

from h3ms_async.dit import exactness, verify
from h3ms_async.dit.layout import build_layout
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.sparse import UnsplitSparse
from workers.dit.protocol import ProbeShard, SparseStepSettings
from h3ms_async.dit.split import SplitEngine
from h3ms_async.status.hub import get_hub
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit import sparse as dit_sparse
from workers.dit.sparse import SparseConfig
from workers.runtime.shm import dtype_name
from workers.testing import ck_sparse_cpu
from workers.testing.faults import ShapeFault
from split_checks import fault_engines

#: head_dim 128 and a bfloat16 stream: what the kernel takes
CFG = DiTConfig(hidden=256, layers=2, heads=4, head_dim=128, ffn=384, t_dim=16, rope_pairs=12)
#: sparse between sigma 0.8 and 0.2, every length
SPARSE = SparseConfig(sigma_start=0.8, sigma_end=0.2, min_tokens=0)
#: (sigma, conditioning branch) per step of one prompt: above the window (dense), then two sparse steps of two
#: branches, the second of each branch reusing the pooled statistics of the first
STEPS = [(0.9, "cond"), (0.6, "cond"), (0.6, "uncond"), (0.4, "cond"), (0.4, "uncond")]


@pytest.fixture(scope="module")
def model():
    return ReferenceDiT(CFG, weights="int8", seed=5)


@pytest.fixture
def kernel(monkeypatch):
    """The CPU stand-in, here (the unsplit references, verify's unsplit run) and in the workers this test starts."""
    monkeypatch.setenv(ck_sparse_cpu.ENV, "1")
    ck_sparse_cpu.install()
    yield
    ck_sparse_cpu.uninstall()


@pytest.fixture
def engine(monkeypatch, kernel, model):
    engines = fault_engines(monkeypatch)
    make = next(engines)

    def loaded(fault: str | None = None, **opts) -> SplitEngine:
        eng = make(fault, sparse=SPARSE, **opts)
        eng.load_weights(("sparse-exactness", fault), CFG, model.block_weights, compute_dtype=torch.bfloat16)
        return eng

    yield loaded
    next(engines, None)  # release them all, and check nothing is left


def _inputs(s: int):
    inp = make_step_inputs(CFG, build_layout(88, 3, 4, 6, 8, keyframes=1, sigma=STEPS[s][0]), 40 + s, torch.bfloat16)
    assert inp.x.shape[0] == 200
    return inp


def _sparse_refs(model: ReferenceDiT, n: int = len(STEPS)) -> list[torch.Tensor]:
    """The first ``n`` steps unsplit with the same sparse attention over every head (its own pooled statistics, in
    step order)."""
    unsplit = UnsplitSparse(SPARSE)
    out = []
    for s, (sigma, branch) in enumerate(STEPS[:n]):
        inp = _inputs(s)
        out.append(model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs, sparse=unsplit,
                                        sigma=sigma, branch=branch))
    return out


def _dense_ref(model: ReferenceDiT, s: int) -> torch.Tensor:
    inp = _inputs(s)
    return model.forward_blocks(inp.x.clone(), inp.t_emb, inp.segments, inp.rope_freqs)


def _run(eng: SplitEngine, model: ReferenceDiT, s: int) -> torch.Tensor:
    inp = _inputs(s)
    sigma, branch = STEPS[s]
    return eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, sigma=sigma,
                          sparse_branch=branch)


@pytest.fixture
def verified(monkeypatch):
    """The verify results recorded from here on."""
    hub = get_hub()
    seen: list[dict] = []
    record = hub.record_verify
    monkeypatch.setattr(hub, "record_verify", lambda rec: seen.append(record(rec)) or seen[-1])
    return seen


def test_sparse_split_is_measured_and_verified_bit_exact(engine, model, verified):
    """The probe measures the sparse ops exact; verify waits for the prompt's first sparse step (the first step is
    above the window), finds it bit-exact against the same sparse attention unsplit, and checks nothing else in the
    prompt; every step equals the unsplit sparse run (so the ranks' pooled statistics equal the unsplit run's), not
    the dense one. The next prompt's first step is verified from fresh statistics on both sides."""
    refs = _sparse_refs(model)
    eng = engine(verify=True)
    for s, (sigma, branch) in enumerate(STEPS):
        out = _run(eng, model, s)
        assert torch.equal(out, refs[s]), f"step {s} (sigma {sigma}, {branch})"
        counts = [r.sparse for r in eng.last_rank_results]
        inside = s > 0
        assert all(c["sparse_blocks"] == (CFG.layers if inside else 0) for c in counts), (s, counts)
        assert all(c["stats_reused"] == (CFG.layers if s >= 3 else 0) for c in counts), (s, counts)
        assert inside == (not torch.equal(out, _dense_ref(model, s))), s
        assert len(verified) == (1 if inside else 0), s
    v = verified[0]
    assert v["bit_exact"] and v["max_abs_diff"] == 0.0 and v["first_difference"] is None
    probed = [op for op in invariance.OP_ORDER if op not in exactness.OVERLAP_OPS]
    rows = {r["op"]: r for r in get_hub().status()["exactness"]["verdicts"][-len(probed):]}
    assert list(rows) == probed
    assert {r["verdict"] for r in rows.values()} == {"exact"}
    assert rows["attn.qkv_proj.chunks"]["shards"] == [200, 200] and rows["attention.sparse"]["shards"] == [2, 2]
    # a new prompt whose first step is sparse, the last one's statistics still on the ranks (its sampling end never
    # came): verify drops them first, as its unsplit run starts without any
    eng.new_prompt()
    assert torch.equal(_run(eng, model, 1), refs[1])
    assert len(verified) == 2 and verified[1]["bit_exact"]
    assert eng.end_sampling() == eng.ranks * CFG.layers  # (block, rows, heads, branch): this step's only


def test_verify_names_a_sparse_kernel_difference_the_probe_cannot_see(engine, model, verified):
    """The sparse kernel's output over a 2-head group is one ulp off in its first row on steps only: the probe passes
    the plan, verify reports the step not bit-exact, first at block 0's attention, and the split result stands."""
    refs = _sparse_refs(model, 2)
    eng = engine("sparse:2:step", verify=True)
    _run(eng, model, 0)
    out = _run(eng, model, 1)
    assert not torch.equal(out, refs[1])
    assert len(verified) == 1
    v = verified[0]
    assert v == get_hub().status()["exactness"]["verify"][-1]
    assert not v["bit_exact"] and v["max_abs_diff"] > 0 and v["first_difference"] == "block 0 attention"
    assert all(r["verdict"] == "exact" for r in get_hub().status()["exactness"]["verdicts"][-8:])


def test_a_differing_sparse_kernel_turns_sparse_attention_off_for_the_plan(engine, model, caplog):
    """The sparse kernel over a 2-head group is one ulp off, also in the probe: the plan stays split, its steps run
    dense (equal to the dense unsplit run) with one warning naming the op, the heads and the device, and the status
    shows the op adjusted."""
    eng = engine("sparse:2")
    with caplog.at_level(logging.WARNING, logger="h3_multistream"):
        for s in (1, 3):  # the second step reuses the cached verdict
            out = _run(eng, model, s)
            assert torch.equal(out, _dense_ref(model, s)), s
            assert all(r.sparse is None for r in eng.last_rank_results)
    warned = [r.getMessage() for r in caplog.records if "sparse attention is off" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "attention.sparse" in warned[0] and "heads [0, 2)" in warned[0] and "on cpu " in warned[0], warned
    row = [r for r in get_hub().status()["exactness"]["verdicts"] if r["op"] == "attention.sparse"][-1]
    assert row["verdict"] == "adjusted" and "attention runs dense" in row["detail"]
    assert eng.end_sampling() == 0  # nothing ran sparse


def test_the_probe_compares_the_qkv_projection_chunk_by_chunk(kernel, model, monkeypatch):
    """In process, with the kernel's row chunk shortened to 128 rows (200 tokens: chunks [0, 128) and [128, 200)): a
    fault on the group's 72-row projection is seen on that chunk only, and through it in the kernel's output; the
    whole projection over every row (``attn.qkv_proj``) never makes that call."""
    monkeypatch.setattr(dit_sparse, "PRODUCER_CHUNK", 128)
    blocks = [model.block_weights(i) for i in range(CFG.layers)]
    man = [{k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in b.items()} for b in blocks]
    ops = invariance.block_ops(man, lambda i: dit_ops.block_quant(blocks[i]))
    inp = _inputs(1)
    kw = dict(tokens=200, shards=[ProbeShard([(0, 100)], (0, 2))], total_heads=CFG.heads, head_dim=CFG.head_dim,
              dtype=torch.bfloat16, attend=dit_ops.builtin_attend("sdpa"), device=torch.device("cpu"),
              sparse=dit_sparse.probe_wire(SPARSE, inp.segments, inp.rope_freqs))
    clean = {v.op: v for v in invariance.run_probe(ops, **kw)[0].ops}
    assert clean["attn.qkv_proj.chunks"].shards == [[0, 128], [128, 200]]
    assert clean["attn.qkv_proj.chunks"].exact == [True, True] and clean["attention.sparse"].exact == [True, True]
    monkeypatch.setattr(dit_ops, "SHAPE_FAULT", ShapeFault.parse(f"linear:72:{CFG.hidden}:{3 * 2 * CFG.head_dim}"))
    faulty = {v.op: v for v in invariance.run_probe(ops, **kw)[0].ops}
    assert faulty["attn.qkv_proj.chunks"].exact == [True, False] and faulty["attn.qkv_proj.chunks"].max_abs_diff[1] > 0
    assert faulty["attention.sparse"].exact == [False, False]
    assert faulty["attn.qkv_proj"].exact == [True] and faulty["attention"].exact == [True]


def test_verify_waits_for_the_first_step_that_can_run_the_kernel():
    wire = SparseStepSettings(SPARSE, 0.9, "cond")
    assert not verify.due(wire, 0.9, 200, CFG.layers)  # above the window: a later step runs sparse
    assert verify.due(wire, 0.6, 200, CFG.layers) and verify.due(wire, None, 200, CFG.layers)
    assert verify.due(wire, 0.1, 200, CFG.layers)  # below it: no later step will
    short = SparseStepSettings(SparseConfig(sigma_start=0.8, min_tokens=1000), 0.9, "cond")
    assert verify.due(short, 0.9, 200, CFG.layers)  # too short for any sparse block
    every = SparseStepSettings(SparseConfig(sigma_start=0.8, min_tokens=0, dense_blocks=(0, 1)), 0.9, "cond")
    assert verify.due(every, 0.9, 200, CFG.layers)
    assert verify.due(None, 0.9, 200, CFG.layers)  # no sparse attention on this step


def test_sparse_fault_text():
    assert ShapeFault.parse("sparse:2:step") == ShapeFault("sparse", (2,), True)
    with pytest.raises(ValueError, match="sparse:HEADS"):
        ShapeFault.parse("sparse:2:3")
