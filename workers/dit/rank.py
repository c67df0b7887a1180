"""What one rank executes for the transformer split: its weights (views of the shared-memory weight
store, or VRAM copies of them) and a step: the block loop of ``workers.dit.loop`` on its token range
and head group, with the per-block all-gather and all-to-all through the step's exchange.

This module picks the loop's two parameters per device and transport: the weight provider
(``CpuWeights`` over the store, ``workers.dit.cuda.CudaWeights``) and the exchange
(``workers.transports``, wrapped in ``workers.dit.cuda.CudaExchange`` on a CUDA rank).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit import protocol as dit_protocol
from workers.dit import sparse as dit_sparse
from workers.dit.block_clock import BlockClock, CudaBlockClock
from workers.dit.cuda import CudaExchange, CudaWeights
from workers.dit.loop import BlockInputs, LoopHooks, LoopPaths, RankBlocks, run_blocks
from workers.dit.protocol import IpcSync, Transport
from workers.dit.weights import CpuWeights, WeightProvider
from workers.runtime import comfy_host, config
from workers.runtime.fill_progress import FillProgress
from workers.runtime.handlers import WorkerContext, WorkerUnusable, handler, on_release
from workers.runtime.protocol import Dropped, Released, TensorDesc
from workers.transports.arena import ArenaLayout
from workers.transports.cuda_ipc import CudaIpcExchange
from workers.transports.exchange import Exchange, ExchangeAborted, NoExchange
from workers.transports.host import HostExchange

T = TypeVar("T")

_STATE = "dit"
#: The transports whose exchange runs over a step's shm arena (kept per arena).
_ARENA_TRANSPORTS = (Transport.HOST, Transport.CUDA_IPC)

#: The ComfyUI this worker was started from (None: standalone). Importing its attention module
#: applies ComfyUI's own comfy-kitchen backend policy; standalone workers apply the pack's copy of
#: it.
_HOST = comfy_host.ComfyHost.from_env()
if _HOST is None:
    dit_ops.apply_kitchen_policy()
_ATTEND: dict[str, dit_ops.Attend] = {}

#: The test hooks' modulation fault (``H3MS_TEST_HOOKS=1``, read once at import): the step's adaLN
#: rows as this rank uses them, moved on purpose; None in production.
MODULATION_FAULT: Callable[[torch.Tensor], torch.Tensor] | None = None
if config.TEST_HOOKS.get():
    from workers.testing.faults import modulation_fault_from_env

    MODULATION_FAULT = modulation_fault_from_env()


def _attend(name: str) -> dit_ops.Attend:
    """The attention function ``dit_load`` names: ``comfy`` = the parent ComfyUI's selected one,
    else a builtin."""
    fn = _ATTEND.get(name)
    if fn is None:
        if name == "comfy":
            if _HOST is None:
                raise RuntimeError(
                    f"attention 'comfy' needs the parent ComfyUI in {comfy_host.ENV}; the worker "
                    "was started without it"
                )
            fn = comfy_host.comfy_attend(_HOST)
        else:
            fn = dit_ops.builtin_attend(name)
        _ATTEND[name] = fn
    return fn


@dataclass
class RankWeights:
    """This rank's loaded weights: which store and head group they came from, and the provider the
    loop reads."""

    key: str
    store: str
    config: dict
    heads: tuple[int, int]
    provider: WeightProvider
    qkv_heads: tuple[int, int] | None = None
    #: the store's segments this rank maps (its progress word's and its blocks')
    segments: frozenset[str] = frozenset()


def _store_segments(msg: dit_protocol.DitLoad) -> frozenset[str]:
    return frozenset({msg.store, *(d.seg for entry in msg.manifest for d in entry.values())})


@dataclass
class RankState:
    weights: RankWeights | None = None
    exchanges: dict[tuple, Exchange] = field(default_factory=dict)
    #: the process group's backend (nccl or gloo) once a collective step made one
    dist_backend: Transport | None = None
    #: sparse attention's statistics carried from step to step (dropped at sampling end and with the
    #: weights)
    pooled: dit_sparse.PooledStats = field(default_factory=dit_sparse.PooledStats)
    #: held by a load from its start to its end, and by a release: a release sent after a load
    #: failed (the coordinator's pool answers the first rank's failure at once) is answered only
    #: once this rank's load has let go of the store too
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)


def _state(ctx: WorkerContext) -> RankState:
    st = ctx.state.get(_STATE)
    if st is None:
        st = ctx.state[_STATE] = RankState()
    return st


def _provider(ctx: WorkerContext, msg: dit_protocol.DitLoad) -> WeightProvider:
    """The rank's weight provider over the store, no block placed yet: a CUDA rank places blocks in
    VRAM per step (``CudaWeights``); a CPU rank uses zero-copy views of the store, with the head
    group's qkv rows copied once per block."""
    cfg = msg.config
    heads = msg.qkv_heads or msg.heads
    if ctx.device.startswith("cuda"):
        return CudaWeights(ctx, msg)
    manifest = msg.manifest
    return CpuWeights(
        lambda i: {name: ctx.segment(desc.seg).tensor(desc) for name, desc in manifest[i].items()},
        0,
        (int(heads[0]), int(heads[1])),
        cfg["heads"],
        cfg["head_dim"],
        eager=True,
    )


