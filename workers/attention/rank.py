"""What an H3 Attention Parallel helper executes: comfy-kitchen's INT8 attention on the head slice
it is sent.

A helper holds no weights.  A call reaches it as pieces (head slices, ``attn_call`` each); per piece
it maps the packed INT8 Q/K/V and scales, runs ``int8_attention_from_prequantized`` on its device
and writes the result into the output slot the coordinator gave it.  On CUDA the pieces are
pipelined: copy in, attention and copy out run on their own streams, and consecutive pieces'
attention on two compute streams taken in turn. Two transports: shared memory (registered with CUDA
once per segment, so copies run at pinned speed), or CUDA IPC (``ipc``): buffers in the model GPU's
memory, opened once per handle; a helper on that same GPU reads its slice in place, one on another
GPU copies device to device.  Timings come back per phase.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention import ops as attn_ops
from workers.attention import protocol as attn_protocol
from workers.runtime import cuda_ipc
from workers.runtime.handlers import WorkerContext, handler
from workers.runtime.protocol import Released

_SEGMENTS = "attn_segments"
_IPC = "attn_ipc"
_STREAMS = "attn_streams"
#: when the current call's first piece started its attention on this helper (CUDA event;
#: perf_counter on the CPU)
_CALL_START = "attn_call_start"


def _map_segments(ctx: WorkerContext, names: set[str]) -> None:
    """Keep only this call's segments mapped: the coordinator replaced (and unlinked) any older
    ones."""
    for old in ctx.state.get(_SEGMENTS, set()) - names:
        ctx.forget_segment(old)
    ctx.state[_SEGMENTS] = names


def _ipc_storage(ctx: WorkerContext, handle: list, device: int) -> torch.UntypedStorage:
    """The model GPU's buffer behind ``handle`` (opened once; a new buffer replaces the old
    ones)."""
    key = (device, bytes(handle[1]), int(handle[3]))
    opened = ctx.state.setdefault(_IPC, {})
    if key not in opened:
        opened[key] = cuda_ipc.open_storage(handle, device)
    return opened[key]


def _ipc_view(storage: torch.UntypedStorage, d: dict) -> torch.Tensor:
    return attn_protocol.ipc_view(cuda_ipc.bytes_of(storage), d)


def _sources(
    ctx: WorkerContext, msg: attn_protocol.AttnCall
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The slice's tensors and the output slot: shm views, or views of the model GPU's IPC
    buffers."""
    ipc = msg.ipc
    if ipc is None:
        out = msg.out
        if out is None:
            raise ValueError("attn_call names neither an output slot (out) nor IPC buffers (ipc)")
        _map_segments(ctx, {d.seg for d in msg.tensors.values()} | {out.seg})
        return (
            {name: ctx.segment(d.seg).tensor(d) for name, d in msg.tensors.items()},
            ctx.segment(out.seg).tensor(out),
        )
    src, dst = (_ipc_storage(ctx, ipc[side], ipc["device"]) for side in ("in", "out"))
    live = {(ipc["device"], bytes(ipc[side][1]), int(ipc[side][3])) for side in ("in", "out")}
    opened = ctx.state[_IPC]
    for key in set(opened) - live:  # the coordinator replaced its buffers: let go of the old ones
        del opened[key]
    return {name: _ipc_view(src, d) for name, d in ipc["tensors"].items()}, _ipc_view(
        dst, ipc["result"]
    )


@dataclass
class _Streams:
    """A CUDA helper's streams.  Two compute streams taken in turn, because a kernel's last wave of
    blocks leaves most of the GPU idle and a 1-2-head piece has few waves: the next piece's
    attention, on the other stream, fills the SMs the last wave frees (H200, 14 heads in 2-head
    pieces: 139.0 ms on one stream, 129.2 ms on two, 130.5 ms as one call).  Each kernel is
    independent, so the bits do not change."""

    copy_in: torch.cuda.Stream
    copy_out: torch.cuda.Stream
    compute: tuple[torch.cuda.Stream, torch.cuda.Stream]
    turn: int = 0

    def next_compute(self) -> torch.cuda.Stream:
        self.turn ^= 1
        return self.compute[self.turn]


class _Piece:
    """One piece on its way through the helper: on CUDA its copy in, attention and copy out are
    queued on their own streams (so the next piece's copy in and this one's copy out overlap the
    attention around them) and :meth:`finish` waits for them; on the CPU it has run to the end."""

    def __init__(
        self,
        device: torch.device,
        nbytes_in: int,
        nbytes_out: int,
        timings: dict | None = None,
        events: list | None = None,
        call_start: Any = None,
    ) -> None:
        self.device, self.bytes_in, self.bytes_out = device, nbytes_in, nbytes_out
        self.timings, self.events, self.call_start = timings, events, call_start

    def finish(self) -> attn_protocol.AttnPiece:
        """Wait for the piece's copy out; its seconds per phase (CUDA: event-timed, each phase's own
        time) and ``compute_end_s``, from the call's first attention start on this helper to this
        piece's attention end (the helper's attention span, shorter than the phases added up where
        pieces overlap)."""
        timings = self.timings
        if self.events is not None:
            ev = self.events
            ev[-1].synchronize()
            self.call_start.synchronize()  # the call's first piece, on the other compute stream
            timings = {
                "h2d_s": ev[0].elapsed_time(ev[1]) / 1e3,
                "compute_s": ev[2].elapsed_time(ev[3]) / 1e3,
                "d2h_s": ev[4].elapsed_time(ev[5]) / 1e3,
                "compute_end_s": self.call_start.elapsed_time(ev[3]) / 1e3,
            }
        assert timings is not None  # set on the CPU, computed from the events on CUDA
        return attn_protocol.AttnPiece(
            **timings,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            vram_peak_bytes=(
                int(torch.cuda.max_memory_allocated(self.device)) if self.events else None
            ),
        )


