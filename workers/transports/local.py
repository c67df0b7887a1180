"""The exchange between ranks that are threads of one process (the simulated split,
``h3ms_async.dit.reference.SimulatedSplit``): every rank writes its part into shared buffers, meets
the others, and reads the whole.

Results are the shared buffers themselves (no copy), so a rank must be done with a result before
its next op over the same buffer (the block loop is: attention reads the gather's result before the
all-to-all, out_proj the all-to-all's before the next gather).  Every op ends with a meeting, so a
rank that starts op k over a buffer last used at op k' < k - 1 knows every rank has left op k'
behind; only an op right after one over the same buffer meets the others once more before it
writes (as the host exchange's reuse guard waits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.transports.arena import (
    BUFFERS,
    KIND_ALL_TO_ALL,
    KIND_ALL_TO_ALL_HEADS,
    KIND_GATHER,
    KIND_QKV,
    KIND_QKV_ATTEND,
    ArenaLayout,
)
from workers.transports.exchange import ExchangeBase, InProcess, RowsProduceFn, packed_qkv


class LocalArena:
    """The buffers the ranks of ``layout`` share, on ``device``: the gathered rows ``[S, W]``, each
    rank's received columns ``[n_r, C]`` and (layouts planned with ``qkv``) each rank's q, k, v
    ``[S, 3·c_r]``; ``meet()`` returns once every rank has called it."""

    def __init__(self, layout: ArenaLayout, device: torch.device, meet: Callable[[], None]) -> None:
        self.layout, self.meet = layout, meet
        dt, s = layout.torch_dtype, layout.tokens
        self.gathered = torch.empty((s, layout.row_width), dtype=dt, device=device)
        spans = [(layout.rows(r), layout.cols(r)) for r in range(layout.world)]
        self.received = [
            torch.empty((t1 - t0, layout.columns), dtype=dt, device=device) for (t0, t1), _ in spans
        ]
        self.qkv = (
            [torch.empty((s, 3 * (c1 - c0)), dtype=dt, device=device) for _, (c0, c1) in spans]
            if layout.q_offsets
            else []
        )


class LocalExchange(InProcess, ExchangeBase):
    """One rank thread's side of a :class:`LocalArena` (every rank thread runs the same ops)."""

    transport = "simulated"

    def __init__(self, rank: int, arena: LocalArena) -> None:
        self.rank, self.layout, self._arena = rank, arena.layout, arena
        self.device = arena.gathered.device
        self._last: tuple[str, ...] = ()  # the buffers of the previous op

    def _begin_op(self, kind: int, n: int) -> None:
        if kind in (KIND_QKV, KIND_QKV_ATTEND):
            self.layout.check_qkv()
        if set(BUFFERS[kind]) & set(self._last):
            self._arena.meet()  # every rank is done with the previous op's result
        self._last = BUFFERS[kind]

    def _result(self, kind: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        if kind == KIND_QKV_ATTEND:  # two ops over the shared buffers: a result of its own
            return super()._result(kind, shape, device)
        return self._shared(kind)

    def _shared(self, kind: int) -> torch.Tensor:
        if kind in (KIND_ALL_TO_ALL, KIND_ALL_TO_ALL_HEADS):
            return self._arena.received[self.rank]
        if kind == KIND_QKV:
            return self._arena.qkv[self.rank]
        return self._arena.gathered

    def _done(self, kind: int, out: torch.Tensor) -> torch.Tensor:
        """Meet the others; then ``out`` holds the result (copied when it is not the buffer)."""
        self._arena.meet()
        shared = self._shared(kind)
        return out if out is shared else out.copy_(shared)

    def _all_gather_rows(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        t0, t1 = self.layout.rows(self.rank)
        self._arena.gathered[t0:t1].copy_(local)
        return self._done(KIND_GATHER, out)

    def _all_gather_rows_produced(
        self, produce: RowsProduceFn, n: int, out: torch.Tensor
    ) -> torch.Tensor:
        """Each piece written into the shared rows as it is produced."""
        for j in range(n):
            a, b, part = self._row_piece(produce, n, j)
            if part is not None:
                self._arena.gathered[a:b].copy_(part)
        return self._done(KIND_GATHER, out)

    def _all_to_all_cols(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        c0, c1 = self.layout.cols(self.rank)
        for p, dst in enumerate(self._arena.received):
            p0, p1 = self.layout.rows(p)
            dst[:, c0:c1].copy_(local[p0:p1])
        return self._done(KIND_ALL_TO_ALL, out)

    def _all_to_all_qkv(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        t0, t1 = self.layout.rows(self.rank)
        for p, dst in enumerate(self._arena.qkv):
            dst[t0:t1].copy_(packed_qkv(local, self.layout.qkv_cols(p)))
        return self._done(KIND_QKV, out)
