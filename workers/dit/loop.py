"""The one block loop of the DiT: the unsplit reference, the in-process simulated split and every
rank run it.

Per block, a rank with tokens [t0, t1) and heads [g0, g1) (docs/architecture.md, the DiT split):

1. the block's modulation vectors from its adaLN rows (computed once per step by the model's
   owner and handed to every rank alike); norm1 + modulation of its tokens;
2. all-gather of the modulated rows -> [S, H];
3. qkv of its head rows over all tokens, fused RMSNorm + rope, attention over the whole sequence;
4. all-to-all -> every head's attention output for its own tokens [n_r, heads*D];
5. out_proj, gated residual, norm2 + modulation, MLP, gated residual on its own tokens (in place, as
   ComfyUI).

With ``gather_ahead`` step 5 runs in row pieces of its own tokens, each followed by the next block's
norm1 + modulation of those rows, published into the next block's all-gather while the next piece
computes (``Exchange.all_gather_rows_produced``): the next block starts at step 3.  Only the GEMMs'
row counts change (the exactness probe measures the pieces); the row-wise ops are exact in any
pieces.

With one rank (``IdentityExchange``, all heads) both collectives return their input and the loop is
ComfyUI's unsplit block stack op for op; a split can only differ from it through what the weight
provider and the exchange slice and move, never through how a block computes.  Where the weights
come from (``workers.dit.weights``) and how rows move (``workers.transports.exchange``) are the
loop's two parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.dit import ops as dit_ops
from workers.dit.block_clock import BlockClock, HostBlockClock
from workers.dit.protocol import BlockTiming, Pattern
from workers.dit.sparse import SparseStep
from workers.dit.weights import BlockView, CpuWeights, WeightProvider
from workers.transports.exchange import Exchange, IdentityExchange


@dataclass(frozen=True)
class BlockInputs:
    """One step's inputs as a rank's blocks read them: ``modulation``, every block's raw adaLN
    output ``[blocks, M, 18·hidden]`` indexed by block (``dit_ops.adaln_rows``), the mod
    ``segments`` in the rank's row coordinates (``dit_ops.clip_segments``), the rope table of all
    tokens."""

    modulation: torch.Tensor
    segments: Sequence[dit_ops.ModSegment]
    rope_freqs: torch.Tensor


@dataclass(frozen=True)
class RankBlocks:
    """What a rank computes its blocks with: where the weights come from, how rows move, its head
    count, the head size, the norms' epsilon, the attention function (None: SDPA) and the clock
    its blocks report to (None: the host clock over the exchange's counters)."""

    weights: WeightProvider
    exchange: Exchange
    heads_local: int
    head_dim: int
    eps: float
    attend: dit_ops.Attend | None = None
    clock: BlockClock | None = None


@dataclass(frozen=True)
class LoopPaths:
    """How the exchanges run: ``chunks`` pipelines them; ``head_pieces`` > 1: dense attention in
    that many head pieces, each moved by the all-to-all while the next one computes
    (``Exchange.all_to_all_heads``); ``gather_overlap`` (dense steps): the qkv projection rank by
    rank on the gathered rows as they arrive (``Exchange.all_gather_rows_each``); ``pattern``
    "ulysses" (dense steps; the weights then hold every head's qkv rows): each rank projects q, k,
    v of every head for its own tokens and ``Exchange.all_to_all_qkv`` gives it its heads' q, k,
    v for every token; ``sparse``: attention through comfy-kitchen's sparse kernel where its
    settings say so (``workers.dit.sparse``); ``gather_ahead`` > 0 (the gather pattern): each
    block but the last runs its tail in that many row pieces, each followed by the next block's
    norm1 + modulation of those rows, published into the next block's gather while the next piece
    computes (``Exchange.all_gather_rows_produced``); the next block then projects its qkv on the
    gathered rows whole."""

    chunks: int = 0
    head_pieces: int = 0
    gather_overlap: bool = False
    pattern: Pattern = Pattern.GATHER
    sparse: SparseStep | None = None
    gather_ahead: int = 0


@dataclass(frozen=True)
class LoopHooks:
    """``before_block(i)`` runs before block i (an abort check), ``after_block(i)`` after it
    (progress); ``trace(i, op, output)`` sees each op's output of block i and the block's rows as
    op ``"block"`` (``verify``)."""

    before_block: Callable[[int], None] | None = None
    after_block: Callable[[int], None] | None = None
    trace: Callable[[int, str, torch.Tensor], None] | None = None


def run_blocks(
    x_rows: torch.Tensor,
    inputs: BlockInputs,
    rank: RankBlocks,
    blocks: range,
    paths: LoopPaths = LoopPaths(),
    hooks: LoopHooks = LoopHooks(),
) -> list[BlockTiming]:
    """Run ``blocks`` on this rank's rows ``x_rows`` (updated in place); returns where each block's
    time went (``rank.clock``'s reading: ``workers.dit.block_clock``)."""
    mod, segments, rope_freqs = inputs.modulation, inputs.segments, inputs.rope_freqs
    weights, exchange, attend = rank.weights, rank.exchange, rank.attend
    heads_local, head_dim, eps = rank.heads_local, rank.head_dim, rank.eps
    chunks, head_pieces, pattern, sparse = (
        paths.chunks,
        paths.head_pieces,
        paths.pattern,
        paths.sparse,
    )
    before_block, after_block, trace = hooks.before_block, hooks.after_block, hooks.trace
    clock = rank.clock or HostBlockClock(exchange.counters)
    clock.start()
    ahead = paths.gather_ahead if pattern == Pattern.GATHER else 0
    gathered: torch.Tensor | None = None  # this block's gathered input, when the last one made it
    for i in blocks:
        if before_block is not None:
            before_block(i)
        blk = weights.block(i)
        w = blk.weights
        op_trace = None if trace is None else (lambda op, t, i=i: trace(i, op, t))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = dit_ops.modulation(mod[i])
        attn: torch.Tensor | None = None
        attn_rows: torch.Tensor | None = None
        if gathered is None:
            n1 = dit_ops.norm_modulate(
                x_rows, w["norm1.weight"], shift_msa, scale_msa, segments, eps
            )
        if gathered is None and pattern == "ulysses" and head_pieces > 1:
            attn_rows = _ulysses_in_pieces(
                exchange, n1, blk, rope_freqs, rank, head_pieces, op_trace
            )
        elif gathered is None and pattern == "ulysses":
            qkv = _ulysses_projection(exchange, n1, blk, chunks)
        elif gathered is None and paths.gather_overlap and sparse is None:
            qkv = _gathered_projection(exchange, n1, blk)
        else:
            n1_full = exchange.all_gather_rows(n1, chunks) if gathered is None else gathered
            if sparse is not None:
                attn = sparse.attention(
                    i, n1_full, blk, rope_freqs, heads_local, head_dim, eps, op_trace
                )
            if attn is None:
                qkv = dit_ops.linear(
                    n1_full, blk.qkv, blk.qkv_scale, None, quant=blk.quant["attn.qkv_proj"]
                )
        if attn is None and attn_rows is None:
            dit_ops.norm_rope_(
                qkv,
                w["attn.q_norm.weight"],
                w["attn.k_norm.weight"],
                rope_freqs,
                heads_local,
                head_dim,
                eps,
                op_trace,
            )
        if attn_rows is not None:  # the Ulysses pieces attended as they arrived
            pass
        elif attn is not None:  # sparse attention ran
            attn_rows = exchange.all_to_all_cols(attn, chunks)
        elif head_pieces > 1:
            attn_rows = _attend_in_pieces(
                exchange, qkv, heads_local, head_dim, attend, head_pieces, op_trace
            )
        else:
            attn = dit_ops.attend_group(qkv, heads_local, head_dim, attend, op_trace)
            attn_rows = exchange.all_to_all_cols(attn, chunks)
        tail = _Tail(x_rows, attn_rows, blk, (gate_msa, shift_mlp, scale_mlp, gate_mlp), eps)
        if ahead and i + 1 < blocks.stop:
            gathered = _tail_ahead(
                exchange, tail, segments, weights.ahead(i + 1), mod[i + 1], ahead, op_trace
            )
        else:
            gathered = None
            tail.run(0, x_rows.shape[0], segments, op_trace)
        if op_trace is not None:
            op_trace("block", x_rows)
        weights.done(i)
        clock.block_done()
        if after_block is not None:
            after_block(i)
    return clock.finish()


@dataclass(frozen=True)
class _Tail:
    """A block's step 5 on this rank's rows ``x`` (updated in place), from the all-to-all's
    ``attn_rows``; ``mods``: its gate_msa, shift_mlp, scale_mlp, gate_mlp."""

    x: torch.Tensor
    attn_rows: torch.Tensor
    blk: BlockView
    mods: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    eps: float

    def run(
        self, a: int, b: int, segments: Sequence[dit_ops.ModSegment], trace: dit_ops.Trace | None
    ) -> torch.Tensor:
        """Rows [a, b) (``segments`` in their coordinates); returns their new residual rows."""
        whole = (a, b) == (0, self.x.shape[0])
        x = self.x if whole else self.x[a:b]
        # a piece's GEMM input as the probe measures it: a tensor of its own
        rows = self.attn_rows if whole else self.attn_rows[a:b].clone()
        gate_msa, shift_mlp, scale_mlp, gate_mlp = self.mods
        w, quant = self.blk.weights, self.blk.quant
        return dit_ops.out_mlp(
            x, rows, w, gate_msa, shift_mlp, scale_mlp, gate_mlp, segments, self.eps, quant, trace
        )


def _tail_ahead(
    exchange: Exchange,
    tail: _Tail,
    segments: Sequence[dit_ops.ModSegment],
    following: BlockView,
    following_mod: torch.Tensor,
    pieces: int,
    trace: dit_ops.Trace | None,
) -> torch.Tensor:
    """``tail`` in row pieces, each followed by the following block's norm1 + modulation of
    those rows, published into that block's all-gather: its gathered input ``[S, H]``.  ``trace``
    sees each linear's output of every piece put together, as the unsplit tail's."""
    shift_msa, scale_msa = dit_ops.modulation(following_mod)[:2]
    norm_w = following.weights["norm1.weight"]
    parts: dict[str, list[torch.Tensor]] = {}

    def keep(op: str, t: torch.Tensor) -> None:
        parts.setdefault(op, []).append(t)

    def produce(a: int, b: int) -> torch.Tensor:
        local = dit_ops.clip_segments(segments, a, b)
        x = tail.run(a, b, local, None if trace is None else keep)
        return dit_ops.norm_modulate(x, norm_w, shift_msa, scale_msa, local, tail.eps)

    gathered = exchange.all_gather_rows_produced(produce, pieces)
    if trace is not None:
        for op, ts in parts.items():
            trace(op, torch.cat(ts))
    return gathered


def _ulysses_projection(
    exchange: Exchange, n1: torch.Tensor, blk: BlockView, chunks: int
) -> torch.Tensor:
    """The Ulysses pattern's projection: q, k, v of every head for this rank's tokens (``blk.qkv``
    holds every head's rows), moved by the all-to-all so this rank holds its heads' for every token:
    the group's packed ``[S, 3·h·D]`` projection (``dit_ops.norm_rope_`` still to run)."""
    own = dit_ops.linear(n1, blk.qkv, blk.qkv_scale, None, quant=blk.quant["attn.qkv_proj"])
    return exchange.all_to_all_qkv(own, chunks)


def _ulysses_in_pieces(
    exchange: Exchange,
    n1: torch.Tensor,
    blk: BlockView,
    rope_freqs: torch.Tensor,
    rank: RankBlocks,
    pieces: int,
    trace: dit_ops.Trace | None,
) -> torch.Tensor:
    """The Ulysses pattern with attention in head pieces: q, k, v of every head for this rank's
    tokens move in this rank's head pieces, each piece's heads are normed, roped and attended as
    soon as they are here, and each piece's output goes back while the next piece is attended
    (``Exchange.all_to_all_qkv_attend``): this rank's rows of every head.  ``trace`` sees the
    group's projection and attention as the one-piece path lays them out."""
    w, head_dim = blk.weights, rank.head_dim
    own = dit_ops.linear(n1, blk.qkv, blk.qkv_scale, None, quant=blk.quant["attn.qkv_proj"])
    outs: list[torch.Tensor] = []
    raw: list[torch.Tensor] = []

    def attend(a: int, b: int, qkv: torch.Tensor) -> torch.Tensor:
        heads = (b - a) // head_dim
        if trace is not None:
            raw.append(qkv.clone())  # the projection, before norm and rope change it in place
        dit_ops.norm_rope_(
            qkv,
            w["attn.q_norm.weight"],
            w["attn.k_norm.weight"],
            rope_freqs,
            heads,
            head_dim,
            rank.eps,
        )
        out = dit_ops.attend_group(qkv, heads, head_dim, rank.attend)
        if trace is not None:
            outs.append(out)
        return out

    rows = exchange.all_to_all_qkv_attend(own, pieces, attend)
    if trace is not None:
        thirds = [p.chunk(3, dim=1) for p in raw]
        empty = own.new_empty((rope_freqs.shape[1], 0))  # a rank without heads
        trace("attn.qkv_proj", torch.cat([t[k] for k in range(3) for t in thirds] or [empty], 1))
        trace("attention", torch.cat(outs, dim=1) if outs else empty)
    return rows


def _gathered_projection(exchange: Exchange, n1: torch.Tensor, blk: BlockView) -> torch.Tensor:
    """The all-gather of the block input with this rank's group's qkv projection computed on each
    rank's rows as they arrive (this rank's first, while the others' travel): the packed ``[S,
    3·h·D]`` projection (``dit_ops.norm_rope_`` still to run)."""
    parts: dict[int, torch.Tensor] = {}

    def on_rows(a: int, b: int, rows: torch.Tensor) -> None:
        parts[a] = dit_ops.linear(
            rows, blk.qkv, blk.qkv_scale, None, quant=blk.quant["attn.qkv_proj"]
        )

    exchange.all_gather_rows_each(n1, on_rows)
    return torch.cat([parts[a] for a in sorted(parts)])


def _attend_in_pieces(
    exchange: Exchange,
    qkv: torch.Tensor,
    heads_local: int,
    head_dim: int,
    attend: dit_ops.Attend | None,
    pieces: int,
    trace: dit_ops.Trace | None,
) -> torch.Tensor:
    """Dense attention of this rank's heads (``qkv``: its group's projection) computed in head
    pieces inside the all-to-all, which returns this rank's rows of every head."""
    parts: list[torch.Tensor] = []

    def produce(a: int, b: int) -> torch.Tensor:
        out = dit_ops.attend_head_piece(
            qkv, heads_local, head_dim, a // head_dim, b // head_dim, attend
        )
        if trace is not None:
            parts.append(out)
        return out

    rows = exchange.all_to_all_heads(produce, pieces)
    if trace is not None:
        trace("attention", torch.cat(parts, dim=1))
    return rows


def block_forward_unsplit(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    inputs: BlockInputs,
    heads: int,
    head_dim: int,
    eps: float,
    attend: dit_ops.Attend | None = None,
) -> torch.Tensor:
    """One whole ComfyUI DiT block on all tokens and heads (``inputs.modulation``: this block's
    rows alone, ``[1, M, 18·hidden]``); ``x`` is mutated in place and returned, like ComfyUI."""
    one = CpuWeights(lambda _: weights, 1, (0, heads), heads, head_dim, eager=False)
    run_blocks(
        x, inputs, RankBlocks(one, IdentityExchange(), heads, head_dim, eps, attend), range(1)
    )
    return x
