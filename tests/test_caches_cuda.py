"""The Text Encoder Cache and the VAE Cache under ComfyUI's real start-up on CUDA, at H3's sizes, through ComfyUI's
own unload and load (``mm.unload_all_models()`` then a node call that makes ComfyUI load the model again).

``import main`` runs ComfyUI's start-up, so the patchers are what ComfyUI picks for each flag set: DynamicVRAM (its
default), ``--disable-dynamic-vram``, and that with ``--lowvram`` / ``--novram``.  The text encoder is an SD1-type
CLIP built by ComfyUI at H3's encoder size (``TE_GB``: 14.6 GB of bf16 weights at width 5120; smaller where ComfyUI
runs it on the CPU), the VAE is H3's video VAE at its real size, both with seeded random weights.  Measured per flag
set (printed as ``RESULT`` and asserted): output-cache hit vs miss time; the reload after ComfyUI's unload without
the weight cache vs with it (the restore from pinned RAM); bytes held, and given back by the release action and by
``weight_cache``/``enabled`` off; what the release action reports as freed against the process's RSS drop (with both
models unloaded by ComfyUI the cached copies are their host weights: kept, unpinned); every output equal bit for bit
to the plain one, a LoRA (applied by ComfyUI's ``load_lora_for_models``) included.  Where ComfyUI never moves the
weights (DynamicVRAM; a text encoder ComfyUI runs on the CPU under ``--lowvram``/``--novram``) the cache must hold
nothing and say why.

On the GPU machine: ``bash benchmarks/device_run.sh caches`` (about 4 min on an H200).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import comfy_tree

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]

SCRIPT = r'''
import asyncio, gc, json, os, sys, time, psutil, torch
import main  # noqa: F401  (ComfyUI's start-up: comfy-aimdo and the ModelPatcherDynamic swap, per the flags)
import nodes
import comfy.model_management as mm, comfy.sd, comfy.sd1_clip, comfy.supported_models_base
import comfy.ldm.minimax.vae as V
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
from h3ms_async.caches import _free_pinned_pool, _trim_heap, output_cache, weight_cache
from h3ms_async.observability.routes import action_clear_weights
M = nodes.NODE_CLASS_MAPPINGS
LOADS = []
_load = mm.load_models_gpu
def observed_load(models, *a, **k):  # observes ComfyUI's own loads; the load itself is ComfyUI's
    LOADS.append(len(models))
    return _load(models, *a, **k)
mm.load_models_gpu = observed_load
GEN = torch.Generator(device="cuda").manual_seed(11)

def rand_sd(shapes, bump):
    # generated on the GPU (fast), kept in host RAM as a loaded checkpoint is
    return {n: (torch.randn(t.shape, generator=GEN, device="cuda") * 0.02 + (1.0 if n.endswith(bump) else 0.0))
            .to(torch.bfloat16).cpu() for n, t in sorted(shapes.items()) if t.is_floating_point()}

sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_h3_vae import eager_comfy_ops

def shapes_of(build):
    # under DynamicVRAM a Linear's weight stays None until loaded: the template needs eager ops
    with eager_comfy_ops(), torch.device("meta"):
        return build().state_dict()

def big_clip(gib):
    cfg = json.load(open("comfy/sd1_clip_config.json"))
    h = 5120
    layers = max(1, round((gib * 2**30 / 2 - 49408 * h) / (12 * h * h)))
    cfg.update(hidden_size=h, intermediate_size=4 * h, num_attention_heads=40, num_hidden_layers=layers)
    path = os.path.join(os.environ["TMP_DIR"], "big_clip.json")
    json.dump(cfg, open(path, "w"))
    class Big(comfy.sd1_clip.SDClipModel):
        def __init__(self, device="cpu", dtype=None, model_options={}):
            super().__init__(device=device, dtype=dtype, model_options=model_options, textmodel_json_config=path,
                             return_projected_pooled=False)
    shapes = shapes_of(lambda: Big(device="meta", dtype=torch.bfloat16).transformer)
    sd = rand_sd(shapes, ("layer_norm1.weight", "layer_norm2.weight", "final_layer_norm.weight"))
    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    clip = comfy.sd.CLIP(target, state_dict=[sd], parameters=sum(t.numel() for t in sd.values()),
                         model_options={"clip_l_class": Big})
    lora = {}
    for b in range(2):
        k = f"lora_te_text_model_encoder_layers_{b}_self_attn_q_proj"
        lora[f"{k}.lora_up.weight"] = torch.randn(h, 8, generator=GEN, device="cuda").cpu() * 0.05
        lora[f"{k}.lora_down.weight"] = torch.randn(8, h, generator=GEN, device="cuda").cpu() * 0.05
        lora[f"{k}.alpha"] = torch.tensor(8.0)
    return clip, comfy.sd.load_lora_for_models(None, clip, lora, 1.0, 1.0)[1], layers

def big_vae():
    shapes = shapes_of(V.MiniMaxH3VideoVAE)
    sd = rand_sd(shapes, ("norm1.weight", "norm2.weight", "norm_out.weight"))
    for n in ("latents_mean", "latents_std"):
        if n in shapes:
            sd[n] = (torch.zeros if n == "latents_mean" else torch.ones)(shapes[n].shape)
    return comfy.sd.VAE(sd=sd)

def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t

def encode(c, text):
    def run():
        with torch.inference_mode():
            cond = M["CLIPTextEncode"]().encode(c, text)[0]
        return cond[0][0].cpu(), cond[0][1]["pooled_output"].cpu()
    return timed(run)

def eq(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))

clip, lora_clip, layers = big_clip(float(os.environ["TE_GB"]))
vae = big_vae()
z = torch.randn(1, vae.latent_channels, 20, 2, 3, generator=torch.Generator().manual_seed(3))
def decode(v):
    def run():
        with torch.inference_mode():
            return v.decode(z).cpu()
    return timed(run)

r = {"patcher": type(clip.patcher).__name__, "dynamic": clip.patcher.is_dynamic(),
     "vae_patcher": type(vae.patcher).__name__,
     "te_device": str(clip.patcher.load_device), "te_layers": layers}
(ref_a, _), (ref_lora, _) = encode(clip, "a red fox"), encode(lora_clip, "a red fox")
ref_img, _ = decode(vae)
mm.unload_all_models()
(ref_b, r["te_reload_plain_s"]) = encode(clip, "a blue bird")
mm.unload_all_models()
(img, r["vae_reload_plain_s"]) = decode(vae)
equal = [torch.equal(img, ref_img)]

cached = M["H3MSTextEncoderCacheAsync"]().patch(clip, True, True, 64, 0.0)[0]
cvae = M["H3MSVAECacheAsync"]().patch(vae, True, True, 0.0)[0]
miss, r["te_miss_s"] = encode(cached, "a green frog")
n_loads = len(LOADS)
hit, r["te_hit_s"] = encode(cached, "a green frog")
r["hit_loads"] = len(LOADS) - n_loads
equal.append(eq(miss, hit))
mm.unload_all_models()  # ComfyUI's own unload: the cache homes the host weights (the first time: its fill)
r["rows_after_unload"] = weight_cache().summaries()
got, r["te_restore_s"] = encode(cached, "a red fox")
equal.append(eq(got, ref_a))
mm.unload_all_models()
got, r["te_restore2_s"] = encode(cached, "a blue bird")
equal.append(eq(got, ref_b))
got, _ = encode(lora_clip, "a red fox")  # a LoRA over the restored weights: ComfyUI patches after its load
equal.append(eq(got, ref_lora))
mm.unload_all_models()
img, r["vae_restore_s"] = decode(cvae)
equal.append(torch.equal(img, ref_img))
mm.unload_all_models()
img, r["vae_restore2_s"] = decode(cvae)
equal.append(torch.equal(img, ref_img))
r.update(equal=equal, rows=weight_cache().summaries(), stats=output_cache().stats())
held = lambda: sum(row["bytes"] for row in weight_cache().summaries())  # noqa: E731
mm.unload_all_models()
r["held_before_release"] = held()
gc.collect()
_free_pinned_pool()
_trim_heap()  # what earlier frees left in the heap and the pinned pool goes first: the drop below is the release's
rss0 = psutil.Process().memory_info().rss
r["cleared"] = action_clear_weights()["caches"]
r["release_rss_drop"] = rss0 - psutil.Process().memory_info().rss
r["release"] = M["H3MSReleaseResourcesAsync"]().run(False, True, False, False, True)["ui"]["text"]
r["held_after_release"], r["outputs_after_release"] = held(), output_cache().stats()["bytes"]
mm.unload_all_models()  # nothing was loaded since: nothing to refill
decode(cvae)
encode(cached, "a last prompt")
mm.unload_all_models()  # ComfyUI's next unload refills
r["held_refilled"] = held()
M["H3MSVAECacheAsync"]().patch(vae, True, False, 0.0)
M["H3MSTextEncoderCacheAsync"]().patch(clip, False, True, 64, 0.0)
r["held_after_off"] = held()
r["equal_after_release"] = [torch.equal(decode(vae)[0], ref_img), eq(encode(clip, "a red fox")[0], ref_a)]
print("RESULT", json.dumps(r))
'''

TE_GB = 14.6  # H3's Qwen3-VL-32B text encoder in bf16 (the node's tooltip)
# flags, and the encoder's size: under --lowvram/--novram ComfyUI runs the encoder on the CPU (the cache stands aside
# there), where one encode at H3's size would take many seconds
MODES = {"dynamic": ([], TE_GB), "static": (["--disable-dynamic-vram"], TE_GB),
         "lowvram": (["--disable-dynamic-vram", "--lowvram"], 0.3),
         "novram": (["--disable-dynamic-vram", "--novram"], 0.3)}


@pytest.mark.parametrize("mode", list(MODES))
def test_caches_restore_through_comfyui_unload_at_h3_sizes(tmp_path, mode) -> None:
    flags, te_gb = MODES[mode]
    env = {"TMP_DIR": str(tmp_path), "H3MS_TESTS_DIR": str(Path(__file__).parent), "TE_GB": str(te_gb)}
    proc = comfy_tree.run_comfy_script(SCRIPT, [*flags, "--disable-api-nodes"], env=env, timeout_s=580)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    print(mode, json.dumps(r, indent=1))
    assert all(r["equal"]) and all(r["equal_after_release"]) and r["stats"]["hits"] == 1, r
    assert r["te_hit_s"] < r["te_miss_s"] / 10 and r["hit_loads"] == 0, r
    # ComfyUI had both models unloaded: each cached copy was a model's host weights, so it stays with the model
    # (unpinned), and the RAM the release reports as freed is what the process's RSS dropped
    cleared = r["cleared"]
    assert cleared["kept_bytes"] == r["held_before_release"], r
    assert cleared["pinned_freed_bytes"] >= r["held_before_release"], r
    assert abs(r["release_rss_drop"] - cleared["freed_bytes"]) <= 128 << 20, r
    # the release action drops every copy; ComfyUI's next unload refills; weight_cache=false / enabled=false drop
    assert r["held_after_release"] == 0 and r["outputs_after_release"] == 0 and r["held_after_off"] == 0, r
    assert r["held_refilled"] == r["held_before_release"], r
    rows = {row["group"].split(":")[0]: row for row in r["rows"]}
    if mode == "dynamic":
        assert r["dynamic"] and all(row["state"] == "aside" and "DynamicVRAM" in row["reason"] for row in r["rows"]), r
        return
    assert not r["dynamic"], r
    vae = rows["vae"]
    assert vae["state"] == "held" and vae["homes"] >= 2 and vae["bytes"] > 2**30, vae
    te = rows["te"]
    if r["te_device"] == "cpu":  # --lowvram / --novram: ComfyUI runs the text encoder on the CPU
        assert te["state"] == "aside" and "both cpu" in te["reason"], te
    else:
        assert te["state"] == "held" and te["homes"] >= 2 and te["restores"] >= 2, te
        assert te["bytes"] > 0.9 * te_gb * 2**30, te
    if mode == "static":
        assert vae["restores"] >= 2, vae
