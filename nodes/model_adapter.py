"""ComfyUI ModelPatcher ↔ core: H3 detection, config, weight key and weight reading, patch capture, wrapper install.

How the split sits on a ModelPatcher (``docs/comfyui_facts.md`` §8):
- a DIFFUSION_MODEL wrapper under ``WRAPPER_KEY`` (:class:`SplitWrapper`) and one ``("double_block", i)`` patch per
  block: block 0's runs the whole stack on the workers, the others hand the stream back untouched, so H3's own
  ``_forward`` keeps the preamble and the final layer;
- ComfyUI keeps one patch per key, so a user patch set on the same key *before* our node is kept inside our patch
  (``displaced``) and one set *after* it replaces ours; the wrapper sorts both out on every call;
- an ON_PRE_RUN callback records which patcher is actually sampled (a LoRA node after ours makes a new clone that
  shares our wrapper), so the weights and their key come from that patcher.
"""
from __future__ import annotations

import json
import os
import threading
import weakref
from typing import Any, Callable, Mapping

import torch

from h3ms_async.log import get_logger
from h3ms_async.observability.status import ram_info

from . import progress

log = get_logger("MultiStream")

WRAPPER_KEY = "h3_multistream_async"
H3_CLASS_NAME = "MiniMaxH3Model"
GIB = 1024 ** 3


class MultiStreamError(RuntimeError):
    """A model or patch set the split cannot run; the message names the cause and the fix."""


# --- recognising H3 -------------------------------------------------------------------------------------------

def diffusion_model_of(patcher: Any) -> Any | None:
    """The patcher's diffusion model (object patches honoured), or None when it has none."""
    getter = getattr(patcher, "get_model_object", None)
    if getter is None:
        return None
    try:
        return getter("diffusion_model")
    except (AttributeError, KeyError):
        return None


def is_h3(diffusion_model: Any) -> bool:
    """True for ComfyUI's ``comfy.ldm.minimax.model.MiniMaxH3Model`` (or a subclass); not for minimax_music."""
    return any(c.__name__ == H3_CLASS_NAME and c.__module__.endswith("minimax.model")
               for c in type(diffusion_model).__mro__)


