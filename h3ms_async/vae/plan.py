"""H3 video-VAE temporal chunk plan, the ordered blend, and the write loop (docs/architecture.md,
"VAE split").

H3's video VAE decodes a latent ``[B, 24, T, h, w]`` (T > 1) in temporal chunks: the latent is
padded by repeating its last frame, chunk i decodes tokens ``[c*i, c*i + c + o)`` (c = tokens per
chunk, o = overlap tokens) into ``4*(c + o)`` raw frames, and the raw frames are cut into a *head*
(written, after blending the previous chunk's tail into its first frames) and a *tail* (kept for the
next chunk; the last chunk's tail is written as is). Only the blend and the write are ordered; every
chunk decode is independent, which is what the split deals across ranks.

This module computes the plan from the VAE's constants and replays the ordered part, with the blend
and the pixel finalisation given as callables (under ComfyUI the VAE's own methods, so ComfyUI's
code does the math; standalone
:func:`blend` and :func:`finalize`, which match it bit for bit — tests/test_vae_plan.py checks both
against the recorded golden plans and blend).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BlendFn = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
FinalizeFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class VaeGeometry:
    """The temporal constants of an H3 video VAE (defaults: H3's own, clip 17 frames, 3 dropped
    tokens, 4x time)."""

    clip_length: int = 17
    token_drop: int = 3
    vae_ratio_t: int = 4

    def __post_init__(self) -> None:
        for name in ("clip_length", "vae_ratio_t"):
            if getattr(self, name) < 1:
                raise ValueError(f"VaeGeometry.{name}={getattr(self, name)} must be >= 1")
        if self.token_drop < 0:
            raise ValueError(f"VaeGeometry.token_drop={self.token_drop} must be >= 0")

    @classmethod
    def from_model(cls, model: Any) -> VaeGeometry:
        """Read the constants from a live ``MiniMaxH3VideoVAE`` (or anything with the same
        attributes)."""
        return cls(int(model.clip_length), int(model.token_drop), int(model.vae_ratio_t))

    @property
    def frame_pre_padding(self) -> int:
        """Leading raw frames of every part that are causal padding and never written."""
        return (-self.clip_length) % self.vae_ratio_t

    @property
    def tokens_chunk_size(self) -> int:
        return math.ceil(self.clip_length / self.vae_ratio_t)

    @property
    def token_overlap(self) -> int:
        return (-self.token_drop) % self.tokens_chunk_size

    @property
    def frame_overlap(self) -> int:
        """Frames over which a chunk's tail is blended into the next chunk's head."""
        return max(self.token_overlap * self.vae_ratio_t - self.frame_pre_padding, 0)

    @property
    def part_frames(self) -> int:
        """Raw frames per part (head or tail) before the pre-padding cut."""
        return self.tokens_chunk_size * self.vae_ratio_t

    @property
    def parts_per_chunk(self) -> int:
        """2 (head + tail) when tokens are dropped between clips, else 1."""
        return 2 if self.token_drop > 0 else 1

    @property
    def span_tokens(self) -> int:
        return self.tokens_chunk_size + self.token_overlap


H3_GEOMETRY = VaeGeometry()


@dataclass(frozen=True)
class ChunkPlan:
    """How a latent of ``T`` frames decodes: pad, chunk spans (on the padded latent), output frame
    count."""

    T: int
    pad_tokens: int
    spans: tuple[tuple[int, int], ...]
    output_frames: int
    geometry: VaeGeometry

    @property
    def num_chunks(self) -> int:
        return len(self.spans)

    @property
    def padded_len(self) -> int:
        return self.T + self.pad_tokens

    def raw_frames(self, i: int) -> int:
        """Raw decoder frames of chunk ``i`` (tokens x temporal ratio)."""
        a, b = self.spans[i]
        return (b - a) * self.geometry.vae_ratio_t


def chunk_counts(T: int, geo: VaeGeometry = H3_GEOMETRY) -> tuple[int, int]:
    """``(pad_tokens, num_chunks)`` for a latent of ``T`` frames (T >= 2 takes the temporal
    path)."""
    if T < 1:
        raise ValueError(f"latent length T={T} must be >= 1")
    c = geo.tokens_chunk_size
    # Count as if the dropped tokens were still there, round up to whole chunks, then take the
    # dropped ones away.
    with_dropped = T + geo.token_drop
    pad = -with_dropped % c
    chunks = (with_dropped + pad) // c - (1 if geo.token_drop > 0 else 0)
    if chunks < 1:  # too short for one chunk: pad a whole extra chunk
        pad += c
        chunks = 1
    return pad, chunks


def _pad_frames(T: int, pad_tokens: int, geo: VaeGeometry) -> int:
    """Output frames that the padding tokens produce (dropped by the write cap)."""
    tail = geo.clip_length % geo.vae_ratio_t
    if tail == 0:
        return pad_tokens * geo.vae_ratio_t
    # A token that starts a clip covers ``tail`` frames, every other one a full temporal ratio.
    return sum(
        tail if (T + k) % geo.tokens_chunk_size == 0 else geo.vae_ratio_t for k in range(pad_tokens)
    )


def _part_lengths(raw: int, geo: VaeGeometry) -> list[int]:
    """Frames of each part of a chunk with ``raw`` decoded frames, after the pre-padding cut."""
    out = []
    for j in range(geo.parts_per_chunk):
        lo = j * geo.part_frames
        hi = min(lo + geo.part_frames, raw)
        out.append(max(0, hi - lo - geo.frame_pre_padding))
    return out


def make_plan(T: int, geo: VaeGeometry = H3_GEOMETRY) -> ChunkPlan:
    """The temporal plan of a latent with ``T`` frames (``T >= 2``; T = 1 never takes the temporal
    path)."""
    if T < 2:
        raise ValueError(
            f"latent length T={T}: the temporal chunk plan needs T >= 2 (T=1 decodes as one image)"
        )
    pad, n = chunk_counts(T, geo)
    padded = T + pad
    spans = tuple(
        (geo.tokens_chunk_size * i, min(geo.tokens_chunk_size * i + geo.span_tokens, padded))
        for i in range(n)
    )
    frames = 0
    last_tail = 0
    for a, b in spans:
        parts = _part_lengths(max(0, b - a) * geo.vae_ratio_t, geo)
        frames += parts[0]
        if len(parts) > 1:
            last_tail = parts[1]
    frames += last_tail
    return ChunkPlan(T, pad, spans, frames - _pad_frames(T, pad, geo), geo)


def pad_latent(z: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``z`` with its last frame repeated ``plan.pad_tokens`` times along T (dim 2)."""
    if plan.pad_tokens <= 0:
        return z
    return torch.cat([z, z[:, :, -1:].repeat(1, 1, plan.pad_tokens, 1, 1)], dim=2)


