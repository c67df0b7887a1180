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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.host_memory import ram_info
from workers.runtime import fill_progress as progress_layout
from workers.runtime.fill_progress import FillProgress
from workers.runtime.protocol import TensorDesc
from workers.runtime.shm import Arena, Segment, ShmError, dtype_name, slot_bytes

log = get_logger("Weights")
GIB = 1 << 30

BlockReader = Callable[[int], dict[str, torch.Tensor]]


class WeightStoreRefused(RuntimeError):
    """Filling the store would break the RAM reserve (or /dev/shm is too small); the split must not
    run."""


def _block_layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in sorted(tensors.items())}


@dataclass
class WeightStore:
    """One store.  ``manifest[i]`` maps block i's parameter names to descriptors in ``segment``;
    ``progress`` is the fill-progress word ahead of the blocks
    (``workers/runtime/fill_progress.py``), through which the ranks take blocks in while the store
    still fills."""

    key: tuple
    segment: Segment
    manifest: list[dict[str, TensorDesc]]
    nbytes: int
    progress: TensorDesc
    #: the fill's seconds, and ``time.monotonic()`` when its last block was complete (0.0 and None
    #: while it fills)
    fill_seconds: float = 0.0
    filled_at: float | None = None
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
            "key": [str(k) for k in self.key],
            "blocks": len(self.manifest),
            "bytes": self.nbytes,
            "fill_seconds": round(self.fill_seconds, 3),
            "segment": self.segment.name,
        }

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
        first: dict[str, torch.Tensor],
        started: float,
    ) -> None:
        self.store = store
        self._read = read_block
        #: block 0's source tensors, read to size the store (gone once :meth:`run` copied them)
        self.first = first
        self._started = started

    def run(self) -> WeightStore:
        """Copy every block, publishing each as complete in the progress word.  A failure marks the
        fill failed there (every waiting rank stops) and raises; the caller releases the store once
        the ranks that mapped it have stopped."""
        store, seg = self.store, self.store.segment
        progress = store.fill_progress()
        layout = _block_layout(self.first)
        try:
            for i, entry in enumerate(store.manifest):
                tensors = self.first if i == 0 else self._read(i)
                got = _block_layout(tensors)
                if got != layout:
                    raise ValueError(
                        f"block {i} has another structure than block 0 "
                        f"({sorted(set(got) ^ set(layout)) or 'shapes/dtypes differ'}); "
                        "the weight store needs identical blocks"
                    )
                for name, desc in entry.items():
                    # any device: no host tensor between
                    seg.tensor(desc).copy_(tensors[name].detach())
                progress.publish(i + 1)
                self.first = {}  # let block 0's source tensors go
        except BaseException:
            progress.fail()
            raise
        store.filled_at = time.monotonic()
        store.fill_seconds = time.perf_counter() - self._started
        log.info(
            "filled %d blocks, %.2f GiB in %.2fs",
            len(store.manifest),
            store.nbytes / GIB,
            store.fill_seconds,
        )
        return store


def size_store(
    key: tuple,
    n_blocks: int,
    read_block: BlockReader,
    *,
    reserve_gb: float = 0.0,
    create: Callable[[int, str], Segment] = Segment.create,
) -> StoreFill:
    """Make the store for ``n_blocks`` blocks read by ``read_block(i)`` (block 0 sizes it), with
    every block's place laid out; :meth:`StoreFill.run` copies them.

    ``reserve_gb``: RAM that must stay available after the store is filled (the node's
    ``cache_ram_reserve_gb``); refusing raises :class:`WeightStoreRefused` with the numbers.
    ``create`` makes the segment (a pool's ``create_segment`` so the pool unlinks it at release).
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    t = time.perf_counter()
    first = read_block(0)
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
    try:
        seg = create(slot_bytes(progress_layout.DTYPE, progress_layout.SHAPE) + total, "wstore")
    except ShmError as exc:
        raise WeightStoreRefused(str(exc)) from None
    try:
        arena = Arena(seg)
        word = arena.alloc(progress_layout.DTYPE, progress_layout.SHAPE)
        manifest = [
            {name: arena.alloc(dt, shape) for name, (dt, shape) in layout.items()}
            for _ in range(n_blocks)
        ]
        store = WeightStore(key, seg, manifest, total, word)
        store.fill_progress().publish(0)
    except BaseException:
        seg.close()
        raise
    log.info("weight store: %d blocks, %.2f GiB to fill (%s)", n_blocks, total / GIB, ram.text)
    return StoreFill(store, read_block, first, t)


def fill(
    key: tuple,
    n_blocks: int,
    read_block: BlockReader,
    *,
    reserve_gb: float = 0.0,
    create: Callable[[int, str], Segment] = Segment.create,
) -> WeightStore:
    """:func:`size_store`, then copy every block: a filled store (released again when the copy
    fails)."""
    sized = size_store(key, n_blocks, read_block, reserve_gb=reserve_gb, create=create)
    try:
        return sized.run()
    except BaseException:
        sized.store.release()
        raise
