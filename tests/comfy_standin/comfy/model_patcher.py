"""Stand-in for ``comfy.model_patcher.ModelPatcher``: only what the pack touches.

Facts followed (h3_dit_facts §3.1/§3.2/§6.3, node_surface_facts §1.6, and ComfyUI's model_patcher.py):
- ``clone()`` shares ``model``, copies ``patches`` lists, keeps ``patches_uuid``, deep-copies ``model_options``
  (dicts and lists), copies ``wrappers``/``callbacks`` two levels deep, shares ``backup`` and keeps
  ``cached_patcher_init``;
- ``set_model_patch_replace`` builds a NEW transformer_options dict (copying ``patches_replace`` and the named
  sub-dict) and stores the patch under ``(block_name, number)``, replacing what was there;
- ``add_wrapper_with_key`` appends to ``wrappers[type][key]``; ``pre_run`` sets ``model.current_patcher`` and calls the
  ON_PRE_RUN callbacks with the patcher;
- ``add_patches`` records LoRA-style patches and gives the patcher a fresh ``patches_uuid``;
- ``patch_weight_to_device(key, device_to=None, return_weight=True)`` returns the patched weight, computed on
  ``device_to`` (else where the weight lives), without touching the model; without a patch for ``key`` it returns the
  live weight, wherever it is.  ``patch_model`` bakes patches into the live parameters, keeping the
  originals in ``backup`` and setting ``model.current_weight_patches_uuid`` (what a full load does).
The only patch kind here is ComfyUI's plain ``"diff"`` (weight + strength * diff), computed in fp32 and rounded back
to the weight's dtype; quantized weights go through the module's ``convert_weight``/``set_weight`` like ComfyUI.
"""
from __future__ import annotations

import uuid
from collections import namedtuple
from typing import Any, Callable

import torch

from . import utils
from .patcher_extension import CallbacksMP

_Backup = namedtuple("_Backup", ["weight", "inplace_update"])


def _deepcopy_list_dict(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deepcopy_list_dict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy_list_dict(v) for v in value]
    return value


