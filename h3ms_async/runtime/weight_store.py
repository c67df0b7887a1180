"""The shared-memory weight store: every block's effective weights once, for all ranks.

Filled once per model key in the coordinator's process (from the reference model standalone, or from
ComfyUI's cast path in the ComfyUI layer), then mapped read-only by every rank.  Layout: one
segment, a fill-progress word (``workers/runtime/fill_progress.py``), then the blocks back to back,
each tensor at a 4 KiB-aligned offset, described by a manifest (one ``{name: tensor descriptor}``
map per block) that ``dit_load`` carries to the workers.  All blocks of an H3 model share one
structure, so block 0 sizes the segment, the whole manifest is laid out before any copy, and every
later block is checked against it.  The fill runs in two steps (:func:`size_store`, then
:meth:`StoreFill.run`) so that what runs beside the copy (the workers' start, the ranks' loads, the
plan probe) starts between them; each block is published in the progress word once it is complete.

A store keyed by a :class:`PatchedKey` (weights = a base plus weight patches, e.g. a LoRA) can take
another patch set of the same base in place (:meth:`WeightStore.rewrite`): only the tensors the old
or the new patch set touches are read and copied again, as long as the blocks keep their layout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.file_bytes import FileBytes, FileReader, Source
from h3ms_async.runtime.host_memory import ram_info
from workers.runtime import fill_progress as progress_layout
from workers.runtime.fill_progress import FillProgress
from workers.runtime.protocol import TensorDesc, tensor_nbytes
from workers.runtime.shm import Arena, Segment, ShmError, dtype_name, slot_bytes

log = get_logger("Weights")
GIB = 1 << 30

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


def _copy_in(dest: torch.Tensor, src: Source, files: FileReader) -> None:
    """One stored tensor's copy: file bytes by ``pread`` (``files``), a tensor from any device
    straight into shared memory (no host tensor between)."""
    if isinstance(src, FileBytes):
        files.read_into(dest, src)
    else:
        dest.copy_(src.detach())


def _desc_layout(entry: dict[str, TensorDesc]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (d.dtype, tuple(d.shape)) for name, d in sorted(entry.items())}


@dataclass(frozen=True)
class Rewrite:
    """What :meth:`WeightStore.rewrite` copied: ``blocks`` (block, tensor names) in block order,
    ``tensors`` of the store's ``of_tensors``, their ``bytes``, in ``seconds`` (reads included)."""

    blocks: tuple[tuple[int, tuple[str, ...]], ...]
    tensors: int
    of_tensors: int
    bytes: int
    seconds: float


