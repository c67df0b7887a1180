"""The VAE split decode on CUDA: the FIRST decode after the workers start equals ComfyUI's unsplit decode bit for
bit, and so does the next one.

Runs ``python -m h3ms_async bench vae`` (ComfyUI's own H3 VAE code in a child started in the real tree) at a reduced
size: 2 decoder layers of the real width (32 heads of 64, so every attention call is large enough for ComfyUI's SDPA
backend priority), logical ranks on ``cuda:0``.  Nothing in the test warms the workers: each rank count starts fresh
workers and its first decode is compared.  On the GPU machine:
``python -m pytest -q -m cuda tests/test_vae_split_cuda.py``.
"""
from __future__ import annotations

import json

import pytest
import torch

import comfy_tree
from h3ms_async.tools.bench.vae import main as bench_vae_main

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_first_split_decode_after_start_equals_comfyui(tmp_path, dtype) -> None:
    root = comfy_tree.ensure_tree()
    shims = [arg for d in comfy_tree.shim_dirs() for arg in ("--extra-path", d)]
    rc = bench_vae_main(["--comfy-root", str(root), *shims, "--device", "cuda:0", "--dtype", dtype,
                         "--ranks", "2,3", "--T", "22", "--height", "24", "--width", "40", "--layers", "2",
                         "--heads", "32", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / f"bench_vae_{dtype}.json").read_text())
    for run in rep["runs"]:
        assert run["equal_first"], f"{run['ranks']} ranks, {dtype}: the first decode after the workers started differs"
        assert run["equal"], f"{run['ranks']} ranks, {dtype}: the second decode differs"
        assert run["first_record"]["load_s"] > 0 and len(set(run["first_record"]["devices"])) == 1
    assert rc == 0 and [r["ranks"] for r in rep["runs"]] == [2, 3]
