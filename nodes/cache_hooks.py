"""What the two cache nodes share: weight keys from the loaders' reload factories, and the
pinned-RAM weight cache (h3ms_async/caches.py) attached to ComfyUI's own unload and load of a model.

Where ComfyUI moves a model's weights (``docs/comfyui_facts.md`` §9): with a GPU load device and a
host offload device and without DynamicVRAM (``--disable-dynamic-vram``, also under
``--lowvram``/``--novram``), its unload (``unload_all_models``, ``free_memory``:
``ModelPatcher.detach`` → ``unpatch_model``) restores the unpatched weights and moves them to host
RAM, and its next load copies them back.  The cache registers an ``on_detach_after`` callback on the
model's patcher (ComfyUI's own callback list, copied to every clone): right after that unload it
makes the host weights page-locked buffers (:meth:`WeightCache.home`), so ComfyUI's next load, LoRA
patches applied by ComfyUI after it as always, copies from pinned RAM.

Where ComfyUI never drops the weights the cache holds nothing and says why (status row and one log
line): load device equal to the offload device (``--cpu``, ``--gpu-only``, a text encoder ComfyUI
runs on the CPU) keeps them where they are; DynamicVRAM (``ModelPatcherDynamic``, ComfyUI's default
on NVIDIA) keeps them as host tensors it pins and streams itself; quantized weights (comfy-kitchen
``QuantizedTensor``) keep layout and scales outside the bytes.
"""

from __future__ import annotations

import os
import uuid
import weakref
from typing import Any

import torch

from h3ms_async.caches import CacheRefused, Freed, named_tensors, weight_cache
from h3ms_async.log import get_logger

log = get_logger("Caches")

CALLBACK_KEY = "h3ms_weight_cache"
ON_DETACH = "on_detach_after"  # comfy.patcher_extension.CallbacksMP.ON_DETACH

# model object -> {"group", "key", "reserve_gb"}: weak, so a model ComfyUI dropped is not kept alive
_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()


def file_key(patcher: Any, *extra: Any) -> tuple | None:
    """``(realpath, size, mtime_ns)`` per file the loader's reload factory names (CLIPLoader,
    DualCLIPLoader, VAELoader), then ``extra``; None without such a factory."""
    init = getattr(patcher, "cached_patcher_init", None)
    try:
        paths = init[1][0]
        paths = list(paths) if isinstance(paths, (list, tuple)) else [paths]
        stats = []
        for p in paths:
            real = os.path.realpath(p)
            st = os.stat(real)
            stats += [real, st.st_size, st.st_mtime_ns]
    except (TypeError, IndexError, KeyError, OSError):
        return None
    return (*stats, *extra) if stats else None


def object_key(model: Any) -> tuple:
    """A key for a model object without a reload factory: a token stored on it, living as long as
    its weights."""
    token = model.__dict__.get("_h3ms_weight_token")
    if token is None:
        token = model._h3ms_weight_token = uuid.uuid4().hex
    return ("object", token)


def vae_key(vae: Any) -> tuple:
    """A VAE's weight key: its file from the loader's reload factory, else a token on its model
    object."""
    fkey = file_key(getattr(vae, "patcher", None))
    return ("vae", *fkey) if fkey is not None else ("vae", *object_key(vae.first_stage_model))


def never_dropped(patcher: Any, model: torch.nn.Module) -> str | None:
    """Why ComfyUI never drops or moves ``model``'s weights (so a cache would hold a useless copy),
    or None."""
    probe = getattr(patcher, "is_dynamic", None)
    if callable(probe) and probe():
        return (
            "ComfyUI runs it under DynamicVRAM (ModelPatcherDynamic), which keeps its weights in "
            "host RAM, pins them and streams them to the GPU itself; start ComfyUI with "
            "--disable-dynamic-vram to use the weight cache"
        )
    odd = sorted(n for n, t in named_tensors(model).items() if type(t.data) is not torch.Tensor)
    if odd:
        return (
            f"{len(odd)} tensors (e.g. {odd[0]}) are "
            f"{type(named_tensors(model)[odd[0]].data).__name__}, not plain tensors (a quantized "
            "checkpoint): a byte copy cannot rebuild them"
        )
    load, offload = getattr(patcher, "load_device", None), getattr(patcher, "offload_device", None)
    if load is None or torch.device(load) == torch.device(offload):
        return (
            f"its load device and offload device are both {load}: ComfyUI never moves its weights, "
            "so there is nothing to restore"
        )
    return None


def _on_detach(patcher: Any, unpatch_all: bool) -> None:
    """ComfyUI's ``on_detach_after`` callback: its unload just moved the weights to the offload
    device."""
    cfg = _ATTACHED.get(patcher.model)
    if cfg is None or not unpatch_all:
        return
    try:
        weight_cache().home(cfg["group"], cfg["key"], patcher.model, cfg["reserve_gb"])
    except CacheRefused as exc:
        if not cfg.get("refused_note"):
            log.warning("%s", exc)
            cfg["refused_note"] = True


def attach(patcher: Any, group: str, key: tuple, reserve_gb: float) -> bool:
    """Cache ``patcher.model``'s weights in ``group`` from ComfyUI's next unload on; or, where
    ComfyUI never drops them, hold nothing and say why.  Returns whether the cache is attached."""
    model = patcher.model
    why = never_dropped(patcher, model)
    if why is not None:
        detach(model, group)
        weight_cache().stand_aside(group, why)
        return False
    _ATTACHED[model] = {"group": group, "key": key, "reserve_gb": float(reserve_gb)}
    ensure_callback(patcher)
    return True


def ensure_callback(patcher: Any) -> None:
    """Register :func:`_on_detach` on ``patcher`` once (clones made after this carry it)."""
    if _on_detach not in patcher.get_callbacks(ON_DETACH, CALLBACK_KEY):
        patcher.add_callback_with_key(ON_DETACH, CALLBACK_KEY, _on_detach)


def detach(model: torch.nn.Module, group: str) -> Freed:
    """Stop caching ``model``'s weights and drop ``group``'s copy; returns what that gave back
    (while ComfyUI has ``model`` unloaded the copy is its host weights and stays with it)."""
    _ATTACHED.pop(model, None)
    return weight_cache().release(group)


def note_loaded(model: torch.nn.Module) -> None:
    """After a call during which ComfyUI may have loaded ``model``: count a restore from the pinned
    copy."""
    cfg = _ATTACHED.get(model)
    if cfg is not None and weight_cache().note_loaded(cfg["group"], model):
        log.info("weight cache %s: ComfyUI loaded the weights from the pinned copy", cfg["group"])
