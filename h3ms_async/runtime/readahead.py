"""Page-cache readahead of a safetensors checkpoint, block by block, for the weight-store fill.

The fill copies one block at a time from tensors that map the checkpoint file (ComfyUI loads
safetensors by ``mmap``) or that ComfyUI's own reader (comfy-aimdo: buffered ``pread``s) takes
from it.  Faulting those pages in one by one reads a cold file in small synchronous pieces, well
under the disk's sequential rate, and several readers at once (the fill's own, ComfyUI's rows and
casts, a readahead) pull the disk between places.  So one background reader streams the blocks'
byte ranges into the page cache in file order, in large sequential reads (what reads a file at
the disk's rate), up to :data:`BLOCKS_AHEAD` blocks past the fill, and the fill waits for a
block's pages before it touches them: the disk then serves one stream while the fill copies
the block before.  It reads them itself: ``posix_fadvise(POSIX_FADV_WILLNEED)`` would be free of
copies, but Linux reads at most the device's readahead window of each range it is given
(``force_page_cache_ra`` caps the request; a few MB of a 100 MB tensor).  A block's tensors are
not contiguous in the file (safetensors groups tensors by dtype alignment, then by name), so
each block is a list of ranges, adjacent ones merged.

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
import time
from collections.abc import Callable

from h3ms_async.log import get_logger

log = get_logger("Weights")

#: a header larger than this is not a checkpoint we read ahead (the spec allows 100 MB)
MAX_HEADER_BYTES = 100 << 20
#: how many blocks past the one being read are read ahead: enough that the disk keeps streaming
#: through the fill's pauses (the store's creation, a block's rows and casts), each block being
#: read at most this far ahead of its use (H3: ~0.9 GB a block)
BLOCKS_AHEAD = 4
#: one read: as large as a sequential read that streams at the disk's rate (the kernel splits it
#: into many device requests in flight at once)
PIECE_BYTES = 64 << 20
#: the reader stops when the fill has not moved on for this long (a fill that failed), and the
#: fill stops waiting for a reader that has read nothing for this long
IDLE_S = 60.0

#: a transformer block's tensor (not the token refiner's ``token_refiner.blocks.<j>``)
_BLOCK = re.compile(r"(?:^|diffusion_model\.)blocks\.(\d+)\.(.+)$")

Ranges = list[tuple[int, int]]


def read_header(path: str) -> tuple[int, dict[str, dict]]:
    """A safetensors file's data-section offset and its tensor entries (``name -> {"dtype",
    "shape", "data_offsets"}``, offsets relative to the data section; ``__metadata__`` left out).
    Raises ``ValueError`` for a file that is not safetensors."""
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
    header.pop("__metadata__", None)
    return 8 + n, header


Wanted = Callable[[int, str], bool]


def block_ranges(path: str, wanted: Wanted = lambda _i, _n: True) -> dict[int, Ranges]:
    """Block index -> the file's ``(offset, length)`` ranges holding that block's tensors that
    ``wanted(block index, in-block name after blocks.<i>.)`` accepts; adjacent ranges merged, in
    file order.  Raises ``ValueError`` for a file that is not safetensors."""
    base, header = read_header(path)
    spans: dict[int, Ranges] = {}
    for name, info in header.items():
        m = _BLOCK.search(name)
        if m is None or not wanted(int(m.group(1)), m.group(2)):
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
    """Reads blocks into the page cache ahead of the fill.  :meth:`reading` (block ``i`` is about
    to be read) lets a background thread read, in block order from the first block asked for,
    every block up to ``i`` + :data:`BLOCKS_AHEAD` (none the fill is past), each block's ranges in
    order in :data:`PIECE_BYTES` reads; a piece already cached is skipped.  It returns once block
    ``i`` is in, so the fill's reads of it find their pages cached (or when the reader ended, or
    read nothing for :data:`IDLE_S`).  The thread ends after the last block, at :meth:`close`, or
    when the fill stalls for :data:`IDLE_S`.  :meth:`wait` joins the reads asked for so far
    (tests); ``read_bytes`` and ``cached_bytes`` count the pieces read and skipped."""

    def __init__(self, path: str, ranges: dict[int, Ranges]) -> None:
        self.path = path
        self.ranges = ranges
        self.read_bytes = 0
        self.cached_bytes = 0
        self._cond = threading.Condition()
        self._at = -1  # the block the fill is reading
        self._done = -1  # the last block read ahead
        self._ended = False
        self._stop = False
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, path: str, wanted: Wanted) -> BlockReadahead | None:
        """The readahead of a safetensors ``path`` (None, logged, for a file it cannot read)."""
        try:
            return cls(path, block_ranges(path, wanted))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.info("no readahead for %s: %s", path, exc)
            return None

    def reading(self, i: int) -> None:
        with self._cond:
            self._at = max(self._at, i)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(i,), name="h3ms-readahead", daemon=True
                )
                self._thread.start()
            if i not in self.ranges:
                return
            seen, since = -1, 0.0
            while not self._ended and self._done < i:
                now = time.monotonic()
                if (moved := self.read_bytes + self.cached_bytes) != seen:
                    seen, since = moved, now
                elif now - since >= IDLE_S:
                    log.info("readahead of %s: no progress, block %d read directly", self.path, i)
                    return
                self._cond.wait(IDLE_S - (now - since))

    def _run(self, first: int) -> None:
        fds: list[int] = []  # the reader's, and one whose 1-byte probes leave its stream alone
        try:
            while len(fds) < 2:
                fds.append(os.open(self.path, os.O_RDONLY))
        except OSError as exc:
            for f in fds:
                os.close(f)
            log.info("readahead of %s stopped: %s", self.path, exc)
            self._end()
            return
        fd, probe = fds
        started = time.monotonic()
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            buf = memoryview(bytearray(PIECE_BYTES))
            for j in sorted(b for b in self.ranges if b >= first):
                with self._cond:
                    while not self._stop and j > self._at + BLOCKS_AHEAD:
                        if not self._cond.wait(IDLE_S):
                            log.info("readahead of %s stopped: the fill stalled", self.path)
                            return
                    if self._stop:
                        return
                    if j < self._at:
                        continue  # the fill is past it
                for off, length in self.ranges[j]:
                    for k in range(0, length, PIECE_BYTES):
                        self._piece(fd, probe, buf, off + k, min(PIECE_BYTES, length - k))
                with self._cond:
                    self._done = j
                    self._cond.notify_all()
        except OSError as exc:
            log.info("readahead of %s stopped: %s", self.path, exc)
        finally:
            for f in fds:
                os.close(f)
            self._end()
            log.info(
                "readahead of %s: %.2f GB read, %.2f GB found cached, in %.2fs",
                os.path.basename(self.path),
                self.read_bytes / 1e9,
                self.cached_bytes / 1e9,
                time.monotonic() - started,
            )

    def _piece(self, fd: int, probe: int, buf: memoryview, off: int, n: int) -> None:
        if _cached(probe, off, n):
            with self._cond:
                self.cached_bytes += n
                self._cond.notify_all()
            return
        done = 0
        while done < n:
            got = os.preadv(fd, [buf[: n - done]], off + done)
            if got <= 0:
                break
            done += got
        with self._cond:
            self.read_bytes += done
            self._cond.notify_all()

    def _end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, timeout: float = 30.0) -> None:
        """Until every block asked for so far is read (or the reader ended)."""
        with self._cond:
            last = max((b for b in self.ranges if b <= self._at + BLOCKS_AHEAD), default=-1)
            self._cond.wait_for(lambda: self._ended or self._done >= last, timeout)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(IDLE_S)


def _cached(fd: int, off: int, n: int) -> bool:
    """Whether a piece's first, middle and last pages are in the page cache: a read that may not
    wait for the disk (``RWF_NOWAIT``) of one byte at each."""
    one = bytearray(1)
    try:
        return all(
            os.preadv(fd, [one], at, os.RWF_NOWAIT) == 1 for at in (off, off + n // 2, off + n - 1)
        )
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: this filesystem cannot say
        return False
