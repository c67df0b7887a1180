"""The record checks of the parity tests' split proof (``tests/split_proof.py``): each accepts a record of a whole
split and names what is wrong with one that is not (a rank with nothing, a gap, parts past the whole, other ranks, a
decode that left no record of its own). The proof itself runs inside ComfyUI in every parity test."""
from __future__ import annotations

import msgspec
import pytest
from split_proof import (
    attention_call_failure,
    dit_step_failure,
    tiling_failure,
    vae_decode_failure,
    vae_decodes_failure,
)

from h3ms_async.status.records import RankRecord, StepRecord
from workers.dit.protocol import BlockTiming

pytestmark = pytest.mark.fast

CPU2 = ["cpu", "cpu"]


def step(tokens: list[list[int]], heads: list[list[int]], devices: list[str] = CPU2) -> dict:
    """A step record's JSON form, as the split engine records it."""
    ranks = [RankRecord(rank=r, device=d, tokens=t, heads=h, compute_s=0.1, exchange_s=0.0, wait_s=0.0,
                        moved_bytes=1, vram_peak_bytes=None,
                        per_block=[BlockTiming(compute_s=0.05, copy_s=0.0, hidden_s=0.0, exposed_s=0.0)] * 2)
             for r, (d, t, h) in enumerate(zip(devices, tokens, heads))]
    rec = StepRecord(at="now", seq=7, sigma=1.0, tokens=tokens[-1][1], blocks=2, devices=devices, exchange="host",
                     chunks=1, wall_s=0.2, moved_bytes=2, weight_store="warm", ranks=ranks)
    return msgspec.to_builtins(rec)


def test_tiling():
    assert tiling_failure([[0, 3], [3, 5]], 5, "tokens") is None
    assert "rank 1 computed no tokens" in tiling_failure([[0, 5], [5, 5]], 5, "tokens")
    assert "rank 1's heads start at 3, not 2" in tiling_failure([[0, 2], [3, 4]], 4, "heads")
    assert "end at 4, not at 5" in tiling_failure([[0, 2], [2, 4]], 5, "tokens")


def test_dit_step():
    good = step([[0, 16], [16, 33]], [[0, 2], [2, 4]])
    assert dit_step_failure(good, CPU2, tokens=33, heads=4, blocks=2) is None
    assert "has 33 tokens, the model call 40" in dit_step_failure(good, CPU2, tokens=40)
    assert "has 2 blocks, the model call 3" in dit_step_failure(good, CPU2, blocks=3)
    assert "ran on ['cpu', 'cpu'], expected ['cpu', 'cpu', 'cpu']" in dit_step_failure(good, ["cpu"] * 3)
    assert "end at 4, not at 8" in dit_step_failure(good, CPU2, heads=8)
    assert "rank 1 computed no heads" in dit_step_failure(step([[0, 16], [16, 33]], [[0, 4], [4, 4]]), CPU2)
    assert "rank 0 computed no tokens" in dit_step_failure(step([[0, 0], [0, 33]], [[0, 2], [2, 4]]), CPU2)


def test_attention_call():
    call = {"call": 3, "tokens": 34, "heads": 8, "ranks": [{"rank": 0, "device": "cpu", "heads": [0, 4]},
                                                            {"rank": 1, "device": "cpu", "heads": [4, 8]}]}
    assert attention_call_failure(call, CPU2, tokens=34, heads=8) is None
    assert "has 8 heads, the model's attention call 16" in attention_call_failure(call, CPU2, heads=16)
    assert "ran on ranks [(0, 'cpu'), (1, 'cpu')], expected [(0, 'cuda:0')" in attention_call_failure(
        call, ["cuda:0", "cuda:0"])
    call["ranks"][1]["heads"] = [4, 7]
    assert "end at 7, not at 8" in attention_call_failure(call, CPU2)


def decode(owners: list[int], ranks: int, job: int = 1, dropped: list[int] | None = None) -> dict:
    """A VAE decode record's JSON form, as the VAE split engine records it (chunk i decoded by ``owners[i]``)."""
    return {"job": job, "chunks": len(owners), "devices": ["cpu"] * ranks, "dropped_ranks": dropped or [],
            "chunks_per_rank": [owners.count(r) for r in range(ranks)],
            "per_chunk": [{"index": i, "rank": r, **({"bytes": 64} if r else {})} for i, r in enumerate(owners)]}


def test_vae_decode():
    assert vae_decode_failure(decode([0, 1, 2, 0], 3), ["cpu"] * 3) is None
    assert vae_decode_failure(decode([0, 1, 2], 4), ["cpu"] * 4) is None  # 3 chunks: rank 3 has none to decode
    assert vae_decode_failure(decode([0, 2, 0], 3, dropped=[1]), ["cpu"] * 3, dropped=[1]) is None
    assert "no VAE decode record" in vae_decode_failure(None, CPU2)
    assert "dropped ranks [1]" in vae_decode_failure(decode([0, 0], 2, dropped=[1]), CPU2)
    assert "ranks [0, 1, 2] should each decode" in vae_decode_failure(decode([0, 1, 0, 1], 3), ["cpu"] * 3)
    dup = decode([0, 1], 2)
    dup["per_chunk"][1]["index"] = 0
    assert "not each of its 2 chunks once" in vae_decode_failure(dup, CPU2)
    empty = decode([0, 1], 2)
    del empty["per_chunk"][1]["bytes"]
    assert "chunks [1] came back from their workers without bytes" in vae_decode_failure(empty, CPU2)


def test_vae_decodes_are_each_their_own():
    first, second = decode([0, 1], 2, job=4), decode([0, 1], 2, job=5)
    assert vae_decodes_failure([first, second], CPU2) is None
    assert "decodes [4, 4], not of 2 consecutive ones" in vae_decodes_failure([first, first], CPU2)
    assert "decode 1: no VAE decode record" in vae_decodes_failure([first, None], CPU2)
