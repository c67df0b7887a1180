"""The GPU-direct exchange between CUDA rank processes: the host exchange's protocol over buffers in
the ranks' own GPU memory, shared by CUDA IPC, so every byte moves device to device (peer to peer
over NVLink/PCIe between GPUs with peer access, a plain device copy between logical ranks of one
GPU) and never through the host.

What moves where.  Rank p's *send buffer* lives on its GPU and holds what the host exchange's arena
holds of rank p's writing (:func:`send_plan`): its rows of G ``[n_p, W]``, its block A_p ``[S,
c_p]`` and, for a ``qkv`` layout, its rows of every Q_r ``[n_p, 3·c_r]``.  A rank writes only into
its own send buffer (a copy on its GPU) and reads its peers' parts straight out of theirs (the copy
runs on the reading process's stream of the peer's GPU, ordered with the reader's own stream by
PyTorch's cross-device copy); the ops, the chunking, the sequence words, the doorbells, the reuse
guard, the abort generation and every deadline are :class:`~workers.transports.host.HostExchange`'s,
over a small shm arena that is the host arena's header page followed by the handle slots
(:func:`arena_bytes`).  Wrapped by ``workers.dit.cuda.CudaExchange`` (``over_host(...,
exchange=CudaIpcExchange)``) as the host exchange is on a CUDA rank.  The host exchange's reuse
argument needs two facts: a chunk's bytes are in the writer's buffer before a reader copies them,
and a reader's copies of an op are done before anything it publishes later.

Two orderings (:class:`~workers.dit.protocol.IpcSync`) give them.  *Host*: every chunk's copy is
synchronised on the host before it is published, and every op's reads before the next op starts,
so the host waits for the GPU inside each op and the GPU's queue runs dry at every exchange.
*Events* (``event_streams`` given: the write and read streams of ``workers.dit.cuda.CudaExchange``):
the host waits for the GPU only to bound how far it runs ahead (``workers.dit.cuda.AHEAD_OPS``);
CUDA IPC events carry the two facts from stream to stream.  Rank
p records a *send event* on its write stream once a chunk's copies are queued, before it publishes
the chunk (a produced piece's right after its copies, before the next piece's, which wait for more
compute).  The events form a ring of :data:`RING` per rank: the k-th chunk p publishes in a job is
slot ``k mod RING``, and every rank publishes the same chunks in the same order, so a reader knows
the slot of the chunk it takes; its read stream waits on that event before the copy out of p's
buffer.  A reader records a *read event* per buffer (G, A, Q) on its read stream after the reads
of each op (and at ``begin()``), before anything of its next op is published; a writer's write
stream waits on every peer's read event of a buffer before its first write into it in an op, which
the host exchange's reuse guard already holds back until the peer has published something later.
So every wait is enqueued after the record it needs (a CUDA stream waits on an event's latest
record, which may be a later one: later work of the same stream, never earlier), and every wait
names work already queued, so the streams cannot wait on each other in a cycle.

Handles.  Each rank allocates its send buffer once per exchange object (one per step arena, i.e. per
step shape) and writes one handle per peer (:meth:`IpcBuffers.share`:
``workers.runtime.cuda_ipc.share`` as msgpack) into slot (owner, peer) of the arena: the payload,
then its length as the slot's first word (the x86-64 store order argument of
``workers.transports.host``).  A rank opens its peers' buffers at its first op, waiting for their
slots under the op's deadline and the abort generation.  With events, a rank first writes one
payload with the handles of all its events (:data:`EVENTS`) into its event slot, which a peer opens
together with its buffer.  ``devices[p]`` is the index under which this process sees rank p's GPU
(a worker sees its own as 0 and its peers' through the pool's ``also_visible``).  Only
:class:`IpcBuffers` touches CUDA: ``workers/testing/ipc_cpu.py`` replaces it to run everything else
on CPU ranks (``tests/test_exchange_conformance.py``; with events, its stand-in events check every
wait's order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from workers.runtime import cuda_ipc
from workers.runtime.shm import align
from workers.transports.arena import BUFFERS, ArenaLayout
from workers.transports.exchange import ExchangeError
from workers.transports.host import AsyncCopyFn, CopyFn, HostExchange

#: Bytes of one handle slot: an int64 payload length, then the msgpack handle (about 200 bytes).
SLOT_BYTES = 1024
#: Send events per rank (the chunks a writer may publish before a reader waits on the first of
#: them is at most two ops' worth; more only makes a wait cover later copies too).
RING = 128
#: The buffers with a read event, in the order of a rank's read events after its send ring.
READ_BUFFERS = ("G", "A", "Q")
#: Events per rank: the send ring, then one read event per buffer.
EVENTS = RING + len(READ_BUFFERS)
#: Bytes of a CUDA IPC event handle (``cudaIpcEventHandle_t``).
EVENT_HANDLE_BYTES = 64
#: Bytes of one rank's event slot: an int64 payload length, then every event's handle.
EVENT_SLOT_BYTES = align(8 + EVENTS * EVENT_HANDLE_BYTES)


class CudaIpcUnavailable(ExchangeError):
    """This process cannot share or open the ranks' GPU buffers by CUDA IPC."""


