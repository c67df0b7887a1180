"""The pack's typed records: one split step (:class:`StepRecord`, with its INFO log line), one
exactness verdict (:class:`VerdictRecord`) and one ``verify`` result (:class:`VerifyRecord`).

Each is a msgspec Struct built by the code that produces it; the status hub (``hub.py``) keeps
their JSON forms and serves them, so a consumer can check one with ``msgspec.convert(obj,
StepRecord)``.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Mapping
from typing import Annotated, Literal

import msgspec

from h3ms_async.runtime.host_memory import fmt_bytes
from workers.dit.protocol import BlockTiming, IpcSync, Pattern, Transport

#: A step record's ``exchange``: the transport as it ran.
Exchange = Transport

#: ``[start, end)``, a JSON array of two ints.
Range = Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]


class RankRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One rank's share of a step: its token range and head group (``[start, end)``), its seconds
    and bytes, and where each block's time went (``per_block``: compute, exchange copy, the copy
    hidden behind compute, the exposed wait; ``workers.dit.protocol.BlockTiming``)."""

    rank: int
    device: str
    tokens: Range
    heads: Range
    compute_s: float
    exchange_s: float
    wait_s: float
    moved_bytes: int
    vram_peak_bytes: int | None
    per_block: list[BlockTiming]
    #: a GPU rank's block weights: bytes kept in its VRAM, blocks resident there and blocks streamed
    #: from the pinned store each step (None on a CPU rank: its weights are views of the host store)
    weights_vram_bytes: int | None = None
    resident_blocks: int | None = None
    streamed_blocks: int | None = None


class StepRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One split denoising step.  The ranks are listed 0..N-1; their token ranges tile ``[0,
    tokens)`` and their head groups tile ``[0, H)``, in order (the split plan's invariants; tests
    check them)."""

    at: str
    seq: int
    kind: Literal["dit"] = "dit"
    sigma: float | None
    tokens: int
    blocks: int
    devices: list[str]
    exchange: Exchange
    chunks: int
    #: head pieces each rank's attention ran in, each moved while the next computed (0: one call)
    head_pieces: int = 0
    #: the qkv projection ran on each rank's gathered rows as they arrived
    gather_overlap: bool = False
    #: row pieces each block's tail ran in, each followed by the next block's norm1 + modulation
    #: of those rows published into its gather (0: off)
    gather_ahead: int = 0
    #: when the engine picks the overlaps (``overlap_tuning``): "warming" (a plan's first step, no
    #: overlaps), "measuring" (timing one exact combination) or "fastest"; "" when options fix them
    overlap_tuning: Literal["", "warming", "measuring", "fastest"] = ""
    #: how attention got its inputs: the all-gather of the block input, or Ulysses' q/k/v all-to-all
    pattern: Pattern = Pattern.GATHER
    #: how the GPU-direct exchange ordered its copies (``exchange`` "cuda_ipc"; None otherwise)
    ipc_sync: IpcSync | None = None
    wall_s: float
    moved_bytes: int
    weight_store: str
    ranks: list[RankRecord]

    def __post_init__(self) -> None:
        short = [r.rank for r in self.ranks if len(r.per_block) != self.blocks]
        if short:
            raise ValueError(
                f"rank(s) {short}: per_block must hold one timing per block ({self.blocks})"
            )


class VerdictRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One measured exactness verdict of a plan's op on one device (``exactness.verdicts``):
    ``shards`` are the plan's shard sizes (tokens, heads or chunks) as probed; ``detail`` one
    sentence (what was adjusted, or why unsplit)."""

    program: Literal["dit", "attention", "vae"]
    op: str
    device: str
    dtype: str
    shape: str
    shards: list[int]
    verdict: Literal["exact", "adjusted", "unsplit"]
    detail: str
    probe_ms: float
    at: str


class VerifyRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One result of the opt-in ``verify`` setting (``exactness.verify``): a split step against the
    same step run unsplit on the model's device; ``first_difference`` e.g. ``"block 3 mlp.fc2"``
    (None when bit-exact)."""

    at: str
    devices: list[str]
    bit_exact: bool
    max_abs_diff: float
    first_difference: str | None
    steps_checked: int


#: :func:`block_means`' keys: the four numbers of ``BlockTiming`` in milliseconds.
BLOCK_MS = ("compute_ms", "copy_ms", "hidden_ms", "exposed_ms")


def block_means(per_block: Iterable[Mapping]) -> dict[str, float]:
    """The mean block of per-block timings (``BlockTiming`` JSON forms, e.g. every timed step's
    ``per_block`` of one rank): its four numbers in milliseconds, the block's time (compute +
    exposed) and the exposed wait as a percentage of it."""
    rows = list(per_block)
    n = max(1, len(rows))
    out = {
        ms: sum(float(r[ms.removesuffix("_ms") + "_s"]) for r in rows) / n * 1e3 for ms in BLOCK_MS
    }
    block = out["compute_ms"] + out["exposed_ms"]
    out["block_ms"] = block
    out["exposed_pct"] = 100.0 * out["exposed_ms"] / block if block > 0 else 0.0
    return out


def now_iso() -> str:
    """The ``at`` field of a step record: local time, second precision, ISO-8601."""
    return _dt.datetime.now().isoformat(timespec="seconds")


def _joined(values: Iterable[float]) -> str:
    return "/".join(f"{v:.3f}" for v in values)


def format_step_line(rec: Mapping) -> str:
    """The one INFO line per split step (the logger adds ``[H3 MultiStream] [MultiStream]``).

    Example: ``sigma 0.9375 step 12: 45000 tokens x 50 blocks on cuda:0+cuda:1, 3.214s (exchange
    host x4; compute 2.100/2.050s, exchange 0.410/0.430s, wait 0.020/0.050s; 1.23 GiB moved), weight
    store warm, 18.5 GiB, VRAM peak cuda:0 12.30 GiB / cuda:1 11.90 GiB``. Ranks that share a device
    add up (they are separate processes on one GPU); the VRAM clause is left out when no rank
    reports a peak (CPU runs).
    """
    ranks = rec["ranks"]
    sigma = f"sigma {rec['sigma']:.4f} " if rec.get("sigma") is not None else ""
    chunks = f" x{rec['chunks']}" if rec["chunks"] > 1 else ""
    if rec.get("head_pieces", 0) > 1:
        chunks += f", attention in {rec['head_pieces']} head pieces"
    if rec.get("gather_overlap"):
        chunks += ", qkv as the rows arrive"
    if rec.get("gather_ahead", 0) > 0:
        chunks += f", next gather ahead in {rec['gather_ahead']} row pieces"
    if rec.get("overlap_tuning"):
        chunks += f" (overlaps {rec['overlap_tuning']})"
    if rec.get("pattern") == "ulysses":
        chunks += ", Ulysses"
    if rec.get("ipc_sync"):
        events = rec["ipc_sync"] == "events"
        chunks += f", ordered by {'CUDA IPC events' if events else 'host waits'}"
    line = (
        f"{sigma}step {rec['seq']}: {rec['tokens']} tokens x {rec['blocks']} blocks on "
        f"{'+'.join(r['device'] for r in ranks)}, {rec['wall_s']:.3f}s (exchange "
        f"{rec['exchange']}{chunks}; compute {_joined(r['compute_s'] for r in ranks)}s, exchange "
        f"{_joined(r['exchange_s'] for r in ranks)}s, wait {_joined(r['wait_s'] for r in ranks)}s; "
        f"{fmt_bytes(rec['moved_bytes'])} moved), weight store {rec['weight_store']}"
    )
    peaks: dict[str, int] = {}
    for r in ranks:
        if r["vram_peak_bytes"] is not None:
            peaks[r["device"]] = peaks.get(r["device"], 0) + r["vram_peak_bytes"]
    if peaks:
        line += ", VRAM peak " + " / ".join(f"{d} {fmt_bytes(b)}" for d, b in peaks.items())
    return line
