"""Host exchange between rank processes: one shared-memory arena, per-rank sequence words, eventfd
doorbells.

What each collective returns is ``workers.transports.exchange``'s spec; the arena's layout and the
sequence word are ``workers.transports.arena``'s.  Here: how the ops move their bytes through the
arena and how the ranks signal each other.  ``all_gather_rows``, ``all_to_all_cols`` and
``all_to_all_qkv`` cut every rank's part into ``chunks`` pieces; chunk j of an op is published as
one sequence-word step, so a rank writes chunk j while its peers read chunk j-1.
``all_gather_rows_each`` is one chunk whose rows are handed over as each rank's arrive.
``all_gather_rows_produced``: chunk j carries row piece j of every rank, published as soon as it is
produced (the gather's layout in that many chunks), so peers read piece j while its producer
computes piece j+1.
``all_to_all_heads``: chunk j carries head piece j of every rank, published as soon as it is
produced, so peers read piece j while its producer computes piece j+1; while this op runs, ``A_r``
holds rank r's pieces one after another, each ``[S, w_j]``.
``all_to_all_qkv_attend``: chunk j < P carries q/k/v head piece j of every receiver (``Q_r`` holds
rank r's pieces one after another, each ``[S, 3·w_j]``), chunk P + j every rank's attention output
of its piece j (``A_r`` in pieces, as ``all_to_all_heads``); every q/k/v piece's copies out start
at once, each piece is attended as soon as every peer's part of it is in, and its output's copies
out start at once too.

Signalling.  After a chunk's bytes are in the arena the writer stores its *sequence word*
(``workers.transports.arena``: generation, job, op, op kind, chunk count, chunks published) and
writes 1 to every peer's eventfd doorbell.  A waiter compares the peers' sequence words with what
it expects; when something is missing it poll()s its own doorbell with the remaining deadline,
drains it and checks again.  An eventfd is a counter, so a ring that lands between the check and the
poll() is not lost.  ``bench_exchange`` measured this against an AF_UNIX msgpack round trip (what
coordinator-routed signalling would cost per message); see its ``choice`` field.

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
before"): two consecutive ops over one buffer (the exchange probe runs ``all_gather_rows_each``
then the next block's ``all_gather_rows``) would otherwise wait for each other.  Across jobs: a rank
writes nothing of job k+1 before every peer has begun job k+1, i.e. has finished (or abandoned, on
abort) job k.  A peer's word showing the *next* job therefore means "everything of this job is
published and still intact".

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
from typing import Any

import torch

from workers.transports.arena import (
    BUFFERS,
    JOB_CYCLE,
    KIND_ALL_TO_ALL,
    KIND_ALL_TO_ALL_HEADS,
    KIND_GATHER,
    KIND_NAMES,
    KIND_QKV,
    KIND_QKV_ATTEND,
    MAX_OPS_PER_JOB,
    ArenaLayout,
    decode_seq,
    encode_fault,
    encode_seq,
    fault_index,
    fault_op,
    qkv_ranges,
    seq_index,
)
from workers.transports.exchange import (
    AttendFn,
    ExchangeChunkMismatch,
    ExchangeStats,
    ExchangeTimeout,
    JobExchange,
    ProduceFn,
    RowsFn,
    RowsProduceFn,
    packed_qkv,
)

log = logging.getLogger("h3_multistream.worker")

CopyFn = Callable[[torch.Tensor, torch.Tensor], Any]
#: Starts a copy and returns the function that waits for it.
AsyncCopyFn = Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]

_AHEAD = 1 << 62  # a peer in the next job has published everything of ours


def _default_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _no_wait() -> None:
    """A copy that was done when it returned."""


def _sync_copy(fn: CopyFn) -> AsyncCopyFn:
    def start(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        fn(dst, src)
        return _no_wait

    return start


class HostStats(ExchangeStats):
    """The host exchange's counters: chunks published, doorbell wake-ups, waits ended spinning."""

    chunks_published: int
    wakeups: int
    spin_hits: int


