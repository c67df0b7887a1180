"""Which overlaps a plan runs with when the engine picks them (``SplitOptions.overlap_tuning``).

The probe decides which overlaps are exact on a plan (``h3ms_async.dit.exactness``); whether they
pay depends on the machine: on a GPU they hide exchange copies behind compute, on a CPU the same
cores do both and the pieces only add calls.  So the engine measures: the first step of a plan runs
without overlaps (its time holds the plan's one-off costs and is not compared), then each exact
combination runs one step, and every later step of that plan runs the fastest.  Every combination
is exact, so the steps that measure cost time, never bits.  Measurements live as long as the engine
(its workers): a new prompt with the same plan runs the fastest at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from h3ms_async.dit.exactness import NO_OVERLAP, Overlap

#: The overlaps the node's ``overlaps`` input "auto" offers the engine: attention in 8 head pieces,
#: the gather overlap and the cross-block overlap in 8 row pieces.  The speed model, validated
#: within 1 % on an H100 with 8 and with 4 pieces, predicts 8 ahead of 4 where the link is slow
#: (PCIe Gen4 at 2 GPUs: +2 % host-staged, +1 % GPU-direct) and level on NVLink, where the tuner
#: keeps none; 8 pieces cost 0.4 % more of a shard's compute than 4 (docs/performance.md).
AUTO_OVERLAP = Overlap(head_pieces=8, gather=True, ahead=8)


class TuningPhase(StrEnum):
    """Where a plan's choice stands, as step records and the panel show it."""

    WARMING = "warming"
    MEASURING = "measuring"
    FASTEST = "fastest"


class OverlapChoice(StrEnum):
    """The node's ``overlaps`` input: let the engine pick (auto), none, or exactly one set."""

    AUTO = "auto"
    OFF = "off"
    HEAD_PIECES = "head pieces"
    GATHER = "gather"
    BOTH = "both"
    AHEAD = "gather ahead"
    ALL = "all"


def overlap_options(choice: str) -> dict:
    """The ``SplitOptions`` fields (head_pieces, gather_overlap, gather_ahead, overlap_tuning) of a
    choice ("both": head pieces and gather; "all": those and gather ahead); ValueError naming the
    input and its values otherwise."""
    try:
        c = OverlapChoice(choice)
    except ValueError:
        values = ", ".join(repr(v.value) for v in OverlapChoice)
        raise ValueError(f"overlaps={choice!r} is not one of {values}") from None
    pieces = AUTO_OVERLAP.head_pieces if c in ("auto", "head pieces", "both", "all") else 0
    return {
        "head_pieces": pieces,
        "gather_overlap": c in ("auto", "gather", "both", "all"),
        "gather_ahead": AUTO_OVERLAP.ahead if c in ("auto", "gather ahead", "all") else 0,
        "overlap_tuning": c is OverlapChoice.AUTO,
    }


def combinations(exact: Overlap) -> list[Overlap]:
    """Every overlap ``exact`` allows, fewest first: none, pieces, gather, both, then each of those
    with gather ahead."""
    pieces = [0, exact.head_pieces] if exact.head_pieces > 1 else [0]
    gathers = [False, True] if exact.gather else [False]
    aheads = [0, exact.ahead] if exact.ahead > 0 else [0]
    return [Overlap(p, g, a) for a in aheads for g in gathers for p in pieces]


@dataclass
class _PlanTrial:
    candidates: list[Overlap]
    seconds_per_block: dict[Overlap, float] = field(default_factory=dict)
    warmed: bool = False

    def next(self) -> tuple[Overlap, TuningPhase]:
        if len(self.candidates) == 1:
            return self.candidates[0], TuningPhase.FASTEST
        if not self.warmed:
            return NO_OVERLAP, TuningPhase.WARMING
        untried = [c for c in self.candidates if c not in self.seconds_per_block]
        if untried:
            return untried[0], TuningPhase.MEASURING
        return min(self.candidates, key=self.seconds_per_block.__getitem__), TuningPhase.FASTEST


@dataclass(frozen=True)
class PlanKey:
    """What decides a step's speed for the tuner: shards, pattern, transport, sparse or dense."""

    token_bounds: tuple[int, ...]
    head_bounds: tuple[int, ...]
    pattern: str
    transport: str
    sparse: bool

    def describe(self) -> str:
        """e.g. ``tokens 0-262-524, heads 0-4-8, gather over host, dense``."""
        tokens = "-".join(map(str, self.token_bounds))
        heads = "-".join(map(str, self.head_bounds))
        kind = "sparse" if self.sparse else "dense"
        return f"tokens {tokens}, heads {heads}, {self.pattern} over {self.transport}, {kind}"


class OverlapTuner:
    """Per plan (:class:`PlanKey`), the measured seconds per block of each exact overlap and the
    resulting choice."""

    def __init__(self) -> None:
        self._plans: dict[PlanKey, _PlanTrial] = {}

    def choose(self, key: PlanKey, exact: Overlap) -> tuple[Overlap, TuningPhase]:
        """The overlap the next step of ``key`` runs, given what the probe measured exact."""
        trial = self._plans.get(key)
        candidates = combinations(exact)
        if trial is None or trial.candidates != candidates:
            trial = self._plans[key] = _PlanTrial(candidates)
        return trial.next()

    def record(
        self, key: PlanKey, ran: Overlap, phase: TuningPhase, seconds_per_block: float
    ) -> None:
        """The wall time per block of a step that ran ``ran`` in ``phase``."""
        trial = self._plans.get(key)
        if trial is None:
            return
        if phase is TuningPhase.WARMING:
            trial.warmed = True
        elif phase is TuningPhase.MEASURING:
            trial.seconds_per_block[ran] = seconds_per_block

    def snapshot(self) -> list[dict]:
        """Per plan: the measured ms per block of each overlap and the one later steps run."""
        out = []
        for key, trial in self._plans.items():
            choice, phase = trial.next()
            out.append(
                {
                    "plan": key.describe(),
                    "phase": phase.value,
                    "choice": choice.name,
                    "ms_per_block": {
                        o.name: round(s * 1e3, 3) for o, s in trial.seconds_per_block.items()
                    },
                }
            )
        return out
