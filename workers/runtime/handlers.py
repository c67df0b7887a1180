"""What a worker serves: the handler registry, the per-worker context, and the core commands.

A handler is ``async def fn(ctx: WorkerContext, msg: Kind) -> Kind.ANSWER`` registered with
``@handler(Kind)`` for a request struct ``Kind`` (a :class:`workers.runtime.protocol.Request`
subclass); it receives the decoded, validated message, the returned answer struct (of the kind's
``ANSWER``) is the ``r`` of the ``ok`` answer, an exception becomes an ``err`` answer carrying its
traceback (a :class:`WorkerUnusable` also ends the worker). Blocking work goes through
``ctx.run_compute`` so the worker's loop keeps answering (heartbeats, aborts) while it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.runtime import protocol
from workers.runtime.shm import ABORT_WORD, Segment, owner_holds, register_cuda


class WorkerUnusable(RuntimeError):
    """A handler's failure after which this process must not serve again (its GPU queue still
    waits on an event of a peer that died): the worker answers the error, then closes its channel,
    so the pool sees it gone and starts a fresh one for the next job."""


Handler = Callable[["WorkerContext", Any], Awaitable[protocol.Answer]]
#: request struct -> handler coroutine function.
HANDLERS: dict[type[protocol.Request], Handler] = {}
H = TypeVar("H", bound=Handler)


def handler(kind: type[protocol.Request]) -> Callable[[H], H]:
    """Register ``fn`` as the worker's handler for requests of the struct ``kind``."""
    if (
        not (isinstance(kind, type) and issubclass(kind, protocol.Request))
        or kind is protocol.Request
    ):
        raise ValueError(
            f"cannot register a handler for {kind!r}: give a Request subclass of "
            "workers/*/protocol.py"
        )

    def deco(fn: H) -> H:
        if kind in HANDLERS and HANDLERS[kind] is not fn:
            raise ValueError(
                f"a handler for {kind.__qualname__} is already registered "
                f"({HANDLERS[kind].__qualname__})"
            )
        HANDLERS[kind] = fn
        return fn

    return deco


#: Called with (ctx, names) right before the segments ``names`` are unmapped because their owner let
#: go of them: an extension module drops what it built on them (an exchange over an old arena), so
#: the unmap really happens.
RELEASE_HOOKS: list[Callable[[WorkerContext, set[str]], None]] = []


def on_release(
    fn: Callable[[WorkerContext, set[str]], None],
) -> Callable[[WorkerContext, set[str]], None]:
    """Register ``fn`` in :data:`RELEASE_HOOKS`."""
    if fn not in RELEASE_HOOKS:
        RELEASE_HOOKS.append(fn)
    return fn