def read_config(dm: Any):
    """The block-stack config, read from the live modules, never from defaults (pruned checkpoints
    differ)."""
    from h3ms_async.dit.reference import DiTConfig
    b0 = dm.blocks[0]
    head_dim = int(b0.attn.q_norm.weight.shape[0])
    return DiTConfig(
        hidden=int(b0.norm1.weight.shape[0]),
        layers=len(dm.blocks),
        heads=int(getattr(b0.attn, "heads", b0.attn.qkv_proj.weight.shape[0] // (3 * head_dim))),
        head_dim=head_dim,
        ffn=int(b0.mlp.fc1.weight.shape[0] // 2),
        t_dim=int(b0.adaln_proj.linear.weight.shape[1]),
        # t, h and w axes (docs/comfyui_facts.md §2.2)
        rope_pairs=3 * int(dm.rope.inv_freq.shape[0]),
        eps=float(b0.norm1.eps),
    )


# --- weight key ------------------------------------------------------------------------------------------------

def weight_key(patcher: Any) -> tuple[tuple, str | None]:
    """``(key, warning)``: the shm weight-store key of what ``patcher`` would run.

    From the loader's reload factory (``cached_patcher_init = (factory, (path, model_options, ...))``,
    ``docs/comfyui_facts.md`` §9): ``("dit", realpath, size, mtime_ns, repr(options), patches_uuid)``. Without it
    the key is tied to this model object (``id``), with a warning: the store is then refilled for every reloaded model.
    """
    patches = str(getattr(patcher, "patches_uuid", ""))
    init = getattr(patcher, "cached_patcher_init", None)
    if init and len(init) >= 2 and init[1]:
        args = init[1]
        path = args[0]
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            st = os.stat(path)
            options = args[1] if len(args) > 1 else None
            opts = (repr(sorted(options.items(), key=lambda kv: str(kv[0]))) if isinstance(options, Mapping)
                    else repr(options))
            return ("dit", os.path.realpath(path), st.st_size, st.st_mtime_ns, opts, patches), None
    model = getattr(patcher, "model", patcher)
    return ("dit-object", id(model), patches), (
        "weight store keyed by model object: the loader gave no single-file reload factory (cached_patcher_init); "
        "load the DiT with a core loader (UNETLoader / CheckpointLoaderSimple) to keep the store across reloads")


# --- weights through ComfyUI's own patch path ------------------------------------------------------------------

def _is_quantized(t: Any) -> bool:
    return hasattr(t, "_qdata") and hasattr(t, "_params")


def _patched_in_cast(module: Any) -> bool:
    """True when ComfyUI applies ``module``'s weight patches inside its cast (``comfy.ops.cast_bias_weight``) rather
    than into the live weight: ``ModelPatcherDynamic`` sets ``<param>_lowvram_function``; the classic patcher, for a
    module it leaves offloaded (``--lowvram``, a partial load), puts a ``LowVramPatch`` in ``<param>_function``."""
    for param in ("weight", "bias"):
        if getattr(module, f"{param}_lowvram_function", None) is not None:
            return True
        if any(getattr(f, "is_lowvram_patch", False) for f in getattr(module, f"{param}_function", ())):
            return True
    return False


def _wants_requant(module: Any, name: str) -> bool:
    """The ``want_requant`` ComfyUI's forward passes to the cast for this module at inference.

    An int8 linear keeps its quantized path (and asks the cast to re-quantize a patched weight) when it has no
    weight functions and no full-precision flags; H3's ``mlp.fc2`` goes through ``comfy.ops.linear_input_act``,
    which always asks for it on a tensorwise int8 weight.
    """
    weight = getattr(module, "weight", None)
    if not _is_quantized(weight):
        return False
    if name.endswith("mlp.fc2") and weight._layout_cls == "TensorWiseINT8Layout" and \
            not getattr(weight._params, "transposed", False):
        return True
    return (getattr(module, "layout_type", None) is not None and not getattr(module, "_full_precision_mm", False)
            and not getattr(module, "comfy_force_cast_weights", False)
            and not getattr(module, "weight_function", ()) and not getattr(module, "bias_function", ()))


def _cast_path_tensors(patcher: Any, module: Any, name: str, compute_dtype: torch.dtype,
                       out: dict[str, torch.Tensor]) -> None:
    """Put ``module``'s weight and bias, as ComfyUI's own cast hands them to its forward, into ``out`` (host copies,
    store names; ``name`` is the module's in-block name).

    The weight a patch-in-the-cast module computes with exists only inside ``comfy.ops.cast_bias_weight``: under
    ``ModelPatcherDynamic`` the module's own storage may be comfy-aimdo's read-only mapping of the checkpoint file, and
    the patch is applied to the copy the cast faults in on ``load_device``. So the split asks that function for the
    module's tensors with the arguments the forward gives it (compute dtype, load device, ``want_requant``), copies
    them to the host before the cast buffer can be reused, and then hands the buffer back (``uncast_bias_weight``).
    """
    import comfy.ops
    weight, bias, offload = comfy.ops.cast_bias_weight(
        module, None, dtype=compute_dtype, device=patcher.load_device, bias_dtype=compute_dtype, offloadable=True,
        compute_dtype=compute_dtype, want_requant=_wants_requant(module, name))
    try:
        _put_host(out, f"{name}.weight", weight)
        if bias is not None:
            _put_host(out, f"{name}.bias", bias)
    finally:
        comfy.ops.uncast_bias_weight(module, weight, bias, offload)


def effective_weight(patcher: Any, key: str) -> Any:
    """The tensor ComfyUI computes with for state-dict ``key`` of a module whose patches ComfyUI bakes into the
    weight (a module that patches in its cast goes through :func:`_cast_path_tensors` instead): LoRA/weight patches
    and weight wrappers applied.

    A fully loaded model already holds its patched weights (originals in ``patcher.backup``, and
    ``model.current_weight_patches_uuid == patcher.patches_uuid``): those are taken as they are, never patched twice;
    when the live weight holds another clone's patches, the original comes from ``backup``. Otherwise
    ``patch_weight_to_device(key, return_weight=True)`` gives the weight without touching the model: an unpatched key
    is the live tensor as it is (no device work); a patched key is computed on ``patcher.load_device``, because
    ComfyUI's load computes patches there, in that device's patch dtype (``lora_compute_dtype``), and the split must
    match it bit for bit (quantized layers re-quantize through their ``set_weight``,
    ``docs/comfyui_facts.md`` §5.1). That is one transient tensor at a time, moved to the host by
    :func:`block_tensors` before the next is made. Weight wrappers
    (``add_weight_wrapper``) run last, in order, as ``cast_bias_weight`` runs a module's ``weight_function`` list.
    """
    backup = getattr(patcher, "backup", {})
    if key not in backup:
        device = patcher.load_device if key in patcher.patches else None
        weight = patcher.patch_weight_to_device(key, device_to=device, return_weight=True)
    elif getattr(patcher.model, "current_weight_patches_uuid", None) == patcher.patches_uuid:
        path, attr = key.rsplit(".", 1)
        weight = getattr(patcher.get_model_object(path), attr)
    elif key not in patcher.patches:
        weight = backup[key].weight  # the live weight carries another clone's patches; ours has none here
    else:
        raise MultiStreamError(
            f"{key} currently holds another model clone's LoRA/weight patches, so this clone's patched weight cannot "
            "be computed; let ComfyUI load this model (queue the prompt again) before the split reads its weights")
    for fn in getattr(patcher, "weight_wrapper_patches", {}).get(key, []):
        weight = fn(weight)
    return weight


def _convrot_tag(params: Any) -> torch.Tensor | None:
    if not getattr(params, "convrot", False):
        return None
    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": int(params.convrot_groupsize)}
    return torch.frombuffer(bytearray(json.dumps(conf).encode("utf-8")), dtype=torch.uint8).clone()


def _put_host(out: dict[str, torch.Tensor], name: str, w: Any) -> None:
    """Store ``w`` under ``name`` on the CPU as the weight store takes it: an int8 ``QuantizedTensor`` becomes
    ``<name>`` (its ``_qdata``) + ``<name>_scale`` (``_params.scale``, fp32) + ``<linear>.comfy_quant`` (JSON bytes)
    when it is ConvRot."""
    if _is_quantized(w):
        out[name] = w._qdata.detach().to("cpu").contiguous()
        out[f"{name}_scale"] = w._params.scale.detach().to("cpu", torch.float32).contiguous()
        tag = _convrot_tag(w._params)
        if tag is not None:
            out[f"{name.rsplit('.', 1)[0]}.comfy_quant"] = tag
    else:
        out[name] = w.detach().to("cpu").contiguous()


def block_tensors(patcher: Any, block_index: int, compute_dtype: torch.dtype,
                  prefix: str = "diffusion_model.") -> dict[str, torch.Tensor]:
    """Block ``block_index``'s effective tensors on the CPU, keyed by in-block name, as the weight store takes them.

    A module whose patches ComfyUI applies in its cast gives what that cast gives (:func:`_cast_path_tensors`: the
    compute dtype, or int8 re-quantized where the forward asks for it); every other module gives its stored tensors
    (:func:`effective_weight`), which ranks cast to the activation dtype exactly as ComfyUI's ops do. A weight that a
    patch left dequantized stays a float weight, which is what ComfyUI then computes with.
    """
    dm = patcher.get_model_object(prefix.rstrip("."))
    block = dm.blocks[block_index]
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in block.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        if _patched_in_cast(module):
            _cast_path_tensors(patcher, module, mod_name, compute_dtype, out)
            own = [n for n in own if n not in ("weight", "bias")]
        for n in own:
            name = f"{mod_name}.{n}" if mod_name else n
            _put_host(out, name, effective_weight(patcher, f"{prefix}blocks.{block_index}.{name}"))
    return out


def block_nbytes(dm: Any, block_index: int) -> int:
    """Bytes the block occupies as stored (int8 data counts one byte per element)."""
    total = 0
    for p in dm.blocks[block_index].parameters():
        data = p._qdata if _is_quantized(p) else p
        total += data.numel() * data.element_size()
    return total


def available_ram() -> int:
    """Available RAM in bytes: the smaller of the host's and the memory cgroup's figure."""
    return int(ram_info().available_bytes)


def block_reader(patcher: Any, reserve_gb: float, compute_dtype: torch.dtype,
                 ram: Callable[[], int] = available_ram) -> Callable[[int], dict[str, torch.Tensor]]:
    """``block_weights(i)`` for ``SplitEngine.load_weights``, refusing a block that would eat into the RAM reserve."""
    dm = patcher.get_model_object("diffusion_model")
    reserve = int(reserve_gb * GIB)

    def read(i: int) -> dict[str, torch.Tensor]:
        need = block_nbytes(dm, i)
        avail = ram()
        if avail - need < reserve:
            raise MultiStreamError(
                f"weight store: block {i} needs {need / GIB:.2f} GiB but only {avail / GIB:.2f} GiB RAM is available "
                f"and cache_ram_reserve_gb keeps {reserve_gb:g} GiB free; lower cache_ram_reserve_gb, free RAM, or "
                "run the model unsplit")
        with torch.inference_mode():
            return block_tensors(patcher, i, compute_dtype)
    return read


# --- user block patches ----------------------------------------------------------------------------------------

class _OwnPatch:
    """Marks the patches this pack installs; ``displaced`` is the user patch that held the key before ours."""

    def __init__(self, displaced: Any = None):
        self.displaced = displaced


class PassThroughPatch(_OwnPatch):
    """Blocks 1..L-1: block 0 already ran them on the workers, unless it fell back to running this step unsplit
    (``stack.unsplit``): then each block runs here as in plain ComfyUI, with the user's own patch if any."""

    def __init__(self, displaced: Any = None, stack: "_RunStack | None" = None, index: int = 0) -> None:
        super().__init__(displaced)
        self.stack = stack
        self.index = index

    def __call__(self, args: dict, extra: dict) -> dict:
        if self.stack is not None and self.stack.unsplit:
            return self.stack.run_unsplit(self.index, args, extra)
        return {"img": args["img"]}


class StackPatch(_OwnPatch):
    """Block 0 at node time; the wrapper swaps in a per-call :class:`_RunStack` that does the work."""

    def __call__(self, args: dict, extra: dict) -> dict:
        raise MultiStreamError("H3 MultiStream's block patch ran without its DIFFUSION_MODEL wrapper; another node "
                               "removed the wrapper. Put H3 MultiStream last in the model chain.")


def collect_user_patches(transformer_options: Mapping, n_blocks: int) -> dict[int, Any]:
    """User ``("double_block", i)`` patches by block, ours set aside; any other ``dit`` key is refused."""
    dit = transformer_options.get("patches_replace", {}).get("dit", {})
    found: dict[int, Any] = {}
    other = []
    for key, patch in dit.items():
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == "double_block" and isinstance(key[1], int)
                and 0 <= key[1] < n_blocks):
            other.append(key)
            continue
        user = patch.displaced if isinstance(patch, _OwnPatch) else patch
        if user is not None:
            found[key[1]] = user
    if other:
        raise MultiStreamError(f"unsupported dit patches: {other!r}; H3 MultiStream only runs "
                               "('double_block', i) patches. Remove the node that sets them or disable H3 MultiStream.")
    return found


#: How ComfyUI's Model Sparse Attention node (ComfyUI 0.35+, ``comfy_extras/nodes_sparse_attention.py``) marks a
#: model: the key of its ON_PREPARE_STATE / ON_CLEANUP callbacks, and the module its attention override
#: (``transformer_options['optimized_attention_override']``) and H3 block patches (``("double_block", i)``) come from.
COMFY_SPARSE_KEY = "block_sparse_attention"
COMFY_SPARSE_MODULE = "nodes_sparse_attention"


def _from_comfy_sparse(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").rsplit(".", 1)[-1] == COMFY_SPARSE_MODULE


def refuse_comfy_sparse(patcher: Any, transformer_options: Mapping | None = None) -> None:
    """Raise when ComfyUI's Model Sparse Attention patch is on the model: its sparse attention runs in ComfyUI's
    process on whole blocks (a block patch with its own attention, an attention override), which the ranks cannot
    run, and a split that ignored it would silently attend dense. ``transformer_options``: the call's (default:
    the patcher's)."""
    to = transformer_options if transformer_options is not None else \
        getattr(patcher, "model_options", {}).get("transformer_options", {})
    found = []
    if any(COMFY_SPARSE_KEY in by_key for by_key in (getattr(patcher, "callbacks", None) or {}).values()):
        found.append(f"callbacks '{COMFY_SPARSE_KEY}'")
    if _from_comfy_sparse(to.get("optimized_attention_override")):
        found.append("its attention override")
    dit = to.get("patches_replace", {}).get("dit", {})
    blocks = [k[1] for k, p in dit.items() if isinstance(k, tuple) and len(k) == 2
              and _from_comfy_sparse(p.displaced if isinstance(p, _OwnPatch) else p)]
    if blocks:
        found.append(f"block patches on {len(blocks)} block(s)")
    if found:
        raise MultiStreamError(
            f"the model carries ComfyUI's Model Sparse Attention patch ({', '.join(found)}); it runs sparse attention "
            "inside ComfyUI's own blocks, which the split's rank workers cannot run. To run sparse attention split, "
            "remove the Model Sparse Attention node and connect an H3 MS Sparse Attention node (same settings) to "
            "H3 MultiStream's sparse_attention input; or set H3 MultiStream's enabled=false to keep ComfyUI's node")


def _replaces(i: int, why: str) -> MultiStreamError:
    return MultiStreamError(
        f"block {i} carries a patch that replaces the block computation ({why}); H3 MultiStream only supports "
        "patches that adjust transformer_options (e.g. a per-block attention backend). Remove that patch, or set "
        "H3 MultiStream's enabled=false for this model.")


def capture_block_options(user_patches: Mapping[int, Any], args: Mapping, n_blocks: int) -> list[dict] | None:
    """Run each user patch against a recording ``original_block`` and keep what it changes in transformer_options.

    The patch sees block ``i``'s args with a meta-device ``img`` (same shape and dtype, no data, so a patch that
    computes on the stream cannot touch the real one). It must call ``original_block`` exactly once, with the args it
    got except for ``transformer_options``, pass no ``attention`` callable, and return what ``original_block``
    returned. Returns one dict per block (the keys the patch set or replaced), or None when nothing changed.
    """
    if not user_patches:
        return None
    base_to = args["transformer_options"]
    probe = torch.empty_like(args["img"], device="meta")
    per_block: list[dict] = [{} for _ in range(n_blocks)]
    for i, patch in sorted(user_patches.items()):
        given_to = dict(base_to)
        given_to["block_index"] = i
        snapshot = dict(given_to)
        call_args = dict(args, img=probe, transformer_options=given_to)
        seen: list[dict] = []

        def original_block(a: dict) -> dict:
            seen.append(dict(a))
            return {"img": a["img"]}
        try:
            out = patch(call_args, {"original_block": original_block})
        except MultiStreamError:
            raise
        except Exception as exc:  # noqa: BLE001 - a patch that computes on the stream fails on the meta probe
            raise _replaces(i, f"it failed on a data-free probe: {type(exc).__name__}: {exc}") from exc
        if len(seen) != 1:
            raise _replaces(i, f"it called original_block {len(seen)} times, not once")
        rec = seen[0]
        if rec.get("attention") is not None:
            raise _replaces(i, "it passes its own attention module")
        for name in ("img", "t_emb", "mod_segments", "rope_freqs"):
            if rec.get(name) is not call_args[name]:
                raise _replaces(i, f"it changes args[{name!r}]")
        if not isinstance(out, Mapping) or out.get("img") is not probe:
            raise _replaces(i, "it does not return original_block's output")
        rec_to = rec.get("transformer_options", {})
        removed = [k for k in snapshot if k not in rec_to]
        if removed:
            raise _replaces(i, f"it removes transformer_options keys {removed}")
        per_block[i] = {k: v for k, v in rec_to.items() if k not in snapshot or snapshot[k] is not v}
    return per_block if any(per_block) else None


# --- the wrapper ---------------------------------------------------------------------------------------------------

class SplitState:
    """What one node instance configured; shared by every clone that inherits its wrapper."""

    def __init__(self, devices: list[str], options: Any, reserve_gb: float, patcher: Any,
                 weight_cache: bool = True):
        self.devices = list(devices)
        self.options = options
        self.reserve_gb = reserve_gb
        self.weight_cache = weight_cache
        self.detached = False
        self._patcher = weakref.ref(patcher)
        self._lock = threading.Lock()
        self._new_prompt = True
        self.warned: set[str] = set()

    def warn_once(self, what: str, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``what`` happens for this node's configuration."""
        if what not in self.warned:
            self.warned.add(what)
            log.warning(message, *args)

    def after_sampling(self, patcher: Any) -> None:
        """ComfyUI's ON_CLEANUP: the ranks drop sparse attention's pooled statistics; with ``weight_cache`` off, the
        store goes too (workers stay)."""
        from h3ms_async.dit.split import end_sampling
        try:
            dropped = end_sampling()
        except Exception as exc:  # noqa: BLE001 - cleanup must finish; a rank that failed here is restarted next step
            log.warning("dropping sparse attention statistics after sampling failed: %s", exc)
        else:
            if dropped:
                log.info("sampling ended: %d sparse attention statistics entries dropped on the ranks", dropped)
        if not self.weight_cache:
            from h3ms_async.dit.split import clear_weight_stores
            if clear_weight_stores():
                log.info("weight_cache is off: weight store released after sampling")

    def set_patcher(self, patcher: Any) -> None:
        """ComfyUI's ON_PRE_RUN: sampling of a new prompt starts (its first split step is the one ``verify``
        checks)."""
        with self._lock:
            self._patcher = weakref.ref(patcher)
            self._new_prompt = True

    def take_new_prompt(self) -> bool:
        """Whether sampling started since the last call (then the engine is told: ``SplitEngine.new_prompt``)."""
        with self._lock:
            new, self._new_prompt = self._new_prompt, False
            return new

    def patcher(self) -> Any:
        with self._lock:
            p = self._patcher()
        if p is None:
            raise MultiStreamError("the model this split was configured for is gone; re-run the H3 MultiStream node")
        return p

    def describe(self) -> dict:
        from h3ms_async.dit.split import options_dict
        return {"kind": "dit_split", "devices": list(self.devices), "detached": self.detached,
                "options": None if self.options is None else options_dict(self.options)}


_STATES: "weakref.WeakSet[SplitState]" = weakref.WeakSet()


def live_states() -> list[SplitState]:
    """Split configurations still referenced by some model."""
    return list(_STATES)


def detach_all() -> int:
    """Make every installed split run unsplit until its node runs again; returns how many were attached."""
    n = 0
    for state in live_states():
        if not state.detached:
            state.detached = True
            n += 1
    return n


class _RunStack:
    """Block 0 for one diffusion-model call: capture user patches, fill the store, run all blocks on the workers."""

    def __init__(self, state: SplitState, dm: Any, user_patches: dict[int, Any]):
        self.state = state
        self.dm = dm
        self.user_patches = user_patches
        self.unsplit = False

    def run_unsplit(self, i: int, args: dict, extra: dict) -> dict:
        """Block i exactly as plain ComfyUI runs it (the user's patch, else the original block)."""
        patch = self.user_patches.get(i)
        return patch(args, extra) if patch is not None else extra["original_block"](args)

    def __call__(self, args: dict, extra: dict) -> dict:
        from h3ms_async.dit.sparse import branch_key
        from h3ms_async.dit.split import SplitError, SplitInterrupted, SplitUnsafe, check_block_options, get_engine
        interrupt = progress.interrupt_probe()
        if interrupt():  # cancelled between steps: start nothing
            progress.raise_interrupted()
        n = len(self.dm.blocks)
        # refuse a bad patch before any work (weight store fill, worker start)
        block_options = capture_block_options(self.user_patches, args, n)
        try:
            check_block_options(block_options)
        except SplitError as exc:
            raise MultiStreamError(str(exc)) from None
        unsafe = self._attention_unsafe(args["img"])
        if unsafe:
            self.state.warn_once("attention", "%s; running this model's steps unsplit", unsafe)
            self.unsplit = True
            return self.run_unsplit(0, args, extra)
        patcher = self.state.patcher()
        key, warning = weight_key(patcher)
        if warning:
            self.state.warn_once("key", warning)
        engine = get_engine(self.state.devices, self.state.options)
        if self.state.take_new_prompt():
            engine.new_prompt()
        dtype = args["img"].dtype
        engine.load_weights(key, read_config(self.dm), block_reader(patcher, self.state.reserve_gb, dtype), n,
                            compute_dtype=dtype)
        try:
            out = engine.run_blocks(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                    block_options=block_options, interrupt=interrupt, sigma=_sigma(args),
                                    in_place=True,
                                    sparse_branch=branch_key(args["transformer_options"].get("uuids", ())))
        except SplitInterrupted as exc:
            progress.raise_interrupted(exc)
        except SplitUnsafe as exc:
            # A plan measured not bit-exact on these GPUs: this step runs unsplit in ComfyUI, as it would without
            # the node (the ranks stay up for the next plan). Warned once per plan; later steps only at DEBUG.
            (log.warning if exc.first else log.debug)("%s; running this step unsplit", exc)
            self.unsplit = True
            return self.run_unsplit(0, args, extra)
        return {"img": out}

    def _attention_unsafe(self, img: torch.Tensor) -> str | None:
        """Why ComfyUI's sub-quadratic attention could chunk this call otherwise on a rank, or None.

        Its chunk sizes follow free memory; when the unsplit call takes the largest chunks, every rank (fewer heads,
        less memory) takes them too (``workers.runtime.comfy_host.subquad_unchunked``).
        """
        host = getattr(self.state.options, "comfy_host", None)
        if host is None or host.attention != "attention_sub_quad":
            return None
        from comfy import model_management
        from h3ms_async.dit.split import subquad_unchunked
        heads = int(self.dm.blocks[0].attn.heads)
        free = model_management.get_free_memory(img.device, True)[0]
        if subquad_unchunked(heads, img.shape[0], img.element_size(), free):
            return None
        return (f"ComfyUI's sub-quadratic attention would chunk {img.shape[0]} tokens x {heads} heads by free memory "
                f"({free / GIB:.1f} GiB), which the head-split ranks cannot reproduce exactly; start ComfyUI with "
                "--use-pytorch-cross-attention to split such steps")


def _sigma(args: Mapping) -> float | None:
    """The step's sigma for the step record: ComfyUI puts the sampler's sigmas in transformer_options."""
    sigmas = args.get("transformer_options", {}).get("sigmas")
    if isinstance(sigmas, torch.Tensor) and sigmas.numel() >= 1:
        return float(sigmas.reshape(-1)[0])
    return None


class SplitWrapper:
    """The DIFFUSION_MODEL wrapper: swaps our block patches in for this call and runs H3's own ``_forward``."""

    def __init__(self, state: SplitState):
        self.state = state

    def __call__(self, executor: Any, x: Any, timestep: Any, context: Any, transformer_options: dict,
                 *args: Any, **kwargs: Any) -> Any:
        dm = executor.class_obj
        if not is_h3(dm):
            return executor(x, timestep, context, transformer_options, *args, **kwargs)
        n = len(dm.blocks)
        user = collect_user_patches(transformer_options, n)
        if not self.state.detached:
            refuse_comfy_sparse(self.state.patcher(), transformer_options)
        to = dict(transformer_options)
        to["patches_replace"] = dict(to.get("patches_replace", {}))
        override = to.get("optimized_attention_override")
        if override is not None:
            self.state.warn_once(
                "override", "the model carries a whole-model attention override (%s, set with "
                "set_model_optimized_attention / transformer_options['optimized_attention_override']); the rank "
                "workers cannot run it, so this model runs unsplit. Remove the node that sets it to split the model",
                getattr(override, "__name__", type(override).__name__))
        if self.state.detached or override is not None:  # plain ComfyUI: the user's own patches only
            to["patches_replace"]["dit"] = {("double_block", i): p for i, p in user.items()}
            return executor(x, timestep, context, to, *args, **kwargs)
        stack = _RunStack(self.state, dm, user)
        dit = {("double_block", i): PassThroughPatch(stack=stack, index=i) for i in range(1, n)}
        dit[("double_block", 0)] = stack
        to["patches_replace"]["dit"] = dit
        to["prefetch_dynamic_vbars"] = False  # no ComfyUI-side block weight prefetch: blocks run on the workers
        return executor(x, timestep, context, to, *args, **kwargs)


def install_split(clone: Any, devices: list[str], options: Any, reserve_gb: float,
                  weight_cache: bool = True) -> SplitState:
    """Put the wrapper, the block patches and the pre-run / cleanup callbacks on ``clone`` (a fresh clone); returns
    the state."""
    from comfy.patcher_extension import CallbacksMP, WrappersMP
    dm = clone.get_model_object("diffusion_model")
    state = SplitState(devices, options, reserve_gb, clone, weight_cache)
    _STATES.add(state)
    dit = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for i in range(len(dm.blocks)):
        previous = dit.get(("double_block", i))
        if isinstance(previous, _OwnPatch):  # a second H3 MultiStream node in the chain: keep the user patch only
            previous = previous.displaced
        patch = StackPatch(previous) if i == 0 else PassThroughPatch(previous)
        clone.set_model_patch_replace(patch, "dit", "double_block", i)
    # a second H3 MultiStream node in the chain replaces the first one's wrapper and callback instead of stacking
    clone.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    clone.remove_callbacks_with_key(CallbacksMP.ON_PRE_RUN, WRAPPER_KEY)
    clone.remove_callbacks_with_key(CallbacksMP.ON_CLEANUP, WRAPPER_KEY)
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, SplitWrapper(state))
    clone.add_callback_with_key(CallbacksMP.ON_PRE_RUN, WRAPPER_KEY, state.set_patcher)
    clone.add_callback_with_key(CallbacksMP.ON_CLEANUP, WRAPPER_KEY, state.after_sampling)
    return state
