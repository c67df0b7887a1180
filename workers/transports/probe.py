"""A rank program for the exchange tests and benchmark: ``python -m workers.transports.probe --rank
R --world W ...``.

It runs the cases of ``--spec`` (JSON) in order.  A case names a transport (``host``, ``gloo`` or
``both``), an arena segment (``workers/runtime/shm.py``, attached by id) with its layout (host), the
chunk counts to run, and rounds x blocks of (all_gather_rows, all_to_all_cols), with ``"overlap":
true`` also ``all_to_all_heads`` in as many head pieces as chunks (each piece produced on demand
from the pattern) and ``all_gather_rows_each`` (each rank's rows handed over once); a layout
planned with ``qkv`` adds ``all_to_all_qkv`` (of a ``[S, 3·C]`` pattern).  Every rank
generates every rank's inputs from the case seed, so it checks its own results against the exact
expected tensors (``torch.equal``) and, with ``both``, the host result against the torch.distributed
one. Doorbell eventfds arrive through ``pass_fds`` (``--doorbells``), the abort control word as a
segment id (``--control``).  Output: one JSON line on stdout with per-case results, per-op timings
and the exchange stats; exit status 0 when every check passed, 1 when a check failed, 3 when an
exchange raised.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import torch

from workers.dit.protocol import Transport
from workers.runtime.shm import Segment
from workers.transports.host import ArenaLayout, ExchangeError, HostExchange, packed_qkv


def case_inputs(layout: ArenaLayout, seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full ``[S, W]`` rows and ``[S, C]`` columns of pattern ``index`` (identical on every
    rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    dt = layout.torch_dtype
    shapes = ((layout.tokens, layout.row_width), (layout.tokens, layout.columns))
    if dt.is_floating_point:
        return tuple(torch.randn(s, generator=gen).to(dt) for s in shapes)  # type: ignore[return-value]
    return tuple(torch.randint(-100, 100, s, generator=gen).to(dt) for s in shapes)  # type: ignore[return-value]


def _keep(into: list[tuple[int, int, torch.Tensor]], a: int, b: int, rows: torch.Tensor) -> None:
    """``all_gather_rows_each``'s callback in the probe: keep a copy of each handed-over range."""
    into.append((a, b, rows.clone()))


