"""Test stand-in: the GPU-direct exchange (``workers.transports.cuda_ipc.CudaIpcExchange``) on CPU
ranks, so everything but its CUDA calls runs without a GPU: the send plan and its views, the handle
slots, opening the peers' buffers under the op's deadline and the abort generation, and the host
exchange's protocol reading the peers' parts straight out of their buffers.

Each rank's "device buffer" is a shm segment of its own (``workers/runtime/shm.py``) and its "IPC
handle" the segment's id, through which a peer process attaches it.  The exchange probe
(``workers.transports.probe``) builds it for ``cuda_ipc`` cases on CPU ranks, only with
``H3MS_TEST_HOOKS=1 H3MS_CUDA_IPC_CPU=1``; ``H3MS_TEST_IPC_WITHHOLD_RANK`` names a rank whose
handles stay unwritten.

Events (the exchange ordered by CUDA IPC events): a rank's events are int64 words in one shm
segment of its own, a record stores the record's stamp (``workers.transports.cuda_ipc.stamp``) and
a wait checks that the event's latest record stands for the stamp it needs or a later one, raising
:class:`EventOrderError` otherwise: on a GPU that wait would have let a copy run before the bytes
it reads were written, or a write before its peers' reads.  So the protocol's order (every record
before the word that announces it) is checked on CPU ranks; ``H3MS_TEST_IPC_UNRECORDED_RANK`` names
a rank that never records, which its peers must catch.  What only a GPU shows is out of its reach:
CUDA IPC handles, peer-to-peer copies and the streams themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.runtime.shm import Segment
from workers.testing import settings
from workers.transports.cuda_ipc import EVENTS, IpcBuffers, stamp_text
from workers.transports.exchange import ExchangeError

_CPU = torch.device("cpu")


class EventOrderError(ExchangeError):
    """A wait on an event whose latest record is older than the one the wait needs."""


class _Event:
    """One stand-in event: word ``index`` of its owner's event segment."""

    def __init__(self, words: torch.Tensor, index: int) -> None:
        self.words, self.index = words, index


class ShmBuffers(IpcBuffers):
    """Send buffers in shm segments: ``share`` hands out the segment's id, ``open`` attaches it.
    ``withhold``: every share is an empty payload, which leaves the slot reading as unwritten."""

    def __init__(self, withhold: bool = False, unrecorded: bool = False) -> None:
        self.withhold = withhold
        self.unrecorded = unrecorded
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

    def events(self, device: torch.device, count: int) -> list[Any]:
        seg = Segment.create(count * 8, "ipcev")
        self._segments.append(seg)
        words = seg.base_tensor()[: count * 8].view(torch.int64)
        words.zero_()
        self._owned[words.data_ptr()] = seg
        return [_Event(words, i) for i in range(count)]

    def share_events(self, events: Sequence[Any]) -> bytes:
        return self._owned[events[0].words.data_ptr()].name.encode()

    def open_events(self, payload: bytes, index: int) -> list[Any]:
        seg = Segment.attach(payload.decode())
        self._segments.append(seg)
        words = seg.base_tensor()[: EVENTS * 8].view(torch.int64)
        return [_Event(words, i) for i in range(EVENTS)]

    def record(self, event: Any, stream: Any, stamp: int) -> None:
        if not self.unrecorded:
            event.words[event.index] = stamp

    def wait(self, event: Any, stream: Any, stamp: int) -> None:
        latest = int(event.words[event.index])
        if latest < stamp:
            raise EventOrderError(
                f"a wait for {stamp_text(stamp)} found the event's latest record at "
                f"{stamp_text(latest) if latest else 'none'}: on a GPU the copy would not wait for "
                "the bytes (or reads) it depends on"
            )

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
    return ShmBuffers(
        withhold=rank == settings.TEST_IPC_WITHHOLD_RANK.get(),
        unrecorded=rank == settings.TEST_IPC_UNRECORDED_RANK.get(),
    )
