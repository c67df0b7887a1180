"""Split benchmark: the reference H3 DiT block stack unsplit vs split across rank workers, side by
side in one run.

``python -m h3ms_async bench split [options]`` (or :func:`run_bench_split`) prints one JSON object:

* the unsplit wall time per step and per block (``--device``; CUDA clocks are read after
  ``torch.cuda.synchronize``);
* for every transport x chunking x overlap variant (``--exchange host,nccl`` x ``--chunks 0,8`` x
  ``--overlap none,pieces4,gather``; nccl runs as gloo on CPU ranks and is never chunked; cuda_ipc,
  the GPU-direct exchange, needs CUDA ranks; ``none`` is the no-exchange baseline, its output not
  compared), on the same workers and weights: split
  wall time per step and per block, per-rank compute / copy / wait seconds, bytes moved, doorbell
  signals per block and the estimated signalling cost per block;
* where a block's time goes, from the step records' per-block timings averaged over the timed
  steps (``block_ms``, per rank and over every rank): compute, exchange copy, the copy hidden
  behind compute, the exposed wait, and the exposed wait as a percentage of the block; with the
  ``none`` baseline each variant's block over the baseline's (``comparisons``);
* a tiny-payload host-exchange probe that measures what one more chunk round (and so one doorbell
  signal) costs;
* a bit-exact check of every split output (warm-up steps included) against the unsplit output of the
  same inputs;
* machine facts (CPU model and count, load average, RAM, torch version, device names).

Warm-up steps are excluded from timing.  The defaults finish in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from h3ms_async.dit.exactness import NO_OVERLAP, Overlap
from h3ms_async.dit.layout import layout_for_tokens
from h3ms_async.dit.options import BASELINE_EXCHANGE, EXCHANGES, SplitOptions, parse_pattern
from h3ms_async.dit.reference import (
    WEIGHT_KINDS,
    DiTConfig,
    ReferenceDiT,
    StepInputs,
    make_step_inputs,
)
from h3ms_async.dit.split import SplitEngine
from h3ms_async.dit.tested_paths import allow_untested_paths
from h3ms_async.log import ensure_console_handler, get_logger
from h3ms_async.runtime import plans
from h3ms_async.runtime.spawn import cpu_thread_env
from h3ms_async.status.hub import get_hub
from h3ms_async.status.records import block_means
from h3ms_async.tools.bench.exchange import ProbeGroup
from h3ms_async.tools.cli import ArgParser, add_pattern_argument, int_list
from workers.dit.protocol import Transport
from workers.transports.arena import ArenaLayout
from workers.transports.dist import check_nccl_rank_map

log = get_logger("bench")

MODEL_DTYPES = {"int8": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}
PROBE_CHUNKS = (1, 8)
SIGMA = 0.7


def bench_config(
    hidden: int, layers: int, heads: int, head_dim: int, ffn: int | None = None
) -> DiTConfig:
    """A block-stack config from the CLI sizes; t_dim and rope pairs follow H3's ratios (2688 and 48
    at full width)."""
    ffn = ffn or max(64, (hidden * 8 // 3) // 64 * 64)
    rope_pairs = min(48, (head_dim // 2) // 3 * 3)
    if rope_pairs < 3:
        raise ValueError(f"head_dim={head_dim} is too small for the rope table; use head_dim >= 6")
    return DiTConfig(
        hidden=hidden,
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        ffn=ffn,
        t_dim=max(16, hidden // 2),
        rope_pairs=rope_pairs,
    )


def machine_info(devices: Sequence[str]) -> dict:
    """What the numbers were measured on."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    cuda_devices: dict[str, str] = {}
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "load_avg_1_5_15": [round(v, 2) for v in os.getloadavg()],
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads_here": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": cuda_devices,
    }
    for name in sorted({d for d in devices if d.startswith("cuda")}):
        cuda_devices[name] = torch.cuda.get_device_name(torch.device(name))
    return info


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without this the clock would stop before the work is done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _on(inp: StepInputs, device: torch.device) -> tuple:
    segs = [
        (a, b, row.to(device) if isinstance(row, torch.Tensor) else row)
        for a, b, row in inp.segments
    ]
    return inp.x.clone().to(device), inp.t_emb.to(device), segs, inp.rope_freqs.to(device)