def _check_out(out: torch.Tensor, slot: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(slot.shape) or out.dtype != slot.dtype:
        raise ValueError(
            f"attention slice returned {out.dtype} {list(out.shape)}, the output slot is "
            f"{slot.dtype} {list(slot.shape)}"
        )


def _start(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> _Piece:
    """Queue one piece (on the compute thread, which is free again as soon as the work is queued on
    CUDA)."""
    device = torch.device(ctx.device)
    src, slot = _sources(ctx, msg)
    nbytes_in = sum(t.numel() * t.element_size() for t in src.values())
    nbytes_out = slot.numel() * slot.element_size()
    if device.type != "cuda":
        t0 = time.perf_counter()
        if msg.first:
            ctx.state[_CALL_START] = t0
        out = attn_ops.attend(src, msg.meta)
        _check_out(out, slot)
        t1 = time.perf_counter()
        slot.copy_(out)
        return _Piece(
            device,
            nbytes_in,
            nbytes_out,
            timings={
                "h2d_s": 0.0,
                "compute_s": t1 - t0,
                "d2h_s": time.perf_counter() - t1,
                "compute_end_s": t1 - ctx.state.get(_CALL_START, t0),
            },
        )
    if msg.first:
        torch.cuda.reset_peak_memory_stats(device)
    streams = ctx.state.get(_STREAMS)
    if streams is None:
        streams = ctx.state[_STREAMS] = _Streams(
            torch.cuda.Stream(device),
            torch.cuda.Stream(device),
            (torch.cuda.Stream(device), torch.cuda.Stream(device)),
        )
    copy_in, copy_out, compute = streams.copy_in, streams.copy_out, streams.next_compute()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    if msg.first:
        ctx.state[_CALL_START] = ev[2]
    with torch.cuda.stream(copy_in):
        ev[0].record(copy_in)
        local = {name: t.to(device, non_blocking=True) for name, t in src.items()}
        ev[1].record(copy_in)
    for name, t in local.items():
        if t is not src[name]:
            # made on copy_in, read on compute: not reusable before the attention is done
            t.record_stream(compute)
    compute.wait_event(ev[1])
    ev[2].record(compute)
    with torch.cuda.stream(compute):
        out = attn_ops.attend(local, msg.meta)
    _check_out(out, slot)
    ev[3].record(compute)
    copy_out.wait_event(ev[3])
    with torch.cuda.stream(copy_out):
        ev[4].record(copy_out)
        slot.copy_(out, non_blocking=True)
        ev[5].record(copy_out)
    out.record_stream(copy_out)
    return _Piece(
        device, nbytes_in, nbytes_out, events=ev, call_start=ctx.state.get(_CALL_START, ev[2])
    )


def _start_inference(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> _Piece:
    with torch.inference_mode():
        return _start(ctx, msg)


@handler(attn_protocol.AttnCall)
async def _attn_call(ctx: WorkerContext, msg: attn_protocol.AttnCall) -> attn_protocol.AttnPiece:
    # Pieces reach the compute thread in the order they arrive; waiting for one happens off that
    # thread, so the next piece is queued on the GPU while this one still runs.
    t0 = time.perf_counter()
    piece = await ctx.run_compute(_start_inference, ctx, msg)
    result = await asyncio.get_running_loop().run_in_executor(None, piece.finish)
    result.wall_s = time.perf_counter() - t0
    return result


@handler(attn_protocol.AttnProbe)
async def _attn_probe(ctx: WorkerContext, msg: attn_protocol.AttnProbe) -> attn_protocol.AttnProbed:
    """This helper's head ranges against the whole call, on its own device
    (``attn_ops.probe_ranges``)."""
    shape = tuple(int(v) for v in msg.shape)
    ranges = [(int(a), int(b)) for a, b in msg.ranges]
    out = await ctx.run_compute(
        attn_ops.probe_ranges,
        shape,
        int(msg.kv_len),
        getattr(torch, msg.dtype),
        ranges,
        torch.device(ctx.device),
    )
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


@handler(attn_protocol.AttnRelease)
async def _attn_release(ctx: WorkerContext, msg: attn_protocol.AttnRelease) -> Released:
    _map_segments(ctx, set())
    ctx.state.pop(_IPC, None)
    ctx.state.pop(_STREAMS, None)
    ctx.state.pop(_CALL_START, None)
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return Released(released=True)
