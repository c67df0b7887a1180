"""``python -m h3ms_async bench sparse``: dense vs sparse attention per step at full H3 width,
unsplit and split on logical ranks of one CUDA GPU (JSON to stdout and ``--out``/bench_sparse.json,
rewritten after every variant so a run cut short still leaves what it measured).

Per token count and mode (dense, Sol-Attn at ``--tau``, top-k at ``--keep-percent``): the unsplit
run in this process (``ReferenceDiT.forward_blocks``, every block resident on the GPU) and the split
on each ``--ranks`` count (weights resident, host exchange in 8 chunks). A sparse run starts from
fresh statistics: its first step (the kernel's bootstrap, two producer passes) is reported apart
from the steady steps that reuse the pooled statistics (``first_step_s``, ``step_s`` = best of the
rest). Every split step is compared with ``torch.equal`` against the unsplit step of the same mode
and index (exactness = the same sparse attention on one GPU; dense is compared too). Logical ranks
share one GPU, so the split's times show its overhead, not a multi-GPU speed-up.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from h3ms_async.dit.layout import layout_for_tokens
from h3ms_async.dit.options import SplitOptions
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.dit.sparse import SparseSettings, UnsplitSparse
from h3ms_async.dit.split import SplitEngine, release_all_engines
from h3ms_async.tools.bench.gpu import FULL
from h3ms_async.tools.cli import ArgParser, int_list, positive_int
from workers.dit.ops import ModSegment
from workers.dit.protocol import Residency
from workers.dit.sparse import SparseConfig, kernel_unavailable


def _timed(fn: Callable[[], torch.Tensor], steps: int) -> tuple[list[torch.Tensor], list[float]]:
    outs, walls = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        outs.append(out.cpu())
    return outs, walls


def _row(walls: list[float], layers: int) -> dict:
    first, rest = walls[0], walls[1:] or walls
    return {"first_step_s": first, "step_s": min(rest), "ms_per_block": min(rest) / layers * 1e3}


def run(
    tokens: Sequence[int],
    layers: int,
    weights: str,
    ranks_list: Sequence[int],
    steps: int,
    modes: dict[str, SparseConfig | None],
    out_path: str | None,
    seed: int = 1234,
) -> dict:
    cfg = DiTConfig(layers=layers, **FULL)
    res: dict = {
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "sparse_kernel": kernel_unavailable(torch.device("cuda:0")) or "available",
        },
        "config": {
            "layers": layers,
            **FULL,
            "tokens": list(tokens),
            "weights": weights,
            "steps": steps,
            "modes": {k: (v.as_json() if v else None) for k, v in modes.items()},
        },
        "runs": [],
        "errors": [],
    }

    def save() -> None:
        res["summary"] = summarize(res)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1, default=str)

    t = time.perf_counter()
    model = ReferenceDiT(cfg, weights=weights, seed=seed, device="cuda").materialize()
    res["weight_generation_s"] = time.perf_counter() - t
    refs: dict = {}

    def unsplit_pass(
        x: torch.Tensor,
        dev: tuple[torch.Tensor, list[ModSegment], torch.Tensor],
        sparse: UnsplitSparse | None,
    ) -> torch.Tensor:
        # the input's copy to the GPU is part of each timed pass
        return model.forward_blocks(x.cuda(), *dev, sparse=sparse)

    for n in tokens:
        inp = make_step_inputs(cfg, layout_for_tokens(n), seed + n, torch.bfloat16)
        dev = (inp.t_emb.cuda(), inp.segments, inp.rope_freqs.cuda())
        # warm this shape (a fresh process's first pass differs)
        model.forward_blocks(inp.x.cuda(), *dev)
        for mode, sc in modes.items():
            unsplit = UnsplitSparse(sc) if sc is not None else None
            outs, walls = _timed(functools.partial(unsplit_pass, inp.x, dev, unsplit), steps)
            refs[(n, mode)] = (inp, outs)
            res["runs"].append({"tokens": n, "mode": mode, "ranks": 0, **_row(walls, layers)})
            print(
                f"unsplit {n} {mode}: {res['runs'][-1]['ms_per_block']:.1f} ms/block",
                file=sys.stderr,
            )
            save()
    for nr in ranks_list:
        eng = SplitEngine(
            ["cuda:0"] * nr, SplitOptions(vram_residency=Residency.RESIDENT, exchange_chunks=8)
        )
        try:
            eng.load_weights(("bench-sparse", weights, seed, layers), cfg, model.block_weights)
            for n in tokens:
                for mode, sc in modes.items():
                    inp, ref = refs[(n, mode)]
                    eng.options = replace(eng.options, sparse=sc)
                    eng.end_sampling()  # fresh statistics, as the unsplit run started
                    outs, walls = _timed(
                        functools.partial(
                            eng.run_blocks,
                            inp.x,
                            model.modulation(inp.t_emb),
                            inp.segments,
                            inp.rope_freqs,
                        ),
                        steps,
                    )
                    exact = [bool(torch.equal(o, r)) for o, r in zip(outs, ref)]
                    row = {
                        "tokens": n,
                        "mode": mode,
                        "ranks": nr,
                        **_row(walls, layers),
                        "bit_exact": all(exact),
                        "bit_exact_per_step": exact,
                        "max_abs_diff": max(
                            float((o.float() - r.float()).abs().max()) for o, r in zip(outs, ref)
                        ),
                        "rank_sparse_counts": [r.sparse for r in eng.last_rank_results],
                    }
                    res["runs"].append(row)
                    print(
                        f"split{nr} {n} {mode}: {row['ms_per_block']:.1f} ms/block "
                        f"exact={row['bit_exact']}",
                        file=sys.stderr,
                    )
                    save()
        except Exception as exc:  # noqa: BLE001 - keep what the other rank counts measured
            res["errors"].append(
                {
                    "ranks": nr,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:],
                }
            )
            save()
        finally:
            eng.release()
    save()
    return res


def summarize(res: dict) -> dict:
    """Sparse vs dense per token count and rank count (0 = unsplit), and whether every split step
    was exact."""
    runs = res["runs"]
    by: dict = {}
    for r in runs:
        by.setdefault((r["tokens"], r["ranks"]), {})[r["mode"]] = r
    cases = []
    for (n, nr), modes in sorted(by.items()):
        dense = modes.get("dense")
        case = {"tokens": n, "ranks": nr, **{f"{m}_step_s": r["step_s"] for m, r in modes.items()}}
        if dense:
            case.update(
                {
                    f"{m}_speedup_vs_dense": dense["step_s"] / r["step_s"]
                    for m, r in modes.items()
                    if m != "dense"
                }
            )
        cases.append(case)
    split = [r for r in runs if r["ranks"]]
    return {
        "all_split_steps_bit_exact": bool(split)
        and all(r["bit_exact"] for r in split)
        and not res["errors"],
        "by_case": cases,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="python -m h3ms_async bench sparse", description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int_list, default=[75794], help="comma-separated packed sequence lengths"
    )
    p.add_argument("--layers", type=positive_int, default=4, help="blocks at full H3 width")
    p.add_argument(
        "--weights", choices=("int8", "bf16"), default="int8", help="block weight format"
    )
    p.add_argument("--ranks", type=int_list, default=[2, 4], help="logical rank counts on cuda:0")
    p.add_argument(
        "--steps", type=int, default=3, help="steps per variant, >= 2 (the first is reported apart)"
    )
    p.add_argument("--tau", type=float, default=1.3, help="Sol-Attn threshold")
    p.add_argument(
        "--keep-percent", type=float, default=10.0, help="top-k: percent of key blocks kept"
    )
    p.add_argument("--out", default=None, help="directory for bench_sparse.json")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error(
            f"--steps {a.steps}: give at least 2 (the first sparse step bootstraps the statistics)"
        )
    if any(r < 1 or r > FULL["heads"] for r in a.ranks):
        p.error(
            f"--ranks {a.ranks}: each rank count must be between 1 and {FULL['heads']} (one head "
            "per rank)"
        )
    try:
        sol = SparseSettings(method="sol-attn", tau=a.tau, start_percent=0.0, min_tokens=0).resolve(
            None, a.layers
        )
        topk = SparseSettings(
            method="top-k", keep_percent=a.keep_percent, start_percent=0.0, min_tokens=0
        ).resolve(None, a.layers)
    except ValueError as exc:
        p.error(str(exc))
    if not torch.cuda.is_available():
        p.error(
            f"bench sparse needs a CUDA GPU and this torch ({torch.__version__}) sees none; run it "
            "on a GPU machine (comfy-kitchen has no CPU sparse attention kernel)"
        )
    out_path = None
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        out_path = os.path.join(a.out, "bench_sparse.json")
    try:
        res = run(
            a.tokens,
            a.layers,
            a.weights,
            a.ranks,
            a.steps,
            {"dense": None, "sol-attn": sol, "top-k": topk},
            out_path,
        )
    finally:
        release_all_engines()
    print(json.dumps(res, indent=1, default=str))
    return 0 if res["summary"]["all_split_steps_bit_exact"] else 1
