"""CUDA rank workers (skipped without a GPU; run on the device machine by benchmarks/device_run.sh).

Covers: pinned (cudaHostRegister'ed) shm moving through a CUDA worker bit-exactly; the split on logical ranks of one
GPU bit-exact against the unsplit run in this process, for int8 and bf16 weights, chunked and single-shot host
exchange, weights resident and streamed; the NCCL refusal for two ranks on one GPU.

Warm-up: measured on the H200 (benchmarks/diag_parity.py), the FIRST block-stack pass of a process differs in the
last bits from every later pass, in this process and in a worker alike (first == first, later == later, split or
not).  A worker is a fresh process, like a freshly started ComfyUI, so each side is warmed once before comparing.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")]

from h3ms_async.coordinator import get_coordinator  # noqa: E402
from h3ms_async.layout import layout_for_tokens  # noqa: E402
from h3ms_async.pool import WorkerPool  # noqa: E402
from h3ms_async.reference_dit import DiTConfig, ReferenceDiT, make_step_inputs  # noqa: E402
from h3ms_async.split import SplitEngine, SplitOptions  # noqa: E402
from workers.shm import Arena, Segment  # noqa: E402

CFG = DiTConfig(hidden=1024, layers=3, heads=16, head_dim=128, ffn=2816, t_dim=256, rope_pairs=48)


def test_cuda_worker_echo_through_registered_shm():
    pool = WorkerPool(["cuda:0", "cuda:0"], name="cudaecho")
    coord = get_coordinator()
    seg = Segment.create(2 * (256 << 20) + 8192, "cudaecho")
    try:
        coord.run(pool.start(), 300, "start")
        a = Arena(seg)
        src, dst = a.alloc("bfloat16", [128 << 20]), a.alloc("bfloat16", [128 << 20])
        data = seg.tensor(src)
        data.copy_(torch.randn(128 << 20, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
        for rank in range(2):
            seg.tensor(dst).zero_()
            r = coord.run(pool.request(rank, "echo", {"src": src, "dst": dst}, timeout=120), 150, "echo")
            assert r["registered"] is True
            assert torch.equal(seg.tensor(dst), data)
            assert r["sha256"] == hashlib.sha256(seg.tensor(dst).view(torch.uint8).numpy()).hexdigest()
            print(f"rank {rank}: 256 MiB host->GPU->host in {r['seconds'] * 1e3:.1f} ms "
                  f"({2 * 256 / 1024 / r['seconds']:.1f} GB/s both ways)")
    finally:
        coord.run(pool.release(force=True), 60, "release")
        seg.close()
        seg.unlink()


@pytest.fixture(scope="module")
def models():
    return {kind: ReferenceDiT(CFG, weights=kind, seed=21, device="cuda") for kind in ("int8", "bf16")}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("residency", ["resident", "stream"])
def test_split_on_logical_ranks_is_exact(models, ranks, residency):
    layouts = [layout_for_tokens(4096), layout_for_tokens(3000)]
    eng = SplitEngine(["cuda:0"] * ranks, SplitOptions(vram_residency=residency))
    try:
        for kind, model in models.items():
            eng.load_weights(("cuda-test", kind), CFG, model.block_weights)
            for s, lay in enumerate(layouts):
                inp = make_step_inputs(CFG, lay, 40 + s, model.dtype)
                refs = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments,
                                             inp.rope_freqs.cuda()).cpu() for _ in range(2)]
                eng.run_blocks(inp.x, inp.t_emb, inp.segments, inp.rope_freqs)  # warm (see module doc)
                for chunks in (0, 8):
                    out = eng.run_blocks(inp.x, inp.t_emb, inp.segments, inp.rope_freqs, exchange_chunks=chunks)
                    diff = (out.float() - refs[1].float()).abs().max().item()
                    assert torch.equal(out, refs[1]), f"{kind} chunks={chunks} step {s}: max |diff| {diff:g}"
    finally:
        eng.release()


def test_nccl_refuses_two_ranks_on_one_gpu():
    with pytest.raises(ValueError, match="one GPU"):
        SplitEngine(["cuda:0", "cuda:0"], SplitOptions(exchange="nccl"))
