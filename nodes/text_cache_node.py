"""The **H3 MS Text Encoder Cache** node (CLIP → CLIP): encoder outputs cached by content, and the
encoder's weights in pinned RAM while ComfyUI has them unloaded (``cache_hooks``).

The cache sits on ComfyUI's ``CLIP.encode_from_tokens`` and ``CLIP.encode_from_tokens_scheduled``
(class-level hooks that act only for a CLIP whose encoder object has a config here, so every clone
of a configured CLIP is cached, LoRA clones made after the node included).  There it runs before
ComfyUI loads the encoder: a hit returns without loading it.  The key (``docs/comfyui_facts.md`` §9)
is

* the encoder's weights: the files, CLIP type and load options from the loader's reload factory (the
  same file loaded again hits), else a token living on the encoder object;
* every patch route on the calling CLIP's patcher, by content (``patch_key``): LoRA weight patches,
  bypass injections, hooks with their keyframes and strengths, weight wrappers, object patches,
  model options;
* the call: the method, ``layer_idx`` (CLIP Set Last Layer) and every argument (tokens with their
  weights and embedded images, ``add_dict``, ``return_pooled``/``unprojected``).

A scheduled encode (Set CLIP Hooks with ``schedule_clip``: one encode per keyframe) is cached as one
call.  A call with anything the key cannot read safely runs plain (logged once per reason).
``hooks`` entries are never stored: a hit gets the calling CLIP's own through ComfyUI's
``add_hooks_to_dict``.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from h3ms_async.caches import digest, output_cache, register_status
from h3ms_async.log import get_logger

from . import method_hooks
from .cache_hooks import (
    CALLBACK_KEY,
    attach,
    detach,
    ensure_callback,
    file_key,
    note_loaded,
    object_key,
)
from .inputs import PatchNode, enabled_input, ram_reserve_input
from .patch_key import Unkeyable, patcher_fp

log = get_logger("TextEncoder")

HOOK_LABEL = "TextEncoder"
METHODS = ("encode_from_tokens", "encode_from_tokens_scheduled")
_NOT_KEYED = ("self", "show_pbar")  # a progress bar does not change the output

# encoder object (shared by every clone of a CLIP) -> live config; weak: a dropped encoder takes its
# config along
_CONFIGS: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
_NOTES: set[str] = set()
_NOTES_LOCK = threading.Lock()


def encoder_key(clip: Any) -> tuple:
    """The encoder's identity: its files, CLIP type and load options from the loader's reload
    factory (``(factory, (paths, embeddings, clip_type, options))``), else a token on the encoder
    object."""
    patcher = getattr(clip, "patcher", None)
    args = getattr(patcher, "cached_patcher_init", None)
    args = args[1] if isinstance(args, tuple) and len(args) > 1 else ()
    clip_type = repr(args[2]) if len(args) > 2 else None
    options = (
        repr(sorted(args[3].items(), key=str))
        if len(args) > 3 and isinstance(args[3], dict)
        else None
    )
    fkey = file_key(patcher, clip_type, options)
    return ("te", *(fkey if fkey is not None else object_key(clip.cond_stage_model)))


def _note_once(reason: str) -> None:
    with _NOTES_LOCK:
        if reason in _NOTES:
            return
        _NOTES.add(reason)
    log.warning("text-encoder output cache skipped for a call: %s; such calls run plain", reason)


def _strip_hooks(out: Any) -> Any:
    """``out`` without its ``hooks`` entries (objects of the calling CLIP, re-added on a hit),
    tensors shared."""
    if isinstance(out, dict):
        return {k: _strip_hooks(v) for k, v in out.items() if k != "hooks"}
    if isinstance(out, (list, tuple)):
        items = [_strip_hooks(v) for v in out]
        return items if isinstance(out, list) else tuple(items)
    return out


def _add_hooks(clip: Any, out: Any) -> None:
    """Give every conditioning dict of a hit the calling CLIP's hooks, as ComfyUI's encode does."""
    if isinstance(out, dict):
        clip.add_hooks_to_dict(out)
    elif isinstance(out, list):
        for item in out:
            if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict):
                clip.add_hooks_to_dict(item[1])


def _make_wrapper(original: Callable[..., Any], _cfg: dict) -> Callable[..., Any]:
    name = original.__name__
    sig = inspect.signature(original)

    def run_plain(clip: Any, cfg: dict, args: tuple, kwargs: dict) -> Any:
        if cfg["weight_cache"]:
            ensure_callback(clip.patcher)
        try:
            return original(clip, *args, **kwargs)
        finally:
            note_loaded(clip.cond_stage_model)

    def cached(clip: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = _CONFIGS.get(getattr(clip, "cond_stage_model", None))
        if cfg is None:
            return original(clip, *args, **kwargs)
        scheduled = name == "encode_from_tokens_scheduled"
        if cfg["entries"] < 1 or (
            scheduled and (clip.patcher.forced_hooks is None or not clip.use_clip_schedule)
        ):
            # unscheduled, ComfyUI's scheduled encode calls encode_from_tokens: that call is the
            # cached one
            return run_plain(clip, cfg, args, kwargs)
        t = time.perf_counter()
        try:
            bound = sig.bind(clip, *args, **kwargs)
            bound.apply_defaults()
            call = {k: v for k, v in bound.arguments.items() if k not in _NOT_KEYED}
            key = digest(
                cfg["base_key"],
                patcher_fp(clip.patcher, clip.cond_stage_model, CALLBACK_KEY),
                name,
                clip.layer_idx,
                call,
            )
        except (Unkeyable, TypeError) as exc:
            _note_once(str(exc))
            return run_plain(clip, cfg, args, kwargs)
        cache = output_cache()
        hit = cache.get(key)
        if hit is not None:
            _add_hooks(clip, hit)
            st = cache.stats()
            log.info(
                "output cache HIT %s: encoder neither loaded nor run (%.4f s incl. hashing); %d "
                "entries, %d hits / %d misses",
                key[:12],
                time.perf_counter() - t,
                st["entries"],
                st["hits"],
                st["misses"],
            )
            return hit
        out = run_plain(clip, cfg, args, kwargs)
        cache.put(key, _strip_hooks(out), cfg["entries"], cfg["reserve_gb"])
        st = cache.stats()
        log.info(
            "encoded in %.2f s (output cache MISS %s, %d/%d entries)",
            time.perf_counter() - t,
            key[:12],
            st["entries"],
            cfg["entries"],
        )
        return out

    cached.__name__ = cached.__qualname__ = name
    return cached


def _uninstall_if_unused(clip_class: type) -> None:
    if not _CONFIGS:
        for attr in METHODS:
            method_hooks.uninstall(clip_class, attr)


class H3MSTextEncoderCacheAsync(PatchNode):
    """CLIP → CLIP (a clone; the config sits on the shared encoder, the hooks on ComfyUI's CLIP
    class)."""

    CATEGORY = "advanced/conditioning"
    RETURN_TYPES = ("CLIP",)
    DESCRIPTION = (
        "Caches text-encoder outputs (a re-queued or repeated prompt neither loads nor runs the "
        "encoder) and keeps the encoder's weights in pinned RAM while ComfyUI has them unloaded. "
        "It acts for every clone of this CLIP: enabled=false turns it off; bypassing or muting the "
        "node cannot."
    )

    INPUTS: ClassVar[dict] = {
        "required": {
            "clip": ("CLIP",),
            "enabled": enabled_input(
                "Off stops caching this encoder and drops its weight copy (RAM freed only while "
                "ComfyUI has the encoder loaded: while it is unloaded the copy is its host weights "
                "and stays with it). Bypassing the node leaves an earlier configuration in place."
            ),
            "weight_cache": (
                "BOOLEAN",
                {
                    "default": True,
                    "tooltip": "While ComfyUI has the encoder unloaded, keep its weights in pinned "
                    "RAM so ComfyUI's next load copies them at full speed (about 14.6 GB for H3's "
                    "Qwen3-VL-32B encoder; no second copy: they are the host weights). Holds "
                    "nothing (and says why) where ComfyUI never unloads them: --cpu, --gpu-only, "
                    "an encoder ComfyUI runs on the CPU, DynamicVRAM (ComfyUI's default on NVIDIA; "
                    "use --disable-dynamic-vram). Off drops the copy: RAM is freed only while "
                    "ComfyUI has the encoder loaded (while it is unloaded the copy is its host "
                    "weights and stays with it).",
                },
            ),
            "cond_cache_entries": (
                "INT",
                {
                    "default": 64,
                    "min": 0,
                    "max": 4096,
                    "tooltip": "How many encoder outputs to keep (least recently used go first); 0 "
                    "= output cache off.",
                },
            ),
            "cache_ram_reserve_gb": ram_reserve_input(
                "Cache only while at least this much RAM stays available."
            ),
        },
    }

    def patch(
        self,
        clip: Any,
        enabled: bool,
        weight_cache: bool,
        cond_cache_entries: int,
        cache_ram_reserve_gb: float,
    ) -> tuple:
        cond_model = clip.cond_stage_model
        base = encoder_key(clip)
        group = "te:" + (
            os.path.basename(base[1]) if base[1] != "object" else type(cond_model).__name__
        )
        register_status()
        if not enabled:
            _CONFIGS.pop(cond_model, None)
            freed = detach(cond_model, group)
            _uninstall_if_unused(type(clip))
            log.info(
                "node configured: off for this encoder (weight copy dropped: %s)", freed.text()
            )
            return (clip.clone(),)
        if weight_cache:
            weight_cache = attach(clip.patcher, group, base, cache_ram_reserve_gb)
        else:
            detach(cond_model, group)
        _CONFIGS[cond_model] = {
            "base_key": base,
            "weight_cache": bool(weight_cache),
            "entries": int(cond_cache_entries),
            "reserve_gb": float(cache_ram_reserve_gb),
        }
        for attr in METHODS:
            method_hooks.install(type(clip), attr, HOOK_LABEL, _make_wrapper, {})
        log.info(
            "node configured: output cache %s, weight cache %s, RAM reserve %g GiB",
            f"{cond_cache_entries} entries" if cond_cache_entries else "off",
            "on" if weight_cache else "off",
            cache_ram_reserve_gb,
        )
        return (clip.clone(),)
