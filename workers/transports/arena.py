"""The host exchange's arena: its layout and the sequence-word codec, the format the coordinator
(which plans an arena, creates it and reads the ranks' progress from it) and the ranks
(``workers.transports.host``) share.

Arena (one shm segment for all ranks; see :class:`ArenaLayout`)::

    header page   line 0: magic, version, world, nbytes
                  line 1+r: rank r's sequence word, fault word
    G [S, W]      all-gather buffer: rank r writes rows [t_r, t_r+1)
    A_r [S, c_r]  one all-to-all block per rank: rank r writes its columns for every other rank's
    tokens
    Q_r [S, 3c_r] (``qkv`` layouts only) rank r's q, k, v columns: every rank writes its tokens'
    rows (``all_to_all_qkv_attend``: rank r's head pieces one after another, each ``[S, 3w_j]``,
    and A_r holds rank r's attention output in the same pieces, each ``[S, w_j]``)

Sequence word (one int64, monotonic within a job)::

    bits 47..62  abort generation (low 16 bits)
    bits 33..46  job number in that generation (1..16383, cycling)
    bits 19..32  op index in the job (1..16383)
    bits 16..18  op kind (0 gather, 1 all-to-all, 2 all-to-all by head pieces, 3 q/k/v all-to-all,
                 4 q/k/v in and attention output back by head pieces: chunks 1..P the q/k/v
                 pieces, P+1..2P the output pieces)
    bits 8..15   chunk count of the op
    bits 0..7    chunks of the op published so far

Fault word: the generation and job bits of the sequence word, the op at bits 17..32 and bit 0 set.

The layout's bounds are also the rank plan every exchange works on, whatever moves the bytes
(``workers.transports.exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.runtime.protocol import DTYPE_SIZES
from workers.runtime.shm import align, dtype_name, torch_dtype

CACHE_LINE = 64
WORDS_PER_LINE = CACHE_LINE // 8
MAGIC = 0x4833_4D53_5843_4831  # "H3MSXCH1"
VERSION = 3
MAX_WORLD = 64
MAX_CHUNKS = 255
MAX_OPS_PER_JOB = (1 << 14) - 1
JOB_CYCLE = (1 << 14) - 1

KIND_GATHER = 0
KIND_ALL_TO_ALL = 1
KIND_ALL_TO_ALL_HEADS = 2
KIND_QKV = 3
KIND_QKV_ATTEND = 4
KIND_NAMES = {
    KIND_GATHER: "all_gather_rows",
    KIND_ALL_TO_ALL: "all_to_all_cols",
    KIND_ALL_TO_ALL_HEADS: "all_to_all_heads",
    KIND_QKV: "all_to_all_qkv",
    KIND_QKV_ATTEND: "all_to_all_qkv_attend",
}
#: The arena buffers each op kind writes (the reuse guard is per buffer).
BUFFERS = {
    KIND_GATHER: ("G",),
    KIND_ALL_TO_ALL: ("A",),
    KIND_ALL_TO_ALL_HEADS: ("A",),
    KIND_QKV: ("Q",),
    KIND_QKV_ATTEND: ("Q", "A"),
}


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
    def _check_arena(self, arena: torch.Tensor, nbytes: int | None = None) -> None:
        """Raise unless ``arena`` is a flat uint8 CPU tensor of at least ``nbytes`` (default: the
        whole layout's)."""
        need = self.nbytes if nbytes is None else nbytes
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
        if arena.numel() < need:
            raise ValueError(
                f"exchange arena holds {arena.numel()} bytes, the layout needs {need}; size "
                "the segment with layout.nbytes"
            )

    def header_words(self, arena: torch.Tensor) -> np.ndarray:
        """The header page as an int64 numpy view (plain loads/stores, no tensor dispatch per
        check).  Only the header page must be there: the GPU-direct exchange's arena is that page
        and its buffers' handles (``workers.transports.cuda_ipc``)."""
        self._check_arena(arena, self.header_bytes)
        return arena.numpy()[: self.header_bytes].view(np.int64)

    def seq_words(self, arena: torch.Tensor) -> list[int]:
        """Every rank's current sequence word (a progress probe for the coordinator; read-only)."""
        words = self.header_words(arena)
        return [int(words[seq_index(r)]) for r in range(self.world)]

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

    def check_qkv(self) -> None:
        """Raise unless the layout was planned with ``qkv`` (``all_to_all_qkv`` needs its Q_r
        blocks)."""
        if not self.q_offsets:
            raise ValueError(
                "this arena layout has no q/k/v blocks; plan it with qkv=True for the Ulysses "
                "pattern"
            )

    def q_view(self, arena: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s q, k, v block ``[S, 3·c_r]`` (a ``qkv`` layout's)."""
        self.check_qkv()
        c0, c1 = self.cols(rank)
        n = self.tokens * 3 * (c1 - c0) * self.torch_dtype.itemsize
        off = self.q_offsets[rank]
        return arena[off : off + n].view(self.torch_dtype).view(self.tokens, 3 * (c1 - c0))

    def qkv_cols(self, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s q, k and v column ranges in a fused projection of every head
        (``[q | k | v]``, each ``C`` wide)."""
        return qkv_ranges(*self.cols(rank), self.columns)

    def chunk_rows(self, rank: int, chunks: int, j: int) -> tuple[int, int]:
        """Tokens [a, b) of ``rank``'s rows in chunk j of ``chunks`` (:func:`piece` of its rows, in
        sequence coordinates)."""
        t0, t1 = self.rows(rank)
        a, b = piece(t1 - t0, chunks, j)
        return t0 + a, t0 + b

    def head_piece(self, rank: int, pieces: int, j: int) -> tuple[int, int]:
        """Columns [a, b) of ``rank``'s group (its own coordinates) in head piece j of ``pieces``:
        whole heads, near-equal counts (some empty when the group has fewer heads than pieces)."""
        c0, c1 = self.cols(rank)
        a, b = piece((c1 - c0) // self.col_unit, pieces, j)
        return a * self.col_unit, b * self.col_unit

    def a_piece_view(self, a_rank: torch.Tensor, rank: int, pieces: int, j: int) -> torch.Tensor:
        """Head piece j of ``rank``'s block ``a_rank`` (its :meth:`a_view`) as ``all_to_all_heads``
        and ``all_to_all_qkv_attend`` lay it out: ``[S, b - a]`` after the pieces before it."""
        a, b = self.head_piece(rank, pieces, j)
        flat = a_rank.reshape(-1)
        return flat[self.tokens * a : self.tokens * b].view(self.tokens, b - a)

    def q_piece_view(self, q_block: torch.Tensor, rank: int, pieces: int, j: int) -> torch.Tensor:
        """Head piece j of ``rank``'s q, k, v block ``q_block`` (its :meth:`q_view`, or any
        ``[n, 3·c_r]`` block of it) as ``all_to_all_qkv_attend`` lays it out: the piece's heads' q,
        k and v packed alone, ``[n, 3·(b - a)]``, after the pieces before it."""
        a, b = self.head_piece(rank, pieces, j)
        n = q_block.shape[0]
        flat = q_block.reshape(-1)
        return flat[n * 3 * a : n * 3 * b].view(n, 3 * (b - a))

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


def seq_index(rank: int) -> int:
    """Index of rank ``rank``'s sequence word in :meth:`ArenaLayout.header_words`."""
    return (rank + 1) * WORDS_PER_LINE


def fault_index(rank: int) -> int:
    """Index of rank ``rank``'s fault word in :meth:`ArenaLayout.header_words`."""
    return (rank + 1) * WORDS_PER_LINE + 1


def _epoch_bits(gen: int, job: int) -> int:
    return ((gen & 0xFFFF) << 47) | (job << 33)


def encode_seq(gen: int, job: int, op: int, kind: int, chunks: int, count: int) -> int:
    """Pack one sequence word (layout in the module docstring)."""
    return _epoch_bits(gen, job) | (op << 19) | (kind << 16) | (chunks << 8) | count


def encode_fault(gen: int, job: int, op: int) -> int:
    """The fault word a rank posts when it finds the ranks disagree at ``op`` of job (gen, job)."""
    return _epoch_bits(gen, job) | (op << 17) | 1


def fault_op(word: int, gen: int, job: int) -> int | None:
    """The op a fault word names when it was posted in job (gen, job); None otherwise."""
    if word and (word & ~((1 << 33) - 1)) == _epoch_bits(gen, job):
        return (word >> 17) & 0xFFFF
    return None


def decode_seq(word: int) -> tuple[int, int, int, int, int, int]:
    """(generation low 16 bits, job, op, kind, chunks, count) of a sequence word."""
    return (
        (word >> 47) & 0xFFFF,
        (word >> 33) & 0x3FFF,
        (word >> 19) & 0x3FFF,
        (word >> 16) & 7,
        (word >> 8) & 0xFF,
        word & 0xFF,
    )


def qkv_ranges(a: int, b: int, width: int) -> list[tuple[int, int]]:
    """The q, k and v ranges of columns [a, b) in a ``[q | k | v]`` projection, each ``width``
    wide."""
    return [(base + a, base + b) for base in (0, width, 2 * width)]


def piece(n: int, chunks: int, j: int) -> tuple[int, int]:
    """Rows [a, b) of chunk j when n rows are cut into ``chunks`` near-equal pieces (some empty if
    chunks > n)."""
    return n * j // chunks, n * (j + 1) // chunks