def arena_bytes(layout: ArenaLayout) -> int:
    """Bytes of the shm arena the GPU-direct exchange of ``layout`` runs over: the host arena's
    header page, one handle slot per (owner, peer), then one event slot per rank."""
    return _event_base(layout) + layout.world * EVENT_SLOT_BYTES


def _slot(layout: ArenaLayout, owner: int, peer: int) -> slice:
    start = layout.header_bytes + (owner * layout.world + peer) * SLOT_BYTES
    return slice(start, start + SLOT_BYTES)


def _event_base(layout: ArenaLayout) -> int:
    return layout.header_bytes + layout.world * layout.world * SLOT_BYTES


def _event_slot(layout: ArenaLayout, owner: int) -> slice:
    start = _event_base(layout) + owner * EVENT_SLOT_BYTES
    return slice(start, start + EVENT_SLOT_BYTES)


def stamp(job: int, op: int, chunks: int = 0) -> int:
    """What an event's record stands for, ordered within a job: op ``op`` of job ``job`` with
    ``chunks`` of it published (a read event: 0, its reads done).  CUDA ignores it; the CPU
    stand-in (``workers/testing/ipc_cpu.py``) checks every wait against it."""
    return (job << 24) | (op << 9) | chunks


def stamp_text(value: int) -> str:
    """What a :func:`stamp` stands for, in words (the stand-in's errors)."""
    job, op, chunks = value >> 24, (value >> 9) & 0x7FFF, value & 0x1FF
    return f"job {job} op {op}" + (f" chunk {chunks}" if chunks else " (reads done)")


@dataclass(frozen=True)
class SendPlan:
    """Byte offsets of rank p's parts in its send buffer (every rank computes every rank's)."""

    g: int
    a: int
    q: tuple[int, ...]
    nbytes: int


def send_plan(layout: ArenaLayout, p: int) -> SendPlan:
    """Where rank p's rows of G, its A_p and its rows of each Q_r lie in its send buffer."""
    elem = layout.torch_dtype.itemsize
    t0, t1 = layout.rows(p)
    c0, c1 = layout.cols(p)
    off = 0
    g = off
    off += align((t1 - t0) * layout.row_width * elem)
    a = off
    off += align(layout.tokens * (c1 - c0) * elem)
    q = []
    for r in range(layout.world if layout.q_offsets else 0):
        r0, r1 = layout.cols(r)
        q.append(off)
        off += align((t1 - t0) * 3 * (r1 - r0) * elem)
    return SendPlan(g, a, tuple(q), max(off, 1))


class _SendBuffer:
    """Typed views of one rank's send buffer (``flat``: its bytes, on the device it lives on)."""

    def __init__(self, layout: ArenaLayout, p: int, flat: torch.Tensor) -> None:
        plan = send_plan(layout, p)
        if flat.numel() < plan.nbytes:
            raise ValueError(
                f"rank {p}'s send buffer holds {flat.numel()} bytes, its plan needs {plan.nbytes}: "
                "the ranks run different layouts"
            )
        dt, w, s = layout.torch_dtype, layout.row_width, layout.tokens
        t0, t1 = layout.rows(p)
        c0, c1 = layout.cols(p)
        self.flat, self.t0 = flat, t0

        def view(off: int, rows: int, cols: int) -> torch.Tensor:
            n = rows * cols * dt.itemsize
            return flat[off : off + n].view(dt).view(rows, cols)

        self.g = view(plan.g, t1 - t0, w)
        self.a = view(plan.a, s, c1 - c0)
        self.q = [
            view(off, t1 - t0, 3 * (layout.cols(r)[1] - layout.cols(r)[0]))
            for r, off in enumerate(plan.q)
        ]


