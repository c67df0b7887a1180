"""Test stand-in: the GPU-direct exchange (``workers.transports.cuda_ipc.CudaIpcExchange``) on CPU
ranks, so everything but its CUDA calls runs without a GPU: the send plan and its views, the handle
slots, opening the peers' buffers under the op's deadline and the abort generation, and the host
exchange's protocol reading the peers' parts straight out of their buffers.

Each rank's "device buffer" is a shm segment of its own (``workers/runtime/shm.py``) and its "IPC
handle" the segment's id, through which a peer process attaches it.  The exchange probe
(``workers.transports.probe``) builds it for ``cuda_ipc`` cases on CPU ranks, only with
``H3MS_TEST_HOOKS=1 H3MS_CUDA_IPC_CPU=1``; ``H3MS_TEST_IPC_WITHHOLD_RANK`` names a rank whose
handles stay unwritten.  What only a GPU shows is out of its reach: CUDA IPC handles, peer-to-peer
copies and the ordering of copies across devices' streams.
"""

from __future__ import annotations

import torch

from workers.runtime.shm import Segment
from workers.testing import settings
from workers.transports.cuda_ipc import IpcBuffers

_CPU = torch.device("cpu")


class ShmBuffers(IpcBuffers):
    """Send buffers in shm segments: ``share`` hands out the segment's id, ``open`` attaches it.
    ``withhold``: every share is an empty payload, which leaves the slot reading as unwritten."""

    def __init__(self, withhold: bool = False) -> None:
        self.withhold = withhold
        self._segments: list[Segment] = []
        self._owned: dict[int, Segment] = {}  # by the buffer's address

    def device(self, index: int) -> torch.device:
        return _CPU

    def allocate(self, device: torch.device, nbytes: int) -> torch.Tensor:
        seg = Segment.create(nbytes, "ipccpu")
        self._segments.append(seg)
        flat = seg.base_tensor()[:nbytes]
        self._owned[flat.data_ptr()] = seg
        return flat

    def share(self, flat: torch.Tensor) -> bytes:
        return b"" if self.withhold else self._owned[flat.data_ptr()].name.encode()

    def open(self, handle: bytes, index: int) -> torch.Tensor:
        seg = Segment.attach(handle.decode())
        self._segments.append(seg)
        return seg.base_tensor()

    def unavailable(self, device: torch.device) -> str:
        return ""

    def close(self) -> None:
        """Unmap every segment (the exchange dropped its views first) and stop new attaches."""
        self._owned.clear()
        for seg in self._segments:
            seg.close()
        self._segments.clear()


def buffers(rank: int) -> ShmBuffers | None:
    """Rank ``rank``'s stand-in buffers with ``H3MS_CUDA_IPC_CPU=1``, else None."""
    if not settings.CUDA_IPC_CPU.get():
        return None
    return ShmBuffers(withhold=rank == settings.TEST_IPC_WITHHOLD_RANK.get())