def unsplit_step(model: ReferenceDiT, inp: StepInputs) -> tuple[float, torch.Tensor]:
    """One step through the unsplit block loop on the model's device: (seconds, output on the
    CPU)."""
    device = model.device
    x, t_emb, segs, rope = _on(inp, device)
    _sync(device)
    t = time.perf_counter()
    out = model.forward_blocks(x, t_emb, segs, rope)
    _sync(device)
    return time.perf_counter() - t, out.cpu()


def signal_probe(world: int, rounds: int) -> dict | None:
    """Cost of one more chunk round of the host exchange at a tiny payload (so almost all of it is
    signalling: sequence words, eventfd doorbells, wake-ups), measured with ``world`` CPU probe
    processes.

    ``per_signal_us`` spreads that cost over the doorbells a rank sends per extra chunk round
    (counted, not assumed).  None for a single rank (no peers, no signals) or ``rounds`` = 0.
    """
    if world < 2 or rounds < 1:
        return None
    n = 8 * world
    tiny = ArenaLayout.plan(
        world, plans.partition(n, [1.0] * world), plans.partition(n, [1.0] * world), n, "bfloat16"
    )
    case = {
        "name": "tiny",
        "transport": "host",
        "layout": tiny,
        "chunks": list(PROBE_CHUNKS),
        "rounds": rounds,
        "blocks": 1,
        "patterns": 2,
    }
    with ProbeGroup(world, [case]) as grp:
        grp.start()
        recs = grp.results(timeout_s=300)
    bad = [r for r in recs if not r["ok"]]
    if bad:
        raise RuntimeError(f"signal probe (world {world}): ranks failed: {bad}")
    # Per chunk count: slowest rank's median (gather + all-to-all) time, and signals per op.
    block_us, signals_per_op = [], []
    for ri in range(len(PROBE_CHUNKS)):
        block_us.append(
            max(
                statistics.median(r["cases"][0]["runs"][ri]["gather_s"])
                + statistics.median(r["cases"][0]["runs"][ri]["a2a_s"])
                for r in recs
            )
            * 1e6
        )
        stats = [r["cases"][0]["runs"][ri]["stats"] for r in recs]
        signals_per_op.append(statistics.fmean(s["signals_sent"] / max(1, s["ops"]) for s in stats))
    extra_rounds = PROBE_CHUNKS[1] - PROBE_CHUNKS[0]
    per_round_us = (block_us[1] - block_us[0]) / (2 * extra_rounds)  # two ops per block
    signals_per_round = (signals_per_op[1] - signals_per_op[0]) / extra_rounds
    return {
        "world": world,
        "rounds": rounds,
        "payload_bytes_per_op": n * n * 2,
        "ranks": "CPU probe processes",
        "block_us_by_chunks": dict(zip(map(str, PROBE_CHUNKS), block_us)),
        "extra_chunk_round_us": per_round_us,
        "signals_per_chunk_round_per_rank": signals_per_round,
        "per_signal_us": per_round_us / signals_per_round if signals_per_round else None,
    }


def _variants(
    exchanges: Sequence[str], chunks: Sequence[int], overlaps: Sequence[Overlap]
) -> list[tuple[str, int, Overlap]]:
    out = []
    for ex in exchanges:
        # torch.distributed collectives are not chunked (NCCL pipelines internally): one chunk
        # variant is enough.
        for c in chunks if ex == "host" else (0,):
            for o in overlaps:
                if (ex, c, o) not in out:
                    out.append((ex, c, o))
    return out


