"""``python -m h3ms_async demo``: the reference H3 DiT unsplit, then split across rank workers, compared bit for bit.

The default model is sized to finish in well under a minute on 2 CPU cores (most of it is starting three worker
processes that import torch).  Every size is an option, up to the full H3 width on CUDA ranks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

import torch

from h3ms_async import plans
from h3ms_async.layout import layout_for_tokens
from h3ms_async.lifetime import run_guarded
from h3ms_async.log import ensure_console_handler
from h3ms_async.reference_dit import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.split import SplitOptions, get_engine, release_all_engines

DTYPES = {"int8": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m h3ms_async demo", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="cpu,cpu,cpu", help="one device per rank, e.g. cpu,cpu,cpu or cuda:0,cuda:0,cuda:1")
    p.add_argument("--device", default=None, help="device of the unsplit run (default: the first rank's device)")
    p.add_argument("--tokens", type=int, default=3000, help="packed sequence length S")
    p.add_argument("--layers", type=int, default=6, help="number of DiT blocks")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H (full H3: 5376)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (full H3: 56)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (full H3: 128)")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default: 8/3 of hidden, rounded to 64; H3: 14336)")
    p.add_argument("--weights", choices=sorted(DTYPES), default="int8", help="block weight format")
    p.add_argument("--exchange", choices=["host", "nccl"], default="host", help="rank exchange transport")
    p.add_argument("--exchange-chunks", type=int, default=0, help="pipelined chunks per exchange (0/1: single shot)")
    p.add_argument("--shares", default="", help="relative speed per rank, e.g. 1,1,0.7 (default: equal)")
    p.add_argument("--vram-residency", choices=["auto", "resident", "stream"], default="auto")
    p.add_argument("--steps", type=int, default=2, help="denoising steps to run (each compared)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--serve", type=int, default=None, metavar="PORT",
                   help="serve the status routes and live panel on 127.0.0.1:PORT while running")
    return p


def _config(a: argparse.Namespace) -> DiTConfig:
    ffn = a.ffn or max(64, (a.hidden * 8 // 3) // 64 * 64)
    rope_pairs = min(48, (a.head_dim // 2) // 3 * 3)
    return DiTConfig(hidden=a.hidden, layers=a.layers, heads=a.heads, head_dim=a.head_dim, ffn=ffn,
                     t_dim=max(16, a.hidden // 2), rope_pairs=rope_pairs)


def run(a: argparse.Namespace) -> dict:
    """Run the demo; returns the result object (what ``--json`` prints)."""
    from tqdm import tqdm

    ranks = plans.rank_map(a.ranks)
    shares = plans.parse_shares(a.shares) or None
    cfg = _config(a)
    device = torch.device(a.device or ranks[0])
    dtype = DTYPES[a.weights]
    # Fail on a bad plan before anything heavy starts.
    plans.make_split_plan(ranks, shares, a.tokens, cfg.heads)
    model = ReferenceDiT(cfg, weights=a.weights, seed=a.seed, device=device)
    layout = layout_for_tokens(a.tokens)
    engine = get_engine(ranks, SplitOptions(exchange=a.exchange, exchange_chunks=a.exchange_chunks,
                                            vram_residency=a.vram_residency, shares=shares))
    t = time.perf_counter()
    engine.load_weights(("demo", a.seed, a.weights, cfg), cfg, model.block_weights)
    start_s = time.perf_counter() - t
    steps = []
    bar = tqdm(total=a.steps * 2, desc="demo", unit="pass", file=sys.stderr, disable=a.json)
    for s in range(a.steps):
        inp = make_step_inputs(cfg, layout, a.seed + s, dtype)
        t = time.perf_counter()
        ref = model.forward_blocks(inp.x.clone().to(device), inp.t_emb.to(device), inp.segments,
                                   inp.rope_freqs.to(device)).cpu()
        unsplit_s = time.perf_counter() - t
        bar.update(1)
        t = time.perf_counter()
        out = engine.run_blocks(inp.x, inp.t_emb, inp.segments, inp.rope_freqs, sigma=0.7)
        split_s = time.perf_counter() - t
        bar.update(1)
        diff = float((out.float() - ref.float()).abs().max())
        steps.append({"step": s, "unsplit_s": unsplit_s, "split_s": split_s, "bit_exact": bool(torch.equal(out, ref)),
                      "max_abs_diff": diff})
    bar.close()
    from h3ms_async.status import get_hub
    last = get_hub().recent_steps(1)[-1]
    return {
        "config": {"tokens": layout.seq_len, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
                   "head_dim": cfg.head_dim, "ffn": cfg.ffn, "weights": a.weights, "ranks": ranks,
                   "exchange": engine.transport, "exchange_chunks": a.exchange_chunks, "shares": shares,
                   "unsplit_device": str(device)},
        "worker_start_and_load_s": start_s,
        "steps": steps,
        "ranks": last["ranks"],
        "bit_exact": all(s["bit_exact"] for s in steps),
        "max_abs_diff": max(s["max_abs_diff"] for s in steps),
    }


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"\nreference H3 DiT: {c['tokens']} tokens x {c['layers']} blocks, hidden {c['hidden']}, "
          f"{c['heads']} heads x {c['head_dim']}, ffn {c['ffn']}, {c['weights']} weights")
    print(f"split over {len(c['ranks'])} ranks ({','.join(c['ranks'])}), exchange {c['exchange']}"
          f"{' x' + str(c['exchange_chunks']) if c['exchange_chunks'] > 1 else ''}; "
          f"workers started and weights loaded in {res['worker_start_and_load_s']:.1f}s\n")
    for s in res["steps"]:
        print(f"step {s['step']}: unsplit {s['unsplit_s']:.3f}s   split {s['split_s']:.3f}s   "
              f"{'equal' if s['bit_exact'] else 'DIFFERENT'}")
    print("\nlast split step, per rank:")
    print(f"{'rank':>4} {'device':>8} {'tokens':>13} {'heads':>7} {'compute s':>10} {'exchange s':>11} "
          f"{'wait s':>8} {'MB moved':>9}")
    for r in res["ranks"]:
        print(f"{r['rank']:>4} {r['device']:>8} {r['tokens'][0]:>6}-{r['tokens'][1]:<6} "
              f"{r['heads'][0]:>3}-{r['heads'][1]:<3} {r['compute_s']:>10.3f} {r['exchange_s']:>11.3f} "
              f"{r['wait_s']:>8.3f} {r['moved_bytes'] / 1e6:>9.2f}")
    print(f"\nbit-exact: {'yes' if res['bit_exact'] else 'no'} (max abs difference {res['max_abs_diff']:g})")


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not a.json:
        ensure_console_handler()
    stop = None

    def body() -> int:
        nonlocal stop
        if a.serve is not None:
            from h3ms_async.serve import start_background_server
            url, stop = start_background_server(port=a.serve)
            print(f"live panel: {url}/h3multistream/panel", file=sys.stderr)
        try:
            res = run(a)
        except (ValueError, plans.GPUSelectionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps(res, indent=2))
        else:
            print_table(res)
        return 0 if res["bit_exact"] else 1

    def release() -> None:
        release_all_engines()
        if stop is not None:
            stop()

    return run_guarded(body, release, "demo")
