"""``python -m h3ms_async bench model``: predicted step time and speed-up of the DiT split at N
ranks per link.

The model is ``h3ms_async.dit.speed_model``. Its measured parts come from ``--parts FILE`` (schema
``h3ms_async.speed_parts/1``; ``benchmarks/speed_parts_h200.json`` holds the one-H200 figures of
docs/performance.md) or, on a CUDA GPU without ``--parts``, are measured here: the unsplit block and
the slowest rank's 1/N shard of the reference block at full H3 width, timed alone in this process,
the block without its attention (the attention fraction), the pinned host<->device copy rates and,
with an overlapped ``--schedule``, what its overlaps' kernels add to the largest 2-rank shard.
Links: PCIe Gen4 and Gen5 with host staging and NVLink with NCCL at stated rates
(``--pcie4-gbps``...), plus the measured host link when the parts carry pinned copy rates, plus a
multi-host network with ``--net-gbit``. Every prediction is made for the block-input all-gather
(what the split runs) and for Ulysses, dense and sparse (sparse: the all-gather pattern only, as the
split runs it). ``--validate`` (CUDA only) runs the real split on logical ranks of one GPU
(``--validate-ranks``, 2 and 4 by default; the all-gather pattern unless ``--validate-pattern
ulysses``) and prints predicted vs measured step time.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence

import torch

from h3ms_async.dit import speed_model as sm
from h3ms_async.dit.exactness import NO_OVERLAP, Overlap
from h3ms_async.dit.tested_paths import allow_untested_paths
from h3ms_async.tools.cli import ArgParser, int_list, positive_int


def default_links(parts: sm.Parts, a) -> list[sm.Link]:
    links = [
        sm.Link(
            "pcie4-host", "host", a.pcie4_gbps, sm.HOST_OP_LATENCY_S, sm.SOURCES["pcie4"], True
        ),
        sm.Link(
            "pcie5-host", "host", a.pcie5_gbps, sm.HOST_OP_LATENCY_S, sm.SOURCES["pcie5"], True
        ),
        sm.Link(
            "nvlink-nccl", "nccl", a.nvlink_gbps, sm.NCCL_OP_LATENCY_S, sm.SOURCES["nvlink"], True
        ),
        sm.Link(
            "pcie4-p2p",
            "cuda_ipc",
            a.pcie4_gbps,
            sm.HOST_OP_LATENCY_S,
            sm.SOURCES["pcie4_p2p"],
            True,
        ),
        sm.Link(
            "pcie5-p2p",
            "cuda_ipc",
            a.pcie5_gbps,
            sm.HOST_OP_LATENCY_S,
            sm.SOURCES["pcie5_p2p"],
            True,
        ),
        sm.Link(
            "nvlink-p2p",
            "cuda_ipc",
            a.nvlink_gbps,
            sm.HOST_OP_LATENCY_S,
            sm.SOURCES["nvlink_p2p"],
            True,
        ),
    ]
    if parts.pinned_h2d_gbps and parts.pinned_d2h_gbps:
        src = (
            "MEASURED: pinned copies into/from a CUDA-registered shm segment (parts: "
            f"{parts.sources.get('pinned_h2d_gbps', 'this run')})"
        )
        links.append(
            sm.Link(
                "measured-host",
                "host",
                parts.pinned_h2d_gbps,
                sm.HOST_OP_LATENCY_S,
                src,
                False,
                d2h_gbps=parts.pinned_d2h_gbps,
            )
        )
    if a.net_gbit:
        links.append(
            sm.Link(
                f"net{a.net_gbit:g}g-nccl",
                "nccl",
                a.nvlink_gbps,
                sm.NCCL_OP_LATENCY_S,
                f"{sm.SOURCES['nvlink']} inside a host; {sm.SOURCES['net']}; "
                f"{a.net_gbit:g} Gb/s per host, {a.gpus_per_host} GPU(s) per host",
                True,
                net_gbps=a.net_gbit / 8 * sm.NET_EFFICIENCY,
                gpus_per_host=a.gpus_per_host,
            )
        )
    return links


def host_memcpy_gbps(nbytes: int = 256 << 20, reps: int = 3) -> float:
    """GB/s of one large tensor copy in host memory on this machine (read + write counted once, as
    a copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _predict(parts: sm.Parts, world: int, link: sm.Link, schedule: Overlap, **kw) -> sm.Prediction:
    """``speed_model.predict`` with ``schedule``'s overlaps (head pieces, gather overlap, gather
    ahead)."""
    return sm.predict(
        parts,
        world,
        link,
        head_pieces=schedule.head_pieces,
        gather_overlap=schedule.gather,
        gather_ahead=schedule.ahead,
        **kw,
    )


def run(
    parts: sm.Parts,
    ranks: Sequence[int],
    links: Sequence[sm.Link],
    *,
    overlap: float = 0.0,
    schedule: Overlap = NO_OVERLAP,
    sparse_attention_ratio: float | None = None,
    compute_scale: float = 1.0,
    shares: Sequence[float] | None = None,
) -> dict:
    """Every (N, link, pattern, dense/sparse) prediction, and the pattern the model prefers per (N,
    link)."""
    rho = (
        sparse_attention_ratio
        if sparse_attention_ratio is not None
        else parts.sparse_attention_ratio()
    )
    modes = [False] + ([True] if rho is not None else [])
    preds, prefer = [], []
    for n in ranks:
        for link in links:
            if link.shared:
                continue
            for sparse in modes:
                # sparse attention runs with the all-gather pattern only (the split refuses Ulysses
                # with it)
                patterns = ("gather",) if sparse else sm.PATTERNS
                pair = {
                    p: _predict(
                        parts,
                        n,
                        link,
                        schedule,
                        pattern=p,
                        sparse=sparse,
                        overlap=overlap,
                        sparse_attention_ratio=rho,
                        compute_scale=compute_scale,
                        shares=shares,
                    )
                    for p in patterns
                }
                preds += [p.to_dict() for p in pair.values()]
                best = min(pair.values(), key=lambda p: p.step_s)
                prefer.append(
                    {
                        "world": n,
                        "link": link.name,
                        "attention": best.attention,
                        "pattern": best.pattern,
                        "gather_over_ulysses": (
                            pair["gather"].step_s / pair["ulysses"].step_s
                            if "ulysses" in pair
                            else None
                        ),
                    }
                )
    return {
        "bench": "model",
        "schedule": {
            "overlaps": schedule.name,
            "overlap": overlap,
            "qkv_fraction": sm.QKV_FRACTION,
            "note": "--schedule names the split's overlaps as implemented (piecesN: attention in "
            "N head pieces pipelined with the all-to-all; gather: the qkv projection of a rank's "
            "own rows beside the all-gather, ASSUMED qkv_fraction of a block); without them every "
            "op waits for the compute before it and the next compute for its bytes; --overlap "
            "hides a further fraction of what stays exposed (schedules not built)",
        },
        "parts": sm.parts_to_dict(parts),
        "sparse_attention_ratio": rho,
        "compute_scale": compute_scale,
        "links": [
            {
                "name": ln.name,
                "transport": ln.transport,
                "gbps": ln.gbps,
                "d2h_gbps": ln.d2h_gbps,
                "net_gbps": ln.net_gbps,
                "gpus_per_host": ln.gpus_per_host,
                "op_latency_s": ln.op_latency_s,
                "assumed": ln.assumed,
                "source": ln.source,
            }
            for ln in links
        ],
        "host_mem_source": parts.sources.get("host_mem_gbps", "from the parts"),
        "validated_on_gpu": False,
        "predictions": preds,
        "preferred_pattern": prefer,
    }


def table(res: dict) -> str:
    """Compact text: speed-up of the gather pattern (Ulysses in brackets) per N and link, dense and
    sparse."""
    # (link, attention) -> world -> pattern -> prediction
    rows: dict[tuple[str, str], dict[int, dict[str, dict]]] = {}
    for p in res["predictions"]:
        key = (p["link"], p["attention"])
        rows.setdefault(key, {}).setdefault(p["world"], {})[p["pattern"]] = p
    worlds = sorted({p["world"] for p in res["predictions"]})
    pref = {(q["world"], q["link"], q["attention"]): q["pattern"] for q in res["preferred_pattern"]}
    head = f"{'link':<16} {'attn':<6} " + " ".join(f"{'N=' + str(n):>30}" for n in worlds)
    lines = [
        "speed-up vs one GPU, all-gather pattern [Ulysses] (step s; * = preferred; schedule "
        f"{res['schedule']['overlaps']}, overlap {res['schedule']['overlap']:g})",
        head,
    ]
    for (link, attn), by_n in rows.items():
        cells = []
        for n in worlds:
            g, u = by_n[n]["gather"], by_n[n].get("ulysses")
            star = "*U" if pref[(n, link, attn)] == "ulysses" else "*G"
            other = f"{u['speedup']:5.2f}x" if u else f"{'-':>6}"
            cells.append(f"{g['speedup']:5.2f}x [{other}] {g['step_s']:6.2f}s {star}")
        lines.append(f"{link:<16} {attn:<6} " + " ".join(f"{c:>30}" for c in cells))
    validation = res.get("validation", [])
    checked = ", ".join(str(r["world"]) for r in validation)
    with_pattern = (
        f" with the {validation[0].get('pattern', 'gather')} pattern" if validation else ""
    )
    if res["validated_on_gpu"]:
        verdict = (
            f"Validated on this GPU: predicted within {res['validation_bound_pct']:g} % of "
            f"measured at {checked} logical ranks{with_pattern} (the JSON's validation)."
        )
    elif checked:
        verdict = (
            f"NOT validated: at {checked} logical ranks{with_pattern} on this GPU the prediction "
            f"missed the measurement by more than {res['validation_bound_pct']:g} % somewhere "
            "(the JSON's validation)."
        )
    else:
        verdict = "Not validated on a GPU in this run (bench model --validate there)."
    lines.append(verdict + " Links marked ASSUMED in the JSON use stated rates, not measurements.")
    return "\n".join(lines)


# -- measuring the parts on a CUDA GPU
# ------------------------------------------------------------------------------
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device, reps: int = 3) -> float:
    fn()
    _sync(dev)
    best = float("inf")
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


