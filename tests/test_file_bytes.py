"""Tensors read straight from their file into the weight store (``h3ms_async/runtime/file_bytes.py``), on a real
file and real shared memory: the bytes come by ``pread`` in pieces, several at once, equal to the file's, and a
store filled from such sources holds exactly the checkpoint's tensors and counts what it read from the file."""
from __future__ import annotations

import mmap
import os
import warnings

import pytest
import torch

from h3ms_async.runtime import file_bytes
from h3ms_async.runtime.file_bytes import FileBytes, FileReader
from h3ms_async.runtime.weight_store import fill
from workers.runtime.shm import Arena, Segment


def _mapped(path: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[FileBytes, mmap.mmap]:
    """``path``'s bytes at ``offset`` as a view of a read-only mapping (as ComfyUI maps its checkpoint), with its file
    range."""
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    n = torch.Size(shape).numel()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        view = torch.frombuffer(mm, dtype=dtype, count=n, offset=offset).view(shape)
    return FileBytes(view, fd, offset), mm


def test_a_tensor_comes_whole_in_pieces_at_once(tmp_path, monkeypatch):
    """A 5 MiB bf16 tensor at an odd file offset, read in 1 MiB pieces by three threads into shared memory, equals
    the file's bytes."""
    monkeypatch.setattr(file_bytes, "PIECE_BYTES", 1 << 20)
    raw = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "blob.bin"
    path.write_bytes(raw.numpy().tobytes())
    shape = (1280, 2048)  # 5 MiB of bf16
    src, mm = _mapped(str(path), 12345, torch.bfloat16, shape)
    seg = Segment.create(8 << 20, "fbtest")
    reader = FileReader(threads=3)
    try:
        dest = seg.tensor(Arena(seg).alloc("bfloat16", shape))
        reader.read_into(dest, src)
        assert reader.bytes == 5 << 20
        assert torch.equal(dest.view(torch.uint8).reshape(-1), raw[12345:12345 + (5 << 20)])
        assert torch.equal(dest.view(torch.uint8), src.tensor.view(torch.uint8))
    finally:
        reader.close()
        seg.close()
        os.close(src.fd)


def test_a_file_that_ends_early_and_a_wrong_destination_are_refused(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    reader = FileReader(threads=2)
    try:
        past_end = FileBytes(torch.zeros(4096, dtype=torch.uint8), fd, 2048)
        with pytest.raises(OSError, match="file ended 2048 bytes early at offset 4096"):
            reader.read_into(torch.empty(4096, dtype=torch.uint8), past_end)
        with pytest.raises(ValueError, match="destination holds 100 bytes, the file range 4096"):
            reader.read_into(torch.empty(100, dtype=torch.uint8), FileBytes(torch.zeros(4096, dtype=torch.uint8),
                                                                            fd, 0))
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            FileBytes(torch.zeros(8, 8).t(), fd, 0)
    finally:
        reader.close()
        os.close(fd)


def test_a_store_filled_from_the_file_holds_the_checkpoints_tensors(tmp_path):
    """Three blocks of a real safetensors file, handed to the fill as file ranges of a mapping: the store equals what
    safetensors loads, and every byte came by pread."""
    from safetensors.torch import load_file, save_file

    from h3ms_async.runtime.readahead import block_ranges

    g = torch.Generator().manual_seed(5)
    sd = {}
    for i in range(3):
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.randint(-127, 127, (384, 256), dtype=torch.int8, generator=g)
        sd[f"blocks.{i}.attn.qkv.weight_scale"] = torch.rand(1, generator=g)
        sd[f"blocks.{i}.norm1.weight"] = torch.randn(256, generator=g).to(torch.bfloat16)
    path = str(tmp_path / "ck.safetensors")
    save_file(sd, path)
    loaded = load_file(path)
    # each tensor's own range: ``block_ranges`` of a one-tensor filter gives exactly its bytes
    maps = []

    def read(i: int):
        out = {}
        for name in ("attn.qkv.weight", "attn.qkv.weight_scale", "norm1.weight"):
            ((offset, length),) = block_ranges(path, lambda n, name=name: n == name)[i]
            t = loaded[f"blocks.{i}.{name}"]
            assert length == t.numel() * t.element_size()
            src, mm = _mapped(path, offset, t.dtype, tuple(t.shape))
            maps.append((src.fd, mm))
            out[name] = src
        return out

    store = fill(("file-bytes", path), 3, read)
    try:
        for i in range(3):
            for name, t in store.block(i).items():
                assert torch.equal(t, loaded[f"blocks.{i}.{name}"]), (i, name)
        assert store.file_bytes == sum(t.numel() * t.element_size() for t in loaded.values())
    finally:
        store.release()
        for fd, _mm in maps:
            os.close(fd)


def test_a_patch_change_restores_unpatched_tensors_from_the_file(tmp_path):
    """A store filled with a patched qkv (a tensor) beside file ranges takes the unpatched patch set in place: the qkv
    comes back from the file, byte for byte, and only it is rewritten."""
    from safetensors.torch import load_file, save_file

    from h3ms_async.runtime.readahead import block_ranges
    from h3ms_async.runtime.weight_store import PatchedKey

    g = torch.Generator().manual_seed(6)
    sd = {}
    for i in range(2):
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.randint(-60, 60, (96, 64), dtype=torch.int8, generator=g)
        sd[f"blocks.{i}.norm1.weight"] = torch.randn(64, generator=g).to(torch.bfloat16)
    path = str(tmp_path / "ck.safetensors")
    save_file(sd, path)
    loaded = load_file(path)
    fds = []

    def reader(patched: bool):
        def read(i: int):
            out = {}
            for name in ("attn.qkv.weight", "norm1.weight"):
                ((offset, _),) = block_ranges(path, lambda n, name=name: n == name)[i]
                t = loaded[f"blocks.{i}.{name}"]
                src, _mm = _mapped(path, offset, t.dtype, tuple(t.shape))
                fds.append(src.fd)
                out[name] = src
            if patched:
                out["attn.qkv.weight"] = loaded[f"blocks.{i}.attn.qkv.weight"] * 2
            return out
        return read

    touched = frozenset((i, "attn.qkv.weight") for i in range(2))
    store = fill(PatchedKey(("f",), "lora", touched), 2, reader(True))
    try:
        assert torch.equal(store.block(1)["attn.qkv.weight"], loaded["blocks.1.attn.qkv.weight"] * 2)
        done = store.rewrite(PatchedKey(("f",), "", frozenset()), reader(False))
        assert done.blocks == ((0, ("attn.qkv.weight",)), (1, ("attn.qkv.weight",)))
        for i in range(2):
            for name, t in store.block(i).items():
                assert torch.equal(t, loaded[f"blocks.{i}.{name}"]), (i, name)
    finally:
        store.release()
        for fd in fds:
            os.close(fd)
