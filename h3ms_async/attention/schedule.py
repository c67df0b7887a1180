"""The schedule H3 Attention Parallel runs, as a time model, and the head split that minimises it.

One call, as ``h3ms_async.attention.engine`` runs it (docs/attention_parallel.md):

* the model GPU stages the helpers' slices one after another, in helper order, over its own link (``stage``);
* helper r is dispatched the moment its own slice is staged: it copies the slice in over its link (``helper_in``),
  attends its heads, and copies the result out (``helper_out``);
* each result comes back into the model GPU as soon as its helper is done, one at a time over the model GPU's link
  (``ret``), overlapped with the other helpers' compute;
* meanwhile the model GPU attends its own heads, which pay no transfer.

Every cost is a measured quantity: seconds per head of attention on each device and seconds per byte on each leg
(a leg that does not exist for a transport, e.g. a helper reading a slice in place, costs 0).  Heads are independent,
so every split gives the same bits; the split only moves time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from h3ms_async.runtime import plans


@dataclass(frozen=True)
class Legs:
    """Seconds per byte of each transfer leg of one call (0 where a transport has no such leg)."""

    stage: float
    helper_in: float
    helper_out: float
    ret: float


def critical_path(sizes: Sequence[int], per_head_s: Sequence[float], in_per_head: float, out_per_head: float,
                  legs: Legs) -> dict:
    """Predicted seconds of one call with ``sizes[r]`` heads on device r (0 = the model GPU): the model GPU's own
    heads, and per helper when its slice is staged, when it is done and when its result is back."""
    staged, done = [], []
    t = 0.0
    for h, c in zip(sizes[1:], per_head_s[1:]):
        t += h * in_per_head * legs.stage
        staged.append(t)
        done.append(t + h * in_per_head * legs.helper_in + h * c + h * out_per_head * legs.helper_out)
    back, t = [0.0] * len(done), 0.0
    for r in sorted(range(len(done)), key=done.__getitem__):  # returns are serial, in completion order
        t = max(t, done[r]) + sizes[r + 1] * out_per_head * legs.ret
        back[r] = t
    local = sizes[0] * per_head_s[0]
    return {"heads": list(sizes), "local_s": local, "staged_s": staged, "helper_done_s": done, "back_s": back,
            "total_s": max([local] + back)}


def best_split(heads: int, per_head_s: Sequence[float], helper_shares: Sequence[float], in_per_head: float,
               out_per_head: float, legs: Legs) -> dict:
    """The split with the shortest :func:`critical_path`: every model-GPU head count from 1 up, the rest shared by
    the helpers in proportion to ``helper_shares`` (largest remainder, at least one head each).  Ties keep the
    larger helper share (fewer heads on the model GPU)."""
    n = len(per_head_s)
    best: dict | None = None
    for h0 in range(1, heads - (n - 1) + 1):
        bounds = plans.partition(heads - h0, helper_shares, "attention heads")
        sizes = [h0] + [b - a for a, b in zip(bounds, bounds[1:])]
        pred = critical_path(sizes, per_head_s, in_per_head, out_per_head, legs)
        if best is None or pred["total_s"] < best["total_s"]:
            best = pred
    assert best is not None  # heads >= n: the loop ran at least once
    return best
