"""The fill's readahead (``h3ms_async/runtime/readahead.py``) on a real safetensors file: each block's ranges hold
exactly its tensors' bytes (the file groups tensors by dtype, so a block is several ranges), and asking for block 1
brings exactly its pages into the page cache of a file dropped from it (``mincore`` over a mapping of the file)."""
from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest
import torch

from h3ms_async.runtime.readahead import BLOCKS_AHEAD, BlockReadahead, block_ranges
from page_cache import drop

PAGE = os.sysconf("SC_PAGE_SIZE")


def _checkpoint(path: str, blocks: int = 3, qkv_rows: int = 2048) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file  # ComfyUI's requirement, installed with the ComfyUI tests' packages
    g = torch.Generator().manual_seed(3)
    sd = {"diffusion_model.patch_embed.weight": torch.randn(64, 64, generator=g),
          "diffusion_model.token_refiner.blocks.0.mlp.fc1.weight": torch.randn(64, 64, generator=g)}  # not a block
    for i in range(blocks):
        p = f"diffusion_model.blocks.{i}."
        sd[p + "attn.qkv_proj.weight"] = torch.randint(-127, 127, (qkv_rows, 2048), dtype=torch.int8, generator=g)
        sd[p + "attn.qkv_proj.weight_scale"] = torch.rand(512, 1, generator=g)
        sd[p + "norm1.weight"] = torch.randn(512, generator=g).to(torch.bfloat16)
        sd[p + "adaln_proj.linear.weight"] = torch.randn(256, 512, generator=g).to(torch.bfloat16)
    save_file(sd, path)
    return sd


def test_block_ranges_hold_exactly_the_blocks_tensors(tmp_path):
    path = str(tmp_path / "h3.safetensors")
    sd = _checkpoint(path)
    held = block_ranges(path, lambda _i, name: not name.startswith("adaln_proj."))
    assert sorted(held) == [0, 1, 2]
    data = open(path, "rb").read()
    for i, ranges in held.items():
        assert len(ranges) > 1  # int8, fp32 and bf16 tensors lie in different parts of the file
        got = b"".join(data[off:off + n] for off, n in ranges)
        names = [k for k in sd if k.startswith(f"diffusion_model.blocks.{i}.") and ".adaln_proj." not in k]
        want = sorted(sd[k].contiguous().view(torch.uint8).numpy().tobytes() for k in names)
        # the ranges are in file order; each tensor's bytes are one piece of them
        assert len(got) == sum(len(w) for w in want)
        assert all(w in got for w in want)
        assert sd[f"diffusion_model.blocks.{i}.adaln_proj.linear.weight"].view(torch.uint8).numpy().tobytes() \
            not in got
    with pytest.raises(ValueError, match="safetensors"):
        (tmp_path / "x.safetensors").write_bytes(b"\xff" * 7)
        block_ranges(str(tmp_path / "x.safetensors"))


