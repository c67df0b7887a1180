"""``python -m h3ms_async bench attention``: H3 Attention Parallel at the reference shape, and a model of N GPUs.

In one run (JSON to stdout and ``--out``), at ``--shape`` (default ``1,56,93312,128``, H3's packed ref2va call):

* the unsplit call: kitchen's ``prequantize_int8_attention`` and ``int8_attention_from_prequantized`` (medians);
* the attention of a head slice alone, for the slice sizes that 2, 4 and 8 GPUs get (measured per-helper compute);
* the host transport's copy rates (device to registered shm and back) and, with two GPUs that reach each other, the
  peer-to-peer rate (NVLink or PCIe P2P);
* the parallel call on logical helpers of the same GPU (``--helpers``) over each transport (``--transports``: host
  staging through shm, CUDA IPC), side by side: every output ``torch.equal`` to the unsplit one (the first call after
  the helpers start included), the split the engine tuned, staged and returned bytes and GB/s;
* the predicted time and speedup at N = 2, 4, 8 GPUs of the schedule the engine runs (``attention_schedule``), from
  the quantities above: PCIe host-staged at the measured host rates and at an assumed PCIe Gen4 x16 rate, NVLink by
  CUDA IPC at the measured P2P rate (two GPUs) or an assumed NVLink rate (formula and links in ``model``).

On a CPU (CI smoke test) it runs with the pack's CPU test hook (``H3MS_TEST_HOOKS=1 H3MS_CK_ATTENTION_CPU=1``).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from h3ms_async.attention import schedule as attention_schedule
from h3ms_async.runtime import plans
from h3ms_async.attention.engine import TRANSPORTS, AttentionParallelEngine
from h3ms_async.tools.cli import ArgParser
from workers.attention import ops as attn_ops
from workers.attention import ck_cpu as ck_attention_cpu

REFERENCE_SHAPE = (1, 56, 93312, 128)
MODEL_GPUS = (2, 4, 8)
#: GB/s each way, stated assumptions for links this run cannot measure (labelled "assumed" in the JSON).
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


def peer_rate(nbytes: int = 1 << 30, reps: int = 5) -> dict:
    """GB/s of a cuda:0 -> cuda:1 copy when both GPUs reach each other (else the reason it was not measured)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return {"GBps": None, "why": "fewer than 2 CUDA GPUs visible: run on a machine with 2 GPUs to measure P2P"}
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
    """Heads per device when ``n`` equal devices share ``heads`` (the engine's split at a shape's first call)."""
    bounds = plans.partition(heads, [1.0] * n, "attention heads")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def predict(n: int, heads: int, quant_s: float, per_head_s: float, in_per_head: float, out_per_head: float,
            legs: attention_schedule.Legs) -> dict:
    """Time of one call on ``n`` equal GPUs as the engine runs it (``attention_schedule``): quantize, then the split
    the engine tunes to, with every helper pipelined behind its own slice."""
    best = attention_schedule.best_split(heads, [per_head_s] * n, [1.0] * (n - 1), in_per_head, out_per_head, legs)
    return dict(best, quantize_s=quant_s, total_s=quant_s + best["total_s"])


def _legs(stage: float, helper_in: float, helper_out: float, ret: float) -> attention_schedule.Legs:
    """:class:`attention_schedule.Legs` (seconds per byte) from the legs' rates in B/s."""
    return attention_schedule.Legs(stage=1 / stage, helper_in=1 / helper_in, helper_out=1 / helper_out, ret=1 / ret)


def _parallel_run(device: torch.device, n: int, transport: str, pq: Any, ref: torch.Tensor, quant_s: float,
                  attn_s: float, reps: int) -> dict:
    """The engine with ``n`` logical helpers on ``device`` over ``transport``: exactness (first call included),
    medians, bytes and rates, the split it tuned."""
    eng = AttentionParallelEngine([str(device)] * (n + 1), transport=transport)
    try:
        first_equal = torch.equal(eng.attend(pq), ref)
        wall, out = _timed(lambda: eng.attend(pq), reps, device)
        calls = eng.recent_calls()[-reps:]
        staged = statistics.median(c["stage_s"] for c in calls)
        returned = statistics.median(c["return_s"] for c in calls)
        moved_in, moved_out = calls[-1]["staged_bytes"], calls[-1]["returned_bytes"]
        return {
            "helpers": n, "transport": transport, "heads": [r["heads"][1] - r["heads"][0] for r in calls[-1]["ranks"]],
            "bit_exact_first_call": first_equal, "bit_exact": torch.equal(out, ref), "wall_s": wall,
            "speedup_vs_unsplit": (quant_s + attn_s) / (quant_s + wall),
            "staged_bytes": moved_in, "stage_s": staged, "stage_GBps": moved_in / staged / 1e9 if staged else None,
            "returned_bytes": moved_out, "return_s": returned,
            "return_GBps": moved_out / returned / 1e9 if returned else None,
            "tuned_split": eng.snapshot()["splits"],
            "per_rank": [{k: r[k] for k in ("device", "heads", "transport", "stage_s", "h2d_s", "compute_s", "d2h_s",
                                            "return_s", "wall_s")} for r in calls[-1]["ranks"]],
        }
    finally:
        eng.release()


