"""``python -m h3ms_async bench invariance``: the row and head invariance table of H3's shapes on
this device.

Prints one JSON object (also to ``--out``):

* ``linears``: per weight kind (bf16, int8, int8 with ConvRot, as the ops compute them), per full
  product ``M`` (``--products``, default H3's 9355 and 78491 rows) and per linear of the block: for
  each row count of ``--rows`` (log-spaced, 1 ... 39245), whether a shard of that many rows taken
  from the start, the middle and the end of the product gives the unsplit call's bits
  (``torch.equal``), and the largest difference;
* ``attention``: per kernel (SDPA under ComfyUI's backend policy, kitchen INT8 attention where
  available) and sequence length, for each head count 1 ... heads-1, whether that head group attends
  to the unsplit call's bits, beside what the old flash-tiles rule (now a prior) would have said;
* ``engine``: what the split engine now does with a 2-rank plan whose first rank gets ``n`` rows
  (exact, adjusted to which shard sizes, or unsplit), from the same measurements and the engine's
  own candidate order;
* ``probe_cost``: the probe's one-time cost for a 2-rank plan at full width against one unsplit
  block, times the layers = one step: one rank's own shard (``probe_ms``: what each of two ranks
  on their own GPUs runs, at once) and both ranks' shards in one probe (``two_ranks_one_gpu_ms``:
  what two logical ranks of one GPU run, each unsplit call made once).

The calls are the rank's (``workers.dit.invariance`` over ``workers.dit.ops``). ``--tiny`` is the
CPU smoke variant.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import torch

from h3ms_async.dit import exactness
from h3ms_async.dit.layout import build_layout, layout_for_tokens
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, make_step_inputs
from h3ms_async.tools.cli import ArgParser, UsageError
from workers.dit import invariance
from workers.dit import ops as dit_ops
from workers.dit.protocol import LinearOp, ProbeReport, ProbeShard

H3 = DiTConfig(layers=50)
PRODUCTS = (9355, 78491)
ROWS = (
    1,
    2,
    3,
    4,
    5,
    8,
    16,
    31,
    32,
    33,
    64,
    100,
    128,
    256,
    512,
    1000,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    39245,
)
KINDS = ("bf16", "int8", "int8_convrot")
TINY = DiTConfig(hidden=64, layers=2, heads=4, head_dim=16, ffn=128, t_dim=32, rope_pairs=6)
TINY_PRODUCTS = (200,)
TINY_ROWS = (1, 2, 3, 4, 5, 8, 16, 31, 32, 64, 100)


def h3_ops(cfg: DiTConfig, kind: str) -> list[LinearOp]:
    """The block's linears as a checkpoint of ``kind`` stores them (int8: tensorwise scale, ConvRot
    groups of 256)."""
    man = {}
    for name, shape in cfg.block_shapes().items():
        int8 = kind != "bf16" and any(name == f"{n}.weight" for n in dit_ops.INT8_LINEARS)
        man[name] = ("int8" if int8 else "bfloat16", shape)
        if int8:
            man[name.replace(".weight", ".weight_scale")] = ("float32", (1,))
    quant = dit_ops.QuantInfo(kind == "int8_convrot", 256)
    return invariance.block_ops([man], lambda i: dict.fromkeys(dit_ops.INT8_LINEARS, quant))


def _slices(m: int, n: int) -> dict[str, tuple[int, int]]:
    mid = (m - n) // 2
    return {"start": (0, n), "middle": (mid, mid + n), "end": (m - n, m)}


def linear_table(
    cfg: DiTConfig,
    kind: str,
    m: int,
    rows: Sequence[int],
    device: torch.device,
    pool: invariance.RandomPool,
) -> tuple[list[dict], list[dict]]:
    """The ``linears`` rows of one weight kind and product size, and the engine's decision per row
    count: a 2-rank plan with ``n`` rows on rank 0 runs as planned when its shards are exact, else
    the first exact candidate of ``exactness.adjusted_bounds`` (measured in a second pass, only for
    the sizes that need it), else unsplit."""
    rows = [n for n in rows if n < m]
    first = {s: None for n in rows for s in [*_slices(m, n).values(), (0, n), (n, m)]}
    table, ok = _measure(cfg, kind, m, list(first), device, pool)
    failing = [n for n in rows if not (ok[(0, n)] and ok[(n, m)])]
    second: dict[tuple[int, int], None] = {}
    for n in failing:
        for c in exactness.adjusted_bounds((0, n, m)):
            second.update({(c[0], c[1]): None, (c[1], c[2]): None})
    todo = [s for s in second if s not in ok]
    if todo:
        ok.update(_measure(cfg, kind, m, todo, device, pool)[1])
    for t in table:
        t["rows"] = {
            str(n): {
                **{k: t["by_shard"][s][0] for k, s in _slices(m, n).items()},
                "max_abs_diff": max(t["by_shard"][s][1] for s in _slices(m, n).values()),
            }
            for n in rows
        }
        del t["by_shard"]
    engine = []
    for n in rows:
        if n not in failing:
            engine.append({"weights": kind, "M": m, "rows": n, "engine": "exact"})
            continue
        pick = next(
            (
                c
                for c in exactness.adjusted_bounds((0, n, m))
                if ok[(c[0], c[1])] and ok[(c[1], c[2])]
            ),
            None,
        )
        engine.append(
            {
                "weights": kind,
                "M": m,
                "rows": n,
                "engine": f"adjusted to {exactness.sizes(pick)}" if pick else "unsplit",
            }
        )
    return table, engine


def _measure(
    cfg: DiTConfig,
    kind: str,
    m: int,
    shards: list[tuple[int, int]],
    device: torch.device,
    pool: invariance.RandomPool,
) -> tuple[list[dict], dict[tuple[int, int], bool]]:
    """Each linear over ``m`` rows against ``shards``: table rows (with ``by_shard``) and, per
    shard, whether every token-split linear (the ones the engine splits by rows) is exact there."""
    clock = invariance.Clock(device)
    ok = dict.fromkeys(shards, True)
    table = []
    with torch.inference_mode():
        for op in h3_ops(cfg, kind):
            # qkv is head-split in the engine; its rows are measured too, for the table only
            [[v]] = invariance.probe_linear(
                pool,
                op,
                m,
                [((0, cfg.heads), [invariance.Variant(op.name, "tokens", shards)])],
                torch.bfloat16,
                cfg.heads,
                cfg.head_dim,
                clock,
            )
            res = dict(zip(shards, zip(v.exact, v.max_abs_diff)))
            if op.split == "tokens":
                for s, (e, _) in res.items():
                    ok[s] = ok[s] and e
            table.append(
                {
                    "weights": kind,
                    "M": m,
                    "op": op.name,
                    "dtype": v.dtype,
                    "shape": v.shape,
                    "ms": v.ms,
                    "by_shard": res,
                }
            )
    return table, ok


def attention_table(
    cfg: DiTConfig,
    kernel: str,
    seq: int,
    device: torch.device,
    pool: invariance.RandomPool,
    sm_count: int | None,
) -> dict:
    """Head groups 1 ... heads-1 of one kernel at one sequence length, beside the flash-tiles
    prior."""
    attend = dit_ops.builtin_attend(kernel)
    clock = invariance.Clock(device)
    with torch.inference_mode():
        [[v]] = invariance.probe_attention(
            pool,
            seq,
            [[invariance.Variant("attention", "heads", [(0, g) for g in range(1, cfg.heads)])]],
            cfg.heads,
            cfg.head_dim,
            torch.bfloat16,
            attend,
            clock,
        )
    heads = {
        str(g): {
            "exact": e,
            "max_abs_diff": d,
            "prior_ok": None
            if sm_count is None
            else dit_ops.flash_tiles_ok(g, cfg.heads, seq, sm_count),
        }
        for g, e, d in zip(range(1, cfg.heads), v.exact, v.max_abs_diff)
    }
    return {"kernel": kernel, "dtype": "bfloat16", "S": seq, "heads": heads, "ms": v.ms}


def probe_cost(cfg: DiTConfig, kind: str, m: int, device: torch.device) -> dict:
    """The probe before a new 2-rank plan (one rank's shard, and both ranks' in one probe), against
    one unsplit block of the reference model."""
    # materialized: the timed block is the block's compute, not its weights' seeded draw
    model = ReferenceDiT(
        dataclasses.replace(cfg, layers=1),
        weights="int8" if kind != "bf16" else "bf16",
        seed=1,
        device=device,
    ).materialize()
    layout = (
        layout_for_tokens(m) if m >= 4000 else build_layout(88, 3, 4, 6, 8, keyframes=1, sigma=0.7)
    )
    inp = make_step_inputs(model.config, layout, 2, model.dtype)
    args = (inp.x.to(device), inp.t_emb.to(device), inp.segments, inp.rope_freqs.to(device))
    dit_ops.warm_up(dit_ops.builtin_attend("sdpa"), device, [model.dtype])
    clock = invariance.Clock(device)
    block_ms = []
    for _ in range(2):
        t = clock.start()
        model.forward_blocks(args[0].clone(), *args[1:])
        block_ms.append(clock.ms(t))
    seq = args[0].shape[0]
    half, h = seq // 2, cfg.heads // 2
    shards = [ProbeShard([(0, half)], (0, h)), ProbeShard([(half, seq)], (h, cfg.heads))]

    def probe(asked: list[ProbeShard]) -> list[ProbeReport]:
        return invariance.run_probe(
            h3_ops(cfg, kind),
            tokens=seq,
            shards=asked,
            total_heads=cfg.heads,
            head_dim=cfg.head_dim,
            dtype=model.dtype,
            attend=dit_ops.builtin_attend("sdpa"),
            device=device,
        )

    rep = probe(shards[:1])[0]
    both = probe(shards)[0]
    step_ms = block_ms[-1] * cfg.layers
    return {
        "weights": kind,
        "tokens": seq,
        "probe_ms": rep.ms,
        "per_op_ms": {v.op: v.ms for v in rep.ops},
        "two_ranks_one_gpu_ms": both.ms,
        "block_ms": block_ms[-1],
        "layers": cfg.layers,
        "step_ms_est": step_ms,
        "fraction_of_step": rep.ms / step_ms,
        "two_ranks_one_gpu_fraction_of_step": both.ms / step_ms,
    }


def run_bench_invariance(
    *,
    tiny: bool,
    device: str | None = None,
    products: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
    kinds: Sequence[str] | None = None,
    print_json: bool = True,
) -> dict:
    """Run it; returns (and unless ``print_json`` is false prints) the JSON object."""
    dev = torch.device(device or ("cuda:0" if torch.cuda.is_available() and not tiny else "cpu"))
    cfg = TINY if tiny else H3
    products = tuple(products or (TINY_PRODUCTS if tiny else PRODUCTS))
    rows = tuple(rows or (TINY_ROWS if tiny else ROWS))
    # ConvRot needs 256-column groups: not at tiny width
    kinds = tuple(kinds or (KINDS[:2] if tiny else KINDS))
    if dev.type == "cpu" and not tiny:
        raise UsageError(
            "bench invariance at full H3 width needs a CUDA device; use --tiny on a CPU"
        )
    if dev.type == "cuda":
        dit_ops.apply_kitchen_policy()
    sm = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None
    t0 = time.perf_counter()
    linears, engine = [], []
    attention: list[dict] = []
    for kind in kinds:
        for m in products:
            pool = invariance.RandomPool(dev)
            table, eng = linear_table(cfg, kind, m, rows, dev, pool)
            linears += table
            engine += eng
            del pool
    kernels = ["sdpa"] + (["ck_int8"] if dev.type == "cuda" and _ck_attention(dev) else [])
    for kernel in kernels:
        # a fresh process's first CUDA SDPA call can take another kernel than later ones
        # (dit_ops.warm_up): warm, as the ranks are before their first probe
        dit_ops.warm_up(dit_ops.builtin_attend(kernel), dev, [torch.bfloat16])
        attention.extend(
            attention_table(cfg, kernel, m, dev, invariance.RandomPool(dev), sm) for m in products
        )
    cost = [probe_cost(cfg, kind, max(products), dev) for kind in kinds[:2]]
    report = {
        "bench": "invariance",
        "machine": invariance.fingerprint(dev),
        "config": {
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "head_dim": cfg.head_dim,
            "ffn": cfg.ffn,
            "layers": cfg.layers,
            "products": list(products),
            "rows": list(rows),
            "kinds": list(kinds),
            "attention_kernels": kernels,
            "sm_count": sm,
        },
        "linears": linears,
        "attention": attention,
        "engine": engine,
        "probe_cost": cost,
        "wall_s": time.perf_counter() - t0,
    }
    if print_json:
        print(json.dumps(report, indent=2))
    return report


def _ck_attention(dev: torch.device) -> bool:
    import comfy_kitchen as ck

    return bool(ck.int8_attention_is_available(dev))


def build_parser() -> ArgParser:
    p = ArgParser(prog="python -m h3ms_async bench invariance", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small CPU variant (the smoke test)")
    p.add_argument(
        "--device", default=None, help="device to measure (default cuda:0, cpu with --tiny)"
    )
    p.add_argument("--products", default="", help="full product row counts, e.g. 9355,78491")
    p.add_argument("--rows", default="", help="shard row counts, e.g. 1,2,3,16,32")
    p.add_argument("--kinds", default="", help=f"weight kinds, of {','.join(KINDS)}")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    return p


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: give comma-separated positive integers, e.g. 1,2,16"
        ) from None
    if any(v < 1 for v in vals):
        raise UsageError(f"{flag} {text!r}: every value must be >= 1")
    return vals


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UsageError(f"--kinds {a.kinds!r}: {bad} not among {','.join(KINDS)}")
    rep = run_bench_invariance(
        tiny=a.tiny,
        device=a.device,
        products=_ints(a.products, "--products"),
        rows=_ints(a.rows, "--rows"),
        kinds=kinds,
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2)
    return 0