async def _place_blocks(
    ctx: WorkerContext, msg: dit_protocol.DitLoad, provider: WeightProvider
) -> tuple[float, float]:
    """Place every block as soon as the store's progress word says it is complete (the event loop
    waits, so a probe runs on the compute thread meanwhile); returns the ``time.monotonic()``
    stamps of the first and the last block placed."""
    progress = FillProgress(ctx.segment(msg.store), msg.progress, len(msg.manifest))
    gen = ctx.abort_generation()
    first_at = 0.0
    for i in range(len(msg.manifest)):
        await progress.wait_for(i, msg.deadline_s, lambda: ctx.abort_generation() != gen)
        await ctx.run_compute(provider.place, i)
        if i == 0:
            first_at = time.monotonic()
    return first_at, time.monotonic()


async def _warm(ctx: WorkerContext, attention: str, dtype: torch.dtype) -> dit_ops.Attend:
    """The attention function ``attention`` names, warmed up in ``dtype`` once (see
    dit_ops.warm_up) before the first step or probe that uses them."""
    attend = _attend(attention)
    lock = ctx.state.setdefault("warm_lock", asyncio.Lock())
    async with lock:  # a load and a probe may arrive together
        if ctx.state.get("warm") != (attention, dtype):
            await ctx.run_compute(dit_ops.warm_up, attend, torch.device(ctx.device), [dtype])
            ctx.state["warm"] = (attention, dtype)
    return attend


def _device(ctx: WorkerContext) -> dit_protocol.DitDevice:
    dev = torch.device(ctx.device)
    return dit_protocol.DitDevice(
        sm_count=_sm_count(ctx),
        fingerprint=invariance.fingerprint(dev),
        sparse_kernel=dit_sparse.kernel_unavailable(dev),
    )


@handler(dit_protocol.DitDescribe)
async def _dit_describe(
    ctx: WorkerContext, msg: dit_protocol.DitDescribe
) -> dit_protocol.DitDevice:
    return _device(ctx)


@handler(dit_protocol.DitLoad)
async def _dit_load(ctx: WorkerContext, msg: dit_protocol.DitLoad) -> dit_protocol.DitLoaded:
    st = _state(ctx)
    async with st.loading:
        return await _load(ctx, st, msg)


async def _load(
    ctx: WorkerContext, st: RankState, msg: dit_protocol.DitLoad
) -> dit_protocol.DitLoaded:
    if (
        st.weights is not None
        and st.weights.key == msg.key
        and list(st.weights.heads) == list(msg.heads)
        and st.weights.qkv_heads == (tuple(msg.qkv_heads) if msg.qkv_heads else None)
    ):
        return dit_protocol.DitLoaded(
            loaded=False, bytes=st.weights.provider.nbytes, device=_device(ctx)
        )
    _drop_weights(ctx, st)
    ctx.state["devices"] = msg.config.get("devices")
    await _warm(ctx, msg.config["attention"], getattr(torch, msg.config["compute_dtype"]))
    t = time.perf_counter()
    provider: WeightProvider | None = None
    try:
        provider = await ctx.run_compute(_provider, ctx, msg)
        first_at, last_at = await _place_blocks(ctx, msg, provider)
    except BaseException:
        # a fill that failed or a load given up: nothing of the store stays mapped here
        if provider is not None:
            provider.close()
        for name in _store_segments(msg):
            ctx.forget_segment(name)
        raise
    heads = (int(msg.heads[0]), int(msg.heads[1]))
    qkv_heads = (int(msg.qkv_heads[0]), int(msg.qkv_heads[1])) if msg.qkv_heads else None
    st.weights = RankWeights(
        msg.key, msg.store, msg.config, heads, provider, qkv_heads, _store_segments(msg)
    )
    seconds = time.perf_counter() - t
    ctx.log.info(
        "[dit] rank %d: weights %s mapped (%d blocks from the store, heads %s, attention %s) in "
        "%.2fs",
        ctx.rank,
        msg.key,
        len(msg.manifest),
        msg.heads,
        _HOST.attention
        if msg.config["attention"] == "comfy" and _HOST
        else msg.config["attention"],
        seconds,
    )
    return dit_protocol.DitLoaded(
        loaded=True,
        bytes=provider.nbytes,
        device=_device(ctx),
        seconds=seconds,
        first_block_at=first_at,
        last_block_at=last_at,
    )


