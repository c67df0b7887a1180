"""Sparse attention inside the split: comfy-kitchen's chunked Sol-Attn producer over one rank's
heads.

Sol-Attn (adaptive threshold ``tau``) and SLA-style top-k select key blocks per head and query
block, and after the split's all-gather a rank holds every token of its heads; so a rank running
``ck.sol_attn_chunked`` over its head group computes exactly those heads of the same call over every
head on one GPU (docs/architecture.md, sparse attention). The kernel carries pooled per-head
statistics (``kmean``, ``vscale``, ``[h, 128]`` fp32) from one step to the next:
:class:`PooledStats` keeps them per (block, rows, head range, conditioning branch) and is emptied
when sampling ends.

:class:`SparseConfig` is the settings as the ranks receive them (the sigma window already in
sigmas); the user-facing settings and their resolution live in ``h3ms_async.dit.sparse``. Kernel
facts: ``docs/comfyui_facts.md`` (sparse attention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import comfy_kitchen as ck
import torch

from workers.dit import ops as dit_ops
from workers.dit.protocol import (
    BLOCK,
    SparseConfig,
    SparseProbeSettings,
    SparseStepSettings,
)
from workers.dit.weights import BlockView

#: Rows of the qkv projection per producer chunk (64-aligned, as ComfyUI's H3 path): Q/K/V are never
#: built whole.
PRODUCER_CHUNK = 4096
HEAD_DIM = 128


def dense_reason(cfg: SparseConfig, sigma: float | None, tokens: int, block: int) -> str | None:
    """Why block ``block`` of a step at ``sigma`` over ``tokens`` tokens runs dense by the settings,
    or None."""
    if sigma is not None and not cfg.sigma_end <= sigma <= cfg.sigma_start:
        return f"sigma {sigma:.4g} outside [{cfg.sigma_end:.4g}, {cfg.sigma_start:.4g}]"
    if tokens < cfg.min_tokens:
        return f"{tokens} tokens < min_tokens {cfg.min_tokens}"
    if block in cfg.dense_blocks:
        return f"block {block} in dense_blocks"
    return None


def kernel_unavailable(device: torch.device) -> str | None:
    """Why comfy-kitchen's Sol-Attn kernel cannot run on ``device`` (no CUDA, SM < 8.0, not
    compiled), or None where ``ck.sol_attn_is_available`` says it can. The per-call rules
    (bfloat16 chunks, head_dim 128) are the caller's: ``h3ms_async.dit.sparse``."""
    if ck.sol_attn_is_available(device):
        return None
    if device.type != "cuda":
        return f"{device} is not a CUDA device (comfy-kitchen has no CPU sparse attention kernel)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return f"{device} is SM {major}.{minor}; the kernel needs SM 8.0 or newer"
    return (
        f"comfy-kitchen's sol_attn kernel is not available on {device} (its CUDA backend is "
        "disabled or not compiled for this GPU)"
    )


def target_starts(segments: Sequence[tuple]) -> tuple[int, int] | None:
    """``(audio_start, video_start)`` of H3's packed stream: the target audio and video are always
    its last two mod segments (``docs/comfyui_facts.md`` §1.4); None with fewer than two
    segments."""
    if len(segments) < 2:
        return None
    return int(segments[-2][0]), int(segments[-1][0])


