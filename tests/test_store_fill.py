"""The weight store's fill (``h3ms_async/runtime/weight_store.py``) on real shared memory: a block's write into the
store overlaps the next block's read, several blocks are written at once each into its own segment, the progress word
counts only the leading complete blocks, the store holds exactly the blocks read, and a write that fails fails the
fill for every waiting rank with its own error."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from h3ms_async.runtime import weight_store
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
    """A store sized over ``read`` (tensors: each reserved, then copied) whose writer calls ``on_copy()`` as it
    starts block ``block``."""
    fill = size_store(("t", tag), BLOCKS, read)
    seg = fill.store.blocks[block]
    plain = seg.reserve

    def reserve(off, nbytes):
        if off == 0:
            on_copy()
        return plain(off, nbytes)

    seg.reserve = reserve
    return fill


def test_a_blocks_copy_overlaps_the_next_blocks_read():
    """Block 0's write into the store waits until block 1's read has begun: a fill that read and wrote in turn would
    never read block 1 while block 0 is written, and the wait would time out."""
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
        # the reads and the writes each took part of the fill, the writes beside the reads
        assert 0 < store.read_seconds < store.fill_seconds and 0 < store.copy_seconds < store.fill_seconds
        assert len({d.seg for i in range(BLOCKS) for d in store.manifest[i].values()}) == BLOCKS
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
        raise ShmError("/dev/shm is too small while writing block 1")

    fill = _watched_fill("copy fails", read, 1, copying_1)
    store = fill.store
    try:
        with pytest.raises(ShmError, match="while writing block 1"):
            fill.run()
        assert store.fill_progress().read() == FAILED
        assert store.filled_at is None
        # the reader stops once a write failed: at most the writers' blocks past the failed one are read
        assert reads and max(reads) <= 1 + min(weight_store.WRITERS, os.cpu_count() or 1), reads
    finally:
        store.release()
    assert _no_segments_left()


def _file_blocks(path) -> tuple[int, list[dict]]:
    """Every block's tensors written one after another into the file at ``path``: its open descriptor and each block's
    tensors as their file ranges (``FileBytes``, what the node hands over for a checkpoint's own bytes)."""
    from h3ms_async.runtime.file_bytes import FileBytes

    blocks, raw = [], bytearray()
    for i in range(BLOCKS):
        entry = {}
        for k, v in _block(i).items():
            entry[k] = (v, len(raw))
            raw += v.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        blocks.append(entry)
    path.write_bytes(bytes(raw))
    fd = os.open(path, os.O_RDONLY)
    return fd, [{k: FileBytes(v, fd, off) for k, (v, off) in entry.items()} for entry in blocks]


def test_blocks_are_written_at_once_and_published_only_when_every_block_before_is_complete(monkeypatch, tmp_path):
    """With two writers, block 2 is written while block 1's write is held back: the progress word stays at 1 until
    block 1 is complete, then jumps past every complete block. Each block's pages are allocated by its own write
    into its own segment (none before). The blocks are a file's bytes (they hold no memory of their own): blocks of
    tensors are written one at a time, as the next one is read."""
    monkeypatch.setattr(weight_store, "WRITERS", 2)
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two writers")
    fd, sources = _file_blocks(tmp_path / "blocks.bin")
    fill = size_store(("t", "parallel"), BLOCKS, lambda i: sources[i])
    store = fill.store
    assert all(os.fstat(seg._fd).st_blocks == 0 for seg in store.blocks)
    release_1 = threading.Event()
    seen: list[int] = []
    plain1, plain2 = store.blocks[1].write, store.blocks[2].write

    def write1(off, data):
        assert release_1.wait(10.0), "block 2 was never written while block 1 waited"
        return plain1(off, data)

    def write2(off, data):
        out = plain2(off, data)
        if not release_1.is_set():
            seen.append(store.fill_progress().read())
            release_1.set()
        return out

    store.blocks[1].write, store.blocks[2].write = write1, write2
    try:
        fill.run()
        assert seen and all(p <= 1 for p in seen), seen
        assert store.fill_progress().read() == BLOCKS
        assert all(os.fstat(seg._fd).st_blocks * 512 >= seg.size for seg in store.blocks)
        assert all(torch.equal(store.block(i)[k], v) for i in range(BLOCKS) for k, v in _block(i).items())
        assert store.file_bytes == store.nbytes - sum(
            seg.size - sum(d.nbytes for d in store.manifest[i].values()) for i, seg in enumerate(store.blocks))
    finally:
        store.release()
        os.close(fd)
    assert _no_segments_left()


def test_a_store_without_room_in_dev_shm_is_refused_before_any_segment_is_made(monkeypatch):
    from h3ms_async.runtime.weight_store import WeightStoreRefused
    from workers.runtime import shm

    class Full:
        f_bavail, f_frsize, f_blocks = 1, 4096, 16

    made = []
    create = shm.Segment.create
    monkeypatch.setattr(shm.os, "statvfs", lambda _p: Full)
    monkeypatch.setattr(shm.Segment, "create", classmethod(lambda cls, *a, **k: made.append(a) or create(*a, **k)))
    with pytest.raises(WeightStoreRefused, match=r"/dev/shm is too small: .* --shm-size"):
        size_store(("t", "full"), BLOCKS, _block)
    assert made == []
