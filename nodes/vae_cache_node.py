"""The **H3 MS VAE Cache** node (VAE → VAE): the VAE's weights in pinned RAM (``docs/comfyui_facts.md`` §9).

It hooks ``decode``, ``encode``, ``decode_tiled`` and ``encode_tiled`` on ``vae.first_stage_model`` (shared by the
VAE's clones, e.g. Select VAE Device's shallow copy; place the node after that one).  Each VAE file has its own cache
group ``vae:<file>``, so the video and the audio VAE do not evict each other.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from h3ms_async import caches
from h3ms_async.log import get_logger

from . import method_hooks
from .cache_hooks import DYNAMIC_NOTE, stage_weights, vae_key, weights_managed_by_comfy
from .inputs import PatchNode, enabled_input, ram_reserve_input

log = get_logger("VAE cache")

HOOK_ATTRS = ("decode", "encode", "decode_tiled", "encode_tiled")
HOOK_LABEL = "VAE"


def _make_wrapper(original: Callable[..., Any], cfg: dict) -> Callable[..., Any]:
    model = original.__self__

    def cached_call(*args: Any, **kwargs: Any) -> Any:
        if cfg["weight_cache"]:
            stage_weights(model, cfg["group"], cfg["key"], cfg["reserve_gb"], cfg, cfg["load_device"])
        return original(*args, **kwargs)

    return cached_call


class H3MSVAECacheAsync(PatchNode):
    """VAE → VAE (the same VAE; the hooks sit on its model)."""

    CATEGORY = "advanced/latent"
    RETURN_TYPES = ("VAE",)
    DESCRIPTION = ("Keeps the VAE's weights in pinned RAM so switching scenes does not read them from disk again. "
                   "Place it after Select VAE Device. enabled=false removes the hooks; bypassing or muting the node "
                   "cannot.")

    INPUTS = {
        "required": {
            "vae": ("VAE",),
            "enabled": enabled_input("Off removes the hooks and the VAE's cache group."),
            "weight_cache": ("BOOLEAN", {"default": True, "tooltip": "Keep a pinned-RAM copy of the weights "
                             "(0.56 GB for the H3 audio VAE; a quantized (int8) VAE runs without it, with one "
                             "warning). Under DynamicVRAM (ComfyUI's default on NVIDIA) ComfyUI keeps and pins "
                             "the weights itself and this node does nothing; use --disable-dynamic-vram to get "
                             "it."}),
            "cache_ram_reserve_gb": ram_reserve_input("Fill the cache only while at least this much RAM stays "
                                                      "available."),
        },
    }

    def patch(self, vae: Any, enabled: bool, weight_cache: bool, cache_ram_reserve_gb: float) -> tuple:
        model = vae.first_stage_model
        key = vae_key(vae)
        group = f"vae:{type(model).__name__ if key[1] == 'object' else os.path.basename(key[1])}"
        managed = enabled and weight_cache and weights_managed_by_comfy(getattr(vae, "patcher", None))
        if managed:
            log.warning("%s: %s", group, DYNAMIC_NOTE)
        if not enabled or not weight_cache or managed:
            # the weights are this node's only job: without them an installed hook would keep filling the cache
            for attr in HOOK_ATTRS:
                method_hooks.uninstall(model, attr)
            caches.weight_cache().release(group)
            return (vae,)
        cfg = {"group": group, "key": key, "weight_cache": True, "reserve_gb": float(cache_ram_reserve_gb),
               "load_device": getattr(getattr(vae, "patcher", None), "load_device", None)}
        for attr in HOOK_ATTRS:
            if callable(getattr(model, attr, None)):
                method_hooks.install(model, attr, HOOK_LABEL, _make_wrapper, cfg)
        caches.register_status()
        log.info("node configured: group %s, RAM reserve %g GiB", group, cache_ram_reserve_gb)
        return (vae,)
