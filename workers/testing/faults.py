"""Faults the tests inject into the rank programs' compute: a call shape that rounds differently
(:class:`ShapeFault`, ``H3MS_TEST_SHAPE_FAULT``), a block's adaLN rows one unit off
(``H3MS_TEST_MODULATION_FAULT``), a VAE worker that dies mid-chunk or decodes one
unit off (``H3MS_TEST_VAE_CRASH_FILE``, ``H3MS_TEST_VAE_SKEW_RANK``,
``H3MS_TEST_VAE_COLD_SKEW_RANK``).  ``workers/dit/ops.py``, ``workers/dit/rank.py`` and
``workers/vae/rank.py`` take them from here at import, only with ``H3MS_TEST_HOOKS=1``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.testing import settings


@dataclass(frozen=True)
class ShapeFault:
    """One call shape rounds differently on purpose, as a kernel library that picks another kernel
    for it would.  ``kind`` "linear" matches ``(rows, in_features)`` or ``(rows, in_features,
    out_features)``, "attention" (dense attention) and "sparse" (the sparse kernel,
    ``workers.dit.sparse``) match ``(heads,)``; ``steps_only``: the invariance probe
    (:func:`probing`) does not see it, a difference only ``verify`` can catch.

    Text form (``H3MS_TEST_SHAPE_FAULT``): ``linear:ROWS:IN_FEATURES[:OUT_FEATURES]``,
    ``attention:HEADS`` or ``sparse:HEADS``, ``:step`` appended for ``steps_only``.
    """

    kind: str
    shape: tuple[int, ...]
    steps_only: bool = False

    @classmethod
    def parse(cls, raw: str) -> ShapeFault:
        parts = raw.strip().split(":")
        steps_only = parts[-1] == "step"
        if steps_only:
            parts = parts[:-1]
        arities = {"linear": (2, 3), "attention": (1,), "sparse": (1,)}.get(parts[0])
        if (
            arities is None
            or len(parts) - 1 not in arities
            or not all(p.isdigit() and int(p) > 0 for p in parts[1:])
        ):
            raise ValueError(
                "is not linear:ROWS:IN_FEATURES[:OUT_FEATURES], attention:HEADS or sparse:HEADS "
                "(optionally followed by :step)"
            )
        return cls(parts[0], tuple(int(p) for p in parts[1:]), steps_only)

    def apply(self, kind: str, shape: tuple[int, ...], out: torch.Tensor, probing: bool) -> None:
        """Move ``out``'s first row one unit in the last place up, in place, when this call is the
        faulty one: the smallest difference a kernel could make, so any tolerance is caught."""
        same = tuple(shape[: len(self.shape)]) == self.shape
        if kind == self.kind and same and not (self.steps_only and probing):
            row = out[0]
            row.copy_(torch.nextafter(row, torch.full_like(row, float("inf"))))


def vae_crash(ctx: Any) -> None:
    """Before a VAE chunk: die when the crash file exists (deleting it, so only one worker dies)."""
    path = settings.TEST_VAE_CRASH_FILE.get()
    if not path:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    ctx.log.warning("test hook: dying in the middle of a chunk")
    for h in ctx.log.handlers + logging.getLogger().handlers:
        h.flush()
    os._exit(7)


def vae_skew(ctx: Any, raw: torch.Tensor) -> None:
    """On a decoded VAE chunk of the skewed rank (every chunk) or the cold-skewed rank (its first
    chunk only): one unit in the last place on every value, a decode that differs from rank 0's
    (VAE rank = pool rank + 1)."""
    rank = ctx.rank + 1
    cold = settings.TEST_VAE_COLD_SKEW_RANK.get() == rank and not ctx.state.get("cold_skewed")
    if cold or settings.TEST_VAE_SKEW_RANK.get() == rank:
        ctx.state["cold_skewed"] = True
        raw.copy_(torch.nextafter(raw, torch.full_like(raw, float("inf"))))


def shape_fault_from_env() -> ShapeFault | None:
    """The shape fault ``H3MS_TEST_SHAPE_FAULT`` names (None when unset)."""
    return settings.TEST_SHAPE_FAULT.get(ShapeFault.parse) or None


def modulation_fault_from_env() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The modulation fault ``H3MS_TEST_MODULATION_FAULT`` names (None when unset): a copy of the
    step's adaLN rows ``[blocks, M, 18·hidden]`` with every value of that block one unit in the
    last place up (the staged rows stay as the owner wrote them)."""
    block = settings.TEST_MODULATION_FAULT.get()
    if block < 0:
        return None

    def fault(rows: torch.Tensor) -> torch.Tensor:
        if block >= rows.shape[0]:
            return rows
        out = rows.clone()
        out[block] = torch.nextafter(out[block], torch.full_like(out[block], float("inf")))
        return out

    return fault
