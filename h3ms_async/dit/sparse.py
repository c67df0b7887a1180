"""Sparse attention settings (H3 MS Sparse Attention) and the decisions the coordinator takes for a
whole step.

:class:`SparseSettings` is what the user sets, validated here with errors that name the input and
the fix; :meth:`SparseSettings.resolve` turns it into the ranks' ``workers.dit.sparse.SparseConfig``
(the percent window as sigmas, the block list checked against the model). :class:`DenseFallback`
decides, once per step, whether the kernel can run at all on these ranks and this stream (CUDA SM
>= 8.0, bfloat16, head_dim 128) and says why not in ONE log line per reason; every rank then runs
dense, so a split never mixes sparse and dense ranks. :func:`probe_settings` is what the invariance
probe measures the kernel with. :class:`UnsplitSparse` is the engine's unsplit path: the same
sparse attention over every head on one device, with its own statistics.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3ms_async.log import get_logger
from workers.dit.protocol import (
    EXTRA_TOKENS_MAX,
    SINK_MODES,
    SparseConfig,
    SparseProbeSettings,
    SparseStepSettings,
)
from workers.dit.sparse import (
    HEAD_DIM,
    PooledStats,
    SparseStep,
    dense_reason,
    kernel_unavailable,
    probe_wire,
    sparse_step,
)

log = get_logger("Sparse")

METHODS = ("sol-attn", "top-k")
_BLOCK_ITEM = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_block_list(text: str) -> tuple[int, ...]:
    """``"0, 1, 47-49"`` -> ``(0, 1, 47, 48, 49)`` (sorted, unique); anything else is a
    ``ValueError`` naming ``dense_blocks``."""
    blocks: set[int] = set()
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        m = _BLOCK_ITEM.match(part)
        if m is None:
            raise ValueError(
                f"dense_blocks: {part!r} is not a block index or range; write indices and ranges "
                "separated by commas, e.g. '0, 1, 47-49'"
            )
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise ValueError(
                f"dense_blocks: range {part!r} runs backwards; write it low-high, e.g. '{b}-{a}'"
            )
        blocks.update(range(a, b + 1))
    return tuple(sorted(blocks))


@dataclass(frozen=True)
class SparseSettings:
    """The H3 MS Sparse Attention node's inputs (names as on the node)."""

    method: str = "sol-attn"
    tau: float = 1.3
    keep_percent: float = 10.0
    start_percent: float = 0.2
    end_percent: float = 1.0
    dense_blocks: str = ""
    min_tokens: int = 12288
    extra_tokens: int = 256
    sink_conditioning: str = "exact_kv_and_rows"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: choose one of {', '.join(METHODS)}")
        if not 0.0 <= self.tau <= 4.0:
            raise ValueError(
                f"tau={self.tau:g}: must be between 0 and 4 (1.0 keeps ~16% of key blocks exact, "
                "2.0 ~3%); the default is 1.3"
            )
        if not 0.5 <= self.keep_percent <= 95.0:
            raise ValueError(
                f"keep_percent={self.keep_percent:g}: must be between 0.5 and 95 (percent of key "
                "blocks each query block keeps); the default is 10"
            )
        for name in ("start_percent", "end_percent"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(
                    f"{name}={v:g}: must be between 0 and 1 (a fraction of the sampling schedule)"
                )
        if self.end_percent < self.start_percent:
            raise ValueError(
                f"end_percent={self.end_percent:g} is before start_percent={self.start_percent:g}: "
                "sparse attention would never run; set end_percent >= start_percent"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or self.min_tokens < 0
        ):
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an integer >= 0")
        if not 0 <= self.extra_tokens <= EXTRA_TOKENS_MAX or self.extra_tokens % 64:
            raise ValueError(
                f"extra_tokens={self.extra_tokens}: must be 0, 64, 128, 192 or 256 (tokens are "
                "routed in 64-token tiles; 0 turns it off)"
            )
        if self.sink_conditioning not in SINK_MODES:
            raise ValueError(
                f"sink_conditioning={self.sink_conditioning!r}: choose one of "
                f"{', '.join(SINK_MODES)}"
            )
        parse_block_list(self.dense_blocks)

    def resolve(
        self, percent_to_sigma: Callable[[float], float] | None, layers: int
    ) -> SparseConfig:
        """The ranks' config for a model of ``layers`` blocks. ``percent_to_sigma`` is the model's
        ``model_sampling.percent_to_sigma`` (None: no sigma window, every step sparse)."""
        blocks = parse_block_list(self.dense_blocks)
        outside = [b for b in blocks if b >= layers]
        if outside:
            raise ValueError(
                f"dense_blocks: block(s) {outside} do not exist; the model has blocks "
                f"0-{layers - 1}"
            )
        if percent_to_sigma is None:
            start, end = math.inf, 0.0
        else:
            start, end = (
                float(percent_to_sigma(self.start_percent)),
                float(percent_to_sigma(self.end_percent)),
            )
            # ComfyUI maps percent 0 to a sigma above any schedule's first step (999999999.9)
            start = math.inf if start >= 1e8 else start
        return SparseConfig(
            tau=float(self.tau),
            topk_ratio=0.0 if self.method == "sol-attn" else self.keep_percent / 100.0,
            sigma_start=start,
            sigma_end=max(end, 0.0),
            min_tokens=int(self.min_tokens),
            dense_blocks=blocks,
            sink_conditioning=self.sink_conditioning,
            extra_tokens=int(self.extra_tokens),
        )

    def describe(self) -> str:
        how = f"tau {self.tau:g}" if self.method == "sol-attn" else f"keep {self.keep_percent:g}%"
        return (
            f"{self.method} ({how}), {self.start_percent:g}-{self.end_percent:g} of the schedule, "
            f"min_tokens {self.min_tokens}, dense_blocks '{self.dense_blocks}', sinks "
            f"{self.sink_conditioning}, extra_tokens {self.extra_tokens}"
        )


def branch_key(uuids: Sequence) -> str:
    """The conditioning branch a call belongs to, from ComfyUI's ``transformer_options['uuids']``
    (the pooled statistics of a positive and a negative pass differ)."""
    return ",".join(str(u) for u in uuids)


class DenseFallback:
    """Whether the kernel can run for a step at all; logs one line per reason it cannot (then the
    step is dense)."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def blocked(
        self, dtype: torch.dtype, head_dim: int, rank_reasons: Sequence[str | None]
    ) -> str | None:
        """The reason every rank runs this step dense, or None; logged the first time it comes
        up."""
        reason = next((r for r in rank_reasons if r), None)
        if reason is None and dtype != torch.bfloat16:
            reason = (
                f"the stream is {str(dtype).removeprefix('torch.')}; the chunked kernel takes "
                "bfloat16"
            )
        if reason is None and head_dim != HEAD_DIM:
            reason = f"head_dim is {head_dim}; the kernel takes {HEAD_DIM}"
        if reason is not None and reason not in self._said:
            self._said.add(reason)
            log.warning("sparse attention cannot run, attention stays dense: %s", reason)
        return reason


def probe_settings(
    config: SparseConfig,
    tokens: int,
    blocks: int,
    segments: Sequence[tuple],
    rope_freqs: torch.Tensor,
) -> SparseProbeSettings | None:
    """What the invariance probe measures sparse attention ``config`` with on a step of ``tokens``
    tokens through ``blocks`` blocks (a ``dit_probe``'s ``sparse``:
    ``workers.dit.sparse.probe_wire``), or None when the settings keep every block dense at this
    length (no step of it runs the kernel)."""
    if all(dense_reason(config, None, tokens, i) is not None for i in range(blocks)):
        return None
    return probe_wire(config, segments, rope_freqs)


class UnsplitSparse:
    """The engine's unsplit path: sparse attention over every head on one device
    (``ReferenceDiT.forward_blocks``), with its own pooled statistics and fallback line; what the
    split must equal bit for bit."""

    def __init__(self, config: SparseConfig) -> None:
        self.config = config
        self.stats = PooledStats()
        self.fallback = DenseFallback()

    def step(
        self,
        *,
        heads: int,
        head_dim: int,
        segments: Sequence[tuple],
        sigma: float | None,
        branch: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> SparseStep | None:
        """This step's :class:`SparseStep` over heads [0, heads), or None when the kernel cannot run
        (dense)."""
        if self.fallback.blocked(dtype, head_dim, [kernel_unavailable(device)]):
            return None
        return sparse_step(
            SparseStepSettings(self.config, sigma, branch), self.stats, (0, heads), segments
        )

    def end_sampling(self) -> int:
        """Drop the statistics (sampling ended); returns how many entries there were."""
        return self.stats.clear()