class ModelPatcher:
    def __init__(self, model: torch.nn.Module, load_device: torch.device, offload_device: torch.device):
        self.model = model
        self.load_device = load_device
        self.offload_device = offload_device
        self.patches: dict[str, list] = {}
        self.backup: dict[str, _Backup] = {}
        self.object_patches: dict[str, Any] = {}
        self.object_patches_backup: dict[str, Any] = {}
        self.weight_wrapper_patches: dict[str, list[Callable]] = {}
        self.model_options: dict = {"transformer_options": {}}
        self.patches_uuid = uuid.uuid4()
        self.wrappers: dict[str, dict[str, list[Callable]]] = {}
        self.callbacks: dict[str, dict[str, list[Callable]]] = {}
        self.cached_patcher_init: tuple | None = None
        if not hasattr(model, "current_weight_patches_uuid"):
            model.current_weight_patches_uuid = None

    def is_dynamic(self) -> bool:
        return False

    def clone(self) -> "ModelPatcher":
        n = ModelPatcher(self.model, self.load_device, self.offload_device)
        n.patches = {k: list(v) for k, v in self.patches.items()}
        n.patches_uuid = self.patches_uuid
        n.backup = self.backup
        n.object_patches = dict(self.object_patches)
        n.object_patches_backup = self.object_patches_backup
        n.weight_wrapper_patches = dict(self.weight_wrapper_patches)
        n.model_options = _deepcopy_list_dict(self.model_options)
        n.wrappers = {k: {k1: list(v1) for k1, v1 in v.items()} for k, v in self.wrappers.items()}
        n.callbacks = {k: {k1: list(v1) for k1, v1 in v.items()} for k, v in self.callbacks.items()}
        n.cached_patcher_init = self.cached_patcher_init
        return n

    # --- options, wrappers, callbacks -------------------------------------------------------------------------
    def set_model_patch_replace(self, patch: Any, name: str, block_name: str, number: int, transformer_index=None):
        to = dict(self.model_options["transformer_options"])
        to["patches_replace"] = dict(to.get("patches_replace", {}))
        to["patches_replace"][name] = dict(to["patches_replace"].get(name, {}))
        key = (block_name, number) if transformer_index is None else (block_name, number, transformer_index)
        to["patches_replace"][name][key] = patch
        self.model_options["transformer_options"] = to

    def add_wrapper_with_key(self, wrapper_type: str, key: str, wrapper: Callable) -> None:
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type: str, key: str) -> None:
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def add_callback_with_key(self, call_type: str, key: str, callback: Callable) -> None:
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def remove_callbacks_with_key(self, call_type: str, key: str) -> None:
        self.callbacks.get(call_type, {}).pop(key, None)

    def get_all_callbacks(self, call_type: str) -> list[Callable]:
        found: list[Callable] = []
        for fns in self.callbacks.get(call_type, {}).values():
            found.extend(fns)
        return found

    def pre_run(self) -> None:
        if hasattr(self.model, "current_patcher"):
            self.model.current_patcher = self
        for callback in self.get_all_callbacks(CallbacksMP.ON_PRE_RUN):
            callback(self)

    def get_model_object(self, name: str) -> Any:
        if name in self.object_patches:
            return self.object_patches[name]
        if name in self.object_patches_backup:
            return self.object_patches_backup[name]
        return utils.get_attr(self.model, name)

    # --- weight patches ---------------------------------------------------------------------------------------
    def add_patches(self, patches: dict[str, torch.Tensor], strength_patch: float = 1.0) -> list[str]:
        sd = self.model.state_dict()
        added = []
        for key, diff in patches.items():
            if key in sd:
                self.patches.setdefault(key, []).append((strength_patch, ("diff", diff)))
                added.append(key)
        self.patches_uuid = uuid.uuid4()
        return added

    def add_weight_wrapper(self, name: str, function: Callable) -> None:
        self.weight_wrapper_patches[name] = self.weight_wrapper_patches.get(name, []) + [function]
        self.patches_uuid = uuid.uuid4()

    def _owner(self, key: str) -> tuple[torch.nn.Module, str]:
        path, attr = key.rsplit(".", 1)
        return utils.get_attr(self.model, path), attr

    def patch_weight_to_device(self, key: str, device_to=None, return_weight: bool = False):
        module, attr = self._owner(key)
        weight = getattr(module, attr)
        if key not in self.patches:
            return weight
        convert = getattr(module, f"convert_{attr}", None)
        setter = getattr(module, f"set_{attr}", None)
        # like ComfyUI: the patch math runs on device_to when given, else where the weight lives
        work = weight.detach().to(weight.device if device_to is None else device_to, copy=True)
        work = convert(work) if convert is not None else work
        work = work.to(torch.float32, copy=True)
        for strength, (kind, diff) in self.patches[key]:
            assert kind == "diff"
            work += strength * diff.to(torch.float32)
        if setter is not None:
            return setter(work, return_weight=True)
        out = work.to(weight.dtype)
        if return_weight:
            return out
        utils.get_attr(self.model, key.rsplit(".", 1)[0]).register_parameter(
            attr, torch.nn.Parameter(out, requires_grad=False))
        return None

    def patch_model(self) -> None:
        """Bake this patcher's patches into the live weights (what a full load does), originals to ``backup``."""
        for key in self.patches:
            module, attr = self._owner(key)
            if key not in self.backup:
                self.backup[key] = _Backup(getattr(module, attr), False)
            patched = self.patch_weight_to_device(key, return_weight=True)
            module.register_parameter(attr, torch.nn.Parameter(patched, requires_grad=False))
        self.model.current_weight_patches_uuid = self.patches_uuid

    def unpatch_model(self) -> None:
        for key, bk in list(self.backup.items()):
            module, attr = self._owner(key)
            module.register_parameter(attr, bk.weight)
        self.backup.clear()
        self.model.current_weight_patches_uuid = None

