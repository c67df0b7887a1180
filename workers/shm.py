"""POSIX shared-memory segments, used by the coordinator (owner) and the workers (attach) alike.

A segment is a file in /dev/shm named ``h3ms-<owner pid>-<random hex>-<tag>``, created O_EXCL with mode 0600 and
mapped with mmap.  We do not use ``multiprocessing.shared_memory``: its resource tracker unlinks segments that
another process still uses and warns at exit.  Tensors are zero-copy views described by
``{seg, off, dtype, shape}`` (see ``protocol.check_tensor_desc``); offsets handed out by :class:`Arena` are
4096-byte aligned so that a worker can register a whole segment with CUDA once (:func:`register_cuda`), which
is what makes host<->device copies from it fast.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
from typing import TYPE_CHECKING, Any, Sequence

from workers.protocol import DTYPE_SIZES, SEGMENT_NAME_RE, ProtocolError, check_tensor_desc, desc_nbytes

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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ShmError(f"dtype {name!r} is not available in this torch {torch.__version__}")
    return dt


def check_free_space(nbytes: int, path: str = SHM_DIR) -> int:
    """Raise :class:`ShmError` unless ``path`` has room for ``nbytes`` more; return the free byte count.

    /dev/shm is a tmpfs: creating a segment larger than its free space succeeds, and the process dies of SIGBUS
    when it touches the missing pages, so we check first.
    """
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ShmError(
            f"{path} has {free / 2**20:.1f} MiB free but {nbytes / 2**20:.1f} MiB are needed. "
            f"Give the machine more shared memory: in Docker start the container with --shm-size "
            f"(e.g. --shm-size={max(1, -(-2 * nbytes // 2**30))}g), or free space in {path}.")
    return free


class Segment:
    """One mapped shm segment.  The owner creates and finally unlinks it; other processes attach by name."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self._base: "torch.Tensor | None" = None
        self._cuda_ptr: int | None = None

    @property
    def registered(self) -> bool:
        """Whether this mapping is registered with CUDA as pinned host memory."""
        return self._cuda_ptr is not None

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, size: int, tag: str) -> "Segment":
        """Create a new segment of at least ``size`` bytes (rounded up to 4096) owned by this process."""
        if size <= 0:
            raise ShmError(f"segment size must be > 0, got {size}")
        size = _align(size)
        name = f"h3ms-{os.getpid()}-{secrets.token_hex(8)}-{tag}"
        if not SEGMENT_NAME_RE.match(name):
            raise ShmError(f"segment tag {tag!r} must be 1-48 chars of letters, digits, '_' or '.'")
        check_free_space(size)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment by name."""
        if not isinstance(name, str) or not SEGMENT_NAME_RE.match(name):
            raise ShmError(f"{name!r} is not a segment name of this pack (h3ms-<pid>-<hex>-<tag>)")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name} does not exist (released, or its owner died)") from None
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ShmError(f"shared-memory segment {name} is empty")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise ShmError(f"segment {self.name} is closed")
        return self._mm

    def buffer(self, off: int = 0, nbytes: int | None = None) -> memoryview:
        """A memoryview of ``nbytes`` bytes at ``off`` (bounds-checked).  Release it before :meth:`close`."""
        mm = self._mapping()
        end = self.size if nbytes is None else off + nbytes
        if off < 0 or end > self.size or end < off:
            raise ShmError(f"range [{off}, {end}) is outside segment {self.name} of {self.size} bytes")
        return memoryview(mm)[off:end]

    def base_tensor(self) -> "torch.Tensor":
        """The whole segment as one uint8 tensor (created once; every view shares its storage)."""
        if self._base is None:
            import numpy as np
            import torch

            # Through numpy, not torch.frombuffer: numpy holds a buffer export on the mmap for as long as any
            # view lives, so close() cannot unmap memory a tensor still points at (it raises BufferError instead).
            self._base = torch.from_numpy(np.frombuffer(self._mapping(), dtype=np.uint8, count=self.size))
        return self._base

    def tensor(self, desc: dict) -> "torch.Tensor":
        """Zero-copy tensor view for a descriptor that points into this segment."""
        try:
            check_tensor_desc(desc)
        except ProtocolError as exc:
            raise ShmError(str(exc)) from None
        if desc["seg"] != self.name:
            raise ShmError(f"descriptor points into segment {desc['seg']}, not {self.name}")
        off, nbytes = desc["off"], desc_nbytes(desc)
        if off + nbytes > self.size:
            raise ShmError(
                f"descriptor [{off}, {off + nbytes}) ({desc['dtype']} {list(desc['shape'])}) is outside "
                f"segment {self.name} of {self.size} bytes")
        dt = _torch_dtype(desc["dtype"])
        flat = self.base_tensor()[off:off + nbytes]
        return flat.view(dt).view(tuple(desc["shape"]))

    def close(self) -> None:
        """Unmap (after CUDA unregistration).  Tensor views that are still alive keep the mapping until freed."""
        if self._cuda_ptr is not None:
            unregister_cuda(self)
        self._base = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Views still exported: the mapping goes away with the last of them.
                log.debug("segment %s: views still alive at close; unmapped when they are freed", self.name)

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid until closed).  Missing is fine."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        if self.owner:
            self.unlink()

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

    def alloc(self, dtype: str, shape: Sequence[int]) -> dict:
        """Reserve room for a ``dtype`` tensor of ``shape``; return its descriptor."""
        if dtype not in DTYPE_SIZES:
            raise ShmError(f"dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        desc = {"seg": self.segment.name, "off": self.used, "dtype": dtype, "shape": [int(n) for n in shape]}
        nbytes = desc_nbytes(desc)
        end = self.used + _align(max(nbytes, 1))
        if end > self.segment.size:
            raise ShmError(
                f"arena on {self.segment.name} is full: {dtype} {list(shape)} needs {nbytes} bytes, "
                f"{self.free} of {self.segment.size} left")
        check_tensor_desc(desc)
        self.used = end
        return desc

    def reset(self) -> None:
        """Forget every allocation (the caller guarantees no descriptor is still in use)."""
        self.used = 0


def register_cuda(segment: Segment, device: str = "cuda") -> bool:
    """Register the whole segment with CUDA as pinned host memory when ``device`` is CUDA; no-op otherwise.

    Returns whether it registered.  Unregistration happens in :meth:`Segment.close`.
    """
    if not str(device).startswith("cuda") or segment._cuda_ptr is not None:
        return False
    import torch

    ptr = segment.base_tensor().data_ptr()
    rc = torch.cuda.cudart().cudaHostRegister(ptr, segment.size, 0)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise ShmError(f"cudaHostRegister of {segment.name} ({segment.size} bytes) failed with CUDA error {code}")
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


def owner_pid(name: str) -> int | None:
    """The owner pid carried by a segment name, or None if it is not one of ours."""
    m = SEGMENT_NAME_RE.match(name)
    return int(m.group(1)) if m else None


def dead_owner_entries(path: str, pattern: "re.Pattern[str]") -> list[str]:
    """Full paths of entries in ``path`` named by ``pattern`` (group 1 = owner pid) whose owner is dead and that
    belong to this user (never a link).  The one rule both the shm and the run-dir sweeps apply."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    uid = os.getuid()
    out = []
    for name in names:
        m = pattern.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if st.st_uid == uid and not os.path.islink(full):
            out.append(full)
    return out


def sweep_dead_owners(path: str = SHM_DIR) -> list[str]:
    """Unlink ``h3ms-<pid>-*`` segments whose owner process is gone; return their names."""
    removed = []
    for full in dead_owner_entries(path, SEGMENT_NAME_RE):
        try:
            os.unlink(full)
            removed.append(os.path.basename(full))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("could not remove stale segment %s: %s", full, exc)
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead processes: %s", len(removed), removed[:8])
    return removed