def run(shape: Sequence[int], helper_counts: Sequence[int], transports: Sequence[str], reps: int,
        device: torch.device) -> dict:
    """The whole benchmark (see the module doc); returns the JSON record."""
    import comfy_kitchen as ck

    b, heads, tokens, head_dim = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, heads, tokens, head_dim, generator=g, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    with torch.inference_mode():
        quant_s, pq = _timed(lambda: ck.prequantize_int8_attention(q, k, v), reps, device)
        del q, k, v
        attn_s, ref = _timed(lambda: ck.int8_attention_from_prequantized(pq), reps, device)
        in_per_head = _nbytes(attn_ops.head_slice(pq, 0, heads).values()) / heads
        out_per_head = ref.numel() * ref.element_size() / heads
        needed = {h for n in MODEL_GPUS if n <= heads for h in slice_sizes(heads, n)}
        fields = attn_ops.meta(pq)
        slice_s = {}
        for h in sorted(needed | {heads}):
            part = {name: t.contiguous() for name, t in attn_ops.head_slice(pq, 0, h).items()}
            slice_s[h], _ = _timed(lambda: attn_ops.attend(part, fields), reps, device)
        runs = [_parallel_run(device, n, t, pq, ref, quant_s, attn_s, reps) for n in helper_counts for t in transports]
    host = _host_rates(device, int(in_per_head * heads))
    p2p = peer_rate() if device.type == "cuda" else {"GBps": None, "why": "CPU run"}
    ipc_local = [r["stage_GBps"] for r in runs if r["transport"] == "cuda_ipc" and r["stage_GBps"]]
    per_head = statistics.median(s / h for h, s in slice_s.items())
    unsplit = quant_s + attn_s
    links: dict[str, tuple[Any, str]] = {
        # host staging: the model GPU's link carries the staging (device to host) and the returns (host to device),
        # each helper's own link its copy in and out
        "pcie_host_staged": (_legs(host["d2h_GBps"] * 1e9, host["h2d_GBps"] * 1e9, host["d2h_GBps"] * 1e9,
                                   host["h2d_GBps"] * 1e9),
                             f"host staging at this run's measured device<->registered-shm rates "
                             f"({host['d2h_GBps']:.1f} / {host['h2d_GBps']:.1f} GB/s), one PCIe link per GPU"),
        "pcie_gen4_x16_assumed": (_legs(*[PCIE_GEN4_X16 * 1e9] * 4),
                                  f"host staging at {PCIE_GEN4_X16:g} GB/s each way, an ASSUMED PCIe Gen4 x16 rate "
                                  "(not measured here)"),
    }
    if ipc_local:
        local = statistics.median(ipc_local) * 1e9
        if p2p["GBps"]:
            # CUDA IPC: staging and returns are copies inside the model GPU, the helper copies over NVLink
            links["nvlink_p2p"] = (_legs(local, p2p["GBps"] * 1e9, p2p["GBps"] * 1e9, local),
                                   f"CUDA IPC: staging into the model GPU's own memory at the measured "
                                   f"{local / 1e9:.0f} GB/s, helpers copy P2P at the measured {p2p['GBps']:.0f} GB/s")
        links["nvlink_assumed"] = (_legs(local, NVLINK_ASSUMED * 1e9, NVLINK_ASSUMED * 1e9, local),
                                   f"CUDA IPC: staging into the model GPU's own memory at the measured "
                                   f"{local / 1e9:.0f} GB/s, helpers copy P2P at {NVLINK_ASSUMED:g} GB/s, an ASSUMED "
                                   f"NVLink 4 copy rate (not measured here: {p2p['why']})")
    models: dict[str, Any] = {}
    for name, (legs, note) in links.items():
        models[name] = {"links": note, "s_per_byte": vars(legs)}
        for n in (n for n in MODEL_GPUS if n <= heads):
            pred = predict(n, heads, quant_s, per_head, in_per_head, out_per_head, legs)
            models[name][f"N={n}"] = dict(pred, speedup=unsplit / pred["total_s"])
    if "nvlink_p2p" not in models:
        models["nvlink_p2p"] = {"predicted": None, "why": p2p["why"] if ipc_local else
                                "no cuda_ipc run to measure the model GPU's staging rate"}
    return {
        "shape": list(shape), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "unsplit": {"prequantize_s": quant_s, "attention_s": attn_s, "total_s": unsplit},
        "slice_attention_s": {str(h): s for h, s in sorted(slice_s.items())},
        "per_head_attention_s": per_head,
        "bytes_per_head": {"in": in_per_head, "out": out_per_head},
        "links_GBps": {"host_d2h": host["d2h_GBps"], "host_h2d": host["h2d_GBps"], "p2p": p2p["GBps"],
                       "p2p_note": p2p["why"], "cuda_ipc_local_stage": statistics.median(ipc_local) if ipc_local
                       else None},
        "parallel_on_logical_helpers": runs,
        "model": {"formula": "quantize + critical path of the engine's schedule (h3ms_async/attention/schedule.py): "
                             "the model GPU stages the helpers' slices one after another in helper order (stage leg); "
                             "helper r starts when its own slice is staged, copies it in (helper_in), attends its "
                             "heads (per_head_attention_s each, measured alone in this run), copies the result out "
                             "(helper_out); results come back one at a time in completion order (ret leg), while the "
                             "model GPU attends its own heads (no transfer); the head split is the one the engine "
                             "tunes to (the model GPU's count minimising this path, the helpers equal)",
                  **models},
        "reference_pack_4x_pcie": {"unsplit_ms": 534.4, "n4_ms": 197.2, "speedup": 2.71},
    }


