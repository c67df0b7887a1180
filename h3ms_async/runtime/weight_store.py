"""The shared-memory weight store: every block's effective weights once, for all ranks.

Filled once per model key in the coordinator's process (from the reference model standalone, or from
ComfyUI's cast path in the ComfyUI layer), then mapped read-only by every rank.  Layout: a small
segment with the fill-progress word (``workers/runtime/fill_progress.py``), and one segment per
block, each tensor at a 4 KiB-aligned offset, described by a manifest (one ``{name: tensor
descriptor}`` map per block, each descriptor naming its block's segment) that ``dit_load`` carries
to the workers.  A segment per block because tmpfs allocates a file's pages under that file's
locks: the blocks' writers allocate their pages in parallel, each in its own file, and ``pwrite``
allocates them without zeroing them first (16 writers into one file ran at a ninth of the rate of
16 files on an H100 host; ``benchmarks/store_pages.py``).  The checkpoint's own bytes are written
so, several blocks at once; tensors the host made (casts, GPU tensors) are copied in by torch, one
block at a time, as they hold memory until written.  All blocks of an H3 model share one
structure, so block 0 sizes the store, the whole manifest is laid out before any copy, and every
later block is checked against it.  The fill runs in two steps (:func:`size_store`, then
:meth:`StoreFill.run`) so that what runs beside the copy (the workers' start, the ranks' loads,
the plan probe) starts between them; the progress word counts the leading blocks that are
complete.

A store keyed by a :class:`PatchedKey` (weights = a base plus weight patches, e.g. a LoRA) can take
another patch set of the same base in place (:meth:`WeightStore.rewrite`): only the tensors the old
or the new patch set touches are read and copied again, as long as the blocks keep their layout.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.file_bytes import FileBytes, FileMaps, Source
from h3ms_async.runtime.host_memory import ram_info
from workers.runtime import fill_progress as progress_layout
from workers.runtime.fill_progress import FillProgress
from workers.runtime.protocol import TensorDesc, tensor_nbytes
from workers.runtime.shm import Arena, Segment, ShmError, check_room, dtype_name, slot_bytes

log = get_logger("Weights")
GIB = 1 << 30
#: blocks written at once (each by one thread, into its own segment): enough to spread the page
#: allocation over a GPU host's cores (16 writers of 16 files filled tmpfs at 98 % of a fresh
#: memcpy's rate on an H100 host, 4 at 36 %)
WRITERS = 16
#: a block's write takes well under a second; this long without one finishing is a fault
WAIT_S = 120.0

BlockReader = Callable[[int], Mapping[str, Source]]


class WeightStoreRefused(RuntimeError):
    """Filling the store would break the RAM reserve (or /dev/shm is too small); the split must not
    run."""


class LayoutChanged(ValueError):
    """A patch change would change the blocks' layout (names, dtypes, shapes): the store cannot be
    rewritten in place and must be filled anew."""


@dataclass(frozen=True)
class PatchedKey:
    """A store key in two parts: ``base``, what fixes the unpatched weights (file, load options),
    and ``patch``, the id of the weight patches on top (a LoRA at one strength; "" for none).
    ``patched``: ``(block, in-block parameter name)`` of every block parameter the patch set
    changes; it follows from ``patch``, so equality and the key's text are ``base`` and ``patch``
    alone."""

    base: tuple
    patch: str
    patched: frozenset[tuple[int, str]] = field(default=frozenset(), compare=False, repr=False)

    def parts(self) -> list[str]:
        return [*(str(k) for k in self.base), self.patch]


StoreKey = tuple | PatchedKey


def key_parts(key: StoreKey) -> list[str]:
    """The key as the status route's list of strings."""
    return key.parts() if isinstance(key, PatchedKey) else [str(k) for k in key]


def patch_change(held: StoreKey, new: StoreKey) -> bool:
    """Whether ``new`` differs from ``held`` in its weight patches only (the same base)."""
    return (
        isinstance(held, PatchedKey)
        and isinstance(new, PatchedKey)
        and held.base == new.base
        and held.patch != new.patch
    )


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def touched_tensors(names: Iterable[str], patched_params: Iterable[str]) -> list[str]:
    """The stored tensors among ``names`` (one block's) that patches of ``patched_params`` (in-block
    parameter names) can change: every stored tensor of each patched parameter's module. A patched
    int8 weight changes its data, its scale and its quantization tag, a weight patched in a cast
    comes back with its bias."""
    modules = {_module(p) for p in patched_params}
    return sorted(n for n in names if _module(n) in modules)


