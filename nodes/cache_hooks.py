"""What the two cache nodes share: weight keys from the loaders' reload factories, and staging a model's weights
through the pinned-RAM weight cache (h3ms_async/caches.py).

Staging, before every hooked call: the first call fills the group's pinned copy (the RAM reserve may refuse it, with
one warning, and the call runs without the cache); a later call that finds the model's weights dropped (ComfyUI
evicted them to the ``meta`` device) puts them back from the pinned copy on the model's device instead of reading
the file again.

Under DynamicVRAM (ComfyUI's ``ModelPatcherDynamic`` with comfy-aimdo, its default on NVIDIA) the weights are never
evicted that way: they stay host tensors that ComfyUI pins and faults into VRAM itself, through comfy.ops' cast path.
A second pinned copy would only double the RAM, so the weight cache stands aside for such a model
(:func:`weights_managed_by_comfy`, one warning); the text-encoder output cache works the same either way.
"""
from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from h3ms_async.caches import CacheRefused, named_tensors, weight_cache
from h3ms_async.log import get_logger

log = get_logger("Caches")


def file_key(patcher: Any, *extra: Any) -> tuple | None:
    """``(realpath, size, mtime_ns, *extra)`` of the single file the loader's reload factory names, or None."""
    init = getattr(patcher, "cached_patcher_init", None)
    try:
        paths = init[1][0]
        if isinstance(paths, (list, tuple)):
            if len(paths) != 1:
                return None
            paths = paths[0]
        path = os.path.realpath(paths)
        st = os.stat(path)
    except (TypeError, IndexError, KeyError, OSError):
        return None
    return (path, st.st_size, st.st_mtime_ns, *extra)


DYNAMIC_NOTE = ("weight cache off for this model: ComfyUI runs it under DynamicVRAM (ModelPatcherDynamic), which "
                "keeps its weights in host RAM, pins them and streams them to the GPU itself, so there is nothing to "
                "restore; start ComfyUI with --disable-dynamic-vram to use the weight cache")


def weights_managed_by_comfy(patcher: Any) -> bool:
    """Whether ``patcher`` is ComfyUI's dynamic-VRAM patcher (``is_dynamic()``), which owns the weights' host copy."""
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def object_key(model: Any) -> tuple:
    """A key for a model object without a reload factory: a token stored on it, living as long as its weights."""
    token = model.__dict__.get("_h3ms_weight_token")
    if token is None:
        token = model._h3ms_weight_token = uuid.uuid4().hex
    return ("object", token)


def vae_key(vae: Any) -> tuple:
    """A VAE's weight key: its file from the loader's reload factory, else a token on its model object."""
    fkey = file_key(getattr(vae, "patcher", None))
    return ("vae", *fkey) if fkey is not None else ("vae", *object_key(vae.first_stage_model))


def _device_of(model: torch.nn.Module, fallback: Any) -> torch.device:
    for t in named_tensors(model).values():
        if not t.is_meta:
            return t.device
    return torch.device(fallback if fallback is not None else "cpu")


def stage_weights(model: torch.nn.Module, group: str, key: tuple, reserve_gb: float, cfg: dict,
                  load_device: Any = None) -> str:
    """Fill or use ``group``'s pinned copy for ``model``; returns what happened ("filled", "restored", "warm",
    "refused", "unsupported", "empty")."""
    wc = weight_cache()
    entry = wc.get(group, key)
    tensors = named_tensors(model)
    evicted = any(t.is_meta for t in tensors.values())
    if entry is None:
        if evicted or not tensors:
            return "empty"
        odd = sorted(n for n, t in tensors.items() if type(t.data) is not torch.Tensor)
        if odd:
            # Quantized weights (comfy-kitchen QuantizedTensor, e.g. an int8 H3 VAE) carry their layout and scales
            # outside the tensor data: a byte copy could not rebuild them, so such a model runs without the cache.
            if not cfg.get("unsupported_note"):
                log.warning("weight cache %s off for this model: %d tensors (e.g. %s) are %s, not plain tensors "
                            "(a quantized checkpoint); it runs without the weight cache", group, len(odd), odd[0],
                            type(tensors[odd[0]].data).__name__)
                cfg["unsupported_note"] = True
            return "unsupported"
        try:
            wc.fill(group, key, tensors, reserve_gb)
        except CacheRefused as exc:
            if not cfg.get("refused_note"):
                log.warning("%s", exc)
                cfg["refused_note"] = True
            return "refused"
        cfg["refused_note"] = False
        return "filled"
    if not evicted:
        return "warm"
    model.to_empty(device=_device_of(model, load_device))
    wc.restore(entry, model)
    log.info("weight cache %s: restored %.2f GiB from pinned RAM", group, entry.nbytes / 2**30)
    return "restored"
