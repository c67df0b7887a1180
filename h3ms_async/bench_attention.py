"""``python -m h3ms_async bench attention``: H3 Attention Parallel at the reference shape, and a model of N GPUs.

In one run (JSON to stdout and ``--out``), at ``--shape`` (default ``1,56,93312,128``, H3's packed ref2va call):

* the unsplit call: kitchen's ``prequantize_int8_attention`` and ``int8_attention_from_prequantized`` (medians);
* the attention of a head slice alone, for the slice sizes that 2, 4 and 8 GPUs get (measured per-helper compute);
* the host transport's copy rates (device to registered shm and back) and, with two GPUs that reach each other, the
  peer-to-peer rate (NVLink or PCIe P2P);
* the parallel call on logical helpers of the same GPU (``--helpers``), every output ``torch.equal`` to the unsplit
  one (the first call after the helpers start included), with its staged and returned bytes and GB/s;
* the predicted time and speedup at N = 2, 4, 8 GPUs, built only from the quantities above (formula in ``model``).

On a CPU (CI smoke test) it runs with the pack's CPU test hook (``H3MS_TEST_HOOKS=1 H3MS_CK_ATTENTION_CPU=1``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from h3ms_async import plans
from h3ms_async.attention_parallel import AttentionParallelEngine
from workers import attn_ops, ck_attention_cpu

REFERENCE_SHAPE = (1, 56, 93312, 128)
MODEL_GPUS = (2, 4, 8)


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
    """Heads per device when ``n`` equal devices share ``heads`` (the engine's partition)."""
    bounds = plans.partition(heads, [1.0] * n, "attention heads")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def predict(n: int, heads: int, quant_s: float, slice_s: dict[int, float], in_per_head: float,
            out_per_head: float, to_link: float, from_link: float) -> dict:
    """Time of one call on ``n`` GPUs, as the engine runs it: quantize; the model GPU attends its heads while it sends
    every helper's slice over its own link (``to_link`` B/s) and the helpers, each on its own link, copy in, attend
    (``slice_s[h]``: measured time of h heads) and copy out; then the model GPU takes the results in (``from_link``)."""
    sizes = slice_sizes(heads, n)
    stage = sum(h * in_per_head for h in sizes[1:]) / to_link
    helper = max(h * in_per_head / from_link + slice_s[h] + h * out_per_head / to_link for h in sizes[1:])
    back = sum(h * out_per_head for h in sizes[1:]) / from_link
    total = quant_s + max(slice_s[sizes[0]], stage + helper) + back
    return {"heads": sizes, "stage_s": stage, "helper_s": helper, "return_s": back, "total_s": total}


def run(shape: Sequence[int], helper_counts: Sequence[int], reps: int, device: torch.device) -> dict:
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
        runs = []
        for n in helper_counts:
            eng = AttentionParallelEngine([str(device)] * (n + 1))
            try:
                first_equal = torch.equal(eng.attend(pq), ref)
                wall, out = _timed(lambda: eng.attend(pq), reps, device)
                calls = eng.recent_calls()[-reps:]
                staged = statistics.median(c["stage_s"] for c in calls)
                returned = statistics.median(c["return_s"] for c in calls)
                moved_in, moved_out = calls[-1]["staged_bytes"], calls[-1]["returned_bytes"]
                runs.append({
                    "helpers": n, "heads": slice_sizes(heads, n + 1),
                    "bit_exact_first_call": first_equal, "bit_exact": torch.equal(out, ref), "wall_s": wall,
                    "speedup_vs_unsplit": (quant_s + attn_s) / (quant_s + wall),
                    "staged_bytes": moved_in, "stage_s": staged, "stage_GBps": moved_in / staged / 1e9,
                    "returned_bytes": moved_out, "return_s": returned, "return_GBps": moved_out / returned / 1e9,
                    "per_rank": [{k: r[k] for k in ("device", "heads", "compute_s", "h2d_s", "d2h_s", "wall_s")}
                                 for r in calls[-1]["ranks"]],
                })
            finally:
                eng.release()
    host = _host_rates(device, int(in_per_head * heads))
    p2p = peer_rate() if device.type == "cuda" else {"GBps": None, "why": "CPU run"}
    unsplit = quant_s + attn_s
    models: dict[str, Any] = {}
    links = {"pcie_host_staged": (host["d2h_GBps"], host["h2d_GBps"]), "nvlink_p2p": (p2p["GBps"], p2p["GBps"])}
    for name, (to_gbps, from_gbps) in links.items():
        if not to_gbps or not from_gbps:
            models[name] = {"predicted": None, "why": p2p["why"]}
            continue
        models[name] = {}
        for n in (n for n in MODEL_GPUS if n <= heads):
            pred = predict(n, heads, quant_s, slice_s, in_per_head, out_per_head, to_gbps * 1e9, from_gbps * 1e9)
            models[name][f"N={n}"] = dict(pred, speedup=unsplit / pred["total_s"])
    return {
        "shape": list(shape), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "unsplit": {"prequantize_s": quant_s, "attention_s": attn_s, "total_s": unsplit},
        "slice_attention_s": {str(h): s for h, s in sorted(slice_s.items())},
        "bytes_per_head": {"in": in_per_head, "out": out_per_head},
        "links_GBps": {"host_d2h": host["d2h_GBps"], "host_h2d": host["h2d_GBps"], "p2p": p2p["GBps"],
                       "p2p_note": p2p["why"]},
        "parallel_on_logical_helpers": runs,
        "model": {"formula": "quantize + max(model GPU's own heads, stage all helper slices over the model GPU's link "
                             "+ slowest helper (its copy in, its measured slice attention, its copy out)) + return "
                             "all results over the model GPU's link; every term measured in this run",
                  **models},
        "reference_pack_4x_pcie": {"unsplit_ms": 534.4, "n4_ms": 197.2, "speedup": 2.71},
    }


def _host_rates(device: torch.device, nbytes: int) -> dict:
    """Device <-> registered-shm GB/s (the host transport's copies); CPU memcpy rates on a CPU run."""
    if device.type == "cuda":
        from h3ms_async.bench_gpu import copy_bandwidth
        bw = copy_bandwidth(min(nbytes, 1 << 30))
        return {"d2h_GBps": bw["d2h_registered_GBps"], "h2d_GBps": bw["h2d_registered_GBps"]}
    src, dst = torch.empty(max(nbytes, 1), dtype=torch.uint8), torch.empty(max(nbytes, 1), dtype=torch.uint8)
    t, _ = _timed(lambda: dst.copy_(src), 3, device)
    return {"d2h_GBps": nbytes / t / 1e9, "h2d_GBps": nbytes / t / 1e9}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3ms_async bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default=",".join(map(str, REFERENCE_SHAPE)), help="B,H,S,D of the attention call")
    p.add_argument("--helpers", default="1,3", help="logical helper counts to run (all on --device)")
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
    if device.type == "cpu" and not ck_attention_cpu.install_if_requested():
        p.error("kitchen's INT8 attention needs CUDA; on a CPU only the test hook runs it "
                "(H3MS_TEST_HOOKS=1 H3MS_CK_ATTENTION_CPU=1)")
    res = run(shape, helper_counts, max(1, a.reps), device)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if all(r["bit_exact"] and r["bit_exact_first_call"] for r in res["parallel_on_logical_helpers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
