"""The split inside real ComfyUI on CUDA, started as ``main.py`` starts (DynamicVRAM on unless disabled): every
output ``torch.equal`` to plain ComfyUI, including the first call after the workers start, with no warm-up here.

Run on a GPU machine (the lead's H200 run): ``H3MS_COMFY_ARCHIVE=.carry/ComfyUI-0f1fa67.tar.xz python -m pytest -q
-m cuda tests/test_cuda_comfy.py``. Each case is one ComfyUI process; results go to ``$OUT`` when set.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import comfy_tree  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]

_BODY = r'''
import asyncio, json, os, sys, torch
sys.path.insert(0, {tests!r})
# main.py's own start-up: comfy-aimdo and the ModelPatcherDynamic swap unless --disable-dynamic-vram
import main  # noqa: F401  (runs ComfyUI's start-up code up to its __main__ guard)
import comfy_h3, nodes, comfy.sd, server
from comfy.cli_args import args
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
N = nodes.NODE_CLASS_MAPPINGS
import comfy.model_patcher as mp
name = f"h3cuda-{{os.getpid()}}.safetensors"
path = os.path.join(comfy_h3.checkpoint_dir(), name)
comfy_h3.write_checkpoint(path, layers=2, int8={int8})
try:
    model = comfy_h3.load(name)
    if {lora}:
        with torch.inference_mode():
            model = comfy.sd.load_lora_for_models(model, None, comfy_h3.lora_state_dict(2), 0.8, 0)[0]
    kw = dict(width=1280, height=768, length=56, steps=2)  # >= 8000 packed tokens
    gpus = N["H3MSGPUSetAsync"]().build("auto", "", {shares!r}, 0.0, 8)[0] if {shares!r} else None
    split = N["H3MultiStreamAsync"]().patch(model, True, -1, "host", 8, True, 0.0, "auto", gpus)[0]
    first = comfy_h3.ksample(split, **kw)   # the first call after the workers start
    plain = comfy_h3.ksample(model, **kw)
    second = comfy_h3.ksample(split, **kw)
    r = dict(patcher=type(model).__name__, first=comfy_h3.same(plain, first), second=comfy_h3.same(plain, second))
    print("CASE " + json.dumps(r), flush=True)
finally:
    os.unlink(path)
'''

CASES = [
    # (id, ComfyUI flags, rank map, shares, int8, lora)
    ("bf16-sdpa-dynamic-lora", [], "cuda:0,cuda:0", "", False, True),
    ("bf16-sdpa-nodynamic-lora", ["--disable-dynamic-vram"], "cuda:0,cuda:0", "", False, True),
    ("int8-sdpa-3ranks", [], "cuda:0,cuda:0,cuda:0", "1,2,1", True, False),
    ("int8-ck-2ranks", ["--use-ck-attention"], "cuda:0,cuda:0", "", True, False),
    ("bf16-ck-3ranks", ["--use-ck-attention"], "cuda:0,cuda:0,cuda:0", "1,2,1", False, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_split_equals_comfyui_on_cuda(case):
    cid, flags, ranks, shares, int8, lora = case
    body = _BODY.format(tests=os.path.dirname(__file__), int8=int8, lora=lora, shares=shares)
    r = comfy_tree.run_comfy_script(body, ["--disable-api-nodes", *flags], env={"H3MS_RANK_MAP": ranks},
                                    timeout_s=300)
    out = [json.loads(x[5:]) for x in r.stdout.splitlines() if x.startswith("CASE ")]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"cuda_comfy-{cid}.json"), "w") as fh:
            json.dump({"case": cid, "flags": flags, "ranks": ranks, "result": out, "rc": r.returncode}, fh)
        with open(os.path.join(os.environ["OUT"], f"cuda_comfy-{cid}.log"), "w") as fh:
            fh.write(r.stdout + "\n" + r.stderr)
    assert r.returncode == 0 and out, r.stderr[-4000:]
    assert out[0]["first"][0] and out[0]["second"][0], out
