"""The schedule H3 Attention Parallel runs, as a time model, and the head split that minimises it.

One call, as ``h3ms_async.attention.engine`` runs it (docs/attention_parallel.md):

* each helper's heads are cut into pieces of at most ``chunk_heads`` heads (0: one piece per
  helper), and the model GPU stages the pieces one after another over its own link (``stage``),
  round robin over the helpers, so every helper gets its first piece early (:func:`pieces`);
* a piece is dispatched the moment it is staged (one message, ``dispatch_s`` one way); its helper
  copies it in over its own link (``helper_in``), attends its heads and copies the result out
  (``helper_out``) on three streams, so the copy in of piece i+1 and the copy out of piece i overlap
  the attention of the pieces around them;
* each piece's result comes back into the model GPU as soon as its helper answers, one at a time
  over the model GPU's link (``ret``), overlapped with the compute still running;
* meanwhile the model GPU attends its own heads, which pay no transfer; with ``local_after_stage``
  (CUDA IPC, where staging is a copy inside the model GPU that would otherwise queue behind its
  attention) they start once every piece is staged.

Every cost is a measured quantity: seconds per head of attention on each device and seconds per byte
on each leg (a leg that does not exist for a transport, e.g. a helper reading a slice in place,
costs 0).  Heads are independent, so every split gives the same bits; the split and the pieces only
move time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from h3ms_async.runtime import plans


@dataclass(frozen=True)
class Legs:
    """Seconds per byte of each transfer leg of one call (0 where a transport has no such leg)."""

    stage: float
    helper_in: float
    helper_out: float
    ret: float


@dataclass(frozen=True)
class Pipeline:
    """How the pieces of one call overlap: ``chunk_heads`` (0 = one piece per helper), whether the
    model GPU's own heads wait for the staging (``local_after_stage``), and one message's one-way
    latency in seconds."""

    chunk_heads: int = 0
    local_after_stage: bool = False
    dispatch_s: float = 0.0


def pieces(bounds: Sequence[int], chunk_heads: int) -> list[tuple[int, int, int]]:
    """``(helper, h0, h1)`` of every piece, in the order the model GPU stages them: helper r's range
    ``[bounds[r], bounds[r + 1])`` cut into the fewest near-equal pieces of at most ``chunk_heads``
    heads (0: whole), taken round robin over the helpers (rank 0, the model GPU, stages nothing)."""
    cut: list[list[tuple[int, int, int]]] = []
    for r in range(1, len(bounds) - 1):
        a, h = bounds[r], bounds[r + 1] - bounds[r]
        n = -(-h // chunk_heads) if chunk_heads > 0 else 1
        mine = []
        for i in range(n):
            size = h // n + (1 if i < h % n else 0)
            mine.append((r, a, a + size))
            a += size
        cut.append(mine)
    return [p[i] for i in range(max((len(p) for p in cut), default=0)) for p in cut if i < len(p)]


def critical_path(
    sizes: Sequence[int],
    per_head_s: Sequence[float],
    in_per_head: float,
    out_per_head: float,
    legs: Legs,
    pipeline: Pipeline = Pipeline(),
) -> dict:
    """Predicted seconds of one call with ``sizes[r]`` heads on device r (0 = the model GPU): the
    model GPU's own heads, and per helper when its last piece is staged, when it is done and when
    its last result is back."""
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    n = len(sizes)
    free_in, free_compute, free_out = [0.0] * n, [0.0] * n, [0.0] * n
    staged, done, back = [0.0] * (n - 1), [0.0] * (n - 1), [0.0] * (n - 1)
    finished: list[tuple[float, int, int]] = []
    t = 0.0
    for r, h0, h1 in pieces(bounds, pipeline.chunk_heads):
        h = h1 - h0
        t += h * in_per_head * legs.stage
        staged[r - 1] = t
        free_in[r] = max(t + pipeline.dispatch_s, free_in[r]) + h * in_per_head * legs.helper_in
        free_compute[r] = max(free_in[r], free_compute[r]) + h * per_head_s[r]
        free_out[r] = max(free_compute[r], free_out[r]) + h * out_per_head * legs.helper_out
        done[r - 1] = free_out[r]
        finished.append((free_out[r] + pipeline.dispatch_s, r, h))
    link = 0.0
    for answered, r, h in sorted(finished, key=lambda f: (f[0], f[1])):
        # returns are serial, in answer order
        link = max(link, answered) + h * out_per_head * legs.ret
        back[r - 1] = link
    local = (t if pipeline.local_after_stage else 0.0) + sizes[0] * per_head_s[0]
    return {
        "heads": list(sizes),
        "chunk_heads": pipeline.chunk_heads,
        "local_s": local,
        "staged_s": staged,
        "helper_done_s": done,
        "back_s": back,
        "total_s": max([local, *back]),
    }


def best_split(
    heads: int,
    per_head_s: Sequence[float],
    helper_shares: Sequence[float],
    in_per_head: float,
    out_per_head: float,
    legs: Legs,
    pipeline: Pipeline = Pipeline(),
) -> dict:
    """The split with the shortest :func:`critical_path`: every model-GPU head count from 1 up, the
    rest shared by the helpers in proportion to ``helper_shares`` (largest remainder, at least one
    head each).  Ties keep the larger helper share (fewer heads on the model GPU)."""
    n = len(per_head_s)
    best: dict | None = None
    for h0 in range(1, heads - (n - 1) + 1):
        bounds = plans.partition(heads - h0, helper_shares, "attention heads")
        sizes = [h0, *(b - a for a, b in itertools.pairwise(bounds))]
        pred = critical_path(sizes, per_head_s, in_per_head, out_per_head, legs, pipeline)
        if best is None or pred["total_s"] < best["total_s"]:
            best = pred
    assert best is not None  # heads >= n: the loop ran at least once
    return best
