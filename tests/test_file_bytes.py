"""Tensors whose bytes lie unchanged in their file (``h3ms_async/runtime/file_bytes.py``), written into the weight
store, on a real file and real shared memory: a mapped tensor is written through the segment's descriptor, equal to
the file's bytes, and a store filled from such sources holds exactly the checkpoint's tensors and counts what came
from the file."""
from __future__ import annotations

import mmap
import os
import warnings

import pytest
import torch

from h3ms_async.runtime.file_bytes import FileBytes, FileMaps
from h3ms_async.runtime.readahead import read_header
from h3ms_async.runtime.weight_store import fill
from workers.runtime.shm import Arena, Segment, ShmError


def _mapped(path: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[FileBytes, mmap.mmap, int]:
    """``path``'s bytes at ``offset`` as a view of a read-only mapping (as ComfyUI maps its checkpoint), the mapping
    and its descriptor."""
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    n = torch.Size(shape).numel()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        view = torch.frombuffer(mm, dtype=dtype, count=n, offset=offset).view(shape)
    return FileBytes(view, fd, offset), mm, fd


def test_a_mapped_tensor_is_written_whole_into_its_blocks_segment(tmp_path):
    """A 5 MiB bf16 tensor at an odd offset of a file, written through the segment's descriptor from the fill's own
    mapping of the file (as the fill writes it), equals the file's bytes, and the segment's pages were allocated by
    that write."""
    from h3ms_async.runtime.weight_store import _write

    raw = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "blob.bin"
    path.write_bytes(raw.numpy().tobytes())
    shape = (1280, 2048)  # 5 MiB of bf16
    src, mm, fd = _mapped(str(path), 12345, torch.bfloat16, shape)
    seg = Segment.create(8 << 20, "fbtest", reserve=False)
    try:
        desc = Arena(seg).alloc("bfloat16", shape)
        assert os.fstat(seg._fd).st_blocks == 0
        files = FileMaps()
        try:
            assert _write(seg, desc, src, files) is True
        finally:
            files.close()
        assert os.fstat(seg._fd).st_blocks * 512 >= 5 << 20
        dest = seg.tensor(desc)
        assert torch.equal(dest.view(torch.uint8).reshape(-1), raw[12345:12345 + (5 << 20)])
        del dest
    finally:
        seg.close()
        os.close(fd)


def test_a_write_past_the_segment_and_a_strided_file_tensor_are_refused():
    seg = Segment.create(4096, "fbtest", reserve=False)
    try:
        with pytest.raises(ShmError, match=r"range \[2048, 6144\) is outside segment"):
            seg.write(2048, memoryview(bytes(4096)))
    finally:
        seg.close()
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        FileBytes(torch.zeros(8, 8).t(), 0, 0)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        FileBytes(torch.zeros(8), 0, -1)


def test_a_file_range_past_the_files_end_is_refused(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    files = FileMaps()
    try:
        with pytest.raises(ValueError, match=r"file range \[2048, 6144\) is past the file's end \(4096 bytes\)"):
            files.view(FileBytes(torch.zeros(4096, dtype=torch.uint8), fd, 2048))
    finally:
        files.close()
        os.close(fd)


class _Checkpoint:
    """A real safetensors file of ``blocks`` blocks (an int8 qkv with its scale, a bf16 norm) and each tensor's file
    source: a view of a read-only mapping with its own range, from the file's header."""

    NAMES = ("attn.qkv.weight", "attn.qkv.weight_scale", "norm1.weight")

    def __init__(self, tmp_path, blocks: int, seed: int) -> None:
        from safetensors.torch import load_file, save_file

        g = torch.Generator().manual_seed(seed)
        sd = {}
        for i in range(blocks):
            sd[f"blocks.{i}.attn.qkv.weight"] = torch.randint(-60, 60, (384, 256), dtype=torch.int8, generator=g)
            sd[f"blocks.{i}.attn.qkv.weight_scale"] = torch.rand(1, generator=g)
            sd[f"blocks.{i}.norm1.weight"] = torch.randn(256, generator=g).to(torch.bfloat16)
        self.path = str(tmp_path / "ck.safetensors")
        save_file(sd, self.path)
        self.loaded = load_file(self.path)
        self.fds: list[int] = []

    def sources(self, i: int) -> dict[str, FileBytes]:
        base, header = read_header(self.path)
        out = {}
        for name in self.NAMES:
            a, b = header[f"blocks.{i}.{name}"]["data_offsets"]
            t = self.loaded[f"blocks.{i}.{name}"]
            assert b - a == t.numel() * t.element_size()
            out[name], _mm, fd = _mapped(self.path, base + a, t.dtype, tuple(t.shape))
            self.fds.append(fd)
        return out

    def equals(self, store, i: int) -> bool:
        return all(torch.equal(t, self.loaded[f"blocks.{i}.{name}"]) for name, t in store.block(i).items())

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def test_a_store_filled_from_the_file_holds_the_checkpoints_tensors(tmp_path):
    """Three blocks of a real safetensors file, handed to the fill as file ranges of a mapping: the store equals what
    safetensors loads, and every byte is counted as the file's."""
    ck = _Checkpoint(tmp_path, 3, seed=5)
    store = fill(("file-bytes", ck.path), 3, ck.sources)
    try:
        assert all(ck.equals(store, i) for i in range(3))
        assert store.file_bytes == sum(t.numel() * t.element_size() for t in ck.loaded.values())
    finally:
        store.release()
        ck.close()


def test_a_patch_change_restores_unpatched_tensors_from_the_file(tmp_path):
    """A store filled with a patched qkv (a tensor) beside file ranges takes the unpatched patch set in place: the qkv
    comes back from the file, byte for byte, and only its module's tensors are rewritten."""
    from h3ms_async.runtime.weight_store import PatchedKey

    ck = _Checkpoint(tmp_path, 2, seed=6)

    def patched(i: int):
        return {**ck.sources(i), "attn.qkv.weight": ck.loaded[f"blocks.{i}.attn.qkv.weight"] * 2}

    touched = frozenset((i, "attn.qkv.weight") for i in range(2))
    store = fill(PatchedKey(("f",), "lora", touched), 2, patched)
    try:
        assert torch.equal(store.block(1)["attn.qkv.weight"], ck.loaded["blocks.1.attn.qkv.weight"] * 2)
        done = store.rewrite(PatchedKey(("f",), "", frozenset()), ck.sources)
        qkv = ("attn.qkv.weight", "attn.qkv.weight_scale")
        assert done.blocks == ((0, qkv), (1, qkv))
        assert all(ck.equals(store, i) for i in range(2))
    finally:
        store.release()
        ck.close()
