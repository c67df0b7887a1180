"""``python -m h3ms_async bench gpu``: the split at full H3 width on logical ranks of one CUDA GPU,
in one run.

Measures, side by side in one process tree (JSON to stdout and ``--out``/bench_gpu.json):

* pinned copy bandwidth from and into a CUDA-registered shm segment (the path the host exchange
  uses);
* parity: split on 2 and 4 logical ranks vs the unsplit run in this process, int8 and bf16 weights,
  exchange_chunks 0 and 8, and with 8 chunks each overlap of ``--overlap`` (attention in head
  pieces moved while the next computes, the qkv projection on the gathered rows as they arrive,
  both), weights resident and streamed, every output compared with ``torch.equal``;
* overhead at each token count: unsplit per-block time, split per-block time, and the "none"
  baseline (the same ranks computing their shards with no exchange, begun together:
  ``split.BASELINE_START_LEAD_S``; two CUDA contexts time-slicing one GPU for the whole step, as
  the split's do), so the split's own overhead is split / baseline;
* where the time goes per rank (compute / copy / wait) and the host exchange's achieved bandwidth;
* where a block's time goes, from the step records' per-block timings (CUDA events, read once per
  step) of each run's best step (``block_ms``: compute, exchange copy, the copy hidden behind
  compute, the exposed wait, the exposed wait as % of the block; per rank in ``block_ms_by_rank``),
  and per case and rank count each split's block over the no-exchange baseline's of the same ranks
  (``split2_*_block_vs_baseline``, ``split4_...``) and its exposed exchange as % of the block
  (``*_exposed_pct``);
* with ``--exchange host,cuda_ipc,cuda_ipc_events``, host staging and the GPU-direct exchange
  (its copies waited for on the host, and ordered by CUDA IPC events) side by side: every variant
  above in each, on the same workers and weights (``split2_cuda_ipc_x8...``,
  ``split2_cuda_ipc_events_x8...`` in the summary);
* streamed vs resident step time.

This process (the stand-in for ComfyUI's, which is long warm when a split starts) runs one unsplit
pass per shape first; the workers are not warmed by the benchmark: they warm their attention up
themselves when they load weights (a fresh CUDA process's first SDPA call can take cuDNN's kernel
and later calls FlashAttention's), so every split step, the first included, is compared with
``torch.equal``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Sequence

import msgspec
import torch

from h3ms_async.dit.exactness import Overlap
from h3ms_async.dit.layout import layout_for_tokens
from h3ms_async.dit.options import SplitOptions, parse_pattern
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.split import SplitEngine, release_all_engines
from h3ms_async.dit.tested_paths import allow_untested_paths
from h3ms_async.status.hub import get_hub
from h3ms_async.status.records import block_means
from h3ms_async.tools.cli import ArgParser, add_pattern_argument, int_list, positive_int
from workers.dit.loop import BlockInputs, block_forward_unsplit
from workers.dit.protocol import IpcSync, Residency, Transport
from workers.runtime.shm import Segment, register_cuda

FULL = {
    "hidden": 5376,
    "heads": 56,
    "head_dim": 128,
    "ffn": 14336,
    "t_dim": 2688,
    "rope_pairs": 48,
}


#: The exchanges ``bench gpu --exchange`` can time side by side (host staging first: the default),
#: each as (``exchange``, ``ipc_sync``): the GPU-direct exchange with its copies waited for on the
#: host, and ordered by CUDA IPC events.
STAGED: dict[str, tuple[Transport, IpcSync | None]] = {
    Transport.HOST.value: (Transport.HOST, None),
    Transport.CUDA_IPC.value: (Transport.CUDA_IPC, IpcSync.HOST),
    f"{Transport.CUDA_IPC.value}_events": (Transport.CUDA_IPC, IpcSync.EVENTS),
}


def staged(name: str) -> tuple[Transport, IpcSync | None]:
    """(transport, ipc_sync) of a timed variant's exchange: a :data:`STAGED` name, or ``none`` (the
    no-exchange baseline)."""
    return STAGED.get(name) or (Transport(name), None)


#: The overlaps ``bench gpu`` times by default (``exactness.Overlap.from_name``).
OVERLAPS = ("none", "pieces4", "gather", "gather+pieces4")


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> dict:
    """GB/s of host<->device copies from/into a registered shm segment, and H2D from an unregistered
    one."""
    out = _copy_rates(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), nbytes, reps)
    torch.cuda.empty_cache()  # the probe buffer is gone with _copy_rates: free it before the runs
    return out


def _copy_rates(buf: torch.Tensor, nbytes: int, reps: int) -> dict[str, float]:
    out = {}
    for registered in (True, False):
        seg = Segment.create(nbytes, "bwprobe")
        try:
            if registered:
                register_cuda(seg, "cuda")
            host = seg.base_tensor()[:nbytes]
            host.fill_(1)
            dirs = (
                (
                    ("h2d", functools.partial(buf.copy_, host, non_blocking=True)),
                    ("d2h", functools.partial(host.copy_, buf, non_blocking=True)),
                )
                if registered
                else (("h2d", functools.partial(buf.copy_, host, non_blocking=True)),)
            )
            for name, fn in dirs:
                best = float("inf")
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - t)
                out[f"{name}_{'registered' if registered else 'unregistered'}_GBps"] = (
                    nbytes / best / 1e9
                )
        finally:
            seg.close()
            seg.unlink()
    return out


class CachedModel:
    """The reference model with every block's weights kept on the GPU (generated once)."""

    def __init__(self, cfg: DiTConfig, kind: str, seed: int) -> None:
        self.model = ReferenceDiT(cfg, weights=kind, seed=seed, device="cuda").materialize()
        self.cfg = cfg
        self.blocks = [self.model.block_weights(i) for i in range(cfg.layers)]

    def block_weights(self, i: int) -> dict[str, torch.Tensor]:
        return self.blocks[i]

    def modulation(self, t_emb: torch.Tensor) -> torch.Tensor:
        """Every block's adaLN rows for ``t_emb`` (``ReferenceDiT.modulation``)."""
        return self.model.modulation(t_emb)

    def forward(
        self, x: torch.Tensor, t_emb: torch.Tensor, segments, rope: torch.Tensor
    ) -> torch.Tensor:
        c = self.cfg
        mod = self.modulation(t_emb)
        with torch.inference_mode():
            for i, w in enumerate(self.blocks):
                x = block_forward_unsplit(
                    x, w, BlockInputs(mod[i : i + 1], segments, rope), c.heads, c.head_dim, c.eps
                )
        return x


