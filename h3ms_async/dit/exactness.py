"""Which token plan a split step may run, from what the ranks measured (``workers.dit.invariance``).

Before a plan (token bounds + head bounds) is first used, every rank probes its own shard on its own
device.  The plan runs as planned when every op is exact there; when only token-split ops differ,
the shard boundaries move to a measured safe size (multiples of :data:`ADJUST_MULTIPLES` rows, or
that many rows at least, shares kept as close as possible) and the candidates are probed again;
otherwise (a head group's attention or qkv rows differ, or a rank's device computes the unsplit
products with other bits than rank 0's) the step runs unsplit.  The overlaps and sparse attention
are measured too and run only where exact: a differing op turns that feature off for the plan
(:func:`measured_overlap`, :func:`measured_sparse`).

The fixed rules :data:`MIN_SHARD_TOKENS` and ``dit_ops.flash_tiles_ok`` are priors: they only
order the adjustments and are named in the log when the measurement overrides them.  The decision is
cached for the life of the process, keyed by everything a kernel choice may depend on
(:func:`verdict_key`).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import msgspec

from h3ms_async.log import get_logger
from workers.dit.protocol import LinearOp, ProbeReport, SparseProbeSettings
from workers.runtime import config

log = get_logger("MultiStream")

#: The prior for GEMMs: fewer rows than this took other kernel paths on the machines first measured
#: (MKL's small-M path, kitchen's GEMV kernels). Adjusted plans keeping every shard at or above it
#: are tried first.
MIN_SHARD_TOKENS = 4
#: Shard sizes (multiples, or minimums) an adjusted plan tries, smallest move first.
ADJUST_MULTIPLES = (16, 32, 64, 128)

Verdict = Literal["exact", "adjusted", "unsplit"]


@dataclass(frozen=True)
class Overlap:
    """What a step computes while its exchanges move: attention in ``head_pieces`` head pieces
    inside the all-to-all (0: one call), the qkv projection on each rank's gathered rows as they
    arrive (``gather``), and each block's tail in ``ahead`` row pieces, each followed by the next
    block's norm1 + modulation of those rows published into its gather (0: off).  Asked for by the
    options, run where the probe measures it exact."""

    head_pieces: int = 0
    gather: bool = False
    ahead: int = 0

    @property
    def name(self) -> str:
        """``none`` or ``+``-joined ``gather``, ``piecesN``, ``aheadN`` (what :meth:`from_name`
        reads)."""
        parts = (
            (["gather"] if self.gather else [])
            + ([f"pieces{self.head_pieces}"] if self.head_pieces > 1 else [])
            + ([f"ahead{self.ahead}"] if self.ahead > 1 else [])
        )
        return "+".join(parts) or "none"

    @classmethod
    def from_name(cls, text: str) -> Overlap:
        """The overlap :attr:`name` names; ValueError naming the accepted forms otherwise."""
        pieces, gather, ahead = 0, False, 0
        for part in text.strip().split("+"):
            if part == "gather":
                gather = True
            elif part.startswith("pieces") and part[6:].isdigit() and int(part[6:]) > 1:
                pieces = int(part[6:])
            elif part.startswith("ahead") and part[5:].isdigit() and int(part[5:]) > 1:
                ahead = int(part[5:])
            elif part != "none":
                raise ValueError(
                    f"overlap {text!r}: use none, or gather, piecesN, aheadN (N >= 2) joined by "
                    "'+' (gather+piecesN, gather+pieces4+ahead4)"
                )
        return cls(pieces, gather, ahead)


#: The schedule without overlaps.
NO_OVERLAP = Overlap()


@dataclass(frozen=True)
class PlanVerdict:
    """The engine's decision about one plan: the token bounds to run (None: run the step unsplit),
    the verdict, one sentence saying why, what the probe cost (the slowest rank's wall time, all
    rounds), the overlap it runs with (what was asked for, less what measured inexact) and whether
    sparse attention is off on it (asked for and measured inexact: the plan runs dense)."""

    token_bounds: tuple[int, ...] | None
    verdict: Verdict
    detail: str
    probe_ms: float
    overlap: Overlap = NO_OVERLAP
    sparse_off: bool = False


def verdict_key(
    fingerprints: Sequence[dict],
    compute_dtype: str,
    ops: Sequence[LinearOp],
    attention: str,
    token_bounds: Sequence[int],
    head_bounds: Sequence[int],
    head_dim: int,
    overlap: Overlap = NO_OVERLAP,
    sparse: SparseProbeSettings | None = None,
) -> str:
    """Everything a plan's verdict depends on, as one JSON text: each rank's device, runtime, torch
    and comfy-kitchen (its fingerprint), the dtype, the ops' shapes and storage, the attention
    function, the shards, the overlap asked for, the sparse kernel's settings asked for (the
    ``dit_probe``'s ``sparse``; None: no sparse attention)."""
    key = {
        "devices": [dict(sorted(fp.items())) for fp in fingerprints],
        "dtype": compute_dtype,
        "ops": msgspec.to_builtins(list(ops)),
        "attention": attention,
        "tokens": list(token_bounds),
        "heads": list(head_bounds),
        "head_dim": head_dim,
        "overlap": asdict(overlap),
        "sparse": msgspec.to_builtins(sparse) if sparse else None,
    }
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def cache_path() -> str | None:
    """The verdict file: ``H3MS_INVARIANCE_CACHE``, by default in the user's cache folder; None
    when it says ``off``."""
    raw = config.INVARIANCE_CACHE.get()
    if raw == "off":
        return None
    if raw:
        return str(raw)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "h3_multistream", "invariance.json")


