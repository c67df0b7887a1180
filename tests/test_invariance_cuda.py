"""The invariance probe and ``verify`` on CUDA ranks (skipped without a GPU; ``benchmarks/device_run.sh invariance``).

The issue's case: bf16 at H3's width with shares 1:2000 gives rank 0 about 10 rows, where the H200's bf16 GEMM at
fc2's shape rounds differently (measured: 1-16 rows differ, 31 and up are equal).  The engine must adjust the shard
and stay exact, or run the step unsplit; never return a different result.  ``verify`` on logical ranks says
bit-exact.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: run these on a GPU machine with "
                                                                     "a CUDA build of torch, e.g. "
                                                                     "benchmarks/device_run.sh invariance")]

from h3ms_async.dit.layout import layout_for_tokens  # noqa: E402
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs  # noqa: E402
from h3ms_async.dit.errors import SplitUnsafe  # noqa: E402
from h3ms_async.dit.options import SplitOptions  # noqa: E402
from h3ms_async.dit.split import SplitEngine  # noqa: E402
from h3ms_async.status.hub import get_hub  # noqa: E402

WIDE = DiTConfig(hidden=5376, layers=1, heads=56, head_dim=128, ffn=14336, t_dim=2688, rope_pairs=48)


def test_bf16_ten_row_shard_adjusts_or_runs_unsplit_never_differs():
    model = ReferenceDiT(WIDE, weights="bf16", seed=4, device="cuda").materialize()  # drawn once, not per read
    inp = make_step_inputs(WIDE, layout_for_tokens(20000), 2, torch.bfloat16)
    refs = [model.forward_blocks(inp.x.cuda(), inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda()).cpu()
            for _ in range(2)]
    eng = SplitEngine(["cuda:0", "cuda:0"], SplitOptions(shares=(1.0, 2000.0)))
    try:
        eng.load_weights(("cuda-inv", "bf16"), WIDE, model.block_weights)
        try:
            eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)  # warm
            out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
        except SplitUnsafe as exc:
            print("refused:", exc)
            assert "NVIDIA" in str(exc)
        else:
            assert torch.equal(out, refs[1]), f"max |diff| {(out.float() - refs[1].float()).abs().max()}"
            sizes = [r["tokens"][1] - r["tokens"][0] for r in get_hub().recent_steps(1)[0]["ranks"]]
            print("ran split with shards", sizes)
        for v in get_hub().exactness()["verdicts"][-6:]:
            print(v["op"], v["shape"], v["shards"], v["verdict"], v["detail"], f"{v['probe_ms']:.1f} ms")
    finally:
        eng.release()


def test_verify_on_logical_ranks_says_bit_exact():
    cfg = DiTConfig(hidden=1024, layers=3, heads=16, head_dim=128, ffn=2816, t_dim=256, rope_pairs=48)
    model = ReferenceDiT(cfg, weights="int8", seed=21, device="cuda")
    inp = make_step_inputs(cfg, layout_for_tokens(6000), 3, torch.bfloat16)
    eng = SplitEngine(["cuda:0", "cuda:0"], SplitOptions(verify=True))
    try:
        eng.load_weights(("cuda-inv", "int8"), cfg, model.block_weights)
        eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs)
        v = get_hub().exactness()["verify"][-1]
        print("verify:", v)
        assert v["bit_exact"] and v["first_difference"] is None and "NVIDIA" in v["devices"][0]
    finally:
        eng.release()
