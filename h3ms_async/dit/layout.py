"""Packed token layouts of the H3 DiT: which rows are text, keyframe conditions, audio and video,
and what each row's modulation row, timestep value and 3-D position are.

Packed order (``docs/comfyui_facts.md`` §1.4): ``[text | cond (+cond_audio) per keyframe | audio |
video]``.  Modulation rows are ``t_row*3 + tag`` with tag 0 = video modality (video, cond), 1 =
text, 2 = audio modality (audio, cond_audio); text tag runs split the text span.  Timestep values
per kind: text = video = t_v, audio = t_a, cond = max(t_v, 0.999), cond_audio = max(t_a, 1.0), with
t_v = 1 - sigma and t_a = 1 - shift(sigma, 12 → 3) in float64 as the newest ComfyUI computes them.

Positions (t, h, w) reproduce the golden file's ``PackedLayout.position_ids`` for its case (7 text
rows, one keyframe, a 4x6 token grid, 5 latent frames, 10 audio frames): text rows sit at (i, 0, 0);
the spatial grid has step ``32/sqrt(hp*wp)`` with index ``n//2`` at 16; a latent frame k sits at
``text_len + first_pixel_frame(k)*5/3`` (24 fps video on a 40 Hz audio-frame clock, 4 pixel frames
per latent after the first); audio frame j of channel c sits at ``(text_len + j, 0, w_min or
w_max)``.  Odd grid sizes and ``cond_audio`` positions are not covered by a golden file; they follow
the same rules by assumption.  The blocks only consume the rope table made from these, so a layout
used for benchmarks needs the right *sizes* more than the right positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
KIND_TAG = {
    "text": TAG_TEXT,
    "cond": TAG_VIDEO,
    "cond_audio": TAG_AUDIO,
    "audio": TAG_AUDIO,
    "video": TAG_VIDEO,
}

VISUAL_COND_AUG = 0.999
AUDIO_COND_AUG = 1.0
SHIFT_VIDEO, SHIFT_AUDIO = 12.0, 3.0
AUDIO_FRAMES_PER_VIDEO_FRAME = 5.0 / 3.0  # 40 Hz audio latents per 24 fps pixel frame
GRID_CENTER, GRID_EXTENT = 16.0, 32.0


@dataclass(frozen=True)
class Layout:
    """A packed H3 token layout (see the module docstring for the conventions)."""

    segments: list[tuple[int, int, str]]
    seq_len: int
    position_ids: torch.Tensor = field(repr=False)  # [S, 3] float64 (t, h, w)
    mod_segments: list[tuple[int, int, int]]
    t_values: list[float]
    # (text_len, frames, height_tokens, width_tokens, audio_frames)
    signature: tuple[int, int, int, int, int]

    @property
    def rows(self) -> int:
        """Number of modulation rows the adaln output must have: 3 per distinct timestep value."""
        return 3 * len(self.t_values)


def time_shift_sigma(sigma: float, shift_from: float, shift_to: float) -> float:
    """Re-shift a sigma from one flow shift to another (ComfyUI's ``time_shift_sigma``), in
    float64."""
    base = sigma / (shift_from + sigma * (1.0 - shift_from))
    return shift_to * base / (1.0 + (shift_to - 1.0) * base)


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _axis(n: int, step: float) -> list[float]:
    offset = GRID_CENTER - (n // 2) * step
    return [i * step + offset for i in range(n)]


def _frame_time(text_len: int, latent_frame: int) -> float:
    first_pixel = 0 if latent_frame == 0 else 4 * latent_frame - 3
    return text_len + first_pixel * AUDIO_FRAMES_PER_VIDEO_FRAME


def _text_runs(
    text_len: int, text_tags: Sequence[int] | torch.Tensor | None
) -> list[tuple[int, int, int]]:
    if text_tags is None:
        return [(0, text_len, TAG_TEXT)]
    tags = [
        int(t) for t in (text_tags.tolist() if isinstance(text_tags, torch.Tensor) else text_tags)
    ]
    if len(tags) != text_len:
        raise ValueError(
            f"text_tags has {len(tags)} entries for text_len {text_len}; give one tag per text "
            "token"
        )
    if any(t not in (TAG_VIDEO, TAG_TEXT, TAG_AUDIO) for t in tags):
        raise ValueError(
            f"text_tags must hold 0 (vision pad), 1 (text) or 2 (audio), got {sorted(set(tags))}"
        )
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, text_len + 1):
        if i == text_len or tags[i] != tags[start]:
            runs.append((start, i, tags[start]))
            start = i
    return runs


def build_layout(
    text_len: int,
    frames: int,
    height_tokens: int,
    width_tokens: int,
    audio_frames: int,
    *,
    keyframes: int | Sequence[int] = 0,
    keyframe_audio_frames: int = 0,
    text_tags: Sequence[int] | torch.Tensor | None = None,
    sigma: float = 0.7,
) -> Layout:
    """Build the packed layout of one H3 forward.

    ``frames`` latent frames of ``height_tokens x width_tokens`` tokens (the 2x2-patched latent
    grid), ``audio_frames`` audio latent frames (2 channels, so 2·audio_frames rows).  ``keyframes``
    is a count (spread evenly over the latent frames, the first at frame 0) or the list of latent
    frame indices; each adds one frame of ``cond`` rows and, when ``keyframe_audio_frames`` > 0,
    ``2·keyframe_audio_frames`` ``cond_audio`` rows.  ``text_tags`` gives one modality tag per text
    token.  ``sigma`` (0 < sigma <= 1) sets the timestep values.
    """
    text_len = _positive_int(text_len, "text_len")
    frames = _positive_int(frames, "frames")
    hp = _positive_int(height_tokens, "height_tokens")
    wp = _positive_int(width_tokens, "width_tokens")
    audio_frames = _positive_int(audio_frames, "audio_frames")
    keyframe_audio_frames = _positive_int(keyframe_audio_frames, "keyframe_audio_frames", 0)
    if not (0.0 < float(sigma) <= 1.0):
        raise ValueError(f"sigma must be in (0, 1], got {sigma}")
    if isinstance(keyframes, int):
        count = _positive_int(keyframes, "keyframes", 0)
        if count > frames:
            raise ValueError(
                f"keyframes={count} but there are only {frames} latent frames; use at most {frames}"
            )
        key_idx = (
            [0]
            if count == 1
            else [round(j * (frames - 1) / (count - 1)) for j in range(count)]
            if count
            else []
        )
    else:
        key_idx = [int(k) for k in keyframes]
        bad = [k for k in key_idx if not 0 <= k < frames]
        if bad:
            raise ValueError(
                f"keyframes {bad} are outside the {frames} latent frames (0..{frames - 1})"
            )

    sigma = float(sigma)
    t_v = 1.0 - sigma
    t_a = 1.0 - time_shift_sigma(sigma, SHIFT_VIDEO, SHIFT_AUDIO)
    seg_t = {
        "text": t_v,
        "video": t_v,
        "audio": t_a,
        "cond": max(t_v, VISUAL_COND_AUG),
        "cond_audio": max(t_a, AUDIO_COND_AUG),
    }

    step = GRID_EXTENT / math.sqrt(hp * wp)
    hs, ws = _axis(hp, step), _axis(wp, step)
    grid_hw = torch.tensor([[h, w] for h in hs for w in ws], dtype=torch.float64)
    w_edges = (ws[0], ws[-1])

    segments: list[tuple[int, int, str]] = []
    pos_parts: list[torch.Tensor] = []
    cursor = 0

    def add(kind: str, pos: torch.Tensor) -> None:
        nonlocal cursor
        segments.append((cursor, cursor + pos.shape[0], kind))
        pos_parts.append(pos)
        cursor += pos.shape[0]

    def frame_rows(latent_frame: int) -> torch.Tensor:
        t = torch.full((hp * wp, 1), _frame_time(text_len, latent_frame), dtype=torch.float64)
        return torch.cat([t, grid_hw], dim=1)

    def audio_rows(t0: float, n: int) -> torch.Tensor:
        t = torch.tensor([t0 + j for j in range(n)], dtype=torch.float64)
        rows = [
            torch.stack(
                [t, torch.zeros(n, dtype=torch.float64), torch.full((n,), w, dtype=torch.float64)],
                1,
            )
            for w in w_edges
        ]
        return torch.cat(rows)  # channel-major, as the target audio

    text_pos = torch.zeros(text_len, 3, dtype=torch.float64)
    text_pos[:, 0] = torch.arange(text_len, dtype=torch.float64)
    add("text", text_pos)
    for k in key_idx:
        add("cond", frame_rows(k))
        if keyframe_audio_frames:
            add("cond_audio", audio_rows(_frame_time(text_len, k), keyframe_audio_frames))
    add("audio", audio_rows(float(text_len), audio_frames))
    add("video", torch.cat([frame_rows(f) for f in range(frames)]))

    t_values = sorted({seg_t[kind] for _, _, kind in segments})
    t_row = {t: i for i, t in enumerate(t_values)}
    mod_segments: list[tuple[int, int, int]] = []
    for a, b, kind in segments:
        base = t_row[seg_t[kind]] * 3
        if kind == "text":
            mod_segments.extend(
                (a + ra, a + rb, base + tag) for ra, rb, tag in _text_runs(text_len, text_tags)
            )
        else:
            mod_segments.append((a, b, base + KIND_TAG[kind]))

    return Layout(
        segments=segments,
        seq_len=cursor,
        position_ids=torch.cat(pos_parts),
        mod_segments=mod_segments,
        t_values=t_values,
        signature=(text_len, frames, hp, wp, audio_frames),
    )


# Token grids (height x width tokens = pixels / 32) of common H3 output sizes, largest first.
_GRIDS = ((40, 23), (36, 20), (30, 17), (26, 15), (24, 14), (20, 12), (16, 9))
_TEXT_RANGE = (128, 512)


def _audio_frames_for(frames: int) -> int:
    pixel_frames = 4 * (frames - 1) + 1
    return math.ceil(pixel_frames * AUDIO_FRAMES_PER_VIDEO_FRAME)


def layout_for_tokens(total_tokens: int, *, sigma: float = 0.7) -> Layout:
    """A realistic text+audio+video layout of exactly ``total_tokens`` rows (e.g. 39975, 75794).

    Picks the largest common token grid and the most latent frames whose video + audio rows leave
    between 128 and 512 text tokens; the text length absorbs the remainder, so the total is exact.
    Audio length follows the video duration (40 Hz audio latents, 24 fps video).
    """
    total = _positive_int(total_tokens, "total_tokens")
    for hp, wp in _GRIDS:
        per_frame = hp * wp
        for frames in range(total // per_frame, 0, -1):
            audio = _audio_frames_for(frames)
            text = total - frames * per_frame - 2 * audio
            if _TEXT_RANGE[0] <= text <= _TEXT_RANGE[1]:
                return build_layout(text, frames, hp, wp, audio, sigma=sigma)
            if text > _TEXT_RANGE[1]:
                break
    raise ValueError(
        f"total_tokens={total} is too small for a realistic layout (need at least a few thousand "
        "tokens); use build_layout for tiny sequences"
    )