@dataclass
class WeightStore:
    """One store.  ``manifest[i]`` maps block i's parameter names to descriptors in ``segment``;
    ``progress`` is the fill-progress word ahead of the blocks
    (``workers/runtime/fill_progress.py``), through which the ranks take blocks in while the store
    still fills."""

    key: StoreKey
    segment: Segment
    manifest: list[dict[str, TensorDesc]]
    nbytes: int
    progress: TensorDesc
    #: the fill's seconds, and ``time.monotonic()`` when its last block was complete (0.0 and None
    #: while it fills)
    fill_seconds: float = 0.0
    filled_at: float | None = None
    #: of the fill's seconds, those its reading thread spent reading blocks (the reader: ComfyUI's
    #: casts, the file) and those its copy thread spent copying them in, beside the reads
    read_seconds: float = 0.0
    copy_seconds: float = 0.0
    #: of the fill's seconds, those its reserving thread spent reserving the blocks' pages (all but
    #: block 0's: :func:`size_store`), ahead of the copies
    reserve_seconds: float = 0.0
    #: of the stored bytes, those the copy thread read from their file (:class:`FileBytes`)
    file_bytes: int = 0
    created_at: float = field(default_factory=time.time)

    @property
    def key_text(self) -> str:
        return repr(self.key)

    def fill_progress(self) -> FillProgress:
        return FillProgress(self.segment, self.progress, len(self.manifest))

    def block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors as zero-copy views (tests and diagnostics)."""
        return {name: self.segment.tensor(d) for name, d in self.manifest[i].items()}

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
        files = FileReader()
        try:
            for i in sorted(params):
                entry = self.manifest[i]
                names = touched_tensors(entry, params[i])
                if not names:
                    continue
                tensors = read_block(i)
                got, want = _block_layout(tensors), _desc_layout(entry)
                if got != want:
                    diff = sorted(set(got.items()) ^ set(want.items()))
                    raise LayoutChanged(
                        f"block {i} would change its layout ({', '.join(n for n, _ in diff[:4])}"
                        f"{', ...' if len(diff) > 4 else ''})"
                    )
                for name in names:
                    d = entry[name]
                    _copy_in(self.segment.tensor(d), tensors[name], files)
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
        )

    def release(self) -> None:
        """Unmap and unlink (workers must have dropped their views first: ``dit_release``)."""
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
        """Copy every block, publishing each as complete in the progress word.  Blocks are read
        in this thread (the reader may run the host's own code: ComfyUI's casts) and copied into
        the store in another, one block behind, so a block's copy (file reads, device-to-host
        copies) overlaps the next block's read; a source that lies unchanged in a file
        (:class:`FileBytes`) is read from it by ``pread``, several pieces at once.  A failure
        marks the fill failed there (every waiting rank stops) and raises; the caller releases
        the store once the ranks that mapped it have stopped.  A third thread reserves the
        blocks' pages in block order, ahead of the copies (a copy waits for its block's)."""
        store, seg = self.store, self.store.segment
        progress = store.fill_progress()
        layout = _block_layout(self.first)
        # one block waits while one copies: two blocks' source tensors alive at most
        handoff: queue.Queue[tuple[int, Mapping[str, Source]] | None] = queue.Queue(maxsize=1)
        copy_failed: list[Exception] = []
        files = FileReader()
        pages = _Reserver(store)

        def copy_blocks() -> None:
            while (item := handoff.get()) is not None:
                if copy_failed:
                    continue  # drained until the reader's end mark
                i, tensors = item
                t = time.perf_counter()
                try:
                    pages.wait(i)
                    for name, desc in store.manifest[i].items():
                        _copy_in(seg.tensor(desc), tensors[name], files)
                    progress.publish(i + 1)
                    store.copy_seconds += time.perf_counter() - t
                except Exception as exc:  # noqa: BLE001 - raised in the reading thread
                    copy_failed.append(exc)

        copier = threading.Thread(target=copy_blocks, name="h3ms-store-copy", daemon=True)
        copier.start()
        try:
            try:
                for i in range(len(store.manifest)):
                    if copy_failed:
                        break
                    if i == 0:
                        tensors, self.first = self.first, {}  # block 0's go with its copy
                    else:
                        t = time.perf_counter()
                        tensors = self._read(i)
                        store.read_seconds += time.perf_counter() - t
                    got = _block_layout(tensors)
                    if got != layout:
                        raise ValueError(
                            f"block {i} has another structure than block 0 "
                            f"({sorted(set(got) ^ set(layout)) or 'shapes/dtypes differ'}); "
                            "the weight store needs identical blocks"
                        )
                    _settled(tensors)
                    handoff.put((i, tensors))
            finally:
                handoff.put(None)
                copier.join()  # a copy of at most two blocks: it ends
                pages.close()
                files.close()
                store.file_bytes = files.bytes
            if copy_failed:
                raise copy_failed[0]
        except BaseException:
            progress.fail()
            raise
        store.filled_at = time.monotonic()
        store.fill_seconds = time.perf_counter() - self._started
        log.info(
            "filled %d blocks, %.2f GiB in %.2fs (reading %.2fs, copying %.2fs and reserving "
            "pages %.2fs beside it; %.2f GiB of it read from the file by pread)",
            len(store.manifest),
            store.nbytes / GIB,
            store.fill_seconds,
            store.read_seconds,
            store.copy_seconds,
            store.reserve_seconds,
            store.file_bytes / GIB,
        )
        return store


class _Reserver:
    """Reserves the pages of blocks 1.. of a store made by :func:`size_store` (block 0's are), one
    block at a time in block order, on its own thread: ``posix_fallocate`` is single-threaded in
    the kernel, so the whole store's before the first copy would wait seconds that the copies can
    run beside.  :meth:`wait` returns once block ``i``'s are (raising what stopped it);
    :meth:`close` stops it between blocks and joins it."""

    #: a block's reservation takes well under a second; this long without one is a fault
    WAIT_S = 120.0

    def __init__(self, store: WeightStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._reserved = 1
        self._failed: Exception | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="h3ms-store-pages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store = self._store
        try:
            for i in range(1, len(store.manifest)):
                with self._cond:
                    if self._stop:
                        return
                t = time.perf_counter()
                descs = store.manifest[i].values()
                if descs:
                    lo = min(d.off for d in descs)
                    hi = max(d.off + slot_bytes(d.dtype, d.shape) for d in descs)
                    store.segment.reserve(lo, hi - lo)
                store.reserve_seconds += time.perf_counter() - t
                with self._cond:
                    self._reserved = i + 1
                    self._cond.notify_all()
        except Exception as exc:  # noqa: BLE001 - raised in the copy that waits for it
            with self._cond:
                self._failed = exc
                self._cond.notify_all()

    def wait(self, i: int) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._reserved > i or self._failed is not None, self.WAIT_S
            ):
                raise ShmError(
                    f"reserving the weight store's pages for block {i} took over {self.WAIT_S:g}s"
                )
            if self._reserved <= i:
                assert self._failed is not None
                raise self._failed

    def close(self) -> None:
        with self._cond:
            self._stop = True
        self._thread.join(self.WAIT_S)


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
    every block's place laid out; :meth:`StoreFill.run` copies them.  Only the progress word's and
    block 0's pages are reserved here; :meth:`StoreFill.run` reserves the others beside its copies
    (an H3 block's reservation takes hundredths of a second, the whole store's seconds).

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
    word_bytes = slot_bytes(progress_layout.DTYPE, progress_layout.SHAPE)
    try:
        seg = Segment.create(word_bytes + total, "wstore", reserve=False)
    except ShmError as exc:
        raise WeightStoreRefused(str(exc)) from None
    try:
        seg.reserve(0, word_bytes + per_block)
        arena = Arena(seg)
        word = arena.alloc(progress_layout.DTYPE, progress_layout.SHAPE)
        manifest = [
            {name: arena.alloc(dt, shape) for name, (dt, shape) in layout.items()}
            for _ in range(n_blocks)
        ]
        store = WeightStore(key, seg, manifest, total, word)
        store.fill_progress().publish(0)
    except ShmError as exc:
        seg.close()
        raise WeightStoreRefused(str(exc)) from None
    except BaseException:
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
