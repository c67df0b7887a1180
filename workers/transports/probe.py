"""The exchange probe: every collective of an exchange checked against the spec
(``workers.transports.exchange``) with ``torch.equal``, and timed.

:func:`run_case` runs one case on one rank over any :class:`~workers.transports.exchange.Exchange`
(``tests/test_exchange_conformance.py`` calls it on rank threads for the in-process ones).
``python -m workers.transports.probe --rank R --world W ...`` is the rank program that runs the
cases of ``--spec`` (JSON) in order in a process of its own, over the transports that need one (the
exchange tests and benchmark; ``ProbeGroup`` in ``h3ms_async/tools/bench/exchange.py`` starts it).

A case names its transports (``transport``: one of ``host``, ``cuda_ipc``, ``gloo``, ``nccl`` or a
list of them; the spec's ``devices``, one per rank, put the ranks on CUDA devices: the host exchange
is then wrapped as a CUDA rank wraps it, ``nccl`` needs them, ``cuda_ipc`` too unless the test
stand-in runs it on CPU ranks: ``workers/testing/ipc_cpu.py``), an arena segment
(``workers/runtime/shm.py``, attached by id) with its layout (host; for ``cuda_ipc`` the
GPU-direct exchange's header and handle slots, ``arena_ipc``; ``ipc_sync``: its ordering, an
``IpcSync`` value, host by default), the chunk counts to run, and rounds x
blocks of
(all_gather_rows, all_to_all_cols); a layout planned with ``qkv`` adds ``all_to_all_qkv`` (of a
``[S, 3·C]`` pattern); ``"overlap": true`` adds ``all_to_all_heads`` in as many head pieces as
chunks (each piece produced on demand from the pattern), on a ``qkv`` layout
``all_to_all_qkv_attend`` in as many head pieces (each piece handed over once, in order, and
"attended" by :func:`probe_attend`),
``all_gather_rows_each`` (each rank's
rows handed over once, its own first) and ``all_gather_rows_produced`` in as many row pieces as
chunks (every row produced once, pieces in order).  Every rank generates every rank's inputs
from the case seed, so it checks its own results against the spec's exact tensors.  Doorbell
eventfds arrive through ``pass_fds`` (``--doorbells``), the abort control word as a segment id
(``--control``).  Output: one JSON line on stdout with per-case results, per-op timings and the
exchange stats; exit status 0 when every check passed, 1 when a check failed, 3 when an exchange
raised.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workers.dit.protocol import IpcSync, Transport
from workers.runtime import config
from workers.runtime.shm import Segment
from workers.transports.arena import ArenaLayout, piece
from workers.transports.cuda_ipc import CudaIpcExchange, IpcBuffers
from workers.transports.exchange import (
    Exchange,
    ExchangeError,
    gathered_rows,
    qkv_pieces,
    received_attended,
    received_cols,
    received_qkv,
)
from workers.transports.host import HostExchange

_CPU = torch.device("cpu")
#: The transports the rank program builds (those that need a process per rank).
TRANSPORTS = (
    Transport.HOST.value,
    Transport.CUDA_IPC.value,
    Transport.GLOO.value,
    Transport.NCCL.value,
)
#: The transports that run over a shm arena of the case's (``arena``).
ARENA_TRANSPORTS = (Transport.HOST.value, Transport.CUDA_IPC.value)


def case_transports(case: dict) -> list[str]:
    """The transports a case names (``transport``: one name or a list)."""
    given = case["transport"]
    names = [given] if isinstance(given, str) else list(given)
    unknown = [t for t in names if t not in TRANSPORTS]
    if unknown or not names:
        raise ValueError(
            f"probe case transport {given!r}: name one or more of {', '.join(TRANSPORTS)}"
        )
    return names


def case_layout(case: dict) -> ArenaLayout:
    """The case's layout (an ``ArenaLayout`` or its ``to_dict()``)."""
    lay = case["layout"]
    return lay if isinstance(lay, ArenaLayout) else ArenaLayout.from_dict(lay)


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
    """The probe's callback of the ops that hand over parts: keep a copy of each, with its
    bounds."""
    into.append((a, b, rows.cpu().clone()))