class VariantRun:
    """One transport/chunking variant on the shared engine: runs steps, checks each output, keeps
    the timings of the timed (non-warm-up) steps and the per-rank numbers of their step records."""

    def __init__(self, engine: SplitEngine, exchange: str, chunks: int, overlap: Overlap) -> None:
        self.engine, self.exchange, self.chunks, self.overlap = engine, exchange, chunks, overlap
        self.overlap_ran = NO_OVERLAP
        self.transport = exchange
        self.walls: list[float] = []
        self.engine_walls: list[float] = []
        self.per_rank: list[list[dict]] = []
        self.diffs: list[float] = []
        self.exact = True

    @property
    def label(self) -> str:
        name = (
            f"{self.transport} x{max(self.chunks, 1)}"
            if self.exchange == "host"
            else self.transport
        )
        return f"{name} {self.overlap.name}" if self.overlap != NO_OVERLAP else name

    def step(self, model: ReferenceDiT, inp: StepInputs, ref: torch.Tensor, timed: bool) -> None:
        """One step of ``model`` on the engine; its modulation rows are computed on the model's
        device inside the timed span, as the node computes them before every split step."""
        t = time.perf_counter()
        out = self.engine.run_blocks(
            inp.x,
            model.modulation(inp.t_emb),
            inp.segments,
            inp.rope_freqs,
            exchange=self.exchange,
            exchange_chunks=self.chunks,
            head_pieces=self.overlap.head_pieces,
            gather_overlap=self.overlap.gather,
            gather_ahead=self.overlap.ahead,
            sigma=SIGMA,
        )
        dt = time.perf_counter() - t
        rec = get_hub().recent_steps(1)[-1]
        self.transport = rec["exchange"]
        self.overlap_ran = Overlap(rec["head_pieces"], rec["gather_overlap"], rec["gather_ahead"])
        # the baseline's ranks get nothing from their peers: its output is not the model's
        same = self.exchange == BASELINE_EXCHANGE or bool(torch.equal(out, ref))
        self.exact = self.exact and same
        # The float difference costs seconds at full width (75794 x 5376); compute it only when
        # there is one.
        self.diffs.append(0.0 if same else float((out.float() - ref.float()).abs().max()))
        log.info(
            "split %s: %.3f s, %s%s",
            self.label,
            dt,
            "no exchange, not compared"
            if self.exchange == BASELINE_EXCHANGE
            else "bit-exact"
            if same
            else f"DIFFERS (max {self.diffs[-1]:g})",
            "" if timed else " (warm-up)",
        )
        if timed:
            self.walls.append(dt)
            self.engine_walls.append(rec["wall_s"])
            # The hub record has no signal count; the engine keeps the workers' raw results (same
            # rank order).
            self.per_rank.append(
                [
                    {**r, "signals": raw.signals}
                    for r, raw in zip(rec["ranks"], self.engine.last_rank_results)
                ]
            )

    def summary(self, layers: int, probe: dict | None) -> dict:
        per_signal = probe.get("per_signal_us") if probe and self.exchange == "host" else None
        ranks = []
        for r in range(self.engine.ranks):
            rows = [step[r] for step in self.per_rank]
            mean = {
                key: statistics.fmean(row[key] for row in rows)
                for key in ("compute_s", "exchange_s", "wait_s", "moved_bytes", "signals")
            }
            vram = [
                row["vram_peak_bytes"] for row in rows if row.get("vram_peak_bytes") is not None
            ]
            signals_per_block = mean["signals"] / layers
            ranks.append(
                {
                    "rank": r,
                    "device": rows[0]["device"],
                    "tokens": rows[0]["tokens"],
                    "heads": rows[0]["heads"],
                    "compute_s": mean["compute_s"],
                    "exchange_copy_s": mean["exchange_s"],
                    "wait_s": mean["wait_s"],
                    "moved_bytes": int(mean["moved_bytes"]),
                    "signals_per_step": mean["signals"],
                    "signals_per_block": signals_per_block,
                    "wait_per_block_ms": mean["wait_s"] / layers * 1e3,
                    "signalling_per_block_us_est": signals_per_block * per_signal
                    if per_signal is not None
                    else None,
                    "vram_peak_bytes": max(vram) if vram else None,
                    "block_ms": block_means(b for row in rows for b in row["per_block"]),
                }
            )
        mean_wall = statistics.fmean(self.walls)
        return {
            "label": self.label,
            "exchange": self.exchange,
            "transport": self.transport,
            "chunks": max(self.chunks, 1) if self.exchange == "host" else None,
            "overlap": self.overlap.name,
            "overlap_ran": self.overlap_ran.name,
            "step_s": self.walls,
            "step_mean_s": mean_wall,
            "step_min_s": min(self.walls),
            "block_mean_s": mean_wall / layers,
            "engine_wall_mean_s": statistics.fmean(self.engine_walls),
            "moved_bytes_per_step": sum(r["moved_bytes"] for r in ranks),
            "block_ms": block_means(
                b for step in self.per_rank for row in step for b in row["per_block"]
            ),
            "ranks": ranks,
            "bit_exact": None if self.exchange == BASELINE_EXCHANGE else self.exact,
            "max_abs_diff": max(self.diffs),
        }