class IpcBuffers:
    """Where the ranks' send buffers live and how a peer reaches one: memory of a CUDA device,
    shared by CUDA IPC.  One object per exchange.  (``workers/testing/ipc_cpu.py`` overrides it to
    run the exchange's protocol without a GPU, each buffer a shm segment.)"""

    def device(self, index: int) -> torch.device:
        """The device under this process's index ``index`` (``CudaIpcExchange``'s ``devices``)."""
        return torch.device("cuda", index)

    def allocate(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A new flat uint8 send buffer of ``nbytes`` on ``device``."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def share(self, flat: torch.Tensor) -> bytes:
        """A handle of ``flat`` for one opener (raises ``RuntimeError`` where this process cannot
        share it)."""
        return msgspec.msgpack.encode(cuda_ipc.share(flat))

    def open(self, handle: bytes, index: int) -> torch.Tensor:
        """The buffer behind a peer's ``handle`` as one flat uint8 tensor, on this process's device
        ``index`` (raises ``RuntimeError`` where it cannot be opened)."""
        return cuda_ipc.bytes_of(cuda_ipc.open_storage(msgspec.msgpack.decode(handle), index))

    def unavailable(self, device: torch.device) -> str:
        """Why this process cannot share memory of ``device`` ('' when it can)."""
        return cuda_ipc.unavailable(str(device))

    def events(self, device: torch.device, count: int) -> list[Any]:
        """``count`` new events on ``device`` that other processes can wait on."""
        with torch.cuda.device(device):
            events = [torch.cuda.Event(interprocess=True) for _ in range(count)]
            for ev in events:
                # PyTorch creates an event at its first record (or handle) on the current device:
                # here, so each lives on ``device`` before its handle is taken
                ev.record()
        return events

    def share_events(self, events: Sequence[Any]) -> bytes:
        """One payload with the handles of ``events`` (for every opener)."""
        return b"".join(ev.ipc_handle() for ev in events)

    def open_events(self, payload: bytes, index: int) -> list[Any]:
        """A peer's events from its payload, on this process's device ``index``."""
        n = EVENT_HANDLE_BYTES
        device = torch.device("cuda", index)
        return [
            torch.cuda.Event.from_ipc_handle(device, payload[i : i + n])
            for i in range(0, len(payload), n)
        ]

    def record(self, event: Any, stream: Any, stamp: int) -> None:
        """Record ``event`` on ``stream`` (``stamp``: :func:`stamp`)."""
        event.record(stream)

    def wait(self, event: Any, stream: Any, stamp: int) -> None:
        """Make ``stream`` wait for ``event``'s latest record, which must stand for ``stamp`` or
        later."""
        stream.wait_event(event)

    def close(self) -> None:
        """Let go of what the buffers hold besides their tensors (here nothing: an opened storage
        gives its reference back when its last tensor is freed)."""


class CudaIpcExchange(HostExchange):
    """One CUDA rank's side of the GPU-direct exchange (the module docstring).  ``arena`` is the
    shm arena of :func:`arena_bytes` (header initialised by its creator with
    ``layout.init_header``), ``devices[p]`` this process's index of rank p's GPU, ``buffers``
    where the send buffers live (default: :class:`IpcBuffers`, CUDA memory); ``event_streams``
    (write stream, read stream) orders the copies by CUDA IPC events instead of host waits (the
    copy hooks then only queue their copies); the other arguments are :class:`HostExchange`'s, whose
    copy hooks here move device memory."""

    transport = "cuda_ipc"
    _slots: np.ndarray

    def __init__(
        self,
        rank: int,
        world: int,
        arena: torch.Tensor,
        layout: ArenaLayout,
        doorbell_fds: list[int],
        control: torch.Tensor,
        deadline_s: float,
        *,
        devices: Sequence[int],
        buffers: IpcBuffers | None = None,
        event_streams: tuple[Any, Any] | None = None,
        spin_us: float = 0.0,
        to_host: CopyFn | None = None,
        to_device: CopyFn | None = None,
        to_host_async: AsyncCopyFn | None = None,
    ) -> None:
        if len(devices) != world:
            raise ValueError(f"need one CUDA device index per rank ({world}), got {list(devices)}")
        self.devices = [int(d) for d in devices]
        self.buffers = buffers or IpcBuffers()
        self.device = self.buffers.device(self.devices[rank])
        self._bufs: list[_SendBuffer | None] = [None] * world
        self._streams = event_streams
        self._events: list[list[Any] | None] = [None] * world  # per rank: send ring, read events
        self._sent = 0  # chunks this rank published in this job
        self._op_base = 0  # ... before the current op (the ring slot of its chunk 0)
        self._recorded = 0  # chunks of the current op whose send event is recorded
        super().__init__(
            rank,
            world,
            arena,
            layout,
            doorbell_fds,
            control,
            deadline_s,
            spin_us=spin_us,
            to_host=to_host,
            to_device=to_device,
            to_host_async=to_host_async,
        )

    # -- the buffers -------------------------------------------------------------------------------
    def _map_data(self, arena: torch.Tensor) -> None:
        """Allocate this rank's send buffer and hand each peer a handle of it."""
        lay, me = self.layout, self.rank
        if arena.numel() < arena_bytes(lay):
            raise ValueError(
                f"the GPU-direct exchange's arena holds {arena.numel()} bytes, it needs "
                f"{arena_bytes(lay)} (workers.transports.cuda_ipc.arena_bytes)"
            )
        self._slots = arena.numpy()
        with torch.inference_mode(False):
            # a normal tensor: written in and outside inference mode
            flat = self.buffers.allocate(self.device, send_plan(lay, me).nbytes)
        self._bufs[me] = _SendBuffer(lay, me, flat)
        try:
            if self._streams is not None:
                mine = self.buffers.events(self.device, EVENTS)
                self._events[me] = mine
                self._write_payload(_event_slot(lay, me), self.buffers.share_events(mine))
            for p in range(self.world):
                if p != me:
                    self._write_slot(p, self.buffers.share(flat))
        except RuntimeError as exc:
            raise CudaIpcUnavailable(
                f"rank {me}: exchange=cuda_ipc cannot share its {self.device} buffer "
                f"({self.buffers.unavailable(self.device) or exc}); or use exchange host"
            ) from exc

    def _write_slot(self, peer: int, payload: bytes) -> None:
        self._write_payload(_slot(self.layout, self.rank, peer), payload)

    def _write_payload(self, where: slice, payload: bytes) -> None:
        slot = self._slots[where]
        if len(payload) > len(slot) - 8:
            raise ValueError(f"a CUDA IPC payload of {len(payload)} bytes does not fit its slot")
        slot[8 : 8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        slot[:8].view(np.int64)[0] = len(payload)  # last: a reader that sees it sees the payload

    def _read_slot(self, owner: int) -> bytes | None:
        return self._read_payload(_slot(self.layout, owner, self.rank))

    def _read_payload(self, where: slice) -> bytes | None:
        slot = self._slots[where]
        n = int(slot[:8].view(np.int64)[0])
        return bytes(slot[8 : 8 + n]) if n else None

    def _open(self, p: int) -> None:
        payload = self._read_slot(p)
        assert payload is not None  # _open_peers takes a peer once its slot is filled
        try:
            flat = self.buffers.open(payload, self.devices[p])
        except RuntimeError as exc:
            raise CudaIpcUnavailable(
                f"rank {self.rank}: exchange=cuda_ipc cannot open rank {p}'s buffer on its device "
                f"{self.devices[p]} ({str(exc).splitlines()[0]}); every rank's worker must see "
                "every rank's GPU, or use exchange host"
            ) from exc
        self._bufs[p] = _SendBuffer(self.layout, p, flat)
        if self._streams is not None:
            # written before the buffer's slot, so there by now
            payload = self._read_payload(_event_slot(self.layout, p))
            if payload is None:
                raise CudaIpcUnavailable(
                    f"rank {self.rank}: rank {p} shared its buffer without its events: the ranks "
                    "run the GPU-direct exchange with different orderings"
                )
            self._events[p] = self.buffers.open_events(payload, self.devices[p])

    def _open_peers(self) -> None:
        """Open every peer's send buffer once its handle is there (the op's deadline, abort)."""
        pending = [p for p in self._peers if self._bufs[p] is None]
        if pending:
            self._drain(
                pending,
                lambda p: self._read_slot(p) is not None,
                self._open,
                "cuda_ipc: waiting for rank(s) {} to share their GPU buffers",
            )

    def _begin_op(self, kind: int, n: int) -> None:
        self._op_base, self._recorded = self._sent, 0
        super()._begin_op(kind, n)
        self._open_peers()
        if self._streams is not None:
            # the guard above saw every peer publish past the buffers' last use, so each has
            # recorded its read event for that use
            for name in BUFFERS[kind]:
                need = stamp(self._job, max(self._last_use[name], 0))
                ev = RING + READ_BUFFERS.index(name)
                for p in self._peers:
                    self.buffers.wait(self._events_of(p)[ev], self._streams[0], need)

    def begin(self, abort_generation: int) -> None:
        super().begin(abort_generation)
        self._sent = 0

    # -- event ordering ------------------------------------------------------------------------
    def _events_of(self, p: int) -> list[Any]:
        """Rank p's events (this rank's own, or a peer's as opened): send ring, then read events."""
        events = self._events[p]
        if events is None:
            raise RuntimeError(f"rank {self.rank}: rank {p}'s events are not open yet")
        return events

    def _staged(self, j: int) -> None:
        self._record_sent(j)

    def _publish(self, kind: int, n_chunks: int, j: int) -> None:
        self._record_sent(j)
        self._sent += 1
        super()._publish(kind, n_chunks, j)

    def _record_sent(self, j: int) -> None:
        """Record chunk j's send event after its copies, once (a produced piece's right after its
        copies start: the next piece's copies, queued before j is published, wait for its
        compute)."""
        if self._streams is not None and j >= self._recorded:
            ring = self._events_of(self.rank)
            slot = ring[(self._op_base + j) % RING]
            self.buffers.record(slot, self._streams[0], stamp(self._job, self._op, j + 1))
            self._recorded = j + 1

    def _consume(self, kind: int, n_chunks: int, j: int, take: Callable[[int, int], None]) -> None:
        if self._streams is None:
            super()._consume(kind, n_chunks, j, take)
            return
        slot, read = (self._op_base + j) % RING, self._streams[1]
        need = stamp(self._job, self._op, j + 1)

        def ordered(p: int, jj: int) -> None:
            self.buffers.wait(self._events_of(p)[slot], read, need)
            take(p, jj)

        super()._consume(kind, n_chunks, j, ordered)

    def _reads_done(self, buffers: Sequence[str]) -> None:
        if self._streams is not None:
            mine = self._events_of(self.rank)
            for name in buffers:
                ev = mine[RING + READ_BUFFERS.index(name)]
                self.buffers.record(ev, self._streams[1], stamp(self._job, max(self._op, 0)))

    def _buf(self, p: int) -> _SendBuffer:
        buf = self._bufs[p]
        if buf is None:
            raise RuntimeError(f"rank {self.rank}: rank {p}'s send buffer is not open yet")
        return buf

    def _g_rows(self, p: int, a: int, b: int) -> torch.Tensor:
        buf = self._buf(p)
        return buf.g[a - buf.t0 : b - buf.t0]

    def _a_block(self, p: int) -> torch.Tensor:
        return self._buf(p).a

    def _q_rows(self, r: int, p: int, a: int, b: int) -> torch.Tensor:
        buf = self._buf(p)
        return buf.q[r][a - buf.t0 : b - buf.t0]

    def _q_piece_rows(self, r: int, p: int, n: int, j: int, a: int, b: int) -> torch.Tensor:
        buf = self._buf(p)
        return self.layout.q_piece_view(buf.q[r], r, n, j)[a - buf.t0 : b - buf.t0]

    def close(self) -> None:
        """Drop the peers' buffers and events (each gives its reference back) and this rank's
        own."""
        super().close()
        self._bufs = [None] * self.world
        self._events = [None] * self.world
        self.buffers.close()
