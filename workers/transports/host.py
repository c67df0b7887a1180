"""Host exchange between rank processes: one shared-memory arena, per-rank sequence words, eventfd
doorbells.

Two collectives per transformer block (``docs/architecture.md`` §3):

* ``all_gather_rows``: rank r holds rows ``[n_r, W]`` (its tokens); every rank gets ``[S, W]`` in
  token order.
* ``all_gather_rows_each``: the same gather in one chunk, handing each rank's rows to a callback
  as soon as they are here (this rank's at once, before it waits), so the rank computes on them
  (the qkv projection) while the others' rows still arrive.
* ``all_to_all_cols``: rank r holds ``[S, c_r]`` (its head group's columns for all tokens); every
  rank gets ``[n_r, C]`` = every rank's columns for its own tokens, in rank order.
* ``all_to_all_qkv`` (the Ulysses pattern, arenas planned with ``qkv``): rank r holds ``[n_r, 3·C]``
  (q, k and v of every head for its tokens, as the fused projection lays them out); every rank gets
  ``[S, 3·c_r]`` = q, k and v of its own heads for every token, packed ``[q | k | v]`` as a
  projection of its head group alone.
* ``all_to_all_heads``: the same result, with rank r's columns produced head piece by head piece
  while the op runs (attention computed in head pieces): chunk j carries piece j of every rank,
  published as soon as it is produced, so peers read piece j while its producer computes piece j+1.
  While this op runs, ``A_r`` holds rank r's pieces one after another, each ``[S, w_j]``.

Arena (one shm segment for all ranks; see :class:`ArenaLayout`)::

    header page   line 0: magic, version, world, nbytes
                  line 1+r: rank r's sequence word, fault word
    G [S, W]      all-gather buffer: rank r writes rows [t_r, t_r+1)
    A_r [S, c_r]  one all-to-all block per rank: rank r writes its columns for every other rank's
    tokens
    Q_r [S, 3c_r] (``qkv`` layouts only) rank r's q, k, v columns: every rank writes its tokens'
    rows

Signalling.  After a chunk's bytes are in the arena the writer stores its *sequence word* (below)
and writes 1 to every peer's eventfd doorbell.  A waiter compares the peers' sequence words with
what it expects; when something is missing it poll()s its own doorbell with the remaining deadline,
drains it and checks again.  An eventfd is a counter, so a ring that lands between the check and the
poll() is not lost.  ``bench_exchange`` measured this against an AF_UNIX msgpack round trip (what
coordinator-routed signalling would cost per message); see its ``choice`` field.

Sequence word (one int64, monotonic within a job)::

    bits 47..62  abort generation (low 16 bits)
    bits 33..46  job number in that generation (1..16383, cycling)
    bits 18..32  op index in the job (1..32767)
    bits 16..17  op kind (0 gather, 1 all-to-all, 2 all-to-all by head pieces, 3 q/k/v all-to-all)
    bits 8..15   chunk count of the op
    bits 0..7    chunks of the op published so far

``begin()`` stores (generation, job, op 0): "I have begun this job".  Because op kind and chunk
count are in the word, a reader that finds a peer on the same op with another kind or chunk count
raises :class:`ExchangeChunkMismatch` and posts a fault word, so every rank fails with the same
clear error instead of reading the wrong rows.

Memory reuse (why G and A_r are not double-buffered).  Before rank p writes into a buffer X at op o
it waits until every peer's sequence word shows an op later than the last op o' of this job that
used X (or, for the first use in a job, shows that the peer has begun this job).  A rank publishes
anything of op o'+1 only after it consumed all of op o', so that wait proves nobody still reads X.
With the block pattern gather(b), all-to-all(b), gather(b+1), ... the wait costs nothing: a rank
writes G for block b+1 only after it has received every rank's A for block b, and each rank
publishes its A for block b only after it finished reading G for block b (symmetrically for A: A for
b+1 is written after every rank's G for b+1 arrived, which each rank publishes after reading A for
b).  Any other op sequence stays correct; the guard then really waits, and a rank that waits first
stores its word for op o with no chunk published, which says the same ("I consumed every op
before"): two consecutive ops over one buffer (the exchange probe runs ``all_to_all_cols`` then
``all_to_all_heads``) would otherwise wait for each other.  Across jobs: a rank writes nothing
of job k+1 before every peer has begun job k+1, i.e. has finished (or abandoned, on abort) job k.
A peer's word showing the *next* job therefore means "everything of this job is published and
still intact".

Failure rules.  ``control[0]`` is the pool's abort generation: when it differs from the one given to
``begin()`` the exchange raises :class:`ExchangeAborted` at the next check (the pool rings every
doorbell so sleepers check at once).  Every op has a deadline of ``deadline_s``; missing data raises
:class:`ExchangeTimeout` naming the ranks and the op/chunk.  After a failed job the pool must bump
the abort generation before the next ``begin()`` (a rank that aborted mid-job and one that finished
the job would otherwise disagree on op numbering); a restarted worker likewise joins with a new
generation.  Job numbers live in the HostExchange objects: new objects over an arena that was
already used need a new generation or a fresh ``ArenaLayout.init_header()``, or a peer's word left
from the old objects could read as this job's progress.

Ordering: the writer stores data, then the sequence word; the reader loads the word, then the data.
On x86-64 (TSO) stores become visible in program order and loads are not reordered with older loads,
so no fence is needed.  Python offers no portable fence; on weakly ordered CPUs a warning is logged
(use ``exchange=nccl`` there).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import torch

from workers.runtime.protocol import DTYPE_SIZES
from workers.runtime.shm import align, dtype_name, torch_dtype

log = logging.getLogger("h3_multistream.worker")

CACHE_LINE = 64
WORDS_PER_LINE = CACHE_LINE // 8
MAGIC = 0x4833_4D53_5843_4831  # "H3MSXCH1"
VERSION = 1
MAX_WORLD = 64
MAX_CHUNKS = 255
MAX_OPS_PER_JOB = (1 << 15) - 1
_JOB_CYCLE = (1 << 14) - 1

KIND_GATHER = 0
KIND_ALL_TO_ALL = 1
KIND_ALL_TO_ALL_HEADS = 2
KIND_QKV = 3
_KIND_NAMES = {
    KIND_GATHER: "all_gather_rows",
    KIND_ALL_TO_ALL: "all_to_all_cols",
    KIND_ALL_TO_ALL_HEADS: "all_to_all_heads",
    KIND_QKV: "all_to_all_qkv",
}
#: The arena buffer each op kind writes (the reuse guard is per buffer).
_BUFFER = {KIND_GATHER: "G", KIND_ALL_TO_ALL: "A", KIND_ALL_TO_ALL_HEADS: "A", KIND_QKV: "Q"}

CopyFn = Callable[[torch.Tensor, torch.Tensor], Any]
#: Starts a copy and returns the function that waits for it.
AsyncCopyFn = Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]
#: ``produce(c_a, c_b)``: this rank's all-to-all columns [c_a, c_b) (whole heads) for all tokens.
ProduceFn = Callable[[int, int], torch.Tensor]
#: ``on_rows(a, b, rows)``: the gathered rows of tokens [a, b) (one rank's), once they are here.
RowsFn = Callable[[int, int, torch.Tensor], None]


class ExchangeError(RuntimeError):
    """Base of the exchange's failures."""


