"""CUDA specifics of a rank: weight residency and prefetch, and the exchange's copies on their own
streams.

Weights.  The shared-memory weight store is mapped once per worker and registered with CUDA as
pinned host memory (``WorkerContext.segment``), so host->device copies from it run at full PCIe/C2C
speed.  At the first step (when the sequence length, and so the working set, is known) the rank
decides how many leading blocks stay resident in VRAM: ``resident`` = all, ``stream`` = none,
``auto`` = as many as fit in the rank's share of free VRAM (ranks on the same GPU split it) minus
the step's working set minus a reserve (``H3MS_VRAM_RESERVE_GB``, default 2)
(:func:`auto_resident_blocks`); before each later ``auto`` step it checks that the room is still
there (other processes on the GPU, ComfyUI's above all, take VRAM after the choice) and streams its
last resident blocks where it is not (:func:`resident_blocks_that_still_fit`).  The rest stream
through two device slots: while block i computes,
block i+1 is copied into the other slot on a side stream; the compute stream waits on the slot's
"loaded" event, the side stream on the "freed" event the compute stream recorded after the slot's
previous block.

Exchange copies.  A D2H copy of outgoing rows runs on a dedicated stream and the host waits for that
copy's event only (the exchange may publish the rows only once they are in shared memory); H2D
copies of incoming rows run on a second stream and are not waited for by the host: the compute
stream waits on that stream after the op.  Before each op the host waits for the compute that
produced the op's input (one event), which is what a rank would do anyway before it can publish, and
it makes the compute / copy / wait split of the timings exact.  The argument why arena memory may be
reused despite asynchronous H2D reads: every publish synchronises a D2H copy that, in stream order,
follows all H2D copies of earlier ops (the D2H stream waits on the compute stream, which waited on
the H2D stream), and each op starts by waiting for the previous op's H2D copies (``_reads_done``),
so a rank never signals progress while one of its reads of an arena region is still in flight.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from workers.dit import ops as dit_ops
from workers.dit.block_clock import CudaBlockClock
from workers.dit.protocol import DitLoad
from workers.dit.weights import BlockView, check_names
from workers.runtime import config
from workers.runtime.handlers import WorkerContext, WorkerUnusable
from workers.transports.exchange import (
    AttendFn,
    ExchangeBase,
    ExchangeTimeout,
    ProduceFn,
    RowsFn,
    RowsProduceFn,
)
from workers.transports.host import HostExchange

if TYPE_CHECKING:
    from workers.transports.dist import DistExchange

GIB = 1 << 30
_T = TypeVar("_T")
#: Ops a rank's host may run ahead of its GPU where the copies are ordered by CUDA IPC events:
#: enough to keep the GPU's queue full across an exchange, few enough that an abort stops a step
#: within about a block and that a failed step's queued work drains as fast.
AHEAD_OPS = 2


def _queued() -> None:
    """The wait for a copy whose peers wait for it on the GPU (CUDA IPC events): none here."""


class StreamTimer:
    """Copy durations measured with CUDA events on the copy streams, read once per step."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, what: str, stream: torch.cuda.Stream) -> tuple:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        return what, a, b

    def stop(self, token: tuple, stream: torch.cuda.Stream) -> None:
        token[2].record(stream)
        self.pairs.append(token)

    def collect(self) -> dict[str, float]:
        """Seconds per copy kind since the last collect (synchronises the recorded events)."""
        out: dict[str, float] = {}
        for what, a, b in self.pairs:
            b.synchronize()
            out[what] = out.get(what, 0.0) + a.elapsed_time(b) / 1000.0
        self.pairs.clear()
        return out


