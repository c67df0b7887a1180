"""The **H3 MS VAE Cache** node (VAE → VAE): the VAE's weights in pinned RAM while ComfyUI has it
unloaded (``docs/comfyui_facts.md`` §9; how and where: ``cache_hooks``).

It attaches the weight cache to the VAE's patcher and hooks ``decode``, ``encode``, ``decode_tiled``
and ``encode_tiled`` on ``vae.first_stage_model`` (shared by the VAE's clones, e.g. Select VAE
Device's shallow copy; place the node after that one) to count the loads ComfyUI made from the
pinned copy.  Each VAE file has its own cache group ``vae:<file>``, so the video and the audio VAE
do not evict each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

from h3ms_async import caches
from h3ms_async.log import get_logger

from . import method_hooks
from .cache_hooks import attach, detach, note_loaded, vae_key
from .inputs import PatchNode, enabled_input, ram_reserve_input

log = get_logger("VAE cache")

HOOK_ATTRS = ("decode", "encode", "decode_tiled", "encode_tiled")
HOOK_LABEL = "VAE"


def _make_wrapper(original: Callable[..., Any], cfg: dict) -> Callable[..., Any]:
    model = original.__self__

    def cached_call(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            note_loaded(model)

    return cached_call


class H3MSVAECacheAsync(PatchNode):
    """VAE → VAE (the same VAE; the hooks sit on its model)."""

    CATEGORY = "advanced/latent"
    RETURN_TYPES = ("VAE",)
    DESCRIPTION = (
        "Keeps the VAE's weights in pinned RAM so switching scenes does not read them from disk "
        "again. Place it after Select VAE Device. enabled=false removes the hooks; bypassing or "
        "muting the node cannot."
    )

    INPUTS: ClassVar[dict] = {
        "required": {
            "vae": ("VAE",),
            "enabled": enabled_input("Off removes the hooks and the VAE's cache group."),
            "weight_cache": (
                "BOOLEAN",
                {
                    "default": True,
                    "tooltip": "While ComfyUI has the VAE unloaded, keep its weights in pinned "
                    "RAM, so ComfyUI's next load copies them at full speed (0.56 GB for the H3 "
                    "audio VAE). Holds nothing (and says why) where ComfyUI never unloads the "
                    "weights: --cpu, --gpu-only, DynamicVRAM (ComfyUI's default on NVIDIA; use "
                    "--disable-dynamic-vram), or a quantized (int8) VAE. Off drops the copy: RAM "
                    "is freed only while ComfyUI has the VAE loaded (while it is unloaded the copy "
                    "is its host weights and stays with it).",
                },
            ),
            "cache_ram_reserve_gb": ram_reserve_input(
                "Fill the cache only while at least this much RAM stays available."
            ),
        },
    }

    def patch(
        self, vae: Any, enabled: bool, weight_cache: bool, cache_ram_reserve_gb: float
    ) -> tuple:
        model = vae.first_stage_model
        key = vae_key(vae)
        group = f"vae:{type(model).__name__ if key[1] == 'object' else os.path.basename(key[1])}"
        caches.register_status()
        patcher = getattr(vae, "patcher", None)
        if (
            not enabled
            or not weight_cache
            or patcher is None
            or not attach(patcher, group, key, cache_ram_reserve_gb)
        ):
            # the weights are this node's only job: without the cache its hooks have nothing to
            # count
            for attr in HOOK_ATTRS:
                method_hooks.uninstall(model, attr)
            if not enabled or not weight_cache or patcher is None:
                detach(model, group)
            return (vae,)
        cfg = {"group": group, "reserve_gb": float(cache_ram_reserve_gb)}
        for attr in HOOK_ATTRS:
            if callable(getattr(model, attr, None)):
                method_hooks.install(model, attr, HOOK_LABEL, _make_wrapper, cfg)
        log.info("node configured: group %s, RAM reserve %g GiB", group, cache_ram_reserve_gb)
        return (vae,)
