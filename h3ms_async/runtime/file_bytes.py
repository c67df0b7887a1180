"""Tensors whose bytes lie unchanged in a file.

A host that maps its checkpoint (ComfyUI's safetensors load under DynamicVRAM maps the file and
notes each tensor's file range) hands the fill tensors that are views of that mapping; marked as
file bytes, the fill counts them as read from the file, and the readahead brings their ranges into
the page cache before the fill's writers copy them (``h3ms_async/runtime/readahead.py``).  The
bytes are the file's, so the store's copy is the same as the view's copy, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FileBytes:
    """``tensor`` is the host's view of bytes that lie unchanged in its checkpoint file (a view of
    the file's mapping): the fill copies it as any host tensor and counts it as read from the
    file, and keeps no block's tensors alive for it (the mapping holds them)."""

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if self.tensor.device.type != "cpu" or not self.tensor.is_contiguous():
            raise ValueError("FileBytes needs a contiguous CPU tensor")

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