#: ``timed(key, op, *args)``: the op's result, its duration appended to the run's ``key`` list.
Timed = Callable[..., torch.Tensor]


def _block(
    ex: Exchange,
    lay: ArenaLayout,
    rank: int,
    pattern: tuple[torch.Tensor, torch.Tensor],
    chunks: int,
    overlap: bool,
    timed: Timed,
    device: torch.device,
) -> list[str]:
    """One block's ops in the split's order, each result checked against the spec at once (a
    result may be a buffer the next op of its kind rewrites); returns what differed."""
    x, y = pattern
    ranks = range(lay.world)
    rows = [x[slice(*lay.rows(p))] for p in ranks]
    cols = [y[:, slice(*lay.cols(p))] for p in ranks]
    bad: list[str] = []

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.clone().to(device)

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want):
            bad.append(f"{what} differs")

    got = timed("gather_s", ex.all_gather_rows, mine(rows[rank]), chunks)
    check("gather", got, gathered_rows(lay, rows))
    got = timed("a2a_s", ex.all_to_all_cols, mine(cols[rank]), chunks)
    check("all_to_all", got, received_cols(lay, rank, cols))
    if lay.q_offsets:
        z = torch.cat([y, y.flip(0), -y], dim=1)  # q, k, v of every head
        qkv = [z[slice(*lay.rows(p))] for p in ranks]
        got = timed("qkv_s", ex.all_to_all_qkv, mine(qkv[rank]), chunks)
        check("all_to_all_qkv", got, received_qkv(lay, rank, qkv))
    if overlap:
        c0 = lay.cols(rank)[0]
        got = timed(
            "heads_s", ex.all_to_all_heads, lambda ca, cb: mine(y[:, c0 + ca : c0 + cb]), chunks
        )
        check(f"all_to_all_heads ({chunks} pieces)", got, received_cols(lay, rank, cols))
        if lay.q_offsets:
            bad += _qkv_attend(ex, lay, rank, qkv, chunks, timed, mine)
        handed: list[tuple[int, int, torch.Tensor]] = []
        got = timed(
            "each_s", ex.all_gather_rows_each, mine(rows[rank]), functools.partial(_keep, handed)
        )
        check("all_gather_rows_each", got, gathered_rows(lay, rows))
        order = [(a, b) for a, b, _ in handed]
        ranges = [lay.rows(p) for p in ranks]
        r0, r1 = lay.rows(rank)
        own_first = r1 == r0 or order[:1] == [(r0, r1)]
        if sorted(order) != [(a, b) for a, b in ranges if b > a] or not own_first:
            bad.append(f"rows handed over as {order}")
        if not all(torch.equal(part, x[a:b]) for a, b, part in handed):
            bad.append("handed-over rows differ")
        asked: list[tuple[int, int]] = []

        def produce(a: int, b: int) -> torch.Tensor:
            asked.append((a, b))
            return mine(rows[rank][a:b])

        got = timed("produced_s", ex.all_gather_rows_produced, produce, chunks)
        check(f"all_gather_rows_produced ({chunks} pieces)", got, gathered_rows(lay, rows))
        n = max(1, chunks)
        want = [(a, b) for a, b in (piece(r1 - r0, n, j) for j in range(n)) if b > a]
        if asked != want:
            bad.append(f"rows produced as {asked}, expected {want}")
    return bad


def probe_attend(a: int, b: int, qkv: torch.Tensor) -> torch.Tensor:
    """The probe's stand-in for attention: q - v of the piece ``[S, 3·(b - a)]`` (exact on every
    device; it mixes q and v, so a piece laid out wrong or a wrong output place shows)."""
    w = b - a
    return qkv[:, :w] - qkv[:, 2 * w :]


