"""Fingerprints of everything ComfyUI can put on a CLIP's patcher that changes what its encoder
computes, for the Text Encoder Cache's key (``docs/comfyui_facts.md`` §9).

ComfyUI changes a CLIP's output through its ``ModelPatcher``: weight patches (``LoraLoader``:
``patches``), bypass injections (``LoraLoaderBypass``: ``injections`` holding the adapters and
strengths in closures), hooks with their keyframes and strengths (``Set CLIP Hooks``:
``forced_hooks``, ``hook_patches``), weight wrappers, object patches, model options, wrappers and
callbacks.  Each is fingerprinted by content, never by an id: a patch rebuilt from the same file
gives the same fingerprint, and two patches that differ in one strength or one tensor byte never do.

A fingerprint is a sha256 over a tagged walk (a Merkle tree: every node hashes its tag and its
children's fingerprints).  What the walk cannot read safely (an object of a class outside ComfyUI, a
module outside the encoder, a tensor subclass) raises :class:`Unkeyable`; the cache then runs that
call plain.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import marshal
import threading
import types
import weakref
from typing import Any

import torch

_TAG_PLAIN = (type(None), bool, int, float, complex, str, bytes)
# a patch set never changes under one uuid (ComfyUI gives add_patches a new one), so its fingerprint
# is kept per uuid
_PATCH_MEMO: dict[Any, str] = {}
_PATCH_MEMO_MAX = 256
_TENSOR_MEMO: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
_LOCK = threading.Lock()
# state a ComfyUI object holds only while injected, not what it computes: the bypass hook's saved
# forward
_TRANSIENT = {("comfy.weight_adapter.bypass", "BypassForwardHook"): frozenset({"original_forward"})}


class Unkeyable(TypeError):
    """Something on the CLIP cannot be fingerprinted safely; the call runs without the cache."""


def _h(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(b"%d:" % len(b))
        h.update(b)
    return h.hexdigest()


def tensor_fp(t: torch.Tensor) -> str:
    """dtype, shape and bytes of ``t`` (not its device: the same values on another device compute
    the same); remembered per tensor object and version, so a LoRA's tensors are read once."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise Unkeyable(f"a {type(t).__name__} tensor (its layout lives outside its bytes)")
    # an inference tensor has no version counter: it is read every time
    version = None if t.is_inference() else t._version
    with _LOCK:
        memo = _TENSOR_MEMO.get(id(t))
        if version is not None and memo is not None and memo[0]() is t and memo[1] == version:
            return memo[2]
    c = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"T{c.dtype}{tuple(c.shape)}:".encode())
    if c.numel():
        h.update(c.reshape(-1).view(torch.uint8).numpy())
    fp = h.hexdigest()
    if version is None:
        return fp
    with _LOCK:
        if len(_TENSOR_MEMO) > 65536:  # drop dead entries rather than grow without bound
            for k in [k for k, v in _TENSOR_MEMO.items() if v[0]() is None]:
                del _TENSOR_MEMO[k]
        _TENSOR_MEMO[id(t)] = (weakref.ref(t), version, fp)
    return fp


