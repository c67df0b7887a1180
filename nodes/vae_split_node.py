"""The **H3 MS VAE Split Decode** node: H3 video-VAE temporal chunks decoded across GPUs, bit-exact.

The node hooks ``decode_temporal`` on the VAE's ``first_stage_model`` (below the denormalisation and
the output buffer ComfyUI preallocates, so every decode path reaches it: VAE Decode, its OOM
fallback, VAE Decode Tiled). The hooked call pads the latent, deals the chunks (rank 0 = ComfyUI's
process on the VAE's own device, one worker process per other GPU running ComfyUI's own decoder) and
replays the ordered blend and write with the VAE's own ``blend`` and ``_finalize_pixels``
(h3ms_async/vae/split.py; docs/architecture.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from h3ms_async.log import get_logger

from . import method_hooks
from .cache_hooks import vae_key
from .inputs import SECOND_GPU_INPUT, PatchNode, enabled_input
from .progress import interrupt_probe, raise_interrupted

log = get_logger("VAE split")

HOOK_ATTR = "decode_temporal"
HOOK_LABEL = "VAE split"
DEFAULT_MAX_GPUS = 4


def is_h3_video_vae(model: Any) -> bool:
    """ComfyUI's ``MiniMaxH3VideoVAE`` (or anything with its temporal decode methods)."""
    return all(
        callable(getattr(model, n, None))
        for n in (
            "decode_temporal",
            "_decode_temporal_chunks",
            "_adaptive_decode",
            "blend",
            "_finalize_pixels",
        )
    )


def comfy_info() -> dict:
    """Where the workers find ComfyUI and with which flags: the root of the loaded ``comfy``
    package, this process's import path, and ComfyUI's command line (None when it was not
    parsed)."""
    import comfy.model_management
    import comfy.options

    root = os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_management.__file__)))
    argv = list(sys.argv[1:]) if getattr(comfy.options, "args_parsing", False) else None
    return {
        "root": root,
        "sys_path": [p for p in sys.path if isinstance(p, str) and p],
        "argv": argv,
    }


def plan_devices(vae_device: torch.device, cfg: dict) -> tuple[list[str] | None, str]:
    """``(devices, why)``: rank 0 = the VAE's device, then one worker device per rank; None when
    unsplit.

    The ranks come from the first of: ``H3MS_VAE_RANK_MAP``, ``H3MS_RANK_MAP`` (the DiT split's;
    both for tests and verification), the node's GPU Set (``gpus``; without one ``second_gpu``, -1 =
    every visible GPU) resolved around the VAE's GPU as the DiT split resolves it.  ``max_gpus``
    caps each of them, and so does a connected GPU Set's own ``max_gpus``.
    """
    from h3ms_async.runtime.plans import GPUSet, RankPlan, resolve_cuda
    from h3ms_async.vae.split import forced_devices

    gpus = cfg["gpus"]
    cap = min(int(cfg["max_gpus"]), gpus.max_gpus) if gpus is not None else int(cfg["max_gpus"])
    forced = forced_devices(vae_device)
    if forced is not None:
        ranks, source = forced
        plan = RankPlan(tuple(ranks), (1.0,) * len(ranks)).limited(cap)
        return (
            list(plan.devices) if len(plan.devices) > 1 else None
        ), f"{source}: {plan.describe()}"
    if vae_device.type != "cuda":
        return None, f"the VAE decodes on {vae_device}; the split needs it on a CUDA GPU"
    gpu_set = gpus if gpus is not None else GPUSet.legacy(int(cfg["second_gpu"]))
    plan = resolve_cuda(gpu_set, vae_device.index or 0).limited(cap)
    if len(plan.devices) < 2:
        return (
            None,
            "one usable GPU "
            f"({', '.join(plan.devices)}{'; ' + '; '.join(plan.notes) if plan.notes else ''})",
        )
    return list(plan.devices), plan.describe()


def decoder_spec(model: Any, key: tuple, arch: dict, dtype: str) -> Any:
    """What the workers need to rebuild ``model``'s decoder
    (``h3ms_async.vae.split.DecoderSpec``)."""
    from h3ms_async.vae.split import DecoderSpec, decoder_tensors, layout_digest

    return DecoderSpec(
        key=(*key, dtype, layout_digest(model, arch)),
        arch=arch,
        dtype=dtype,
        comfy=comfy_info(),
        read_tensors=lambda: decoder_tensors(model),
    )


