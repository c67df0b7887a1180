"""The **H3 Attention Parallel** node: MiniMax H3's attention heads split across the model's GPU and
helper GPUs.

The model stays whole on its GPU; a clone gets an attention override
(``set_model_optimized_attention``) that quantizes Q/K/V once with comfy-kitchen, exactly as
ComfyUI's ``--use-ck-attention`` does, and runs the INT8 attention of each head range on one device
(``h3ms_async.attention.engine``).  The result equals plain ComfyUI with ``--use-ck-attention`` bit
for bit.  See docs/attention_parallel.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from h3ms_async.log import get_logger
from workers.runtime import config

from .h3_detect import diffusion_model_of, is_h3
from .inputs import ModelPatchNode
from .model_wrapper import WRAPPER_KEY

log = get_logger("AttentionParallel")

HELPERS_ENV = config.ATTN_HELPERS.name
TRANSPORT_ENV = config.ATTN_TRANSPORT.name
DEVICE_CHOICES = ["disabled", "auto"] + [str(n) for n in range(2, 9)]
MAX_DEVICES = 8

_DESCRIPTION = (
    "Splits MiniMax H3's attention heads across GPUs while the whole model stays on its own GPU: "
    "every attention call is quantized to INT8 once (comfy-kitchen, as ComfyUI's "
    "--use-ck-attention does), each helper GPU gets its packed head slice, runs kitchen's INT8 "
    "attention on it and sends the result back. Helpers hold no weights. Output is identical bit "
    "for bit to ComfyUI with --use-ck-attention, which this node requires. Use it instead of H3 "
    "MultiStream when the model fits on one GPU; the two cannot run on the same model."
)


class AttentionParallelError(RuntimeError):
    """The node's configuration cannot run; the message names the input or the flag and the fix."""


class H3AttentionParallelAsync(ModelPatchNode):
    """MODEL → MODEL: a clone whose attention runs head-parallel on helper devices."""

    DESCRIPTION = _DESCRIPTION

    INPUTS: ClassVar[dict] = {
        "required": {
            "model": ("MODEL", {"tooltip": "A MiniMax H3 model on a CUDA GPU."}),
            "devices": (
                DEVICE_CHOICES,
                {
                    "default": "disabled",
                    "tooltip": "How many GPUs share the attention heads, counting the model's GPU. "
                    "auto: every suitable visible GPU (never fails; one GPU runs as plain "
                    "ComfyUI). disabled: the model passes through untouched.",
                },
            ),
            "min_sequence_length": (
                "INT",
                {
                    "default": 32768,
                    "min": 1,
                    "max": 1_000_000,
                    "step": 1024,
                    "advanced": True,
                    "tooltip": "auto only: attention calls over fewer packed tokens run on the "
                    "model's GPU alone (splitting short calls costs more than it saves).",
                },
            ),
        },
        "optional": {
            "gpus": (
                "H3MS_GPUS",
                {
                    "tooltip": "GPU choice from an H3 MS GPU Set node; its shares size the head "
                    "ranges."
                },
            ),
        },
    }

    def patch(self, model: Any, devices: str, min_sequence_length: int, gpus: Any = None) -> tuple:
        if devices not in DEVICE_CHOICES:
            raise AttentionParallelError(
                f"devices={devices!r} is not one of {', '.join(DEVICE_CHOICES)}"
            )
        if devices == "disabled":
            return (model,)
        dm = diffusion_model_of(model)
        if dm is None or not is_h3(dm):
            raise AttentionParallelError(
                "H3 Attention Parallel needs a MiniMax H3 model, got "
                f"{type(dm if dm is not None else model).__name__}"
                "; connect an H3 model or set devices=disabled"
            )
        if _has_multistream(model):
            raise AttentionParallelError(
                "H3 MultiStream is already on this model; keep one of the two: H3 MultiStream when "
                "the model does not fit on one GPU (it splits whole blocks), H3 Attention Parallel "
                "when it does (only attention moves). Remove the other node from the model chain"
            )
        _require_ck_flag()
        heads = int(dm.blocks[0].attn.heads)
        auto = devices == "auto"
        plan, shares, why = _plan(model, gpus, None if auto else int(devices), heads)
        if plan is None:
            log.info("H3 Attention Parallel: running on one device (%s)", why)
            return (model,)
        transport = choose_transport(plan)
        clone = model.clone()
        clone.set_model_optimized_attention(
            ParallelAttention(plan, shares, auto, int(min_sequence_length), transport)
        )
        log.info(
            "node configured: %d heads over %s, transport %s (%s)%s",
            heads,
            ",".join(plan),
            transport,
            why,
            f", calls under {min_sequence_length} tokens on {plan[0]} alone" if auto else "",
        )
        return (clone,)


