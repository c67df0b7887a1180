"""H3 Attention Parallel, coordinator side: one attention call's heads split across the model's device and helpers.

The model stays whole on its device (rank 0 of the plan); only attention moves.  Per call (docs/attention_parallel.md):

1. the caller has quantized Q/K/V once, for all heads, with comfy-kitchen (``prequantize_int8_attention``);
2. the heads are apportioned by shares (``plans.partition``, largest remainder): rank 0 keeps the first range, each
   helper r gets range r;
3. each helper's packed INT8 slice is copied into its slot of one input segment of shared memory (registered with CUDA,
   so device-to-host runs at pinned speed), and ``attn_call`` goes to every helper at once;
4. rank 0 attends its own range meanwhile (on CUDA it starts before the copies finish);
5. each helper writes its BF16 (input-dtype) result into its slot of the output segment; rank 0 copies them into the
   right head slots of the output.

Heads are independent and the quantization happened once on the full tensors, so the result equals the unsplit
call bit for bit.  The engine owns its :class:`WorkerPool` (one helper process per helper device) and its segments;
a helper that dies or errs fails the call with its last log lines, and the call has a deadline.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from h3ms_async import plans
from h3ms_async.coordinator import get_coordinator
from h3ms_async.log import get_logger
from h3ms_async.pool import WorkerError, WorkerPool
from h3ms_async.status import get_hub, now_iso
from workers import attn_ops, attn_protocol  # noqa: F401 - attn_protocol declares the kinds sent here
from workers.exchange import dtype_name
from workers.shm import Arena, Segment, register_cuda

log = get_logger("AttentionParallel")

#: Calls kept per engine for the status route and the panel.
RECENT_CALLS = 32


class AttentionParallelError(RuntimeError):
    """A parallel attention call failed (a helper died, erred or missed the deadline); the message says which."""


@dataclass
class _Buffers:
    """One call shape's shm slots: per helper, its packed input slice and its output, reused while shapes match."""

    key: tuple
    inputs: Segment
    outputs: Segment
    in_descs: list[dict[str, dict]]
    out_descs: list[dict]

    def close(self) -> None:
        for seg in (self.inputs, self.outputs):
            seg.close()
            seg.unlink()