class VerdictCache:
    """Plan verdicts for the life of the process, and across processes in the JSON file
    :func:`cache_path` names (read once, rewritten whole after each new verdict)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdicts: dict[str, PlanVerdict] = {}
        self._read: str | None = None

    def get(self, key: str) -> PlanVerdict | None:
        path = cache_path()
        with self._lock:
            if path and self._read != path:
                self._read = path
                self._verdicts.update(
                    {k: v for k, v in _load(path).items() if k not in self._verdicts}
                )
            return self._verdicts.get(key)

    def put(self, key: str, verdict: PlanVerdict) -> None:
        path = cache_path()
        with self._lock:
            self._verdicts[key] = verdict
            if path:
                _save(path, self._verdicts)

    def clear(self) -> None:
        """Forget every verdict of this process (the file stays)."""
        with self._lock:
            self._verdicts.clear()
            self._read = None


def _load(path: str) -> dict[str, PlanVerdict]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        out = {}
        for k, v in raw.items():
            tb = v["token_bounds"]
            out[k] = PlanVerdict(
                None if tb is None else tuple(int(b) for b in tb),
                v["verdict"],
                str(v["detail"]),
                float(v["probe_ms"]),
                Overlap(**v.get("overlap", {})),
                bool(v.get("sparse_off", False)),
            )
        return out
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning(
            "H3MS_INVARIANCE_CACHE=%s is unreadable (%s: %s); measuring plans anew (the file is "
            "rewritten)",
            path,
            type(exc).__name__,
            exc,
        )
        return {}


def _save(path: str, verdicts: dict[str, PlanVerdict]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({k: asdict(v) for k, v in verdicts.items()}, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(
            "H3MS_INVARIANCE_CACHE=%s cannot be written (%s); verdicts stay in memory only",
            path,
            exc,
        )


#: The process-wide cache (``SplitEngine`` reads and fills it).
VERDICTS = VerdictCache()


def sizes(bounds: Sequence[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(bounds)]


def adjusted_bounds(
    bounds: Sequence[int], multiples: Sequence[int] = ADJUST_MULTIPLES
) -> list[tuple[int, ...]]:
    """Token bounds near ``bounds`` whose shards avoid small row counts: for each ``m`` of
    ``multiples``, every inner boundary rounded to the nearest multiple of ``m`` (each shard keeps
    >= m rows), and every shard raised to at least ``m`` rows (taken from the largest shards).
    Ordered by how far the boundaries move (shares kept as close as possible), plans whose shards
    all keep the :data:`MIN_SHARD_TOKENS` prior first; ``bounds`` itself and duplicates left out."""
    total, n = bounds[-1], len(bounds) - 1
    out: dict[tuple[int, ...], None] = {}
    for m in multiples:
        if total < n * m:
            continue
        rounded = [0]
        for i in range(1, n):
            b = round(bounds[i] / m) * m
            rounded.append(min(max(b, rounded[-1] + m), total - m * (n - i)))
        rounded.append(total)
        out[tuple(rounded)] = None
        sz = sizes(bounds)
        for r in range(n):
            while sz[r] < m:
                big = max(range(n), key=lambda j: sz[j])
                take = min(m - sz[r], sz[big] - m)
                sz[r] += take
                sz[big] -= take
        acc = [0]
        for v in sz:
            acc.append(acc[-1] + v)
        out[tuple(acc)] = None
    out.pop(tuple(bounds), None)
    return sorted(
        out,
        key=lambda c: (
            min(sizes(c)) < MIN_SHARD_TOKENS,
            sum(abs(a - b) for a, b in zip(c, bounds)),
        ),
    )


def first_exact(reports: Sequence[ProbeReport], n_candidates: int) -> int | None:
    """The first candidate on which every rank's token-split ops are exact, or None."""
    for c in range(n_candidates):
        if all(v.exact[c] for rep in reports for v in rep.ops if v.split == "tokens"):
            return c
    return None


