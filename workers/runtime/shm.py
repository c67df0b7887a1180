"""POSIX shared-memory segments, used by the coordinator (owner) and the workers (attach) alike.

A segment is an *unnamed* tmpfs file: ``open("/dev/shm", O_TMPFILE)``, mode 0600, its pages reserved
at creation (``posix_fallocate``; or range by range by its owner, :meth:`Segment.reserve`), mapped
with mmap.  It never has a name in /dev/shm, so nothing can be left there when any process dies,
however it dies: the memory goes back when the last descriptor and mapping of it are gone.
Another process maps it through the owner's descriptor, ``/proc/<owner pid>/fd/<fd>`` (same user
only), which works for a worker that starts late too (a restarted rank); once the owner closes the
segment nobody new can attach.

Why this and not a name unlinked after every user has mapped it, with the descriptor passed over the
channel (SCM_RIGHTS) to late starters: the descriptor is already reachable through /proc, so no fd
passing has to be woven into the msgpack channel, and there is no window at all in which a name
exists.  Why not
``multiprocessing.shared_memory``: its resource tracker unlinks segments that another process still
uses.

The segment's id, ``h3ms-<owner pid>-<fd, 8 hex><inode, 16 hex>-<tag>``, travels in tensor
descriptors ``{seg, off, dtype, shape}`` (``protocol.TensorDesc``); attaching checks that the
descriptor behind ``/proc/<pid>/fd/<fd>`` is still the same tmpfs inode.  Offsets handed out by
:class:`Arena` are 4096-byte aligned so that a worker can register a whole segment with CUDA once
(:func:`register_cuda`), which is what makes host<->device copies from it fast.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import resource
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from workers.runtime.protocol import (
    DTYPE_SIZES,
    SEGMENT_NAME_RE,
    ProtocolError,
    TensorDesc,
    tensor_nbytes,
)

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
ALIGN = 4096
#: The pool's control block: 4 KiB of int64 words.
CONTROL_SIZE = 4096
CONTROL_WORDS = CONTROL_SIZE // 8
#: Word 0 of the control block: the abort generation, incremented by ``WorkerPool.abort()``.
ABORT_WORD = 0

log = logging.getLogger("h3_multistream.worker")


class ShmError(RuntimeError):
    """A shared-memory segment could not be created, attached or viewed."""


def align(n: int) -> int:
    """``n`` rounded up to the page alignment every segment offset and size keeps."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes an :class:`Arena` takes for one ``dtype`` tensor of ``shape`` (at least one byte,
    page-aligned): a segment for a set of tensors is the sum of their slots."""
    return align(max(tensor_nbytes(dtype, [int(n) for n in shape]), 1))


def dtype_name(dtype: torch.dtype | str) -> str:
    """The wire name of a dtype (``"bfloat16"``); ValueError naming the choices (the protocol's
    ``DTYPE_SIZES``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(
            f"dtype {dtype!r} is not supported in shared memory; use one of {sorted(DTYPE_SIZES)}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name; ShmError when this torch lacks it."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ShmError(f"dtype {name!r} is not available in this torch {torch.__version__}")
    return dt


def _shm_size_hint(nbytes: int) -> str:
    return (
        "give the machine more shared memory: in Docker start the container with --shm-size (e.g. "
        f"--shm-size={max(1, -(-2 * nbytes // 2**30))}g; Docker's default is 64m), or free space "
        f"in {SHM_DIR}"
    )


def _too_small(nbytes: int) -> ShmError:
    st = os.statvfs(SHM_DIR)
    return ShmError(
        f"{SHM_DIR} is too small: {nbytes / 2**20:.1f} MiB are needed but it has "
        f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of "
        f"{st.f_blocks * st.f_frsize / 2**20:.1f} MiB; " + _shm_size_hint(nbytes)
    )


def check_room(nbytes: int) -> None:
    """Refuse ``nbytes`` of segments /dev/shm has no room for now (files written since can still
    take it: the reservation or the write then fails)."""
    st = os.statvfs(SHM_DIR)
    if st.f_bavail * st.f_frsize < nbytes:
        raise _too_small(nbytes)


def _reserve(fd: int, off: int, nbytes: int) -> None:
    """Allocate every page of the file's ``[off, off + nbytes)`` now, so that a full tmpfs fails
    here and not as a SIGBUS on first touch.

    tmpfs gives a too-large file without complaint and only runs out when a page is written; statvfs
    cannot see files that exist but are not written yet, so a free-space check before creating is
    not enough.
    """
    try:
        os.posix_fallocate(fd, off, nbytes)
    except OSError as exc:
        raise _failed(exc, off + nbytes, nbytes) from None


def _failed(exc: OSError, end: int, nbytes: int) -> ShmError:
    """The error for sizing or reserving ``nbytes`` of a segment file up to byte ``end``."""
    if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        return ShmError(f"cannot reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR}: {exc}")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if exc.errno == errno.EFBIG and limit != resource.RLIM_INFINITY and limit < end:
        return ShmError(
            f"cannot reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR}: this process's file-size "
            f"limit (ulimit -f) is {limit / 2**20:.1f} MiB; raise it (ulimit -f unlimited)"
        )
    return _too_small(nbytes)


def _split_id(name: Any) -> tuple[int, int, int]:
    """(owner pid, owner fd, inode) from a segment id; :class:`ShmError` if it is not one."""
    m = SEGMENT_NAME_RE.match(name) if isinstance(name, str) else None
    if not m or len(m.group(2)) != 24:
        raise ShmError(
            f"{name!r} is not a segment name of this pack (h3ms-<pid>-<fd><inode hex>-<tag>)"
        )
    return int(m.group(1)), int(m.group(2)[:8], 16), int(m.group(2)[8:], 16)


def _handle_path(name: str) -> tuple[str, int]:
    pid, fd, ino = _split_id(name)
    return f"/proc/{pid}/fd/{fd}", ino


def owner_holds(name: str) -> bool:
    """Whether the owner of segment ``name`` still holds it (so it can still be attached)."""
    path, ino = _handle_path(name)
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False


class Segment:
    """One mapped shm segment.  The owner creates and finally unlinks it; other processes attach by
    name."""

    def __init__(
        self, name: str, size: int, mm: mmap.mmap, owner: bool, fd: int | None = None
    ) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd  # the owner's handle, through which others attach
        self._mm: mmap.mmap | None = mm
        self._base: torch.Tensor | None = None
        self._cuda_ptr: int | None = None

    @property
    def registered(self) -> bool:
        """Whether this mapping is registered with CUDA as pinned host memory."""
        return self._cuda_ptr is not None

    @classmethod
    def create(cls, size: int, tag: str, *, reserve: bool = True) -> Segment:
        """Create a new segment of at least ``size`` bytes (rounded up to 4096) owned by this
        process.

        Every page is reserved now: a /dev/shm too small for it raises :class:`ShmError` naming its
        size and ``--shm-size``.  With ``reserve=False`` the segment is only sized (after checking
        that /dev/shm has the room free now) and its owner reserves each range with
        :meth:`reserve` before writing it: a large segment's reservation can then run beside the
        writes of the ranges reserved before (it is single-threaded in the kernel).
        """
        if size <= 0:
            raise ShmError(f"segment size must be > 0, got {size}")
        size = align(size)
        if not SEGMENT_NAME_RE.match(f"h3ms-1-{'0' * 24}-{tag}"):
            raise ShmError(f"segment tag {tag!r} must be 1-48 chars of letters, digits, '_' or '.'")
        try:
            fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ShmError(
                f"cannot create a shared-memory segment in {SHM_DIR}: {exc} (it must be a tmpfs "
                "the current user can write; in Docker it always is)"
            ) from None
        try:
            if reserve:
                _reserve(fd, 0, size)
            else:
                check_room(size)
                try:
                    os.ftruncate(fd, size)
                except OSError as exc:
                    raise _failed(exc, size, size) from None
            name = f"h3ms-{os.getpid()}-{fd:08x}{os.fstat(fd).st_ino:016x}-{tag}"
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, size, mm, owner=True, fd=fd)

    def _owned_range(self, off: int, nbytes: int, what: str) -> int:
        """The owner's descriptor for ``what`` (an operation only the owner may do) on ``[off, off +
        nbytes)``; ShmError for another process or a range outside the segment."""
        if self._fd is None:
            raise ShmError(f"only the owner {what} segment {self.name}")
        if off < 0 or nbytes < 0 or off + nbytes > self.size:
            raise ShmError(
                f"range [{off}, {off + nbytes}) is outside segment {self.name} of {self.size} bytes"
            )
        return self._fd

    def reserve(self, off: int, nbytes: int) -> None:
        """Reserve the pages of ``[off, off + nbytes)`` of a segment created with
        ``reserve=False`` (owner only); :class:`ShmError` as :meth:`create` when /dev/shm ran
        out."""
        _reserve(self._owned_range(off, nbytes, "reserves pages of"), off, nbytes)

    def write(self, off: int, data: memoryview) -> None:
        """Write ``data`` at ``off`` through the owner's descriptor (owner only): tmpfs allocates
        the pages it writes without zeroing them first and without a page fault in the writer,
        and a full /dev/shm raises :class:`ShmError` as :meth:`create` does."""
        n = len(data)
        fd = self._owned_range(off, n, "writes")
        done = 0
        try:
            while done < n:
                done += os.pwritev(fd, [data[done:]], off + done)
        except OSError as exc:
            raise _failed(exc, off + n, n) from None

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment by its id (through its owner's descriptor)."""
        path, ino = _handle_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmError(
                f"shared-memory segment {name} does not exist (released, or its owner died)"
            ) from None
        except PermissionError:
            raise ShmError(
                f"cannot open shared-memory segment {name} through {path}: permission denied (the "
                "owner must run as the same user and stay dumpable)"
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_ino != ino or not stat.S_ISREG(st.st_mode):
                raise ShmError(
                    f"shared-memory segment {name} does not exist (released, or its owner died)"
                )
            if st.st_size <= 0:
                raise ShmError(f"shared-memory segment {name} is empty")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, st.st_size, mm, owner=False)

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise ShmError(f"segment {self.name} is closed")
        return self._mm

    def buffer(self, off: int = 0, nbytes: int | None = None) -> memoryview:
        """A memoryview of ``nbytes`` bytes at ``off`` (bounds-checked).  Release it before
        :meth:`close`."""
        mm = self._mapping()
        end = self.size if nbytes is None else off + nbytes
        if off < 0 or end > self.size or end < off:
            raise ShmError(
                f"range [{off}, {end}) is outside segment {self.name} of {self.size} bytes"
            )
        return memoryview(mm)[off:end]

    def base_tensor(self) -> torch.Tensor:
        """The whole segment as one uint8 tensor (created once; every view shares its storage)."""
        if self._base is None:
            import numpy as np
            import torch

            # Through numpy, not torch.frombuffer: numpy holds a buffer export on the mmap for as
            # long as any view lives, so close() cannot unmap memory a tensor still points at (it
            # raises BufferError instead).
            self._base = torch.from_numpy(
                np.frombuffer(self._mapping(), dtype=np.uint8, count=self.size)
            )
        return self._base

    def tensor(self, desc: TensorDesc) -> torch.Tensor:
        """Zero-copy tensor view for a descriptor (checked when it was built or decoded) into this
        segment."""
        if desc.seg != self.name:
            raise ShmError(f"descriptor points into segment {desc.seg}, not {self.name}")
        off, nbytes = desc.off, desc.nbytes
        if off + nbytes > self.size:
            raise ShmError(
                f"descriptor [{off}, {off + nbytes}) ({desc.dtype} {list(desc.shape)}) is outside "
                f"segment {self.name} of {self.size} bytes"
            )
        dt = torch_dtype(desc.dtype)
        flat = self.base_tensor()[off : off + nbytes]
        return flat.view(dt).view(tuple(desc.shape))

    def close(self) -> None:
        """Unmap (after CUDA unregistration) and, for the owner, drop the handle others attach
        through.  Tensor views that are still alive keep the mapping until freed; the memory goes
        when every process let go."""
        if self._cuda_ptr is not None:
            unregister_cuda(self)
        self._base = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Views still exported: the mapping goes away with the last of them.
                log.debug(
                    "segment %s: views still alive at close; unmapped when they are freed",
                    self.name,
                )
        self.unlink()

    def unlink(self) -> None:
        """Stop new attaches: close the owner's handle (our own mapping stays valid).  Idempotent; a
        no-op for an attached segment.  (There is no name in /dev/shm to remove: segments are
        unnamed.)"""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size}, owner={self.owner})"


