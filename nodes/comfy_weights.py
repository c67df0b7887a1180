"""What the split reads out of ComfyUI's model internals: the weight key and each block's weights.

The one node module on ComfyUI's private API: ``ModelPatcher.cached_patcher_init``,
``patches_uuid``, ``backup``, ``patches``, ``patch_weight_to_device``, ``weight_wrapper_patches``,
the ``<param>_lowvram_function`` / ``LowVramPatch`` markers, ``comfy.ops.cast_bias_weight`` /
``uncast_bias_weight`` and comfy-kitchen's ``QuantizedTensor`` internals (``_qdata``, ``_params``,
``_layout_cls``); a ComfyUI change that moves them breaks here and nowhere else. Weights go through
ComfyUI's own patch path (``docs/comfyui_facts.md`` §5.1), so the split computes with exactly the
tensors plain ComfyUI would.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from h3ms_async.runtime.file_bytes import FileBytes
from h3ms_async.runtime.host_memory import GIB, ram_info
from h3ms_async.runtime.readahead import BlockReadahead
from h3ms_async.runtime.weight_store import PatchedKey, Source
from workers.dit.ops import held_by_ranks

from .errors import MultiStreamError

_BLOCK_PATCH = re.compile(r"diffusion_model\.blocks\.(\d+)\.(.+)")


def patched_block_params(patcher: Any) -> frozenset[tuple[int, str]]:
    """``(block, in-block parameter name)`` of every block parameter the ranks hold that
    ``patcher``'s weight patches (``patches``: LoRA and other weight patches) change."""
    out = set()
    for key in getattr(patcher, "patches", {}):
        m = _BLOCK_PATCH.fullmatch(str(key))
        if m and held_by_ranks(m.group(2)):
            out.add((int(m.group(1)), m.group(2)))
    return frozenset(out)


def weight_key(patcher: Any) -> tuple[PatchedKey, str | None]:
    """``(key, warning)``: the shm weight-store key of what ``patcher`` would run.

    The key's base comes from the loader's reload factory (``cached_patcher_init``: file, options);
    without one it is the model object's ``id``, with a warning, and every reload refills the
    store. Its patch part is ComfyUI's ``patches_uuid`` with the block parameters the patches
    change, so a LoRA change rewrites only those (``WeightStore.rewrite``).
    """
    patches = str(getattr(patcher, "patches_uuid", ""))
    patched = patched_block_params(patcher)
    path = checkpoint_path(patcher)
    if path is not None:
        st = os.stat(path)
        args = patcher.cached_patcher_init[1]
        options = args[1] if len(args) > 1 else None
        opts = (
            repr(sorted(options.items(), key=lambda kv: str(kv[0])))
            if isinstance(options, Mapping)
            else repr(options)
        )
        return PatchedKey(("dit", path, st.st_size, st.st_mtime_ns, opts), patches, patched), None
    model = getattr(patcher, "model", patcher)
    return PatchedKey(("dit-object", id(model)), patches, patched), (
        "weight store keyed by model object: the loader gave no single-file reload factory "
        "(cached_patcher_init); load the DiT with a core loader (UNETLoader / "
        "CheckpointLoaderSimple) to keep the store across reloads"
    )


def checkpoint_path(patcher: Any) -> str | None:
    """The real path of the single file the loader's reload factory (``cached_patcher_init``)
    loads the model from, or None."""
    init = getattr(patcher, "cached_patcher_init", None)
    if init and len(init) >= 2 and init[1]:
        path = init[1][0]
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            return os.path.realpath(path)
    return None


# --- weights through ComfyUI's own patch path -----------------------------------------------------


def _is_quantized(t: Any) -> bool:
    return hasattr(t, "_qdata") and hasattr(t, "_params")


