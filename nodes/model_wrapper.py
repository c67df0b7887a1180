"""The split on a ComfyUI ModelPatcher: its DIFFUSION_MODEL wrapper, block runner and callbacks.

How the split sits on a ModelPatcher (``docs/comfyui_facts.md`` §8):
- a DIFFUSION_MODEL wrapper under ``WRAPPER_KEY`` (:class:`SplitWrapper`) and one
  ``("double_block", i)`` patch per block: block 0's runs the whole stack on the workers, the
  others hand the stream back untouched, so H3's own ``_forward`` keeps the preamble and the final
  layer;
- the user's block patches are sorted out on every call (``nodes/block_patches.py``);
- an ON_PRE_RUN callback records which patcher is actually sampled (a LoRA node after ours makes a
  new clone that shares our wrapper), so the weights and their key come from that patcher
  (``nodes/comfy_weights.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.host_memory import GIB

from . import progress
from .block_patches import (
    OwnPatch,
    PassThroughPatch,
    StackPatch,
    capture_block_options,
    collect_user_patches,
    refuse_comfy_sparse,
)
from .comfy_weights import block_reader, weight_key
from .errors import MultiStreamError
from .h3_detect import is_h3, read_config
from .modulation import BlockModulation
from .work_units import refuse_work_units

log = get_logger("MultiStream")

WRAPPER_KEY = "h3_multistream_async"


class SplitState:
    """What one node instance configured; shared by every clone that inherits its wrapper."""

    def __init__(
        self,
        devices: list[str],
        options: Any,
        reserve_gb: float,
        patcher: Any,
        weight_cache: bool = True,
    ):
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
        """ComfyUI's ON_CLEANUP: the ranks drop sparse attention's pooled statistics; with
        ``weight_cache`` off, the store goes too (workers stay)."""
        from h3ms_async.dit.split import end_sampling

        try:
            dropped = end_sampling()
        except Exception as exc:  # noqa: BLE001
            # cleanup must finish; a rank that failed here is restarted next step
            log.warning("dropping sparse attention statistics after sampling failed: %s", exc)
        else:
            if dropped:
                log.info(
                    "sampling ended: %d sparse attention statistics entries dropped on the ranks",
                    dropped,
                )
        if not self.weight_cache:
            from h3ms_async.dit.split import clear_weight_stores

            if clear_weight_stores():
                log.info("weight_cache is off: weight store released after sampling")

    def set_patcher(self, patcher: Any) -> None:
        """ComfyUI's ON_PRE_RUN: sampling of a new prompt starts (its first split step is the one
        ``verify`` checks).  Refuses ComfyUI's MultiGPU CFG Split put after this node, unless
        the split is detached (plain ComfyUI then runs it)."""
        if not self.detached:
            refuse_work_units(patcher)
        with self._lock:
            self._patcher = weakref.ref(patcher)
            self._new_prompt = True

    def take_new_prompt(self) -> bool:
        """Whether sampling started since the last call (then the engine is told:
        ``SplitEngine.new_prompt``)."""
        with self._lock:
            new, self._new_prompt = self._new_prompt, False
            return new

    def patcher(self) -> Any:
        with self._lock:
            p = self._patcher()
        if p is None:
            raise MultiStreamError(
                "the model this split was configured for is gone; re-run the H3 MultiStream node"
            )
        return p

    def describe(self) -> dict:
        from h3ms_async.dit.options import options_dict

        return {
            "kind": "dit_split",
            "devices": list(self.devices),
            "detached": self.detached,
            "options": None if self.options is None else options_dict(self.options),
        }


_STATES: weakref.WeakSet[SplitState] = weakref.WeakSet()


def live_states() -> list[SplitState]:
    """Split configurations still referenced by some model."""
    return list(_STATES)


def detach_all() -> int:
    """Make every installed split run unsplit until its node runs again; returns how many were
    attached."""
    n = 0
    for state in live_states():
        if not state.detached:
            state.detached = True
            n += 1
    return n


class _RunStack:
    """Block 0 for one diffusion-model call: capture user patches, fill the store, run all blocks on
    the workers."""

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
        from h3ms_async.dit.errors import SplitError, SplitInterrupted, SplitUnsafe
        from h3ms_async.dit.options import check_block_options
        from h3ms_async.dit.sparse import branch_key
        from h3ms_async.dit.split import get_engine
        from h3ms_async.dit.step import Step

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
        # a first prompt reads the checkpoint (from disk when cold) from block 0's adaLN row on:
        # the workers start beside that read instead of after it
        engine.start_workers()
        rows = BlockModulation(self.dm, args["t_emb"])
        if self.state.take_new_prompt():
            engine.new_prompt()
        dtype = args["img"].dtype
        step = Step(
            args["img"],
            args["t_emb"].new_empty(0),  # the rows come with the load below
            args["mod_segments"],
            args["rope_freqs"],
            block_options=block_options,
            interrupt=interrupt,
            sigma=_sigma(args),
            in_place=True,
            sparse_branch=branch_key(args["transformer_options"].get("uuids", ())),
        )
        # a load probes this step's plan on the ranks while the store fills, and a fill computes
        # each block's row as it reads the block: one pass over a cold checkpoint feeds both
        reserve = self.state.reserve_gb
        engine.load_weights(
            key,
            read_config(self.dm),
            block_reader(patcher, reserve, dtype, before=rows.row),
            n,
            compute_dtype=dtype,
            first_step=step,
            patched_weights=block_reader(
                patcher, reserve, dtype, before=rows.row, read_ahead=False
            ),
        )
        step = replace(step, modulation=rows.stacked())
        try:
            out = engine.run_step(step)
        except SplitInterrupted as exc:
            progress.raise_interrupted(exc)
        except SplitUnsafe as exc:
            # A plan measured not bit-exact on these GPUs: this step runs unsplit in ComfyUI, as it
            # would without the node (the ranks stay up for the next plan). Warned once per plan;
            # later steps only at DEBUG.
            (log.warning if exc.first else log.debug)("%s; running this step unsplit", exc)
            self.unsplit = True
            return self.run_unsplit(0, args, extra)
        return {"img": out}

    def _attention_unsafe(self, img: torch.Tensor) -> str | None:
        """Why ComfyUI's sub-quadratic attention could chunk this call otherwise on a rank, or None.

        Its chunk sizes follow free memory; when the unsplit call takes the largest chunks, every
        rank (fewer heads, less memory) takes them too
        (``workers.runtime.comfy_host.subquad_unchunked``).
        """
        host = getattr(self.state.options, "comfy_host", None)
        if host is None or host.attention != "attention_sub_quad":
            return None
        from comfy import model_management

        from workers.runtime.comfy_host import subquad_unchunked

        heads = int(self.dm.blocks[0].attn.heads)
        free = model_management.get_free_memory(img.device, True)[0]
        if subquad_unchunked(heads, img.shape[0], img.element_size(), free):
            return None
        return (
            f"ComfyUI's sub-quadratic attention would chunk {img.shape[0]} tokens x {heads} heads "
            f"by free memory ({free / GIB:.1f} GiB), which the head-split ranks cannot reproduce "
            "exactly; start ComfyUI with --use-pytorch-cross-attention to split such steps"
        )


def _sigma(args: Mapping) -> float | None:
    """The step's sigma for the step record: ComfyUI puts the sampler's sigmas in
    transformer_options."""
    sigmas = args.get("transformer_options", {}).get("sigmas")
    if isinstance(sigmas, torch.Tensor) and sigmas.numel() >= 1:
        return float(sigmas.reshape(-1)[0])
    return None


class SplitWrapper:
    """The DIFFUSION_MODEL wrapper: swaps our block patches in for this call and runs H3's own
    ``_forward``."""

    def __init__(self, state: SplitState):
        self.state = state

    def __call__(
        self,
        executor: Any,
        x: Any,
        timestep: Any,
        context: Any,
        transformer_options: dict,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
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
                "override",
                "the model carries a whole-model attention override (%s, set with "
                "set_model_optimized_attention / "
                "transformer_options['optimized_attention_override']); the rank workers cannot run "
                "it, so this model runs unsplit. Remove the node that sets it to split the model",
                getattr(override, "__name__", type(override).__name__),
            )
        if (
            self.state.detached or override is not None
        ):  # plain ComfyUI: the user's own patches only
            to["patches_replace"]["dit"] = {("double_block", i): p for i, p in user.items()}
            return executor(x, timestep, context, to, *args, **kwargs)
        stack = _RunStack(self.state, dm, user)
        dit = {("double_block", i): PassThroughPatch(stack=stack, index=i) for i in range(1, n)}
        dit[("double_block", 0)] = stack
        to["patches_replace"]["dit"] = dit
        to["prefetch_dynamic_vbars"] = (
            False  # no ComfyUI-side block weight prefetch: blocks run on the workers
        )
        return executor(x, timestep, context, to, *args, **kwargs)


def install_split(
    clone: Any, devices: list[str], options: Any, reserve_gb: float, weight_cache: bool = True
) -> SplitState:
    """Put the wrapper, the block patches and the pre-run / cleanup callbacks on ``clone`` (a fresh
    clone); returns the state."""
    from comfy.patcher_extension import CallbacksMP, WrappersMP

    dm = clone.get_model_object("diffusion_model")
    state = SplitState(devices, options, reserve_gb, clone, weight_cache)
    _STATES.add(state)
    dit = (
        clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    )
    for i in range(len(dm.blocks)):
        previous = dit.get(("double_block", i))
        if isinstance(
            previous, OwnPatch
        ):  # a second H3 MultiStream node in the chain: keep the user patch only
            previous = previous.displaced
        patch = StackPatch(previous) if i == 0 else PassThroughPatch(previous)
        clone.set_model_patch_replace(patch, "dit", "double_block", i)
    # a second H3 MultiStream node in the chain replaces the first one's wrapper and callback
    # instead of stacking
    clone.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    clone.remove_callbacks_with_key(CallbacksMP.ON_PRE_RUN, WRAPPER_KEY)
    clone.remove_callbacks_with_key(CallbacksMP.ON_CLEANUP, WRAPPER_KEY)
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, SplitWrapper(state))
    clone.add_callback_with_key(CallbacksMP.ON_PRE_RUN, WRAPPER_KEY, state.set_patcher)
    clone.add_callback_with_key(CallbacksMP.ON_CLEANUP, WRAPPER_KEY, state.after_sampling)
    return state
