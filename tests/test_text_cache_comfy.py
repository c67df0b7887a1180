"""H3 MS Text Encoder Cache through the real ComfyUI tree and ComfyUI's own nodes (CPU).

A full-size CLIP-L file loaded with ``CLIPLoader``; every way ComfyUI patches a CLIP, each made by ComfyUI's own node:
``LoraLoader`` (two strengths), ``LoraLoaderBypass``, a hook LoRA with two keyframes through ``Set CLIP Hooks`` with
``schedule_clip`` (one encode per keyframe), and ``LoraLoader`` with a LoRA for the diffusion model only.  Each result
is compared bit for bit with a plain encode of that same CLIP made before the cache existed: a patch route must miss
(and equal its own encode), the model-only LoRA must hit, the same file loaded again must hit.  A hit must not load
the encoder (ComfyUI's ``load_models_gpu`` is observed, and its loaded-model list stays empty after an unload).  On
the CPU ComfyUI never moves the weights: the weight cache holds nothing and says why.  Release Resources frees the
outputs' bytes; ``enabled=false`` turns the cache off for that encoder.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import comfy_tree

pytestmark = [pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or ""),
              pytest.mark.timeout(900)]  # ~60 s of CPU (a full-size CLIP-L, ~40 encodes); a shared box is slower

SCRIPT = r'''
import asyncio, json, os, sys, types, torch
import nodes, folder_paths
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
import comfy.model_management as mm
from comfy_extras.nodes_hooks import CreateHookKeyframe, CreateHookLora, SetClipHooks, SetHookKeyframes
from comfy_extras.nodes_lora_debug import LoraLoaderBypass
from h3ms_async.caches import output_cache, weight_cache
from h3ms_async.status.hub import get_hub
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_clip import clip_l_files

tmp = os.environ["TMP_DIR"]
files = clip_l_files(tmp)
folder_paths.add_model_folder_path("text_encoders", tmp)
folder_paths.add_model_folder_path("loras", tmp)
M = nodes.NODE_CLASS_MAPPINGS
LOADS = []
_load = mm.load_models_gpu
def observed_load(models, *a, **k):  # observes ComfyUI's own loads; the load itself is ComfyUI's
    LOADS.append(len(models))
    return _load(models, *a, **k)
mm.load_models_gpu = observed_load

def load_clip():
    return M["CLIPLoader"]().load_clip(os.path.basename(files["clip"]), "stable_diffusion")[0]

def encode(c, text="a red fox"):
    with torch.inference_mode():
        return M["CLIPTextEncode"]().encode(c, text)[0]

def rows(cond):
    return [(e[0], e[1]["pooled_output"], e[1].get("clip_start_percent"), e[1].get("clip_end_percent"),
             "hooks" in e[1]) for e in cond]

def same(a, b):
    ra, rb = rows(a), rows(b)
    return len(ra) == len(rb) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2:] == y[2:]
                                      for x, y in zip(ra, rb))

def diff(a, b):
    return max(float((x[0] - y[0]).abs().max()) for x, y in zip(rows(a), rows(b)))

clip = load_clip()
lora, unet_lora = os.path.basename(files["lora"]), os.path.basename(files["unet_lora"])

def hooked(second_strength):
    hooks = CreateHookLora().create_hook(lora, 1.0, 1.0)[0]
    kf = CreateHookKeyframe().create_hook_keyframe(1.0, 0.0)[0]
    kf = CreateHookKeyframe().create_hook_keyframe(second_strength, 0.5, prev_hook_kf=kf)[0]
    return SetClipHooks().apply_hooks(clip, True, True, SetHookKeyframes().set_hook_keyframes(hooks, kf)[0])[0]

odd = clip.clone()
odd.patcher.add_object_patch("h3ms_test_marker", types.SimpleNamespace(v=1))  # nothing the key can read
variants = {
    "plain": clip,
    "bypass": LoraLoaderBypass().load_lora(None, clip, lora, 1.0, 1.0)[1],
    "lora": nodes.LoraLoader().load_lora(None, clip, lora, 1.0, 1.0)[1],
    "lora_half": nodes.LoraLoader().load_lora(None, clip, lora, 1.0, 0.5)[1],
    "model_only": nodes.LoraLoader().load_lora(None, clip, unet_lora, 1.0, 1.0)[1],
    "hook_a": hooked(0.25),
    "hook_b": hooked(0.75),
    "odd": odd,
}
refs = {n: encode(c) for n, c in variants.items()}
ref_checks = {
    "bypass_differs": diff(refs["bypass"], refs["plain"]), "lora_differs": diff(refs["lora"], refs["plain"]),
    "half_differs": diff(refs["lora_half"], refs["lora"]), "model_only_same": same(refs["model_only"], refs["plain"]),
    "hook_entries": len(refs["hook_a"]), "hook_keyframes_differ": diff(refs["hook_a"][:1], refs["hook_a"][1:]),
    "hook_schedules_differ": diff(refs["hook_a"][1:], refs["hook_b"][1:]),
}

node = M["H3MSTextEncoderCacheAsync"]()
cached = node.patch(clip, True, True, 64, 0.0)[0]
calls = []
def call(name, c, ref, text="a red fox"):
    st0, n0 = output_cache().stats(), len(LOADS)
    out = encode(c, text)
    st1 = output_cache().stats()
    calls.append({"name": name, "hits": st1["hits"] - st0["hits"], "misses": st1["misses"] - st0["misses"],
                  "loads": len(LOADS) - n0, "equal": same(out, ref)})

for name in variants:  # bypass three times: ComfyUI's injection converts its adapters to the layer dtype once
    for _ in range(3 if name == "bypass" else 2):
        call(name, variants[name], refs[name])
call("node_output", cached, refs["plain"])
mm.unload_all_models()
call("after_unload", cached, refs["plain"])
loaded_after_hit = len(mm.current_loaded_models)

clip2 = load_clip()  # the same file, loaded again: a new encoder object with the same weights
ref2 = encode(clip2)
node.patch(clip2, True, True, 64, 0.0)
call("reloaded", clip2, ref2)
bits_equal_reload = same(ref2, refs["plain"])

status = get_hub().status()
held_bytes = status["text_encoder_outputs"]["bytes"]
te_rows = [r for r in status["caches"] if r["group"].startswith("te:")]
release = M["H3MSReleaseResourcesAsync"]().run(False, False, False, False, True)["ui"]["text"]
after_release = get_hub().status()["text_encoder_outputs"]
node.patch(clip, False, True, 64, 0.0)
call("disabled", clip, refs["plain"])
print("RESULT", json.dumps({"ref_checks": ref_checks, "calls": calls, "loaded_after_hit": loaded_after_hit,
                            "bits_equal_reload": bits_equal_reload, "held_bytes": held_bytes, "te_rows": te_rows,
                            "release": release, "after_release": after_release}))
'''


def test_text_encoder_cache_keys_every_comfy_patch_route_and_never_loads_on_a_hit(tmp_path) -> None:
    env = {"TMP_DIR": str(tmp_path), "H3MS_TESTS_DIR": str(Path(__file__).parent)}
    proc = comfy_tree.run_comfy_script(SCRIPT, ["--cpu", "--disable-api-nodes"], env=env, timeout_s=880)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    refs = r["ref_checks"]
    # the patch routes really change the output, each in its own way (else the test could not fail)
    assert refs["bypass_differs"] > 1e-3 and refs["lora_differs"] > 1e-3 and refs["half_differs"] > 1e-3, refs
    assert refs["model_only_same"] and refs["hook_entries"] == 2, refs
    assert refs["hook_keyframes_differ"] > 1e-3 and refs["hook_schedules_differ"] > 1e-3, refs
    calls = {}
    for c in r["calls"]:
        calls.setdefault(c["name"], []).append(c)
    assert all(c["equal"] for c in r["calls"]), [c for c in r["calls"] if not c["equal"]]
    for name in ("plain", "bypass", "lora", "lora_half", "hook_a", "hook_b"):
        first, last = calls[name][0], calls[name][-1]
        assert (first["misses"], first["hits"], last["misses"], last["hits"]) == (1, 0, 0, 1), (name, calls[name])
        assert first["loads"] >= 1 and last["loads"] == 0, (name, "a hit must not load the encoder")
    # the bypass adapters' weights change dtype when ComfyUI first injects them: one more miss, never a wrong hit
    assert [(c["hits"], c["loads"]) for c in calls["model_only"]] == [(1, 0)] * 2, calls["model_only"]
    assert [(c["hits"], c["misses"]) for c in calls["odd"]] == [(0, 0)] * 2, calls["odd"]
    assert sum("output cache skipped for a call: a types.SimpleNamespace object" in ln
               for ln in proc.stderr.splitlines()) == 1
    for name in ("node_output", "after_unload", "reloaded"):
        [c] = calls[name]
        assert (c["hits"], c["loads"]) == (1, 0), (name, c)
    assert r["loaded_after_hit"] == 0 and r["bits_equal_reload"]
    [c] = calls["disabled"]
    assert (c["hits"], c["misses"]) == (0, 0) and c["loads"] >= 1, c
    # on the CPU ComfyUI never moves the weights: the weight cache holds nothing and says why
    assert r["te_rows"] and all(t["state"] == "aside" and t["bytes"] == 0 and "both cpu" in t["reason"]
                                for t in r["te_rows"]), r["te_rows"]
    assert r["held_bytes"] > 0 and r["after_release"]["bytes"] == 0 and r["after_release"]["entries"] == 0
    assert any("text-encoder output cache cleared" in ln for ln in r["release"]), r["release"]