def sinks(
    cfg: SparseConfig, starts: tuple[int, int] | None
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(sink_blocks, sink_q)``: the packed conditioning prefix (everything before the target
    video) as key blocks every query attends exactly; with ``exact_kv_and_rows`` also the
    target-audio query rows dense."""
    if cfg.sink_conditioning == "off" or starts is None or starts[1] <= 0:
        return (0, 0), (0, 0)
    audio, video = starts
    blocks = (0, -(-video // BLOCK))
    if cfg.sink_conditioning == "exact_kv":
        return blocks, (0, 0)
    return blocks, (audio // BLOCK, blocks[1])


StatsKey = tuple[int, int, tuple[int, int], str]
"""(block, rows, head range, conditioning branch)."""


class PooledStats:
    """The kernel's pooled ``(kmean, vscale)`` of the previous step, per :data:`StatsKey`; one per
    rank process (and one per unsplit reference), emptied when sampling ends or the weights
    change."""

    def __init__(self) -> None:
        self._stats: dict[StatsKey, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, key: StatsKey) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._stats.get(key)

    def put(self, key: StatsKey, kmean: torch.Tensor, vscale: torch.Tensor) -> None:
        self._stats[key] = (kmean, vscale)

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        n = len(self._stats)
        self._stats.clear()
        return n

    def __len__(self) -> int:
        return len(self._stats)


@dataclass
class SparseStep:
    """Sparse attention for one step of one rank (or of the unsplit run): the settings, the step's
    sigma and conditioning branch, this rank's head range and the stream's sink blocks. ``counts``
    says what ran."""

    config: SparseConfig
    stats: PooledStats
    sigma: float | None
    branch: str
    heads: tuple[int, int]
    sink_blocks: tuple[int, int]
    sink_q: tuple[int, int]
    counts: dict = field(
        default_factory=lambda: {"sparse_blocks": 0, "dense_blocks": 0, "stats_reused": 0}
    )

    def attention(
        self,
        i: int,
        n1_full: torch.Tensor,
        blk: BlockView,
        rope_freqs: torch.Tensor,
        heads_local: int,
        head_dim: int,
        eps: float,
        trace: dit_ops.Trace | None = None,
    ) -> torch.Tensor | None:
        """Block ``i``'s attention of this rank's heads, ``[S, h·D]`` like ``dit_ops.norm_rope_``
        + ``dit_ops.attend_group``; None when the settings keep this block dense (the caller then
        runs the dense path). ``trace`` sees the qkv projection (its chunks of the first producer
        pass, joined), the output and the statistics passed to the next step (``attention.kmean``,
        ``attention.vscale``: ``[h, 128]``)."""
        seq = n1_full.shape[0]
        if dense_reason(self.config, self.sigma, seq, i) is not None:
            self.counts["dense_blocks"] += 1
            return None
        w = blk.weights
        quant = blk.quant["attn.qkv_proj"]
        n_chunks = -(-seq // PRODUCER_CHUNK)
        projected: list[torch.Tensor] = []

        def chunks():
            # the qkv projection in 64-aligned row slices, each handed to the kernel's producer as
            # it is made
            for a in range(0, seq, PRODUCER_CHUNK):
                chunk = dit_ops.linear(
                    n1_full[a : a + PRODUCER_CHUNK], blk.qkv, blk.qkv_scale, None, quant=quant
                )
                if trace is not None and len(projected) < n_chunks:
                    projected.append(chunk)
                yield chunk

        key: StatsKey = (i, seq, self.heads, self.branch)
        pooled = self.stats.get(key)
        norms = (
            w["attn.q_norm.weight"].to(n1_full.device),
            w["attn.k_norm.weight"].to(n1_full.device),
        )
        out, kmean, vscale = ck.sol_attn_chunked(
            chunks,
            seq,
            heads_local,
            rope_freqs,
            norms,
            kmean=None if pooled is None else pooled[0],
            vscale=None if pooled is None else pooled[1],
            tau=self.config.tau,
            topk_ratio=self.config.topk_ratio,
            token_aug=self.config.extra_tokens,
            sink_blocks=list(self.sink_blocks),
            sink_q=list(self.sink_q),
            rope_eps=eps,
        )
        attn = out.view(seq, heads_local * head_dim)
        if dit_ops.SHAPE_FAULT is not None:
            dit_ops.SHAPE_FAULT.apply("sparse", (heads_local,), attn, dit_ops.is_probing())
        self.stats.put(key, kmean, vscale)
        self.counts["sparse_blocks"] += 1
        self.counts["stats_reused"] += pooled is not None
        if trace is not None:
            for op, t in (
                ("attn.qkv_proj", torch.cat(projected)),
                ("attention", attn),
                ("attention.kmean", kmean),
                ("attention.vscale", vscale),
            ):
                trace(op, t)
        return attn


def sparse_step(
    wire: SparseStepSettings,
    stats: PooledStats,
    heads: tuple[int, int],
    segments: Sequence[tuple],
) -> SparseStep:
    """The :class:`SparseStep` of a ``dit_step``'s ``sparse`` settings; ``segments`` are the whole
    stream's mod segments (not a rank's clipped ones)."""
    sb, sq = sinks(wire.config, target_starts(segments))
    return SparseStep(
        wire.config,
        stats,
        wire.sigma,
        wire.branch,
        (int(heads[0]), int(heads[1])),
        sb,
        sq,
    )


def probe_wire(
    config: SparseConfig, segments: Sequence[tuple], rope: torch.Tensor
) -> SparseProbeSettings:
    """A ``dit_probe``'s ``sparse`` settings: what the kernel's calls depend on besides the shapes
    (method, ``tau``/``topk_ratio``, ``extra_tokens``, the sinks of this stream's ``segments``)
    and the rope table's pairs and dtype; the per-step decisions (sigma window, ``min_tokens``,
    ``dense_blocks``) left out."""
    sb, sq = sinks(config, target_starts(segments))
    kernel = replace(config, sigma_start=math.inf, sigma_end=0.0, min_tokens=0, dense_blocks=())
    return SparseProbeSettings(
        kernel,
        (int(sb[0]), int(sb[1])),
        (int(sq[0]), int(sq[1])),
        int(rope.shape[-3]),
        str(rope.dtype).removeprefix("torch."),
    )


def probe_step(wire: SparseProbeSettings, heads: tuple[int, int]) -> SparseStep:
    """The :class:`SparseStep` the invariance probe calls for ``heads`` (fresh statistics; every
    block sparse)."""
    return SparseStep(
        wire.config,
        PooledStats(),
        None,
        "",
        (int(heads[0]), int(heads[1])),
        wire.sink_blocks,
        wire.sink_q,
    )