def _pages(ranges: list[tuple[int, int]]) -> set[int]:
    return {p for off, n in ranges for p in range(off // PAGE, (off + n - 1) // PAGE + 1)}


def _own_pages(ranges: dict[int, list[tuple[int, int]]]) -> dict[int, set[int]]:
    """Each block's own pages: those no other block's ranges touch (small tensors of neighbouring blocks share
    pages)."""
    pages = {i: _pages(r) for i, r in ranges.items()}
    return {i: p - set().union(*(q for j, q in pages.items() if j != i)) for i, p in pages.items()}


def _resident(path: str) -> set[int]:
    """The file's pages in the page cache (``mincore`` over a shared read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return {p for p in range(pages) if vec[p] & 1}


def _cached_within(path: str, pages: set[int], deadline_s: float = 10.0) -> set[int]:
    """The file's cached pages once ``pages`` are among them, or at the deadline."""
    end = time.monotonic() + deadline_s
    while not pages <= (cached := _resident(path)) and time.monotonic() < end:
        time.sleep(0.02)
    return cached


def test_reading_a_block_brings_the_next_blocks_into_the_page_cache(tmp_path):
    path = str(tmp_path / "h3.safetensors")
    n, a = BLOCKS_AHEAD + 4, BLOCKS_AHEAD
    _checkpoint(path, blocks=n)
    wanted = lambda _i, name: not name.startswith("adaln_proj.")  # noqa: E731
    ranges = block_ranges(path, wanted)
    own = _own_pages(ranges)
    assert all(len(p) >= 64 for p in own.values())
    drop(path)
    if _resident(path) & own[0]:
        pytest.skip(f"this filesystem keeps {path}'s pages cached after POSIX_FADV_DONTNEED")
    ahead = BlockReadahead.of(path, wanted)
    assert ahead is not None
    ahead.reading(1)
    ahead.wait()

    def nbytes(blocks) -> int:
        return sum(n for i in blocks for _, n in ranges[i])

    # block 1 is read now and the next BLOCKS_AHEAD ahead of it, each once, and none other (the kernel's own
    # readahead may cache some of them before the reader gets there, and a little past them: the reader's counts
    # say what it took in, read or found cached)
    cached = _cached_within(path, set().union(*(own[i] for i in range(1, a + 2))))
    assert [own[i] <= cached for i in range(a + 2)] == [i > 0 for i in range(a + 2)]
    assert ahead.read_bytes + ahead.cached_bytes == nbytes(range(1, a + 2))
    ahead.reading(2)  # one more block is asked for now; the others were read once already
    ahead.wait()
    assert own[a + 2] <= _cached_within(path, own[a + 2])
    assert ahead.read_bytes + ahead.cached_bytes == nbytes(range(1, a + 3))


def test_a_tensor_larger_than_the_kernels_readahead_window_is_read_whole(tmp_path):
    """``posix_fadvise(WILLNEED)`` reads only the device's readahead window of a range (a few MB); the readahead
    reads the block itself, so every page of a 64 MiB tensor is cached once its block was asked for."""
    path = str(tmp_path / "h3.safetensors")
    _checkpoint(path, blocks=2, qkv_rows=32768)
    ranges = block_ranges(path)
    own0 = _pages(ranges[0]) - _pages(ranges[1])
    assert len(own0) * PAGE > 64 << 20
    drop(path)
    if _resident(path) & own0:
        pytest.skip(f"this filesystem keeps {path}'s pages cached after POSIX_FADV_DONTNEED")
    ahead = BlockReadahead(path, {0: ranges[0]})
    ahead.reading(0)
    ahead.wait()
    assert own0 <= _resident(path)
    assert ahead.read_bytes == sum(n for _, n in ranges[0]) and ahead.cached_bytes == 0
    ahead.close()
    assert ahead._thread is not None and not ahead._thread.is_alive()


def test_pieces_already_cached_are_not_read_again_and_close_ends_the_reader(tmp_path):
    path = str(tmp_path / "h3.safetensors")
    _checkpoint(path, blocks=BLOCKS_AHEAD + 4)
    with open(path, "rb") as f:
        while f.read(16 << 20):  # every page cached
            pass
    ranges = block_ranges(path)
    ahead = BlockReadahead(path, ranges)
    ahead.reading(0)
    ahead.wait()
    if ahead.read_bytes:
        pytest.skip("this filesystem cannot say whether a page is cached (RWF_NOWAIT)")
    assert ahead.cached_bytes == sum(n for i in range(BLOCKS_AHEAD + 1) for _, n in ranges[i])
    ahead.close()  # the fill stopped at block 0: the reader ends without reading the blocks past the window
    assert ahead._thread is not None and not ahead._thread.is_alive()
    assert ahead.cached_bytes == sum(n for i in range(BLOCKS_AHEAD + 1) for _, n in ranges[i])


def test_a_stalled_fill_ends_the_reader_and_closes_its_file(tmp_path, monkeypatch):
    """A fill that stops asking (it failed, or the store was refused after block 0) leaves no reader behind: the
    thread ends once the fill made no progress for ``IDLE_S`` and its file descriptor is closed."""
    import h3ms_async.runtime.readahead as ra
    monkeypatch.setattr(ra, "IDLE_S", 0.3)
    path = str(tmp_path / "h3.safetensors")
    _checkpoint(path, blocks=BLOCKS_AHEAD + 4)
    ahead = BlockReadahead(path, block_ranges(path))
    fds = set(os.listdir("/proc/self/fd"))
    ahead.reading(0)
    ahead.wait()
    assert ahead._thread is not None
    ahead._thread.join(10.0)
    assert not ahead._thread.is_alive()
    assert ahead.read_bytes + ahead.cached_bytes == sum(
        n for i in range(BLOCKS_AHEAD + 1) for _, n in block_ranges(path)[i])
    assert set(os.listdir("/proc/self/fd")) <= fds


def test_reading_returns_once_the_block_is_in_the_page_cache(tmp_path, monkeypatch):
    """The fill touches a block only after the reader has read it, so the disk serves one stream: with a reader
    slowed down, ``reading(1)`` still returns with every page of block 1 cached."""
    path = str(tmp_path / "h3.safetensors")
    _checkpoint(path, blocks=4)
    ranges = block_ranges(path)
    own1 = _own_pages(ranges)[1]
    drop(path)
    if _resident(path) & own1:
        pytest.skip(f"this filesystem keeps {path}'s pages cached after POSIX_FADV_DONTNEED")
    slow = BlockReadahead._piece

    def slowed(self, *args):
        time.sleep(0.05)
        slow(self, *args)

    monkeypatch.setattr(BlockReadahead, "_piece", slowed)
    ahead = BlockReadahead(path, ranges)
    ahead.reading(1)
    assert own1 <= _resident(path)
    ahead.close()


def test_a_reader_that_reads_nothing_does_not_hold_the_fill(tmp_path, monkeypatch):
    """A reader stuck on its disk lets the fill go on after ``IDLE_S`` without progress (the fill then reads the
    block itself), and ends once it is let go."""
    import threading

    import h3ms_async.runtime.readahead as ra
    monkeypatch.setattr(ra, "IDLE_S", 0.3)
    path = str(tmp_path / "h3.safetensors")
    _checkpoint(path, blocks=2)
    stuck = threading.Event()
    monkeypatch.setattr(BlockReadahead, "_piece", lambda self, *args: stuck.wait(10.0))
    ahead = BlockReadahead(path, block_ranges(path))
    t = time.monotonic()
    ahead.reading(0)
    assert 0.25 < time.monotonic() - t < 5.0
    stuck.set()
    ahead.close()
    assert ahead._thread is not None and not ahead._thread.is_alive()