class HostExchange(JobExchange):
    """One rank's side of the host exchange.  See the module docstring for the protocol.

    ``to_host(dst_view, src)`` copies a rank's outgoing rows into the arena and must return only
    when the bytes are there (a CUDA hook synchronises its copy's event); ``to_device(dst,
    src_view)`` copies incoming rows out.  Both default to ``dst.copy_(src)``.  ``to_host_async``
    starts an outgoing copy and returns the function that waits for it (``all_to_all_heads`` starts
    piece j+1's copies before it waits for piece j's); it defaults to ``to_host``, done at once.
    ``spin_us`` > 0 re-checks the peers' words for that long before sleeping on the doorbell
    (measured by bench_exchange; off by default).
    """

    transport = "host"
    _stats: HostStats

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
        if len(doorbell_fds) != world:
            raise ValueError(f"need one doorbell fd per rank ({world}), got {len(doorbell_fds)}")
        if control.dtype != torch.int64 or control.device.type != "cpu" or control.numel() < 1:
            raise ValueError(
                "control must be an int64 CPU tensor over shared memory whose word 0 is the abort "
                f"generation, got {control.dtype} {tuple(control.shape)} on {control.device}"
            )
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        super().__init__(rank, world, layout, control)
        layout.check_header(arena)
        if platform.machine().lower() not in ("x86_64", "amd64"):
            log.warning(
                "[exchange] host exchange on %s: the sequence-word protocol relies on x86-64 store "
                "ordering; use exchange=nccl on this machine if results differ",
                platform.machine(),
            )
        self.deadline_s = float(deadline_s)
        self.spin_s = max(0.0, float(spin_us)) * 1e-6
        self._to_host = to_host or _default_copy
        self._to_device = to_device or _default_copy
        self._to_host_async = to_host_async or _sync_copy(self._to_host)
        self._arena = arena  # keeps the mapping's views alive
        self._words = layout.header_words(arena)
        self._map_data(arena)
        self._peers = [p for p in range(world) if p != rank]
        self._peer_fds = [doorbell_fds[p] for p in self._peers]
        self._my_fd = doorbell_fds[rank]
        self._poll = select.poll()
        self._poll.register(self._my_fd, select.POLLIN)
        self._job = 0
        self._op = 0
        self._n_chunks = 1
        self._last_use = {"G": -1, "A": -1, "Q": -1}  # per arena buffer; -1: not used in this job
        self._deadline = 0.0

    def _map_data(self, arena: torch.Tensor) -> None:
        """The arena's data blocks G, A_r and Q_r (a transport whose blocks live elsewhere maps
        its own and overrides the three views below)."""
        lay = self.layout
        self._g = lay.g_view(arena)
        self._a = [lay.a_view(arena, r) for r in range(self.world)]
        self._q = [lay.q_view(arena, r) for r in range(self.world)] if lay.q_offsets else []

    def _g_rows(self, p: int, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of G, inside rank p's tokens (which rank p writes)."""
        return self._g[a:b]

    def _a_block(self, p: int) -> torch.Tensor:
        """A_p ``[S, c_p]`` (rank p writes it)."""
        return self._a[p]

    def _q_rows(self, r: int, p: int, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of Q_r, inside rank p's tokens (which rank p writes)."""
        return self._q[r][a:b]

    def _q_piece_rows(self, r: int, p: int, n: int, j: int, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of head piece j of ``n`` of Q_r laid out in pieces
        (:meth:`ArenaLayout.q_piece_view`), inside rank p's tokens (which rank p writes)."""
        return self.layout.q_piece_view(self._q[r], r, n, j)[a:b]

    def begin(self, abort_generation: int) -> None:
        if abort_generation != self._gen:
            self._job = 0
        self._job = self._job % JOB_CYCLE + 1
        self._op = 0
        self._last_use = {"G": -1, "A": -1, "Q": -1}
        super().begin(abort_generation)
        self._reads_done(tuple(self._last_use))
        self._words[fault_index(self.rank)] = 0
        self._words[seq_index(self.rank)] = encode_seq(self._job_gen, self._job, 0, 0, 0, 0)
        self._ring()

    def close(self) -> None:
        """Drop the poll registration (the fds belong to the pool)."""
        with contextlib.suppress(KeyError, ValueError):
            self._poll.unregister(self._my_fd)

    def _zero_stats(self) -> HostStats:
        return {
            **super()._zero_stats(),
            "chunks_published": 0,
            "wakeups": 0,
            "spin_hits": 0,
        }

    # -- the ops -----------------------------------------------------------------------------------
    def _begin_op(self, kind: int, n: int) -> None:
        if kind in (KIND_QKV, KIND_QKV_ATTEND):
            self.layout.check_qkv()
        if self._op >= MAX_OPS_PER_JOB:
            raise RuntimeError(
                f"more than {MAX_OPS_PER_JOB} exchanges in one job; call begin() per step"
            )
        super()._begin_op(kind, n)
        self._op += 1
        # the op's chunks in the sequence word: each head piece twice for the q/k/v-and-output op
        self._n_chunks = 2 * n if kind == KIND_QKV_ATTEND else n
        self._deadline = time.monotonic() + self.deadline_s
        self._guard_reuse(kind)

    def _all_gather_rows(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        lay, me = self.layout, self.rank
        t0, t1 = lay.rows(me)
        self._timed_copy(out[t0:t1], local, _default_copy)

        def publish(j: int) -> None:
            a, b = lay.chunk_rows(me, n, j)
            if b > a and self._peers:
                dst = self._g_rows(me, a, b)
                self._timed_copy(dst, local[a - t0 : b - t0], self._to_host, written=True)

        def take(p: int, j: int) -> None:
            a, b = lay.chunk_rows(p, n, j)
            if b > a:
                self._timed_copy(out[a:b], self._g_rows(p, a, b), self._to_device, read=True)

        self._pipeline(KIND_GATHER, n, publish, take)
        return out

    def _all_gather_rows_each(
        self, local: torch.Tensor, on_rows: RowsFn, out: torch.Tensor
    ) -> torch.Tensor:
        """This rank's rows handed over once published, each peer's as soon as they arrive (in
        arrival order)."""
        t0, t1 = self.layout.rows(self.rank)
        self._timed_copy(out[t0:t1], local, _default_copy)
        if t1 > t0 and self._peers:
            self._timed_copy(self._g_rows(self.rank, t0, t1), local, self._to_host, written=True)
        self._publish(KIND_GATHER, 1, 0)
        self._hand_over(self.rank, out, on_rows)

        def take(p: int, j: int) -> None:
            a, b = self.layout.rows(p)
            if b > a:
                self._timed_copy(out[a:b], self._g_rows(p, a, b), self._to_device, read=True)
                on_rows(a, b, out[a:b])

        self._consume(KIND_GATHER, 1, 0, take)
        self._op_done(KIND_GATHER)
        return out

    def _all_gather_rows_produced(
        self, produce: RowsProduceFn, n: int, out: torch.Tensor
    ) -> torch.Tensor:
        """Piece j is chunk j of the op, published once its copy out is done; piece j+1 is
        produced (and its copy started) before this rank waits for it (as ``all_to_all_heads``)."""
        lay, me = self.layout, self.rank

        def stage(j: int) -> list[Callable[[], None]]:
            a, b, part = self._row_piece(produce, n, j)
            if part is None:
                return []
            self._timed_copy(out[a:b], part, _default_copy)
            if not self._peers:
                return []
            return [self._started_copy(self._g_rows(me, a, b), part)]

        def take(p: int, j: int) -> None:
            a, b = lay.chunk_rows(p, n, j)
            if b > a:
                self._timed_copy(out[a:b], self._g_rows(p, a, b), self._to_device, read=True)

        self._produced_pieces(KIND_GATHER, n, stage, take)
        return out

    def _all_to_all_cols(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        lay, me = self.layout, self.rank
        t0, t1 = lay.rows(me)
        c0, c1 = lay.cols(me)
        self._timed_copy(out[:, c0:c1], local[t0:t1], _default_copy)
        mine = self._a_block(me)

        def publish(j: int) -> None:
            if c1 == c0:
                return
            # chunk j carries the j-th piece of every receiver's rows, so every receiver progresses
            # per chunk
            for r in self._peers:
                a, b = lay.chunk_rows(r, n, j)
                if b > a:
                    self._timed_copy(mine[a:b], local[a:b], self._to_host, written=True)

        def take(p: int, j: int) -> None:
            p0, p1 = lay.cols(p)
            a, b = lay.chunk_rows(me, n, j)
            if b > a and p1 > p0:
                src = self._a_block(p)[a:b]
                self._timed_copy(out[a - t0 : b - t0, p0:p1], src, self._to_device, read=True)

        self._pipeline(KIND_ALL_TO_ALL, n, publish, take)
        return out

    def _all_to_all_qkv(self, local: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        lay, me = self.layout, self.rank
        t0, t1 = lay.rows(me)
        c0, c1 = lay.cols(me)
        self._timed_copy(out[t0:t1], packed_qkv(local, lay.qkv_cols(me)), _default_copy)

        def publish(j: int) -> None:
            a, b = lay.chunk_rows(me, n, j)
            for r in self._peers if b > a else ():
                r0, r1 = lay.cols(r)
                if r1 > r0:
                    part = packed_qkv(local[a - t0 : b - t0], lay.qkv_cols(r))
                    # packed after the op began: the copy out must wait for the packing
                    dst = self._q_rows(r, me, a, b)
                    self._timed_copy(dst, part, self._to_host_after, written=True)

        def take(p: int, j: int) -> None:
            a, b = lay.chunk_rows(p, n, j)
            if b > a and c1 > c0:
                self._timed_copy(out[a:b], self._q_rows(me, p, a, b), self._to_device, read=True)

        self._pipeline(KIND_QKV, n, publish, take)
        return out

    def _all_to_all_qkv_attend(
        self, local: torch.Tensor, n: int, attend: AttendFn, out: torch.Tensor
    ) -> torch.Tensor:
        """Chunk j < n carries q/k/v head piece j of every receiver, chunk n + j every rank's
        output of its piece j.  The projection is whole when the op begins, so every q/k/v piece's
        copies out start at once.  Then piece by piece this rank publishes its q/k/v piece j, takes
        the peers' and attends it, starts the output's copies out, and only then publishes its
        output of piece j-1 and takes the peers': piece j is attended while piece j+1 travels in
        and piece j-1's output travels back.  (A published count is monotonic, so an output piece
        is published after every q/k/v piece: the q/k/v copies out, queued first, are done by
        then.)"""
        lay, me = self.layout, self.rank
        t0, t1 = lay.rows(me)
        c0, c1 = lay.cols(me)
        # the received q/k/v in pieces; its copies in are queued before the attention that reads
        # them, which the compute stream waits for before anything else can take its memory
        received = out.new_empty((lay.tokens, 3 * (c1 - c0)))
        chunks = self._n_chunks

        def piece_cols(r: int, j: int) -> list[tuple[int, int]]:
            a, b = lay.head_piece(r, n, j)
            r0 = lay.cols(r)[0]
            return qkv_ranges(r0 + a, r0 + b, lay.columns)

        def stage_qkv(j: int) -> list[Callable[[], None]]:
            a, b = lay.head_piece(me, n, j)
            if b > a and t1 > t0:
                own = lay.q_piece_view(received, me, n, j)[t0:t1]
                self._timed_copy(own, packed_qkv(local, piece_cols(me, j)), _default_copy)
            waits = []
            for r in self._peers if t1 > t0 else ():
                ra, rb = lay.head_piece(r, n, j)
                if rb > ra:
                    part = packed_qkv(local, piece_cols(r, j))
                    dst = self._q_piece_rows(r, me, n, j, t0, t1)
                    waits.append(self._started_copy(dst, part))
            self._staged(j)
            return waits

        def take_qkv(p: int, j: int) -> None:
            a, b = lay.rows(p)
            ha, hb = lay.head_piece(me, n, j)
            if b > a and hb > ha:
                dst = lay.q_piece_view(received, me, n, j)[a:b]
                self._timed_copy(
                    dst, self._q_piece_rows(me, p, n, j, a, b), self._to_device, read=True
                )

        def stage_out(j: int) -> list[Callable[[], None]]:
            a, b = lay.head_piece(me, n, j)
            waits = []
            if b > a:
                part = self._attended_piece(attend, a, b, lay.q_piece_view(received, me, n, j))
                waits = self._send_head_piece(n, j, a, part, out)
            self._staged(n + j)
            return waits

        def take_out(p: int, j: int) -> None:
            self._take_head_piece(p, n, j - n, out)

        # chunk k's copies out: the q/k/v pieces' started at once, each output piece's once attended
        waits = [stage_qkv(j) for j in range(n)]
        published = 0

        def publish(upto: int) -> None:
            """Publish chunks up to ``upto`` (exclusive), each once its copies out are done."""
            nonlocal published
            while published < upto:
                t = time.perf_counter()
                for wait in waits[published]:
                    wait()
                self._stats["copy_s"] += time.perf_counter() - t
                self._publish(KIND_QKV_ATTEND, chunks, published)
                published += 1

        for j in range(n):
            publish(j + 1)
            self._consume(KIND_QKV_ATTEND, chunks, j, take_qkv)
            waits.append(stage_out(j))
            if j:
                publish(n + j)
                self._consume(KIND_QKV_ATTEND, chunks, n + j - 1, take_out)
        publish(chunks)
        self._consume(KIND_QKV_ATTEND, chunks, chunks - 1, take_out)
        self._op_done(KIND_QKV_ATTEND)
        return out

    def _all_to_all_heads(self, produce: ProduceFn, n: int, out: torch.Tensor) -> torch.Tensor:
        """Piece j is chunk j of the op, published once its copies out are done; piece j+1 is
        produced (and its copies started) before this rank waits for them."""

        def stage(j: int) -> list[Callable[[], None]]:
            a, _, part = self._piece(produce, n, j)
            return [] if part is None else self._send_head_piece(n, j, a, part, out)

        def take(p: int, j: int) -> None:
            self._take_head_piece(p, n, j, out)

        self._produced_pieces(KIND_ALL_TO_ALL_HEADS, n, stage, take)
        return out

    def _send_head_piece(
        self, n: int, j: int, a: int, part: torch.Tensor, out: torch.Tensor
    ) -> list[Callable[[], None]]:
        """This rank's head piece j of ``n`` (``part``: its columns from ``a`` on, every token) as
        the all-to-all of columns moves it: its own rows into ``out``, each peer's rows copied out
        into A (piece j's place); the waits for those copies."""
        lay, me = self.layout, self.rank
        t0, t1 = lay.rows(me)
        c0 = lay.cols(me)[0]
        self._timed_copy(out[:, c0 + a : c0 + a + part.shape[1]], part[t0:t1], _default_copy)
        dst = lay.a_piece_view(self._a_block(me), me, n, j)
        waits = []
        for r in self._peers:
            r0, r1 = lay.rows(r)
            if r1 > r0:
                waits.append(self._started_copy(dst[r0:r1], part[r0:r1]))
        return waits

    def _take_head_piece(self, p: int, n: int, j: int, out: torch.Tensor) -> None:
        """Peer p's head piece j of ``n``, this rank's rows of it, from A into ``out``."""
        lay = self.layout
        t0, t1 = lay.rows(self.rank)
        a, b = lay.head_piece(p, n, j)
        if b > a and t1 > t0:
            p0 = lay.cols(p)[0]
            src = lay.a_piece_view(self._a_block(p), p, n, j)[t0:t1]
            self._timed_copy(out[:, p0 + a : p0 + b], src, self._to_device, read=True)

    def _produced_pieces(
        self,
        kind: int,
        n: int,
        stage: Callable[[int], list[Callable[[], None]]],
        take: Callable[[int, int], None],
    ) -> None:
        """The pipeline of an op whose pieces this rank produces: piece j+1 is produced and its
        copies out started (``stage``), then this rank takes (``take``) the peers' piece j-1,
        then waits for its own piece j's copies out and publishes it as chunk j of the op; the
        peers' last piece is taken at the end.

        Taking piece j-1 before waiting for piece j's copies out queues its copies in while
        piece j's copies out still run (the two directions of a link run at once): after the
        last piece only its own two hops are left, not also the hop in of the piece before it."""

        def staged(j: int) -> list[Callable[[], None]]:
            waits = stage(j)
            self._staged(j)
            return waits

        started = staged(0)
        for j in range(n):
            following = staged(j + 1) if j + 1 < n else []
            if j:
                self._consume(kind, n, j - 1, take)
            t = time.perf_counter()
            for wait in started:
                wait()
            self._stats["copy_s"] += time.perf_counter() - t
            self._publish(kind, n, j)
            started = following
        self._consume(kind, n, n - 1, take)
        self._op_done(kind)

    # -- op machinery ------------------------------------------------------------------------------
    def _op_done(self, kind: int) -> None:
        """Every chunk of the current op is consumed: its buffers' last use in this job."""
        for name in BUFFERS[kind]:
            self._last_use[name] = self._op
        self._reads_done(BUFFERS[kind])

    def _staged(self, j: int) -> None:
        """Every copy out of chunk j of the current op is started (a transport whose peers wait
        for those copies on the GPU marks it here, before the next chunk's copies start)."""

    def _reads_done(self, buffers: tuple[str, ...]) -> None:
        """This rank has started every read out of ``buffers`` so far and publishes nothing later
        yet: a transport that orders its peers' next writes after those reads on the GPU
        (``workers.transports.cuda_ipc``'s events) marks it here."""

    def _started_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        """``to_host_async(dst, src)``, timed and counted: the wait for the copy."""
        t = time.perf_counter()
        wait = self._to_host_async(dst, src)
        self._stats["copy_s"] += time.perf_counter() - t
        self._stats["bytes_written"] += src.numel() * src.element_size()
        return wait

    def _to_host_after(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``to_host_async`` and its wait: a copy out of a tensor computed after the op began."""
        self._to_host_async(dst, src)()

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
        self._op_done(kind)

    def _publish(self, kind: int, n_chunks: int, j: int) -> None:
        word = encode_seq(self._job_gen, self._job, self._op, kind, n_chunks, j + 1)
        self._words[seq_index(self.rank)] = word
        self._stats["chunks_published"] += 1
        self._ring()

    def _ring(self) -> None:
        for fd in self._peer_fds:
            os.eventfd_write(fd, 1)
        self._stats["signals_sent"] += len(self._peer_fds)

    def _progress(self, p: int, kind: int, n_chunks: int) -> int:
        """Chunks of the current op that peer p has published (``_AHEAD`` past it, -1 not yet on
        this op)."""
        word = int(self._words[seq_index(p)])
        gen, job, op, pkind, pn, count = decode_seq(word)
        if gen != (self._job_gen & 0xFFFF):
            return -1
        if job != self._job:
            return _AHEAD if job == self._job % JOB_CYCLE + 1 else -1
        if op > self._op:
            return _AHEAD
        if op < self._op:
            return -1
        if (pkind, pn) != (kind, n_chunks):
            self._post_fault()
            raise ExchangeChunkMismatch(
                f"rank {self.rank} runs op {self._op} as {KIND_NAMES[kind]} with {n_chunks} "
                f"chunk(s), rank {p} as {KIND_NAMES[pkind]} with {pn} chunk(s): every rank must "
                "get the same exchange_chunks and the same op sequence"
            )
        return count

    def _past(self, p: int, op: int) -> bool:
        """Peer p has begun this job and published something after ``op`` (so it is done reading
        op's data)."""
        gen, job, pop = decode_seq(int(self._words[seq_index(p)]))[:3]
        if gen != (self._job_gen & 0xFFFF):
            return False
        if job != self._job:
            return job == self._job % JOB_CYCLE + 1
        return pop > op

    def _guard_reuse(self, kind: int) -> None:
        last = max(self._last_use[name] for name in BUFFERS[kind])
        pending = [p for p in self._peers if not self._past(p, last)]
        if pending:
            if last > 0:
                # "on this op, nothing published yet": this rank has read all of the ops before,
                # which is what a peer waiting here for the same buffer needs to see
                word = encode_seq(self._job_gen, self._job, self._op, kind, self._n_chunks, 0)
                self._words[seq_index(self.rank)] = word
                self._ring()
            what = (
                f"{KIND_NAMES[kind]} op {self._op}: waiting for rank(s) {{}} to "
                + (f"finish reading op {last}" if last > 0 else "begin this job")
                + " before reusing the buffer"
            )
            self._drain(pending, lambda p: self._past(p, last), lambda p: None, what)

    def _consume(self, kind: int, n_chunks: int, j: int, take: Callable[[int, int], None]) -> None:
        pending = list(self._peers)
        what = (
            f"{KIND_NAMES[kind]} op {self._op} chunk {j + 1}/{n_chunks}: no data from rank(s) {{}}"
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
            self.check_abort(what.format(pending))
            self._check_faults()
            if self.spin_s and self._spin(pending, ready):
                self._stats["spin_hits"] += 1
                self._stats["wait_s"] += time.perf_counter() - t
                continue
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                words = {p: decode_seq(int(self._words[seq_index(p)]))[2:] for p in pending}
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
        """The running job's abort generation (ops run only after ``begin()``: ``_begin_op``)."""
        assert self._gen is not None
        return self._gen

    def _post_fault(self) -> None:
        self._words[fault_index(self.rank)] = encode_fault(self._job_gen, self._job, self._op)
        self._ring()

    def _check_faults(self) -> None:
        for p in self._peers:
            op = fault_op(int(self._words[fault_index(p)]), self._job_gen, self._job)
            if op is not None:
                raise ExchangeChunkMismatch(
                    f"rank {self.rank}: rank {p} found a chunk-count / op-sequence mismatch at op "
                    f"{op}: every rank must get the same exchange_chunks and the same op sequence"
                )