class AttentionParallelEngine:
    """Head-parallel INT8 attention over ``devices``: ``devices[0]`` is the model's device (this process), the rest
    are helper devices, one worker process each (a device may repeat: logical helpers on one GPU)."""

    def __init__(self, devices: Sequence[str], shares: Sequence[float] | None = None,
                 call_timeout_s: float = 120.0) -> None:
        if len(devices) < 2:
            raise ValueError(f"devices: attention parallel needs the model's device and at least one helper, got "
                             f"{list(devices)!r}")
        if shares is not None and len(shares) != len(devices):
            raise plans.GPUSelectionError(f"shares: {len(shares)} value(s) for {len(devices)} device(s); give one "
                                          "share per device, the model's first")
        self.devices = list(devices)
        self.shares = tuple(float(s) for s in shares) if shares else None
        self.transport = "host"
        self.call_timeout_s = float(call_timeout_s)
        self.pool = WorkerPool(self.devices[1:], name="attn")
        self._buffers: _Buffers | None = None
        self._lock = threading.Lock()
        self._running = False
        self._calls = 0
        self._recent: collections.deque[dict] = collections.deque(maxlen=RECENT_CALLS)
        self._copy_stream: Any = None
        _LIVE.add(self)
        _register_status()

    @property
    def running(self) -> bool:
        return self._running

    def head_bounds(self, heads: int) -> list[int]:
        """Cumulative head bounds, one range per device (largest remainder by shares; ties to later devices)."""
        if heads < len(self.devices):
            raise AttentionParallelError(f"cannot split {heads} attention heads over {len(self.devices)} devices; "
                                         f"use at most {heads}")
        return plans.partition(heads, self.shares or [1.0] * len(self.devices), "attention heads")

    # -- one call -------------------------------------------------------------------------------------------------
    def attend(self, pq: Any) -> torch.Tensor:
        """``int8_attention_from_prequantized(pq)`` with the heads split over the devices: ``[B, H, Sq, D]`` in
        ``pq.input_dtype`` on ``pq.q``'s device, equal to the unsplit call."""
        fields = attn_ops.meta(pq)
        b, heads, sq, _ = pq.q.shape
        bounds = self.head_bounds(heads)
        device = pq.q.device
        cuda = device.type == "cuda"
        with self._lock:
            self._running = True
            try:
                t_start = time.perf_counter()
                if not self.pool.running:
                    get_coordinator().run(self.pool.start(), self.pool.start_timeout + 10.0, "starting helpers")
                buf = self._buffers_for(pq, bounds, device)
                slices = [attn_ops.head_slice(pq, bounds[r], bounds[r + 1]) for r in range(len(self.devices))]
                out = torch.empty((b, heads, sq, fields["original_head_dim"]), dtype=pq.input_dtype, device=device)
                result = (self._call_cuda if cuda else self._call_cpu)(buf, slices, fields, out, bounds)
                self._record(result, bounds, sq, heads, time.perf_counter() - t_start)
                return out
            finally:
                self._running = False

    def _fields(self, buf: _Buffers, fields: dict) -> list[dict]:
        self._calls += 1
        return [{"job": self._calls, "tensors": buf.in_descs[r], "meta": fields, "out": buf.out_descs[r]}
                for r in range(len(self.devices) - 1)]

    def _stage(self, buf: _Buffers, slices: list[dict[str, torch.Tensor]], non_blocking: bool) -> int:
        """Copy every helper's slice into its input slot; returns the bytes staged."""
        moved = 0
        for r, descs in enumerate(buf.in_descs, start=1):
            for name, desc in descs.items():
                buf.inputs.tensor(desc).copy_(slices[r][name], non_blocking=non_blocking)
                moved += slices[r][name].numel() * slices[r][name].element_size()
        return moved

    def _collect(self, buf: _Buffers, out: torch.Tensor, bounds: list[int], non_blocking: bool) -> int:
        """Copy every helper's result into its head slots of ``out``; returns the bytes copied."""
        moved = 0
        for r, desc in enumerate(buf.out_descs, start=1):
            src = buf.outputs.tensor(desc)
            out[:, bounds[r]:bounds[r + 1]].copy_(src, non_blocking=non_blocking)
            moved += src.numel() * src.element_size()
        return moved

    def _call_cpu(self, buf: _Buffers, slices: list, fields: dict, out: torch.Tensor, bounds: list[int]) -> dict:
        # Stage and send first: the helpers work while this process attends its own range.
        t0 = time.perf_counter()
        staged = self._stage(buf, slices, False)
        t1 = time.perf_counter()
        fut = get_coordinator().submit(self._dispatch(self._fields(buf, fields)))
        try:
            out[:, :bounds[1]].copy_(attn_ops.attend(slices[0], fields))
            t2 = time.perf_counter()
            results = self._wait(fut)
        except BaseException:
            self._abandon(fut)
            raise
        t3 = time.perf_counter()
        returned = self._collect(buf, out, bounds, False)
        return {"stage_s": t1 - t0, "local_s": t2 - t1, "return_s": time.perf_counter() - t3, "staged": staged,
                "returned": returned, "helpers": results}

    def _call_cuda(self, buf: _Buffers, slices: list, fields: dict, out: torch.Tensor, bounds: list[int]) -> dict:
        device = out.device
        stream = torch.cuda.current_stream(device)
        if self._copy_stream is None or self._copy_stream.device != device:
            self._copy_stream = torch.cuda.Stream(device)
        ready = torch.cuda.Event()
        ready.record(stream)
        t0 = time.perf_counter()
        # The copies to shm run on a side stream, concurrently with rank 0's own heads on the caller's stream.
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            staged = self._stage(buf, slices, True)
        local_start, local_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        local_start.record(stream)
        out[:, :bounds[1]].copy_(attn_ops.attend(slices[0], fields))
        local_end.record(stream)
        self._copy_stream.synchronize()
        t1 = time.perf_counter()
        fut = get_coordinator().submit(self._dispatch(self._fields(buf, fields)))
        try:
            results = self._wait(fut)
        except BaseException:
            self._abandon(fut)
            stream.synchronize()
            raise
        t2 = time.perf_counter()
        returned = self._collect(buf, out, bounds, True)
        stream.synchronize()
        return {"stage_s": t1 - t0, "local_s": local_start.elapsed_time(local_end) / 1000.0,
                "return_s": time.perf_counter() - t2, "staged": staged, "returned": returned, "helpers": results}

    async def _dispatch(self, fields: list[dict]) -> list[dict]:
        await self.pool.start()  # a helper that died since the last call restarts the pool (helpers hold no state)
        return await self.pool.all("attn_call", fields, self.call_timeout_s)

    def _wait(self, fut: "cf.Future[list[dict]]") -> list[dict]:
        try:
            return fut.result(timeout=self.call_timeout_s + 5.0)
        except cf.TimeoutError:
            raise AttentionParallelError(f"attention helpers on {','.join(self.devices[1:])} did not answer within "
                                         f"{self.call_timeout_s:g} s; every helper was aborted") from None
        except WorkerError as exc:
            raise AttentionParallelError(f"attention helper failed: {exc}") from exc

    def _abandon(self, fut: "cf.Future[Any]") -> None:
        if not fut.done():
            self.pool.abort()
            get_coordinator().cancel(fut, wait=2.0)

    # -- buffers ----------------------------------------------------------------------------------------------------
    def _buffers_for(self, pq: Any, bounds: list[int], device: torch.device) -> _Buffers:
        shapes = [{name: (t.dtype, tuple(t.shape)) for name, t in attn_ops.head_slice(pq, bounds[r], bounds[r + 1])
                   .items()} for r in range(1, len(self.devices))]
        b, _, sq, _ = pq.q.shape
        outs = [(pq.input_dtype, (b, bounds[r + 1] - bounds[r], sq, int(pq.original_head_dim)))
                for r in range(1, len(self.devices))]
        key = (repr(shapes), repr(outs), str(device))
        if self._buffers is not None and self._buffers.key == key:
            return self._buffers
        self._drop_buffers()
        inputs = Segment.create(sum(_slot(dt, shp) for s in shapes for dt, shp in s.values()), "attn_in")
        try:
            outputs = Segment.create(sum(_slot(dt, shp) for dt, shp in outs), "attn_out")
        except BaseException:
            inputs.close()
            inputs.unlink()
            raise
        buf = _Buffers(key, inputs, outputs, [], [])
        try:
            a_in, a_out = Arena(inputs), Arena(outputs)
            buf.in_descs = [{name: a_in.alloc(dtype_name(dt), shp) for name, (dt, shp) in s.items()} for s in shapes]
            buf.out_descs = [a_out.alloc(dtype_name(dt), shp) for dt, shp in outs]
            if device.type == "cuda":
                register_cuda(inputs, str(device))
                register_cuda(outputs, str(device))
        except BaseException:
            buf.close()
            raise
        self._buffers = buf
        return buf

    def _drop_buffers(self) -> None:
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None

    # -- records, status, release -------------------------------------------------------------------------------------
    def _record(self, result: dict, bounds: list[int], tokens: int, heads: int, wall: float) -> None:
        ranks = [{"rank": 0, "device": self.devices[0], "heads": [bounds[0], bounds[1]], "compute_s": result["local_s"],
                  "h2d_s": 0.0, "d2h_s": 0.0, "wall_s": result["local_s"], "vram_peak_bytes": None}]
        for r, res in enumerate(result["helpers"], start=1):
            ranks.append({"rank": r, "device": self.devices[r], "heads": [bounds[r], bounds[r + 1]],
                          **{k: float(res[k]) for k in ("compute_s", "h2d_s", "d2h_s", "wall_s")},
                          "vram_peak_bytes": res.get("vram_peak_bytes")})
        moved = result["staged"] + result["returned"]
        transfer_s = result["stage_s"] + result["return_s"]
        rec = {"at": now_iso(), "call": self._calls, "tokens": tokens, "heads": heads, "transport": self.transport,
               "wall_s": wall, "stage_s": result["stage_s"], "return_s": result["return_s"], "moved_bytes": moved,
               "staged_bytes": result["staged"], "returned_bytes": result["returned"],
               "gb_per_s": moved / transfer_s / 1e9 if transfer_s > 0 else None, "ranks": ranks}
        self._recent.append(rec)
        log.debug("call %d: %d tokens x %d heads on %s in %.1f ms (%d MB moved)", self._calls, tokens, heads,
                  ",".join(self.devices), wall * 1e3, moved // 1_000_000)

    def recent_calls(self) -> list[dict]:
        """The last calls' records (oldest first): per device its heads and compute / copy seconds."""
        return list(self._recent)

    def snapshot(self) -> dict:
        """This engine for the status route: devices, shares, helpers (worker rows), call count, recent calls."""
        return {"devices": list(self.devices), "shares": list(self.shares) if self.shares else None,
                "transport": self.transport, "running": self._running, "calls": self._calls,
                "helpers": self.pool.snapshot(), "recent_calls": self.recent_calls()[-8:]}

    def release(self) -> None:
        """Stop the helpers and unlink the segments."""
        with self._lock:
            self._drop_buffers()
            if self.pool.running:
                get_coordinator().run(self.pool.release(force=True), 60.0, "releasing attention helpers")


def _slot(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes an :class:`Arena` takes for one tensor (4 KiB aligned)."""
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return -(-max(n, 1) // 4096) * 4096


# -- engine registry ------------------------------------------------------------------------------------------------
_ENGINES: dict[tuple, AttentionParallelEngine] = {}
_ENGINES_LOCK = threading.Lock()
_LIVE: "weakref.WeakSet[AttentionParallelEngine]" = weakref.WeakSet()


def get_engine(devices: Sequence[str], shares: Sequence[float] | None = None) -> AttentionParallelEngine:
    """The engine for these devices and shares (made once; helpers start on the first call).  Engines for other
    device lists are released first: their helpers hold GPU memory."""
    key = (tuple(devices), tuple(shares) if shares else None)
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            for old in list(_ENGINES):
                _ENGINES.pop(old).release()
            eng = _ENGINES[key] = AttentionParallelEngine(devices, shares)
        return eng


def release_all_engines() -> int:
    """Release every engine made by :func:`get_engine`; returns how many there were."""
    with _ENGINES_LOCK:
        items = list(_ENGINES.values())
        _ENGINES.clear()
    for eng in items:
        eng.release()
    return len(items)


def live_engines() -> list[AttentionParallelEngine]:
    """Every engine alive in this process (also ones made directly)."""
    return list(_LIVE)


_STATUS_REGISTERED = False


def _register_status() -> None:
    global _STATUS_REGISTERED
    if _STATUS_REGISTERED:
        return
    hub = get_hub()
    hub.register_provider("attention", lambda: {"engines": [e.snapshot() for e in live_engines()]})
    hub.add_busy_source(lambda: any(e.running for e in live_engines()))
    _STATUS_REGISTERED = True


atexit.register(release_all_engines)
