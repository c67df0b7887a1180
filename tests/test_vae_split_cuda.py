"""The VAE split decode on CUDA: the FIRST decode after the workers start equals ComfyUI's unsplit decode bit for
bit, and so does the next one.

Runs ``python -m h3ms_async bench vae`` (ComfyUI's own H3 VAE code in a child started in the real tree) at a reduced
size: 2 decoder layers of the real width (32 heads of 64, so every attention call is large enough for ComfyUI's SDPA
backend priority), logical ranks on ``cuda:0``.  Nothing in the test warms the workers: each rank count starts fresh
workers and its first decode is compared.  A bf16-stored checkpoint loaded as VAELoader loads it (DynamicVRAM on and
off) splits and equals ComfyUI's decode.  On the GPU machine:
``python -m pytest -q -m cuda tests/test_vae_split_cuda.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import comfy_tree
from split_proof import vae_decodes_failure
from h3ms_async.tools.bench.vae import main as bench_vae_main

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_first_split_decode_after_start_equals_comfyui(tmp_path, dtype) -> None:
    root = comfy_tree.ensure_tree()
    shims = [arg for d in comfy_tree.shim_dirs() for arg in ("--extra-path", d)]
    rc = bench_vae_main(["--comfy-root", str(root), *shims, "--device", "cuda:0", "--dtype", dtype,
                         "--ranks", "2,3", "--T", "22", "--height", "24", "--width", "40", "--layers", "2",
                         "--heads", "32", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / f"bench_vae_{dtype}.json").read_text())
    for run in rep["runs"]:
        assert run["equal_first"], f"{run['ranks']} ranks, {dtype}: the first decode after the workers started differs"
        assert run["equal"], f"{run['ranks']} ranks, {dtype}: the second decode differs"
        # both compared decodes split: each has its own record, every rank decoding (tests/split_proof.py)
        why = vae_decodes_failure([run["first_record"], run["record"]], ["cuda:0"] * run["ranks"])
        assert why is None, f"{run['ranks']} ranks, {dtype}: {why}"
        assert run["first_record"]["load_s"] > 0 and len(set(run["first_record"]["devices"])) == 1
    assert rc == 0 and [r["ranks"] for r in rep["runs"]] == [2, 3]


DYNAMIC_SCRIPT = r'''
import asyncio, json, os, sys, torch
import main  # noqa: F401  (ComfyUI's start-up: comfy-aimdo and the ModelPatcherDynamic swap)
import comfy.sd, nodes
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_h3_vae import small_h3_vae_state_dict
from split_proof import SplitProof
sd = {k: v.to(torch.bfloat16) for k, v in small_h3_vae_state_dict().items()}  # a bf16-stored checkpoint
vae = comfy.sd.VAE(sd=sd)  # as VAELoader builds it: ComfyUI picks the compute dtype
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
from h3ms_async.vae import split as vae_split
z = torch.randn(1, 24, 20, 4, 6, generator=torch.Generator().manual_seed(7))
z2 = torch.randn(1, 24, 20, 2, 4, generator=torch.Generator().manual_seed(8))  # another chunk shape
with torch.inference_mode():
    ref, ref2 = vae.decode(z), vae.decode(z2)
blocks = sorted({str(p.dtype) for n, p in vae.first_stage_model.named_parameters()
                 if n.startswith("decoder.transformer_blocks.")})
equal, shares = [], []

def split_decode(v, latent, n, dropped=()):
    """One decode under the split's proof: ``n`` ranks less ``dropped`` decoded every chunk (tests/split_proof.py)."""
    with SplitProof(["cuda:0"] * n, "vae", dropped=dropped) as proof:
        with torch.inference_mode():
            out = v.decode(latent)
    shares.append(proof.summary()["share"])
    return out

for n in (2, 3):
    os.environ["H3MS_VAE_RANK_MAP"] = ",".join(["cuda:0"] * n)
    split_vae = nodes.NODE_CLASS_MAPPINGS["H3MSVAESplitDecodeAsync"]().patch(vae, True, -1)[0]
    equal += [bool(torch.equal(split_decode(split_vae, z, n), ref)) for _ in range(2)]
# the exactness probe on the GPU: a fresh 2-rank pool whose worker decodes otherwise on purpose (test hook), a new
# chunk shape (so the probe runs again): the worker is dropped and the decode stays exact
os.environ["H3MS_TEST_VAE_SKEW_RANK"] = "1"
os.environ["H3MS_VAE_RANK_MAP"] = "cuda:0,cuda:0"
with torch.inference_mode():
    split_vae = nodes.NODE_CLASS_MAPPINGS["H3MSVAESplitDecodeAsync"]().patch(vae, True, -1)[0]
skew_equal = bool(torch.equal(split_decode(split_vae, z2, 2, dropped=[1]), ref2))
skew_rec = vae_split.get_vae_engine(["cuda:0"] * 2).last_record
print("RESULT", json.dumps({"patcher": type(vae.patcher).__name__, "vae_dtype": str(vae.vae_dtype),
                            "blocks": blocks, "equal": equal, "shares": shares, "std": float(ref.std()),
                            "skew_equal": skew_equal, "probe_ms": skew_rec["probe_ms"]}))
'''


@pytest.mark.parametrize("dynamic", [True, False])
def test_bf16_checkpoint_splits_exactly_under_dynamic_vram_and_without(dynamic: bool) -> None:
    """A bf16-stored H3 VAE as VAELoader loads it: under DynamicVRAM ComfyUI keeps the stored bf16 in the comfy.ops
    layers, casts the rest to the fp16 it computes in, and casts each layer's weights per call; the split must run
    the same casts on its workers (it decoded unsplit: "the decoder's blocks mix dtypes").  Then the exactness
    probe on the GPU: a worker skewed on purpose (``H3MS_TEST_VAE_SKEW_RANK``) is dropped."""
    args = ["--disable-api-nodes"] + ([] if dynamic else ["--disable-dynamic-vram"])
    env = {"H3MS_TESTS_DIR": str(Path(__file__).parent), "H3MS_TEST_HOOKS": "1"}
    proc = comfy_tree.run_comfy_script(DYNAMIC_SCRIPT, args, env=env, timeout_s=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    ours = "\n".join(ln for ln in proc.stderr.splitlines() if "H3 MultiStream" in ln)[-4000:]
    r = {**r, "log": ours}  # the pack's own log lines, so that a failed assertion shows why
    print(json.dumps(r, indent=1))  # whole: pytest cuts a long dict in an assertion message
    assert (r["patcher"] == "ModelPatcherDynamic") is dynamic and r["vae_dtype"] == "torch.float16", r
    if dynamic:
        assert r["blocks"] == ["torch.bfloat16", "torch.float16"], r  # the mixed case itself
    assert r["equal"] == [True] * 4 and r["std"] > 0.01, r
    # the proofs passed in ComfyUI's process (tests/split_proof.py): every rank decoded chunks of its own
    assert [len(s) for s in r["shares"]] == [2, 2, 3, 3, 2] and all(min(s) > 0 for s in r["shares"][:4]), r
    assert not [ln for ln in proc.stderr.splitlines() if "decoding unsplit" in ln], proc.stderr[-3000:]
    # a worker made to decode otherwise is caught on the GPU too: one warning naming it, dropped, still exact
    assert r["skew_equal"] and r["probe_ms"] > 0, r  # its proof: rank 1 dropped, rank 0 decoded every chunk
    assert proc.stderr.count("rank 1 (cuda:0 ") == 1, proc.stderr[-3000:]
