"""``python -m h3ms_async bench attention``: H3 Attention Parallel at the reference shape, and a
model of N GPUs.

In one run (JSON to stdout and ``--out``), at ``--shape`` (default ``1,56,93312,128``, H3's packed
ref2va call):

* the unsplit call: kitchen's ``prequantize_int8_attention`` and
  ``int8_attention_from_prequantized`` (medians);
* the attention of a head slice alone, for the slice sizes that 2, 4 and 8 GPUs get and for every
  piece size up to ``--chunk-heads`` (the model GPU's per-head compute), and a helper's range
  attended in pieces of every size up to ``--chunk-heads`` as the helper runs them, on one stream
  and on two taken in turn (a helper's per-head compute);
* the host transport's copy rates (device to registered shm and back) and, with two GPUs that reach
  each other, the peer-to-peer rate (NVLink or PCIe P2P);
* the parallel call on logical helpers of the same GPU (``--helpers``) over each transport
  (``--transports``: host staging through shm, CUDA IPC), side by side: every output ``torch.equal``
  to the unsplit one (the first call after the helpers start included), the split the engine tuned,
  and per phase (stage copy, helper copy in, compute, helper copy out, take-back) its seconds, bytes
  and GB/s, plus one message's round trip to a helper;
* the predicted time and speedup at N = 2, 4, 8 GPUs of the schedule the engine runs
  (``attention_schedule``, pieces of ``--chunk-heads`` heads; beside it whole slices and every
  smaller piece size), from the quantities above: PCIe host-staged at the measured host rates and at
  an assumed PCIe Gen4 x16 rate, NVLink by CUDA IPC at the measured P2P rate (two GPUs) or an
  assumed NVLink rate (formula and links in ``model``).

On a CPU (CI smoke test) it runs with the pack's CPU test hook (``H3MS_TEST_HOOKS=1
H3MS_CK_ATTENTION_CPU=1``).
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import torch

from h3ms_async.attention import schedule as attention_schedule
from h3ms_async.attention.engine import CHUNK_HEADS, TRANSPORTS, AttentionParallelEngine
from h3ms_async.runtime import plans
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.tools.cli import ArgParser
from workers.attention import ops as attn_ops
from workers.runtime import config
from workers.runtime.protocol import Ping

REFERENCE_SHAPE = (1, 56, 93312, 128)
MODEL_GPUS = (2, 4, 8)
#: GB/s each way, stated assumptions for links this run cannot measure (labelled "assumed" in the
#: JSON).
PCIE_GEN4_X16 = 25.0
NVLINK_ASSUMED = 350.0


def _timed(fn: Callable[[], Any], reps: int, device: torch.device) -> tuple[float, Any]:
    """Median seconds of ``reps`` calls (after one warm call) and the last result."""
    out = fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PeerRate(TypedDict):
    """A measured GPU-to-GPU copy rate, or None and why it was not measured."""

    GBps: float | None
    why: str


def peer_rate(nbytes: int = 1 << 30, reps: int = 5) -> PeerRate:
    """GB/s of a cuda:0 -> cuda:1 copy when both GPUs reach each other (else the reason it was not
    measured)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return {
            "GBps": None,
            "why": "fewer than 2 CUDA GPUs visible: run on a machine with 2 GPUs to measure P2P",
        }
    if not (torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)):
        return {"GBps": None, "why": "cuda:0 and cuda:1 have no peer access both ways"}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    best = float("inf")
    for _ in range(reps + 1):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        best = min(best, time.perf_counter() - t)
    return {"GBps": nbytes / best / 1e9, "why": "measured cuda:0 -> cuda:1"}


def slice_sizes(heads: int, n: int) -> list[int]:
    """Heads per device when ``n`` equal devices share ``heads`` (the engine's split at a shape's
    first call)."""
    bounds = plans.partition(heads, [1.0] * n, "attention heads")
    return [b - a for a, b in itertools.pairwise(bounds)]


def predict(
    n: int,
    heads: int,
    quant_s: float,
    per_head_s: float,
    helper_per_head_s: float,
    in_per_head: float,
    out_per_head: float,
    legs: attention_schedule.Legs,
    pipeline: attention_schedule.Pipeline,
) -> dict:
    """Time of one call on ``n`` equal GPUs as the engine runs it (``attention_schedule``):
    quantize, then the split the engine tunes to, with every helper's pieces pipelined (a helper's
    per-head time is that of its piece size)."""
    best = attention_schedule.best_split(
        heads,
        [per_head_s] + [helper_per_head_s] * (n - 1),
        [1.0] * (n - 1),
        in_per_head,
        out_per_head,
        legs,
        pipeline,
    )
    return dict(best, quantize_s=quant_s, total_s=quant_s + best["total_s"])


