"""Shared-memory segments (workers/runtime/shm.py): real unnamed /dev/shm files, real mappings."""
import os
import stat
import subprocess
import sys

import pytest
import torch

from workers.runtime import shm
from workers.runtime.protocol import TensorDesc
from workers.runtime.shm import Arena, Segment, ShmError

pytestmark = pytest.mark.fast

MiB = 1 << 20


def _ours() -> set:
    """Unnamed /dev/shm files this process holds open or mapped."""
    return shm.held_shm(os.getpid())


@pytest.fixture(autouse=True)
def no_leaks():
    before = _ours()
    yield
    assert _ours() == before, "a test left shared-memory segments behind"


def test_create_attach_share_bytes():
    with Segment.create(10_000, "t") as seg:
        assert seg.size == 12288  # rounded up to 4 KiB
        assert seg.name.startswith(f"h3ms-{os.getpid()}-") and seg.name.endswith("-t")
        st = os.stat(f"/proc/self/fd/{int(seg.name.split('-')[2][:8], 16)}")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_blocks * 512 >= seg.size  # pages reserved
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"h3ms-{os.getpid()}-")]  # no name, ever
        other = Segment.attach(seg.name)
        try:
            assert other.size == seg.size and not other.owner
            with seg.buffer(100, 4) as mv:
                mv[:] = b"abcd"
            with other.buffer(100, 4) as mv:
                assert bytes(mv) == b"abcd"
        finally:
            other.close()
        assert shm.owner_holds(seg.name)
    assert not shm.owner_holds(seg.name)
    with pytest.raises(ShmError, match="does not exist"):
        Segment.attach(seg.name)


def test_another_process_attaches_through_the_owner():
    with Segment.create(4096, "xproc") as seg:
        with seg.buffer(0, 5) as mv:
            mv[:] = b"hello"
        code = ("import sys; from workers.runtime.shm import Segment; s = Segment.attach(sys.argv[1]); "
                "b = s.buffer(0, 5); print(bytes(b).decode()); b[:] = b'HELLO'; b.release(); s.close()")
        out = subprocess.run([sys.executable, "-c", code, seg.name], capture_output=True, text=True, timeout=60,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode == 0 and out.stdout.strip() == "hello", out.stderr
        with seg.buffer(0, 5) as mv:
            assert bytes(mv) == b"HELLO"


def test_tensor_views_are_zero_copy_for_every_dtype():
    with Segment.create(1 * MiB, "views") as seg:
        arena = Arena(seg)
        for name in ["float32", "bfloat16", "float16", "int8", "int64", "uint8"]:
            d = arena.alloc(name, [3, 5])
            assert d.off % shm.ALIGN == 0
            t = seg.tensor(d)
            assert t.dtype == getattr(torch, name) and t.shape == (3, 5)
            t.copy_(torch.arange(15).reshape(3, 5).to(t.dtype))
            again = seg.tensor(d)
            assert again.data_ptr() == t.data_ptr()
            assert torch.equal(again, torch.arange(15).reshape(3, 5).to(t.dtype))
        # a view written here is seen through another mapping of the same segment
        other = Segment.attach(seg.name)
        try:
            d = TensorDesc(seg=seg.name, off=0, dtype="float32", shape=[3, 5])
            assert torch.equal(other.tensor(d), seg.tensor(d))
        finally:
            other.close()
        del t, again


def test_tensor_desc_errors():
    with Segment.create(8192, "err") as seg:
        with pytest.raises(ShmError, match="outside segment"):
            seg.tensor(TensorDesc(seg=seg.name, off=4096, dtype="float32", shape=[1025]))
        with pytest.raises(ShmError, match="points into segment h3ms-9-"):
            seg.tensor(TensorDesc(seg="h3ms-9-000000030123456789abcdef-x", off=0, dtype="uint8", shape=[1]))
        with pytest.raises(ShmError, match="dtype"):
            Arena(seg).alloc("complex64", [1])
        empty = seg.tensor(TensorDesc(seg=seg.name, off=0, dtype="float32", shape=[0, 4]))
        assert empty.shape == (0, 4)


def test_attach_refuses_foreign_and_missing_names():
    with pytest.raises(ShmError, match="not a segment name"):
        Segment.attach("../../etc/passwd")
    with pytest.raises(ShmError, match="not a segment name"):
        Segment.attach(f"h3ms-{os.getpid()}-00000000deadbeef-gone")  # the old named form
    with pytest.raises(ShmError, match="does not exist"):
        Segment.attach(f"h3ms-{os.getpid()}-000003e70000000000000001-gone")
    with pytest.raises(ShmError, match="does not exist"):  # fd 0 is not a tmpfs file of that inode
        Segment.attach(f"h3ms-{os.getpid()}-000000000000000000000001-stdin")
    with pytest.raises(ShmError, match="tag"):
        Segment.create(4096, "bad/tag")
    with pytest.raises(ShmError, match="> 0"):
        Segment.create(0, "zero")


def test_arena_alignment_and_full():
    with Segment.create(3 * 4096, "arena") as seg:
        arena = Arena(seg)
        a = arena.alloc("uint8", [1])
        b = arena.alloc("float32", [1024])
        assert (a.off, b.off) == (0, 4096)
        with pytest.raises(ShmError, match="arena .* is full"):
            arena.alloc("float32", [2048])


def test_close_with_live_views_and_double_unlink():
    seg = Segment.create(4096, "live")
    t = seg.tensor(TensorDesc(seg=seg.name, off=0, dtype="int64", shape=[4]))
    t.fill_(7)
    seg.close()  # the view keeps the mapping alive
    assert int(t.sum()) == 28
    seg.unlink()
    seg.unlink()
    with pytest.raises(ShmError, match="closed"):
        seg.buffer()
    del t


def test_too_large_names_shm_size():
    with pytest.raises(ShmError, match=r"/dev/shm is too small: .* MiB free of .* --shm-size"):
        Segment.create(1 << 50, "huge")
    with pytest.raises(ShmError, match=r"/dev/shm is too small: .* MiB free of .* --shm-size"):
        Segment.create(1 << 50, "huge", reserve=False)


def test_a_segment_sized_only_is_reserved_range_by_range_by_its_owner():
    page = os.sysconf("SC_PAGE_SIZE")
    with Segment.create(16 * page, "sized", reserve=False) as seg:
        assert os.fstat(seg._fd).st_blocks == 0
        seg.reserve(4 * page, 2 * page)
        assert os.fstat(seg._fd).st_blocks * 512 == 2 * page
        with pytest.raises(ShmError, match="outside segment"):
            seg.reserve(15 * page, 2 * page)
        other = Segment.attach(seg.name)
        try:
            with pytest.raises(ShmError, match="only the owner"):
                other.reserve(0, page)
        finally:
            other.close()


def test_register_cuda_is_a_noop_on_cpu():
    with Segment.create(4096, "cpu") as seg:
        assert shm.register_cuda(seg, "cpu") is False
        shm.unregister_cuda(seg)