class ShardClock:
    """Times one rank's shard of the first blocks of ``model`` (``block_weights(i)`` and
    ``modulation(t_emb)`` on ``dev``, the blocks of ``cfg``) alone in this process: ``NoExchange``
    gives every op the shapes the split's ops have and moves nothing, so the time is that rank's
    compute with no second CUDA context beside it."""

    def __init__(self, model, cfg, tokens: int, dev: torch.device) -> None:
        from h3ms_async.dit.layout import layout_for_tokens
        from h3ms_async.dit.reference import make_step_inputs

        self.model, self.cfg, self.dev = model, cfg, dev
        inp = make_step_inputs(self.cfg, layout_for_tokens(tokens), 7, torch.bfloat16)
        self.x = inp.x.to(dev)
        self.mod = model.modulation(inp.t_emb.to(dev))
        self.rope = inp.rope_freqs.to(dev)
        self.segs = [
            (a, b, r.to(dev) if isinstance(r, torch.Tensor) else r) for a, b, r in inp.segments
        ]
        self.tokens = tokens

    def seconds(
        self, world: int, *, attend=None, schedule: Overlap = NO_OVERLAP, blocks: int = 1
    ) -> float:
        """Best of three runs of the largest rank's shard of ``blocks`` blocks at ``world`` ranks,
        with the compute of ``schedule``'s overlaps (head pieces, the qkv projection per gathered
        part, the tail in row pieces feeding the next block)."""
        from workers.dit import ops as dit_ops
        from workers.dit.loop import BlockInputs, LoopPaths, RankBlocks, run_blocks
        from workers.dit.weights import CpuWeights
        from workers.transports.arena import ArenaLayout
        from workers.transports.exchange import IdentityExchange, NoExchange

        cfg = self.cfg
        plan = sm.make_plan(
            sm.Shape(self.tokens, cfg.hidden, cfg.heads, cfg.head_dim, 1, "bfloat16"), world
        )
        # largest remainder gives ties to the higher rank: the last rank is the largest
        r = world - 1
        t0, t1, g0, g1 = plan.tokens[r], plan.tokens[r + 1], plan.heads[r], plan.heads[r + 1]
        lay = ArenaLayout.plan(
            world,
            list(plan.tokens),
            [g * cfg.head_dim for g in plan.heads],
            cfg.hidden,
            torch.bfloat16,
            col_unit=cfg.head_dim,  # head pieces are whole heads
        )
        w = CpuWeights(
            self.model.block_weights, blocks, (g0, g1), cfg.heads, cfg.head_dim, eager=True
        )
        ex = NoExchange(r, lay, self.dev) if world > 1 else IdentityExchange()
        rows = dit_ops.clip_segments(self.segs, t0, t1)
        paths = LoopPaths(
            head_pieces=schedule.head_pieces,
            gather_overlap=schedule.gather,
            gather_ahead=schedule.ahead,
        )

        def once():
            with torch.inference_mode():
                run_blocks(
                    self.x[t0:t1].clone(),
                    BlockInputs(self.mod, rows, self.rope),
                    RankBlocks(w, ex, g1 - g0, cfg.head_dim, cfg.eps, attend),
                    range(blocks),
                    paths,
                )

        return _timed(once, self.dev)

    def overlap_cost(self, schedule: Overlap, blocks: int) -> float:
        """What ``schedule``'s overlaps add to the largest 2-rank shard's compute, as a fraction
        (``Parts.overlap_compute_frac``), over ``blocks`` blocks (the last block has no next one to
        feed, as in a step)."""
        plain = self.seconds(2, blocks=blocks)
        return max(0.0, self.seconds(2, schedule=schedule, blocks=blocks) / plain - 1.0)


