"""H3 MS Text Encoder Cache and H3 MS VAE Cache through the real ComfyUI tree: a hit equals the miss bit for bit, the
key sees the prompt and the layer option, evicted weights come back from the pinned copy exactly, the status counts
hits and misses, Release Resources clears the outputs and removes the hooks; under DynamicVRAM the weight cache stands
aside and the output cache still hits exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import comfy_tree

pytestmark = pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or "")

SCRIPT = r'''
import asyncio, json, os, time, torch
import nodes
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
M = nodes.NODE_CLASS_MAPPINGS
from h3ms_async.caches import output_cache, weight_cache
from h3ms_async.observability.status import get_hub
import sys
method_hooks = next(m for n, m in sys.modules.items() if n.endswith("nodes.method_hooks"))

sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_clip import small_clip
clip = small_clip(os.environ["TMP_DIR"])

def encode(c, text):
    t = time.perf_counter()
    with torch.inference_mode():
        cond = M["CLIPTextEncode"]().encode(c, text)[0]
    return cond[0][0], cond[0][1]["pooled_output"], time.perf_counter() - t

def same(a, b):
    return bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))

last2 = M["CLIPSetLastLayer"]().set_last_layer(clip, -2)[0]
ref_a, ref_b, ref_a2 = encode(clip, "a red fox"), encode(clip, "a blue bird"), encode(last2, "a red fox")
node = M["H3MSTextEncoderCacheAsync"]()
cached = node.patch(clip, True, True, 8, 0.0)[0]
miss = encode(cached, "a red fox")
hit = encode(cached, "a red fox")
hit_other_clone = encode(clip, "a red fox")          # the hook sits on the shared encoder
layer2 = encode(M["CLIPSetLastLayer"]().set_last_layer(cached, -2)[0], "a red fox")
stats_before_evict = output_cache().stats()
clip.cond_stage_model.to_empty(device="meta")         # ComfyUI dropped the weights
after_evict = encode(cached, "a blue bird")
[te_row] = [r for r in weight_cache().summaries() if r["group"] == "te"]
status = get_hub().status()
hooks = method_hooks.installed()
release = M["H3MSReleaseResourcesAsync"]().run(False, False, True, True, True)["ui"]["text"]
plain = encode(clip, "a red fox")
entries_after_release = output_cache().stats()["entries"]
hooked_after = "encode_token_weights" in clip.cond_stage_model.__dict__
ref_c = encode(clip, "a green frog")
# DynamicVRAM: ComfyUI's own ModelPatcherDynamic class (its __init__ needs CUDA and comfy-aimdo, so on CPU the
# instance carries the CPU patcher's state); the weight cache must stand aside, the output cache work as before.
import comfy.model_patcher
dyn_clip = clip.clone()
dyn_clip.patcher = object.__new__(comfy.model_patcher.ModelPatcherDynamic)
dyn_clip.patcher.__dict__.update(clip.patcher.__dict__)
dyn_cached = node.patch(dyn_clip, True, True, 8, 0.0)[0]
dyn_miss, dyn_hit = encode(dyn_cached, "a green frog"), encode(dyn_cached, "a green frog")
dyn = {"is_dynamic": dyn_clip.patcher.is_dynamic(), "miss_equal": same(dyn_miss, ref_c),
       "hit_equal": same(dyn_hit, ref_c), "te_rows": [r for r in weight_cache().summaries() if r["group"] == "te"],
       "stats": output_cache().stats()}
print("RESULT", json.dumps({"dynamic": dyn, 
    "miss_equal": same(miss, ref_a), "hit_equal": same(hit, ref_a), "clone_hit_equal": same(hit_other_clone, ref_a),
    "layer2_equal": same(layer2, ref_a2), "layer2_differs": not same(ref_a2, ref_a),
    "evict_equal": same(after_evict, ref_b), "stats": stats_before_evict, "te_row": te_row,
    "status_outputs": status["text_encoder_outputs"], "hooks": hooks,
    "entries_after_release": entries_after_release, "release": release,
    "hooked_after": hooked_after, "plain_equal": same(plain, ref_a),
    "miss_s": miss[2], "hit_s": hit[2]}))
'''


def test_text_encoder_cache_hit_equals_miss_and_restores_evicted_weights(tmp_path) -> None:
    env = {"TMP_DIR": str(tmp_path), "H3MS_TESTS_DIR": str(Path(__file__).parent)}
    proc = comfy_tree.run_comfy_script(SCRIPT, ["--cpu", "--disable-api-nodes"], env=env, timeout_s=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["miss_equal"] and r["hit_equal"] and r["clone_hit_equal"], r
    assert r["layer2_differs"] and r["layer2_equal"], "the layer option must be part of the key"
    assert r["stats"]["hits"] == 2 and r["stats"]["misses"] == 2 and r["stats"]["entries"] == 2, r["stats"]
    assert r["evict_equal"] and r["te_row"]["restores"] == 1 and r["te_row"]["bytes"] > 6 * 2**20, r["te_row"]
    assert r["status_outputs"]["hits"] == 2 and r["status_outputs"]["misses"] == 3
    assert any(h["hook"] == "TextEncoder" and h["methods"] == ["encode_token_weights"] for h in r["hooks"])
    assert r["entries_after_release"] == 0 and not r["hooked_after"] and r["plain_equal"], r["release"]
    assert any("text-encoder output cache cleared" in ln for ln in r["release"])
    dyn = r["dynamic"]
    assert dyn["is_dynamic"] and dyn["miss_equal"] and dyn["hit_equal"], dyn
    assert dyn["te_rows"] == [], "under DynamicVRAM the weight cache must not hold a second copy"
    assert dyn["stats"]["hits"] == 3 and dyn["stats"]["entries"] == 1, dyn["stats"]
    assert sum("weight cache off for this model: ComfyUI runs it under DynamicVRAM" in ln
               for ln in proc.stderr.splitlines()) == 1
