"""VAE split decode through the real ComfyUI tree: bit-exact to ComfyUI's own single-device decode.

One ComfyUI process (tests/vae_comfy_script.py) decodes with plain ComfyUI, then through the H3 MS VAE Split Decode
node at 2, 3, 4 and 8 CPU ranks (real worker processes running ComfyUI's own H3 decoder), with T values whose plans
pad and deal uneven chunk counts, a latent tall enough for two spatial tiles, fp16 as well as fp32, a bf16 checkpoint
computed in fp16 as DynamicVRAM leaves it (blocks mixing bf16 and fp16, per-layer casts), the ranks taken from the
DiT split's ``H3MS_RANK_MAP`` and capped by ``max_gpus``, the shared-memory return and both socket returns (forced,
and /dev/shm without room); a worker that dies in the middle of a decode fails it with its last log lines, and the
next decode restarts the pool and is exact again.  Every rank's chunk decode is probed against rank 0's before it is
used: a worker made to decode differently on purpose (a test hook) is dropped with one warning, and the split stays
exact.  Each compared decode is proven split (``tests/split_proof.py``: the case's ranks, less a dropped one, decoded
every chunk once).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import comfy_tree

pytestmark = pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or "")

CASES = [
    {"ranks": 2, "T": 20, "h": 2, "dtype": "fp32", "transport": "auto"},    # 4 chunks, 2 pad tokens
    {"ranks": 2, "T": 10, "h": 18, "dtype": "fp32", "transport": "shm"},    # 2 chunks x 2 spatial tiles
    {"ranks": 2, "T": 20, "h": 2, "dtype": "fp32", "transport": "crash"},   # a worker dies mid-decode, then restart
    {"ranks": 3, "T": 23, "h": 2, "dtype": "fp32", "transport": "socket"},  # 4 chunks on 3 ranks: 2/1/1
    {"ranks": 3, "T": 23, "h": 2, "dtype": "fp32", "transport": "no_shm"},  # auto falls back to the socket
    {"ranks": 4, "T": 27, "h": 2, "dtype": "fp32", "transport": "auto"},    # 5 chunks on 4 ranks: 2/1/1/1
    {"ranks": 4, "T": 13, "h": 2, "dtype": "fp16", "transport": "auto"},    # fp16 decoder, 3 chunks on 4 ranks
    {"ranks": 3, "T": 13, "h": 2, "dtype": "dynamic_bf16", "transport": "auto"},  # stored bf16, computed in fp16
    {"ranks": 2, "T": 13, "h": 2, "dtype": "fp32", "transport": "auto", "dit_map": 3},  # H3MS_RANK_MAP, max_gpus 2
    # rank 2 decodes otherwise (its workers start here: the rank count differs from the cases before and after); a
    # chunk shape no case probed before (verdicts are kept per rank, device and shape)
    {"ranks": 3, "T": 13, "h": 4, "dtype": "fp16", "transport": "auto", "skew_rank": 2},
    # 10 chunks on 8 ranks: 2/2/1/.../1; rank 5's first decode after start (the probe) differs, as a kernel's first
    # call in a fresh process can: the probe's second decode keeps it
    {"ranks": 8, "T": 52, "h": 2, "dtype": "fp32", "transport": "auto", "cold_skew_rank": 5},
]


def test_split_decode_equals_comfyui_at_2_3_4_8_ranks_shm_and_socket(tmp_path) -> None:
    script = (Path(__file__).parent / "vae_comfy_script.py").read_text()
    env = {"H3MS_TESTS_DIR": str(Path(__file__).parent), "H3MS_TEST_VAE_CRASH_FILE": str(tmp_path / "crash-now"), "H3MS_TEST_HOOKS": "1","VAE_CASES": json.dumps(CASES), "H3MS_MAX_FRAME_BYTES": str(256 * 1024),  # several fetch pieces/chunk
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = comfy_tree.run_comfy_script(script, ["--cpu", "--disable-api-nodes"], env=env, timeout_s=800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    for case in res["cases"]:
        rec = case["record"]
        what = f"{case['ranks']} ranks, T={case['T']}, h={case['h']}, {case['dtype']}, {case['transport']}"
        assert case["equal"], f"split decode differs from ComfyUI's: {what}"
        # the proof passed in ComfyUI's process: the case's ranks (less a skewed one) decoded every chunk
        assert case["proofs"] and all(p["failure"] is None for p in case["proofs"]), what
        assert case["std"] > 0.01 and case["saturated"] < 0.5, f"degenerate test output: {what}"
        if case["dtype"] == "dynamic_bf16":  # the case ComfyUI's DynamicVRAM makes of a bf16 checkpoint
            assert case["block_dtypes"] == ["torch.bfloat16", "torch.float16"], case["block_dtypes"]
        skewed = case.get("skew_rank")
        assert case["unchecked_equal"] is (False if skewed else None), f"the skew must reach the output: {what}"
        if case["transport"] == "crash":
            err = case["crash_error"] or ""
            assert err.startswith("VaeSplitError") and "worker rank 0 on cpu" in err and "exited with code 7" in err
            assert "last lines of" in err and "test hook: dying in the middle of a chunk" in err, err
        want = {"auto": "shm", "shm": "shm", "socket": "socket", "no_shm": "socket", "crash": "shm"}[case["transport"]]
        assert rec["transport"] == want, what
    assert {c["ranks"] for c in res["cases"]} == {2, 3, 4, 8}
    assert proc.stderr.count("return over the worker sockets instead of shared memory") == 1
    # the skewed rank: one warning naming its device, its verdict in the status document; the others are exact
    assert proc.stderr.count("rank 2 (cpu") == 1 and "decodes a 1x24x7x4x3 chunk differently" in proc.stderr
    vae_verdicts = [v for v in res["verdicts"] if v["program"] == "vae"]
    assert [v["verdict"] for v in vae_verdicts].count("adjusted") == 1 and all(
        v["verdict"] == "exact" for v in vae_verdicts if not v["detail"].startswith("rank 2 (cpu")), vae_verdicts
    assert all(v["probe_ms"] > 0 and v["device"].startswith("cpu") for v in vae_verdicts), vae_verdicts
    second = [v["detail"] for v in vae_verdicts if "from its second decode on" in v["detail"]]
    assert len(second) == 1 and second[0].startswith("rank 5 decodes a 1x24x7x2x3 chunk"), vae_verdicts
    assert res["hooked_after_disable"] == [] and res["busy"] == 0
    assert res["shm_left"] == [] and res["workers_alive"] == []