class Walker:
    """One fingerprinting pass over objects hanging off one encoder (``modules``: the encoder's
    submodules by id, so a bypass hook naming a layer is keyed by that layer's path)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.modules = {id(m): name for name, m in encoder.named_modules()}
        self.stack: list[int] = []

    def fp(self, obj: Any) -> str:
        if isinstance(obj, _TAG_PLAIN):
            return _h("P", type(obj).__name__, repr(obj))
        if isinstance(obj, torch.Tensor):
            return _h("T", tensor_fp(obj))
        if isinstance(obj, (torch.dtype, torch.device)):
            return _h("D", str(obj))
        if isinstance(obj, enum.Enum):
            return _h("E", type(obj).__module__, type(obj).__qualname__, obj.name)
        if (
            id(obj) in self.stack
        ):  # a reference back up the walk: its position, not its content again
            return _h("C", str(self.stack.index(id(obj))))
        self.stack.append(id(obj))
        try:
            return self._composite(obj)
        finally:
            self.stack.pop()

    def _composite(self, obj: Any) -> str:
        if isinstance(obj, (list, tuple)):
            return _h("L" if isinstance(obj, list) else "U", *(self.fp(v) for v in obj))
        if isinstance(obj, (set, frozenset)):
            return _h("S", *sorted(self.fp(v) for v in obj))
        if isinstance(obj, dict):
            return _h("M", *sorted(_h(self.fp(k), self.fp(v)) for k, v in obj.items()))
        if isinstance(obj, torch.nn.Module):
            name = self.modules.get(id(obj))
            if name is None:
                raise Unkeyable(f"a {type(obj).__name__} module outside the encoder")
            return _h("N", name)
        if isinstance(obj, types.MethodType):
            return _h("B", self.fp(obj.__func__), self.fp(obj.__self__))
        if isinstance(obj, functools.partial):
            return _h("Q", self.fp(obj.func), self.fp(obj.args), self.fp(obj.keywords))
        if isinstance(obj, types.FunctionType):
            # its code (marshal: exact, no addresses), its defaults and what its closure captured
            cells = tuple(c.cell_contents for c in obj.__closure__ or ())
            return _h(
                "F",
                obj.__module__ or "",
                obj.__qualname__,
                hashlib.sha256(marshal.dumps(obj.__code__)).hexdigest(),
                self.fp(obj.__defaults__),
                self.fp(obj.__kwdefaults__),
                self.fp(cells),
            )
        if isinstance(obj, type):  # a class (e.g. the __class__ cell of a method using super())
            return _h("K", obj.__module__, obj.__qualname__)
        if isinstance(obj, types.BuiltinFunctionType):
            return _h("G", getattr(obj, "__module__", None) or "", obj.__qualname__)
        cls = type(obj)
        if cls.__module__.split(".")[0] in ("comfy", "comfy_extras") and hasattr(obj, "__dict__"):
            # ComfyUI's own patch, adapter, hook and keyframe classes: their state is their
            # attributes
            skip = _TRANSIENT.get((cls.__module__, cls.__qualname__), frozenset())
            return _h(
                "O",
                cls.__module__,
                cls.__qualname__,
                self.fp({k: v for k, v in vars(obj).items() if k not in skip}),
            )
        raise Unkeyable(f"a {cls.__module__}.{cls.__qualname__} object")


def patcher_fp(patcher: Any, encoder: torch.nn.Module, skip_callback_key: str) -> str:
    """The fingerprint of every patch route on ``patcher`` (see the module doc).  Callbacks
    registered under ``skip_callback_key`` (the cache's own) are left out: they do not touch the
    output."""
    w = Walker(encoder)
    with _LOCK:
        patches = _PATCH_MEMO.get(patcher.patches_uuid)
    if patches is None:
        patches = w.fp(patcher.patches)
        with _LOCK:
            if len(_PATCH_MEMO) >= _PATCH_MEMO_MAX:
                _PATCH_MEMO.pop(next(iter(_PATCH_MEMO)))
            _PATCH_MEMO[patcher.patches_uuid] = patches
    callbacks = {
        kind: {k: v for k, v in by_key.items() if k != skip_callback_key}
        for kind, by_key in getattr(patcher, "callbacks", {}).items()
    }
    parts = {
        "load_device": str(patcher.load_device),
        "patches": patches,
        "object_patches": patcher.object_patches,
        "weight_wrappers": patcher.weight_wrapper_patches,
        "injections": patcher.injections,
        "skip_injection": getattr(patcher, "skip_injection", False),
        "hook_patches": getattr(patcher, "hook_patches", None),
        "forced_hooks": getattr(patcher, "forced_hooks", None),
        "model_options": patcher.model_options,
        "wrappers": getattr(patcher, "wrappers", None),
        "callbacks": callbacks,
        "force_cast_weights": getattr(patcher, "force_cast_weights", False),
    }
    return _h(*(_h(k, v if k == "patches" else w.fp(v)) for k, v in sorted(parts.items())))