def _patched_in_cast(module: Any) -> bool:
    """True when ComfyUI applies ``module``'s weight patches inside its cast
    (``comfy.ops.cast_bias_weight``) rather than into the live weight: ``ModelPatcherDynamic`` sets
    ``<param>_lowvram_function``; the classic patcher, for a module it leaves offloaded
    (``--lowvram``, a partial load), puts a ``LowVramPatch`` in ``<param>_function``."""
    for param in ("weight", "bias"):
        if getattr(module, f"{param}_lowvram_function", None) is not None:
            return True
        if any(
            getattr(f, "is_lowvram_patch", False) for f in getattr(module, f"{param}_function", ())
        ):
            return True
    return False


def _wants_requant(module: Any, name: str) -> bool:
    """The ``want_requant`` ComfyUI's forward passes to the cast for this module at inference.

    An int8 linear keeps its quantized path (and asks the cast to re-quantize a patched weight) when
    it has no weight functions and no full-precision flags; H3's ``mlp.fc2`` goes through
    ``comfy.ops.linear_input_act``, which always asks for it on a tensorwise int8 weight.
    """
    weight = getattr(module, "weight", None)
    if not _is_quantized(weight):
        return False
    if (
        name.endswith("mlp.fc2")
        and weight._layout_cls == "TensorWiseINT8Layout"
        and not getattr(weight._params, "transposed", False)
    ):
        return True
    return (
        getattr(module, "layout_type", None) is not None
        and not getattr(module, "_full_precision_mm", False)
        and not getattr(module, "comfy_force_cast_weights", False)
        and not getattr(module, "weight_function", ())
        and not getattr(module, "bias_function", ())
    )


def _cast_path_tensors(
    patcher: Any, module: Any, name: str, compute_dtype: torch.dtype, out: dict[str, torch.Tensor]
) -> None:
    """Put ``module``'s weight and bias, as ComfyUI's own cast hands them to its forward, into
    ``out`` (copies on the cast's device, store names; ``name`` is the module's in-block name).

    Such a module's patched weight exists only inside ``comfy.ops.cast_bias_weight`` (under
    ``ModelPatcherDynamic`` its storage may be a read-only mapping of the checkpoint file), so this
    calls the cast with the forward's arguments and copies the result out before releasing it.
    """
    import comfy.ops

    weight, bias, offload = comfy.ops.cast_bias_weight(
        module,
        None,
        dtype=compute_dtype,
        device=patcher.load_device,
        bias_dtype=compute_dtype,
        offloadable=True,
        compute_dtype=compute_dtype,
        want_requant=_wants_requant(module, name),
    )
    try:
        _put(out, f"{name}.weight", weight, released=True)
        if bias is not None:
            _put(out, f"{name}.bias", bias, released=True)
    finally:
        comfy.ops.uncast_bias_weight(module, weight, bias, offload)


def effective_weight(patcher: Any, key: str) -> Any:
    """The tensor ComfyUI computes with for state-dict ``key`` (LoRA/weight patches and weight
    wrappers applied) of a module whose patches ComfyUI bakes into the weight.

    Weights a loaded model already holds patched are taken as they are, never patched twice. A
    patched key is computed on ``patcher.load_device``, where ComfyUI's load computes patches (in
    that device's ``lora_compute_dtype``), so the result matches ComfyUI's bit for bit.
    """
    backup = getattr(patcher, "backup", {})
    if key not in backup:
        device = patcher.load_device if key in patcher.patches else None
        weight = patcher.patch_weight_to_device(key, device_to=device, return_weight=True)
    elif getattr(patcher.model, "current_weight_patches_uuid", None) == patcher.patches_uuid:
        path, attr = key.rsplit(".", 1)
        weight = getattr(patcher.get_model_object(path), attr)
    elif key not in patcher.patches:
        weight = backup[
            key
        ].weight  # the live weight carries another clone's patches; ours has none here
    else:
        raise MultiStreamError(
            f"{key} currently holds another model clone's LoRA/weight patches, so this clone's "
            "patched weight cannot be computed; let ComfyUI load this model (queue the prompt "
            "again) before the split reads its weights"
        )
    for fn in getattr(patcher, "weight_wrapper_patches", {}).get(key, []):
        weight = fn(weight)
    return weight