def _make_wrapper(original: Callable[..., Any], cfg: dict) -> Callable[..., Any]:
    model = original.__self__

    def split_decode_temporal(
        z: torch.Tensor, output_buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        from h3ms_async.vae import plan as vae_plan
        from h3ms_async.vae.split import (
            VaeSplitInterrupted,
            VaeSplitUnsupported,
            describe_decoder,
            get_vae_engine,
        )

        devices, why = plan_devices(z.device, cfg)
        if devices is None:
            if cfg.get("unsplit_note") != why:
                log.info("decoding unsplit: %s", why)
                cfg["unsplit_note"] = why
            return original(z, output_buffer)
        try:
            arch, dtype = describe_decoder(model, z.dtype)
            plan = vae_plan.make_plan(int(z.shape[2]), vae_plan.VaeGeometry.from_model(model))
            theirs = tuple(model._decode_temporal_chunks(int(z.shape[2])))
            frames = model.decode_output_shape(tuple(z.shape))[2]
            if theirs != (plan.pad_tokens, plan.num_chunks) or frames != plan.output_frames:
                raise VaeSplitUnsupported(
                    f"this ComfyUI plans T={z.shape[2]} as {theirs} -> {frames} frames, the split "
                    f"as {(plan.pad_tokens, plan.num_chunks)} -> {plan.output_frames}; update H3 "
                    "MultiStream"
                )
        except VaeSplitUnsupported as exc:
            if cfg.get("unsupported_note") != str(exc):  # once per reason, not once per decode
                log.warning("decoding unsplit: %s", exc)
                cfg["unsupported_note"] = str(exc)
            return original(z, output_buffer)
        if output_buffer is None:
            import comfy.model_management as mm

            output_buffer = torch.empty(
                model.decode_output_shape(tuple(z.shape)),
                dtype=torch.float32,
                device=mm.intermediate_device(),
            )
        spec = decoder_spec(model, cfg["key"], arch, dtype)
        try:
            get_vae_engine(devices).decode(
                vae_plan.pad_latent(z, plan),
                plan,
                spec,
                model._adaptive_decode,
                output_buffer,
                model.blend,
                model._finalize_pixels,
                interrupt_probe(),
            )
        except VaeSplitInterrupted as exc:
            raise_interrupted(exc)
        return output_buffer

    return split_decode_temporal


class H3MSVAESplitDecodeAsync(PatchNode):
    """VAE → VAE: the same VAE, with its temporal decode split across GPUs."""

    CATEGORY = "advanced/latent"
    RETURN_TYPES = ("VAE",)
    DESCRIPTION = (
        "Decodes MiniMax H3 video latents with the temporal chunks dealt across GPUs: ComfyUI's "
        "process decodes on the VAE's GPU, every other GPU runs a worker process with ComfyUI's "
        "own H3 VAE code; the output is identical bit for bit to a single-GPU decode. Place it "
        "after Select VAE Device. The hook lives on the VAE model shared by all its clones: "
        "enabled=false removes it; bypassing or muting the node cannot."
    )

    INPUTS: ClassVar[dict] = {
        "required": {
            "vae": (
                "VAE",
                {"tooltip": "A MiniMax H3 video VAE; any other VAE passes through unchanged."},
            ),
            "enabled": enabled_input(
                "Off removes the split hook from this VAE (bypassing the node leaves an installed "
                "hook in place)."
            ),
            "second_gpu": SECOND_GPU_INPUT,
        },
        "optional": {
            "gpus": (
                "H3MS_GPUS",
                {
                    "tooltip": "GPU choice from an H3 MS GPU Set node (shares do not apply: chunks "
                    "are dealt evenly; its max_gpus does)."
                },
            ),
            "max_gpus": (
                "INT",
                {
                    "default": DEFAULT_MAX_GPUS,
                    "min": 1,
                    "max": 8,
                    "tooltip": "Most GPUs used, ComfyUI's own included, whatever chose them (GPU "
                    "Set or rank map); the gain flattens after 3-4 (the blend and write are "
                    "serial). 1 = unsplit.",
                },
            ),
        },
    }

    def patch(
        self,
        vae: Any,
        enabled: bool,
        second_gpu: int,
        gpus: Any = None,
        max_gpus: int = DEFAULT_MAX_GPUS,
    ) -> tuple:
        model = getattr(vae, "first_stage_model", None)
        if model is None or not is_h3_video_vae(model):
            log.warning(
                "VAE Split Decode: %s is not a MiniMax H3 video VAE; passing it through unchanged",
                type(model).__name__,
            )
            return (vae,)
        if not enabled:
            if method_hooks.uninstall(model, HOOK_ATTR):
                from h3ms_async.vae.split import release_vae_engines

                release_vae_engines()
            return (vae,)
        cfg = {
            "second_gpu": int(second_gpu),
            "max_gpus": int(max_gpus),
            "gpus": gpus,
            "key": vae_key(vae),
        }
        device = torch.device(getattr(vae, "device", "cpu"))
        devices, why = plan_devices(device, cfg)
        spec = None
        if devices is not None:
            from h3ms_async.vae.split import VaeSplitUnsupported, describe_decoder

            try:
                spec = decoder_spec(model, cfg["key"], *describe_decoder(model, vae.vae_dtype))
            except VaeSplitUnsupported as exc:
                log.warning("node configured, but this VAE will decode unsplit: %s", exc)
                cfg["unsupported_note"] = str(exc)  # the decodes do not repeat the warning
        method_hooks.install(model, HOOK_ATTR, HOOK_LABEL, _make_wrapper, cfg)
        if spec is not None:
            from h3ms_async.vae.split import get_vae_engine

            get_vae_engine(devices).prestart(spec)
            log.info(
                "node configured: ranks %s (%s); workers starting and loading the decoder in the "
                "background",
                ",".join(devices),
                why,
            )
        elif devices is None:
            log.info("node configured: decoding unsplit (%s)", why)
        return (vae,)