def _dense_slice(pq: Any, h0: int, h1: int) -> dict[str, torch.Tensor]:
    """Heads ``[h0, h1)`` of the packed call as dense tensors, so the timed attention holds no
    slicing copy."""
    return {name: t.contiguous() for name, t in attn_ops.head_slice(pq, h0, h1).items()}


def chain_s(
    pq: Any,
    fields: dict,
    heads: int,
    chunk_heads: int,
    streams: int,
    reps: int,
    device: torch.device,
) -> float:
    """Median seconds to attend heads ``[0, heads)`` as a helper does: pieces of at most
    ``chunk_heads`` heads back to back, piece i on CUDA stream ``i mod streams`` (the helper takes
    its two compute streams in turn, so a piece's attention fills the SMs the previous piece's last
    wave leaves idle; ``streams=1`` is one piece after another). The inputs are in place, as in a
    helper whose copies run ahead of its attention."""
    parts = [
        _dense_slice(pq, h0, h1)
        for _, h0, h1 in attention_schedule.pieces([0, 0, heads], chunk_heads)
    ]
    if device.type != "cuda":
        return _timed(lambda: [attn_ops.attend(part, fields) for part in parts], reps, device)[0]
    side = [torch.cuda.Stream(device) for _ in range(streams)]
    main = torch.cuda.current_stream(device)

    def run() -> list:
        ready = torch.cuda.Event()
        ready.record(main)
        outs = []
        for i, part in enumerate(parts):
            stream = side[i % streams]
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                outs.append(attn_ops.attend(part, fields))
        for stream in side:
            main.wait_stream(stream)
        return outs

    return _timed(run, reps, device)[0]


def _legs(stage: float, helper_in: float, helper_out: float, ret: float) -> attention_schedule.Legs:
    """:class:`attention_schedule.Legs` (seconds per byte) from the legs' rates in B/s."""
    return attention_schedule.Legs(
        stage=1 / stage, helper_in=1 / helper_in, helper_out=1 / helper_out, ret=1 / ret
    )


def _phases(calls: list[dict]) -> dict:
    """Per phase of the helpers' path, added up over the helpers of each call, the median over
    ``calls``: seconds, bytes and GB/s (stage copy and take-back on the model GPU, copy in / compute
    / copy out in the helpers)."""

    def med(key: str, ranks: bool = True) -> float:
        return statistics.median(
            sum(r[key] for r in c["ranks"][1:]) if ranks else c[key] for c in calls
        )

    legs = {
        "stage": ("stage_s", "staged_bytes"),
        "helper_in": ("h2d_s", "staged_bytes"),
        "compute": ("compute_s", None),
        "helper_out": ("d2h_s", "returned_bytes"),
        "take_back": ("return_s", "returned_bytes"),
    }
    out = {}
    for name, (key, nbytes) in legs.items():
        secs = med(key)
        moved = calls[-1][nbytes] if nbytes else None
        out[name] = {
            "s": secs,
            "bytes": moved,
            "GBps": moved / secs / 1e9 if moved and secs > 0 else None,
        }
    out["rank0_compute"] = {
        "s": statistics.median(c["ranks"][0]["compute_s"] for c in calls),
        "bytes": None,
        "GBps": None,
    }
    return out