@functools.lru_cache(maxsize=1)
def _reference(layers: int, weights: str):
    """The full-width reference model of ``layers`` blocks on the GPU (``CachedModel``, seed
    1234), kept for the next caller: with an overlapped schedule the parts and the validation
    time the same blocks, which take seconds to generate."""
    from h3ms_async.dit.reference import DiTConfig
    from h3ms_async.tools.bench.gpu import FULL, CachedModel

    return CachedModel(DiTConfig(layers=layers, **FULL), weights, 1234)


def measure_parts(
    tokens: int,
    weights: str,
    ranks: Sequence[int],
    layers: int,
    host_mem_gbps: float,
    schedule: Overlap = NO_OVERLAP,
    blocks: int = 4,
) -> sm.Parts:
    """The parts of this GPU at full H3 width: unsplit block, block without attention, the slowest
    rank's shard for each N (timed alone, no exchange), pinned copy rates, and with an overlapped
    ``schedule`` the compute its overlaps add (over ``blocks`` blocks)."""
    from h3ms_async.tools.bench.gpu import copy_bandwidth

    bw = copy_bandwidth()
    overlapped = schedule != NO_OVERLAP
    model = _reference(max(2, blocks) if overlapped else 1, weights)
    cfg = model.cfg
    clock = ShardClock(model, cfg, tokens, torch.device("cuda"))

    def no_attention(q, k, v, heads):
        # random, not zeros: the projection after it must not run faster on zeros
        return q.new_empty(q.shape[2], heads * q.shape[3]).normal_()

    unsplit = clock.seconds(1)
    without = clock.seconds(1, attend=no_attention)
    shards = {n: clock.seconds(n) for n in ranks if n > 1}
    over = max(0.0, shards[min(shards)] - unsplit / min(shards)) if shards else 0.0
    gpu = torch.cuda.get_device_name()
    sources = {
        "unsplit_block_s": f"MEASURED here on {gpu}: one {weights} block at full H3 width, "
        f"{tokens} tokens",
        "shard_block_s": "MEASURED here: the largest rank's shard, timed alone (no exchange)",
        "attention_fraction": "MEASURED here: 1 - (block with attention replaced by random "
        "data) / block",
        "pinned_h2d_gbps": f"MEASURED here on {gpu}",
        "host_mem_gbps": "--host-mem-gbps",
    }
    frac = 0.0
    if overlapped:
        frac = clock.overlap_cost(schedule, cfg.layers)
        sources["overlap_compute_frac"] = (
            f"MEASURED here: the largest 2-rank shard over {cfg.layers} blocks with "
            f"{schedule.name} against without, timed alone"
        )
    return sm.Parts(
        shape=sm.Shape(tokens, cfg.hidden, cfg.heads, cfg.head_dim, layers, "bfloat16"),
        unsplit_block_s=unsplit,
        attention_fraction=max(0.0, min(1.0, 1 - without / unsplit)),
        host_mem_gbps=host_mem_gbps,
        rank_overhead_s=over,
        shard_block_s=shards,
        pinned_h2d_gbps=bw["h2d_registered_GBps"],
        pinned_d2h_gbps=bw["d2h_registered_GBps"],
        overlap_compute_frac=frac,
        sources=sources,
    )


