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
exchange=CudaIpcExchange)``) as the host exchange is on a CUDA rank, its copies get the same
ordering: a rank publishes a chunk only after its copy into its send buffer finished (an event
synchronised on the host), and publishes anything of the next op only after its reads of the
previous op finished, which is all the host exchange's reuse argument needs.

Handles.  Each rank allocates its send buffer once per exchange object (one per step arena, i.e. per
step shape) and writes one handle per peer (:meth:`IpcBuffers.share`:
``workers.runtime.cuda_ipc.share`` as msgpack) into slot (owner, peer) of the arena: the payload,
then its length as the slot's first word (the x86-64 store order argument of
``workers.transports.host``).  A rank opens its peers' buffers at its first op, waiting for their
slots under the op's deadline and the abort generation.  ``devices[p]`` is the index under which
this process sees rank p's GPU (a worker sees its own as 0 and its peers' through the pool's
``also_visible``).  Only :class:`IpcBuffers` touches CUDA: ``workers/testing/ipc_cpu.py`` replaces
it to run everything else on CPU ranks (``tests/test_exchange_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from workers.runtime import cuda_ipc
from workers.runtime.shm import align
from workers.transports.arena import ArenaLayout
from workers.transports.exchange import ExchangeError
from workers.transports.host import AsyncCopyFn, CopyFn, HostExchange

#: Bytes of one handle slot: an int64 payload length, then the msgpack handle (about 200 bytes).
SLOT_BYTES = 1024


class CudaIpcUnavailable(ExchangeError):
    """This process cannot share or open the ranks' GPU buffers by CUDA IPC."""


def arena_bytes(layout: ArenaLayout) -> int:
    """Bytes of the shm arena the GPU-direct exchange of ``layout`` runs over: the host arena's
    header page, then one handle slot per (owner, peer)."""
    return layout.header_bytes + layout.world * layout.world * SLOT_BYTES


def _slot(layout: ArenaLayout, owner: int, peer: int) -> slice:
    start = layout.header_bytes + (owner * layout.world + peer) * SLOT_BYTES
    return slice(start, start + SLOT_BYTES)


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

    def close(self) -> None:
        """Let go of what the buffers hold besides their tensors (here nothing: an opened storage
        gives its reference back when its last tensor is freed)."""


class CudaIpcExchange(HostExchange):
    """One CUDA rank's side of the GPU-direct exchange (the module docstring).  ``arena`` is the
    shm arena of :func:`arena_bytes` (header initialised by its creator with
    ``layout.init_header``), ``devices[p]`` this process's index of rank p's GPU, ``buffers``
    where the send buffers live (default: :class:`IpcBuffers`, CUDA memory); the other arguments
    are :class:`HostExchange`'s, whose copy hooks here move device memory."""

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
            for p in range(self.world):
                if p != me:
                    self._write_slot(p, self.buffers.share(flat))
        except RuntimeError as exc:
            raise CudaIpcUnavailable(
                f"rank {me}: exchange=cuda_ipc cannot share its {self.device} buffer "
                f"({self.buffers.unavailable(self.device) or exc}); or use exchange host"
            ) from exc

    def _write_slot(self, peer: int, payload: bytes) -> None:
        if len(payload) > SLOT_BYTES - 8:
            raise ValueError(f"a CUDA IPC handle of {len(payload)} bytes does not fit its slot")
        slot = self._slots[_slot(self.layout, self.rank, peer)]
        slot[8 : 8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        slot[:8].view(np.int64)[0] = len(payload)  # last: a reader that sees it sees the payload

    def _read_slot(self, owner: int) -> bytes | None:
        slot = self._slots[_slot(self.layout, owner, self.rank)]
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
        super()._begin_op(kind, n)
        self._open_peers()

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

    def close(self) -> None:
        """Drop the peers' buffers (each gives its reference back) and this rank's own."""
        super().close()
        self._bufs = [None] * self.world
        self.buffers.close()