def _round_trip(eng: AttentionParallelEngine, reps: int = 20) -> float:
    """Median seconds of one ``ping`` round trip to the first helper (what one piece's message
    costs)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        get_coordinator().run(eng.pool.request(0, Ping(), 10.0), 15.0, "pinging a helper")
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _parallel_run(
    device: torch.device,
    n: int,
    transport: str,
    chunk_heads: int,
    pq: Any,
    ref: torch.Tensor,
    quant_s: float,
    attn_s: float,
    reps: int,
) -> dict:
    """The engine with ``n`` logical helpers on ``device`` over ``transport``: exactness (first call
    included), medians, per-phase seconds, bytes and rates, the split it tuned, one message's round
    trip."""
    eng = AttentionParallelEngine(
        [str(device)] * (n + 1), transport=transport, chunk_heads=chunk_heads
    )
    try:
        first_equal = torch.equal(eng.attend(pq), ref)
        wall, out = _timed(lambda: eng.attend(pq), reps, device)
        calls = eng.recent_calls()[-reps:]
        phases = _phases(calls)
        return {
            "helpers": n,
            "transport": transport,
            "chunk_heads": chunk_heads,
            "heads": [r["heads"][1] - r["heads"][0] for r in calls[-1]["ranks"]],
            "pieces": [r["pieces"] for r in calls[-1]["ranks"][1:]],
            "bit_exact_first_call": first_equal,
            "bit_exact": torch.equal(out, ref),
            "wall_s": wall,
            "speedup_vs_unsplit": (quant_s + attn_s) / (quant_s + wall),
            "staged_bytes": phases["stage"]["bytes"],
            "stage_s": phases["stage"]["s"],
            "stage_GBps": phases["stage"]["GBps"],
            "returned_bytes": phases["take_back"]["bytes"],
            "return_s": phases["take_back"]["s"],
            "return_GBps": phases["take_back"]["GBps"],
            "phases": phases,
            "message_round_trip_s": _round_trip(eng),
            "tuned_split": eng.snapshot()["splits"],
            "per_rank": [
                {
                    k: r[k]
                    for k in (
                        "device",
                        "heads",
                        "transport",
                        "pieces",
                        "stage_s",
                        "h2d_s",
                        "compute_s",
                        "d2h_s",
                        "return_s",
                        "wall_s",
                    )
                }
                for r in calls[-1]["ranks"]
            ],
        }
    finally:
        eng.release()


def run(
    shape: Sequence[int],
    helper_counts: Sequence[int],
    transports: Sequence[str],
    reps: int,
    device: torch.device,
    chunk_heads: int = CHUNK_HEADS,
) -> dict:
    """The whole benchmark (see the module doc); returns the JSON record."""
    import comfy_kitchen as ck

    b, heads, tokens, head_dim = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(b, heads, tokens, head_dim, generator=g, device=device, dtype=torch.bfloat16)
        for _ in range(3)
    )
    with torch.inference_mode():
        quant_s, pq = _timed(
            functools.partial(ck.prequantize_int8_attention, q, k, v), reps, device
        )
        del q, k, v
        attn_s, ref = _timed(lambda: ck.int8_attention_from_prequantized(pq), reps, device)
        in_per_head = _nbytes(attn_ops.head_slice(pq, 0, heads).values()) / heads
        out_per_head = ref.numel() * ref.element_size() / heads
        needed = {h for n in MODEL_GPUS if n <= heads for h in slice_sizes(heads, n)}
        pieces = set(range(1, min(chunk_heads, heads) + 1))
        fields = attn_ops.meta(pq)
        slice_s = {}
        for h in sorted(needed | pieces | {heads}):
            part = _dense_slice(pq, 0, h)
            slice_s[h], _ = _timed(functools.partial(attn_ops.attend, part, fields), reps, device)
        # a helper's range at N = 4 (the aim's N; fewer with fewer heads), attended in pieces as a
        # helper does
        helper_heads = slice_sizes(heads, min(4, heads))[-1]
        chains = {
            str(c): {
                f"{n}_stream{'s' if n > 1 else ''}": chain_s(
                    pq, fields, helper_heads, c, n, reps, device
                )
                for n in (1, 2)
            }
            for c in sorted(pieces)
        }
        runs = [
            _parallel_run(device, n, t, chunk_heads, pq, ref, quant_s, attn_s, reps)
            for n in helper_counts
            for t in transports
        ]
    host = _host_rates(device, int(in_per_head * heads))
    p2p: PeerRate = peer_rate() if device.type == "cuda" else {"GBps": None, "why": "CPU run"}
    ipc_runs = [
        r for r in runs if r["transport"] == "cuda_ipc" and r["stage_GBps"] and r["return_GBps"]
    ]
    ipc_local = [r["stage_GBps"] for r in ipc_runs]
    per_head = statistics.median(s / h for h, s in slice_s.items() if h in needed | {heads})

    def in_pieces(c: int) -> float:
        """A helper's per-head attention time in pieces of at most ``c`` heads, as it runs them (two
        streams)."""
        return chains[str(c)]["2_streams"] / helper_heads

    piece_per_head = in_pieces(chunk_heads) if pieces else per_head
    rtt = statistics.median(r["message_round_trip_s"] for r in runs)
    unsplit = quant_s + attn_s
    links: dict[str, tuple[Any, str]] = {
        # host staging: the model GPU's link carries the staging (device to host) and the returns
        # (host to device), each helper's own link its copy in and out
        "pcie_host_staged": (
            _legs(
                host["d2h_GBps"] * 1e9,
                host["h2d_GBps"] * 1e9,
                host["d2h_GBps"] * 1e9,
                host["h2d_GBps"] * 1e9,
            ),
            "host staging at this run's measured device<->registered-shm rates "
            f"({host['d2h_GBps']:.1f} / {host['h2d_GBps']:.1f} GB/s), one PCIe link per GPU",
        ),
        "pcie_gen4_x16_assumed": (
            _legs(*[PCIE_GEN4_X16 * 1e9] * 4),
            f"host staging at {PCIE_GEN4_X16:g} GB/s each way, an ASSUMED PCIe Gen4 x16 rate (not "
            "measured here)",
        ),
    }
    if ipc_runs:
        # CUDA IPC: staging and take-back are copies inside the model GPU (rates of the cuda_ipc
        # runs), the helpers copy over NVLink
        local = statistics.median(ipc_local) * 1e9
        back = statistics.median(r["return_GBps"] for r in ipc_runs) * 1e9
        inside = (
            f"CUDA IPC: staging / take-back inside the model GPU at the measured {local / 1e9:.0f} "
            f"/ {back / 1e9:.0f} GB/s"
        )
        if p2p["GBps"]:
            links["nvlink_p2p"] = (
                _legs(local, p2p["GBps"] * 1e9, p2p["GBps"] * 1e9, back),
                f"{inside}, helpers copy P2P at the measured {p2p['GBps']:.0f} GB/s",
            )
        links["nvlink_assumed"] = (
            _legs(local, NVLINK_ASSUMED * 1e9, NVLINK_ASSUMED * 1e9, back),
            f"{inside}, helpers copy P2P at {NVLINK_ASSUMED:g} GB/s, an ASSUMED NVLink 4 copy rate "
            f"(not measured here: {p2p['why']})",
        )
    models: dict[str, Any] = {}
    for name, (legs, note) in links.items():
        models[name] = {"links": note, "s_per_byte": vars(legs)}
        for n in (n for n in MODEL_GPUS if n <= heads):
            ipc = name.startswith("nvlink")
            pred = predict(
                n,
                heads,
                quant_s,
                per_head,
                piece_per_head,
                in_per_head,
                out_per_head,
                legs,
                attention_schedule.Pipeline(chunk_heads, ipc, rtt / 2),
            )
            whole = predict(
                n,
                heads,
                quant_s,
                per_head,
                per_head,
                in_per_head,
                out_per_head,
                legs,
                attention_schedule.Pipeline(0, ipc, rtt / 2),
            )
            # smaller pieces than the engine ran, each at the measured cost of its slice sizes
            smaller = {
                str(c): unsplit
                / predict(
                    n,
                    heads,
                    quant_s,
                    per_head,
                    in_pieces(c),
                    in_per_head,
                    out_per_head,
                    legs,
                    attention_schedule.Pipeline(c, ipc, rtt / 2),
                )["total_s"]
                for c in sorted(pieces)[:-1]
            }
            models[name][f"N={n}"] = dict(
                pred,
                speedup=unsplit / pred["total_s"],
                whole_slices={
                    "heads": whole["heads"],
                    "total_s": whole["total_s"],
                    "speedup": unsplit / whole["total_s"],
                },
                speedup_by_chunk_heads=dict(
                    smaller, **{str(chunk_heads): unsplit / pred["total_s"]}
                )
                if pieces
                else {},
            )
    if "nvlink_p2p" not in models:
        models["nvlink_p2p"] = {
            "predicted": None,
            "why": p2p["why"]
            if ipc_runs
            else "no cuda_ipc run to measure the model GPU's staging rate",
        }
    return {
        "shape": list(shape),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "unsplit": {"prequantize_s": quant_s, "attention_s": attn_s, "total_s": unsplit},
        "slice_attention_s": {str(h): s for h, s in sorted(slice_s.items())},
        "per_head_attention_s": per_head,
        "per_head_attention_s_in_pieces": piece_per_head,
        "helper_range_in_pieces_s": {"heads": helper_heads, "by_chunk_heads": chains},
        "message_round_trip_s": rtt,
        "bytes_per_head": {"in": in_per_head, "out": out_per_head},
        "links_GBps": {
            "host_d2h": host["d2h_GBps"],
            "host_h2d": host["h2d_GBps"],
            "p2p": p2p["GBps"],
            "p2p_note": p2p["why"],
            "cuda_ipc_local_stage": statistics.median(ipc_local) if ipc_local else None,
            "cuda_ipc_local_take_back": statistics.median(r["return_GBps"] for r in ipc_runs)
            if ipc_runs
            else None,
        },
        "parallel_on_logical_helpers": runs,
        "model": {
            "formula": "quantize + critical path of the engine's schedule "
            "(h3ms_async/attention/schedule.py): each helper's heads are cut into pieces of at "
            "most chunk_heads heads, staged one after another over the model GPU's link, round "
            "robin over the helpers (stage leg); a piece is dispatched when staged (half the "
            "measured message round trip), its helper copies it in (helper_in), attends it "
            "(per_head_attention_s_in_pieces per head: a helper's range attended in pieces of "
            "chunk_heads heads on two alternating streams, as the helper runs them, measured in "
            "this run: helper_range_in_pieces_s) and copies it out (helper_out), the three "
            "overlapping across pieces on their own streams; results come back one at a time in "
            "answer order (ret leg), while the model GPU attends its own heads "
            "(per_head_attention_s, no transfer; with CUDA IPC after the staging); the head split "
            "is the one the engine tunes to (the model GPU's count minimising this path, the "
            "helpers equal). whole_slices: the same with one piece per helper (the previous "
            "schedule)",
            "chunk_heads": chunk_heads,
            **models,
        },
        "reference_pack_4x_pcie": {"unsplit_ms": 534.4, "n4_ms": 197.2, "speedup": 2.71},
    }


def _host_rates(device: torch.device, nbytes: int) -> dict:
    """Device <-> registered-shm GB/s (the host transport's copies); CPU memcpy rates on a CPU
    run."""
    if device.type == "cuda":
        from h3ms_async.tools.bench.gpu import copy_bandwidth

        bw = copy_bandwidth(min(nbytes, 1 << 30))
        return {"d2h_GBps": bw["d2h_registered_GBps"], "h2d_GBps": bw["h2d_registered_GBps"]}
    src, dst = (
        torch.empty(max(nbytes, 1), dtype=torch.uint8),
        torch.empty(max(nbytes, 1), dtype=torch.uint8),
    )
    t, _ = _timed(lambda: dst.copy_(src), 3, device)
    return {"d2h_GBps": nbytes / t / 1e9, "h2d_GBps": nbytes / t / 1e9}


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="python -m h3ms_async bench attention", description=__doc__.split("\n")[0])
    p.add_argument(
        "--shape", default=",".join(map(str, REFERENCE_SHAPE)), help="B,H,S,D of the attention call"
    )
    p.add_argument(
        "--helpers", default="1,3", help="logical helper counts to run (all on --device)"
    )
    p.add_argument(
        "--transports",
        default="",
        help="comma-separated, of host, cuda_ipc (default: both on CUDA, host on a CPU); each runs "
        "side by side",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--chunk-heads",
        type=int,
        default=CHUNK_HEADS,
        help="heads per piece of a helper's range (0: one piece per helper), as the engine runs it",
    )
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="", help="also write the JSON here")
    a = p.parse_args(argv)
    try:
        shape = [int(x) for x in a.shape.split(",")]
        helper_counts = [int(x) for x in a.helpers.split(",")]
    except ValueError:
        p.error(
            "--shape and --helpers take comma-separated integers, e.g. --shape 1,56,93312,128 "
            "--helpers 1,3"
        )
    if len(shape) != 4 or min(shape) < 1 or not helper_counts or min(helper_counts) < 1:
        p.error("--shape needs 4 positive values B,H,S,D and --helpers positive counts")
    if a.chunk_heads < 0:
        p.error(
            f"--chunk-heads {a.chunk_heads}: give 0 (one piece per helper) or a positive head count"
        )
    device = torch.device(a.device)
    transports = [
        t.strip()
        for t in (a.transports or ("host,cuda_ipc" if device.type == "cuda" else "host")).split(",")
        if t.strip()
    ]
    if (
        not transports
        or any(t not in TRANSPORTS for t in transports)
        or (device.type != "cuda" and "cuda_ipc" in transports)
    ):
        p.error(
            f"--transports {a.transports!r}: give some of {', '.join(TRANSPORTS)} (cuda_ipc only "
            "on CUDA)"
        )
    if device.type == "cpu":
        cpu_hook = (
            "kitchen's INT8 attention needs CUDA; on a CPU only the test hook runs it "
            "(H3MS_TEST_HOOKS=1 H3MS_CK_ATTENTION_CPU=1)"
        )
        if not config.TEST_HOOKS.get():
            p.error(cpu_hook)
        from workers.testing import ck_cpu, settings  # test-only code (H3MS_TEST_HOOKS=1)

        if not settings.CK_ATTENTION_CPU.get():
            p.error(cpu_hook)
        ck_cpu.install()
    res = run(shape, helper_counts, transports, max(1, a.reps), device, a.chunk_heads)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return (
        0
        if all(
            r["bit_exact"] and r["bit_exact_first_call"] for r in res["parallel_on_logical_helpers"]
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