#: How far a prediction may miss the measured block time for the model to count as validated.
VALIDATION_BOUND_PCT = 5.0


def within_bound(rows: Sequence[dict]) -> bool:
    """True when every validated world size was predicted within :data:`VALIDATION_BOUND_PCT`."""
    return bool(rows) and all(abs(r["error_pct"]) <= VALIDATION_BOUND_PCT for r in rows)


def validation_row(
    parts: sm.Parts,
    world: int,
    link: sm.Link,
    schedule: Overlap,
    baseline: float,
    measured: float,
    walls: Sequence[float],
    pattern: str = "gather",
) -> dict:
    """One world size's check: the prediction for ``schedule`` under ``pattern`` plus the
    time-slicing of logical ranks (``sharing_s``) against the ``measured`` block.  The no-exchange
    ``baseline`` runs the same overlaps' compute as the split (its ranks take the step's options),
    so the time-slicing is that baseline over the model's compute with the overlaps' cost
    (``Parts.overlap_compute_frac``)."""
    pred = _predict(parts, world, link, schedule, pattern=pattern)
    sharing = max(0.0, baseline - pred.compute_block_s)
    shared = pred.block_s + sharing
    return {
        "world": world,
        "pattern": pattern,
        "predicted_block_s": pred.block_s,
        "baseline_no_exchange_block_s": baseline,
        "sharing_s": sharing,
        "predicted_shared_block_s": shared,
        "measured_block_s": measured,
        "error_pct": (shared - measured) / measured * 100,
        "error_pct_without_sharing": (pred.block_s - measured) / measured * 100,
        "step_walls_s": list(walls),
    }


