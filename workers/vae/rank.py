"""What a VAE-split worker executes: ComfyUI's own H3 video-VAE decoder on the temporal chunks dealt
to it.

The worker imports ``comfy`` from the ComfyUI root the coordinator names (with ComfyUI's
command-line flags, so the attention function and precision choices are the parent's), builds
``MiniMaxH3VideoVAE``'s decoder with the parent's architecture and operations class, and copies the
parent's decoder tensors in from the weight-store segment: the same code on the same weights, so a
chunk decoded here equals the chunk decoded in ComfyUI's process.  Each chunk answer carries the
raw, untrimmed decoder output (decoder dtype); the ordered blend and write stay with the coordinator
(``h3ms_async.vae.split``).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.runtime import config
from workers.runtime.handlers import WorkerContext, handler
from workers.runtime.protocol import Dropped, Released, TensorDesc
from workers.runtime.shm import torch_dtype
from workers.vae import protocol as vae_protocol
from workers.vae.protocol import DECODE_PREFIXES

#: The test hooks' faults (``workers/testing/faults.py``, with ``H3MS_TEST_HOOKS=1``): called before
#: a chunk decodes and on each decoded chunk; None in production.
BEFORE_CHUNK: Callable[[WorkerContext], None] | None = None
ON_DECODED: Callable[[WorkerContext, torch.Tensor], None] | None = None
if config.TEST_HOOKS.get():
    from workers.testing.faults import vae_crash as BEFORE_CHUNK
    from workers.testing.faults import vae_skew as ON_DECODED

_STATE = "vae"


@dataclass
class VaeState:
    key: str | None = None
    model: Any = None
    dtype: torch.dtype | None = None
    #: (job, index) -> flat uint8 CPU copy of a decoded chunk waiting for ``vae_fetch``
    held: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    #: job -> names of the segments its chunks used (forgotten at ``vae_drop``)
    segments: dict[int, set[str]] = field(default_factory=dict)
    chunks_done: int = 0


def _state(ctx: WorkerContext) -> VaeState:
    st = ctx.state.get(_STATE)
    if st is None:
        st = ctx.state[_STATE] = VaeState()
    return st


def import_comfy_vae(comfy: dict) -> Any:
    """Import ``comfy.ldm.minimax.vae`` from ``comfy["root"]`` after ComfyUI's flags
    ``comfy["argv"]`` are parsed.

    ``comfy["argv"]`` is None when the parent never parsed flags (ComfyUI embedded without its CLI):
    the defaults then hold here too.  A second call must name the same root (a process holds one
    ComfyUI).
    """
    root = os.path.realpath(comfy["root"])
    loaded = sys.modules.get("comfy")
    if loaded is not None:
        where = os.path.realpath(os.path.dirname(next(iter(loaded.__path__))))
        if where != root:
            raise RuntimeError(
                f"this worker already imported ComfyUI from {where}; it cannot switch to {root}"
            )
        return importlib.import_module("comfy.ldm.minimax.vae")
    if not os.path.isfile(os.path.join(root, "comfy", "ldm", "minimax", "vae.py")):
        raise FileNotFoundError(
            f"{root} is not a ComfyUI root with MiniMax H3 (comfy/ldm/minimax/vae.py is missing)"
        )
    sys.path.insert(0, root)
    for p in comfy.get("sys_path") or []:
        if p not in sys.path:
            sys.path.append(p)
    if comfy.get("argv") is not None:
        sys.argv = ["main.py", *comfy["argv"]]
        importlib.import_module("comfy.options").enable_args_parsing()
    return importlib.import_module("comfy.ldm.minimax.vae")


def build_decoder(
    vae_mod: Any, arch: dict, dtype: torch.dtype, stored: Mapping[str, str] | None = None
) -> Any:
    """A ``MiniMaxH3VideoVAE`` whose decode path (``post_quant_conv`` + ``ViT3DDecoder``) has
    ``arch``'s shape.

    ``arch``: ``decoder`` (the ViT3DDecoder arguments), ``operations`` (name of the ``comfy.ops``
    class the parent's decoder linears use; ``mixed_precision_ops`` for a quantized decoder, built
    with ``arch["mixed_precision"]``'s arguments and the quantization ComfyUI detects in the shipped
    tensors' names), ``cast_flags`` (module name -> ``comfy_cast_weights`` where the parent's
    differs from the class's), ``z_channels``, ``embed_dim``, and the tiling/temporal attributes
    ``tile_size``, ``tile_overlap_min``, ``tiling``, ``vae_ratio``, ``vae_ratio_t``,
    ``clip_length``, ``token_drop``.  ``stored``: the shipped tensors' names and dtype names.

    Built on the meta device without the encoder (a decode never touches it), cast to ``dtype`` as
    ComfyUI's VAE loader casts it; a floating tensor the parent keeps in another dtype (DynamicVRAM
    keeps a checkpoint's stored dtype and casts per layer) gets that dtype, so the same per-layer
    casts run here.  ``to_empty`` places it and :func:`load_tensors` fills it.
    """
    import comfy.ops

    if arch["operations"] == "mixed_precision_ops":
        import comfy.utils

        mp = arch["mixed_precision"]
        quant = comfy.utils.detect_layer_quantization(dict.fromkeys(stored or ()), "")
        if quant is None:
            raise ValueError(
                "the parent's decoder is quantized, but no shipped tensor carries comfy_quant "
                "metadata"
            )
        ops_cls = comfy.ops.mixed_precision_ops(
            quant, torch_dtype(mp["compute_dtype"]), bool(mp["full_precision_mm"])
        )
    else:
        ops_cls = getattr(comfy.ops, arch["operations"], None)
    if ops_cls is None:
        raise ValueError(
            f"comfy.ops has no operations class {arch['operations']!r}; the parent's ComfyUI "
            "differs"
        )
    with torch.device("meta"):
        model = vae_mod.MiniMaxH3VideoVAE(
            ch=32,
            ch_mult=(1,) * 6,
            num_res_blocks=1,
            embed_dim=arch["embed_dim"],
            z_channels=arch["z_channels"],
            clip_length=arch["clip_length"],
            token_drop=arch["token_drop"],
            tile_size=arch["tile_size"],
            tile_overlap_min=arch["tile_overlap_min"],
            tiling=arch["tiling"],
        )
        model.encoder = None
        model.quant_conv = None
        model.decoder = vae_mod.ViT3DDecoder(operations=ops_cls, **arch["decoder"])
    model.vae_ratio = int(arch["vae_ratio"])
    model.vae_ratio_t = int(arch["vae_ratio_t"])
    model = model.to(dtype)
    _keep_stored_dtypes(model, stored or {})
    for name, flag in arch.get("cast_flags", {}).items():
        model.get_submodule(name).comfy_cast_weights = flag
    return model


def _keep_stored_dtypes(model: Any, stored: Mapping[str, str]) -> None:
    """Give every built floating parameter or buffer the dtype of its shipped tensor (quantized
    parts, which the linears' own loader rebuilds, are left alone)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        want = torch_dtype(stored[name]) if name in stored else t.dtype
        if want == t.dtype or not (want.is_floating_point and t.dtype.is_floating_point):
            continue
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        if attr in mod._parameters:
            mod._parameters[attr] = torch.nn.Parameter(
                t.data.to(want), requires_grad=t.requires_grad
            )
        else:
            mod._buffers[attr] = t.to(want)


def load_tensors(model: Any, tensors: dict[str, torch.Tensor], device: str) -> int:
    """Load the decode path from the parent's tensors (views of the weight store) as ComfyUI's VAE
    loader loads a checkpoint (``load_state_dict`` per module, a quantized linear rebuilt from its
    stored parts), then copy the non-persistent buffers; refuse missing, extra or mismatched tensors
    (a plain tensor must already have the built dtype: no silent cast).  ``model`` was placed on
    ``device`` by ``to_empty``; a quantized linear's parts are copied out of the store and rebuilt
    on the CPU, as ComfyUI rebuilds them from a checkpoint, then moved there."""
    built = {
        n: t
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if n.startswith(DECODE_PREFIXES)
    }
    # parts the load keeps as they are (a quantized weight wraps its int8 tensor): copies, not views
    # of the store
    tensors = {n: t if n in built else t.clone() for n, t in tensors.items()}
    for name, dst in built.items():
        src = tensors.get(name)
        if src is not None and (src.shape != dst.shape or src.dtype != dst.dtype):
            raise ValueError(
                f"{name}: shipped {src.dtype} {list(src.shape)}, built {dst.dtype} "
                f"{list(dst.shape)}"
            )
    volatile = {
        f"{m}.{b}" if m else b
        for m, mod in model.named_modules()
        for b in mod._non_persistent_buffers_set
    }
    missing: list[str] = []
    extra: list[str] = []
    with torch.no_grad():
        for prefix in DECODE_PREFIXES:
            part = {
                n[len(prefix) :]: t
                for n, t in tensors.items()
                if n.startswith(prefix) and n not in volatile
            }
            m, u = getattr(model, prefix[:-1]).load_state_dict(part, strict=False)
            missing += [prefix + n for n in m]
            extra += [prefix + n for n in u]
        for name in sorted(volatile & set(built)):
            if name not in tensors:
                missing.append(name)
            else:
                built[name].copy_(tensors[name])
    extra += sorted(n for n in tensors if not n.startswith(DECODE_PREFIXES))
    if missing or extra:
        raise ValueError(
            f"decoder tensors do not match the built decoder: missing {missing[:5]}, extra "
            f"{extra[:5]}"
        )
    model.to(device)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _load(ctx: WorkerContext, msg: vae_protocol.VaeLoad) -> dict:
    t0 = time.perf_counter()
    vae_mod = import_comfy_vae(msg.comfy)
    t_import = time.perf_counter() - t0
    dtype = torch_dtype(msg.dtype)
    stored = {name: d.dtype for name, d in msg.manifest.items()}
    model = build_decoder(vae_mod, msg.arch, dtype, stored).to_empty(device=ctx.device)
    names = {d.seg for d in msg.manifest.values()}
    try:
        tensors = {name: ctx.segment(d.seg).tensor(d) for name, d in msg.manifest.items()}
        nbytes = load_tensors(model, tensors, ctx.device)
        del tensors
    finally:
        for name in names:
            ctx.forget_segment(name)
    # No attention warm-up here (the DiT ranks have one): measured on the H200
    # (benchmarks/vae_probe_diag.py), a worker that ran dit_ops.warm_up first took another SDPA
    # kernel for the decoder's attention than ComfyUI's process and differed from its first decode
    # on; a worker without it equals ComfyUI's decode from its first chunk.
    model = model.eval().requires_grad_(False)
    return {
        "model": model,
        "dtype": dtype,
        "nbytes": nbytes,
        "import_s": t_import,
        "load_s": time.perf_counter() - t0,
    }


@handler(vae_protocol.VaeLoad)
async def _vae_load(ctx: WorkerContext, msg: vae_protocol.VaeLoad) -> vae_protocol.VaeLoaded:
    st = _state(ctx)
    if st.key == msg.key and st.model is not None:
        return vae_protocol.VaeLoaded(loaded=False, key=st.key)
    st.model = None
    st.key = None
    res = await ctx.run_compute(_load, ctx, msg)
    st.model, st.dtype, st.key = res["model"], res["dtype"], msg.key
    ctx.log.info(
        "VAE decoder loaded: %.1f MiB %s in %.2f s (ComfyUI import %.2f s), key %s",
        res["nbytes"] / 2**20,
        msg.dtype,
        res["load_s"],
        res["import_s"],
        msg.key,
    )
    return vae_protocol.VaeLoaded(
        loaded=True,
        key=msg.key,
        bytes=res["nbytes"],
        seconds=res["load_s"],
        import_s=res["import_s"],
    )


def _decode_raw(ctx: WorkerContext, st: VaeState, z_desc: TensorDesc) -> torch.Tensor:
    """ComfyUI's decode of the latent chunk at ``z_desc`` on this worker's device (in inference
    mode)."""
    raw = st.model._adaptive_decode(
        ctx.segment(z_desc.seg).tensor(z_desc).to(ctx.device, copy=True)
    )
    if ON_DECODED is not None:
        ON_DECODED(ctx, raw)
    return raw


def _probe(ctx: WorkerContext, st: VaeState, msg: vae_protocol.VaeProbe) -> vae_protocol.VaeProbed:
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            raw = _decode_raw(ctx, st, msg.z)
            digest = vae_protocol.chunk_digest(raw)
    finally:
        ctx.forget_segment(msg.z.seg)
    return vae_protocol.VaeProbed(
        digest=digest,
        seconds=time.perf_counter() - t0,
        shape=list(raw.shape),
        dtype=str(raw.dtype).removeprefix("torch."),
    )


def _decode(
    ctx: WorkerContext, st: VaeState, msg: vae_protocol.VaeChunk, gen: int
) -> vae_protocol.VaeChunkDone:
    if ctx.abort_generation() != gen:  # the decode was abandoned while this chunk waited its turn
        raise RuntimeError(
            f"chunk {msg.index} of job {msg.job} skipped: the coordinator aborted the decode"
        )
    if BEFORE_CHUNK is not None:
        BEFORE_CHUNK(ctx)
    names = st.segments.setdefault(msg.job, set())
    names.add(msg.z.seg)
    if msg.out is not None:
        names.add(msg.out.seg)
    t0 = time.perf_counter()
    with torch.inference_mode():
        raw = _decode_raw(ctx, st, msg.z)
        if ctx.device.startswith("cuda"):
            torch.cuda.synchronize(ctx.device)
        t_decode = time.perf_counter() - t0
        out = msg.out
        if out is not None:
            dst = ctx.segment(out.seg).tensor(out)
            if tuple(dst.shape) != tuple(raw.shape) or dst.dtype != raw.dtype:
                raise ValueError(
                    f"chunk {msg.index}: decoded {raw.dtype} {list(raw.shape)}, the coordinator "
                    f"expects {dst.dtype} {list(dst.shape)}"
                )
            dst.copy_(raw)
        else:
            st.held[(msg.job, msg.index)] = raw.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if ctx.device.startswith("cuda"):
            torch.cuda.synchronize(ctx.device)
    return vae_protocol.VaeChunkDone(
        index=msg.index,
        seconds=t_decode,
        copy_s=time.perf_counter() - t0 - t_decode,
        shape=list(raw.shape),
        dtype=str(raw.dtype).removeprefix("torch."),
        nbytes=raw.numel() * raw.element_size(),
        held=out is None,
    )


@handler(vae_protocol.VaeChunk)
async def _vae_chunk(ctx: WorkerContext, msg: vae_protocol.VaeChunk) -> vae_protocol.VaeChunkDone:
    st = _state(ctx)
    if st.model is None:
        raise RuntimeError("vae_chunk before vae_load: this worker holds no VAE decoder")
    res = await ctx.run_compute(_decode, ctx, st, msg, ctx.abort_generation())
    st.chunks_done += 1
    ctx.log.info(
        "job %d chunk %d: %s %s in %.3f s (+%.3f s copy, %s)",
        msg.job,
        msg.index,
        res.dtype,
        res.shape,
        res.seconds,
        res.copy_s,
        "held for fetch" if res.held else "shm",
    )
    return res


@handler(vae_protocol.VaeProbe)
async def _vae_probe(ctx: WorkerContext, msg: vae_protocol.VaeProbe) -> vae_protocol.VaeProbed:
    st = _state(ctx)
    if st.model is None:
        raise RuntimeError("vae_probe before vae_load: this worker holds no VAE decoder")
    res = await ctx.run_compute(_probe, ctx, st, msg)
    ctx.log.info(
        "exactness probe: %s %s decoded in %.3f s, digest %s",
        res.dtype,
        res.shape,
        res.seconds,
        res.digest[:12],
    )
    return res


@handler(vae_protocol.VaeFetch)
async def _vae_fetch(ctx: WorkerContext, msg: vae_protocol.VaeFetch) -> vae_protocol.VaeFetched:
    st = _state(ctx)
    key = (msg.job, msg.index)
    flat = st.held.get(key)
    if flat is None:
        raise KeyError(f"no decoded chunk {msg.index} of job {msg.job} is held here")
    off, n = int(msg.off), int(msg.n)
    if off < 0 or n < 1 or n > vae_protocol.FETCH_PIECE_BYTES or off + n > flat.numel():
        raise ValueError(
            f"fetch [{off}, {off + n}) of a {flat.numel()}-byte chunk; pieces are at most "
            f"{vae_protocol.FETCH_PIECE_BYTES} bytes"
        )
    data = flat[off : off + n].numpy().tobytes()
    if off + n == flat.numel():
        del st.held[key]
    return vae_protocol.VaeFetched(data=data)


@handler(vae_protocol.VaeDrop)
async def _vae_drop(ctx: WorkerContext, msg: vae_protocol.VaeDrop) -> Dropped:
    st = _state(ctx)
    keys = [k for k in st.held if k[0] == msg.job]
    for k in keys:
        del st.held[k]
    for name in st.segments.pop(msg.job, ()):
        ctx.forget_segment(name)
    return Dropped(dropped=len(keys))


@handler(vae_protocol.VaeRelease)
async def _vae_release(ctx: WorkerContext, msg: vae_protocol.VaeRelease) -> Released:
    st = _state(ctx)
    had = st.model is not None
    ctx.state.pop(_STATE, None)
    if had and ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return Released(released=had)