def _convrot_tag(params: Any) -> torch.Tensor | None:
    if not getattr(params, "convrot", False):
        return None
    conf = {
        "format": "int8_tensorwise",
        "convrot": True,
        "convrot_groupsize": int(params.convrot_groupsize),
    }
    return torch.frombuffer(bytearray(json.dumps(conf).encode("utf-8")), dtype=torch.uint8).clone()


def _put(out: dict[str, torch.Tensor], name: str, w: Any, *, released: bool = False) -> None:
    """Store ``w`` under ``name`` as the weight store takes it, on the device it is on: the store
    copies from any device straight into shared memory, so a weight ComfyUI patched on its GPU
    goes there in one device-to-host copy, with no pageable host tensor between. An int8
    ``QuantizedTensor`` becomes ``<name>`` (its ``_qdata``) + ``<name>_scale`` (``_params.scale``,
    fp32) + ``<linear>.comfy_quant`` (JSON bytes) when it is ConvRot. ``released``: ComfyUI
    reuses ``w``'s memory after this call (its cast buffers), so a copy is kept, on ``w``'s
    device."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if released else t.detach()

    if _is_quantized(w):
        out[name] = keep(w._qdata)
        out[f"{name}_scale"] = keep(w._params.scale.to(torch.float32))
        tag = _convrot_tag(w._params)
        if tag is not None:
            out[f"{name.rsplit('.', 1)[0]}.comfy_quant"] = tag
    else:
        out[name] = keep(w)


def block_tensors(
    patcher: Any, block_index: int, compute_dtype: torch.dtype, prefix: str = "diffusion_model."
) -> dict[str, torch.Tensor]:
    """Block ``block_index``'s effective tensors on the device ComfyUI holds or patched them on
    (the store copies them from there), keyed by in-block name, as the weight
    store takes them: what ComfyUI's cast gives for a module that patches in its cast, the stored
    (patched) tensors otherwise, which ranks cast to the activation dtype as ComfyUI's ops do.
    The adaLN projection is not read: its rows are computed in ComfyUI (``nodes/modulation.py``)
    and the ranks hold no adaLN weights (``workers.dit.ops.held_by_ranks``).
    """
    dm = patcher.get_model_object(prefix.rstrip("."))
    block = dm.blocks[block_index]
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in block.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if not own or not held_by_ranks(f"{mod_name}."):
            continue
        if _patched_in_cast(module):
            _cast_path_tensors(patcher, module, mod_name, compute_dtype, out)
            own = [n for n in own if n not in ("weight", "bias")]
        for n in own:
            name = f"{mod_name}.{n}" if mod_name else n
            _put(out, name, effective_weight(patcher, f"{prefix}blocks.{block_index}.{name}"))
    return out


def file_source(t: torch.Tensor) -> Source:
    """``t`` as the store takes it: its bytes' place in the checkpoint (:class:`FileBytes`) when
    ``t`` is ComfyUI's view of a whole tensor's file range, unchanged
    (``comfy.utils.load_safetensors`` under DynamicVRAM maps the file and notes each tensor's
    range on its storage as ``_comfy_tensor_file_slice``), else ``t``.  The file descriptor is
    the mapping's own, open while the tensor lives."""
    info = getattr(t.untyped_storage(), "_comfy_tensor_file_slice", None)
    fd = getattr(info, "file_ref", None)
    if (
        not isinstance(fd, int)
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or t.storage_offset() != 0
        or t.numel() * t.element_size() != info.size
    ):
        return t
    return FileBytes(t.detach(), fd, int(info.offset))


def block_nbytes(dm: Any, block_index: int) -> int:
    """Bytes of the block's weights the store takes, as stored (int8 data counts one byte per
    element; the adaLN projection stays in ComfyUI)."""
    total = 0
    for name, p in dm.blocks[block_index].named_parameters():
        if not held_by_ranks(name):
            continue
        data = p._qdata if _is_quantized(p) else p
        total += data.numel() * data.element_size()
    return total


def available_ram() -> int:
    """Available RAM in bytes: the smaller of the host's and the memory cgroup's figure."""
    return int(ram_info().available_bytes)


