"""The exchange of the DiT split: what each collective returns (the spec), the interface the block
loop sees, and the base every transport builds on.

Every op works on one rank plan, an :class:`~workers.transports.arena.ArenaLayout`: rank r holds
tokens ``[t_r, t_r+1)`` and head-group columns ``[c_r, c_r+1)``, ``W`` is the row width (hidden
size), ``C`` all columns, ``S`` all tokens (``docs/architecture.md`` §3):

* ``all_gather_rows``: rank r gives rows ``[n_r, W]``; every rank gets ``[S, W]`` in token order
  (:func:`gathered_rows`).
* ``all_gather_rows_each``: the same gather in one chunk, handing each non-empty rank's rows to a
  callback: this rank's first (before it waits), then each peer's (as soon as they are here, where
  the transport can), so the rank computes on them (the qkv projection) while others' still arrive.
* ``all_gather_rows_produced``: the same gather, rank r's rows produced row piece by row piece
  while the op runs (``produce(a, b)``: its rows [a, b) in its own coordinates,
  :meth:`ArenaLayout.chunk_rows`), each piece published as soon as it is produced, so the rows
  travel while the next piece computes (the cross-block overlap: block i's tail in row pieces, each
  followed by block i+1's norm1 + modulation of those rows).
* ``all_to_all_cols``: rank r gives ``[S, c_r]``; every rank gets ``[n_r, C]`` = every rank's
  columns for its own tokens, in rank order (:func:`received_cols`).
* ``all_to_all_heads``: the same result, rank r's columns produced head piece by head piece while
  the op runs (``produce(c_a, c_b)``, :meth:`ArenaLayout.head_piece`).
* ``all_to_all_qkv`` (the Ulysses pattern): rank r gives ``[n_r, 3·C]`` (q, k and v of every head
  for its tokens, as the fused projection lays them out); every rank gets ``[S, 3·c_r]`` = q, k
  and v of its own heads for every token, packed ``[q | k | v]`` as a projection of its head group
  alone (:func:`received_qkv`).
* ``all_to_all_qkv_attend`` (the Ulysses pattern with attention in head pieces): the q/k/v
  all-to-all in this rank's head pieces (:meth:`ArenaLayout.head_piece`), each piece, its heads'
  q, k and v packed alone ``[S, 3·w_j]`` (:meth:`ArenaLayout.q_piece_view`), handed to a callback
  as soon as it is here, which attends it: ``[S, w_j]``; those outputs go back by the all-to-all of
  columns, piece by piece, so piece j+1 travels in and piece j-1's output travels back while
  piece j is attended.  Every rank gets ``[n_r, C]``: every rank's attention output of its own
  tokens (:func:`received_attended`).

``chunks`` (0..255; 0 and 1: one shot) pipelines an op in that many pieces where the transport can;
every rank must give the same.

Implementations: :class:`workers.transports.host.HostExchange` (shared-memory arena),
:class:`workers.transports.dist.DistExchange` (torch.distributed),
:class:`workers.transports.local.LocalExchange` (ranks as threads of one process: the simulated
split), :class:`NoExchange` (a rank that gets nothing from its peers: the "none" benchmark
baseline), :class:`IdentityExchange` (the unsplit run) and, on a CUDA rank,
``workers.dit.cuda.CudaExchange`` wrapping the first two.  The block loop (``workers.dit.loop``)
sees only :class:`Exchange`.  Every implementation but the identity derives from
:class:`ExchangeBase`, which checks the arguments, counts chunks and pieces and allocates results,
so a transport implements only how bytes move; ``tests/test_exchange_conformance.py`` runs every
one against the spec.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, TypedDict

import torch

from workers.transports.arena import (
    BUFFERS,
    KIND_ALL_TO_ALL,
    KIND_ALL_TO_ALL_HEADS,
    KIND_GATHER,
    KIND_NAMES,
    KIND_QKV,
    KIND_QKV_ATTEND,
    MAX_CHUNKS,
    ArenaLayout,
    piece,
    qkv_ranges,
)

_CPU = torch.device("cpu")
#: :class:`NoExchange`'s peer parts are drawn from a generator seeded with this plus the rank
PEER_DATA_SEED = 20261206

#: ``produce(c_a, c_b)``: this rank's all-to-all columns [c_a, c_b) (whole heads) for all tokens.
ProduceFn = Callable[[int, int], torch.Tensor]
#: ``produce(a, b)``: this rank's gather rows [a, b) (its own row coordinates), ``[b - a, W]``.
RowsProduceFn = Callable[[int, int], torch.Tensor]
#: ``on_rows(a, b, rows)``: the gathered rows of tokens [a, b) (one rank's), once they are here.
RowsFn = Callable[[int, int, torch.Tensor], None]
#: ``attend(c_a, c_b, qkv)``: given q, k and v of this rank's columns [c_a, c_b) (whole heads, its
#: own coordinates) for every token, packed ``[S, 3·(c_b - c_a)]``, those heads' attention output
#: ``[S, c_b - c_a]``.
AttendFn = Callable[[int, int, torch.Tensor], torch.Tensor]


class ExchangeError(RuntimeError):
    """Base of the exchange's failures."""