def _block_layout(tensors: Mapping[str, Source]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in sorted(tensors.items())}


def _write(seg: Segment, desc: TensorDesc, src: Source, files: FileMaps) -> bool:
    """One stored tensor's copy into its block's segment; returns whether its bytes came from
    their file.  A file's bytes are written from the fill's own mapping of the file (``files``)
    through the segment's descriptor, which allocates the pages as it writes them (one thread,
    several blocks at once); a tensor the host made is copied into the mapping by torch (every
    core, one block at a time), its range reserved first, as a device tensor is (no host tensor
    between): a full /dev/shm is then an error and not a SIGBUS."""
    if isinstance(src, FileBytes):
        view = files.view(src)
        try:
            seg.write(desc.off, view)
        finally:
            view.release()
        return True
    seg.reserve(desc.off, tensor_nbytes(desc.dtype, desc.shape))
    seg.tensor(desc).copy_(src.detach())
    return False


def _desc_layout(entry: dict[str, TensorDesc]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (d.dtype, tuple(d.shape)) for name, d in sorted(entry.items())}


@dataclass(frozen=True)
class Rewrite:
    """What :meth:`WeightStore.rewrite` copied: ``blocks`` (block, tensor names) in block order,
    ``tensors`` of the store's ``of_tensors``, their ``bytes``, in ``seconds``, of which
    ``read_s`` in the block reader (the host's own code: ComfyUI's casts of the patched modules)."""

    blocks: tuple[tuple[int, tuple[str, ...]], ...]
    tensors: int
    of_tensors: int
    bytes: int
    seconds: float
    read_s: float


@dataclass
class WeightStore:
    """One store.  ``manifest[i]`` maps block i's parameter names to descriptors in
    ``blocks[i]``; ``progress`` is the fill-progress word in ``segment``
    (``workers/runtime/fill_progress.py``), through which the ranks take blocks in while the store
    still fills, and ``segment``'s name is the store's (what the ranks and the status route
    name)."""

    key: StoreKey
    segment: Segment
    blocks: list[Segment]
    manifest: list[dict[str, TensorDesc]]
    nbytes: int
    progress: TensorDesc
    #: the fill's seconds, and ``time.monotonic()`` when its last block was complete (0.0 and None
    #: while it fills)
    fill_seconds: float = 0.0
    filled_at: float | None = None
    #: of the fill's seconds, those its reading thread spent reading blocks (the reader: ComfyUI's
    #: casts, the file), and the seconds from the first block's write to the last one's end, beside
    #: the reads
    read_seconds: float = 0.0
    copy_seconds: float = 0.0
    #: of the stored bytes, those the writers took from their file (:class:`FileBytes`)
    file_bytes: int = 0
    created_at: float = field(default_factory=time.time)

    @property
    def key_text(self) -> str:
        return repr(self.key)

    def fill_progress(self) -> FillProgress:
        return FillProgress(self.segment, self.progress, len(self.manifest))

    def block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors as zero-copy views (tests and diagnostics)."""
        return {name: self.blocks[i].tensor(d) for name, d in self.manifest[i].items()}

    def describe(self) -> str:
        n = len(self.manifest)
        if self.filled_at is None:
            return f"filling, {max(0, self.fill_progress().read())} of {n} blocks"
        return f"warm, {self.nbytes / GIB:.2f} GiB, {n} blocks"

    def summary(self) -> dict:
        """The status route's ``weight_store`` section."""
        return {
            "state": "warm" if self.filled_at is not None else "filling",
            "key": key_parts(self.key),
            "blocks": len(self.manifest),
            "bytes": self.nbytes,
            "fill_seconds": round(self.fill_seconds, 3),
            "segment": self.segment.name,
        }

    def rewrite(self, key: PatchedKey, read_block: BlockReader) -> Rewrite:
        """Take ``key``, another patch set on this store's base (:func:`patch_change`), in place:
        read each block that either patch set touches and copy again the tensors of the patched
        parameters of both (:func:`touched_tensors`: the old patches' are restored, the new ones'
        written).  Raises :class:`LayoutChanged` when a block read has another layout than the store
        (before copying anything when it is the first: all blocks share one layout); any failure
        may leave the content mixed, so the caller drops the store.  No rank may read the store
        meanwhile."""
        assert isinstance(self.key, PatchedKey) and patch_change(self.key, key)
        t = time.perf_counter()
        params: dict[int, set[str]] = {}
        for i, name in self.key.patched | key.patched:
            if 0 <= i < len(self.manifest):
                params.setdefault(i, set()).add(name)
        blocks: list[tuple[int, tuple[str, ...]]] = []
        nbytes = 0
        read_s = 0.0
        files = FileMaps()
        try:
            for i in sorted(params):
                entry = self.manifest[i]
                names = touched_tensors(entry, params[i])
                if not names:
                    continue
                r = time.perf_counter()
                tensors = read_block(i)
                read_s += time.perf_counter() - r
                got, want = _block_layout(tensors), _desc_layout(entry)
                if got != want:
                    diff = sorted(set(got.items()) ^ set(want.items()))
                    raise LayoutChanged(
                        f"block {i} would change its layout ({', '.join(n for n, _ in diff[:4])}"
                        f"{', ...' if len(diff) > 4 else ''})"
                    )
                for name in names:
                    d = entry[name]
                    _write(self.blocks[i], d, tensors[name], files)
                    nbytes += tensor_nbytes(d.dtype, d.shape)
                blocks.append((i, tuple(names)))
        finally:
            files.close()
        self.key = key
        return Rewrite(
            tuple(blocks),
            sum(len(n) for _, n in blocks),
            sum(len(e) for e in self.manifest),
            nbytes,
            time.perf_counter() - t,
            read_s,
        )

    def release(self) -> None:
        """Unmap and unlink (workers must have dropped their views first: ``dit_release``)."""
        for seg in self.blocks:
            seg.close()
        self.segment.close()


