"""Packed layouts: segment order, modulation rows, timestep values, positions, and benchmark-size layouts."""
from __future__ import annotations

import pytest
import torch

from h3ms_async.dit.layout import build_layout, layout_for_tokens, time_shift_sigma
from h3ms_async.dit.reference import rope_table

pytestmark = pytest.mark.fast


def _covers(segs, seq_len) -> bool:
    return segs[0][0] == 0 and segs[-1][1] == seq_len and all(a[1] == b[0] for a, b in zip(segs, segs[1:]))


def test_plain_layout_rows_and_order() -> None:
    lay = build_layout(5, 2, 3, 4, 6, sigma=0.5)
    assert lay.segments == [(0, 5, "text"), (5, 17, "audio"), (17, 41, "video")] and lay.seq_len == 41
    t_v, t_a = 0.5, 1 - time_shift_sigma(0.5, 12.0, 3.0)
    assert lay.t_values == sorted({t_v, t_a})
    rv, ra = lay.t_values.index(t_v) * 3, lay.t_values.index(t_a) * 3
    assert lay.mod_segments == [(0, 5, rv + 1), (5, 17, ra + 2), (17, 41, rv + 0)]
    assert lay.rows == 3 * len(lay.t_values) and lay.signature == (5, 2, 3, 4, 6)
    assert lay.position_ids.dtype == torch.float64 and lay.position_ids.shape == (41, 3)


def test_keyframes_cond_audio_and_text_tags() -> None:
    lay = build_layout(6, 4, 2, 3, 5, keyframes=[0, 3], keyframe_audio_frames=2, text_tags=[1, 0, 0, 2, 1, 1],
                       sigma=0.7)
    kinds = [k for _, _, k in lay.segments]
    assert kinds == ["text", "cond", "cond_audio", "cond", "cond_audio", "audio", "video"]
    assert _covers(lay.segments, lay.seq_len) and _covers(lay.mod_segments, lay.seq_len)
    assert lay.seq_len == 6 + 2 * (6 + 4) + 10 + 24
    t_v, t_a = 1 - 0.7, 1 - time_shift_sigma(0.7, 12.0, 3.0)
    assert lay.t_values == sorted({t_v, t_a, 0.999, 1.0})
    row = {t: i * 3 for i, t in enumerate(lay.t_values)}
    assert lay.mod_segments[:4] == [(0, 1, row[t_v] + 1), (1, 3, row[t_v]), (3, 4, row[t_v] + 2),
                                    (4, 6, row[t_v] + 1)]
    assert lay.mod_segments[4:] == [(6, 12, row[0.999]), (12, 16, row[1.0] + 2), (16, 22, row[0.999]),
                                    (22, 26, row[1.0] + 2), (26, 36, row[t_a] + 2), (36, 60, row[t_v])]
    # A keyframe at latent frame 3 sits at that frame's time.
    assert lay.position_ids[16, 0] == lay.position_ids[36 + 3 * 6, 0]


def test_cond_timesteps_pin_at_high_t() -> None:
    # sigma small: t_v > 0.999 so cond shares the video timestep; audio cond stays pinned at 1.0.
    lay = build_layout(2, 1, 1, 2, 1, keyframes=1, sigma=0.0001)
    assert len(lay.t_values) == 2
    cond = [r for a, b, r in lay.mod_segments][1]
    video = lay.mod_segments[-1][2]
    assert cond == video


def test_keyframe_count_spreads() -> None:
    lay = build_layout(2, 5, 1, 1, 1, keyframes=3)
    cond_t = [lay.position_ids[a, 0].item() for a, _, k in lay.segments if k == "cond"]
    video = lay.segments[-1][0]
    assert cond_t == [lay.position_ids[video + f, 0].item() for f in (0, 2, 4)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(text_len=0), "text_len must be >= 1"),
    (dict(frames=2.5), "frames must be an integer"),
    (dict(height_tokens=-1), "height_tokens must be >= 1"),
    (dict(keyframes=9), "keyframes=9 but there are only 4 latent frames"),
    (dict(keyframes=[0, 4]), "keyframes \\[4\\] are outside"),
    (dict(text_tags=[1, 1]), "text_tags has 2 entries for text_len 3"),
    (dict(text_tags=[1, 5, 1]), "text_tags must hold 0"),
    (dict(sigma=0.0), "sigma must be in"),
    (dict(keyframe_audio_frames=-1), "keyframe_audio_frames must be >= 0"),
])
def test_build_layout_errors(kwargs, match) -> None:
    args = dict(text_len=3, frames=4, height_tokens=2, width_tokens=2, audio_frames=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_layout(**args)


@pytest.mark.parametrize("total", [39975, 75794, 20000])
def test_layout_for_tokens_exact_total(total) -> None:
    lay = layout_for_tokens(total)
    assert lay.seq_len == total and _covers(lay.segments, total)
    text_len, frames, hp, wp, audio = lay.signature
    assert 128 <= text_len <= 512 and frames * hp * wp + 2 * audio + text_len == total
    assert [k for _, _, k in lay.segments] == ["text", "audio", "video"]


def test_layout_for_tokens_too_small() -> None:
    with pytest.raises(ValueError, match="too small"):
        layout_for_tokens(200)


def test_rope_table_shape_and_rotation() -> None:
    lay = build_layout(3, 2, 2, 2, 2)
    table = rope_table(lay.position_ids, 12, torch.float32)
    assert table.shape == (1, lay.seq_len, 1, 12, 2, 2)
    c, s = table[..., 0, 0], table[..., 1, 0]
    assert torch.equal(table[..., 1, 1], c) and torch.equal(table[..., 0, 1], -s)
    assert torch.equal(table[0, 0, 0, :, 0, 0], torch.ones(12))  # token 0 sits at the origin
    with pytest.raises(ValueError, match="multiple of 3"):
        rope_table(lay.position_ids, 10, torch.float32)
