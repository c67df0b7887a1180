"""The shared-memory weight store: every block's effective weights once, for all ranks.

Filled once per model key in the coordinator's process (from the reference model standalone, or from
ComfyUI's cast path in the ComfyUI layer), then mapped read-only by every rank.  Layout: one
segment, blocks back to back, each tensor at a 4 KiB-aligned offset, described by a manifest (one
``{name: tensor descriptor}`` map per block) that ``dit_load`` carries to the workers.  All blocks
of an H3 model share one structure, so block 0 sizes the segment and every later block is checked
against it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from h3ms_async.log import get_logger
from h3ms_async.runtime.host_memory import ram_info
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
    """One filled store.  ``manifest[i]`` maps block i's parameter names to descriptors in
    ``segment``."""

    key: tuple
    segment: Segment
    manifest: list[dict[str, TensorDesc]]
    nbytes: int
    fill_seconds: float
    created_at: float = field(default_factory=time.time)

    @property
    def key_text(self) -> str:
        return repr(self.key)

    def block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors as zero-copy views (tests and diagnostics)."""
        return {name: self.segment.tensor(d) for name, d in self.manifest[i].items()}

    def describe(self) -> str:
        return f"warm, {self.nbytes / GIB:.2f} GiB, {len(self.manifest)} blocks"

    def summary(self) -> dict:
        """The status route's ``weight_store`` section."""
        return {
            "state": "warm",
            "key": [str(k) for k in self.key],
            "blocks": len(self.manifest),
            "bytes": self.nbytes,
            "fill_seconds": round(self.fill_seconds, 3),
            "segment": self.segment.name,
        }

    def release(self) -> None:
        """Unmap and unlink (workers must have dropped their views first: ``dit_release``)."""
        self.segment.close()


def fill(
    key: tuple,
    n_blocks: int,
    read_block: BlockReader,
    *,
    reserve_gb: float = 0.0,
    create: Callable[[int, str], Segment] = Segment.create,
    on_sized: Callable[[], None] | None = None,
) -> WeightStore:
    """Copy ``n_blocks`` blocks from ``read_block(i)`` into a new store.

    ``reserve_gb``: RAM that must stay available after the store is filled (the node's
    ``cache_ram_reserve_gb``); refusing raises :class:`WeightStoreRefused` with the numbers.
    ``create`` makes the segment (a pool's ``create_segment`` so the pool unlinks it at release).
    ``on_sized`` runs once the segment is made (the RAM and /dev/shm checks passed), before the
    blocks are copied: what may run beside the copy starts there.
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
        seg = create(total, "wstore")
    except ShmError as exc:
        raise WeightStoreRefused(str(exc)) from None
    try:
        if on_sized is not None:
            on_sized()
        arena = Arena(seg)
        manifest: list[dict[str, TensorDesc]] = []
        for i in range(n_blocks):
            tensors = first if i == 0 else read_block(i)
            got = _block_layout(tensors)
            if got != layout:
                raise ValueError(
                    f"block {i} has another structure than block 0 "
                    f"({sorted(set(got) ^ set(layout)) or 'shapes/dtypes differ'}); "
                    "the weight store needs identical blocks"
                )
            entry = {}
            for name, (dt, shape) in layout.items():
                desc = arena.alloc(dt, shape)
                seg.tensor(desc).copy_(tensors[name].detach())  # any device: no host tensor between
                entry[name] = desc
            manifest.append(entry)
            first = {}  # let block 0's source tensors go
        store = WeightStore(key, seg, manifest, total, time.perf_counter() - t)
    except BaseException:
        seg.close()
        raise
    log.info(
        "filled %d blocks, %.2f GiB in %.2fs (%s)",
        n_blocks,
        total / GIB,
        store.fill_seconds,
        ram.text,
    )
    return store
