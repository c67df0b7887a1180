"""The Text Encoder Cache under ComfyUI's real DynamicVRAM on CUDA: ``import main`` runs ComfyUI's start-up, so the
CLIP's patcher is ``ModelPatcherDynamic`` (comfy-aimdo) unless ``--disable-dynamic-vram``.  Under it the weight
cache stands aside (one warning, no pinned copy) and the output cache's hit equals the miss bit for bit; with
``--disable-dynamic-vram`` the weight cache fills and restores evicted weights exactly.

On the GPU machine: ``python -m pytest -q -m cuda tests/test_caches_cuda.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import comfy_tree

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]

SCRIPT = r'''
import asyncio, json, os, sys, torch
import main  # noqa: F401  (ComfyUI's start-up: comfy-aimdo and the ModelPatcherDynamic swap)
import nodes
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
from h3ms_async.caches import output_cache, weight_cache
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_clip import small_clip
clip = small_clip(os.environ["TMP_DIR"])
M = nodes.NODE_CLASS_MAPPINGS

def encode(c, text):
    with torch.inference_mode():
        cond = M["CLIPTextEncode"]().encode(c, text)[0]
    return cond[0][0].cpu(), cond[0][1]["pooled_output"].cpu()

ref, ref_b = encode(clip, "a red fox"), encode(clip, "a blue bird")
cached = M["H3MSTextEncoderCacheAsync"]().patch(clip, True, True, 8, 0.0)[0]
miss, hit = encode(cached, "a red fox"), encode(cached, "a red fox")
rows = [r for r in weight_cache().summaries() if r["group"] == "te"]
evict_equal = None
if not clip.patcher.is_dynamic():
    clip.cond_stage_model.to_empty(device="meta")  # ComfyUI dropped the weights; the miss restores them
    evict_equal = all(map(torch.equal, encode(cached, "a blue bird"), ref_b))
print("RESULT", json.dumps({"patcher": type(clip.patcher).__name__, "dynamic": clip.patcher.is_dynamic(),
                            "miss_equal": all(map(torch.equal, miss, ref)),
                            "hit_equal": all(map(torch.equal, hit, ref)),
                            "rows": rows, "stats": output_cache().stats(), "evict_equal": evict_equal}))
'''


@pytest.mark.parametrize("dynamic", [True, False])
def test_text_encoder_cache_under_dynamic_vram_and_without(tmp_path, dynamic) -> None:
    args = ["--disable-api-nodes"] + ([] if dynamic else ["--disable-dynamic-vram"])
    env = {"TMP_DIR": str(tmp_path), "H3MS_TESTS_DIR": str(Path(__file__).parent)}
    proc = comfy_tree.run_comfy_script(SCRIPT, args, env=env, timeout_s=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["dynamic"] is dynamic, f"ComfyUI chose {r['patcher']}"
    assert r["miss_equal"] and r["hit_equal"] and r["stats"]["hits"] == 1, r
    notes = sum("under DynamicVRAM (ModelPatcherDynamic)" in ln for ln in proc.stderr.splitlines())
    if dynamic:
        assert r["rows"] == [] and notes == 1, r
    else:
        assert len(r["rows"]) == 1 and notes == 0 and r["evict_equal"], r
