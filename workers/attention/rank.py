"""What an H3 Attention Parallel helper executes: comfy-kitchen's INT8 attention on the head slice it is sent.

A helper holds no weights.  Per call it maps the slice's packed INT8 Q/K/V and scales, runs
``int8_attention_from_prequantized`` on its device and writes the result into the output slot the coordinator gave it.
Two transports: shared memory (registered with CUDA once per segment, so copies run at pinned speed), or CUDA IPC
(``ipc``): buffers in the model GPU's memory, opened once per handle; a helper on that same GPU reads its slice in
place, one on another GPU copies device to device.  Timings come back per phase.
"""
from __future__ import annotations

import time

import torch

from workers.attention import ops as attn_ops
from workers.attention import protocol as attn_protocol
from workers.attention import ck_cpu as ck_attention_cpu
from workers.runtime.handlers import WorkerContext, handler

ck_attention_cpu.install_if_requested()
_SEGMENTS = "attn_segments"
_IPC = "attn_ipc"


def _map_segments(ctx: WorkerContext, names: set[str]) -> None:
    """Keep only this call's segments mapped: the coordinator replaced (and unlinked) any older ones."""
    for old in ctx.state.get(_SEGMENTS, set()) - names:
        ctx.forget_segment(old)
    ctx.state[_SEGMENTS] = names


def _ipc_storage(ctx: WorkerContext, handle: list, device: int) -> torch.UntypedStorage:
    """The model GPU's buffer behind ``handle`` (opened once; a new buffer replaces the old ones)."""
    key = (device, bytes(handle[1]), int(handle[3]))
    opened = ctx.state.setdefault(_IPC, {})
    if key not in opened:
        torch.cuda._lazy_init()
        _, h, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = handle
        opened[key] = torch.UntypedStorage._new_shared_cuda(
            device, bytes(h), int(size), int(offset), bytes(rc_handle), int(rc_offset),
            None if ev_handle is None else bytes(ev_handle), bool(ev_sync))
    return opened[key]


def _ipc_view(storage: torch.UntypedStorage, d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
    n = torch.Size(d["shape"]).numel() * torch.empty((), dtype=dtype).element_size()
    return flat[d["off"]:d["off"] + n].view(dtype).view(d["shape"])


def _sources(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The slice's tensors and the output slot: shm views, or views of the model GPU's IPC buffers."""
    ipc = msg.ipc
    if ipc is None:
        _map_segments(ctx, {d.seg for d in msg.tensors.values()} | {msg.out.seg})
        return ({name: ctx.segment(d.seg).tensor(d) for name, d in msg.tensors.items()},
                ctx.segment(msg.out.seg).tensor(msg.out))
    src, dst = (_ipc_storage(ctx, ipc[side], ipc["device"]) for side in ("in", "out"))
    live = {(ipc["device"], bytes(ipc[side][1]), int(ipc[side][3])) for side in ("in", "out")}
    opened = ctx.state[_IPC]
    for key in set(opened) - live:  # the coordinator replaced its buffers: let go of the old ones
        del opened[key]
    return {name: _ipc_view(src, d) for name, d in ipc["tensors"].items()}, _ipc_view(dst, ipc["result"])


def _call(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> dict:
    """One slice (on the compute thread): copy in, attend, copy out; seconds per phase."""
    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    host, out_host = _sources(ctx, msg)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        local = {name: t.to(device, non_blocking=True) for name, t in host.items()}
        torch.cuda.current_stream(device).synchronize()
    else:
        local = host
    t1 = time.perf_counter()
    out = attn_ops.attend(local, msg.meta)
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


def _call_inference(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> dict:
    with torch.inference_mode():
        return _call(ctx, msg)


@handler(attn_protocol.AttnCall)
async def _attn_call(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> dict:
    return await ctx.run_compute(_call_inference, ctx, msg)


@handler(attn_protocol.AttnRelease)
async def _attn_release(ctx: WorkerContext, msg: attn_protocol.AttnRelease) -> dict:
    _map_segments(ctx, set())
    ctx.state.pop(_IPC, None)
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"released": True}