def _host_rates(device: torch.device, nbytes: int) -> dict:
    """Device <-> registered-shm GB/s (the host transport's copies); CPU memcpy rates on a CPU run."""
    if device.type == "cuda":
        from h3ms_async.tools.bench.gpu import copy_bandwidth
        bw = copy_bandwidth(min(nbytes, 1 << 30))
        return {"d2h_GBps": bw["d2h_registered_GBps"], "h2d_GBps": bw["h2d_registered_GBps"]}
    src, dst = torch.empty(max(nbytes, 1), dtype=torch.uint8), torch.empty(max(nbytes, 1), dtype=torch.uint8)
    t, _ = _timed(lambda: dst.copy_(src), 3, device)
    return {"d2h_GBps": nbytes / t / 1e9, "h2d_GBps": nbytes / t / 1e9}


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="python -m h3ms_async bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default=",".join(map(str, REFERENCE_SHAPE)), help="B,H,S,D of the attention call")
    p.add_argument("--helpers", default="1,3", help="logical helper counts to run (all on --device)")
    p.add_argument("--transports", default="", help="comma-separated, of host, cuda_ipc (default: both on CUDA, host "
                   "on a CPU); each runs side by side")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="", help="also write the JSON here")
    a = p.parse_args(argv)
    try:
        shape = [int(x) for x in a.shape.split(",")]
        helper_counts = [int(x) for x in a.helpers.split(",")]
    except ValueError:
        p.error("--shape and --helpers take comma-separated integers, e.g. --shape 1,56,93312,128 --helpers 1,3")
    if len(shape) != 4 or min(shape) < 1 or not helper_counts or min(helper_counts) < 1:
        p.error("--shape needs 4 positive values B,H,S,D and --helpers positive counts")
    device = torch.device(a.device)
    transports = [t.strip() for t in (a.transports or ("host,cuda_ipc" if device.type == "cuda" else "host"))
                  .split(",") if t.strip()]
    if not transports or any(t not in TRANSPORTS for t in transports) or (
            device.type != "cuda" and "cuda_ipc" in transports):
        p.error(f"--transports {a.transports!r}: give some of {', '.join(TRANSPORTS)} (cuda_ipc only on CUDA)")
    if device.type == "cpu" and not ck_attention_cpu.install_if_requested():
        p.error("kitchen's INT8 attention needs CUDA; on a CPU only the test hook runs it "
                "(H3MS_TEST_HOOKS=1 H3MS_CK_ATTENTION_CPU=1)")
    res = run(shape, helper_counts, transports, max(1, a.reps), device)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if all(r["bit_exact"] and r["bit_exact_first_call"] for r in res["parallel_on_logical_helpers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