def _qkv_attend(
    ex: Exchange,
    lay: ArenaLayout,
    rank: int,
    qkv: list[torch.Tensor],
    pieces: int,
    timed: Timed,
    mine: Callable[[torch.Tensor], torch.Tensor],
) -> list[str]:
    """``all_to_all_qkv_attend`` in ``pieces`` head pieces, attended by :func:`probe_attend`: its
    result, and every non-empty piece handed over once, in order, equal to the spec's; returns
    what differed."""
    handed: list[tuple[int, int, torch.Tensor]] = []

    def attend(a: int, b: int, piece: torch.Tensor) -> torch.Tensor:
        _keep(handed, a, b, piece)
        return probe_attend(a, b, piece)

    got = timed("qkv_attend_s", ex.all_to_all_qkv_attend, mine(qkv[rank]), pieces, attend)
    want = received_attended(lay, rank, pieces, qkv, probe_attend)
    bad = (
        [] if torch.equal(got.cpu(), want) else [f"all_to_all_qkv_attend ({pieces} pieces) differs"]
    )
    expected = qkv_pieces(lay, rank, pieces, qkv)
    if [(a, b) for a, b, _ in handed] != [(a, b) for a, b, _ in expected]:
        bad.append(
            f"q/k/v pieces handed over as {[(a, b) for a, b, _ in handed]}, expected "
            f"{[(a, b) for a, b, _ in expected]}"
        )
    elif not all(torch.equal(h[2], e[2]) for h, e in zip(handed, expected)):
        bad.append("handed-over q/k/v pieces differ")
    return bad