@handler(dit_protocol.DitRefresh)
async def _dit_refresh(
    ctx: WorkerContext, msg: dit_protocol.DitRefresh
) -> dit_protocol.DitRefreshed:
    st = _state(ctx)
    async with st.loading:
        w = st.weights
        if w is None or w.store != msg.store:
            raise RuntimeError(
                f"rank {ctx.rank}: dit_refresh of store {msg.store}, but this rank holds "
                f"{w.store if w else 'no weights'}; the engine must load the ranks again"
            )
        t = time.perf_counter()
        copied = await ctx.run_compute(
            _inference, w.provider.refresh, [(int(i), tuple(names)) for i, names in msg.blocks]
        )
        w.key = msg.key
        # what a fresh load of the new weights would start with
        st.pooled.clear()
        seconds = time.perf_counter() - t
    ctx.log.info(
        "[dit] rank %d: weights %s refreshed in place (%d blocks, %d bytes copied) in %.3fs",
        ctx.rank,
        msg.key,
        len(msg.blocks),
        copied,
        seconds,
    )
    return dit_protocol.DitRefreshed(bytes=copied, seconds=seconds)


@handler(dit_protocol.DitProbe)
async def _dit_probe(ctx: WorkerContext, msg: dit_protocol.DitProbe) -> dit_protocol.ProbeReports:
    """Measure the shards (this rank's, and those of the ranks on its GPU) against the unsplit
    calls on this rank's device (``workers.dit.invariance``), in the model's compute dtype and
    with its attention function (and the sparse kernel with the settings ``msg.sparse`` names); no
    weights needed."""
    model = msg.model
    dtype = getattr(torch, model.compute_dtype)
    gen = int(msg.abort_gen)  # an interrupted step's abort ends its probe between two calls
    attend = await _warm(ctx, model.attention, dtype)

    def probe() -> list[dit_protocol.ProbeReport]:
        # on the compute thread, which goes on after an abort cancelled the request's task
        try:
            return invariance.run_probe(
                msg.ops,
                tokens=int(msg.tokens),
                shards=msg.shards,
                total_heads=int(model.heads),
                head_dim=int(model.head_dim),
                dtype=dtype,
                attend=attend,
                device=torch.device(ctx.device),
                pieces=int(msg.pieces),
                gather_ranges=[(int(a), int(b)) for a, b in msg.gather_ranges],
                eps=float(model.eps),
                sparse=msg.sparse or None,
                stopped=lambda: ctx.abort_generation() != gen,
            )
        except invariance.ProbeAborted as exc:
            ctx.log.info("[dit] rank %d: %s", ctx.rank, exc)
            raise
        finally:
            if ctx.device.startswith("cuda"):
                # the probe's random buffers and products are not the steps' working set
                torch.cuda.empty_cache()

    reports = await ctx.run_compute(probe)
    return dit_protocol.ProbeReports(reports=reports)


def _sm_count(ctx: WorkerContext) -> int | None:
    # The coordinator's exactness check needs it (dit_ops.flash_tiles_ok); CPU ranks have no SDPA
    # schedule to keep.
    if not ctx.device.startswith("cuda"):
        return None
    return torch.cuda.get_device_properties(torch.device(ctx.device)).multi_processor_count