def validate(
    parts: sm.Parts,
    tokens: int,
    weights: str,
    layers: int,
    ranks: Sequence[int],
    schedule: Overlap = NO_OVERLAP,
    pattern: str = "gather",
) -> list[dict]:
    """Predicted vs measured block time of the real split on logical ranks of this one GPU
    (time-sliced, sharing its link; host exchange, chunks 0, ``pattern``, the overlaps of
    ``schedule``: the gather overlap and gather ahead only with the all-gather pattern).

    Logical ranks pay a cost separate GPUs do not: N CUDA contexts time-slicing one GPU.  It is
    measured beside the split, as the same ranks' no-exchange baseline over the model's compute
    (the shards timed alone, summed: ``sharing_s``), and added to the prediction the bound is
    checked on (``predicted_shared_block_s``), so what is validated is the model's exchange and
    overlaps; ``error_pct_without_sharing`` is the bare model's miss."""
    from h3ms_async.dit.layout import layout_for_tokens
    from h3ms_async.dit.options import SplitOptions
    from h3ms_async.dit.reference import make_step_inputs
    from h3ms_async.dit.split import SplitEngine
    from workers.dit.protocol import Pattern, Transport

    model = _reference(layers, weights)
    cfg = model.cfg
    inp = make_step_inputs(cfg, layout_for_tokens(tokens), 11, torch.bfloat16)
    link = sm.Link(
        "logical-one-gpu",
        "host",
        parts.pinned_h2d_gbps or sm.PCIE5_GBPS,
        sm.HOST_OP_LATENCY_S,
        "MEASURED pinned copies of this GPU, every logical rank on it",
        False,
        d2h_gbps=parts.pinned_d2h_gbps,
        shared=True,
    )
    rows = []
    for n in ranks:
        eng = SplitEngine(
            ["cuda:0"] * n,
            SplitOptions(
                exchange=Transport.HOST,
                exchange_chunks=0,
                head_pieces=schedule.head_pieces,
                gather_overlap=schedule.gather and pattern == "gather",
                gather_ahead=schedule.ahead if pattern == "gather" else 0,
                pattern=Pattern(pattern),
            ),
        )
        try:
            eng.load_weights(("bench-model", weights, layers), cfg, model.block_weights)
            walls = []
            mod = model.modulation(inp.t_emb)
            for _ in range(3):  # the first step is a warm-up
                t = time.perf_counter()
                eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs)
                walls.append(time.perf_counter() - t)
            measured = max(r.wall_s for r in eng.last_rank_results) / layers
            for _ in range(2):  # the no-exchange baseline, the second step timed
                eng.run_blocks(inp.x, mod, inp.segments, inp.rope_freqs, exchange="none")
            baseline = max(r.wall_s for r in eng.last_rank_results) / layers
        finally:
            eng.release()
        rows.append(validation_row(parts, n, link, schedule, baseline, measured, walls, pattern))
        row = rows[-1]
        print(
            f"N={n} logical ranks on one GPU: predicted {row['predicted_block_s'] * 1e3:.1f} "
            f"ms/block + {row['sharing_s'] * 1e3:.1f} ms of time-slicing (no-exchange baseline "
            f"{baseline * 1e3:.1f}) = {row['predicted_shared_block_s'] * 1e3:.1f}, measured "
            f"{measured * 1e3:.1f} ms/block, error {row['error_pct']:+.1f} % "
            f"({row['error_pct_without_sharing']:+.1f} % without the time-slicing)",
            file=sys.stderr,
        )
    return rows