def auto_resident_blocks(
    n: int, block_bytes: int, free: int, working_set: int, reserve: int, sharing: int = 1
) -> int:
    """How many of ``n`` leading blocks ``vram_residency auto`` keeps in VRAM: as many as fit in
    this rank's part of the free memory (``free`` split evenly among the ``sharing`` ranks on the
    same GPU, which measure it at the same time) after the step's working set and the reserve. All
    of them when all fit; otherwise two streaming slots are set aside first."""
    budget = free // max(1, sharing) - working_set - reserve
    if budget >= n * block_bytes:
        return n
    return max(0, min(n, (budget - 2 * block_bytes) // max(1, block_bytes)))


def resident_blocks_that_still_fit(
    k: int,
    n: int,
    block_bytes: int,
    free: int,
    cached: int,
    working_set: int,
    reserve: int,
    sharing: int = 1,
) -> int:
    """Of the ``k`` (of ``n``) blocks ``vram_residency auto`` keeps in VRAM, how many stay for the
    step about to run, once other processes on the GPU took memory after the choice (ComfyUI's own
    weights and casts grow while the store fills).  All ``k`` while this rank's share of the free
    memory (``free`` split among the ``sharing`` ranks on the GPU) plus what its own allocator holds
    unused (``cached``) still covers the step's working set and the reserve; otherwise the last ones
    go until it does, with room for the two streaming slots when all ``n`` were resident (they
    have none yet)."""
    room = free // max(1, sharing) + cached - working_set - reserve
    if room >= 0:
        return k
    slots = 2 * block_bytes if k == n else 0
    drop = -(-(slots - room) // max(1, block_bytes))
    return max(0, k - drop)


class CudaWeights:
    """Block weights of one CUDA rank (a ``workers.dit.weights.WeightProvider``): the leading blocks
    resident in VRAM, the rest streamed from the pinned store through two slots prefetched on a side
    stream.  Which blocks stay is decided at the load when it names the first step (``DitLoad``'s
    residency and tokens: each resident block is uploaded as soon as it is placed, beside the
    store's fill), else at the first step."""

    def __init__(self, ctx: WorkerContext, msg: DitLoad) -> None:
        self.device = torch.device(ctx.device)
        self.config = msg.config
        self.heads = tuple(int(v) for v in msg.heads)
        self.residency: str | None = None  # chosen per step (dit_step's "residency")
        self.log = ctx.log
        self.rank = ctx.rank
        # each block's segment is pinned once it is complete (place): pinned before, the pages
        # the store's writers have not written yet would be allocated, and zeroed, in this rank
        self._ctx = ctx
        self.host = [
            {name: ctx.segment(d.seg, register=False).tensor(d) for name, d in entry.items()}
            for entry in msg.manifest
        ]
        self._segments = [sorted({d.seg for d in entry.values()}) for entry in msg.manifest]
        # each block's int8 settings, read from the store once the block is complete (place)
        self.quant: list[dict[str, dit_ops.QuantInfo]] = []
        g0, g1 = (int(v) for v in msg.qkv_heads or msg.heads)
        rows = dit_ops.head_rows(g0, g1, self.config["heads"], self.config["head_dim"])
        self._qkv_rows = [(r.start, r.stop) for r in rows]
        self.block_bytes = sum(self._device_bytes(n, t) for n, t in self.host[0].items())
        self.nbytes = self.block_bytes * len(self.host)
        self.n_resident: int | None = None
        self.resident: list[dict[str, torch.Tensor]] = []
        self.slots: list[dict[str, torch.Tensor]] = []
        self.slot_block = [-1, -1]
        self.side = torch.cuda.Stream(self.device)
        self.loaded = [torch.cuda.Event(), torch.cuda.Event()]
        self.freed: list[torch.cuda.Event | None] = [None, None]
        self.fetch_s = 0.0
        self.timer_events = StreamTimer()
        self.step_uploads = 0  # blocks the running step uploaded to VRAM before its first block
        if msg.residency is not None and msg.tokens is not None:
            self._decide(*msg.tokens, msg.residency)

    def place(self, i: int) -> None:
        if i != len(self.quant):
            raise ValueError(
                f"block {i} placed after {len(self.quant)} blocks; place them in order"
            )
        for name in self._segments[i]:
            self._ctx.segment(name)
        self.quant.append(dit_ops.block_quant(self.host[i]))
        if self.n_resident is not None and i < self.n_resident:
            self.resident.append(self._to_device(i))
            if i + 1 == self.n_resident:
                torch.cuda.synchronize(self.device)  # the load ends with its uploads done

    # -- sizes -------------------------------------------------------------------------------------
    def _device_bytes(self, name: str, t: torch.Tensor) -> int:
        if (
            name in ("attn.qkv_proj.weight", "attn.qkv_proj.weight_scale")
            and t.dim() >= 1
            and t.numel() > 1
        ):
            rows = sum(b - a for a, b in self._qkv_rows)
            return rows * (t.numel() // t.shape[0]) * t.element_size()
        return t.numel() * t.element_size()

    def working_set_bytes(self, tokens: int, local_tokens: int) -> int:
        """A generous estimate of one step's activations on this rank (bf16/fp32 model dtype)."""
        c = self.config
        e = 4 if self.host[0]["norm1.weight"].dtype == torch.float32 else 2
        h_local = self.heads[1] - self.heads[0]
        hid, hd = c["hidden"], c["head_dim"]
        ffn = self.host[0]["mlp.fc2.weight"].shape[1]
        full = tokens * (hid + 3 * h_local * hd + 2 * h_local * hd) * e
        local = local_tokens * (4 * hid + c["heads"] * hd + 3 * ffn) * e
        return int(1.25 * (full + local))

    # -- residency ---------------------------------------------------------------------------------
    def prepare(self, tokens: int, local_tokens: int, residency: str) -> None:
        """Decide how many blocks stay resident and upload them, and allocate the two streaming
        slots: at the first step unless the load did, and whenever the step asks for another
        residency (the store and the process stay)."""
        if self.n_resident is not None and residency == self.residency:
            if residency == "auto":
                self._shed(tokens, local_tokens)
            return
        self._decide(tokens, local_tokens, residency)
        for i in range(self.n_resident or 0):
            self.resident.append(self._to_device(i))
        self.step_uploads = self.n_resident or 0
        torch.cuda.synchronize(self.device)

    def _decide(self, tokens: int, local_tokens: int, residency: str) -> None:
        """How many blocks stay resident for this residency (none uploaded yet), the streaming
        slots allocated; logged."""
        self.resident.clear()
        self.slots.clear()
        self.slot_block = [-1, -1]
        self.freed = [None, None]
        n = len(self.host)
        why = residency
        if residency == "resident":
            k = n
        elif residency == "stream":
            k = 0
        else:
            free, _ = torch.cuda.mem_get_info(self.device)
            reserve, sharing = self._reserve_and_sharing()
            k = auto_resident_blocks(
                n,
                self.block_bytes,
                free,
                self.working_set_bytes(tokens, local_tokens),
                reserve,
                sharing,
            )
            why = (
                f"auto: {free / GIB:.1f} GiB free, shared by {sharing} rank(s) on {self.device}, "
                f"{self.block_bytes / GIB:.2f} GiB per block, {reserve / GIB:.1f} GiB reserve "
                "(H3MS_VRAM_RESERVE_GB)"
            )
        if k < n:
            self.slots = [self._empty_like_block(), self._empty_like_block()]
        self.n_resident = k
        self.residency = residency
        self.log.info(
            "[dit] rank %d: loaded (%d of %d blocks resident in VRAM, %d streamed with prefetch, "
            "heads %s; %s)",
            self.rank,
            k,
            n,
            n - k,
            list(self.heads),
            why,
        )

    def _reserve_and_sharing(self) -> tuple[int, int]:
        """The VRAM reserve (``H3MS_VRAM_RESERVE_GB``) and how many ranks share this GPU."""
        sharing = [str(d) for d in self.config.get("devices") or []].count(str(self.device))
        return int(config.VRAM_RESERVE_GB.get() * GIB), max(1, sharing)

    def _shed(self, tokens: int, local_tokens: int) -> None:
        """Before an ``auto`` step: stream the last resident blocks where the GPU no longer has
        room for the step beside them (:func:`resident_blocks_that_still_fit`), rather than run
        out of memory in the middle of it.  The same bytes, so the same results."""
        k = self._n_resident
        if k == 0:
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        reserve, sharing = self._reserve_and_sharing()
        n = len(self.host)
        keep = resident_blocks_that_still_fit(
            k,
            n,
            self.block_bytes,
            free,
            cached,
            self.working_set_bytes(tokens, local_tokens),
            reserve,
            sharing,
        )
        if keep == k:
            return
        del self.resident[keep:]
        self.n_resident = keep
        if not self.slots:
            self.slots = [self._empty_like_block(), self._empty_like_block()]
            self.freed = [None, None]
        # a block's slot follows from the resident count: what a slot holds must be fetched again
        self.slot_block = [-1, -1]
        self.log.warning(
            "[dit] rank %d: %d of %d blocks now resident in VRAM, %d streamed: the GPU has "
            "%.1f GiB free (shared by %d rank(s)) and this rank %.1f GiB cached, less than this "
            "step needs beside %d resident blocks (another process took VRAM since the load; "
            "H3MS_VRAM_RESERVE_GB keeps more free at the load)",
            self.rank,
            keep,
            n,
            n - keep,
            free / GIB,
            sharing,
            cached / GIB,
            k,
        )

    def _empty_like_block(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.host[0].items():
            shape = list(t.shape)
            if name in ("attn.qkv_proj.weight", "attn.qkv_proj.weight_scale") and t.numel() > 1:
                shape[0] = sum(b - a for a, b in self._qkv_rows)
            out[name] = torch.empty(shape, dtype=t.dtype, device=self.device)
        return out

    def _copy_block(self, dst: dict[str, torch.Tensor], i: int) -> None:
        self._copy_names(dst, i, self.host[i])

    def _copy_names(self, dst: dict[str, torch.Tensor], i: int, names: Iterable[str]) -> None:
        for name in names:
            src, d = self.host[i][name], dst[name]
            if name in ("attn.qkv_proj.weight", "attn.qkv_proj.weight_scale") and src.numel() > 1:
                at = 0
                for a, b in self._qkv_rows:
                    # the head group's q, k and v rows, packed as in the full weight
                    d[at : at + b - a].copy_(src[a:b], non_blocking=True)
                    at += b - a
            else:
                d.copy_(src, non_blocking=True)

    def _to_device(self, i: int) -> dict[str, torch.Tensor]:
        dst = self._empty_like_block()
        self._copy_block(dst, i)
        return dst

    @property
    def _n_resident(self) -> int:
        """Blocks resident in VRAM; the rank calls :meth:`prepare` before a step's first block."""
        if self.n_resident is None:
            raise RuntimeError("CudaWeights.prepare() must run before the first block")
        return self.n_resident

    def _fetch(self, i: int) -> None:
        slot = (i - self._n_resident) % 2
        if self.slot_block[slot] == i:
            return
        t = time.perf_counter()
        with torch.cuda.stream(self.side):
            freed = self.freed[slot]
            if freed is not None:
                self.side.wait_event(freed)
            tok = self.timer_events.start("prefetch", self.side)
            self._copy_block(self.slots[slot], i)
            self.timer_events.stop(tok, self.side)
            self.loaded[slot].record(self.side)
        self.slot_block[slot] = i
        self.fetch_s += time.perf_counter() - t

    # -- the weight provider protocol (workers.dit.weights) ----------------------------------------
    def refresh(self, blocks: Sequence[tuple[int, Sequence[str]]]) -> int:
        """Copy the named tensors of resident blocks into VRAM again and read a block's int8
        settings again where its tags changed; a streaming slot holding such a block is fetched
        again (streamed blocks come from the store at each step anyway)."""
        copied = 0
        for i, names in blocks:
            if i >= len(self.quant):
                raise ValueError(f"refresh of block {i}: only {len(self.quant)} blocks placed")
            check_names(i, self.host[i], names)
            if any(n.endswith(".comfy_quant") for n in names):
                self.quant[i] = dit_ops.block_quant(self.host[i])
            if i < len(self.resident):
                self._copy_names(self.resident[i], i, names)
                copied += sum(self._device_bytes(n, self.host[i][n]) for n in names)
            self.slot_block = [-1 if b == i else b for b in self.slot_block]
        torch.cuda.synchronize(self.device)
        return copied

    def block(self, i: int) -> BlockView:
        nxt = self._n_resident
        if i < nxt:
            if i == nxt - 1 and nxt < len(self.host):
                # the first streamed block loads while the last resident one computes
                self._fetch(nxt)
            return self._view(i, self.resident[i])
        self._fetch(i)
        slot = (i - nxt) % 2
        torch.cuda.current_stream(self.device).wait_event(self.loaded[slot])
        if i + 1 < len(self.host):
            self._fetch(i + 1)
        return self._view(i, self.slots[slot])

    def ahead(self, i: int) -> BlockView:
        """Block ``i`` without the prefetch of block ``i + 1``, whose slot still holds block
        ``i - 1`` (in use until its ``done``); ``block(i)`` issues that prefetch later."""
        nxt = self._n_resident
        if i < nxt:
            return self._view(i, self.resident[i])
        self._fetch(i)
        slot = (i - nxt) % 2
        torch.cuda.current_stream(self.device).wait_event(self.loaded[slot])
        return self._view(i, self.slots[slot])

    def _view(self, i: int, b: dict[str, torch.Tensor]) -> BlockView:
        w = b["attn.qkv_proj.weight"]  # already the head group's rows (_copy_block)
        return BlockView(
            b, w, b.get("attn.qkv_proj.weight_scale") if dit_ops.is_int8(w) else None, self.quant[i]
        )

    def done(self, i: int) -> None:
        if i >= self._n_resident:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.freed[(i - self._n_resident) % 2] = ev

    def timer(self) -> dict:
        """Residency summary and prefetch timings of the step just run (``uploaded_blocks``: the
        resident blocks it uploaded first, 0 when the load had placed them)."""
        copies = self.timer_events.collect()
        uploads, self.step_uploads = self.step_uploads, 0
        return {
            "resident_blocks": self.n_resident or 0,
            "uploaded_blocks": uploads,
            "streamed_blocks": len(self.host) - (self.n_resident or 0),
            "block_bytes": self.block_bytes,
            "prefetch_copy_s": copies.get("prefetch", 0.0),
            "prefetch_issue_s": self.fetch_s,
        }

    def close(self) -> None:
        self.resident.clear()
        self.slots.clear()
        self.host.clear()


class CudaExchange(ExchangeBase):
    """Wraps a HostExchange or DistExchange for a CUDA rank: copy streams, compute/copy/wait
    accounting.  Results are allocated on ``device``; each op is the wrapped exchange's into
    them.  ``clock`` gets each op's window on the compute stream, the compute queued inside it and
    every copy's events (a collective's time outside that compute is its copy), for the per-block
    timings."""

    def __init__(self, device: torch.device, host: bool, synced: bool = True) -> None:
        self.inner: HostExchange | DistExchange | None = None
        self.device = device
        self.host = host
        #: False: the wrapped exchange orders its copies by CUDA IPC events (``CudaIpcExchange``'s
        #: ``event_streams``), so nothing here waits for the GPU on the host
        self.synced = synced
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.timer = StreamTimer()
        self.clock = CudaBlockClock(device)
        self._reads: torch.cuda.Event | None = None
        self._started: collections.deque[torch.cuda.Event] = collections.deque()
        self.compute_wait_s = 0.0
        self.sync_s = 0.0

    @classmethod
    def over_host(
        cls,
        device: torch.device,
        *args: Any,
        exchange: type[HostExchange] = HostExchange,
        events: bool = False,
        **kwargs: Any,
    ) -> CudaExchange:
        """A host exchange (``exchange(*args, **kwargs)``: ``HostExchange`` or the GPU-direct
        ``workers.transports.cuda_ipc.CudaIpcExchange``, whose "arena" copies move device memory)
        moving this device's tensors through the copy streams; ``events``: the GPU-direct
        exchange ordered by CUDA IPC events on these streams (``IpcSync.EVENTS``)."""
        wrap = cls(device, host=True, synced=not events)
        if events:
            kwargs["event_streams"] = (wrap.d2h, wrap.h2d)
        inner = exchange(
            *args,
            **kwargs,
            to_host=wrap.to_host,
            to_device=wrap.to_device,
            to_host_async=wrap.to_host_async,
        )
        return wrap.bind(inner)

    def bind(self, inner: HostExchange | DistExchange) -> CudaExchange:
        """Wrap ``inner`` (built with ``to_host=self.to_host, to_device=self.to_device`` for the
        host exchange)."""
        self.inner = inner
        self.rank, self.layout = inner.rank, inner.layout
        return self

    @property
    def _inner(self) -> HostExchange | DistExchange:
        if self.inner is None:
            raise RuntimeError("CudaExchange.bind() must run before the exchange is used")
        return self.inner

    def _copy(
        self, what: str, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor
    ) -> torch.cuda.Event:
        """``dst.copy_(src)`` queued on ``stream``, timed for the step's stats and the clock; the
        event that ends it."""
        with torch.cuda.stream(stream):
            tok = self.timer.start(what, stream)
            dst.copy_(src, non_blocking=True)
            self.timer.stop(tok, stream)
        self.clock.copy(tok[1], tok[2])
        return tok[2]

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        done = self._copy("d2h", self.d2h, dst, src)
        if self.synced:
            done.synchronize()
        else:
            src.record_stream(self.d2h)  # its memory is not reused before the queued copy ran

    def to_host_async(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        """Start a D2H copy of ``src`` (computed on the current stream) on the D2H stream; returns
        the wait for it, so the compute stream goes on with the next head piece meanwhile (no wait
        when the exchange orders its copies by events)."""
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        done = self._copy("d2h", self.d2h, dst, src)
        src.record_stream(self.d2h)
        return done.synchronize if self.synced else _queued

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy("h2d", self.h2d, dst, src)

    def _moved(self, op: Callable[[torch.cuda.Stream], torch.Tensor]) -> torch.Tensor:
        """Run the wrapped op ``op(compute_stream)`` between the waits for its input and for its
        result's copies."""
        cur = torch.cuda.current_stream(self.device)
        t = time.perf_counter()
        ev = self.clock.event(cur)
        if self.synced:
            ev.synchronize()  # the op's input is computed: from here on the rank only moves data
            if self._reads is not None:
                self._reads.synchronize()  # the previous op's H2D reads of the arena are complete
        else:
            self._started.append(ev)
            if len(self._started) > AHEAD_OPS:
                inner = self._inner
                assert isinstance(inner, HostExchange)  # events: the GPU-direct exchange
                oldest = self._started.popleft()
                self._await(
                    [oldest], inner.deadline_s, f"{AHEAD_OPS} ops ahead of its GPU", aborts=True
                )
        self.compute_wait_s += time.perf_counter() - t
        self.d2h.wait_stream(cur)
        self.h2d.wait_stream(cur)
        out = op(cur)
        if self.host:
            if self.synced:
                self._reads = torch.cuda.Event()
                self._reads.record(self.h2d)
            cur.wait_stream(self.h2d)
            self.clock.window(ev, self.clock.event(cur))
        else:
            t = time.perf_counter()
            end = self.clock.event(cur)
            end.synchronize()
            self.sync_s += time.perf_counter() - t
            self.clock.window(ev, end, collective=True)
        return out

    def _busy(self, queue: Callable[[], _T]) -> _T:
        """``queue()``, compute an op queues on the compute stream inside its window, bracketed by
        events for the clock."""
        a = self.clock.event()
        out = queue()
        self.clock.busy(a, self.clock.event())
        return out

    def _result(self, kind: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """An op's result on this device (the H2D stream writes into it)."""
        out = torch.empty(shape, dtype=self.layout.torch_dtype, device=self.device)
        out.record_stream(self.h2d)
        return out

    def begin(self, abort_generation: int) -> None:
        self._started.clear()
        self._inner.begin(abort_generation)

    def _all_gather_rows(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        return self._moved(lambda cur: self._inner.all_gather_rows(local, n, out=out))

    def _all_to_all_cols(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        return self._moved(lambda cur: self._inner.all_to_all_cols(local, n, out=out))

    def _all_to_all_qkv(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        return self._moved(lambda cur: self._inner.all_to_all_qkv(local, n, out=out))

    def _all_gather_rows_each(
        self, local: torch.Tensor, on_rows: RowsFn, out: torch.Tensor
    ) -> torch.Tensor:
        def run(cur: torch.cuda.Stream) -> torch.Tensor:
            def each(a: int, b: int, rows: torch.Tensor) -> None:
                cur.wait_stream(self.h2d)  # these rows' copy in was queued before this call
                self._busy(lambda: on_rows(a, b, rows))

            return self._inner.all_gather_rows_each(local, each, out=out)

        return self._moved(run)

    def _all_to_all_qkv_attend(
        self, local: torch.Tensor, n: int, attend: AttendFn, out: torch.Tensor
    ) -> torch.Tensor:
        def run(cur: torch.cuda.Stream) -> torch.Tensor:
            def each(a: int, b: int, qkv: torch.Tensor) -> torch.Tensor:
                cur.wait_stream(self.h2d)  # this piece's copies in were queued before this call
                return self._busy(lambda: attend(a, b, qkv))

            return self._inner.all_to_all_qkv_attend(local, n, each, out=out)

        return self._moved(run)

    def _all_to_all_heads(self, produce: ProduceFn, n: int, out: torch.Tensor) -> torch.Tensor:
        def timed(a: int, b: int) -> torch.Tensor:
            return self._busy(lambda: produce(a, b))

        return self._moved(lambda cur: self._inner.all_to_all_heads(timed, n, out=out))

    def _all_gather_rows_produced(
        self, produce: RowsProduceFn, n: int, out: torch.Tensor
    ) -> torch.Tensor:
        def timed(a: int, b: int) -> torch.Tensor:
            return self._busy(lambda: produce(a, b))

        return self._moved(lambda cur: self._inner.all_gather_rows_produced(timed, n, out=out))

    def drain(self, deadline_s: float, what: str) -> None:
        """Wait for the work queued on the compute and copy streams, polling events: where the
        copies are ordered by CUDA IPC events the queues may wait on an event of a peer that died,
        which never comes, so past ``deadline_s`` the worker must not serve again
        (``WorkerUnusable``, naming ``what``).  An abort does not end it: queued work runs on."""
        done = []
        for stream in (torch.cuda.current_stream(self.device), self.d2h, self.h2d):
            ev = torch.cuda.Event()
            ev.record(stream)
            done.append(ev)
        try:
            self._await(done, deadline_s, what, aborts=False)
        except ExchangeTimeout as exc:
            raise WorkerUnusable(
                f"{exc}; its GPU queue still waits on a peer's CUDA IPC event, so this worker "
                "stops and the pool starts a fresh one"
            ) from exc

    def _await(
        self, events: Sequence[torch.cuda.Event], deadline_s: float, what: str, aborts: bool
    ) -> None:
        """Poll ``events`` until done: ``ExchangeTimeout`` after ``deadline_s``, and with
        ``aborts`` ``ExchangeAborted`` once the pool aborted the job."""
        end = time.monotonic() + deadline_s
        pause = 1e-4
        while not all(ev.query() for ev in events):
            if aborts:
                self._inner.check_abort(what)
            if time.monotonic() > end:
                raise ExchangeTimeout(
                    f"rank {self.rank}: {what}: the GPU did not get there within "
                    f"{deadline_s:g}s, waiting on a peer's CUDA IPC event; a rank died or stalled "
                    "- see its worker log"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.005)

    def counters(self) -> tuple[float, float]:
        """The wrapped exchange's host-clock counters (the GPU copy times come with
        :meth:`stats`)."""
        return self._inner.counters()

    def reset_stats(self) -> None:
        self._inner.reset_stats()
        self.timer.collect()
        self.compute_wait_s = 0.0
        self.sync_s = 0.0

    def stats(self) -> dict:
        s = dict(self._inner.stats())
        copies = self.timer.collect()
        s["d2h_gpu_s"] = copies.get("d2h", 0.0)
        s["h2d_gpu_s"] = copies.get("h2d", 0.0)
        if not self.host:
            # a collective's host time is only its launch; its GPU time shows at the sync
            s["wait_s"] = float(s.get("wait_s", 0.0)) + self.sync_s
        s["compute_wait_s"] = self.compute_wait_s
        return s

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