@dataclass
class WorkerContext:
    """Everything a handler may use in this worker process."""

    rank: int
    world_size: int
    device: str
    run_dir: str
    log: logging.Logger
    #: eventfd numbers of every rank's doorbell, index = rank (inherited from the coordinator).
    doorbell_fds: list[int]
    #: int64 view of the pool's control block; word ``shm.ABORT_WORD`` is the abort generation.
    control: Any
    #: free-form state for extension modules (weights, exchange arenas, ...).
    state: dict = field(default_factory=dict)
    control_segment: Segment | None = None
    _segments: dict[str, Segment] = field(default_factory=dict)
    _compute: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3ms-compute")
    )
    inflight: int = 0
    #: whether a ping answer has listed the kinds served yet
    announced: bool = False

    def segment(self, name: str, *, register: bool = True) -> Segment:
        """Attach a segment once, and register it with CUDA once when this worker's device is CUDA
        (``register=False``: not yet, :meth:`register` does it later: registering pins every page,
        so a page the owner has not written yet would be allocated, and zeroed, here)."""
        seg = self._segments.get(name)
        if seg is None:
            self.forget_released()
            seg = Segment.attach(name)
            self._segments[name] = seg
        if register:
            self.register(seg)
        return seg

    def register(self, seg: Segment) -> None:
        """Register an attached segment with CUDA as pinned host memory (once; no-op off CUDA)."""
        try:
            register_cuda(seg, self.device)
        except BaseException:
            self.forget_segment(seg.name)
            raise

    def forget_released(self) -> int:
        """Close the cached segments whose owner has let go of them; returns how many.  Done before
        every new attach (a new segment usually replaces an old one) and on ``drop_released``, or
        this worker would keep their memory for its whole life."""
        gone = {n for n in self._segments if not owner_holds(n)}
        if gone:
            for hook in RELEASE_HOOKS:
                hook(self, gone)
        for name in gone:
            self.forget_segment(name)
        return len(gone)

    def forget_segment(self, name: str) -> None:
        """Close a cached segment (e.g. after the coordinator released it)."""
        seg = self._segments.pop(name, None)
        if seg is not None:
            seg.close()

    def abort_generation(self) -> int:
        """The pool's current abort generation; a change since a job started means: stop it."""
        return int(self.control[ABORT_WORD])

    async def run_compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on this worker's single compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def close(self) -> None:
        """Drop cached segments and the control block; leave the compute thread to die with the
        process."""
        for name in list(self._segments):
            self.forget_segment(name)
        self.control = None
        if self.control_segment is not None:
            self.control_segment.close()
            self.control_segment = None
        self._compute.shutdown(wait=False, cancel_futures=True)


# -- core commands ---------------------------------------------------------------------------------
@handler(protocol.Ping)
async def _ping(ctx: WorkerContext, msg: protocol.Ping) -> protocol.Pong:
    """Liveness; the first answer (to the pool's admission ping) also lists the kinds this worker
    serves, which the pool then refuses others by.  Only the first: a ping is the round trip the IPC
    benchmark times."""
    serves = None
    if not ctx.announced:
        ctx.announced = True
        serves = sorted(protocol.kind_of(kind) for kind in HANDLERS)
    return protocol.Pong(pong=True, pid=os.getpid(), rank=ctx.rank, serves=serves)


def _copy_and_hash(src: Any, dst: Any, device: str) -> tuple[str, float]:
    """Copy ``src`` to ``dst`` through this worker's device (a round trip host->GPU->host on a CUDA
    rank, from and into CUDA-registered shm); returns the sha256 of ``dst`` and the seconds the
    copies took."""
    import torch

    t = time.perf_counter()
    if device.startswith("cuda"):
        staged = src.to(device, non_blocking=True)
        dst.copy_(staged, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
    else:
        dst.copy_(src)
    seconds = time.perf_counter() - t
    return hashlib.sha256(dst.numpy()).hexdigest(), seconds


@handler(protocol.Echo)
async def _echo(ctx: WorkerContext, msg: protocol.Echo) -> protocol.Echoed:
    """Copy the bytes of ``src`` to ``dst`` (both shm descriptors of equal byte size); return their
    sha256."""
    import torch

    src_d, dst_d = msg.src, msg.dst
    n_src, n_dst = src_d.nbytes, dst_d.nbytes
    if n_src != n_dst:
        raise ValueError(
            f"echo: src has {n_src} bytes but dst has {n_dst}; give descriptors of equal size"
        )
    src = ctx.segment(src_d.seg).tensor(src_d).reshape(-1).view(torch.uint8)
    dst = ctx.segment(dst_d.seg).tensor(dst_d).reshape(-1).view(torch.uint8)
    digest, seconds = await ctx.run_compute(_copy_and_hash, src, dst, ctx.device)
    return protocol.Echoed(
        bytes=n_src, sha256=digest, seconds=seconds, registered=ctx.segment(src_d.seg).registered
    )


@handler(protocol.DropReleased)
async def _drop_released(ctx: WorkerContext, msg: protocol.DropReleased) -> protocol.Dropped:
    """Unmap every segment the coordinator has released (sent before it makes new step buffers, so a
    tight /dev/shm has the old ones' pages back first)."""
    return protocol.Dropped(dropped=ctx.forget_released())