class StoreFill:
    """A store sized, made and laid out whose blocks are not copied yet (:func:`size_store`): what
    may run beside the copy starts before :meth:`run` (the workers, the ranks' loads, the plan
    probe); ``store`` already has every block's descriptor."""

    def __init__(
        self,
        store: WeightStore,
        read_block: BlockReader,
        first: Mapping[str, Source],
        started: float,
    ) -> None:
        self.store = store
        self._read = read_block
        #: block 0's source tensors, read to size the store (gone once :meth:`run` copied them)
        self.first = first
        self._started = started

    def run(self) -> WeightStore:
        """Copy every block, publishing the leading complete blocks in the progress word.  Blocks
        are read in this thread, in order (the reader may run the host's own code: ComfyUI's casts,
        and it waits for the readahead of a cold file), and written each by one of up to
        :data:`WRITERS` threads into its own segment, beside the next blocks' reads.  A block
        holding tensors (not only file ranges) keeps them until it is written, so at most one such
        block waits while another is written.  A failure marks the fill failed there (every
        waiting rank stops) and raises; the caller releases the store once the ranks that mapped
        it have stopped."""
        store = self.store
        n = len(store.manifest)
        progress = store.fill_progress()
        layout = _block_layout(self.first)
        writers = max(1, min(WRITERS, os.cpu_count() or 1, n))
        slots = threading.BoundedSemaphore(writers)  # blocks handed over and not yet written
        # of those, the blocks holding tensors (not only file ranges): one at a time, while the
        # reader may hold the next
        holding = threading.BoundedSemaphore(1)
        lock = threading.Lock()
        complete = [False] * n
        failed: list[Exception] = []
        span = [float("inf"), 0.0]  # the first write's start, the last one's end
        published = 0

        def write(i: int, tensors: Mapping[str, Source], held: bool) -> None:
            nonlocal published
            t = time.perf_counter()
            try:
                if not failed:
                    from_file = 0
                    for name, d in store.manifest[i].items():
                        if _write(store.blocks[i], d, tensors[name], files):
                            from_file += tensor_nbytes(d.dtype, d.shape)
                    with lock:
                        store.file_bytes += from_file
                        span[0], span[1] = min(span[0], t), max(span[1], time.perf_counter())
                        complete[i] = True
                        while published < n and complete[published]:
                            published += 1
                        progress.publish(published)
            except Exception as exc:  # noqa: BLE001 - raised in the reading thread
                failed.append(exc)
            finally:
                if held:
                    holding.release()
                slots.release()

        def acquire(sem: threading.BoundedSemaphore, i: int) -> None:
            if not sem.acquire(timeout=WAIT_S):
                raise ShmError(f"no block was written in {WAIT_S:g}s while block {i} waited")

        files = FileMaps()
        pool = cf.ThreadPoolExecutor(writers, thread_name_prefix="h3ms-store-write")
        try:
            try:
                for i in range(n):
                    acquire(slots, i)
                    if failed:
                        slots.release()
                        break
                    if i == 0:
                        tensors, self.first = self.first, {}  # block 0's go with its write
                    else:
                        t = time.perf_counter()
                        tensors = self._read(i)
                        store.read_seconds += time.perf_counter() - t
                    got = _block_layout(tensors)
                    if got != layout:
                        slots.release()
                        raise ValueError(
                            f"block {i} has another structure than block 0 "
                            f"({sorted(set(got) ^ set(layout)) or 'shapes/dtypes differ'}); "
                            "the weight store needs identical blocks"
                        )
                    held = any(not isinstance(v, FileBytes) for v in tensors.values())
                    if held:
                        acquire(holding, i)
                    _settled(tensors)
                    pool.submit(write, i, tensors, held)
                    del tensors
            finally:
                pool.shutdown(wait=True)  # every write ends: each is at most one block's copy
                files.close()
            if failed:
                raise failed[0]
        except BaseException:
            progress.fail()
            raise
        store.filled_at = time.monotonic()
        store.fill_seconds = time.perf_counter() - self._started
        store.copy_seconds = max(0.0, span[1] - span[0])
        log.info(
            "filled %d blocks, %.2f GiB in %.2fs (reading %.2fs, writing %.2fs beside it, %d "
            "blocks at once; %.2f GiB of it from the file)",
            n,
            store.nbytes / GIB,
            store.fill_seconds,
            store.read_seconds,
            store.copy_seconds,
            writers,
            store.file_bytes / GIB,
        )
        return store