class Arena:
    """Bump allocator over one segment: 4096-aligned offsets, descriptors out."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.used = 0

    @property
    def free(self) -> int:
        return self.segment.size - self.used

    def alloc(self, dtype: str, shape: Sequence[int]) -> TensorDesc:
        """Reserve room for a ``dtype`` tensor of ``shape``; return its descriptor."""
        if dtype not in DTYPE_SIZES:
            raise ShmError(f"dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        try:
            desc = TensorDesc(
                seg=self.segment.name, off=self.used, dtype=dtype, shape=[int(n) for n in shape]
            )
        except ProtocolError as exc:
            raise ShmError(str(exc)) from None
        nbytes = desc.nbytes
        end = self.used + slot_bytes(dtype, desc.shape)
        if end > self.segment.size:
            raise ShmError(
                f"arena on {self.segment.name} is full: {dtype} {list(shape)} needs {nbytes} "
                f"bytes, {self.free} of {self.segment.size} left"
            )
        self.used = end
        return desc


def register_cuda(segment: Segment, device: str = "cuda") -> bool:
    """Register the whole segment with CUDA as pinned host memory when ``device`` is CUDA; no-op
    otherwise.

    Returns whether it registered.  Unregistration happens in :meth:`Segment.close`.
    """
    if not str(device).startswith("cuda") or segment._cuda_ptr is not None:
        return False
    import torch

    ptr = segment.base_tensor().data_ptr()
    rc = torch.cuda.cudart().cudaHostRegister(ptr, segment.size, 0)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise ShmError(
            f"cudaHostRegister of {segment.name} ({segment.size} bytes) failed with CUDA error "
            f"{code}"
        )
    segment._cuda_ptr = ptr
    return True


def unregister_cuda(segment: Segment) -> None:
    """Undo :func:`register_cuda` (no-op when not registered)."""
    ptr, segment._cuda_ptr = segment._cuda_ptr, None
    if ptr is None:
        return
    import torch

    rc = torch.cuda.cudart().cudaHostUnregister(ptr)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        log.warning("cudaHostUnregister of %s failed with CUDA error %d", segment.name, code)


def held_shm(pid: int) -> set[str]:
    """This pack's /dev/shm files that process ``pid`` has open or mapped: unnamed segments
    (``/dev/shm/#<inode> (deleted)``) and the named ``h3ms-*`` probe arenas of the exchange
    benchmark; empty when it is gone.  Leak checks and diagnostics: a segment's memory is in use
    exactly while some process holds it.  (Other users of /dev/shm, e.g. POSIX semaphores ``sem.*``,
    are not counted.)"""
    ours = (SHM_DIR + "/#", SHM_DIR + "/h3ms-")
    out: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(ours):
                out.add(target)
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(ours):
                    out.add(parts[5].rstrip("\n"))
    except (FileNotFoundError, ProcessLookupError):
        return set()
    return out