def _drop_weights(ctx: WorkerContext, st: RankState) -> None:
    st.pooled.clear()
    if st.weights is not None:
        st.weights.provider.close()
        st.weights = None
        if ctx.device.startswith("cuda"):
            torch.cuda.empty_cache()


@handler(dit_protocol.DitRelease)
async def _dit_release(ctx: WorkerContext, msg: dit_protocol.DitRelease) -> Released:
    st = _state(ctx)
    async with st.loading:
        return await _release(ctx, st)


async def _release(ctx: WorkerContext, st: RankState) -> Released:
    segments = st.weights.segments if st.weights is not None else frozenset()
    _drop_weights(ctx, st)
    for ex in st.exchanges.values():
        ex.close()
    st.exchanges.clear()
    if st.dist_backend is not None:
        from workers.transports.dist import destroy_group

        await ctx.run_compute(destroy_group)
        st.dist_backend = None
    for name in segments:
        ctx.forget_segment(name)
    return Released(released=True)


@handler(dit_protocol.DitSparseReset)
async def _dit_sparse_reset(ctx: WorkerContext, msg: dit_protocol.DitSparseReset) -> Dropped:
    return Dropped(dropped=_state(ctx).pooled.clear())


@on_release
def _drop_released_arenas(ctx: WorkerContext, names: set[str]) -> None:
    # A host or GPU-direct exchange keeps its arena mapped; one over a released arena is never
    # used again.
    st = _state(ctx)
    for key in [k for k in st.exchanges if k[0] in _ARENA_TRANSPORTS and k[1] in names]:
        st.exchanges.pop(key).close()


def _exchange(ctx: WorkerContext, st: RankState, msg: dit_protocol.DitStep) -> Exchange:
    """The exchange object for this step's arena or process group (created once, reused while it
    matches)."""
    layout = ArenaLayout.from_dict(msg.layout)
    cuda = ctx.device.startswith("cuda")
    if msg.exchange is Transport.NONE:
        key0 = (Transport.NONE, tuple(layout.tokens_bounds), tuple(layout.col_bounds), layout.dtype)
        if key0 not in st.exchanges:
            st.exchanges[key0] = NoExchange(ctx.rank, layout, torch.device(ctx.device))
        return st.exchanges[key0]
    if msg.exchange in _ARENA_TRANSPORTS:
        key: tuple = (msg.exchange, msg.arena)
        ex = st.exchanges.get(key)
        if ex is None:
            for old in [k for k in st.exchanges if k[0] in _ARENA_TRANSPORTS]:
                st.exchanges.pop(old).close()
            arena = ctx.segment(msg.arena).base_tensor()
            args = (ctx.rank, ctx.world_size, arena, layout, ctx.doorbell_fds, ctx.control)
            if msg.exchange is Transport.CUDA_IPC:
                if not cuda:
                    raise ValueError(
                        f"rank {ctx.rank}: exchange cuda_ipc needs a CUDA rank, this one runs on "
                        f"{ctx.device}; use exchange host"
                    )
                ex = CudaExchange.over_host(
                    torch.device(ctx.device),
                    *args,
                    msg.deadline_s,
                    exchange=CudaIpcExchange,
                    devices=msg.peer_devices,
                    events=msg.ipc_sync is IpcSync.EVENTS,
                )
            elif cuda:
                ex = CudaExchange.over_host(torch.device(ctx.device), *args, msg.deadline_s)
            else:
                ex = HostExchange(*args, msg.deadline_s)
            st.exchanges[key] = ex
        return ex
    from workers.transports.dist import DistExchange, init_group

    if st.dist_backend is None:
        backend = msg.exchange.on(cuda)
        init_group(
            ctx.rank,
            ctx.world_size,
            backend.value,
            os.path.join(ctx.run_dir, "dist-rendezvous"),
            msg.deadline_s,
            devices=ctx.state.get("devices"),
            local_device=ctx.device,
        )
        st.dist_backend = backend
    key = (st.dist_backend, tuple(layout.tokens_bounds), tuple(layout.col_bounds), layout.dtype)
    ex = st.exchanges.get(key)
    if ex is None:
        ex = DistExchange(ctx.rank, ctx.world_size, layout, control=ctx.control)
        if cuda:
            ex = CudaExchange(torch.device(ctx.device), host=False).bind(ex)
        st.exchanges[key] = ex
    return ex


