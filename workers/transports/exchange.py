"""The two collectives a split block needs, as one protocol, and the exchange of a rank that has no
peers.

Implementations: :class:`workers.transports.host.HostExchange` (shared-memory arena),
:class:`workers.transports.dist.DistExchange` (torch.distributed), :class:`NoExchange` (below: the
unsplit run, and the benchmark baseline) and, on a CUDA rank, ``workers.dit.cuda.CudaExchange``
wrapping the first two.  The block loop (``workers.dit.loop``) sees only this protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workers.transports.host import (
    ArenaLayout,
    ProduceFn,
    RowsFn,
    each_rank_rows,
    packed_qkv,
    produced_columns,
)

_CPU = torch.device("cpu")


class Exchange(Protocol):
    """One rank's side of the per-block collectives over an :class:`ArenaLayout` (tokens by rank,
    columns by rank).  ``chunks`` pipelines an op in that many pieces where the transport can (0/1:
    one shot)."""

    def begin(self, abort_generation: int) -> None:
        """Start a job; every op raises ``ExchangeAborted`` once the pool's abort generation moves
        past this one."""

    def all_gather_rows(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        """Every rank's rows in token order: ``[n_rank, row_width]`` in, ``[S, row_width]`` out."""

    def all_gather_rows_each(self, local: torch.Tensor, on_rows: RowsFn) -> torch.Tensor:
        """:meth:`all_gather_rows`, calling ``on_rows(a, b, rows)`` for each rank's rows; a
        transport that can calls it for this rank's rows before it waits and for a peer's as soon
        as they arrive."""

    def all_to_all_cols(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        """Every rank's columns for this rank's tokens: ``[S, c_rank]`` in, ``[n_rank, C]`` out."""

    def all_to_all_qkv(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        """The Ulysses pattern's exchange: q, k and v of every head for this rank's tokens
        ``[n_rank, 3·C]`` in, q, k and v of this rank's heads for every token ``[S, 3·c_rank]`` out
        (``host.packed_qkv`` layout)."""

    def all_to_all_heads(self, produce: ProduceFn, pieces: int) -> torch.Tensor:
        """:meth:`all_to_all_cols` of the columns ``produce(c_a, c_b)`` returns per head piece
        (``ArenaLayout.head_piece``); a transport that can moves each piece while the next is
        produced."""

    def counters(self) -> tuple[float, float]:
        """(copy seconds, wait seconds) since the last reset, read on the host clock without
        synchronising any device (the block loop reads them after every block)."""

    def stats(self) -> dict:
        """The step's counters for the step record (may synchronise device events)."""

    def reset_stats(self) -> None:
        """Zero the counters (once per step)."""

    def close(self) -> None:
        """Drop what the exchange holds (not the memory or process group it was given)."""


class InProcessExchange:
    """Base of the exchanges whose peers (if any) live in this process: no job to abort, no
    counters, nothing to drop.  Subclasses define the two ops and their ``stats()["transport"]``
    name."""

    transport = "in-process"

    def begin(self, abort_generation: int) -> None:
        """Nothing to start: no other process can abort the job."""

    def counters(self) -> tuple[float, float]:
        return 0.0, 0.0

    def stats(self) -> dict:
        return {"transport": self.transport}

    def reset_stats(self) -> None:
        """No counters."""

    def close(self) -> None:
        """Nothing held beyond the object."""


class NoExchange(InProcessExchange):
    """The exchange of a rank without peers: what it gathers and what it receives is only its own
    data.

    With one rank (``layout`` None: the unsplit run) both ops return their input, which is then
    exactly what the whole model's op computes.  With a layout of several ranks it is the "none"
    benchmark baseline (``workers.dit.protocol``): the results have the real shapes, the other
    ranks' parts stay zeros.
    """

    transport = "none"

    def __init__(
        self,
        rank: int = 0,
        layout: ArenaLayout | None = None,
        device: torch.device = _CPU,
    ) -> None:
        self.rank, self.layout = rank, layout
        self._g = self._a = None
        self._q: torch.Tensor | None = None
        if layout is not None:
            t0, t1 = layout.rows(rank)
            self._g = torch.zeros(
                (layout.tokens, layout.row_width), dtype=layout.torch_dtype, device=device
            )
            self._a = torch.zeros(
                (t1 - t0, layout.columns), dtype=layout.torch_dtype, device=device
            )

    def all_gather_rows(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        if self._g is None:
            return local
        assert self.layout is not None  # the buffers exist only with a layout
        t0, t1 = self.layout.rows(self.rank)
        self._g[t0:t1].copy_(local)
        return self._g

    def all_to_all_cols(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        if self._a is None:
            return local
        assert self.layout is not None  # the buffers exist only with a layout
        t0, t1 = self.layout.rows(self.rank)
        c0, c1 = self.layout.cols(self.rank)
        self._a[:, c0:c1].copy_(local[t0:t1])
        return self._a

    def all_to_all_qkv(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        lay = self.layout
        if lay is None:
            raise ValueError("the unsplit run projects q, k and v for every token itself")
        c0, c1 = lay.cols(self.rank)
        t0, t1 = lay.rows(self.rank)
        if self._q is None:
            self._q = torch.zeros(
                (lay.tokens, 3 * (c1 - c0)), dtype=lay.torch_dtype, device=local.device
            )
        self._q[t0:t1].copy_(packed_qkv(local, lay.qkv_cols(self.rank)))
        return self._q

    def all_gather_rows_each(self, local: torch.Tensor, on_rows: RowsFn) -> torch.Tensor:
        out = self.all_gather_rows(local)
        if self.layout is None:
            on_rows(0, out.shape[0], out)
        else:
            each_rank_rows(self.layout, out, on_rows)
        return out

    def all_to_all_heads(self, produce: ProduceFn, pieces: int) -> torch.Tensor:
        if self.layout is None:
            raise ValueError("head pieces need a rank layout; the unsplit run attends in one call")
        return self.all_to_all_cols(produced_columns(self.layout, self.rank, pieces, produce))