def deal(num_chunks: int, ranks: int) -> list[int]:
    """Owner rank of every chunk: round robin (chunk i to rank i mod ranks), so ranks get equal
    counts +-1."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    return [i % ranks for i in range(num_chunks)]


# -- the ordered part ------------------------------------------------------------------------------
def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Linear cross-fade of ``a``'s last frames into ``b``'s first along ``dim``; returns the
    blended ``b``.

    The ramp is built in ``b``'s dtype on ``b``'s device and the products are taken in that dtype:
    the rounding of e.g. 0.2 in fp16 is part of the result.
    """
    e = min(a.shape[dim], b.shape[dim], extent)
    ramp = torch.arange(e, device=b.device, dtype=b.dtype) / e
    shape = [1] * a.ndim
    shape[dim] = e
    ramp = ramp.view(shape)
    mixed = a.narrow(dim, a.shape[dim] - e, e) * (1 - ramp) + b.narrow(dim, 0, e) * ramp
    if e < b.shape[dim]:
        return torch.cat([mixed, b.narrow(dim, e, b.shape[dim] - e)], dim=dim)
    return mixed


def finalize(part: torch.Tensor, pixel_mean: torch.Tensor, pixel_std: torch.Tensor) -> torch.Tensor:
    """Raw decoder frames -> float32 pixels in [0, 1] (the constants are taken in float32, whatever
    their dtype)."""
    out = part * pixel_std.to(device=part.device, dtype=torch.float32)
    return out.add_(pixel_mean.to(device=part.device, dtype=torch.float32)).clamp_(0.0, 1.0)


class Assembler:
    """Takes the raw chunk outputs in chunk order and writes the finished video into ``out`` ([B, C,
    F, H, W]).

    ``blend_fn(a, b, extent, dim)`` and ``finalize_fn(part)`` do the math (the VAE's own methods
    under ComfyUI). ``parts_written`` records ``[start, stop, part_frames]`` per written part, as
    the golden plans do.
    """

    def __init__(
        self, plan: ChunkPlan, out: torch.Tensor, blend_fn: BlendFn, finalize_fn: FinalizeFn
    ) -> None:
        if out.shape[2] != plan.output_frames:
            raise ValueError(
                f"output buffer has {out.shape[2]} frames but the plan writes {plan.output_frames}"
            )
        self.plan = plan
        self.out = out
        self._blend = blend_fn
        self._finalize = finalize_fn
        self._tail: torch.Tensor | None = None
        self._pos = 0
        self.next_chunk = 0
        self.parts_written: list[list[int]] = []

    def _write(self, part: torch.Tensor) -> None:
        n = part.shape[2]
        if n <= 0:
            return
        pixels = self._finalize(part)
        k = min(n, max(0, self.out.shape[2] - self._pos))
        if k > 0:
            self.out[:, :, self._pos : self._pos + k].copy_(pixels[:, :, :k])
        self.parts_written.append([self._pos, self._pos + k, n])
        self._pos += k

    def add(self, raw: torch.Tensor) -> None:
        """Feed the next chunk's raw decoder output (all of its frames, decoder dtype)."""
        i = self.next_chunk
        if i >= self.plan.num_chunks:
            raise ValueError(
                f"the plan has {self.plan.num_chunks} chunks; chunk {i} is one too many"
            )
        if raw.shape[2] != self.plan.raw_frames(i):
            raise ValueError(
                f"chunk {i} has {raw.shape[2]} raw frames; the plan expects "
                f"{self.plan.raw_frames(i)}"
            )
        geo = self.plan.geometry
        for j in range(geo.parts_per_chunk):
            lo = j * geo.part_frames
            hi = min(lo + geo.part_frames, raw.shape[2])
            part = raw[:, :, lo:hi][:, :, geo.frame_pre_padding :]
            if j == 0:
                if self._tail is not None:
                    part = self._blend(self._tail, part, geo.frame_overlap, -3)
                    self._tail = None
                self._write(part)
            else:
                self._tail = part.contiguous()
        self.next_chunk += 1
        if self.next_chunk == self.plan.num_chunks and self._tail is not None:
            self._write(self._tail)
            self._tail = None

    @property
    def done(self) -> bool:
        return self.next_chunk == self.plan.num_chunks
