"""What an H3 Attention Parallel helper executes: comfy-kitchen's INT8 attention on the head slice it is sent.

A helper holds no weights.  Per call it maps the slice's packed INT8 Q/K/V and scales from shared memory (registered
with CUDA once per segment, so host-to-device copies run at pinned speed), runs ``int8_attention_from_prequantized``
on its device and writes the result into the output slot the coordinator gave it.  Timings come back per phase.
"""
from __future__ import annotations

import time

import torch

from workers import attn_ops, attn_protocol, ck_attention_cpu  # noqa: F401 - attn_protocol declares the kinds
from workers.handlers import WorkerContext, handler

ck_attention_cpu.install_if_requested()
_SEGMENTS = "attn_segments"


def _map_segments(ctx: WorkerContext, names: set[str]) -> None:
    """Keep only this call's segments mapped: the coordinator replaced (and unlinked) any older ones."""
    for old in ctx.state.get(_SEGMENTS, set()) - names:
        ctx.forget_segment(old)
    ctx.state[_SEGMENTS] = names


def _call(ctx: WorkerContext, msg: dict) -> dict:
    """One slice (on the compute thread): copy in, attend, copy out; seconds per phase."""
    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    _map_segments(ctx, {d["seg"] for d in msg["tensors"].values()} | {msg["out"]["seg"]})
    host = {name: ctx.segment(d["seg"]).tensor(d) for name, d in msg["tensors"].items()}
    out_host = ctx.segment(msg["out"]["seg"]).tensor(msg["out"])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        local = {name: t.to(device, non_blocking=True) for name, t in host.items()}
        torch.cuda.current_stream(device).synchronize()
    else:
        local = host
    t1 = time.perf_counter()
    out = attn_ops.attend(local, msg["meta"])
    if tuple(out.shape) != tuple(out_host.shape) or out.dtype != out_host.dtype:
        raise ValueError(f"attention slice returned {out.dtype} {list(out.shape)}, the output slot is "
                         f"{out_host.dtype} {list(out_host.shape)}")
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    t2 = time.perf_counter()
    out_host.copy_(out, non_blocking=cuda)
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    t3 = time.perf_counter()
    return {
        "h2d_s": t1 - t0, "compute_s": t2 - t1, "d2h_s": t3 - t2, "wall_s": t3 - t0,
        "bytes_in": sum(t.numel() * t.element_size() for t in host.values()),
        "bytes_out": out_host.numel() * out_host.element_size(),
        "vram_peak_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
    }


def _call_inference(ctx: WorkerContext, msg: dict) -> dict:
    with torch.inference_mode():
        return _call(ctx, msg)


@handler("attn_call")
async def _attn_call(ctx: WorkerContext, msg: dict) -> dict:
    return await ctx.run_compute(_call_inference, ctx, msg)


@handler("attn_release")
async def _attn_release(ctx: WorkerContext, msg: dict) -> dict:
    _map_segments(ctx, set())
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"released": True}