def _clock(ex: Exchange, device: torch.device) -> BlockClock | None:
    """A CUDA rank's blocks are timed by CUDA events (its exchange's clock, which also sees the
    copies); a CPU rank's by the host clock (None: the loop's default)."""
    if isinstance(ex, CudaExchange):
        return ex.clock
    return CudaBlockClock(device) if device.type == "cuda" else None


def _segments(
    ctx: WorkerContext, raw: list[tuple[int, int, int | TensorDesc]], device: torch.device
) -> list[dit_ops.ModSegment]:
    out: list[dit_ops.ModSegment] = []
    for a, b, row in raw:
        got = ctx.segment(row.seg).tensor(row).to(device) if isinstance(row, TensorDesc) else row
        out.append((int(a), int(b), got))
    return out


def _modulation(
    ctx: WorkerContext, msg: dit_protocol.DitStep, hidden: int, device: torch.device
) -> torch.Tensor:
    """The step's adaLN rows of every block on this rank's device, checked against the blocks it
    runs and the model's width (``DitStep.modulation``)."""
    desc = msg.modulation
    shape = tuple(int(v) for v in desc.shape)
    b1 = int(msg.blocks[1])
    width = dit_ops.adaln_width(hidden)
    if len(shape) != 3 or shape[0] < b1 or shape[2] != width:
        raise ValueError(
            f"dit_step modulation has shape {list(shape)}; expected [blocks >= {b1}, M, {width}] "
            "(every block's adaLN output for the step's timestep rows)"
        )
    mod = ctx.segment(desc.seg).tensor(desc).to(device)
    if MODULATION_FAULT is not None:
        mod = MODULATION_FAULT(mod)
    return mod


def _wait_for_start(start_at: float) -> float:
    """Sleep until ``start_at`` on the machine's monotonic clock (``DitStep.start_at``; 0: no
    wait), at most ``MAX_START_WAIT_S``; returns the seconds waited."""
    if not start_at:
        return 0.0
    wait = min(start_at - time.monotonic(), dit_protocol.MAX_START_WAIT_S)
    if wait <= 0:
        return 0.0
    t = time.perf_counter()
    time.sleep(wait)
    return time.perf_counter() - t  # a busy machine wakes the rank late: the wait it really had


