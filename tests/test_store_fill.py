"""The weight store's fill (``h3ms_async/runtime/weight_store.py``) on real shared memory: a block's copy into the
store overlaps the next block's read, the store holds exactly the blocks read, and a copy that fails fails the fill
for every waiting rank with its own error, and the blocks' pages are reserved beside the copies, each block's before
its copy."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from h3ms_async.runtime.weight_store import size_store
from workers.runtime.fill_progress import FAILED
from workers.runtime.shm import ShmError

BLOCKS = 5


def _block(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return {"qkv.weight": torch.randint(-127, 127, (256, 128), dtype=torch.int8, generator=g),
            "qkv.weight_scale": torch.rand(1, generator=g),
            "norm1.weight": torch.randn(128, generator=g).to(torch.bfloat16)}


def _no_segments_left() -> bool:
    return not [n for n in os.listdir("/dev/shm") if n.startswith(f"h3ms-{os.getpid()}-")]


def _watched_fill(tag: str, read, block: int, on_copy):
    """A store sized over ``read`` whose copy calls ``on_copy()`` as it starts block ``block`` (its first tensor)."""
    fill = size_store(("t", tag), BLOCKS, read)
    watched = next(iter(fill.store.manifest[block].values()))
    plain = fill.store.segment.tensor

    def tensor(desc):
        if desc == watched:
            on_copy()
        return plain(desc)

    fill.store.segment.tensor = tensor
    return fill


def test_a_blocks_copy_overlaps_the_next_blocks_read():
    """Block 0's copy into the store waits until block 1's read has begun: a fill that read and copied in turn would
    never read block 1 while block 0 copies, and the wait would time out."""
    reading_1 = threading.Event()
    overlapped = []

    def read(i: int) -> dict[str, torch.Tensor]:
        if i == 1:
            reading_1.set()
        return _block(i)

    def copying_0():
        if not overlapped:
            overlapped.append(reading_1.wait(10.0))

    fill = _watched_fill("overlap", read, 0, copying_0)
    store = fill.store
    try:
        fill.run()
        assert overlapped == [True]
        assert store.fill_progress().read() == BLOCKS
        # the reads and the copies each took part of the fill, the copies beside the reads
        assert 0 < store.read_seconds < store.fill_seconds and 0 < store.copy_seconds < store.fill_seconds
        for i in range(BLOCKS):
            got = store.block(i)
            assert got.keys() == _block(i).keys()
            assert all(torch.equal(got[k], v) for k, v in _block(i).items())
            del got
    finally:
        store.release()
    assert _no_segments_left()


def test_a_copy_that_fails_fails_the_fill_and_stops_the_reads():
    reads = []

    def read(i: int) -> dict[str, torch.Tensor]:
        reads.append(i)
        return _block(i)

    def copying_1():
        raise OSError("no space left on /dev/shm while copying block 1")

    fill = _watched_fill("copy fails", read, 1, copying_1)
    store = fill.store
    try:
        with pytest.raises(OSError, match="while copying block 1"):
            fill.run()
        assert store.fill_progress().read() == FAILED
        assert store.filled_at is None
        # the reader stops at the next block once the copy failed: at most two blocks past the failed one are read
        assert reads and max(reads) <= 3, reads
    finally:
        store.release()
    assert _no_segments_left()


def _allocated(store) -> int:
    """Bytes of the store's segment file that have pages (reserved or written)."""
    return os.fstat(store.segment._fd).st_blocks * 512


def test_the_blocks_pages_are_reserved_beside_the_copies_each_before_its_copy():
    """``size_store`` reserves only the progress word's and block 0's pages; the fill reserves the others on its own
    thread, and block 2's copy starts only after block 2's pages are reserved (its reservation made slow here)."""
    fill = size_store(("t", "reserve"), BLOCKS, _block)
    store = fill.store
    seg = store.segment
    per_block = store.nbytes // BLOCKS
    assert _allocated(store) <= seg.size - (BLOCKS - 2) * per_block
    block2 = min(d.off for d in store.manifest[2].values())
    reserved_2: list[float] = []
    plain_reserve = seg.reserve

    def reserve(off: int, nbytes: int) -> None:
        if off == block2:
            threading.Event().wait(0.3)
            plain_reserve(off, nbytes)
            reserved_2.append(time.monotonic())
        else:
            plain_reserve(off, nbytes)

    seg.reserve = reserve
    copying_2: list[float] = []
    watched = next(iter(store.manifest[2].values()))
    plain_tensor = seg.tensor

    def tensor(desc):
        if desc == watched and not copying_2:
            copying_2.append(time.monotonic())
        return plain_tensor(desc)

    seg.tensor = tensor
    try:
        fill.run()
        assert store.fill_progress().read() == BLOCKS
        assert len(reserved_2) == 1 and len(copying_2) == 1 and copying_2[0] >= reserved_2[0]
        assert _allocated(store) >= seg.size
        assert store.reserve_seconds >= 0.3
        assert all(torch.equal(store.block(i)[k], v) for i in range(BLOCKS) for k, v in _block(i).items())
    finally:
        store.release()
    assert _no_segments_left()


def test_a_reservation_that_fails_fails_the_fill_with_its_error():
    fill = size_store(("t", "reserve fails"), BLOCKS, _block)
    store = fill.store
    block3 = min(d.off for d in store.manifest[3].values())
    plain_reserve = store.segment.reserve

    def reserve(off: int, nbytes: int) -> None:
        if off == block3:
            raise ShmError("/dev/shm is too small: (block 3)")
        plain_reserve(off, nbytes)

    store.segment.reserve = reserve
    try:
        with pytest.raises(ShmError, match=r"too small: \(block 3\)"):
            fill.run()
        assert store.fill_progress().read() == FAILED
        assert store.filled_at is None
    finally:
        store.release()
    assert _no_segments_left()
