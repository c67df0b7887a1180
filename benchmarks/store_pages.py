"""What a new weight store's pages cost, and how a cached file's bytes get into them fastest, side by side.

    python benchmarks/store_pages.py --gib 4 --out /tmp/pages.json          (any Linux machine; no GPU, no ComfyUI)

A store is a tmpfs file (``workers/runtime/shm.py``); filling it from a checkpoint in the page cache costs the
allocation (and zeroing) of every page, a page-table entry per 4 KiB page in the filling process, and the copy. Each
row fills ``--gib`` GiB from a cached file by ``pread`` (``--threads`` readers, 8 MiB pieces, as
``FileReader`` reads) and times its phases:

* ``fallocate``: the pages reserved by ``posix_fallocate`` (how ``Segment.create`` makes a segment), then the reads
  map each page on its first write (one write fault per 4 KiB page);
* ``fallocate_populate``: reserved, then mapped by ``MADV_POPULATE_WRITE`` over each reader's share, then read;
* ``populate``: sized only (``ftruncate``), each reader allocating and mapping its share by ``MADV_POPULATE_WRITE``;
* ``fault``: sized only, the reads allocating the pages as they write them;
* ``write``: sized only, each reader writing its share through the segment's descriptor (``pwrite`` from a view of
  the file's read-only mapping, as ComfyUI maps its checkpoint): the kernel allocates each page as it writes it,
  without zeroing it first, without a page fault in the filler, and a full /dev/shm is an error, not a SIGBUS;
* ``splice``: sized only, each reader moving its share from the file to the segment through a pipe: no copy through
  user memory at all;
* ``reused``: a segment whose pages were written before (a store of the same size filled again);
* ``fallocate_files`` / ``write_files``: the store as one tmpfs file per reader instead of one file, each reader
  reserving (``posix_fallocate``) and reading, or writing, its own file: tmpfs allocates a file's pages under that
  file's locks, so separate files may allocate in parallel where one file does not.

Beside them: a private anonymous copy's rate (torch's ``copy_``, all cores) into fresh pages and into pages already
written, the reference the fill is held to, and the kernel's huge-page settings for shmem.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import signal
import sys
import threading
import time

import torch

MADV_POPULATE_WRITE = 23
F_SETPIPE_SZ = 1031  # fcntl.h
PIECE = 8 << 20
PIPE_BYTES = 1 << 20
HOWS = ("fallocate", "fallocate_populate", "populate", "fault", "write", "splice")
FILES_HOWS = ("fallocate_files", "write_files")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _addr(mm: mmap.mmap) -> tuple[int, object]:
    buf = (ctypes.c_char * len(mm)).from_buffer(mm)
    return ctypes.addressof(buf), buf


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts // PIECE) * PIECE
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _parallel(fn, ranges) -> None:
    errors: list[BaseException] = []

    def run(a: int, b: int) -> None:
        try:
            fn(a, b)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    ts = [threading.Thread(target=run, args=r) for r in ranges]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def _in_pieces(a: int, b: int, move) -> None:
    """``[a, b)`` in ``PIECE`` pieces, each moved whole by ``move(at, end)`` (which returns how many bytes it moved
    from ``at`` on, as ``preadv``/``pwritev`` do)."""
    for p in range(a, b, PIECE):
        q = min(b, p + PIECE)
        at = p
        while at < q:
            at += move(at, q)


def _writes(src_fd: int, dst_fd: int, how: str):
    """A reader that fills ``[a, b)`` of the segment through its descriptor: ``write`` by ``pwrite`` from a view of
    the source's read-only mapping (as ComfyUI maps its checkpoint), ``splice`` from the file through a pipe."""
    if how == "write":
        src = mmap.mmap(src_fd, 0, prot=mmap.PROT_READ)

        def write(a: int, b: int) -> None:
            view = memoryview(src)
            try:
                _in_pieces(a, b, lambda at, q: os.pwritev(dst_fd, [view[at:q]], at))
            finally:
                view.release()
        return write, src.close

    def splice(a: int, b: int) -> None:
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
            p = a
            while p < b:
                got = os.splice(src_fd, w, min(PIPE_BYTES, b - p), offset_src=p)
                done = 0
                while done < got:
                    done += os.splice(r, dst_fd, got - done, offset_dst=p + done)
                p += got
        finally:
            os.close(r)
            os.close(w)
    return splice, lambda: None