def _unsplit(model: CachedModel, inp, steps: int) -> tuple[torch.Tensor, float]:
    dev = torch.device("cuda")
    args = (inp.t_emb.to(dev), inp.segments, inp.rope_freqs.to(dev))
    model.forward(inp.x.to(dev), *args)  # warm this shape
    torch.cuda.synchronize()
    best, out = float("inf"), None
    for _ in range(steps):
        x = inp.x.to(dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.forward(x, *args)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    assert out is not None  # steps >= 1 (--steps is a positive int)
    return out.cpu(), best


def _split(
    eng: SplitEngine, model: CachedModel, inp, steps: int, ref: torch.Tensor | None, **kw
) -> dict:
    best = None
    exact = True
    diff = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        out = eng.run_blocks(inp.x, model.modulation(inp.t_emb), inp.segments, inp.rope_freqs, **kw)
        wall = time.perf_counter() - t
        rec = get_hub().recent_steps(1)[-1]
        if ref is not None:
            exact = exact and bool(torch.equal(out, ref))
            diff = max(diff, float((out.float() - ref.float()).abs().max()))
        if best is None or wall < best["step_wall_s"]:
            best = {
                "step_wall_s": wall,
                "ranks": rec["ranks"],
                "raw": msgspec.to_builtins(eng.last_rank_results),
            }
    assert best is not None  # steps >= 1 (--steps is a positive int)
    best["block_ms"] = block_means(b for r in best["ranks"] for b in r["per_block"])
    best["block_ms_by_rank"] = [block_means(r["per_block"]) for r in best["ranks"]]
    best["rank_wall_s"] = max(r["wall_s"] for r in best["raw"]) if best.get("raw") else None
    if ref is not None:
        best.update(bit_exact=exact, max_abs_diff=diff)
    return best


def run(
    tokens: Sequence[int],
    layers: int,
    kinds: Sequence[str],
    ranks_list: Sequence[int],
    steps: int,
    seed: int = 1234,
    residencies: Sequence[str] = ("resident", "stream"),
    overlaps: Sequence[str] = OVERLAPS,
    pattern: str = "gather",
    exchanges: Sequence[str] = (Transport.HOST.value,),
) -> dict:
    cfg = DiTConfig(layers=layers, **FULL)
    res: dict = {
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cpus": os.cpu_count(),
            # set where the ranks run as MPS clients, each on this share of the multiprocessors
            # (logical ranks that no longer time-slice the GPU)
            "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        },
        "config": {
            "layers": layers,
            **FULL,
            "tokens": list(tokens),
            "steps": steps,
            "overlaps": list(overlaps),
            "pattern": pattern,
            "exchanges": list(exchanges),
        },
        "copy_bandwidth": copy_bandwidth(),
        "runs": [],
    }
    models = {}
    for kind in kinds:
        t = time.perf_counter()
        models[kind] = CachedModel(cfg, kind, seed)
        res.setdefault("weight_generation_s", {})[kind] = time.perf_counter() - t
    refs: dict = {}
    for kind in kinds:
        for n in tokens:
            inp = make_step_inputs(cfg, layout_for_tokens(n), seed + n, torch.bfloat16)
            out, wall = _unsplit(models[kind], inp, steps)
            refs[(kind, n)] = (inp, out)
            res["runs"].append(
                {
                    "kind": kind,
                    "tokens": n,
                    "mode": "unsplit",
                    "step_wall_s": wall,
                    "per_block_s": wall / layers,
                }
            )
            print(f"unsplit {kind} {n}: {wall / layers * 1e3:.1f} ms/block", file=sys.stderr)
    for residency in residencies:
        for nr in ranks_list:
            eng = SplitEngine(
                ["cuda:0"] * nr,
                SplitOptions(vram_residency=Residency(residency), pattern=parse_pattern(pattern)),
            )
            try:
                for kind in kinds:
                    eng.load_weights(("bench-gpu", kind, seed), cfg, models[kind].block_weights)
                    for n in tokens:
                        inp, ref = refs[(kind, n)]
                        variants = [
                            v
                            for exch in exchanges
                            for v in [(exch, 0, "none")] + [(exch, 8, o) for o in overlaps]
                        ]
                        if residency == "resident":
                            variants.append(("none", 0, "none"))
                        for exch, chunks, overlap in variants:
                            asked = Overlap.from_name(overlap)
                            transport, sync = staged(exch)
                            r = _split(
                                eng,
                                models[kind],
                                inp,
                                steps,
                                None if exch == "none" else ref,
                                exchange=transport,
                                ipc_sync=sync,
                                exchange_chunks=chunks,
                                head_pieces=asked.head_pieces,
                                gather_overlap=asked.gather,
                                gather_ahead=asked.ahead,
                            )
                            last = get_hub().recent_steps(1)[-1]
                            r.update(
                                kind=kind,
                                tokens=n,
                                mode=f"split{nr}",
                                residency=residency,
                                exchange=exch,
                                chunks=chunks,
                                overlap=overlap,
                                overlap_ran=Overlap(
                                    last["head_pieces"],
                                    last["gather_overlap"],
                                    last["gather_ahead"],
                                ).name,
                                per_block_s=(r["rank_wall_s"] or r["step_wall_s"]) / layers,
                            )
                            res["runs"].append(r)
                            print(
                                f"split{nr} {residency} {kind} {n} {exch} x{chunks} "
                                f"overlap {overlap} (ran {r['overlap_ran']}): "
                                f"{r['per_block_s'] * 1e3:.1f} ms/block exact={r.get('bit_exact')}",
                                file=sys.stderr,
                            )
            finally:
                eng.release()
    res["summary"] = summarize(res)
    return res


def _summarize_mode(case: dict, mode: str, runs: list[dict], unsplit: dict) -> None:
    """``case``'s ratios for the runs of ``mode`` (``split2``, ``split4``...), keys prefixed
    with it."""
    kind, n = unsplit["kind"], unsplit["tokens"]

    def find(**kw):
        return next((r for r in runs if all(r.get(k) == v for k, v in kw.items())), None)

    split_ms: list[float] = []
    split_blocks: dict[str, float] = {}
    for s in runs:
        if (s["kind"], s["tokens"], s["mode"], s.get("residency")) != (
            kind,
            n,
            mode,
            "resident",
        ) or s.get("exchange") not in STAGED:
            continue
        via = "" if s["exchange"] == Transport.HOST.value else f"_{s['exchange']}"
        name = f"{mode}{via}_x{s['chunks']}" + (
            f"_{s['overlap']}" if s["overlap"] != "none" else ""
        )
        case[f"{name}_ms_per_block"] = s["per_block_s"] * 1e3
        case[f"{name}_vs_unsplit"] = s["per_block_s"] / unsplit["per_block_s"]
        case[f"{name}_exposed_pct"] = s["block_ms"]["exposed_pct"]
        split_blocks[name] = s["block_ms"]["block_ms"]
        if s["overlap"] != "none":
            case[f"{name}_ran"] = s["overlap_ran"]
        split_ms.append(s["per_block_s"] * 1e3)
    base = find(kind=kind, tokens=n, mode=mode, residency="resident", exchange="none")
    if base:
        base_ms = base["per_block_s"] * 1e3
        case[f"{mode}_baseline_no_exchange_ms_per_block"] = base_ms
        case[f"{mode}_baseline_vs_unsplit"] = base["per_block_s"] / unsplit["per_block_s"]
        if split_ms:
            case[f"{mode}_best_vs_baseline"] = min(split_ms) / base_ms
        base_block = base["block_ms"]["block_ms"]
        for name, block in split_blocks.items() if base_block > 0 else ():
            case[f"{name}_block_vs_baseline"] = block / base_block
    plain = {"kind": kind, "tokens": n, "mode": mode, "exchange": "host", "chunks": 8}
    st = find(**plain, residency="stream", overlap="none")
    rs = find(**plain, residency="resident", overlap="none")
    if st and rs:
        case[f"{mode}_stream_vs_resident"] = st["per_block_s"] / rs["per_block_s"]
    if rs and rs.get("raw"):
        moved = sum(x["moved_bytes"] for x in rs["raw"])
        copy = max(x.get("copy_gpu_s", 0.0) for x in rs["raw"]) or None
        case[f"{mode}_host_exchange_GBps_per_rank"] = (
            (moved / len(rs["raw"]) / copy / 1e9) if copy else None
        )


def summarize(res: dict) -> dict:
    """Ratios the GPU issue asks for, from the runs above."""
    runs = res["runs"]
    by_case: list[dict] = []
    out = {
        "all_split_outputs_bit_exact": all(r.get("bit_exact", True) for r in runs),
        "by_case": by_case,
    }
    modes = sorted({r["mode"] for r in runs if r["mode"] != "unsplit"}, key=lambda m: int(m[5:]))
    for r in runs:
        if r["mode"] != "unsplit":
            continue
        case = {
            "kind": r["kind"],
            "tokens": r["tokens"],
            "unsplit_ms_per_block": r["per_block_s"] * 1e3,
        }
        for mode in modes:
            _summarize_mode(case, mode, runs, r)
        by_case.append(case)
    bw = res["copy_bandwidth"]
    out["pinned_copy_GBps"] = min(
        bw.get("h2d_registered_GBps", 0), bw.get("d2h_registered_GBps", 0)
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    allow_untested_paths()
    p = ArgParser(prog="python -m h3ms_async bench gpu", description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens",
        type=int_list,
        default=[39975, 75794],
        help="comma-separated packed sequence lengths",
    )
    p.add_argument("--layers", type=int, default=4, help="blocks (>= 4 for the parity claim)")
    p.add_argument("--weights", default="int8,bf16", help="comma-separated: int8,bf16")
    p.add_argument("--ranks", type=int_list, default=[2, 4], help="logical rank counts on cuda:0")
    p.add_argument(
        "--steps", type=positive_int, default=2, help="timed steps per variant (best is kept)"
    )
    p.add_argument(
        "--residency", default="resident,stream", help="comma-separated: resident,stream"
    )
    p.add_argument(
        "--overlap",
        default=",".join(OVERLAPS),
        help="comma-separated overlaps timed with 8 chunks beside the others: none, piecesN "
        "(attention in N head pieces), gather (qkv on the rows as they arrive), aheadN (tails in "
        "N row pieces feeding the next gather), joined by + (gather+pieces4+ahead4)",
    )
    add_pattern_argument(p)
    p.add_argument(
        "--exchange",
        default=Transport.HOST.value,
        help="comma-separated exchanges timed side by side on the same workers: host (staging "
        "through pinned shared memory), cuda_ipc (GPU-direct, copies waited for on the host), "
        "cuda_ipc_events (GPU-direct, ordered by CUDA IPC events)",
    )
    p.add_argument("--out", default=None, help="directory for bench_gpu.json")
    a = p.parse_args(argv)
    exchanges = [e.strip() for e in a.exchange.split(",") if e.strip()]
    bad = [e for e in exchanges if e not in STAGED]
    if bad or not exchanges:
        p.error(f"--exchange {','.join(bad) or '(none)'}: choose from {', '.join(STAGED)}")
    overlaps = [o.strip() for o in a.overlap.split(",") if o.strip()]
    try:
        for o in overlaps:
            Overlap.from_name(o)
    except ValueError as exc:
        p.error(f"--overlap: {exc}")
    if not torch.cuda.is_available():
        p.error(
            f"bench gpu needs a CUDA GPU and this torch ({torch.__version__}) sees none; run it on "
            "a GPU machine"
        )
    try:
        res = run(
            a.tokens,
            a.layers,
            a.weights.split(","),
            a.ranks,
            a.steps,
            residencies=a.residency.split(","),
            overlaps=overlaps,
            pattern=a.pattern,
            exchanges=exchanges,
        )
    finally:
        release_all_engines()
    text = json.dumps(res, indent=1, default=str)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_gpu.json"), "w") as f:
            f.write(text)
    print(text)
    return 0 if res["summary"]["all_split_outputs_bit_exact"] else 1
