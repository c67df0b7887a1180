"""H3 MS Sparse Attention through the real ComfyUI node graph on CUDA: the same graph on one GPU (one worker rank)
and split over 2 and 3 logical ranks (shares 1, 2, 1) of cuda:0 gives the same bits, Sol-Attn and top-k, each rank
map's first calls after its workers start included, 3 sampling steps of two conditioning branches (so the pooled
statistics are reused), every model call proven split on the rank map's ranks (``tests/split_proof.py``), and differs
from plain (dense) ComfyUI.

Skipped without CUDA (comfy-kitchen's sparse attention kernel needs CUDA SM >= 8.0; it has no CPU version) or
without the ComfyUI tree. On the GPU machine: ``bash benchmarks/device_run.sh sparse``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import comfy_tree  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: comfy-kitchen's sparse attention "
                                 "kernel needs CUDA SM >= 8.0 and has no CPU version"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]

_BODY = r'''
import json, os, sys, torch
sys.path.insert(0, {tests!r})
import comfy_h3, nodes
from split_proof import SplitProof
comfy_h3.start()
N = nodes.NODE_CLASS_MAPPINGS
from h3ms_async.dit import split as S
KW = dict(width=1280, height=768, length=56, steps=3)  # 8,7xx packed tokens
DIMS = comfy_h3.Dims(hidden=512, heads=8, head_dim=128, ffn=1024, t_dim=64, rope=4)  # the kernel's head size
name = f"h3sparse-{{os.getpid()}}.safetensors"
path = os.path.join(comfy_h3.checkpoint_dir(), name)
comfy_h3.write_checkpoint(path, layers=2, int8=True, dtype=torch.bfloat16, dims=DIMS)
try:
    model = comfy_h3.load(name)
    plain = comfy_h3.ksample(model, **KW)
    for method in ("sol-attn", "top-k"):
        settings = N["H3MSSparseAttentionAsync"]().build(method, 1.3, 10.0, 0.0, 1.0, min_tokens=0)[0]
        outs = {{}}
        for ranks, shares in (("cuda:0", ""), ("cuda:0,cuda:0", ""), ("cuda:0,cuda:0,cuda:0", "1,2,1")):
            os.environ["H3MS_RANK_MAP"] = ranks
            gpus = N["H3MSGPUSetAsync"]().build("auto", "", shares, 0.0, 8)[0] if shares else None
            split = N["H3MultiStreamAsync"]().patch(model, True, -1, "host", 8, True, 0.0, "auto", gpus,
                                                    sparse_attention=settings)[0]
            with SplitProof(ranks.split(",")) as proof:  # every call split on these ranks
                outs[ranks] = comfy_h3.ksample(split, **KW)  # the first calls after this rank map's workers start
            (eng,) = S.engines()
            counts = [r.sparse for r in eng.last_rank_results]
            r = dict(method=method, ranks=ranks, shares=shares, counts=counts, proof=proof.summary(),
                     same_as_one_gpu=comfy_h3.same(outs["cuda:0"], outs[ranks]),
                     same_as_dense=comfy_h3.same(plain, outs[ranks]))
            print("CASE " + json.dumps(r), flush=True)
finally:
    os.unlink(path)
    S.release_all_engines()
'''


def test_node_split_sparse_equals_one_gpu_sparse():
    body = _BODY.format(tests=os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as web_root:  # ComfyUI's frontend package is not on the GPU machine
        r = comfy_tree.run_comfy_script(body, ["--disable-api-nodes", "--front-end-root", web_root], timeout_s=240)
    out = [json.loads(x[5:]) for x in r.stdout.splitlines() if x.startswith("CASE ")]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sparse_cuda_comfy.json"), "w") as fh:
            json.dump({"results": out, "rc": r.returncode, "stderr_tail": r.stderr[-4000:]}, fh, indent=1)
    assert r.returncode == 0 and len(out) == 6, r.stderr[-4000:]
    for case in out:
        assert case["proof"]["failure"] is None, case  # tests/split_proof.py, in ComfyUI's process
        assert case["same_as_one_gpu"][0], case
        assert not case["same_as_dense"][0], case  # sparse attention really ran
        # the last call (step 3) reused the statistics of its branch on every block of every rank
        assert all(c and c["sparse_blocks"] == 2 and c["stats_reused"] == 2 for c in case["counts"]), case