def one(src_fd: int, n: int, threads: int, how: str, reused: mmap.mmap | None = None) -> dict:
    t0 = time.perf_counter()
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        if how in ("fallocate", "fallocate_populate"):
            os.posix_fallocate(fd, 0, n)
        else:
            os.ftruncate(fd, n)
        mm = reused if reused is not None else mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        t1 = time.perf_counter()
        ranges = _split(n, threads)
        base, keep = _addr(mm)
        if how in ("populate", "fallocate_populate"):
            def populate(a: int, b: int) -> None:
                if _libc.madvise(base + a, b - a, MADV_POPULATE_WRITE) != 0:
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
            _parallel(populate, ranges)
        t2 = time.perf_counter()
        view = memoryview(mm)
        if how in ("write", "splice"):
            fill, done_with = _writes(src_fd, fd, how)
            try:
                _parallel(fill, ranges)
            finally:
                done_with()
        else:
            def read(a: int, b: int) -> None:
                _in_pieces(a, b, lambda at, q: os.preadv(src_fd, [view[at:q]], at))
            _parallel(read, ranges)
        t3 = time.perf_counter()
        # the segment's bytes, as a rank maps them, are the file's
        for at in (0, n // 2, n - 4096):
            assert view[at:at + 4096] == os.pread(src_fd, 4096, at), (how, at)
        view.release()
        del keep
        if reused is None:
            mm.close()
    finally:
        os.close(fd)
    total = t3 - t0
    return {"how": how, "threads": threads, "create_s": round(t1 - t0, 3), "populate_s": round(t2 - t1, 3),
            "read_s": round(t3 - t2, 3), "total_s": round(total, 3), "gbps": round(n / total / 1e9, 2)}


def one_per_file(src_fd: int, n: int, threads: int, how: str) -> dict:
    """``how`` with one tmpfs file per reader: each reader creates its file, reserves it (``fallocate_files``) and
    reads its share into its mapping, or writes its share through the file's descriptor (``write_files``)."""
    src = mmap.mmap(src_fd, 0, prot=mmap.PROT_READ)
    created: list[float] = []

    def fill(a: int, b: int) -> None:
        t = time.perf_counter()
        fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            if how == "fallocate_files":
                os.posix_fallocate(fd, 0, b - a)
            else:
                os.ftruncate(fd, b - a)
            created.append(time.perf_counter() - t)
            mm = mmap.mmap(fd, b - a, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = memoryview(mm)
            sview = memoryview(src)
            try:
                if how == "fallocate_files":
                    _in_pieces(a, b, lambda at, q: os.preadv(src_fd, [view[at - a:q - a]], at))
                else:
                    _in_pieces(a, b, lambda at, q: os.pwritev(fd, [sview[at:q]], at - a))
                for at in (0, b - a - 4096):  # the file's bytes, as a rank maps them, are the source's
                    assert view[at:at + 4096] == sview[a + at:a + at + 4096], (how, a, at)
            finally:
                view.release()
                sview.release()
                mm.close()
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    try:
        _parallel(fill, _split(n, threads))
    finally:
        src.close()
    total = time.perf_counter() - t0
    return {"how": how, "threads": threads, "create_s": round(max(created, default=0.0), 3), "populate_s": 0.0,
            "read_s": round(total - max(created, default=0.0), 3), "total_s": round(total, 3),
            "gbps": round(n / total / 1e9, 2)}


def copy_gbps(n: int, fresh: bool) -> float:
    a = torch.ones(n, dtype=torch.uint8)
    best = 0.0
    for _ in range(3):
        d = torch.empty(n, dtype=torch.uint8)
        if not fresh:
            d.fill_(0)
        t = time.perf_counter()
        d.copy_(a)
        best = max(best, n / (time.perf_counter() - t) / 1e9)
        del d
    return best


def _setting(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--threads", default="1,4,8,16")
    p.add_argument("--dir", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    n = int(a.gib * (1 << 30)) // PIECE * PIECE
    path = os.path.join(a.dir, f".store_pages_{os.getpid()}.bin")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's kill still removes the source file
    rows: list[dict] = []
    try:
        with open(path, "wb") as f:
            block = os.urandom(PIECE)
            for _ in range(n // PIECE):
                f.write(block)
        src = os.open(path, os.O_RDONLY)
        try:
            os.pread(src, 1, 0)
            with open(path, "rb") as f:  # into the page cache: every row reads a cached file
                while f.read(64 << 20):
                    pass
            for threads in [int(x) for x in a.threads.split(",")]:
                for how in HOWS:
                    rows.append(one(src, n, threads, how))
                for how in FILES_HOWS:
                    rows.append(one_per_file(src, n, threads, how))
                fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
                os.posix_fallocate(fd, 0, n)
                mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                os.close(fd)
                one(src, n, threads, "reused", mm)
                rows.append(one(src, n, threads, "reused", mm))
                mm.close()
        finally:
            os.close(src)
    finally:
        if os.path.exists(path):
            os.remove(path)
    fresh, written = copy_gbps(n, True), copy_gbps(n, False)
    res = {
        "machine": os.uname().nodename, "kernel": os.uname().release, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "bytes": n,
        "shmem_enabled": _setting("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "thp_enabled": _setting("/sys/kernel/mm/transparent_hugepage/enabled"),
        "copy_fresh_gbps": round(fresh, 2), "copy_written_gbps": round(written, 2), "rows": rows,
        "best": {how: max((r for r in rows if r["how"] == how), key=lambda r: r["gbps"])
                 for how in (*HOWS, *FILES_HOWS, "reused")},
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
