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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import comfy_kitchen as ck
import torch

from workers.dit import ops as dit_ops
from workers.dit.weights import BlockView

#: Rows of the qkv projection per producer chunk (64-aligned, as ComfyUI's H3 path): Q/K/V are never
#: built whole.
PRODUCER_CHUNK = 4096
#: The kernel's query/key block length and its one head size.
BLOCK = 64
HEAD_DIM = 128
SINK_MODES = ("exact_kv_and_rows", "exact_kv", "off")
#: ``token_aug`` of the kernel: extra tokens per query block, a multiple of 64 up to 256.
EXTRA_TOKENS_MAX = 256


@dataclass(frozen=True)
class SparseConfig:
    """What a rank needs to decide and run sparse attention; validated on construction (both sides).

    ``topk_ratio`` > 0 selects top-k (``tau`` is then ignored); attention is sparse while
    ``sigma_end <= sigma <= sigma_start``, the sequence has at least ``min_tokens`` tokens and the
    block is not in ``dense_blocks``.
    """

    tau: float = 1.3
    topk_ratio: float = 0.0
    sigma_start: float = math.inf
    sigma_end: float = 0.0
    min_tokens: int = 12288
    dense_blocks: tuple[int, ...] = ()
    sink_conditioning: str = "exact_kv_and_rows"
    extra_tokens: int = 256

    def __post_init__(self) -> None:
        if not 0.0 <= self.tau <= 16.0:
            raise ValueError(
                f"tau={self.tau}: must be between 0 and 16 (higher is sparser; 1.3 is the default)"
            )
        if not 0.0 <= self.topk_ratio < 1.0:
            raise ValueError(
                f"topk_ratio={self.topk_ratio}: must be 0 (Sol-Attn threshold) or in (0, 1) "
                "(top-k: the fraction of key blocks kept); set keep_percent below 100"
            )
        if (
            math.isnan(self.sigma_start)
            or math.isnan(self.sigma_end)
            or self.sigma_end > self.sigma_start
        ):
            raise ValueError(
                f"sigma window [{self.sigma_end}, {self.sigma_start}] is empty: the end sigma must "
                "not exceed the start sigma; set end_percent >= start_percent"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or self.min_tokens < 0
        ):
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an integer >= 0")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in self.dense_blocks):
            raise ValueError(
                f"dense_blocks={list(self.dense_blocks)}: block indices must be integers >= 0"
            )
        if self.sink_conditioning not in SINK_MODES:
            raise ValueError(
                f"sink_conditioning={self.sink_conditioning!r}: must be one of "
                f"{', '.join(SINK_MODES)}"
            )
        if not 0 <= self.extra_tokens <= EXTRA_TOKENS_MAX or self.extra_tokens % BLOCK:
            raise ValueError(
                f"extra_tokens={self.extra_tokens}: must be 0, 64, 128, 192 or 256 (the kernel "
                "routes tokens in 64-token tiles)"
            )

    @property
    def method(self) -> str:
        return "top-k" if self.topk_ratio else "sol-attn"

    def to_wire(self) -> dict:
        """Plain data for a ``dit_step``; an open start (+inf) travels as None, so the form is also
        JSON (logs, bench output)."""
        d = asdict(self)
        d["dense_blocks"] = list(self.dense_blocks)
        d["sigma_start"] = None if math.isinf(self.sigma_start) else self.sigma_start
        return d

    @classmethod
    def from_wire(cls, d: dict) -> SparseConfig:
        d = dict(d)
        d["dense_blocks"] = tuple(int(b) for b in d.get("dense_blocks", ()))
        if d.get("sigma_start") is None:
            d["sigma_start"] = math.inf
        return cls(**d)


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
    wire: dict, stats: PooledStats, heads: tuple[int, int], segments: Sequence[tuple]
) -> SparseStep:
    """The :class:`SparseStep` of a ``dit_step``'s ``sparse`` field (``{config, sigma, branch}``);
    ``segments`` are the whole stream's mod segments (not a rank's clipped ones)."""
    cfg = SparseConfig.from_wire(wire["config"])
    sigma = wire.get("sigma")
    sb, sq = sinks(cfg, target_starts(segments))
    return SparseStep(
        cfg,
        stats,
        None if sigma is None else float(sigma),
        str(wire.get("branch", "")),
        (int(heads[0]), int(heads[1])),
        sb,
        sq,
    )


def probe_wire(config: SparseConfig, segments: Sequence[tuple], rope: torch.Tensor) -> dict:
    """A ``dit_probe``'s ``sparse`` field: what the kernel's calls depend on besides the shapes
    (method, ``tau``/``topk_ratio``, ``extra_tokens``, the sinks of this stream's ``segments``)
    and the rope table's pairs and dtype; the per-step decisions (sigma window, ``min_tokens``,
    ``dense_blocks``) left out."""
    sb, sq = sinks(config, target_starts(segments))
    kernel = replace(
        config, sigma_start=math.inf, sigma_end=0.0, min_tokens=0, dense_blocks=()
    ).to_wire()
    return {
        "config": kernel,
        "sink_blocks": list(sb),
        "sink_q": list(sq),
        "rope_pairs": int(rope.shape[-3]),
        "rope_dtype": str(rope.dtype).removeprefix("torch."),
    }


def probe_step(wire: Mapping, heads: tuple[int, int]) -> SparseStep:
    """The :class:`SparseStep` the invariance probe calls for ``heads`` (fresh statistics; every
    block sparse)."""
    return SparseStep(
        SparseConfig.from_wire(wire["config"]),
        PooledStats(),
        None,
        "",
        (int(heads[0]), int(heads[1])),
        (int(wire["sink_blocks"][0]), int(wire["sink_blocks"][1])),
        (int(wire["sink_q"][0]), int(wire["sink_q"][1])),
    )