class ExchangeAborted(ExchangeError):
    """The pool bumped the abort generation (a rank died, the job was cancelled)."""


class ExchangeTimeout(ExchangeError):
    """A peer's data did not arrive within the op's deadline."""


class ExchangeChunkMismatch(ExchangeError):
    """Ranks disagree on the op sequence or the chunk count of an op."""


# -- the spec: what rank ``rank`` gets, given every rank's input (``inputs[p]``: rank p's) ---------
def packed_qkv(rows: torch.Tensor, cols: list[tuple[int, int]]) -> torch.Tensor:
    """One rank's q, k and v columns ``cols`` (:meth:`ArenaLayout.qkv_cols`) of projection rows
    ``[n, 3·C]``, side by side: ``[n, 3·c]`` as a projection of that rank's heads alone."""
    return torch.cat([rows[:, a:b] for a, b in cols], dim=1)


def gathered_rows(layout: ArenaLayout, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``all_gather_rows``' result on every rank: each rank's ``[n_p, W]`` rows in token order."""
    return torch.cat([inputs[p] for p in range(layout.world)])


def received_cols(layout: ArenaLayout, rank: int, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``all_to_all_cols``' (and ``all_to_all_heads``') result on ``rank``: every rank's
    ``[S, c_p]`` columns of ``rank``'s tokens, in rank order."""
    t0, t1 = layout.rows(rank)
    return torch.cat([inputs[p][t0:t1] for p in range(layout.world)], dim=1)


def received_qkv(layout: ArenaLayout, rank: int, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``all_to_all_qkv``'s result on ``rank``: q, k and v of its heads from every rank's
    ``[n_p, 3·C]`` projection, in token order."""
    cols = layout.qkv_cols(rank)
    return torch.cat([packed_qkv(inputs[p], cols) for p in range(layout.world)])


def qkv_pieces(
    layout: ArenaLayout, rank: int, pieces: int, inputs: Sequence[torch.Tensor]
) -> list[tuple[int, int, torch.Tensor]]:
    """What ``all_to_all_qkv_attend`` hands ``rank``'s callback: each non-empty head piece's bounds
    and its heads' q, k and v for every token, packed alone ``[S, 3·(b - a)]``, in order."""
    whole = received_qkv(layout, rank, inputs)
    c = whole.shape[1] // 3
    n = max(1, pieces)
    bounds = [layout.head_piece(rank, n, j) for j in range(n)]
    return [(a, b, packed_qkv(whole, qkv_ranges(a, b, c))) for a, b in bounds if b > a]


def received_attended(
    layout: ArenaLayout,
    rank: int,
    pieces: int,
    inputs: Sequence[torch.Tensor],
    attend: AttendFn,
) -> torch.Tensor:
    """``all_to_all_qkv_attend``'s result on ``rank``: every rank's ``attend`` of its q/k/v pieces
    (:func:`qkv_pieces`) put side by side, moved by :func:`received_cols`."""
    outs = []
    for p in range(layout.world):
        parts = [attend(a, b, qkv) for a, b, qkv in qkv_pieces(layout, p, pieces, inputs)]
        empty = inputs[p].new_empty((layout.tokens, 0))
        outs.append(torch.cat(parts, dim=1) if parts else empty)
    return received_cols(layout, rank, outs)


class Exchange(Protocol):
    """One rank's side of the per-block collectives (what each returns: the module docstring)."""

    def begin(self, abort_generation: int) -> None:
        """Start a job; every op raises ``ExchangeAborted`` once the pool's abort generation moves
        past this one."""

    def all_gather_rows(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        """Every rank's rows in token order: ``[n_rank, row_width]`` in, ``[S, row_width]`` out."""

    def all_gather_rows_each(self, local: torch.Tensor, on_rows: RowsFn) -> torch.Tensor:
        """:meth:`all_gather_rows`, calling ``on_rows(a, b, rows)`` for this rank's rows first and
        then for each peer's."""

    def all_gather_rows_produced(self, produce: RowsProduceFn, pieces: int) -> torch.Tensor:
        """:meth:`all_gather_rows` of the rows ``produce(a, b)`` returns per row piece (every row
        of this rank produced exactly once, pieces in order); a transport that can moves each
        piece while the next is produced."""

    def all_to_all_cols(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        """Every rank's columns for this rank's tokens: ``[S, c_rank]`` in, ``[n_rank, C]`` out."""

    def all_to_all_qkv(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        """q, k and v of every head for this rank's tokens ``[n_rank, 3·C]`` in, q, k and v of this
        rank's heads for every token ``[S, 3·c_rank]`` out (:func:`packed_qkv` layout)."""

    def all_to_all_qkv_attend(
        self, local: torch.Tensor, pieces: int, attend: AttendFn
    ) -> torch.Tensor:
        """:meth:`all_to_all_qkv` in this rank's head pieces, ``attend(c_a, c_b, qkv)`` called for
        each non-empty piece in order as soon as it is here, and its outputs moved back as
        :meth:`all_to_all_cols` moves columns: ``[n_rank, 3·C]`` in, ``[n_rank, C]`` out
        (:func:`received_attended`)."""

    def all_to_all_heads(self, produce: ProduceFn, pieces: int) -> torch.Tensor:
        """:meth:`all_to_all_cols` of the columns ``produce(c_a, c_b)`` returns per head piece; a
        transport that can moves each piece while the next is produced."""

    def counters(self) -> tuple[float, float]:
        """(copy seconds, wait seconds) since the last reset, read on the host clock without
        synchronising any device (the block loop reads them after every block)."""

    def stats(self) -> dict:
        """The step's counters for the step record (may synchronise device events)."""

    def reset_stats(self) -> None:
        """Zero the counters (once per step)."""

    def close(self) -> None:
        """Drop what the exchange holds (not the memory or process group it was given)."""


class ExchangeStats(TypedDict):
    """Counters of a cross-process exchange since its last ``reset_stats()``."""

    transport: str
    rank: int
    ops: int
    bytes_written: int
    bytes_read: int
    copy_s: float
    wait_s: float
    signals_sent: int


class ExchangeBase(ABC):
    """The :class:`Exchange` of one rank of ``layout``, written once for every transport.

    The public ops check their input against the rank plan, validate ``chunks`` (and ``pieces``),
    take the tensor the result goes into (``out`` when given, checked, else :meth:`_result`) and
    hand over to the transport's hooks, which only move bytes: ``_all_gather_rows``,
    ``_all_to_all_cols`` and ``_all_to_all_qkv`` (required); ``_all_gather_rows_each``,
    ``_all_gather_rows_produced``, ``_all_to_all_heads`` and ``_all_to_all_qkv_attend`` (by
    default built on the first three, for transports that move a whole op in one collective).
    ``_begin_op`` is called once per op, after the checks.
    """

    rank: int
    layout: ArenaLayout
    #: Where :meth:`all_to_all_heads` puts its result when no ``out`` is given (the ops with an
    #: input tensor put theirs on its device).
    device: torch.device = _CPU

    # -- the ops -----------------------------------------------------------------------------------
    def all_gather_rows(
        self, local: torch.Tensor, chunks: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every rank's rows in token order: ``local`` is ``[n_rank, row_width]``, the result
        ``[S, row_width]``."""
        lay = self.layout
        self._check_input(KIND_NAMES[KIND_GATHER], local, (self._n_rows, lay.row_width))
        n, res = self._start(KIND_GATHER, chunks, out, (lay.tokens, lay.row_width), local.device)
        return self._all_gather_rows(local, n, res)

    def all_gather_rows_each(
        self, local: torch.Tensor, on_rows: RowsFn, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`all_gather_rows` in one chunk, calling ``on_rows(a, b, rows)`` for this rank's
        rows first and then for each non-empty peer's (as they arrive where the transport can)."""
        lay = self.layout
        self._check_input(KIND_NAMES[KIND_GATHER], local, (self._n_rows, lay.row_width))
        _, res = self._start(KIND_GATHER, 1, out, (lay.tokens, lay.row_width), local.device)
        return self._all_gather_rows_each(local, on_rows, res)

    def all_gather_rows_produced(
        self, produce: RowsProduceFn, pieces: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`all_gather_rows` of this rank's rows produced in ``pieces`` row pieces
        (``produce(a, b)``, local coordinates, :meth:`ArenaLayout.chunk_rows`; 0 and 1: one piece;
        empty pieces are not produced).  Its chunk j carries every rank's piece j, as
        ``all_gather_rows`` in ``pieces`` chunks lays them out."""
        lay = self.layout
        shape = (lay.tokens, lay.row_width)
        n, res = self._start(KIND_GATHER, pieces, out, shape, self.device, "row pieces")
        return self._all_gather_rows_produced(produce, n, res)

    def all_to_all_cols(
        self, local: torch.Tensor, chunks: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every rank's columns for this rank's tokens: ``local`` is ``[S, c_rank]``, the result
        ``[n_rank, C]``."""
        lay = self.layout
        c0, c1 = lay.cols(self.rank)
        self._check_input(KIND_NAMES[KIND_ALL_TO_ALL], local, (lay.tokens, c1 - c0))
        shape = (self._n_rows, lay.columns)
        n, res = self._start(KIND_ALL_TO_ALL, chunks, out, shape, local.device)
        return self._all_to_all_cols(local, n, res)

    def all_to_all_qkv(
        self, local: torch.Tensor, chunks: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q, k and v of this rank's heads for every token: ``local`` is ``[n_rank, 3·C]`` (every
        head's, this rank's tokens), the result ``[S, 3·c_rank]`` (:func:`packed_qkv` layout)."""
        lay = self.layout
        c0, c1 = lay.cols(self.rank)
        self._check_input(KIND_NAMES[KIND_QKV], local, (self._n_rows, 3 * lay.columns))
        n, res = self._start(KIND_QKV, chunks, out, (lay.tokens, 3 * (c1 - c0)), local.device)
        return self._all_to_all_qkv(local, n, res)

    def all_to_all_qkv_attend(
        self,
        local: torch.Tensor,
        pieces: int,
        attend: AttendFn,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`all_to_all_qkv` in ``pieces`` head pieces of this rank's group (0 and 1: one
        piece; at most ``MAX_CHUNKS // 2``: the op publishes each piece twice), each non-empty
        piece's q, k and v packed alone (:meth:`ArenaLayout.q_piece_view`) handed to ``attend(c_a,
        c_b, qkv)`` in order, its ``[S, c_b - c_a]`` output moved back: the result is
        ``[n_rank, C]``, every rank's attention output of this rank's tokens."""
        lay = self.layout
        what = KIND_NAMES[KIND_QKV_ATTEND]
        self._check_input(what, local, (self._n_rows, 3 * lay.columns))
        if isinstance(pieces, int) and pieces > MAX_CHUNKS // 2:
            raise ValueError(f"{what}: head pieces must be at most {MAX_CHUNKS // 2}, got {pieces}")
        shape = (self._n_rows, lay.columns)
        n, res = self._start(KIND_QKV_ATTEND, pieces, out, shape, local.device, "head pieces")
        return self._all_to_all_qkv_attend(local, n, attend, res)

    def all_to_all_heads(
        self, produce: ProduceFn, pieces: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`all_to_all_cols` of this rank's columns produced in ``pieces`` head pieces
        (``produce(c_a, c_b)``, :meth:`ArenaLayout.head_piece`; 0 and 1: one piece)."""
        shape = (self._n_rows, self.layout.columns)
        n, res = self._start(KIND_ALL_TO_ALL_HEADS, pieces, out, shape, self.device, "head pieces")
        return self._all_to_all_heads(produce, n, res)

    # -- the transport's hooks ---------------------------------------------------------------------
    @abstractmethod
    def _all_gather_rows(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """Gather into ``out`` in ``n`` chunks (``local`` and ``out`` checked); returns ``out``."""

    @abstractmethod
    def _all_to_all_cols(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """The all-to-all of columns into ``out`` in ``n`` chunks; returns ``out``."""

    @abstractmethod
    def _all_to_all_qkv(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """The q/k/v all-to-all into ``out`` in ``n`` chunks; returns ``out``."""

    def _all_gather_rows_each(
        self, local: torch.Tensor, on_rows: RowsFn, out: torch.Tensor
    ) -> torch.Tensor:
        """The gather in one chunk, then this rank's rows and each peer's handed over."""
        self._all_gather_rows(local, 1, out)
        self._hand_over(self.rank, out, on_rows)
        for p in range(self.layout.world):
            if p != self.rank:
                self._hand_over(p, out, on_rows)
        return out

    def _all_gather_rows_produced(
        self, produce: RowsProduceFn, n: int, out: torch.Tensor
    ) -> torch.Tensor:
        """Every piece produced first, then one gather of the whole rows."""
        lay = self.layout
        parts = [part for j in range(n) if (part := self._row_piece(produce, n, j)[2]) is not None]
        local = (
            torch.cat(parts) if parts else out.new_empty((0, lay.row_width))
        )  # a rank without rows gives none
        return self._all_gather_rows(local, 1, out)

    def _all_to_all_heads(self, produce: ProduceFn, n: int, out: torch.Tensor) -> torch.Tensor:
        """Every piece produced first, then one all-to-all of the whole columns."""
        parts = [part for j in range(n) if (part := self._piece(produce, n, j)[2]) is not None]
        return self._attended(parts, out)

    def _all_to_all_qkv_attend(
        self, local: torch.Tensor, n: int, attend: AttendFn, out: torch.Tensor
    ) -> torch.Tensor:
        """One q/k/v all-to-all of the whole columns, each piece attended, one all-to-all of the
        whole output."""
        lay = self.layout
        c0, c1 = lay.cols(self.rank)
        shape = (lay.tokens, 3 * (c1 - c0))
        whole = self._all_to_all_qkv(local, 1, out.new_empty(shape))
        pieces = out.new_empty(shape)
        return self._attended(self._attend_pieces(whole, 0, n, attend, pieces), out)

    def _attend_pieces(
        self, whole: torch.Tensor, t0: int, n: int, attend: AttendFn, pieces: torch.Tensor
    ) -> list[torch.Tensor]:
        """Lay ``whole`` (rows from token ``t0`` on, the :func:`packed_qkv` layout) out in
        ``pieces`` (``[S, 3·c_rank]``) piece by piece, attending each non-empty piece once it is
        there: the outputs, checked."""
        c, t1 = whole.shape[1] // 3, t0 + whole.shape[0]
        outs = []
        for j in range(n):
            a, b = self.layout.head_piece(self.rank, n, j)
            if b > a:
                view = self.layout.q_piece_view(pieces, self.rank, n, j)
                for k, (lo, hi) in enumerate(qkv_ranges(a, b, c)):
                    view[t0:t1, k * (b - a) : (k + 1) * (b - a)].copy_(whole[:, lo:hi])
                outs.append(self._attended_piece(attend, a, b, view))
        return outs

    def _attended_piece(self, attend: AttendFn, a: int, b: int, qkv: torch.Tensor) -> torch.Tensor:
        """``attend``'s output of head piece [a, b), checked."""
        part = attend(a, b, qkv)
        shape = (self.layout.tokens, b - a)
        if tuple(part.shape) != shape or part.dtype != self.layout.torch_dtype:
            raise ValueError(
                f"rank {self.rank}: all_to_all_qkv_attend: attend() must return "
                f"{self.layout.dtype} {list(shape)} for head piece [{a}, {b}), got {part.dtype} "
                f"{list(part.shape)}"
            )
        return part

    def _attended(self, outs: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """The all-to-all of this rank's attended pieces ``outs`` put side by side, into
        ``out``."""
        if not outs:  # a rank without heads
            return self._all_to_all_cols(out.new_empty((self.layout.tokens, 0)), 1, out)
        return self._all_to_all_cols(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], 1, out)

    def _begin_op(self, kind: int, n: int) -> None:  # noqa: B027 - a hook most transports skip
        """Called once per op after its argument checks, before its result is allocated (``n``:
        its chunk count, at least 1)."""

    def _result(self, kind: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The tensor an op without ``out`` writes its result into (a transport with result buffers
        of its own returns those)."""
        return torch.empty(shape, dtype=self.layout.torch_dtype, device=device)

    # -- shared bookkeeping ------------------------------------------------------------------------
    @property
    def _n_rows(self) -> int:
        t0, t1 = self.layout.rows(self.rank)
        return t1 - t0

    def _start(
        self,
        kind: int,
        chunks: int,
        out: torch.Tensor | None,
        shape: tuple[int, int],
        device: torch.device,
        what: str = "exchange chunks",
    ) -> tuple[int, torch.Tensor]:
        """Check ``chunks`` (``what`` names them) and ``out``, begin the op; its chunk count (at
        least 1) and the tensor its ``shape`` result goes into."""
        if not isinstance(chunks, int) or not 0 <= chunks <= MAX_CHUNKS:
            raise ValueError(
                f"{what} must be an int in 0..{MAX_CHUNKS} (0/1 = single shot), got {chunks!r}"
            )
        if out is not None and (tuple(out.shape) != shape or out.dtype != self.layout.torch_dtype):
            raise ValueError(
                f"rank {self.rank}: {KIND_NAMES[kind]} out must be {self.layout.dtype} "
                f"{list(shape)}, got {out.dtype} {list(out.shape)}"
            )
        n = max(1, chunks)
        self._begin_op(kind, n)
        return n, self._result(kind, shape, device) if out is None else out

    def _check_input(self, what: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
        if tuple(t.shape) != shape or t.dtype != self.layout.torch_dtype:
            raise ValueError(
                f"rank {self.rank}: {what} input must be {self.layout.dtype} {list(shape)}, got "
                f"{t.dtype} {list(t.shape)}; the rank plan and the exchange layout disagree"
            )

    def _piece(self, produce: ProduceFn, n: int, j: int) -> tuple[int, int, torch.Tensor | None]:
        """Head piece j of ``n`` of this rank's columns: its bounds (group coordinates) and
        ``produce``'s ``[S, b - a]`` columns, checked (None for an empty piece)."""
        a, b = self.layout.head_piece(self.rank, n, j)
        if b == a:
            return a, b, None
        part = produce(a, b)
        self._check_input("all_to_all_heads piece", part, (self.layout.tokens, b - a))
        return a, b, part

    def _row_piece(
        self, produce: RowsProduceFn, n: int, j: int
    ) -> tuple[int, int, torch.Tensor | None]:
        """Row piece j of ``n`` of this rank's rows: its bounds (sequence coordinates) and
        ``produce``'s ``[b - a, W]`` rows, checked (None for an empty piece)."""
        a, b = self.layout.chunk_rows(self.rank, n, j)
        if b == a:
            return a, b, None
        t0 = self.layout.rows(self.rank)[0]
        part = produce(a - t0, b - t0)
        self._check_input("all_gather_rows_produced piece", part, (b - a, self.layout.row_width))
        return a, b, part

    def _hand_over(self, p: int, gathered: torch.Tensor, on_rows: RowsFn) -> None:
        """``on_rows`` for rank p's rows of ``gathered`` (none for a rank without rows)."""
        a, b = self.layout.rows(p)
        if b > a:
            on_rows(a, b, gathered[a:b])

    # -- the job -----------------------------------------------------------------------------------
    @abstractmethod
    def begin(self, abort_generation: int) -> None:
        """Start a job (:meth:`Exchange.begin`)."""

    @abstractmethod
    def counters(self) -> tuple[float, float]:
        """(copy seconds, wait seconds) since the last :meth:`reset_stats`."""

    @abstractmethod
    def stats(self) -> dict:
        """The counters since construction or the last :meth:`reset_stats`."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Zero the counters."""

    @abstractmethod
    def close(self) -> None:
        """Drop what the exchange holds."""


class JobExchange(ExchangeBase):
    """Base of the exchanges between rank processes: a job runs under the pool's abort generation
    (word 0 of ``control``, an int64 shm tensor: :meth:`begin` and every op raise
    :class:`ExchangeAborted` once it differs from the job's) and counts its ops, bytes, copies and
    waits.  ``transport`` names it in the stats."""

    transport: str

    def __init__(
        self, rank: int, world: int, layout: ArenaLayout, control: torch.Tensor | None
    ) -> None:
        if world != layout.world:
            raise ValueError(f"world={world} but the layout was planned for world={layout.world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} is outside 0..{world - 1}")
        self.rank, self.world, self.layout = rank, world, layout
        self._ctl = control.reshape(-1).numpy() if control is not None else None
        self._gen: int | None = None
        self.reset_stats()

    def begin(self, abort_generation: int) -> None:
        """Start a job under ``abort_generation`` (the control word's value when the job was
        submitted)."""
        self._gen = int(abort_generation)
        self.check_abort("begin")

    def _begin_op(self, kind: int, n: int) -> None:
        if self._gen is None:
            raise RuntimeError(
                f"rank {self.rank}: call begin(abort_generation) before the first exchange of a job"
            )
        self._stats["ops"] += 1
        self.check_abort("start")

    def check_abort(self, where: str) -> None:
        """Raise :class:`ExchangeAborted` (naming ``where``) once the pool aborted the job."""
        if self._ctl is not None and int(self._ctl[0]) != self._gen:
            raise ExchangeAborted(
                f"rank {self.rank}: exchange aborted during {where} (abort generation "
                f"{int(self._ctl[0])}, job started under {self._gen})"
            )

    def counters(self) -> tuple[float, float]:
        return self._stats["copy_s"], self._stats["wait_s"]

    def stats(self) -> dict:
        return dict(self._stats)

    def reset_stats(self) -> None:
        self._stats = self._zero_stats()

    def _zero_stats(self) -> ExchangeStats:
        return {
            "transport": self.transport,
            "rank": self.rank,
            "ops": 0,
            "bytes_written": 0,
            "bytes_read": 0,
            "copy_s": 0.0,
            "wait_s": 0.0,
            "signals_sent": 0,
        }


class InProcess:
    """The job side of an exchange whose peers (if any) live in this process: no job to abort, no
    counters, nothing to drop.  ``transport`` names it in the stats."""

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


class NoExchange(InProcess, ExchangeBase):
    """The exchange of a rank that gets nothing from its peers, the "none" benchmark baseline
    (``workers.dit.protocol``): its results have the real shapes and hold only its own part; the
    other ranks' parts hold random values of unit scale, drawn once (seeded by the rank), like the
    activations a split's peers send.  Not zeros: a GPU runs the same kernels measurably faster
    on zeros (less switching, higher clocks), which would make the baseline, and every shard
    timed with it, faster than the split's ranks for a reason the exchange has nothing to do
    with.  With one rank the result is its own part alone.  Results without ``out`` are buffers
    of its own (``device``), rewritten by the next op of their kind."""

    transport = "none"

    def __init__(self, rank: int, layout: ArenaLayout, device: torch.device = _CPU) -> None:
        self.rank, self.layout, self.device = rank, layout, device
        self._gens: dict[torch.device, torch.Generator] = {}
        self._buffers = {
            "G": self._peer_data((layout.tokens, layout.row_width), device),
            "A": self._peer_data((self._n_rows, layout.columns), device),
        }

    def _peer_data(self, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        t = torch.empty(shape, dtype=self.layout.torch_dtype, device=device)
        if t.device not in self._gens:
            self._gens[t.device] = torch.Generator(t.device).manual_seed(PEER_DATA_SEED + self.rank)
        return t.normal_(generator=self._gens[t.device])

    def _result(self, kind: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        buf = BUFFERS[kind][-1]  # the buffer the op's result is laid out like: its last
        if buf not in self._buffers:
            self._buffers[buf] = self._peer_data(shape, device)
        return self._buffers[buf]

    def _all_gather_rows(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        t0, t1 = self.layout.rows(self.rank)
        out[t0:t1].copy_(local)
        return out

    def _all_to_all_cols(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        t0, t1 = self.layout.rows(self.rank)
        c0, c1 = self.layout.cols(self.rank)
        out[:, c0:c1].copy_(local[t0:t1])
        return out

    def _all_to_all_qkv(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        t0, t1 = self.layout.rows(self.rank)
        out[t0:t1].copy_(packed_qkv(local, self.layout.qkv_cols(self.rank)))
        return out

    def _all_to_all_qkv_attend(
        self, local: torch.Tensor, n: int, attend: AttendFn, out: torch.Tensor
    ) -> torch.Tensor:
        """Its own rows of each q/k/v piece (the peers' rows keep their random values) attended,
        and its own columns of the output."""
        lay = self.layout
        c0, c1 = lay.cols(self.rank)
        pieces = self._result(KIND_QKV, (lay.tokens, 3 * (c1 - c0)), local.device)
        own = packed_qkv(local, lay.qkv_cols(self.rank))
        outs = self._attend_pieces(own, lay.rows(self.rank)[0], n, attend, pieces)
        return self._attended(outs, out)


class IdentityExchange(InProcess):
    """The exchange of the unsplit run: one rank holds every token and head, so each op's result is
    its input itself (no layout, no copy).  ``tokens``: the run's token count, which only
    :meth:`all_gather_rows_produced` needs (it cuts them into the pieces it produces)."""

    transport = "none"

    def __init__(self, tokens: int | None = None) -> None:
        self.tokens = tokens

    def all_gather_rows(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        return local

    def all_gather_rows_each(self, local: torch.Tensor, on_rows: RowsFn) -> torch.Tensor:
        on_rows(0, local.shape[0], local)
        return local

    def all_gather_rows_produced(self, produce: RowsProduceFn, pieces: int) -> torch.Tensor:
        """The rows in ``pieces`` pieces of every token, as one rank of a split would produce
        them (:func:`~workers.transports.arena.piece`), put together."""
        if not isinstance(pieces, int) or not 0 <= pieces <= MAX_CHUNKS:
            raise ValueError(f"row pieces must be an int in 0..{MAX_CHUNKS}, got {pieces!r}")
        if self.tokens is None:
            raise ValueError("row pieces need the token count: IdentityExchange(tokens=S)")
        n = max(1, pieces)
        parts = [produce(a, b) for a, b in (piece(self.tokens, n, j) for j in range(n)) if b > a]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def all_to_all_cols(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        return local

    def all_to_all_qkv(self, local: torch.Tensor, chunks: int = 0) -> torch.Tensor:
        raise ValueError("the unsplit run projects q, k and v for every token itself")

    def all_to_all_qkv_attend(
        self, local: torch.Tensor, pieces: int, attend: AttendFn
    ) -> torch.Tensor:
        raise ValueError("the unsplit run projects q, k and v for every token itself")

    def all_to_all_heads(self, produce: ProduceFn, pieces: int) -> torch.Tensor:
        raise ValueError("head pieces need a rank layout; the unsplit run attends in one call")
