"""The **H3 MultiStream** node: splits MiniMax H3's transformer blocks across GPU worker processes,
bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from h3ms_async.dit.exchange_choice import EXCHANGES
from h3ms_async.dit.overlap_tuner import OverlapChoice, overlap_options
from h3ms_async.log import get_logger
from workers.runtime import config

from .attention_parallel_node import has_parallel_attention
from .block_patches import refuse_comfy_sparse
from .errors import MultiStreamError
from .h3_detect import diffusion_model_of, is_h3
from .inputs import SECOND_GPU_INPUT, ModelPatchNode, enabled_input, ram_reserve_input
from .model_wrapper import install_split
from .sparse_attention_node import SPARSE_TYPE
from .work_units import refuse_work_units

log = get_logger("MultiStream")

RANK_MAP_ENV = config.RANK_MAP.name

_DESCRIPTION = (
    "Splits every denoising step of MiniMax H3's transformer blocks across GPUs (tokens and "
    "attention heads), one worker process per GPU, with output identical bit for bit to a single "
    "GPU. ComfyUI keeps H3's own embedding, layout, rope and final layer; the workers run the 50 "
    "blocks from one shared-memory copy of the weights (LoRA and weight patches included). Connect "
    "an H3 MS GPU Set to choose GPUs; without it every visible GPU is used. A model that is not "
    "MiniMax H3, or a single usable GPU, runs unsplit. There is no dynamic_vram or "
    "vram_block_cache input: the workers are separate processes, outside ComfyUI's DynamicVRAM, "
    "and keep as many blocks resident in their own VRAM as fit (vram_residency)."
)


class H3MultiStreamAsync(ModelPatchNode):
    """MODEL → MODEL: a clone with the split wrapper and block patches installed."""

    DESCRIPTION = _DESCRIPTION

    INPUTS: ClassVar[dict] = {
        "required": {
            "model": (
                "MODEL",
                {"tooltip": "A MiniMax H3 model; any other model passes through unchanged."},
            ),
            "enabled": enabled_input(
                "Off returns the model untouched (plain ComfyUI), as bypassing the node does."
            ),
            "second_gpu": SECOND_GPU_INPUT,
            "exchange": (
                list(EXCHANGES),
                {
                    "default": "auto",
                    "tooltip": "host: per-block exchanges through pinned shared memory, works on "
                    "any PCIe box. nccl: torch.distributed collectives, for NVLink machines. "
                    "cuda_ipc: GPU-direct, each GPU reads the others' rows straight from their "
                    "memory (GPUs with peer access, or logical ranks of one GPU). auto: cuda_ipc "
                    "where it can run and has passed its bit-exactness test on CUDA (logical "
                    "ranks of one GPU today; between GPUs once its peer-to-peer test has "
                    "passed), else host.",
                },
            ),
            "exchange_chunks": (
                "INT",
                {
                    "default": 8,
                    "min": 0,
                    "max": 32,
                    "tooltip": "Pipeline the exchange in this many chunks so device-to-host and "
                    "host-to-device copies overlap; 0 or 1 = one shot. 8 suits host staging "
                    "(1.4-2.2 % faster a block than one shot on 2 logical ranks of an H100, level "
                    "at 4) and costs the GPU-direct exchange 0.5-1.0 % at 2 ranks and 2.3 % at 4 "
                    "(set 0 with cuda_ipc). Ignored by nccl.",
                },
            ),
            "weight_cache": (
                "BOOLEAN",
                {
                    "default": True,
                    "tooltip": "On: keep the block weights in shared memory after sampling (about "
                    "19 GB for H3 int8; the adaLN weights stay in ComfyUI's model), so the next "
                    "prompt starts without refilling them. Off: release them when sampling ends "
                    "(the workers stay).",
                },
            ),
            "cache_ram_reserve_gb": ram_reserve_input(
                "Fill the weight store only while at least this much RAM stays available; the "
                "split refuses to start rather than eat into it."
            ),
            "vram_residency": (
                ["auto", "resident", "stream"],
                {
                    "default": "auto",
                    "tooltip": "Where each GPU keeps its block weights. auto: as many blocks "
                    "resident as fit in the GPU's free VRAM after the step's working set and a "
                    "reserve (H3MS_VRAM_RESERVE_GB, default 2), the rest streamed from the pinned "
                    "host store with prefetch; decided when the weights load, from the first "
                    "step's size, and the resident blocks are uploaded while the store fills. "
                    "resident: all blocks must fit. stream: stream every block each step. The "
                    "panel's weights column shows each rank's result.",
                },
            ),
        },
        "optional": {
            "gpus": ("H3MS_GPUS", {"tooltip": "GPU choice from an H3 MS GPU Set node."}),
            "verify": (
                "BOOLEAN",
                {
                    "default": False,
                    "tooltip": "Prove the split bit-exact on this machine: the first split step of "
                    "each prompt (with sparse_attention, its first sparse step) also runs unsplit "
                    "on the model's GPU, with the same attention (block by block, streaming "
                    "the weights) and is compared with torch.equal; the log and the panel say "
                    "'bit-exact on <GPUs>' or where it differs. Costs one unsplit step per prompt.",
                },
            ),
            "sparse_attention": (
                SPARSE_TYPE,
                {
                    "tooltip": "Sparse attention settings from an H3 MS Sparse Attention node: "
                    "each rank runs comfy-kitchen's sparse kernel over its own heads, so the split "
                    "equals the same sparse attention on one GPU. With one usable GPU the blocks "
                    "then run on one worker. Not connected: dense attention."
                },
            ),
            "exchange_pattern": (
                ["gather", "ulysses", "auto"],
                {
                    "default": "gather",
                    "tooltip": "How each block's attention gets its inputs. gather: every GPU "
                    "gets the whole block input and projects its own heads. ulysses: every GPU "
                    "projects every head for its own tokens, then q, k and v are exchanged (each "
                    "GPU holds every head's qkv weights). auto: the one the speed model predicts "
                    "faster for this GPU count, exchange and overlaps (with the default overlaps: "
                    "ulysses from 4 GPUs on PCIe host staging, from 5 with nccl). A "
                    "pattern runs only on a device kind where its bit-exactness test has passed "
                    "(ulysses: CPU and CUDA; elsewhere auto falls back to gather). Sparse "
                    "attention uses gather.",
                },
            ),
            "overlaps": (
                [c.value for c in OverlapChoice],
                {
                    "default": OverlapChoice.AUTO.value,
                    "advanced": True,
                    "tooltip": "What each GPU computes while its exchanges move. auto: attention "
                    "in 8 head pieces (each moved while the next computes; with the ulysses "
                    "pattern each piece's q, k, v arrive while the one before computes), the "
                    "qkv projection on each GPU's rows as they arrive and gather ahead (each "
                    "block's tail in 8 "
                    "row pieces, each sending the next block's rows while the next computes), "
                    "each only where the probe measured it bit-exact and its test has passed on "
                    "this device kind; the first steps of a plan time each combination once and "
                    "the rest run the fastest (the panel's step line says 'overlaps measuring' or "
                    "'fastest'). off: none. head pieces, gather, both (those two), gather ahead, "
                    "all: exactly that (refused in one line where untested).",
                },
            ),
        },
    }

    def patch(
        self,
        model: Any,
        enabled: bool,
        second_gpu: int,
        exchange: str,
        exchange_chunks: int,
        weight_cache: bool,
        cache_ram_reserve_gb: float,
        vram_residency: str,
        gpus: Any = None,
        verify: bool = False,
        sparse_attention: Any = None,
        exchange_pattern: str = "gather",
        overlaps: str = "auto",
    ) -> tuple:
        if not enabled:
            return (model,)
        dm = diffusion_model_of(model)
        if dm is None or not is_h3(dm):
            log.warning(
                "H3 MultiStream: the model is %s, not MiniMax H3; passing it through unsplit",
                type(dm).__name__ if dm is not None else type(model).__name__,
            )
            return (model,)
        if has_parallel_attention(model):
            raise MultiStreamError(
                "H3 Attention Parallel is already on this model; keep one of the two: H3 "
                "MultiStream when the model does not fit on one GPU (it splits whole blocks), H3 "
                "Attention Parallel when it does (only attention moves). Remove the other node "
                "from the model chain"
            )
        sparse = _sparse_config(model, dm, sparse_attention)
        if sparse is not None and exchange_pattern == "ulysses":
            raise MultiStreamError(
                "exchange_pattern 'ulysses' cannot run sparse attention (its kernel needs every "
                "token's block input on each GPU); set exchange_pattern to gather or auto, or "
                "disconnect sparse_attention"
            )
        devices, shares, why = _plan_devices(
            model, gpus, second_gpu, 1 if sparse is not None else 2
        )
        if devices is None:
            log.info("H3 MultiStream: running unsplit (%s)", why)
            return (model,)
        host, unsafe = _comfy_host()
        if unsafe:
            log.warning("H3 MultiStream: running unsplit: %s", unsafe)
            return (model,)
        # only a model this node splits: unsplit, ComfyUI's own sparse attention and MultiGPU CFG
        # Split run as they would without the node
        refuse_comfy_sparse(model)
        refuse_work_units(model)
        from h3ms_async.dit.exchange_choice import parse as parse_exchange
        from h3ms_async.dit.options import COMFY_ATTENTION, SplitOptions, parse_pattern
        from workers.dit.protocol import Residency

        options = SplitOptions(
            exchange=parse_exchange(exchange),
            exchange_chunks=int(exchange_chunks),
            vram_residency=Residency(vram_residency),
            cache_ram_reserve_gb=float(cache_ram_reserve_gb),
            shares=shares,
            attention=COMFY_ATTENTION,
            comfy_host=host,
            verify=bool(verify),
            sparse=sparse,
            pattern=parse_pattern(exchange_pattern),
            **overlap_options(overlaps),
        )
        clone = model.clone()
        install_split(clone, devices, options, float(cache_ram_reserve_gb), bool(weight_cache))
        log.info(
            "node configured: model %s on %s, ranks %s (%s), exchange %s x%d (pattern %s), weight "
            "cache %s, RAM reserve %g GiB, vram residency %s, verify %s, sparse attention %s, "
            "overlaps %s",
            type(dm).__name__,
            getattr(model, "load_device", "?"),
            ",".join(devices),
            why,
            exchange,
            exchange_chunks,
            exchange_pattern,
            "on" if weight_cache else "off",
            cache_ram_reserve_gb,
            vram_residency,
            "on" if verify else "off",
            sparse_attention.describe() if sparse is not None else "off",
            overlaps,
        )
        return (clone,)


#: The flag that selects each attention function ComfyUI may pick (for the unsplit warning).
_ATTENTION_FLAGS = {
    "attention_split": "--use-split-cross-attention",
    "attention_sage": "--use-sage-attention",
    "attention3_sage": "--use-sage-attention",
    "attention_flash": "--use-flash-attention",
    "attention_xformers": "xformers (installed, not --disable-xformers)",
}


def _comfy_host() -> tuple[Any, str | None]:
    """``(host, why_unsplit)``: this ComfyUI (root, argv) and the attention function it selected,
    which the ranks import and run (``workers.runtime.comfy_host``); ``why_unsplit`` names the flag
    when that function is not head-split safe."""
    import sys

    import comfy.ldm.modules.attention as attention

    from workers.runtime.comfy_host import HEAD_SPLIT_SAFE, ComfyHost

    name = attention.optimized_attention.__name__
    root = str(
        Path(attention.__file__).resolve().parents[3]
    )  # <root>/comfy/ldm/modules/attention.py
    host = ComfyHost(root, tuple(sys.argv[1:]), name)
    if name in HEAD_SPLIT_SAFE:
        return host, None
    flag = _ATTENTION_FLAGS.get(name, "an attention flag")
    return host, (
        f"ComfyUI attends with {name} ({flag}), which the split cannot run head-split bit-exactly; "
        f"start ComfyUI without {flag} (e.g. with --use-pytorch-cross-attention) to split H3"
    )


def _sparse_config(model: Any, dm: Any, settings: Any) -> Any:
    """The ranks' sparse attention config from an H3 MS Sparse Attention node's settings (None: not
    connected): the percent window through the model's own ``model_sampling.percent_to_sigma``, the
    dense blocks checked against the model's block count."""
    if settings is None:
        return None
    from h3ms_async.dit.sparse import SparseSettings

    if not isinstance(settings, SparseSettings):
        raise MultiStreamError(
            f"sparse_attention got {type(settings).__name__}; connect an H3 MS Sparse Attention "
            "node's output"
        )
    sampling = model.get_model_object("model_sampling")
    try:
        return settings.resolve(sampling.percent_to_sigma, len(dm.blocks))
    except ValueError as exc:
        raise MultiStreamError(f"H3 MS Sparse Attention: {exc}") from None