def _device(rep: ProbeReport) -> str:
    return rep.fingerprint["device"]


def token_failure(reports: Sequence[ProbeReport], c: int = 0) -> str | None:
    """The first token-split op that differs on candidate ``c``: op, dtype, shape, shard rows,
    device, difference."""
    for rep in reports:
        for v in rep.ops:
            if v.split == "tokens" and not v.exact[c]:
                a, b = v.shards[c]
                return (
                    f"{v.op} ({v.dtype}, {v.shape}) gives a {b - a}-row shard other bits than the "
                    f"unsplit call on {_device(rep)} (max abs difference {v.max_abs_diff[c]:g})"
                )
    return None


def fixed_failure(reports: Sequence[ProbeReport]) -> str | None:
    """What no token adjustment can fix: a head group's qkv rows or attention differ from the
    unsplit call's, or a rank's device computes an unsplit product with other bits than rank 0's
    device (ranks on other GPU models). The sparse ops are :func:`measured_sparse`'s."""
    for rep in reports:
        for v in rep.ops:
            if v.op in SPARSE_OPS:
                continue
            if v.split == "heads" and v.exact and not v.exact[0]:
                g0, g1 = v.shards[0]
                return (
                    f"{v.op} ({v.dtype}, {v.shape}) of heads [{g0}, {g1}) differs from the unsplit "
                    f"call's on {_device(rep)} (max abs difference {v.max_abs_diff[0]:g})"
                )
    for v in reports[0].ops:
        if v.op not in SPARSE_OPS and (why := _other_bits(reports, v.op)) is not None:
            return why
    return None


def _other_bits(reports: Sequence[ProbeReport], op: str) -> str | None:
    """Where a rank's device computes ``op``'s unsplit call with other bits than rank 0's, or
    None."""
    first = next((v.digest for v in reports[0].ops if v.op == op), None)
    for rep in reports[1:]:
        for v in rep.ops:
            if v.op == op and v.digest != first:
                return (
                    f"{v.op} ({v.dtype}, {v.shape}) computes other bits on {_device(rep)} than on "
                    f"{_device(reports[0])}"
                )
    return None


#: The ops the overlaps add to a probe: op name -> what the step does without it.
OVERLAP_OPS = {
    "attention.pieces": "attention runs in one call per rank",
    "attn.qkv_proj.rows": "the qkv projection waits for the whole gather",
    "attn.out_proj.tail": "each block's tail runs whole before the next block's gather",
    "mlp.fc1.tail": "each block's tail runs whole before the next block's gather",
    "mlp.fc2.tail": "each block's tail runs whole before the next block's gather",
}
#: The ops the cross-block overlap adds to a probe (its tail's linears on its row pieces).
TAIL_OPS = ("attn.out_proj.tail", "mlp.fc1.tail", "mlp.fc2.tail")


def _first_inexact(reports: Sequence[ProbeReport], op: str) -> str | None:
    """The first call of overlap op ``op`` that differs from the unsplit call's, or None."""
    for rep in reports:
        for v in rep.ops:
            if v.op != op:
                continue
            what = "heads" if v.split in ("pieces", "heads") else "tokens"
            for (a, b), ok, d in zip(v.shards, v.exact, v.max_abs_diff):
                if not ok:
                    return (
                        f"{v.op} ({v.dtype}, {v.shape}) of {what} [{a}, {b}) differs from the "
                        f"whole call's on {_device(rep)} (max abs difference {d:g})"
                    )
    return None


