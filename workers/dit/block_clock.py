"""Where each block's time goes on a rank: compute, exchange copies, the copy time hidden behind
compute and the exposed wait (``workers.dit.protocol.BlockTiming``).

The block loop (``workers.dit.loop``) calls a :class:`BlockClock`'s ``start()`` before its first
block, ``block_done()`` after each block and ``finish()`` once at the end of the step.

* :class:`HostBlockClock` (CPU ranks, and the in-process runs): the host clock and the exchange's
  copy / wait counters.  Every transport copies on the compute thread, so a copy is time the
  thread did not compute: ``exposed = copy + wait`` and nothing is hidden.
* :class:`CudaBlockClock` (CUDA ranks): CUDA events, read once after the step (one synchronize,
  no per-block sync).  Block bounds are events on the compute stream; the exchange
  (``workers.dit.cuda.CudaExchange``) adds each op's window on the compute stream (from the event
  the host waits for before the op to the one after the op's copies in: the stream holds no work
  in between but what the op itself queues there), the compute it queues inside the window (the
  qkv projection on rows as they arrive, head pieces' attention) and each copy's event pair on the
  copy streams (an NCCL collective runs on a stream of its own: its window less the compute inside
  is its copy, nothing of it hidden).  Only a started clock keeps events.  :func:`block_timings`
  turns those intervals into the four numbers: exposed = the windows less the compute inside
  them, compute = the block's span less that, hidden = the copy time that intersects compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from workers.dit.protocol import BlockTiming

#: ``(start, end)`` seconds.
Interval = tuple[float, float]
#: ``(block index in the loop's run, start, end)`` seconds.
Tagged = tuple[int, float, float]


class BlockClock(Protocol):
    """What the block loop reports its blocks to."""

    def start(self) -> None:
        """Before the first block."""

    def block_done(self) -> None:
        """After each block (its output is queued or computed)."""

    def finish(self) -> list[BlockTiming]:
        """After the last block: one :class:`BlockTiming` per block."""


def _rounded(compute: float, copy: float, hidden: float, exposed: float) -> BlockTiming:
    copy_r = round(max(0.0, copy), 6)
    return BlockTiming(
        compute_s=round(max(0.0, compute), 6),
        copy_s=copy_r,
        hidden_s=min(copy_r, round(max(0.0, hidden), 6)),
        exposed_s=round(max(0.0, exposed), 6),
    )


class HostBlockClock:
    """The host clock and ``counters()`` (copy seconds, wait seconds) of an exchange."""

    def __init__(self, counters: Callable[[], tuple[float, float]]) -> None:
        self._counters = counters
        self._mark = (0.0, 0.0, 0.0)
        self._out: list[BlockTiming] = []

    def _now(self) -> tuple[float, float, float]:
        return (time.perf_counter(), *self._counters())

    def start(self) -> None:
        self._out = []
        self._mark = self._now()

    def block_done(self) -> None:
        now = self._now()
        wall, copy, wait = (a - b for a, b in zip(now, self._mark))
        exposed = min(wall, copy + wait)
        self._out.append(_rounded(wall - exposed, copy, 0.0, exposed))
        self._mark = now

    def finish(self) -> list[BlockTiming]:
        return self._out


def _union(intervals: Sequence[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(intervals: Sequence[Interval], holes: Sequence[Interval]) -> list[Interval]:
    """``intervals`` less every hole (both as unions)."""
    out = []
    cut = _union(holes)
    for start, b in _union(intervals):
        a = start
        for h0, h1 in cut:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


def _length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(x: Interval, intervals: Sequence[Interval]) -> float:
    return sum(max(0.0, min(x[1], b) - max(x[0], a)) for a, b in intervals)


def block_timings(
    bounds: Sequence[float],
    windows: Sequence[Tagged],
    busy: Sequence[Tagged],
    copies: Sequence[Tagged],
) -> list[BlockTiming]:
    """The four numbers per block from a compute stream's timeline: block i spans ``bounds[i]`` to
    ``bounds[i + 1]``; ``windows`` are its exchange ops' windows on the compute stream, ``busy`` the
    compute queued inside them, ``copies`` the copies on the copy streams, each tagged with its
    block."""
    idle = _minus([(a, b) for _, a, b in windows], [(a, b) for _, a, b in busy])
    out = []
    for i in range(len(bounds) - 1):
        span = (bounds[i], bounds[i + 1])
        exposed = _overlap(span, idle)
        computing = _minus([span], idle)
        mine = [(a, b) for k, a, b in copies if k == i]
        hidden = sum(_overlap(c, computing) for c in mine)
        out.append(_rounded(span[1] - span[0] - exposed, _length(mine), hidden, exposed))
    return out


class CudaBlockClock:
    """CUDA events of one rank's step on ``device``'s current (compute) stream and the exchange's
    copy streams; read once, after one synchronize, by :meth:`finish`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: called by :meth:`finish` before its synchronize: a wait for the step's queued work that
        #: can end without it (``CudaExchange.drain``; None: the synchronize alone)
        self.before_read: Callable[[], None] | None = None
        self._bounds: list[torch.cuda.Event] = []
        self._windows: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._busy: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._copies: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._collectives: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """A timing event recorded now on ``stream`` (default: the compute stream)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    @property
    def _block(self) -> int:
        return len(self._bounds) - 1

    def _add(self, rows: list, a: torch.cuda.Event, b: torch.cuda.Event) -> None:
        # only inside a block loop: an exchange used without one (the exchange probe) keeps nothing
        if self._bounds:
            rows.append((self._block, a, b))

    def window(self, a: torch.cuda.Event, b: torch.cuda.Event, *, collective: bool = False) -> None:
        """An exchange op's window on the compute stream; a ``collective``'s (NCCL, on a stream of
        its own) idle part is its copy."""
        self._add(self._collectives if collective else self._windows, a, b)

    def busy(self, a: torch.cuda.Event, b: torch.cuda.Event) -> None:
        """Compute queued on the compute stream inside an op's window."""
        self._add(self._busy, a, b)

    def copy(self, a: torch.cuda.Event, b: torch.cuda.Event) -> None:
        """One exchange copy (events on its copy stream)."""
        self._add(self._copies, a, b)

    def start(self) -> None:
        for rows in (self._windows, self._busy, self._copies, self._collectives):
            rows.clear()
        self._bounds = [self.event()]

    def block_done(self) -> None:
        self._bounds.append(self.event())

    def finish(self) -> list[BlockTiming]:
        if self.before_read is not None:
            self.before_read()
        torch.cuda.synchronize(self.device)
        ref = self._bounds[0]

        def sec(ev: torch.cuda.Event) -> float:
            return ref.elapsed_time(ev) / 1000.0

        def tagged(rows: list[tuple[int, torch.cuda.Event, torch.cuda.Event]]) -> list[Tagged]:
            return [(k, sec(a), sec(b)) for k, a, b in rows]

        busy = tagged(self._busy)
        held = [(a, b) for _, a, b in busy]
        collectives = tagged(self._collectives)
        moved = [(k, a, b) for k, w0, w1 in collectives for a, b in _minus([(w0, w1)], held)]
        out = block_timings(
            [sec(ev) for ev in self._bounds],
            tagged(self._windows) + collectives,
            busy,
            tagged(self._copies) + moved,
        )
        self._bounds = []
        return out