def load_parts(path: str) -> sm.Parts:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise sm.PartsError(f"--parts {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise sm.PartsError(f"--parts {path}: not JSON ({e})") from None
    return sm.parts_from_dict(doc)


def main(argv: Sequence[str] | None = None) -> int:
    allow_untested_paths()
    p = ArgParser(prog="python -m h3ms_async bench model", description=__doc__.splitlines()[0])
    p.add_argument(
        "--parts",
        default=None,
        help="JSON of measured parts (schema h3ms_async.speed_parts/1); without it the parts are "
        "measured on this CUDA GPU",
    )
    p.add_argument("--ranks", type=int_list, default=[2, 4, 8], help="rank counts N to predict")
    p.add_argument(
        "--overlap",
        type=float,
        default=0.0,
        help="a further fraction of the exposed exchange hidden behind compute (schedules not "
        "built yet; 0: as --schedule runs)",
    )
    p.add_argument(
        "--schedule",
        default="none",
        help="the split's overlaps to model: none, piecesN, gather, gather+piecesN (the engine's "
        "head_pieces / gather_overlap)",
    )
    p.add_argument(
        "--sparse-attention-ratio",
        type=float,
        default=None,
        help="sparse / dense attention time (default: from the parts' measured sparse_step_ratio)",
    )
    p.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="multiply every compute time (a GPU this much slower than the parts')",
    )
    p.add_argument(
        "--shares", default=None, help="comma-separated relative rank speeds (uneven shares)"
    )
    p.add_argument("--pcie4-gbps", type=float, default=sm.PCIE4_GBPS)
    p.add_argument("--pcie5-gbps", type=float, default=sm.PCIE5_GBPS)
    p.add_argument("--nvlink-gbps", type=float, default=sm.NVLINK_GBPS)
    p.add_argument(
        "--net-gbit", type=float, default=0.0, help="add ranks over hosts on this network (Gb/s)"
    )
    p.add_argument("--gpus-per-host", type=positive_int, default=8, help="with --net-gbit")
    p.add_argument(
        "--host-mem-gbps",
        type=float,
        default=200.0,
        help="host memory bandwidth for measured parts (ASSUMED default: one socket's DDR5)",
    )
    p.add_argument(
        "--tokens", type=positive_int, default=75794, help="measured parts / --validate: tokens"
    )
    p.add_argument(
        "--weights", default="int8", choices=["int8", "bf16"], help="measured parts / --validate"
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="CUDA only: run the real split on logical ranks of one GPU (--validate-ranks) and "
        "print predicted vs measured block time",
    )
    p.add_argument(
        "--validate-ranks",
        type=int_list,
        default=[2, 4],
        help="the logical rank counts --validate runs (default 2,4); validated_on_gpu needs every "
        "one within the bound",
    )
    p.add_argument(
        "--validate-layers",
        type=positive_int,
        default=4,
        help="blocks per validation step; with an overlapped --schedule also the blocks its "
        "compute cost is timed over when the parts are measured",
    )
    p.add_argument(
        "--validate-pattern",
        choices=["gather", "ulysses"],
        default="gather",
        help="the pattern --validate runs (ulysses: with --schedule's head pieces only)",
    )
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    if not 0.0 <= a.overlap <= 1.0:
        p.error(f"--overlap {a.overlap} must be between 0 and 1")
    try:
        schedule = Overlap.from_name(a.schedule)
    except ValueError as exc:
        p.error(f"--schedule: {exc}")
    if a.sparse_attention_ratio is not None and not 0 < a.sparse_attention_ratio <= 1:
        p.error("--sparse-attention-ratio must be in (0, 1] (sparse attention time / dense)")
    if any(n < 1 for n in a.ranks):
        p.error("--ranks must be >= 1")
    if not a.validate_ranks or any(n < 2 for n in a.validate_ranks):
        p.error("--validate-ranks must list rank counts >= 2 (the split needs two ranks)")
    shares = [float(s) for s in a.shares.split(",")] if a.shares else None
    if shares and any(n != len(shares) for n in a.ranks):
        p.error(f"--shares gives {len(shares)} share(s); use it with --ranks {len(shares)}")
    cuda = torch.cuda.is_available()
    if a.validate and not cuda:
        p.error(
            f"--validate needs a CUDA GPU and this torch ({torch.__version__}) sees none; run it "
            "on a GPU machine (on CPU use --parts FILE for predictions)"
        )
    if a.parts is None and not cuda:
        p.error(
            "no --parts FILE and no CUDA GPU to measure the parts on; give --parts (e.g. "
            "benchmarks/speed_parts_h200.json)"
        )
    try:
        parts = (
            load_parts(a.parts)
            if a.parts
            else measure_parts(
                a.tokens, a.weights, a.ranks, 50, a.host_mem_gbps, schedule, a.validate_layers
            )
        )
        res = run(
            parts,
            a.ranks,
            default_links(parts, a),
            overlap=a.overlap,
            schedule=schedule,
            sparse_attention_ratio=a.sparse_attention_ratio,
            compute_scale=a.compute_scale,
            shares=shares,
        )
    except (sm.PartsError, ValueError) as e:
        p.error(str(e))
    res["host_memcpy_GBps_here"] = host_memcpy_gbps()
    res["host_memcpy_note"] = (
        "one tensor copy on this machine, for reference; the model's host_mem_gbps is the parts' "
        "figure (the DMA of N GPUs into one arena, not one CPU thread's copy)"
    )
    if a.validate:
        vparts = (
            parts
            if not a.parts and set(a.validate_ranks) <= set(a.ranks)
            else measure_parts(
                a.tokens,
                a.weights,
                a.validate_ranks,
                50,
                a.host_mem_gbps,
                schedule,
                a.validate_layers,
            )
        )
        res["validation"] = validate(
            vparts,
            a.tokens,
            a.weights,
            a.validate_layers,
            a.validate_ranks,
            schedule,
            a.validate_pattern,
        )
        res["validation_bound_pct"] = VALIDATION_BOUND_PCT
        res["validated_on_gpu"] = within_bound(res["validation"])
    text = json.dumps(res, indent=1)
    if a.out:  # the JSON goes to the file, the table to stdout
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(table(res))
    else:
        print(text)
        print(table(res), file=sys.stderr)
    return 0