def measured_overlap(
    reports: Sequence[ProbeReport], verdict: PlanVerdict, asked: Overlap
) -> tuple[Overlap, dict[str, str]]:
    """The overlap a plan runs with, and why each part asked for is off (op name -> one
    sentence). The qkv rows were probed on the plan's token ranges as made, so an adjusted plan
    runs without them."""
    off: dict[str, str] = {}
    if verdict.token_bounds is None:
        return NO_OVERLAP, off
    pieces, gather, ahead = asked.head_pieces, asked.gather, asked.ahead
    if pieces and (why := _first_inexact(reports, "attention.pieces")) is not None:
        off["attention.pieces"] = why
        pieces = 0
    if gather:
        why = _as_made(verdict, "attn.qkv_proj.rows") or _first_inexact(
            reports, "attn.qkv_proj.rows"
        )
        if why is not None:
            off["attn.qkv_proj.rows"] = why
            gather = False
    if ahead:
        for op in TAIL_OPS:
            if (why := _as_made(verdict, op) or _first_inexact(reports, op)) is not None:
                off[op] = why
                ahead = 0
                break
    overlap = Overlap(pieces, gather, ahead)
    return overlap, {op: f"{why}; {OVERLAP_OPS[op]}" for op, why in off.items()}


def _as_made(verdict: PlanVerdict, op: str) -> str | None:
    """Why ``op``'s verdict does not hold for an adjusted plan (it was measured on each rank's
    token range as made), or None for a plan that runs as made."""
    if verdict.verdict == "exact":
        return None
    return f"{op} was measured on the token ranges as made, and the plan's were adjusted"


#: The ops sparse attention adds to a probe: op name -> what it is.
SPARSE_OPS = {
    "attn.qkv_proj.chunks": "the qkv projection in the sparse kernel's row chunks",
    "attention.sparse": "the sparse kernel over the head group",
}


def measured_sparse(
    reports: Sequence[ProbeReport], verdict: PlanVerdict, asked: bool
) -> tuple[bool, dict[str, str]]:
    """Whether sparse attention asked for is off on a plan, and why (op name -> one sentence): the
    first sparse op whose group calls differ from the calls over every head, or whose unsplit call
    gives another rank's device other bits than rank 0's.  Measured on the plan as made: the sparse
    calls of every rank cover every token, so adjusted token bounds keep the verdict."""
    if not asked or verdict.token_bounds is None:
        return False, {}
    for op in SPARSE_OPS:
        why = _first_inexact(reports, op) or _other_bits(reports, op)
        if why is not None:
            return True, {op: f"{why}; {SPARSE_OFF}"}
    return False, {}


#: What a plan whose sparse ops differ runs.
SPARSE_OFF = "sparse attention is off on this plan (attention runs dense)"


def slowest_ms(*rounds: Sequence[ProbeReport]) -> float:
    return sum(max(rep.ms for rep in reps) for reps in rounds)


def op_rows(
    reports: Sequence[ProbeReport],
    verdict: PlanVerdict,
    failing: str | None,
    off: Mapping[str, str] | None = None,
) -> list[dict]:
    """One status row per op of the plan (``status.record_verdict`` fields): the op's shard sizes as
    probed, its verdict (the failing op carries the plan's adjusted/unsplit verdict and detail, an
    overlap or sparse op in ``off`` "adjusted" with why it is off, the others "exact" or, when the
    step runs unsplit, "unsplit"), and its slowest rank's probe time."""
    rows = []
    for i, v in enumerate(reports[0].ops):
        per_rank = [rep.ops[i] for rep in reports]
        cut = [
            rv.shards if v.split in ("pieces", "rows", "chunks", "tail") else rv.shards[:1]
            for rv in per_rank
        ]
        shards = [b - a for rv in cut for a, b in rv]
        bad = failing is not None and failing.startswith(v.op + " ")
        if bad:
            state: Verdict = verdict.verdict
            detail = verdict.detail
        elif off and v.op in off:
            state = "adjusted"
            detail = off[v.op]
        else:
            state = "unsplit" if verdict.token_bounds is None else "exact"
            detail = (
                "measured exact"
                if state == "exact"
                else "the step runs unsplit (another op differs)"
            )
        devices = sorted({_device(rep) for rep in reports})
        rows.append(
            {
                "op": v.op,
                "device": ", ".join(devices),
                "dtype": v.dtype,
                "shape": v.shape,
                "shards": shards,
                "verdict": state,
                "detail": detail,
                "probe_ms": max(rv.ms for rv in per_rank),
            }
        )
    return rows