class ParallelAttention:
    """The attention override: ComfyUI's kitchen INT8 attention with the heads split over
    ``devices``.

    ``container_function`` is the path H3 takes (its attention passes
    ``AttentionTensorContainer``s); ``__call__`` takes plain tensors.  Both accept ComfyUI's
    attention arguments ``(q, k, v, heads, mask=None, ...)``.
    """

    def __init__(
        self,
        devices: list[str],
        shares: tuple[float, ...] | None,
        auto: bool,
        min_sequence_length: int,
        transport: str = "host",
    ) -> None:
        self.devices = list(devices)
        self.transport = transport
        self.shares = shares
        self.auto = auto
        self.min_sequence_length = min_sequence_length
        self.container_function = self._from_containers

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        heads: int,
        mask: Any = None,
        attn_precision: Any = None,
        skip_reshape: bool = False,
        skip_output_reshape: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        return self._attend(
            q, k, v, heads, mask, skip_reshape, skip_output_reshape, kwargs.get("scale")
        )

    def _from_containers(
        self,
        q: Any,
        k: Any,
        v: Any,
        heads: int,
        mask: Any = None,
        attn_precision: Any = None,
        skip_reshape: bool = False,
        skip_output_reshape: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        return self._attend(
            q.take(),
            k.take(),
            v.take(),
            heads,
            mask,
            skip_reshape,
            skip_output_reshape,
            kwargs.get("scale"),
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        heads: int,
        mask: Any,
        skip_reshape: bool,
        skip_output_reshape: bool,
        scale: float | None,
    ) -> torch.Tensor:
        import comfy_kitchen as ck

        from h3ms_async.attention.engine import get_engine

        if mask is not None:
            raise AttentionParallelError(
                "H3 Attention Parallel does not split masked attention (by design: H3 attends "
                "without masks); set devices=disabled for this model"
            )
        if not skip_reshape:  # [B, S, heads*D] -> [B, heads, S, D]
            q, k, v = (t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        if q.shape[1] != heads or k.shape[1] != heads or v.shape[1] != heads:
            raise AttentionParallelError(
                f"H3 Attention Parallel needs equal Q/K/V head counts ({heads}); got q "
                f"{q.shape[1]}, k {k.shape[1]}, v {v.shape[1]} (grouped-query attention is not "
                "split by design); set devices=disabled"
            )
        batch = q.shape[0]
        pq = ck.prequantize_int8_attention(q, k, v, scale=scale, attn_mask=None)
        del q, k, v  # the packed INT8 copy is all that is needed from here on, as in ComfyUI
        if self.auto and pq.q.shape[2] < self.min_sequence_length:
            out = ck.int8_attention_from_prequantized(pq)
        else:
            out = get_engine(self.devices, self.shares, self.transport).attend(pq)
        if not skip_output_reshape:
            out = out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1])
        return out


def _has_multistream(model: Any) -> bool:
    """Whether H3 MultiStream's wrapper is on this model."""
    from comfy.patcher_extension import WrappersMP

    return bool(getattr(model, "wrappers", {}).get(WrappersMP.DIFFUSION_MODEL, {}).get(WRAPPER_KEY))


def has_parallel_attention(model: Any) -> bool:
    """Whether this node's attention override is on ``model`` (H3 MultiStream refuses such a
    model)."""
    override = model.model_options.get("transformer_options", {}).get(
        "optimized_attention_override"
    )
    return isinstance(
        getattr(getattr(override, "container_function", None), "__self__", None), ParallelAttention
    )


def _require_ck_flag() -> None:
    from comfy.cli_args import args

    if not getattr(args, "use_ck_attention", False):
        raise AttentionParallelError(
            "H3 Attention Parallel splits comfy-kitchen INT8 attention, and ComfyUI was started "
            "without it; add --use-ck-attention to ComfyUI's command line and restart (or set "
            "devices=disabled)"
        )


def _ck_available(device: str) -> bool:
    import comfy_kitchen as ck

    return bool(ck.int8_attention_is_available(torch.device(device)))


def choose_transport(devices: list[str]) -> str:
    """How slices travel between ``devices[0]`` (the model's) and the helpers, from
    :data:`TRANSPORT_ENV`: CUDA IPC where this process can share device memory and every helper GPU
    and the model's GPU reach each other both ways (a helper on the model's own GPU always does),
    else host staging, with one INFO line saying which device pair (or the allocator) failed and
    why."""
    wanted = config.ATTN_TRANSPORT.get()
    if wanted == "host":
        return "host"
    if not all(d.startswith("cuda") for d in devices):
        if wanted == "cuda_ipc":
            raise AttentionParallelError(
                f"{TRANSPORT_ENV}=cuda_ipc needs CUDA devices, got {','.join(devices)}; unset it "
                "or use host"
            )
        return "host"
    from h3ms_async.attention.buffers import cuda_ipc_unavailable

    failed = cuda_ipc_unavailable(devices[0]) or _peer_failures(devices)
    if not failed:
        return "cuda_ipc"
    if wanted == "cuda_ipc":
        raise AttentionParallelError(
            f"{TRANSPORT_ENV}=cuda_ipc: {failed}; unset it to stage through host memory"
        )
    log.info(
        "H3 Attention Parallel: %s; the helpers stage through host memory (transport host)", failed
    )
    return "host"