def _comparisons(unsplit: dict, variants: list[dict]) -> dict:
    """Ratios measured side by side in this run (> 1: the second-named is faster)."""
    ran = [v for v in variants if "skipped" not in v]
    out: dict = {
        "unsplit_over_split": {v["label"]: unsplit["step_mean_s"] / v["step_mean_s"] for v in ran}
    }
    one_call = [v for v in ran if v["overlap"] == "none"]
    serial = next((v for v in one_call if v["exchange"] == "host" and v["chunks"] == 1), None)
    if serial is not None:
        out["host_serial_over_chunked"] = {
            v["label"]: serial["step_mean_s"] / v["step_mean_s"]
            for v in one_call
            if v["exchange"] == "host" and v["chunks"] > 1
        }
    overlapped = {}
    for v in ran:
        base = next(
            (o for o in one_call if (o["exchange"], o["chunks"]) == (v["exchange"], v["chunks"])),
            None,
        )
        if v["overlap"] != "none" and base is not None:
            overlapped[v["label"]] = base["step_mean_s"] / v["step_mean_s"]
    if overlapped:
        out["no_overlap_over_overlap"] = overlapped
    dist = next((v for v in one_call if v["exchange"] == "nccl"), None)
    if dist is not None and serial is not None:
        out["host_serial_over_" + dist["transport"]] = serial["step_mean_s"] / dist["step_mean_s"]
    base = next((v for v in ran if v["exchange"] == BASELINE_EXCHANGE), None)
    if base is not None and base["block_ms"]["block_ms"] > 0:
        out["block_over_no_exchange"] = {
            v["label"]: v["block_ms"]["block_ms"] / base["block_ms"]["block_ms"]
            for v in ran
            if v is not base
        }
    return out