def _owner(i: int, name: str) -> str:
    """The module (``diffusion_model.blocks.<i>[.<path>]``) holding block ``i``'s tensor ``name``,
    as ComfyUI's ``backup`` names it."""
    block = f"diffusion_model.blocks.{i}"
    return f"{block}.{name.rsplit('.', 1)[0]}" if "." in name else block


def _in_place(patcher: Any) -> set[str]:
    """The modules (``diffusion_model.blocks.<i>.<path>``) whose weights ComfyUI patched in place
    (the originals kept in ``backup``): their live tensors no longer equal the file's bytes."""
    return {k.rsplit(".", 1)[0] for k in getattr(patcher, "backup", {})}


def _read_ahead(patcher: Any, adaln: bool) -> Callable[[int, str], bool]:
    """Which of block ``i``'s tensors the readahead brings into the page cache: those the fill
    reads (``adaln``: the adaLN projection too, which the step's rows read just before), less the
    modules nothing reads from the file: those ComfyUI patched in place (their tensors are taken
    as they are) and those it patches in its cast, which reads them itself (comfy-aimdo reads an
    aligned file range with ``O_DIRECT``, past the page cache: read ahead, they would be read
    twice)."""
    dm = patcher.get_model_object("diffusion_model")
    in_place = _in_place(patcher)

    def wanted(i: int, name: str) -> bool:
        if not (adaln or held_by_ranks(name)):
            return False
        if _owner(i, name) in in_place:
            return False
        try:
            module = dm.blocks[i].get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
        except (AttributeError, IndexError):
            return True
        return module is None or not _patched_in_cast(module)

    return wanted


def block_reader(
    patcher: Any,
    reserve_gb: float,
    compute_dtype: torch.dtype,
    ram: Callable[[], int] = available_ram,
    before: Callable[[int], object] | None = None,
    read_ahead: bool = True,
) -> Callable[[int], dict[str, Source]]:
    """``block_weights(i)`` for ``SplitEngine.load_weights``, refusing a block that would eat into
    the RAM reserve.  ``before(i)`` runs ahead of reading block i: the step's adaLN row of block i
    (``BlockModulation.row``), so a cold checkpoint is read once, block after block, and the
    readahead then asks for whole blocks, adaLN weights included.  A tensor ComfyUI maps unchanged
    from the checkpoint comes back as its file range (:func:`file_source`).  ``read_ahead=False``
    for a LoRA change's rewrite (``patched_weights``): it copies only the patched modules, which
    ComfyUI's cast reads itself, so reading the rest of each block ahead is all waste."""
    dm = patcher.get_model_object("diffusion_model")
    reserve = int(reserve_gb * GIB)
    path = checkpoint_path(patcher)
    ahead: list[BlockReadahead | None] = []  # made at the first read, if ever read

    def read(i: int) -> dict[str, Source]:
        if read_ahead and not ahead:
            safetensors = path is not None and path.lower().endswith((".safetensors", ".sft"))
            ahead.append(
                BlockReadahead.of(path, _read_ahead(patcher, adaln=before is not None))
                if path and safetensors
                else None
            )
        if ahead and ahead[0] is not None:
            ahead[0].reading(i)
        if before is not None:
            before(i)
        need = block_nbytes(dm, i)
        avail = ram()
        if avail - need < reserve:
            raise MultiStreamError(
                f"weight store: block {i} needs {need / GIB:.2f} GiB but only {avail / GIB:.2f} "
                f"GiB RAM is available and cache_ram_reserve_gb keeps {reserve_gb:g} GiB free; "
                "lower cache_ram_reserve_gb, free RAM, or run the model unsplit"
            )
        with torch.inference_mode():
            tensors = block_tensors(patcher, i, compute_dtype)
        # a weight ComfyUI patched in place (its original kept in ``backup``) no longer equals its
        # file's bytes: that module's tensors are copied as they are
        backed = _in_place(patcher)
        return {n: t if _owner(i, n) in backed else file_source(t) for n, t in tensors.items()}

    return read
