"""Where the block loop gets a block's weights from: the weight provider protocol and its CPU
implementation.

A provider hands the loop one :class:`BlockView` per block: the block's parameters by in-block name,
the rank's head group's rows of the fused qkv projection, and the int8 settings of the block's
linears.  Implementations:

- :class:`CpuWeights`: the tensors are used where they are, views of the shared-memory weight store
  on a CPU rank, the reference model's (seeded or loaded) weights in process; the head group's qkv
  rows are sliced once (``eager``) or per block (a reader over a model too big to hold sliced);
- ``workers.dit.cuda.CudaWeights``: VRAM-resident blocks and blocks streamed from pinned host memory
  through two prefetched slots (the residency is chosen per step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from workers.dit import ops as dit_ops


class BlockView(NamedTuple):
    """One block as the loop consumes it on one rank."""

    weights: dict[str, torch.Tensor]
    qkv: torch.Tensor
    qkv_scale: torch.Tensor | None
    quant: dict[str, dit_ops.QuantInfo]
    """``dit_ops.block_quant``: per int8 linear name."""


class WeightProvider(Protocol):
    """The block weights of one rank, for the block loop (``workers.dit.loop``)."""

    #: bytes this provider added on top of the store (copied qkv rows, VRAM copies)
    nbytes: int

    def place(self, i: int) -> None:
        """Block ``i`` is complete in the store: take it in (blocks are placed in order, each once,
        all before the first step; a rank places them while the store still fills)."""

    def refresh(self, blocks: Sequence[tuple[int, Sequence[str]]]) -> int:
        """The named tensors of these placed blocks were rewritten in the store (no step runs): take
        them in again wherever this provider holds copies or settings read from them; returns the
        bytes copied again."""

    def prepare(self, tokens: int, local_tokens: int, residency: str) -> None:
        """Place the weights for a step of ``tokens`` tokens (``local_tokens`` on this rank) under
        ``residency`` (``workers.dit.protocol.RESIDENCIES``); called before every step, a no-op when
        nothing changes."""

    def block(self, i: int) -> BlockView:
        """Block ``i``, usable by work issued on the current stream after this call."""

    def ahead(self, i: int) -> BlockView:
        """Block ``i`` while block ``i - 1`` is still in use (the cross-block overlap runs block
        i's norm1 inside block i-1's tail): usable like :meth:`block`'s, and it reuses no memory
        of block ``i - 1``'s; :meth:`block` is still called for ``i`` before its own work."""

    def done(self, i: int) -> None:
        """The loop has issued all work that reads block ``i`` (its memory may be reused after that
        work)."""

    def timer(self) -> dict | None:
        """Residency and prefetch timings of the step just run (None where weights do not move)."""

    def close(self) -> None:
        """Drop the weights."""


def _view_reads(name: str) -> bool:
    """Whether a block view copies ``name`` or reads settings from it (the head group's qkv rows,
    the int8 ConvRot tags); every other tensor of a CPU rank's view is a view of the store."""
    return name.startswith("attn.qkv_proj.") or name.endswith(".comfy_quant")


def check_names(i: int, held: dict[str, torch.Tensor], names: Sequence[str]) -> None:
    """Refuse a refresh naming tensors block ``i`` does not hold."""
    unknown = sorted(set(names) - set(held))
    if unknown:
        raise ValueError(f"refresh of block {i}: no tensors {unknown[:4]} in the loaded weights")


def block_view(
    weights: dict[str, torch.Tensor], g0: int, g1: int, heads: int, head_dim: int
) -> BlockView:
    """The view of one block's weights for heads [g0, g1) (the qkv rows copied unless that is every
    head)."""
    q_w, q_s = dit_ops.slice_qkv_weights(weights, g0, g1, heads, head_dim)
    return BlockView(weights, q_w, q_s, dit_ops.block_quant(weights))


class CpuWeights:
    """Block weights used in place (CPU ranks and the in-process reference): no residency, nothing
    to prefetch.

    ``read(i)`` gives block ``i``'s parameters.  ``eager`` slices each block's qkv rows once and
    keeps them (a rank's weights: per step nothing is copied): the first ``n_blocks`` at
    construction, later ones as they are placed (:meth:`place`); otherwise each :meth:`block` call
    reads and slices anew (the reference's seeded model, which may be too big to hold).
    """

    def __init__(
        self,
        read: Callable[[int], dict[str, torch.Tensor]],
        n_blocks: int,
        heads: tuple[int, int],
        total_heads: int,
        head_dim: int,
        *,
        eager: bool,
    ) -> None:
        g0, g1 = heads
        self._view = lambda i: block_view(read(i), g0, g1, total_heads, head_dim)
        self._views: list[BlockView] | None = [] if eager else None
        self._copies = (g0, g1) != (0, total_heads)
        self.nbytes = 0
        if eager:
            for i in range(n_blocks):
                self.place(i)

    def place(self, i: int) -> None:
        if self._views is None:
            return  # read per call
        if i != len(self._views):
            raise ValueError(
                f"block {i} placed after {len(self._views)} blocks; place them in order"
            )
        view = self._view(i)
        self._views.append(view)
        if self._copies:
            self.nbytes += view.qkv.numel() * view.qkv.element_size()

    def refresh(self, blocks: Sequence[tuple[int, Sequence[str]]]) -> int:
        """The store views see the new bytes already; a block whose qkv rows or int8 tags changed
        gets its view again (rows sliced anew, tags read anew)."""
        if self._views is None:
            return 0  # read per call
        copied = 0
        for i, names in blocks:
            if i >= len(self._views):
                raise ValueError(f"refresh of block {i}: only {len(self._views)} blocks placed")
            check_names(i, self._views[i].weights, names)
            if any(_view_reads(n) for n in names):
                self._views[i] = self._view(i)
                if self._copies:
                    copied += self._views[i].qkv.numel() * self._views[i].qkv.element_size()
        return copied

    def prepare(self, tokens: int, local_tokens: int, residency: str) -> None:
        """Nothing to place: the tensors are used where they are."""

    def block(self, i: int) -> BlockView:
        return self._views[i] if self._views is not None else self._view(i)

    def ahead(self, i: int) -> BlockView:
        return self.block(i)

    def done(self, i: int) -> None:
        """Nothing to free."""

    def timer(self) -> dict | None:
        return None

    def close(self) -> None:
        if self._views is not None:
            self._views.clear()