def run_case(
    rank: int,
    case: dict,
    exchanges: Sequence[tuple[str, Exchange]],
    stall_hook: Callable[[int], None] | None = None,
    device: torch.device = _CPU,
) -> dict:
    """Run one case on this rank over each of ``exchanges`` (name, exchange) in turn, its inputs on
    ``device``; returns its result record.  ``stall_hook(n)`` runs before the case's n-th op (a test
    freezes one rank there)."""
    layout = case_layout(case)
    rounds, blocks = int(case.get("rounds", 2)), int(case.get("blocks", 2))
    n_pat = int(case.get("patterns", rounds * blocks))
    seed = int(case.get("seed", 1))
    gen = int(case.get("gen", 0))
    patterns = [case_inputs(layout, seed, k) for k in range(n_pat)]
    result: dict = {"name": case.get("name", ""), "ok": True, "failures": [], "runs": []}
    overlap = bool(case.get("overlap"))
    op_count = 0
    times: dict[str, list[float]] = {}

    def timed(key: str, op: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        nonlocal op_count
        op_count += 1
        if stall_hook:
            stall_hook(op_count)
        t = time.perf_counter()
        out = op(*args)
        times[key].append(time.perf_counter() - t)
        return out

    for chunks in case.get("chunks", [0]):
        for tname, ex in exchanges:
            ex.reset_stats()
            keys = ("gather_s", "a2a_s", "qkv_s", "heads_s", "qkv_attend_s", "each_s", "produced_s")
            times = {k: [] for k in keys}
            for rnd in range(rounds):
                ex.begin(gen)
                for blk in range(blocks):
                    pattern = patterns[(rnd * blocks + blk) % n_pat]
                    bad = _block(ex, layout, rank, pattern, chunks, overlap, timed, device)
                    where = f"{tname} chunks={chunks} round={rnd} block={blk}"
                    result["failures"] += [f"{where}: {what}" for what in bad]
            result["runs"].append(
                {"transport": tname, "chunks": chunks, **times, "stats": ex.stats()}
            )
    result["ok"] = not result["failures"]
    return result


def _ipc_stand_in(rank: int) -> IpcBuffers | None:
    """The test stand-in's send buffers of a ``cuda_ipc`` case on a CPU rank (shm segments,
    ``workers/testing/ipc_cpu.py``; only with ``H3MS_TEST_HOOKS=1 H3MS_CUDA_IPC_CPU=1``), else
    None."""
    if not config.TEST_HOOKS.get():
        return None
    from workers.testing import ipc_cpu  # test-only code (H3MS_TEST_HOOKS=1)

    return ipc_cpu.buffers(rank)


def build_exchange(
    transport: str,
    rank: int,
    world: int,
    case: dict,
    devices: list[str],
    doorbells: list[int],
    control: torch.Tensor | None,
    segments: list[Segment],
) -> Exchange:
    """This rank's exchange of ``transport`` for ``case`` on ``devices[rank]`` (a dist one needs
    ``init_group`` first); the arena's segment is attached into ``segments``."""
    device = torch.device(devices[rank])
    layout = case_layout(case)
    cuda = device.type == "cuda"
    if transport in ARENA_TRANSPORTS:
        if control is None:
            raise ValueError(f"a {transport} case needs --control (the abort generation's segment)")
        ipc = transport == Transport.CUDA_IPC.value
        segments.append(Segment.attach(case["arena_ipc" if ipc else "arena"]))
        arena = segments[-1].base_tensor()
        args = (rank, world, arena, layout, doorbells, control, float(case.get("deadline_s", 30)))
        spin_us = float(case.get("spin_us", 0))
        if ipc:
            events = IpcSync(case.get("ipc_sync", IpcSync.HOST.value)) is IpcSync.EVENTS
            if not cuda:
                stand_in = _ipc_stand_in(rank)
                if stand_in is None:
                    raise ValueError(f"probe transport cuda_ipc on {device}: it runs CUDA ranks")
                return CudaIpcExchange(
                    *args,
                    spin_us=spin_us,
                    devices=[0] * world,
                    buffers=stand_in,
                    event_streams=(None, None) if events else None,  # CPU copies: no streams
                )
            from workers.dit.cuda import CudaExchange

            return CudaExchange.over_host(
                device,
                *args,
                spin_us=spin_us,
                exchange=CudaIpcExchange,
                events=events,
                devices=[torch.device(d).index or 0 for d in devices],
            )
        if cuda:
            from workers.dit.cuda import CudaExchange

            return CudaExchange.over_host(device, *args, spin_us=spin_us)
        return HostExchange(*args, spin_us=spin_us)
    from workers.transports.dist import DistExchange

    if cuda != (transport == Transport.NCCL.value):
        raise ValueError(
            f"probe transport {transport!r} on {device}: gloo runs CPU ranks, nccl CUDA ranks"
        )
    ex = DistExchange(rank, world, layout, control=control)
    if cuda:
        from workers.dit.cuda import CudaExchange

        return CudaExchange(device, host=False).bind(ex)
    return ex


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
    ap.add_argument(
        "--spec",
        required=True,
        help="JSON: {cases: [...], init_file, dist_timeout_s, devices (one per rank; default cpu)}",
    )
    args = ap.parse_args(argv)
    spec = json.loads(args.spec)
    out: dict = {"rank": args.rank, "pid": os.getpid(), "ok": False, "cases": [], "error": None}
    # attached for the process's life: the exchanges hold views into them
    segments: list[Segment] = []
    backends: set[str] = set()
    try:
        devices = spec.get("devices") or ["cpu"] * args.world
        device = torch.device(devices[args.rank])
        doorbells = [int(x) for x in args.doorbells.split(",") if x]
        control = None
        if args.control:
            segments.append(Segment.attach(args.control))
            control = segments[-1].base_tensor().view(torch.int64)
        names = {t for c in spec["cases"] for t in case_transports(c)}
        backends = names - set(ARENA_TRANSPORTS)
        if len(backends) > 1:
            raise ValueError("a probe process joins one process group: name gloo or nccl, not both")
        if backends:
            from workers.transports.dist import init_group

            nccl = backends == {Transport.NCCL.value}
            init_group(
                args.rank,
                args.world,
                next(iter(backends)),
                spec["init_file"],
                float(spec.get("dist_timeout_s", 60)),
                devices=devices if nccl else None,
                local_device=devices[args.rank] if nccl else None,
            )
        stall = spec.get("stall") or {}

        def stall_hook(op: int) -> None:
            if stall.get("rank") == args.rank and stall.get("op") == op:
                print(json.dumps({"rank": args.rank, "stalled": op}), flush=True)
                time.sleep(float(stall.get("sleep_s", 30)))

        for case in spec["cases"]:
            exchanges = [
                (
                    t,
                    build_exchange(
                        t, args.rank, args.world, case, devices, doorbells, control, segments
                    ),
                )
                for t in case_transports(case)
            ]
            hook = stall_hook if stall else None
            out["cases"].append(run_case(args.rank, case, exchanges, hook, device))
            for _, ex in exchanges:
                ex.close()
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
        if backends:
            from workers.transports.dist import destroy_group

            destroy_group()
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