def _plan_devices(
    model: Any, gpus: Any, second_gpu: int, min_ranks: int = 2
) -> tuple[list[str] | None, tuple[float, ...] | None, str]:
    """``(devices, shares, why)``: the rank devices and their shares (None: equal), or None with the
    reason the model runs unsplit.

    ``H3MS_RANK_MAP`` replaces the plan as given, even with one rank; a connected GPU set's shares
    still apply. Otherwise the model must be on CUDA and the plan (the model's GPU is rank 0) needs
    ``min_ranks`` ranks (1 with sparse attention: plain ComfyUI has none, so one GPU runs the
    blocks on one worker).
    """
    from h3ms_async.runtime.plans import GPUSelectionError, GPUSet, rank_map, resolve_cuda

    if config.RANK_MAP.is_set():
        spec = config.RANK_MAP.raw()
        devices = config.RANK_MAP.get(rank_map)
        shares = tuple(gpus.shares) if gpus is not None and gpus.shares else None
        if shares is not None and len(shares) != len(devices):
            raise GPUSelectionError(
                f"shares: {len(shares)} value(s) from the H3 MS GPU Set for {len(devices)} rank(s) "
                f"of {RANK_MAP_ENV}={spec}; give one share per rank or leave shares empty"
            )
        return devices, _uneven(shares), f"{RANK_MAP_ENV}={spec}"
    load_device = getattr(model, "load_device", None)
    if getattr(load_device, "type", None) != "cuda":
        return None, None, f"the model is on {load_device}, the split needs MiniMax H3 on CUDA"
    gpu_set = gpus if gpus is not None else GPUSet.legacy(int(second_gpu))
    plan = resolve_cuda(gpu_set, 0 if load_device.index is None else load_device.index)
    notes = "; ".join(plan.notes) if plan.notes else "no notes"
    if len(plan.devices) < min_ranks:
        return None, None, f"one usable GPU ({', '.join(plan.devices)}; {notes})"
    return list(plan.devices), _uneven(plan.shares), f"{plan.describe()}; {gpu_set.describe()}"


def _uneven(shares: tuple[float, ...] | None) -> tuple[float, ...] | None:
    """None for equal shares, so that equal plans share one engine (its key includes the shares)."""
    if not shares or len(set(shares)) == 1:
        return None
    return tuple(float(s) for s in shares)