def run_case(rank: int, case: dict, host: HostExchange | None, dist_ex, stall_hook=None) -> dict:
    """Run one case on this rank; returns its result record."""
    layout = ArenaLayout.from_dict(case["layout"])
    rounds, blocks = int(case.get("rounds", 2)), int(case.get("blocks", 2))
    n_pat = int(case.get("patterns", rounds * blocks))
    seed = int(case.get("seed", 1))
    gen = int(case.get("gen", 0))
    patterns = [case_inputs(layout, seed, k) for k in range(n_pat)]
    r0, r1 = layout.rows(rank)
    c0, c1 = layout.cols(rank)
    gloo = (Transport.GLOO.value, dist_ex)
    transports = [("host", host)] if case["transport"] == "host" else [gloo]
    if case["transport"] == "both":
        transports = [("host", host), gloo]
    result: dict = {"name": case.get("name", ""), "ok": True, "failures": [], "runs": []}
    op_count = 0

    def timed(op, data, chunks, times):
        # every op counts for the stall hook (a test freezes one rank at op N), then is timed
        nonlocal op_count
        op_count += 1
        if stall_hook:
            stall_hook(op_count)
        t = time.perf_counter()
        out = op(data, chunks)
        times.append(time.perf_counter() - t)
        return out

    for chunks in case.get("chunks", [0]):
        for tname, ex in transports:
            assert ex is not None  # main() builds the exchange of every transport the case names
            ex.reset_stats()
            gather_s: list[float] = []
            a2a_s: list[float] = []
            heads_s: list[float] = []
            each_s: list[float] = []
            for rnd in range(rounds):
                ex.begin(gen)
                for blk in range(blocks):
                    x, y = patterns[(rnd * blocks + blk) % n_pat]
                    local_rows = x[r0:r1].clone()
                    local_cols = y[:, c0:c1].clone()
                    g = timed(ex.all_gather_rows, local_rows, chunks, gather_s)
                    a = timed(ex.all_to_all_cols, local_cols, chunks, a2a_s)
                    if layout.q_offsets:
                        z = torch.cat([y, y.flip(0), -y], dim=1)  # q, k, v of every head
                        q = ex.all_to_all_qkv(z[r0:r1].clone(), chunks)
                        if not torch.equal(q, packed_qkv(z, layout.qkv_cols(rank))):
                            result["failures"].append(
                                f"{tname} chunks={chunks} round={rnd} block={blk}: "
                                "all_to_all_qkv differs"
                            )
                    if not torch.equal(g, x):
                        result["failures"].append(
                            f"{tname} chunks={chunks} round={rnd} block={blk}: gather differs"
                        )
                    if not torch.equal(a, y[r0:r1]):
                        result["failures"].append(
                            f"{tname} chunks={chunks} round={rnd} block={blk}: all_to_all differs"
                        )
                    if case.get("overlap"):
                        h = timed(
                            ex.all_to_all_heads,
                            lambda ca, cb, y=y: y[:, c0 + ca : c0 + cb].clone(),
                            chunks,
                            heads_s,
                        )
                        if not torch.equal(h, y[r0:r1]):
                            result["failures"].append(
                                f"{tname} pieces={chunks} round={rnd} block={blk}: "
                                "all_to_all_heads differs"
                            )
                        handed: list[tuple[int, int, torch.Tensor]] = []
                        t = time.perf_counter()
                        e = ex.all_gather_rows_each(local_rows, functools.partial(_keep, handed))
                        each_s.append(time.perf_counter() - t)
                        order = [(a, b) for a, b, _ in handed]
                        ranges = [layout.rows(p) for p in range(layout.world)]
                        own_first = tname != "host" or r1 == r0 or order[:1] == [(r0, r1)]
                        if sorted(order) != [(a, b) for a, b in ranges if b > a] or not own_first:
                            result["failures"].append(
                                f"{tname} round={rnd} block={blk}: rows handed over as {order}"
                            )
                        if not all(torch.equal(rows, x[a:b]) for a, b, rows in handed):
                            result["failures"].append(
                                f"{tname} round={rnd} block={blk}: handed-over rows differ"
                            )
                        if not torch.equal(e, x):
                            result["failures"].append(
                                f"{tname} round={rnd} block={blk}: all_gather_rows_each differs"
                            )
            result["runs"].append(
                {
                    "transport": tname,
                    "chunks": chunks,
                    "gather_s": gather_s,
                    "a2a_s": a2a_s,
                    "heads_s": heads_s,
                    "each_s": each_s,
                    "stats": ex.stats(),
                }
            )
    result["ok"] = not result["failures"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.transports.probe")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument(
        "--doorbells", default="", help="comma-separated eventfd numbers, one per rank (pass_fds)"
    )
    ap.add_argument(
        "--control", default="", help="segment id whose int64 word 0 is the abort generation"
    )
    ap.add_argument("--spec", required=True, help="JSON: {cases: [...], init_file, dist_timeout_s}")
    args = ap.parse_args(argv)
    spec = json.loads(args.spec)
    out: dict = {"rank": args.rank, "pid": os.getpid(), "ok": False, "cases": [], "error": None}
    # attached for the process's life: the exchanges hold views into them
    segments: list[Segment] = []
    dist_ex = None
    try:
        doorbells = [int(x) for x in args.doorbells.split(",") if x]
        control = None
        if args.control:
            segments.append(Segment.attach(args.control))
            control = segments[-1].base_tensor().view(torch.int64)
        needs_dist = any(c["transport"] in ("gloo", "both") for c in spec["cases"])
        if needs_dist:
            from workers.transports.dist import init_group

            init_group(
                args.rank,
                args.world,
                "gloo",
                spec["init_file"],
                float(spec.get("dist_timeout_s", 60)),
            )
        stall = spec.get("stall") or {}

        def stall_hook(op: int) -> None:
            if stall.get("rank") == args.rank and stall.get("op") == op:
                print(json.dumps({"rank": args.rank, "stalled": op}), flush=True)
                time.sleep(float(stall.get("sleep_s", 30)))

        for case in spec["cases"]:
            layout = ArenaLayout.from_dict(case["layout"])
            host = None
            if case["transport"] in ("host", "both"):
                if control is None:
                    raise ValueError("a host case needs --control (the abort generation's segment)")
                segments.append(Segment.attach(case["arena"]))
                host = HostExchange(
                    args.rank,
                    args.world,
                    segments[-1].base_tensor()[: layout.nbytes],
                    layout,
                    doorbells,
                    control,
                    float(case.get("deadline_s", 30)),
                    spin_us=float(case.get("spin_us", 0)),
                )
            if needs_dist and case["transport"] != "host":
                from workers.transports.dist import DistExchange

                dist_ex = DistExchange(args.rank, args.world, layout, control=control)
            out["cases"].append(
                run_case(args.rank, case, host, dist_ex, stall_hook if stall else None)
            )
            if host is not None:
                host.close()
        out["ok"] = all(c["ok"] for c in out["cases"])
        rc = 0 if out["ok"] else 1
    except ExchangeError as e:
        out["error"] = {"type": type(e).__name__, "message": str(e), "t": time.monotonic()}
        rc = 3
    except Exception as e:  # noqa: BLE001
        # reported to the spawner, which fails the test with the traceback
        out["error"] = {
            "type": type(e).__name__,
            "message": str(e),
            "traceback": traceback.format_exc(),
        }
        rc = 2
    finally:
        if dist_ex is not None or any(c["transport"] != "host" for c in spec.get("cases", [])):
            from workers.transports.dist import destroy_group

            destroy_group()
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