def _settled(tensors: Mapping[str, Source]) -> None:
    """Wait for the device work that produced a block's CUDA tensors (ComfyUI's cast and patch),
    so the copy thread, on its own stream, reads finished values."""
    for device in {t.device for t in tensors.values() if isinstance(t, torch.Tensor) and t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def size_store(
    key: StoreKey,
    n_blocks: int,
    read_block: BlockReader,
    *,
    reserve_gb: float = 0.0,
) -> StoreFill:
    """Make the store for ``n_blocks`` blocks read by ``read_block(i)`` (block 0 sizes it), with
    every block's segment made and laid out; :meth:`StoreFill.run` writes them.  The block
    segments are only sized here (their writes allocate their pages), after /dev/shm was checked
    for room for all of them.

    ``reserve_gb``: RAM that must stay available after the store is filled (the node's
    ``cache_ram_reserve_gb``); refusing raises :class:`WeightStoreRefused` with the numbers, as
    does a /dev/shm without room for the store.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    t = time.perf_counter()
    first = read_block(0)
    first_read_s = time.perf_counter() - t
    layout = _block_layout(first)
    per_block = sum(slot_bytes(d, s) for d, s in layout.values())
    total = per_block * n_blocks
    ram = ram_info()
    if ram.available_bytes - total < reserve_gb * GIB:
        raise WeightStoreRefused(
            f"weight store needs {total / GIB:.2f} GiB but only {ram.available_bytes / GIB:.2f} "
            f"GiB RAM is available and cache_ram_reserve_gb={reserve_gb:g} must stay free; lower "
            "the reserve, free RAM, or disable the split for this model"
        )
    made: list[Segment] = []
    try:
        word_bytes = slot_bytes(progress_layout.DTYPE, progress_layout.SHAPE)
        check_room(word_bytes + total)
        made.append(Segment.create(word_bytes, "wstore"))
        word = Arena(made[0]).alloc(progress_layout.DTYPE, progress_layout.SHAPE)
        manifest = []
        for i in range(n_blocks):
            made.append(Segment.create(per_block, f"wstore.b{i}", reserve=False))
            arena = Arena(made[-1])
            manifest.append({name: arena.alloc(dt, shape) for name, (dt, shape) in layout.items()})
        store = WeightStore(key, made[0], made[1:], manifest, total, word)
        store.fill_progress().publish(0)
    except ShmError as exc:
        for seg in made:
            seg.close()
        raise WeightStoreRefused(str(exc)) from None
    except BaseException:
        for seg in made:
            seg.close()
        raise
    log.info("weight store: %d blocks, %.2f GiB to fill (%s)", n_blocks, total / GIB, ram.text)
    store.read_seconds = first_read_s
    return StoreFill(store, read_block, first, t)


def fill(
    key: StoreKey,
    n_blocks: int,
    read_block: BlockReader,
    *,
    reserve_gb: float = 0.0,
) -> WeightStore:
    """:func:`size_store`, then copy every block: a filled store (released again when the copy
    fails)."""
    sized = size_store(key, n_blocks, read_block, reserve_gb=reserve_gb)
    try:
        return sized.run()
    except BaseException:
        sized.store.release()
        raise
