"""Tensors whose bytes lie unchanged in a file, written into the weight store from the file.

A host that maps its checkpoint (ComfyUI's safetensors load under DynamicVRAM maps the file and
notes each tensor's file range) hands the fill tensors that are views of that mapping, with their
file ranges.  The fill writes each range from a read-only mapping of the file it makes itself
(:class:`FileMaps`: how the host mapped it, its advice to the kernel included, does not matter),
after the readahead brought the range into the page cache (``h3ms_async/runtime/readahead.py``).
The bytes are the file's, so the store's copy is the same as the view's copy, bit for bit.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FileBytes:
    """``tensor``'s bytes are the ``tensor.nbytes`` bytes at ``offset`` of the open file ``fd``
    (who makes one keeps ``fd`` open while it lives: ComfyUI's mapping holds it).  ``tensor`` is
    the host's own view of them (its layout); the fill writes the bytes from its own read-only
    mapping of ``fd`` (:class:`FileMaps`), whatever way the host mapped them, several blocks at
    once, as they hold no memory of their own."""

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


class FileMaps:
    """Read-only mappings of the files a fill's :class:`FileBytes` lie in, one per descriptor,
    made at first use (by any writer thread) and unmapped by :meth:`close` once every view of them
    is released."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def view(self, src: FileBytes) -> memoryview:
        """``src``'s bytes as a view of this fill's mapping of its file (release it after use)."""
        with self._lock:
            mm = self._maps.get(src.fd)
            if mm is None:
                mm = self._maps[src.fd] = mmap.mmap(src.fd, 0, prot=mmap.PROT_READ)
        if src.offset + src.nbytes > len(mm):
            raise ValueError(
                f"file range [{src.offset}, {src.offset + src.nbytes}) is past the file's end "
                f"({len(mm)} bytes)"
            )
        return memoryview(mm)[src.offset : src.offset + src.nbytes]

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for mm in maps.values():
            mm.close()