def _peer_failures(devices: list[str]) -> str:
    """'' when every helper GPU and the model's GPU reach each other both ways, else which pair
    fails and why."""
    root = torch.device(devices[0]).index or 0
    problems = []
    for d in dict.fromkeys(devices[1:]):
        other = torch.device(d).index or 0
        if other == root:
            continue
        there, back = (
            torch.cuda.can_device_access_peer(root, other),
            torch.cuda.can_device_access_peer(other, root),
        )
        if not (there and back):
            problems.append(
                f"cuda:{root} and cuda:{other} have no peer access both ways "
                f"(cuda:{root}->cuda:{other}: {'yes' if there else 'no'}, "
                f"cuda:{other}->cuda:{root}: {'yes' if back else 'no'}; "
                "torch.cuda.can_device_access_peer: no NVLink or PCIe P2P between them)"
            )
    return "; ".join(problems)


def _plan(
    model: Any, gpus: Any, requested: int | None, heads: int
) -> tuple[list[str] | None, tuple[float, ...] | None, str]:
    """``(devices, shares, why)``: the model's device first, then the helpers; None (with the
    reason) when auto finds a single device.  ``requested`` is the explicit device count, None for
    auto."""
    from h3ms_async.runtime.plans import GPUSelectionError, GPUSet, rank_map, resolve_cuda

    load_device = getattr(model, "load_device", None)
    root = str(load_device)
    if root == "cuda" or (
        getattr(load_device, "type", None) == "cuda" and load_device.index is None
    ):
        root = f"cuda:{torch.cuda.current_device()}"
    spec = config.ATTN_HELPERS.raw()
    if not spec and getattr(load_device, "type", None) != "cuda":
        if requested is None:
            return (
                None,
                None,
                f"the model is on {load_device}; attention parallelism needs the model on CUDA",
            )
        raise AttentionParallelError(
            f"devices={requested}: the model is on {load_device}, and H3 Attention Parallel needs "
            "MiniMax H3 on a CUDA GPU; load it on CUDA or set devices=disabled"
        )
    if not _ck_available(root):
        raise AttentionParallelError(
            f"Comfy Kitchen INT8 attention is unavailable on {root} (it needs an NVIDIA GPU of "
            "compute capability 7.5 or newer and comfy-kitchen's CUDA build); set "
            "devices=disabled"
        )
    if spec:
        helpers = config.ATTN_HELPERS.get(rank_map)
        if helpers[0].split(":")[0] != root.split(":")[0]:
            raise AttentionParallelError(
                f"{HELPERS_ENV}={spec}: the helpers must be the same kind of device as the model's "
                f"({root}); give e.g. {root},{root} or unset {HELPERS_ENV}"
            )
        devices, shares, why = (
            [root, *helpers],
            (tuple(gpus.shares) if gpus is not None and gpus.shares else None),
            f"{HELPERS_ENV}={spec}",
        )
        if shares is not None and len(shares) != len(devices):
            raise GPUSelectionError(
                f"shares: {len(shares)} value(s) from the H3 MS GPU Set for {len(devices)} "
                f"device(s) (the model's and {HELPERS_ENV}); give one share per device"
            )
    else:
        plan = resolve_cuda(gpus if gpus is not None else GPUSet.parse("auto"), root)
        keep = [i for i, d in enumerate(plan.devices) if i == 0 or _ck_available(d)]
        failures = [
            f"{d}: Comfy Kitchen INT8 attention unavailable"
            for i, d in enumerate(plan.devices)
            if i not in keep
        ]
        devices = [plan.devices[i] for i in keep]
        shares = tuple(plan.shares[i] for i in keep)
        why = "; ".join([plan.describe(), *failures])
    limit = min(MAX_DEVICES, heads)
    want = min(limit, len(devices)) if requested is None else requested
    if requested is not None and (requested > limit or len(devices) < requested):
        raise AttentionParallelError(
            f"devices={requested}: found {len(devices)} suitable device(s) ({why}) for at most "
            f"{limit} ({heads} heads); lower devices, connect an H3 MS GPU Set listing more GPUs, "
            "or use auto"
        )
    if want < 2:
        return None, None, why
    devices, shares = devices[:want], (shares[:want] if shares else None)
    if (
        shares is not None and len(set(shares)) == 1
    ):  # equal shares: one engine for every equal plan
        shares = None
    return devices, shares, why
