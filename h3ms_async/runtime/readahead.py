"""Page-cache readahead of a safetensors checkpoint, block by block, for the weight-store fill.

The fill copies one block at a time from tensors that map the checkpoint file (ComfyUI loads
safetensors by ``mmap``).  Faulting those pages in one by one reads a cold file in small
synchronous pieces, well under the disk's sequential rate; asking the kernel for the next blocks'
byte ranges (``posix_fadvise(POSIX_FADV_WILLNEED)``) while the current block copies keeps the disk
streaming, and the copy then finds its pages cached.  A block's tensors are not contiguous in the
file (safetensors groups tensors by dtype alignment, then by name), so each block is a list of
ranges, adjacent ones merged.

File format (the safetensors spec): an 8-byte little-endian header length, the JSON header
(``name -> {"dtype", "shape", "data_offsets": [begin, end]}``, offsets relative to the data
section, plus an optional ``__metadata__``), then the data section.
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from collections.abc import Callable

from h3ms_async.log import get_logger

log = get_logger("Weights")

#: a header larger than this is not a checkpoint we read ahead (the spec allows 100 MB)
MAX_HEADER_BYTES = 100 << 20
#: how many blocks past the one being read are asked for
BLOCKS_AHEAD = 2

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.(.+)$")

Ranges = list[tuple[int, int]]


def block_ranges(path: str, wanted: Callable[[str], bool] = lambda _: True) -> dict[int, Ranges]:
    """Block index -> the file's ``(offset, length)`` ranges holding that block's tensors whose
    in-block name (after ``blocks.<i>.``) ``wanted`` accepts; adjacent ranges merged, in file
    order.  Raises ``ValueError`` for a file that is not safetensors."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header of {n} bytes is not a safetensors header")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: the safetensors header is not JSON ({exc})") from None
    base = 8 + n
    spans: dict[int, Ranges] = {}
    for name, info in header.items():
        m = _BLOCK.search(name)
        if name == "__metadata__" or m is None or not wanted(m.group(2)):
            continue
        a, b = info["data_offsets"]
        if b > a:
            spans.setdefault(int(m.group(1)), []).append((base + a, b - a))
    return {i: _merged(r) for i, r in spans.items()}


def _merged(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for off, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((off, length))
    return out


class BlockReadahead:
    """Asks the kernel for blocks ahead of the fill.  :meth:`reading` (block ``i`` is being read)
    asks, in a background thread, for ``i`` and the :data:`BLOCKS_AHEAD` blocks after it, each
    once; :meth:`wait` joins the requests made so far (tests)."""

    def __init__(self, path: str, ranges: dict[int, Ranges]) -> None:
        self.path = path
        self.ranges = ranges
        self._asked: set[int] = set()
        self._threads: list[threading.Thread] = []

    @classmethod
    def of(cls, path: str, wanted: Callable[[str], bool]) -> BlockReadahead | None:
        """The readahead of a safetensors ``path`` (None, logged, for a file it cannot read)."""
        try:
            return cls(path, block_ranges(path, wanted))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.info("no readahead for %s: %s", path, exc)
            return None

    def reading(self, i: int) -> None:
        todo = [
            j for j in range(i, i + BLOCKS_AHEAD + 1) if j in self.ranges and j not in self._asked
        ]
        if not todo:
            return
        self._asked.update(todo)
        self._threads = [t for t in self._threads if t.is_alive()]
        t = threading.Thread(target=self._advise, args=(todo,), name="h3ms-readahead", daemon=True)
        self._threads.append(t)
        t.start()

    def _advise(self, blocks: list[int]) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            log.info("readahead of %s stopped: %s", self.path, exc)
            return
        try:
            for j in blocks:
                for off, length in self.ranges[j]:
                    os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
        except OSError as exc:
            log.info("readahead of %s stopped: %s", self.path, exc)
        finally:
            os.close(fd)

    def wait(self, timeout: float = 30.0) -> None:
        for t in self._threads:
            t.join(timeout)