class ExchangeAborted(ExchangeError):
    """The pool bumped the abort generation (a rank died, the job was cancelled)."""


class ExchangeTimeout(ExchangeError):
    """A peer's data did not arrive within the op's deadline."""


class ExchangeChunkMismatch(ExchangeError):
    """Ranks disagree on the op sequence or the chunk count of an op."""


def _check_bounds(what: str, bounds: list[int], world: int) -> tuple[int, ...]:
    if len(bounds) != world + 1:
        raise ValueError(
            f"{what} must have world+1={world + 1} entries, got {len(bounds)}: {list(bounds)}"
        )
    out = tuple(int(b) for b in bounds)
    if out[0] != 0 or any(b > a for a, b in zip(out[1:], out[:-1])):
        raise ValueError(f"{what} must start at 0 and never decrease, got {list(out)}")
    return out


@dataclass(frozen=True)
class ArenaLayout:
    """Where everything lives in one exchange arena (byte offsets from the arena start, all
    4096-aligned).

    ``tokens_bounds[r]:tokens_bounds[r+1]`` are rank r's tokens, ``col_bounds[r]:col_bounds[r+1]``
    its all-to-all columns, ``row_width`` the all-gather row width (hidden size), ``col_unit`` the
    columns of one head (``all_to_all_heads`` cuts a rank's columns into whole heads),
    ``q_offsets`` the Q_r blocks of ``all_to_all_qkv`` (planned with ``qkv``; empty otherwise).
    Build it with :meth:`plan`.
    """

    world: int
    tokens_bounds: tuple[int, ...]
    col_bounds: tuple[int, ...]
    row_width: int
    dtype: str
    header_bytes: int
    g_offset: int
    a_offsets: tuple[int, ...]
    nbytes: int
    col_unit: int = 1
    q_offsets: tuple[int, ...] = ()

    @classmethod
    def plan(
        cls,
        world: int,
        tokens_bounds: list[int],
        col_bounds: list[int],
        row_width: int,
        dtype: torch.dtype | str,
        col_unit: int = 1,
        qkv: bool = False,
    ) -> ArenaLayout:
        """Validate the rank plan and lay out header, G and the A_r blocks."""
        if not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world must be an int in 1..{MAX_WORLD}, got {world!r}")
        tb = _check_bounds("tokens_bounds", tokens_bounds, world)
        cb = _check_bounds("col_bounds", col_bounds, world)
        if not isinstance(row_width, int) or row_width < 1:
            raise ValueError(f"row_width must be a positive int, got {row_width!r}")
        if not isinstance(col_unit, int) or col_unit < 1 or any(b % col_unit for b in cb):
            raise ValueError(
                f"col_unit must be a positive int dividing every column bound {list(cb)}, got "
                f"{col_unit!r}"
            )
        name = dtype_name(dtype)
        elem = DTYPE_SIZES[name]
        seq_tokens = tb[-1]
        header = align(CACHE_LINE * (world + 1))
        g_off = header
        off = g_off + align(seq_tokens * row_width * elem)
        a_offs = []
        for r in range(world):
            a_offs.append(off)
            off += align(seq_tokens * (cb[r + 1] - cb[r]) * elem)
        q_offs = []
        for r in range(world if qkv else 0):
            q_offs.append(off)
            off += align(seq_tokens * 3 * (cb[r + 1] - cb[r]) * elem)
        return cls(
            world,
            tb,
            cb,
            row_width,
            name,
            header,
            g_off,
            tuple(a_offs),
            max(off, header),
            col_unit,
            tuple(q_offs),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def tokens(self) -> int:
        return self.tokens_bounds[-1]

    @property
    def columns(self) -> int:
        return self.col_bounds[-1]

    def rows(self, rank: int) -> tuple[int, int]:
        return self.tokens_bounds[rank], self.tokens_bounds[rank + 1]

    def cols(self, rank: int) -> tuple[int, int]:
        return self.col_bounds[rank], self.col_bounds[rank + 1]

    def to_dict(self) -> dict:
        """Plain msgpack/JSON-able description; :meth:`from_dict` re-plans and checks it."""
        return {
            "world": self.world,
            "tokens_bounds": list(self.tokens_bounds),
            "col_bounds": list(self.col_bounds),
            "row_width": self.row_width,
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "col_unit": self.col_unit,
            "qkv": bool(self.q_offsets),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ArenaLayout:
        try:
            lay = cls.plan(
                d["world"],
                d["tokens_bounds"],
                d["col_bounds"],
                d["row_width"],
                d["dtype"],
                d.get("col_unit", 1),
                bool(d.get("qkv", False)),
            )
        except KeyError as e:
            raise ValueError(
                f"arena layout dict lacks {e}; build it with ArenaLayout.to_dict()"
            ) from None
        if d.get("nbytes", lay.nbytes) != lay.nbytes:
            raise ValueError(
                f"arena layout nbytes {d['nbytes']} != {lay.nbytes} planned here: the coordinator "
                "and the worker run different code versions; restart the workers"
            )
        return lay

    # -- views -------------------------------------------------------------------------------------
    def _check_arena(self, arena: torch.Tensor) -> None:
        if (
            arena.dtype != torch.uint8
            or arena.device.type != "cpu"
            or arena.dim() != 1
            or not arena.is_contiguous()
        ):
            raise ValueError(
                "the exchange arena must be a contiguous 1-D uint8 CPU tensor over shared memory, "
                f"got {arena.dtype} {tuple(arena.shape)} on {arena.device}"
            )
        if arena.numel() < self.nbytes:
            raise ValueError(
                f"exchange arena holds {arena.numel()} bytes, the layout needs {self.nbytes}; size "
                "the segment with layout.nbytes"
            )

    def header_words(self, arena: torch.Tensor) -> np.ndarray:
        """The header page as an int64 numpy view (plain loads/stores, no tensor dispatch per
        check)."""
        self._check_arena(arena)
        return arena.numpy()[: self.header_bytes].view(np.int64)

    def seq_words(self, arena: torch.Tensor) -> list[int]:
        """Every rank's current sequence word (a progress probe for the coordinator; read-only)."""
        words = self.header_words(arena)
        return [int(words[_seq_index(r)]) for r in range(self.world)]

    def g_view(self, arena: torch.Tensor) -> torch.Tensor:
        n = self.tokens * self.row_width * self.torch_dtype.itemsize
        return (
            arena[self.g_offset : self.g_offset + n]
            .view(self.torch_dtype)
            .view(self.tokens, self.row_width)
        )

    def a_view(self, arena: torch.Tensor, rank: int) -> torch.Tensor:
        c0, c1 = self.cols(rank)
        n = self.tokens * (c1 - c0) * self.torch_dtype.itemsize
        off = self.a_offsets[rank]
        return arena[off : off + n].view(self.torch_dtype).view(self.tokens, c1 - c0)

    def q_view(self, arena: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s q, k, v block ``[S, 3·c_r]`` (a ``qkv`` layout's)."""
        if not self.q_offsets:
            raise ValueError(
                "this arena layout has no q/k/v blocks; plan it with qkv=True for the Ulysses "
                "pattern"
            )
        c0, c1 = self.cols(rank)
        n = self.tokens * 3 * (c1 - c0) * self.torch_dtype.itemsize
        off = self.q_offsets[rank]
        return arena[off : off + n].view(self.torch_dtype).view(self.tokens, 3 * (c1 - c0))

    def qkv_cols(self, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s q, k and v column ranges in a fused projection of every head
        (``[q | k | v]``, each ``C`` wide)."""
        c0, c1 = self.cols(rank)
        return [(base + c0, base + c1) for base in (0, self.columns, 2 * self.columns)]

    def head_piece(self, rank: int, pieces: int, j: int) -> tuple[int, int]:
        """Columns [a, b) of ``rank``'s group (its own coordinates) in head piece j of ``pieces``:
        whole heads, near-equal counts (some empty when the group has fewer heads than pieces)."""
        c0, c1 = self.cols(rank)
        a, b = piece((c1 - c0) // self.col_unit, pieces, j)
        return a * self.col_unit, b * self.col_unit

    def a_piece_view(self, a_rank: torch.Tensor, rank: int, pieces: int, j: int) -> torch.Tensor:
        """Head piece j of ``rank``'s block ``a_rank`` (its :meth:`a_view`) as ``all_to_all_heads``
        lays it out: ``[S, b - a]`` after the pieces before it."""
        a, b = self.head_piece(rank, pieces, j)
        flat = a_rank.reshape(-1)
        return flat[self.tokens * a : self.tokens * b].view(self.tokens, b - a)

    def init_header(self, arena: torch.Tensor) -> None:
        """Called once by the arena's creator: magic, version, world, size; every rank's words
        zeroed."""
        words = self.header_words(arena)
        words[:] = 0
        words[1], words[2], words[3] = VERSION, self.world, self.nbytes
        words[0] = MAGIC  # last: a reader that sees the magic sees the rest

    def check_header(self, arena: torch.Tensor) -> None:
        words = self.header_words(arena)
        if int(words[0]) != MAGIC or int(words[1]) != VERSION:
            raise ValueError(
                "exchange arena header is not initialised (magic/version mismatch); the "
                "coordinator must call ArenaLayout.init_header() on a fresh arena before starting "
                "the ranks"
            )
        if int(words[2]) != self.world or int(words[3]) != self.nbytes:
            raise ValueError(
                f"exchange arena header says world={int(words[2])} nbytes={int(words[3])}, the "
                f"layout says world={self.world} nbytes={self.nbytes}: arena and layout do not "
                "belong together"
            )


def _seq_index(rank: int) -> int:
    return (rank + 1) * WORDS_PER_LINE


def _fault_index(rank: int) -> int:
    return (rank + 1) * WORDS_PER_LINE + 1


def _epoch_bits(gen: int, job: int) -> int:
    return ((gen & 0xFFFF) << 47) | (job << 33)


def encode_seq(gen: int, job: int, op: int, kind: int, chunks: int, count: int) -> int:
    """Pack one sequence word (layout in the module docstring)."""
    return _epoch_bits(gen, job) | (op << 18) | (kind << 16) | (chunks << 8) | count


def decode_seq(word: int) -> tuple[int, int, int, int, int, int]:
    """(generation low 16 bits, job, op, kind, chunks, count) of a sequence word."""
    return (
        (word >> 47) & 0xFFFF,
        (word >> 33) & 0x3FFF,
        (word >> 18) & 0x7FFF,
        (word >> 16) & 3,
        (word >> 8) & 0xFF,
        word & 0xFF,
    )


def piece(n: int, chunks: int, j: int) -> tuple[int, int]:
    """Rows [a, b) of chunk j when n rows are cut into ``chunks`` near-equal pieces (some empty if
    chunks > n)."""
    return n * j // chunks, n * (j + 1) // chunks


def _default_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def produced_columns(
    layout: ArenaLayout, rank: int, pieces: int, produce: ProduceFn
) -> torch.Tensor:
    """``rank``'s whole ``[S, c_rank]`` all-to-all input, produced piece by piece as
    ``all_to_all_heads`` produces it (for exchanges that move it in one collective)."""
    parts = []
    for j in range(max(1, pieces)):
        a, b = layout.head_piece(rank, max(1, pieces), j)
        if b > a:
            parts.append(produce(a, b))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def each_rank_rows(layout: ArenaLayout, gathered: torch.Tensor, on_rows: RowsFn) -> None:
    """``on_rows`` for every rank's rows of a finished gather, in rank order (for exchanges that
    gather in one collective)."""
    for p in range(layout.world):
        a, b = layout.rows(p)
        if b > a:
            on_rows(a, b, gathered[a:b])


def packed_qkv(rows: torch.Tensor, cols: list[tuple[int, int]]) -> torch.Tensor:
    """One rank's q, k and v columns ``cols`` (:meth:`ArenaLayout.qkv_cols`) of projection rows
    ``[n, 3·C]``, side by side: ``[n, 3·c]`` as a projection of that rank's heads alone."""
    return torch.cat([rows[:, a:b] for a, b in cols], dim=1)


def _no_wait() -> None:
    """A copy that was done when it returned."""


def _sync_copy(fn: CopyFn) -> AsyncCopyFn:
    def start(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        fn(dst, src)
        return _no_wait

    return start


_AHEAD = 1 << 62  # a peer in the next job has published everything of ours
_CPU = torch.device("cpu")


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


class HostStats(ExchangeStats):
    """The host exchange's counters: chunks published, doorbell wake-ups, waits ended spinning."""

    chunks_published: int
    wakeups: int
    spin_hits: int


class HostExchange:
    """One rank's side of the host exchange.  See the module docstring for the protocol.

    ``to_host(dst_view, src)`` copies a rank's outgoing rows into the arena and must return only
    when the bytes are there (a CUDA hook synchronises its copy's event); ``to_device(dst,
    src_view)`` copies incoming rows out.  Both default to ``dst.copy_(src)``.  ``to_host_async``
    starts an outgoing copy and returns the function that waits for it (``all_to_all_heads`` starts
    piece j+1's copies before it waits for piece j's); it defaults to ``to_host``, done at once.
    ``spin_us`` > 0
    re-checks the peers' words for that long before sleeping on the doorbell (measured by
    bench_exchange; off by default).
    """

    def __init__(
        self,
        rank: int,
        world: int,
        arena: torch.Tensor,
        layout: ArenaLayout,
        doorbell_fds: list[int],
        control: torch.Tensor,
        deadline_s: float,
        *,
        spin_us: float = 0.0,
        to_host: CopyFn | None = None,
        to_device: CopyFn | None = None,
        to_host_async: AsyncCopyFn | None = None,
    ) -> None:
        if world != layout.world:
            raise ValueError(
                f"world={world} but the arena layout was planned for world={layout.world}"
            )
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} is outside 0..{world - 1}")
        if len(doorbell_fds) != world:
            raise ValueError(f"need one doorbell fd per rank ({world}), got {len(doorbell_fds)}")
        if control.dtype != torch.int64 or control.device.type != "cpu" or control.numel() < 1:
            raise ValueError(
                "control must be an int64 CPU tensor over shared memory whose word 0 is the abort "
                f"generation, got {control.dtype} {tuple(control.shape)} on {control.device}"
            )
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        layout.check_header(arena)
        if platform.machine().lower() not in ("x86_64", "amd64"):
            log.warning(
                "[exchange] host exchange on %s: the sequence-word protocol relies on x86-64 store "
                "ordering; use exchange=nccl on this machine if results differ",
                platform.machine(),
            )
        self.rank, self.world, self.layout = rank, world, layout
        self.deadline_s = float(deadline_s)
        self.spin_s = max(0.0, float(spin_us)) * 1e-6
        self._to_host = to_host or _default_copy
        self._to_device = to_device or _default_copy
        self._to_host_async = to_host_async or _sync_copy(self._to_host)
        self._arena = arena  # keeps the mapping's views alive
        self._words = layout.header_words(arena)
        self._ctl = control.reshape(-1).numpy()
        self._g = layout.g_view(arena)
        self._a = [layout.a_view(arena, r) for r in range(world)]
        self._q = [layout.q_view(arena, r) for r in range(world)] if layout.q_offsets else []
        self._peers = [p for p in range(world) if p != rank]
        self._peer_fds = [doorbell_fds[p] for p in self._peers]
        self._my_fd = doorbell_fds[rank]
        self._poll = select.poll()
        self._poll.register(self._my_fd, select.POLLIN)
        self._gen: int | None = None
        self._job = 0
        self._op = 0
        self._last_use = {"G": -1, "A": -1, "Q": -1}  # per arena buffer; -1: not used in this job
        self._deadline = 0.0
        self.reset_stats()

    # -- public ------------------------------------------------------------------------------------
    def begin(self, abort_generation: int) -> None:
        """Start a job under ``abort_generation`` (the control word's value when the job was
        submitted)."""
        if abort_generation != self._gen:
            self._job = 0
        self._gen = int(abort_generation)
        self._job = self._job % _JOB_CYCLE + 1
        self._op = 0
        self._last_use = {"G": -1, "A": -1, "Q": -1}  # per arena buffer; -1: not used in this job
        self._check_abort("begin")
        self._words[_fault_index(self.rank)] = 0
        self._words[_seq_index(self.rank)] = encode_seq(self._gen, self._job, 0, 0, 0, 0)
        self._ring()

    def all_gather_rows(
        self, local: torch.Tensor, chunks: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every rank's rows in token order: ``local`` is ``[n_rank, row_width]``, the result ``[S,
        row_width]``."""
        lay = self.layout
        t0, t1 = lay.rows(self.rank)
        self._check_input("all_gather_rows", local, (t1 - t0, lay.row_width))
        n_chunks = self._start_op(KIND_GATHER, chunks)
        out = self._make_out("all_gather_rows", out, (lay.tokens, lay.row_width), local.device)
        self._guard_reuse(KIND_GATHER)
        self._timed_copy(out[t0:t1], local, _default_copy)
        g = self._g

        def publish(j: int) -> None:
            a, b = piece(t1 - t0, n_chunks, j)
            if b > a and self._peers:
                self._timed_copy(g[t0 + a : t0 + b], local[a:b], self._to_host, written=True)

        def take(p: int, j: int) -> None:
            p0, p1 = lay.rows(p)
            a, b = piece(p1 - p0, n_chunks, j)
            if b > a:
                self._timed_copy(
                    out[p0 + a : p0 + b], g[p0 + a : p0 + b], self._to_device, read=True
                )

        self._pipeline(KIND_GATHER, n_chunks, publish, take)
        return out

    def all_gather_rows_each(
        self, local: torch.Tensor, on_rows: RowsFn, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`all_gather_rows` in one chunk, calling ``on_rows(a, b, rows)`` for this rank's
        rows once they are published and for each peer's rows as soon as they arrive (in arrival
        order)."""
        lay = self.layout
        t0, t1 = lay.rows(self.rank)
        self._check_input("all_gather_rows", local, (t1 - t0, lay.row_width))
        self._start_op(KIND_GATHER, 1)
        out = self._make_out("all_gather_rows", out, (lay.tokens, lay.row_width), local.device)
        self._guard_reuse(KIND_GATHER)
        self._timed_copy(out[t0:t1], local, _default_copy)
        if t1 > t0 and self._peers:
            self._timed_copy(self._g[t0:t1], local, self._to_host, written=True)
        self._publish(KIND_GATHER, 1, 0)
        if t1 > t0:
            on_rows(t0, t1, out[t0:t1])

        def take(p: int, j: int) -> None:
            p0, p1 = lay.rows(p)
            if p1 > p0:
                self._timed_copy(out[p0:p1], self._g[p0:p1], self._to_device, read=True)
                on_rows(p0, p1, out[p0:p1])

        self._consume(KIND_GATHER, 1, 0, take)
        self._last_use[_BUFFER[KIND_GATHER]] = self._op
        return out

    def all_to_all_cols(
        self, local: torch.Tensor, chunks: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every rank's columns for this rank's tokens: ``local`` is ``[S, c_rank]``, the result
        ``[n_rank, C]``."""
        lay = self.layout
        me = self.rank
        t0, t1 = lay.rows(me)
        c0, c1 = lay.cols(me)
        self._check_input("all_to_all_cols", local, (lay.tokens, c1 - c0))
        n_chunks = self._start_op(KIND_ALL_TO_ALL, chunks)
        out = self._make_out("all_to_all_cols", out, (t1 - t0, lay.columns), local.device)
        self._guard_reuse(KIND_ALL_TO_ALL)
        self._timed_copy(out[:, c0:c1], local[t0:t1], _default_copy)
        mine = self._a[me]

        def publish(j: int) -> None:
            if c1 == c0:
                return
            # chunk j carries the j-th piece of every receiver's rows, so every receiver progresses
            # per chunk
            for r in self._peers:
                r0, r1 = lay.rows(r)
                a, b = piece(r1 - r0, n_chunks, j)
                if b > a:
                    self._timed_copy(
                        mine[r0 + a : r0 + b], local[r0 + a : r0 + b], self._to_host, written=True
                    )

        def take(p: int, j: int) -> None:
            p0, p1 = lay.cols(p)
            a, b = piece(t1 - t0, n_chunks, j)
            if b > a and p1 > p0:
                self._timed_copy(
                    out[a:b, p0:p1], self._a[p][t0 + a : t0 + b], self._to_device, read=True
                )

        self._pipeline(KIND_ALL_TO_ALL, n_chunks, publish, take)
        return out

    def all_to_all_qkv(
        self, local: torch.Tensor, chunks: int = 0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q, k and v of this rank's heads for every token: ``local`` is ``[n_rank, 3·C]`` (every
        head's, this rank's tokens), the result ``[S, 3·c_rank]`` (``packed_qkv`` layout).  Needs a
        layout planned with ``qkv``."""
        lay = self.layout
        me = self.rank
        t0, t1 = lay.rows(me)
        c0, c1 = lay.cols(me)
        if not self._q:
            lay.q_view(self._arena, me)  # raises: the layout has no q/k/v blocks
        self._check_input("all_to_all_qkv", local, (t1 - t0, 3 * lay.columns))
        n_chunks = self._start_op(KIND_QKV, chunks)
        out = self._make_out("all_to_all_qkv", out, (lay.tokens, 3 * (c1 - c0)), local.device)
        self._guard_reuse(KIND_QKV)
        self._timed_copy(out[t0:t1], packed_qkv(local, lay.qkv_cols(me)), _default_copy)

        def publish(j: int) -> None:
            a, b = piece(t1 - t0, n_chunks, j)
            if b == a:
                return
            for r in self._peers:
                r0, r1 = lay.cols(r)
                if r1 > r0:
                    # packed after the op began: the copy out must wait for the packing
                    part = packed_qkv(local[a:b], lay.qkv_cols(r))
                    t = time.perf_counter()
                    self._to_host_async(self._q[r][t0 + a : t0 + b], part)()
                    self._stats["copy_s"] += time.perf_counter() - t
                    self._stats["bytes_written"] += part.numel() * part.element_size()

        def take(p: int, j: int) -> None:
            p0, p1 = lay.rows(p)
            a, b = piece(p1 - p0, n_chunks, j)
            if b > a and c1 > c0:
                src = self._q[me][p0 + a : p0 + b]
                self._timed_copy(out[p0 + a : p0 + b], src, self._to_device, read=True)

        self._pipeline(KIND_QKV, n_chunks, publish, take)
        return out

    def all_to_all_heads(
        self,
        produce: ProduceFn,
        pieces: int,
        out: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """:meth:`all_to_all_cols` of this rank's columns produced in ``pieces`` head pieces
        (``produce(c_a, c_b)``, :meth:`ArenaLayout.head_piece`): piece j is chunk j of the op,
        published once its copies out are done, and piece j+1 is produced (and its copies started)
        before this rank waits for them.  ``device``: where ``out`` lives when it is not given."""
        lay = self.layout
        me = self.rank
        t0, t1 = lay.rows(me)
        c0 = lay.cols(me)[0]
        n_chunks = self._start_op(KIND_ALL_TO_ALL_HEADS, pieces)
        out = self._make_out("all_to_all_heads", out, (t1 - t0, lay.columns), device or _CPU)
        self._guard_reuse(KIND_ALL_TO_ALL_HEADS)
        mine = self._a[me]

        def stage(j: int) -> list[Callable[[], None]]:
            a, b = lay.head_piece(me, n_chunks, j)
            if b == a:
                return []
            part = produce(a, b)
            self._check_input("all_to_all_heads piece", part, (lay.tokens, b - a))
            self._timed_copy(out[:, c0 + a : c0 + b], part[t0:t1], _default_copy)
            dst = lay.a_piece_view(mine, me, n_chunks, j)
            waits = []
            for r in self._peers:
                r0, r1 = lay.rows(r)
                if r1 > r0:
                    t = time.perf_counter()
                    waits.append(self._to_host_async(dst[r0:r1], part[r0:r1]))
                    self._stats["copy_s"] += time.perf_counter() - t
                    self._stats["bytes_written"] += (r1 - r0) * (b - a) * part.element_size()
            return waits

        def take(p: int, j: int) -> None:
            a, b = lay.head_piece(p, n_chunks, j)
            if b > a and t1 > t0:
                p0 = lay.cols(p)[0]
                src = lay.a_piece_view(self._a[p], p, n_chunks, j)[t0:t1]
                self._timed_copy(out[:, p0 + a : p0 + b], src, self._to_device, read=True)

        started = stage(0)
        for j in range(n_chunks):
            following = stage(j + 1) if j + 1 < n_chunks else []
            t = time.perf_counter()
            for wait in started:
                wait()
            self._stats["copy_s"] += time.perf_counter() - t
            self._publish(KIND_ALL_TO_ALL_HEADS, n_chunks, j)
            if j:
                self._consume(KIND_ALL_TO_ALL_HEADS, n_chunks, j - 1, take)
            started = following
        self._consume(KIND_ALL_TO_ALL_HEADS, n_chunks, n_chunks - 1, take)
        self._last_use[_BUFFER[KIND_ALL_TO_ALL_HEADS]] = self._op
        return out

    def counters(self) -> tuple[float, float]:
        """(copy seconds, wait seconds) since the last :meth:`reset_stats`
        (``workers.transports.exchange``)."""
        return self._stats["copy_s"], self._stats["wait_s"]

    def stats(self) -> dict:
        """Counters since construction or the last :meth:`reset_stats`."""
        return dict(self._stats)

    def reset_stats(self) -> None:
        self._stats: HostStats = {
            "transport": "host",
            "rank": self.rank,
            "ops": 0,
            "chunks_published": 0,
            "bytes_written": 0,
            "bytes_read": 0,
            "copy_s": 0.0,
            "wait_s": 0.0,
            "signals_sent": 0,
            "wakeups": 0,
            "spin_hits": 0,
        }

    def close(self) -> None:
        """Drop the poll registration (the fds belong to the pool)."""
        with contextlib.suppress(KeyError, ValueError):
            self._poll.unregister(self._my_fd)

    # -- op machinery ------------------------------------------------------------------------------
    def _check_input(self, what: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
        if tuple(t.shape) != shape or t.dtype != self.layout.torch_dtype:
            raise ValueError(
                f"rank {self.rank}: {what} input must be {self.layout.dtype} {list(shape)}, got "
                f"{t.dtype} {list(t.shape)}; the rank plan and the arena layout disagree"
            )

    def _make_out(
        self, what: str, out: torch.Tensor | None, shape: tuple[int, int], device: torch.device
    ) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=self.layout.torch_dtype, device=device)
        if tuple(out.shape) != shape or out.dtype != self.layout.torch_dtype:
            raise ValueError(
                f"rank {self.rank}: {what} out must be {self.layout.dtype} {list(shape)}, got "
                f"{out.dtype} {list(out.shape)}"
            )
        return out

    def _start_op(self, kind: int, chunks: int) -> int:
        if self._gen is None:
            raise RuntimeError(
                f"rank {self.rank}: call begin(abort_generation) before the first exchange of a job"
            )
        if not isinstance(chunks, int) or not 0 <= chunks <= MAX_CHUNKS:
            raise ValueError(
                f"exchange chunks must be an int in 0..{MAX_CHUNKS} (0/1 = single shot), got "
                f"{chunks!r}"
            )
        if self._op >= MAX_OPS_PER_JOB:
            raise RuntimeError(
                f"more than {MAX_OPS_PER_JOB} exchanges in one job; call begin() per step"
            )
        self._op += 1
        self._kind = kind
        self._n_chunks = max(1, chunks)
        self._deadline = time.monotonic() + self.deadline_s
        self._stats["ops"] += 1
        self._check_abort("start")
        return self._n_chunks

    def _timed_copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        fn: CopyFn,
        *,
        written: bool = False,
        read: bool = False,
    ) -> None:
        t = time.perf_counter()
        fn(dst, src)
        self._stats["copy_s"] += time.perf_counter() - t
        nb = dst.numel() * dst.element_size()
        if written:
            self._stats["bytes_written"] += nb
        if read:
            self._stats["bytes_read"] += nb

    def _pipeline(
        self,
        kind: int,
        n_chunks: int,
        publish: Callable[[int], None],
        take: Callable[[int, int], None],
    ) -> None:
        # publish(j) then consume(j-1): while this rank writes chunk j, its peers already read chunk
        # j-1
        for j in range(n_chunks):
            publish(j)
            self._publish(kind, n_chunks, j)
            if j:
                self._consume(kind, n_chunks, j - 1, take)
        self._consume(kind, n_chunks, n_chunks - 1, take)
        self._last_use[_BUFFER[kind]] = self._op

    def _publish(self, kind: int, n_chunks: int, j: int) -> None:
        word = encode_seq(self._job_gen, self._job, self._op, kind, n_chunks, j + 1)
        self._words[_seq_index(self.rank)] = word
        self._stats["chunks_published"] += 1
        self._ring()

    def _ring(self) -> None:
        for fd in self._peer_fds:
            os.eventfd_write(fd, 1)
        self._stats["signals_sent"] += len(self._peer_fds)

    def _progress(self, p: int, kind: int, n_chunks: int) -> int:
        """Chunks of the current op that peer p has published (``_AHEAD`` past it, -1 not yet on
        this op)."""
        word = int(self._words[_seq_index(p)])
        gen, job, op, pkind, pn, count = decode_seq(word)
        if gen != (self._job_gen & 0xFFFF):
            return -1
        if job != self._job:
            return _AHEAD if job == self._job % _JOB_CYCLE + 1 else -1
        if op > self._op:
            return _AHEAD
        if op < self._op:
            return -1
        if (pkind, pn) != (kind, n_chunks):
            self._post_fault()
            raise ExchangeChunkMismatch(
                f"rank {self.rank} runs op {self._op} as {_KIND_NAMES[kind]} with {n_chunks} "
                f"chunk(s), rank {p} as {_KIND_NAMES[pkind]} with {pn} chunk(s): every rank must "
                "get the same exchange_chunks and the same op sequence"
            )
        return count

    def _past(self, p: int, op: int) -> bool:
        """Peer p has begun this job and published something after ``op`` (so it is done reading
        op's data)."""
        gen, job, pop = decode_seq(int(self._words[_seq_index(p)]))[:3]
        if gen != (self._job_gen & 0xFFFF):
            return False
        if job != self._job:
            return job == self._job % _JOB_CYCLE + 1
        return pop > op

    def _guard_reuse(self, kind: int) -> None:
        last = self._last_use[_BUFFER[kind]]
        pending = [p for p in self._peers if not self._past(p, last)]
        if pending:
            if last > 0:
                # "on this op, nothing published yet": this rank has read all of the ops before,
                # which is what a peer waiting here for the same buffer needs to see
                word = encode_seq(self._job_gen, self._job, self._op, kind, self._n_chunks, 0)
                self._words[_seq_index(self.rank)] = word
                self._ring()
            what = (
                f"{_KIND_NAMES[kind]} op {self._op}: waiting for rank(s) {{}} to "
                + (f"finish reading op {last}" if last > 0 else "begin this job")
                + " before reusing the buffer"
            )
            self._drain(pending, lambda p: self._past(p, last), lambda p: None, what)

    def _consume(self, kind: int, n_chunks: int, j: int, take: Callable[[int, int], None]) -> None:
        pending = list(self._peers)
        what = (
            f"{_KIND_NAMES[kind]} op {self._op} chunk {j + 1}/{n_chunks}: no data from rank(s) {{}}"
        )
        self._drain(
            pending, lambda p: self._progress(p, kind, n_chunks) > j, lambda p: take(p, j), what
        )

    def _drain(
        self,
        pending: list[int],
        ready: Callable[[int], bool],
        take: Callable[[int], None],
        what: str,
    ) -> None:
        """Take each pending peer as soon as it is ready; sleep on the doorbell while none is."""
        while True:
            progressed = False
            for p in list(pending):
                if ready(p):
                    take(p)
                    pending.remove(p)
                    progressed = True
            if not pending:
                return
            if progressed:
                continue
            t = time.perf_counter()
            self._check_abort(what.format(pending))
            self._check_faults()
            if self.spin_s and self._spin(pending, ready):
                self._stats["spin_hits"] += 1
                self._stats["wait_s"] += time.perf_counter() - t
                continue
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                words = {p: decode_seq(int(self._words[_seq_index(p)]))[2:] for p in pending}
                raise ExchangeTimeout(
                    f"rank {self.rank}: {what.format(pending)} within {self.deadline_s:g}s (their "
                    f"(op, kind, chunks, published) words: {words}); a rank died or stalled - see "
                    "its worker log"
                )
            if self._poll.poll(max(1, math.ceil(remaining * 1000))):
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._my_fd)
                self._stats["wakeups"] += 1
            self._stats["wait_s"] += time.perf_counter() - t

    def _spin(self, pending: list[int], ready: Callable[[int], bool]) -> bool:
        end = time.perf_counter() + self.spin_s
        while time.perf_counter() < end:
            if any(ready(p) for p in pending):
                return True
        return False

    @property
    def _job_gen(self) -> int:
        """The running job's abort generation (ops run only after ``begin()``: ``_start_op``)."""
        assert self._gen is not None
        return self._gen

    def _check_abort(self, where: str) -> None:
        now = int(self._ctl[0])
        if now != self._gen:
            raise ExchangeAborted(
                f"rank {self.rank}: exchange aborted during {where} (abort generation {now}, job "
                f"started under {self._gen})"
            )

    def _post_fault(self) -> None:
        epoch = _epoch_bits(self._job_gen, self._job)
        self._words[_fault_index(self.rank)] = epoch | (self._op << 17) | 1
        self._ring()

    def _check_faults(self) -> None:
        mine = _epoch_bits(self._job_gen, self._job)
        for p in self._peers:
            f = int(self._words[_fault_index(p)])
            if f and (f & ~((1 << 33) - 1)) == mine:
                raise ExchangeChunkMismatch(
                    f"rank {self.rank}: rank {p} found a chunk-count / op-sequence mismatch at op "
                    f"{(f >> 17) & 0xFFFF}: every rank must get the same exchange_chunks and the "
                    "same op sequence"
                )