def run_step(ctx: WorkerContext, msg: dit_protocol.DitStep) -> dit_protocol.DitStepped:
    """Every requested block on this rank's shard (runs on the compute thread).  Returns per-rank
    timings."""
    st = _state(ctx)
    w = st.weights
    if w is None:
        raise RuntimeError(
            f"rank {ctx.rank}: dit_step before dit_load; the coordinator must load weights first"
        )
    cfg = w.config
    t_start = time.perf_counter()
    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    t0, t1 = (int(v) for v in msg.tokens)
    g0, g1 = w.heads
    step_seg = ctx.segment(msg.x.seg)
    x_full = step_seg.tensor(msg.x)
    x_rows = x_full[t0:t1].to(device, non_blocking=True) if cuda else x_full[t0:t1]
    mod = _modulation(ctx, msg, int(cfg["hidden"]), device)
    rope = step_seg.tensor(msg.rope).to(device)
    segs = dit_ops.clip_segments(_segments(ctx, msg.segments, device), t0, t1)
    alloc0 = _alloc_counters(device) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    w.provider.prepare(x_full.shape[0], t1 - t0, msg.residency)
    ex = _exchange(ctx, st, msg)
    ex.reset_stats()
    gen = int(msg.abort_gen)
    ex.begin(gen)
    b0, b1 = (int(v) for v in msg.blocks)

    def check_abort(i: int) -> None:
        if ctx.abort_generation() != gen:
            raise ExchangeAborted(f"rank {ctx.rank}: step {msg.job} aborted before block {i}")

    # with events the host runs ahead of its GPU: the step's end (and a failed step) waits for it
    drain = ex.drain if isinstance(ex, CudaExchange) and not ex.synced else None
    if isinstance(ex, CudaExchange):
        ex.clock.before_read = (
            None if drain is None else functools.partial(drain, msg.deadline_s, f"step {msg.job}")
        )

    digests: dict[str, str] = {}

    def trace(i: int, op: str, out: torch.Tensor) -> None:
        digests[f"{i}:{op}"] = invariance.digest(out)

    sparse = (
        dit_sparse.sparse_step(msg.sparse, st.pooled, w.heads, msg.segments) if msg.sparse else None
    )
    try:
        rank = RankBlocks(
            w.provider,
            ex,
            g1 - g0,
            int(cfg["head_dim"]),
            float(cfg["eps"]),
            _attend(cfg["attention"]),
            _clock(ex, device),
        )
        paths = LoopPaths(
            int(msg.chunks),
            int(msg.head_pieces),
            bool(msg.gather_overlap),
            msg.pattern,
            sparse,
            gather_ahead=_gather_ahead(msg),
        )
        hooks = LoopHooks(before_block=check_abort, trace=trace if msg.trace else None)
        # set-up ends right before the loop: the blocks' timings tile the rest of the wall
        setup_s = time.perf_counter() - t_start
        start_wait_s = _wait_for_start(msg.start_at)
        per_block = run_blocks(
            x_rows, BlockInputs(mod, segs, rope), rank, range(b0, b1), paths, hooks
        )
    except Exception as exc:
        if drain is not None and not isinstance(exc, WorkerUnusable):
            drain(msg.deadline_s, f"step {msg.job} after it failed")
        raise
    t_tail = time.perf_counter()
    if cuda:
        x_full[t0:t1].copy_(x_rows)
        torch.cuda.current_stream(device).synchronize()
    wall = time.perf_counter() - t_start - start_wait_s
    xs = ex.stats()
    exchange_s = float(xs.get("copy_s", 0.0)) + float(xs.get("wait_s", 0.0))
    return dit_protocol.DitStepped(
        wall_s=wall,
        compute_s=max(0.0, wall - exchange_s),
        exchange_s=float(xs.get("copy_s", 0.0)),
        wait_s=float(xs.get("wait_s", 0.0)),
        moved_bytes=int(xs.get("bytes_written", 0)) + int(xs.get("bytes_read", 0)),
        signals=int(xs.get("signals_sent", 0)),
        vram_peak_bytes=int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        # CUDA ranks: the copies' own durations from events on the copy streams, and the host's
        # waits for compute
        copy_gpu_s=float(xs.get("d2h_gpu_s", 0.0)) + float(xs.get("h2d_gpu_s", 0.0)),
        compute_wait_s=float(xs.get("compute_wait_s", 0.0)),
        weights=w.provider.timer(),
        per_block=per_block,
        # (new allocator segments are cudaMalloc calls; a retry after freeing its cache is a sync)
        setup_s=setup_s,
        tail_s=time.perf_counter() - t_tail,
        cuda_alloc=_alloc_delta(alloc0, _alloc_counters(device)) if alloc0 is not None else None,
        trace=digests,
        start_wait_s=start_wait_s,
        sparse=sparse.counts if sparse is not None else None,
    )


def _gather_ahead(msg: dit_protocol.DitStep) -> int:
    """The step's row pieces of the cross-block overlap, checked (0: off)."""
    n = int(msg.gather_ahead)
    if not 0 <= n <= dit_protocol.MAX_GATHER_AHEAD:
        raise ValueError(
            f"dit_step gather_ahead={n}: use 0 (off) to {dit_protocol.MAX_GATHER_AHEAD} row pieces"
        )
    return n


def _alloc_counters(device: torch.device) -> dict[str, int]:
    st = torch.cuda.memory_stats(device)
    return {
        "segments": int(st.get("segment.all.allocated", 0)),
        "retries": int(st.get("num_alloc_retries", 0)),
        "reserved_bytes": int(st.get("reserved_bytes.all.current", 0)),
    }


def _alloc_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The allocator's growth over one step: new segments, retries, and the reserved bytes at its
    end."""
    return {
        "new_segments": after["segments"] - before["segments"],
        "retries": after["retries"] - before["retries"],
        "reserved_bytes": after["reserved_bytes"],
    }


def _inference(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in inference mode.  Steps run so, like ComfyUI's sampling (an int8 layer whose
    input requires grad takes another code path), and the device copies of weights a step places
    are then inference tensors, which only inference mode may write again (``dit_refresh``)."""
    with torch.inference_mode():
        return fn(*args)


@handler(dit_protocol.DitStep)
async def _dit_step(ctx: WorkerContext, msg: dit_protocol.DitStep) -> dit_protocol.DitStepped:
    return await ctx.run_compute(_inference, run_step, ctx, msg)
