"""Tensors whose bytes lie unchanged in a file, read straight into the weight store.

A host that maps its checkpoint (ComfyUI's safetensors load under DynamicVRAM maps the file and
notes each tensor's file range) hands the fill tensors that are views of that mapping.  Copying
from such a view faults the mapping's pages in one at a time, in the copying thread.  ``pread``
copies the same bytes inside the kernel, with no fault per source page, and several of them at
once spread the copy over the cores.
The bytes are the file's, so the store's copy is the same as the view's copy, bit for bit.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass

import torch

#: one read request: large enough to amortize the call, small enough to spread a tensor over
#: the readers
PIECE_BYTES = 8 << 20


@dataclass(frozen=True)
class FileBytes:
    """``tensor``'s bytes are the ``tensor.nbytes`` bytes at ``offset`` of the open file ``fd``
    (who makes one keeps ``fd`` open while it lives: ComfyUI's mapping holds it).  ``tensor`` is
    the host's own view of them: its layout, and what a copy falls back to."""

    tensor: torch.Tensor
    fd: int
    offset: int

    def __post_init__(self) -> None:
        if self.tensor.device.type != "cpu" or not self.tensor.is_contiguous():
            raise ValueError("FileBytes needs a contiguous CPU tensor")
        if self.offset < 0:
            raise ValueError(f"FileBytes offset must be >= 0, got {self.offset}")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


#: a stored tensor's source: a tensor on any device, or bytes that lie unchanged in a file
Source = torch.Tensor | FileBytes


def tensor_of(src: Source) -> torch.Tensor:
    """The tensor a source stands for (a :class:`FileBytes`' own view of its bytes)."""
    return src.tensor if isinstance(src, FileBytes) else src


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ended {len(view) - done} bytes early at offset {offset + done}")
        done += n


class FileReader:
    """Reads :class:`FileBytes` into host tensors, ``threads`` pieces at a time.  ``close`` ends
    the threads."""

    def __init__(self, threads: int | None = None) -> None:
        n = threads if threads is not None else min(8, os.cpu_count() or 1)
        self._pool = cf.ThreadPoolExecutor(max(1, n), thread_name_prefix="h3ms-file-read")
        #: bytes read from files so far
        self.bytes = 0

    def read_into(self, dest: torch.Tensor, src: FileBytes) -> None:
        """Fill ``dest`` (contiguous, on the host, ``src``'s size) with ``src``'s bytes."""
        n = src.nbytes
        if dest.device.type != "cpu" or not dest.is_contiguous():
            raise ValueError("FileReader reads into contiguous host tensors only")
        if dest.numel() * dest.element_size() != n:
            raise ValueError(
                f"destination holds {dest.numel() * dest.element_size()} bytes, the file range {n}"
            )
        # numpy exports a writable buffer of any tensor's bytes (torch's own dtypes included)
        view = memoryview(dest.view(torch.uint8).reshape(-1).numpy().data) if n else memoryview(b"")
        jobs = [
            self._pool.submit(_pread_full, src.fd, view[a : a + PIECE_BYTES], src.offset + a)
            for a in range(0, n, PIECE_BYTES)
        ]
        cf.wait(jobs)  # all ended before an error is raised: none writes into ``dest`` after
        for job in jobs:
            job.result()
        self.bytes += n

    def close(self) -> None:
        self._pool.shutdown(wait=True)