def run_bench_split(
    ranks: Sequence[str] = ("cpu", "cpu"),
    device: str | None = None,
    tokens: int = 2048,
    layers: int = 4,
    hidden: int = 512,
    heads: int = 8,
    head_dim: int = 64,
    ffn: int | None = None,
    weights: str = "int8",
    steps: int = 3,
    warmup: int = 1,
    chunks: Sequence[int] = (0, 8),
    exchanges: Sequence[str] = ("host", "nccl"),
    seed: int = 1234,
    probe_rounds: int = 50,
    print_json: bool = True,
    overlaps: Sequence[str] = ("none",),
    pattern: str = "gather",
) -> dict:
    """Run the benchmark; prints the JSON result (unless ``print_json`` is false) and returns it.

    ``ranks``: one device per rank; ``device``: the unsplit run's device (default: the first
    rank's).  Raises ValueError / GPUSelectionError for bad sizes or rank maps before any worker
    starts.
    """
    ranks = list(ranks)
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights={weights!r}; use one of {', '.join(WEIGHT_KINDS)}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    known = (*EXCHANGES, BASELINE_EXCHANGE)
    bad = [e for e in exchanges if e not in known]
    if bad or not exchanges:
        raise ValueError(f"exchange {bad or '(none)'}: choose from {', '.join(known)}")
    if "host" in exchanges and not chunks:
        raise ValueError("chunks: give at least one host exchange chunk count (e.g. 0 or 0,8)")
    for c in chunks:
        SplitOptions(exchange_chunks=c)  # its range check, before any worker starts
    if not overlaps:
        raise ValueError("overlaps: give at least one (none: no overlap)")
    asked = [Overlap.from_name(o) for o in overlaps]
    for o in asked:
        SplitOptions(head_pieces=o.head_pieces, gather_ahead=o.ahead)
    cfg = bench_config(hidden, layers, heads, head_dim, ffn)
    # a bad plan fails before anything heavy starts
    plans.make_split_plan(ranks, None, tokens, cfg.heads)
    skipped = []
    if all(d.startswith("cuda") for d in ranks) and "nccl" in exchanges:
        try:
            check_nccl_rank_map(ranks)
        except ValueError as exc:
            skipped.append({"exchange": "nccl", "skipped": str(exc)})
    elif "nccl" in exchanges and any(d.startswith("cuda") for d in ranks):
        skipped.append(
            {
                "exchange": "nccl",
                "skipped": "mixed CPU/CUDA rank map: torch.distributed needs one backend for every "
                "rank; use all-CPU or all-CUDA ranks",
            }
        )
    variants = _variants(
        [e for e in exchanges if not any(s["exchange"] == e for s in skipped)],
        chunks,
        asked,
    )
    if not variants:
        raise ValueError(
            f"no exchange variant can run on rank map {ranks}: {skipped[0]['skipped']}"
        )
    dev = torch.device(device or ranks[0])
    machine = machine_info([*ranks, str(dev)])

    layout = layout_for_tokens(tokens)
    dtype = MODEL_DTYPES[weights]
    t = time.perf_counter()
    model = ReferenceDiT(cfg, weights=weights, seed=seed, device=dev).materialize()
    materialize_s = time.perf_counter() - t
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    probe = signal_probe(len(ranks), probe_rounds)
    # Workers built for the GPU-direct exchange see every rank's GPU and serve the other exchanges
    # too; workers built for another cannot open their peers' buffers across GPUs.
    gpu_direct = any(ex == Transport.CUDA_IPC for ex, _, _ in variants)
    engine = SplitEngine(
        ranks,
        SplitOptions(
            exchange=Transport.CUDA_IPC if gpu_direct else Transport(variants[0][0]),
            exchange_chunks=variants[0][1],
            pattern=parse_pattern(pattern),
        ),
    )
    runs = [VariantRun(engine, ex, c, o) for ex, c, o in variants]
    unsplit_s: list[float] = []
    try:
        t = time.perf_counter()
        engine.load_weights(("bench-split", seed, weights, cfg), cfg, model.block_weights)
        load_s = time.perf_counter() - t
        # Step k runs unsplit, then through every variant, before step k+1: machine load that drifts
        # during the run hits every variant alike, and only one reference output is held at a time
        # (full width: ~0.8 GB).
        for k in range(warmup + steps):
            timed = k >= warmup
            inp = make_step_inputs(cfg, layout, seed + k, dtype)
            dt, ref = unsplit_step(model, inp)
            log.info(
                "unsplit step %d/%d: %.3f s%s",
                k + 1,
                warmup + steps,
                dt,
                "" if timed else " (warm-up)",
            )
            if timed:
                unsplit_s.append(dt)
            for run in runs:
                run.step(model, inp, ref, timed)
    finally:
        engine.release()
    mean = statistics.fmean(unsplit_s)
    unsplit = {
        "device": str(dev),
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "step_s": unsplit_s,
        "step_mean_s": mean,
        "step_min_s": min(unsplit_s),
        "block_mean_s": mean / cfg.layers,
        "vram_peak_bytes": int(torch.cuda.max_memory_allocated(dev))
        if dev.type == "cuda"
        else None,
    }
    results = [run.summary(cfg.layers, probe) for run in runs]
    results += skipped
    ran = [v for v in results if "skipped" not in v]
    compared = [v for v in ran if v["exchange"] != BASELINE_EXCHANGE]
    machine["load_avg_1_5_15_end"] = [round(v, 2) for v in os.getloadavg()]
    report = {
        "bench": "split",
        "machine": machine,
        "config": {
            "tokens": layout.seq_len,
            "layout": list(layout.signature),
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "head_dim": cfg.head_dim,
            "ffn": cfg.ffn,
            "t_dim": cfg.t_dim,
            "weights": weights,
            "model_dtype": str(dtype).removeprefix("torch."),
            "steps": steps,
            "warmup": warmup,
            "seed": seed,
            "ranks": ranks,
            "unsplit_device": str(dev),
            "rank_threads": cpu_thread_env(ranks).get(
                "OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS")
            ),
            "chunks": list(chunks),
            "overlaps": [o.name for o in asked],
            "pattern": pattern,
            "exchanges": list(exchanges),
        },
        "setup_s": {"materialize_weights": materialize_s, "workers_start_and_load": load_s},
        "unsplit": unsplit,
        "split": results,
        "signal_probe": probe,
        "comparisons": _comparisons(unsplit, results),
        "bit_exact": all(v["bit_exact"] for v in compared),
        "max_abs_diff": max((v["max_abs_diff"] for v in compared), default=0.0),
    }
    if print_json:
        print(json.dumps(report, indent=2))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    allow_untested_paths()
    p = ArgParser(prog="python -m h3ms_async bench split", description=__doc__.splitlines()[0])
    p.add_argument(
        "--ranks", default="cpu,cpu", help="one device per rank, e.g. cpu,cpu,cpu or cuda:0,cuda:1"
    )
    p.add_argument(
        "--device",
        default=None,
        help="device of the unsplit run (default: the first rank's device)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=2048,
        help="packed sequence length (H3 benchmarks: 39975, 75794)",
    )
    p.add_argument("--layers", type=int, default=4, help="DiT blocks")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (full H3: 5376)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (full H3: 56)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (full H3: 128)")
    p.add_argument(
        "--ffn",
        type=int,
        default=None,
        help="MLP width (default: 8/3 of hidden, rounded to 64; H3: 14336)",
    )
    p.add_argument("--weights", choices=WEIGHT_KINDS, default="int8", help="block weight format")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed (but checked) steps before the timed ones"
    )
    p.add_argument(
        "--chunks",
        type=int_list,
        default=[0, 8],
        help="host exchange chunk counts to compare (0/1: single shot)",
    )
    add_pattern_argument(p)
    p.add_argument(
        "--overlap",
        default="none",
        help="overlaps to compare: none, piecesN (attention in N head pieces, each moved while the "
        "next computes), gather (qkv on the gathered rows as they arrive), aheadN (each block's "
        "tail in N row pieces feeding the next gather), joined by + (gather+pieces4+ahead4)",
    )
    p.add_argument(
        "--exchange",
        default="host,nccl",
        help="transports to compare: host, nccl (gloo on CPU ranks), cuda_ipc (GPU-direct, CUDA "
        "ranks), none (the no-exchange baseline: each rank computes its shard alone)",
    )
    p.add_argument(
        "--probe-rounds", type=int, default=50, help="tiny-payload signal probe rounds (0: skip)"
    )
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    ensure_console_handler()
    try:
        run_bench_split(
            plans.rank_map(a.ranks),
            a.device,
            a.tokens,
            a.layers,
            a.hidden,
            a.heads,
            a.head_dim,
            a.ffn,
            a.weights,
            a.steps,
            a.warmup,
            a.chunks,
            [e.strip() for e in a.exchange.split(",") if e.strip()],
            a.seed,
            a.probe_rounds,
            overlaps=[o.strip() for o in a.overlap.split(",") if o.strip()],
            pattern=a.pattern,
        )
    except (ValueError, plans.GPUSelectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
