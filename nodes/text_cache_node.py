"""The **H3 MS Text Encoder Cache** node (CLIP → CLIP): encoder outputs cached by content, weights in pinned RAM.

It hooks ``encode_token_weights`` on ``clip.cond_stage_model``, the encoder object every CLIP clone shares (so the
hook survives Select CLIP Device and LoRA clones).  The output-cache key covers everything that changes an encoding
(``docs/comfyui_facts.md`` §9): the encoder's identity (its file, type and options, or the object), the weight-patch
state ComfyUI applied (LoRAs), every sub-encoder's layer options, and the tokens with their weights.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from h3ms_async import caches
from h3ms_async.caches import output_cache, register_status
from h3ms_async.log import get_logger

from . import method_hooks
from .cache_hooks import DYNAMIC_NOTE, file_key, object_key, stage_weights, weights_managed_by_comfy
from .inputs import PatchNode, enabled_input, ram_reserve_input

log = get_logger("TextEncoder")

HOOK_ATTR = "encode_token_weights"
HOOK_LABEL = "TextEncoder"


def sub_encoders(cond_model: Any) -> list[tuple[str, Any]]:
    """The sub-encoders whose layer options change an encoding (those with ``layer_idx``), found once per hook:
    the module tree does not change while the hook lives, the options on it do (CLIP Set Last Layer)."""
    return [(name, m) for name, m in cond_model.named_modules() if hasattr(m, "layer_idx")]


def encoder_options(subs: list[tuple[str, Any]]) -> list:
    """The layer options of every sub-encoder (what CLIP Set Last Layer and ``projected_pooled`` change)."""
    return [(name, getattr(m, "layer", None), getattr(m, "layer_idx", None),
             getattr(m, "return_projected_pooled", None)) for name, m in subs]


def encoder_key(clip: Any) -> tuple:
    """The encoder's identity: its file, CLIP type and load options from the loader's reload factory
    (``(factory, (paths, embeddings, clip_type, options))``), else a token on the encoder object."""
    patcher = getattr(clip, "patcher", None)
    fkey = file_key(patcher)
    if fkey is None:
        return ("te", *object_key(clip.cond_stage_model))
    args = patcher.cached_patcher_init[1]
    clip_type = repr(args[2]) if len(args) > 2 else None
    options = repr(sorted(args[3].items(), key=str)) if len(args) > 3 and isinstance(args[3], dict) else None
    return ("te", *fkey, clip_type, options)


def _make_wrapper(original: Callable[..., Any], cfg: dict) -> Callable[..., Any]:
    cond_model = original.__self__
    subs = sub_encoders(cond_model)

    def encode(token_weight_pairs: Any) -> Any:
        # Weights are staged only when the encoder runs: a hit never touches (or restores) them.
        if cfg["weight_cache"]:
            stage_weights(cond_model, "te", cfg["weight_key"], cfg["reserve_gb"], cfg, cfg["load_device"])
        return original(token_weight_pairs)

    def cached_encode_token_weights(token_weight_pairs: Any) -> Any:
        if cfg["entries"] < 1:
            return encode(token_weight_pairs)
        t = time.perf_counter()
        cache = output_cache()
        out, key, hit = cache.fetch(
            (cfg["base_key"], getattr(cond_model, "current_weight_patches_uuid", None), encoder_options(subs),
             token_weight_pairs), lambda: encode(token_weight_pairs), cfg["entries"], cfg["reserve_gb"])
        st = cache.stats()
        if hit:
            log.info("output cache HIT %s: encoder skipped (%.4f s incl. hashing); %d entries, %d hits / %d misses",
                     key[:12], time.perf_counter() - t, st["entries"], st["hits"], st["misses"])
        else:
            log.info("encoded in %.2f s (output cache MISS %s, %d/%d entries)", time.perf_counter() - t, key[:12],
                     st["entries"], cfg["entries"])
        return out

    return cached_encode_token_weights


class H3MSTextEncoderCacheAsync(PatchNode):
    """CLIP → CLIP (a clone; the hook sits on the shared encoder)."""

    CATEGORY = "advanced/conditioning"
    RETURN_TYPES = ("CLIP",)
    DESCRIPTION = ("Caches text-encoder outputs (a re-queued or repeated prompt skips the encoder) and keeps the "
                   "encoder's weights in pinned RAM. The hook lives on the encoder shared by all CLIP clones: "
                   "enabled=false removes it; bypassing or muting the node cannot.")

    INPUTS = {
        "required": {
            "clip": ("CLIP",),
            "enabled": enabled_input("Off removes the hook (bypassing the node leaves an installed hook in "
                                     "place)."),
            "weight_cache": ("BOOLEAN", {"default": True, "tooltip": "Keep a pinned-RAM copy of the encoder "
                             "weights (about 14.6 GB for H3's Qwen3-VL-32B encoder). Stands aside under "
                             "DynamicVRAM (ComfyUI's default on NVIDIA), which keeps and pins the weights "
                             "itself; use --disable-dynamic-vram to get it."}),
            "cond_cache_entries": ("INT", {"default": 64, "min": 0, "max": 4096, "tooltip": "How many encoder "
                                   "outputs to keep (least recently used go first); 0 = output cache off."}),
            "cache_ram_reserve_gb": ram_reserve_input("Cache only while at least this much RAM stays "
                                                      "available."),
        },
    }

    def patch(self, clip: Any, enabled: bool, weight_cache: bool, cond_cache_entries: int,
              cache_ram_reserve_gb: float) -> tuple:
        cond_model = clip.cond_stage_model
        if not enabled:
            method_hooks.uninstall(cond_model, HOOK_ATTR)
            return (clip.clone(),)
        patcher = getattr(clip, "patcher", None)
        base = encoder_key(clip)
        if weight_cache and weights_managed_by_comfy(patcher):
            log.warning("%s", DYNAMIC_NOTE)
            weight_cache = False
            caches.weight_cache().release("te")
        cfg = {"base_key": base, "weight_key": base, "weight_cache": bool(weight_cache),
               "entries": int(cond_cache_entries), "reserve_gb": float(cache_ram_reserve_gb),
               "load_device": getattr(patcher, "load_device", None)}
        method_hooks.install(cond_model, HOOK_ATTR, HOOK_LABEL, _make_wrapper, cfg)
        register_status()
        log.info("node configured: output cache %s, weight cache %s, RAM reserve %g GiB",
                 f"{cond_cache_entries} entries" if cond_cache_entries else "off", "on" if weight_cache else "off",
                 cache_ram_reserve_gb)
        return (clip.clone(),)
