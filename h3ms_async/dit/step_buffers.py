"""The DiT split's shared-memory step buffers and their lifetime.

One :class:`StepBufferSlot` per split engine owns the buffers a step runs in: the step segment
(residual stream in and out, rope table), the host (or GPU-direct) exchange's arena, and the side
segment (every block's adaLN rows, per-token mod rows). They are made at the first step, reused
while the step's shapes stay, replaced when they change and freed by :meth:`StepBufferSlot.drop` (a
failed step, a weight-store release, the engine's release). Freeing closes and unlinks the
coordinator's side; each rank drops its mapping when told (``DropReleased``) or at its next attach,
so a segment lives until its last user lets go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.dit.protocol import Transport
from workers.runtime.protocol import TensorDesc
from workers.runtime.shm import (
    Arena,
    Segment,
    check_room,
    dtype_name,
    register_cuda,
    slot_bytes,
)
from workers.transports import cuda_ipc
from workers.transports.arena import ArenaLayout

if TYPE_CHECKING:
    from h3ms_async.dit.loaded import LoadedWeights
    from h3ms_async.dit.step import PlannedStep

#: The transports that run over an arena, and its size for a layout: the host exchange's holds the
#: data, the GPU-direct exchange's the header page and its buffers' handles.
ARENA_BYTES: dict[Transport, Callable[[ArenaLayout], int]] = {
    Transport.HOST: lambda layout: layout.nbytes,
    Transport.CUDA_IPC: cuda_ipc.arena_bytes,
}

#: ``name: (dtype, shape)`` of the tensors one segment holds.
Specs = dict[str, tuple[torch.dtype, Sequence[int]]]


@dataclass
class StepBuffers:
    """The step segment (residual stream in/out, rope) and the exchange arena, reused while the
    token plan stays the same, plus the side segment for the adaLN rows and per-token mod rows.

    Those two change shape between the steps of one prompt (H3's first step has one modulation row,
    the next ones two), so they live apart: a new shape replaces the side segment only (full H3:
    50 blocks x M rows x 96768 adaLN values, ~10 MB per row in bf16),
    never the step segment or the multi-GiB arena that every rank has mapped and registered with
    CUDA."""

    shape_key: tuple
    step: Segment
    descs: dict[str, TensorDesc]
    arena: Segment | None
    layout: ArenaLayout
    pinned: bool = False
    side_key: tuple | None = None
    side: Segment | None = None

    def close(self) -> None:
        """Close and unlink every segment (ranks keep their mappings until they drop them)."""
        _free(self.step, self.arena, self.side)


class StepBufferSlot:
    """The one set of step buffers of a split engine, made, reused, replaced and freed here.

    ``unmap_released`` asks the ranks to unmap the buffers dropped so far; it runs before new
    buffers are reserved, so a tight /dev/shm gets the old pages back first."""

    def __init__(self, unmap_released: Callable[[], None]) -> None:
        self._unmap_released = unmap_released
        self._current: StepBuffers | None = None

    @property
    def current(self) -> StepBuffers | None:
        """The buffers the last step ran in, or None when none are held."""
        return self._current

    def for_step(self, planned: PlannedStep, loaded: LoadedWeights) -> StepBuffers:
        """The buffers for this step: the held ones when the shapes match, else new ones (the step
        segment and arena for a new token plan, dtype, rope, exchange or its ordering (its peers'
        handles and words belong to one ordering); the side segment alone for
        new adaLN rows or per-token row shapes).  Under the Ulysses pattern the arena also holds the
        q/k/v blocks."""
        key, side_key = _keys(planned, loaded)
        buf = self._current
        if buf is None or buf.shape_key != key:
            buf = self._new(key, planned, loaded)
        if buf.side_key != side_key:
            _new_side(buf, side_key)
        return buf

    def check_room(self, planned: PlannedStep, loaded: LoadedWeights) -> None:
        """Refuse ``planned`` now (ShmError naming /dev/shm's size and ``--shm-size``) when /dev/shm
        has no room for the buffers it would add, even with the held ones it replaces freed: before
        its plan is probed, which at a new large shape takes seconds that the step would spend only
        to fail when it reserves them."""
        key, side_key = _keys(planned, loaded)
        buf = self._current
        need = freed = 0
        if buf is None or buf.shape_key != key:
            need = _segment_bytes(_step_specs(planned)) + _side_bytes(side_key)
            if planned.transport in ARENA_BYTES:
                need += ARENA_BYTES[planned.transport](_layout(planned, loaded))
            if buf is not None:
                freed = sum(seg.size for seg in (buf.step, buf.arena, buf.side) if seg is not None)
        elif buf.side_key != side_key:
            need = _side_bytes(side_key)
            freed = buf.side.size if buf.side is not None else 0
        if need > freed:
            check_room(need - freed)

    def drop(self) -> None:
        """Free the held buffers, if any; the next step makes new ones."""
        if self._current is not None:
            self._current.close()
            self._current = None

    def _new(self, key: tuple, planned: PlannedStep, loaded: LoadedWeights) -> StepBuffers:
        transport = planned.transport
        self.drop()
        self._unmap_released()
        specs = _step_specs(planned)
        step = Segment.create(_segment_bytes(specs), "step")
        arena_seg = None
        try:
            descs = _alloc(step, specs)
            layout = _layout(planned, loaded)
            if transport in ARENA_BYTES:
                arena_seg = Segment.create(ARENA_BYTES[transport](layout), "arena")
                layout.init_header(arena_seg.base_tensor())
        except BaseException:
            _free(step, arena_seg)
            raise
        x = planned.step.x
        pinned = x.is_cuda and register_cuda(step, str(x.device))
        self._current = StepBuffers(key, step, descs, arena_seg, layout, pinned)
        return self._current


def _keys(planned: PlannedStep, loaded: LoadedWeights) -> tuple[tuple, tuple]:
    """What the step segment and arena (the first) and the side segment (the second) are kept for:
    held buffers are reused while their key stays."""
    step, plan = planned.step, planned.plan
    x, rope, mod = step.x, step.rope_freqs, step.modulation
    key = (
        tuple(plan.token_bounds),
        tuple(loaded.head_bounds),
        x.dtype,
        tuple(rope.shape),
        rope.dtype,
        planned.transport,
        planned.ipc_sync,
        str(x.device),
        planned.pattern == "ulysses",
    )
    rows = tuple(
        (i, int(r.numel()))
        for i, (_, _, r) in enumerate(step.mod_segments)
        if isinstance(r, torch.Tensor)
    )
    return key, (tuple(mod.shape), mod.dtype, rows)


def _step_specs(planned: PlannedStep) -> Specs:
    x, rope = planned.step.x, planned.step.rope_freqs
    return {"x": (x.dtype, x.shape), "rope": (rope.dtype, rope.shape)}


def _layout(planned: PlannedStep, loaded: LoadedWeights) -> ArenaLayout:
    plan, head_dim = planned.plan, loaded.config.head_dim
    return ArenaLayout.plan(
        len(plan.token_bounds) - 1,
        list(plan.token_bounds),
        [g * head_dim for g in loaded.head_bounds],
        loaded.config.hidden,
        planned.step.x.dtype,
        head_dim,
        planned.pattern == "ulysses",
    )


def _side_specs(side_key: tuple) -> Specs:
    """The side segment's tensors for its key: the adaLN rows, then each per-token row index."""
    mod_shape, mod_dtype, rows = side_key
    specs: Specs = {"modulation": (mod_dtype, mod_shape)}
    specs.update({f"row{i}": (torch.int64, (n,)) for i, n in rows})
    return specs


def _side_bytes(side_key: tuple) -> int:
    return _segment_bytes(_side_specs(side_key))


def _new_side(buf: StepBuffers, side_key: tuple) -> None:
    """Replace ``buf``'s side segment (adaLN rows and per-token rows) for new shapes; ranks map the
    new one at the step that names it and drop the old one (its owner let go) at their next
    attach."""
    specs = _side_specs(side_key)
    side = Segment.create(_segment_bytes(specs), "side")
    try:
        descs = _alloc(side, specs)
    except BaseException:
        _free(side)
        raise
    _free(buf.side)
    buf.descs = {k: v for k, v in buf.descs.items() if k in ("x", "rope")} | descs
    buf.side, buf.side_key = side, side_key


def _alloc(seg: Segment, specs: Specs) -> dict[str, TensorDesc]:
    a = Arena(seg)
    return {name: a.alloc(dtype_name(dt), list(shp)) for name, (dt, shp) in specs.items()}


def _free(*segments: Segment | None) -> None:
    for seg in segments:
        if seg is not None:
            seg.close()
            seg.unlink()


def _segment_bytes(specs: Specs) -> int:
    """Bytes of a segment holding one 4 KiB-aligned tensor per ``name: (dtype, shape)``."""
    return sum(slot_bytes(dtype_name(dt), shp) for dt, shp in specs.values())
