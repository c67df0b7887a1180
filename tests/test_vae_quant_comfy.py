"""A quantized H3 video VAE (int8 "convrot" decoder linears, the checkpoint format H3 users load) through the real
ComfyUI tree: the H3 MS VAE Split Decode node splits it (its workers build the decoder with the same
``mixed_precision_ops`` and load the same stored int8 parts), every split decode equals plain ComfyUI's bit for bit,
the worker decodes its share of the chunks, at 2 and 3 ranks; the H3 MS VAE Cache stands aside on it (one warning)
instead of failing the decode.  On CPU ranks here; on the GPU machine also as logical ranks on ``cuda:0``, where the
int8 linears run comfy-kitchen's CUDA kernels."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import comfy_tree

pytestmark = pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=comfy_tree.skip_reason() or "")

SCRIPT = r'''
import asyncio, json, os, sys, torch
import comfy.sd, nodes

sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_h3_vae import small_h3_vae_state_dict
from split_proof import SplitProof
sd = small_h3_vae_state_dict()
# The decoder blocks' linears as an int8 convrot checkpoint stores them: int8 weight, scale, comfy_quant metadata.
conf = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}).encode()
for name in [n for n, t in sd.items() if n.startswith("decoder.transformer_blocks.") and n.endswith(".weight")
             and t.ndim == 2]:
    scale = sd[name].abs().max() / 127
    prefix = name[:-len("weight")]
    sd[name] = torch.round(sd[name] / scale).clamp(-127, 127).to(torch.int8)
    sd[prefix + "weight_scale"] = scale.reshape(()).float()
    sd[prefix + "comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
with torch.inference_mode():  # as ComfyUI's VAELoader runs; on a GPU in the dtype ComfyUI picks for it
    vae = comfy.sd.VAE(sd=sd, dtype=torch.float32 if DEVICE == "cpu" else None)
lin = type(vae.first_stage_model.decoder.transformer_blocks[0].attn.to_qkv)
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
z = torch.randn(1, 24, 20, 2, 3, generator=torch.Generator().manual_seed(7))
with torch.inference_mode():
    ref = vae.decode(z)
outs, proofs = [], []

def split_decode(v, n):
    """One decode under the split's proof: ``n`` ranks each decoded chunks of their own, every chunk once."""
    with SplitProof([DEVICE] * n, "vae") as proof:
        with torch.inference_mode():
            out = v.decode(z)
    proofs.append(proof.summary())
    return out

for n in (2, 3):
    os.environ["H3MS_VAE_RANK_MAP"] = ",".join([DEVICE] * n)
    split_vae = nodes.NODE_CLASS_MAPPINGS["H3MSVAESplitDecodeAsync"]().patch(vae, True, -1)[0]
    outs += [split_decode(split_vae, n) for _ in range(2)]
# H3 MS VAE Cache on the same VAE: quantized weights cannot be byte-copied back, so it must stand aside, not fail
from h3ms_async.caches import weight_cache
cache_vae = nodes.NODE_CLASS_MAPPINGS["H3MSVAECacheAsync"]().patch(split_vae, True, True, 0.0)[0]
outs += [split_decode(cache_vae, 3) for _ in range(2)]
print("RESULT", json.dumps({"cache_rows": weight_cache().summaries(), "linear": lin.__qualname__,
                            "equal": [bool(torch.equal(o, ref)) for o in outs], "std": float(ref.std()),
                            "proofs": proofs}))
'''


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs a CUDA GPU")])])
def test_quantized_vae_splits_and_equals_comfyui(device: str) -> None:
    flags = ["--cpu"] if device == "cpu" else []
    proc = comfy_tree.run_comfy_script(f"DEVICE = {device!r}\n" + SCRIPT, [*flags, "--disable-api-nodes"],
                                       env={"H3MS_TESTS_DIR": str(Path(__file__).parent)}, timeout_s=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["linear"].startswith("mixed_precision_ops."), r  # ComfyUI really loaded it as a quantized decoder
    assert r["equal"] == [True] * 6 and r["std"] > 0.01, r
    # every rank decoded chunks of its own (2 ranks, then 3): the workers really ran the quantized decoder (the proofs
    # passed in ComfyUI's process, tests/split_proof.py)
    assert [(p["devices"], p["failure"]) for p in r["proofs"]] == [([device] * n, None) for n in (2, 2, 3, 3, 3, 3)]
    assert all(min(p["share"]) > 0 for p in r["proofs"]), r["proofs"]
    assert not [ln for ln in proc.stderr.splitlines() if "decoding unsplit" in ln], "the split must not fall back"
    # quantized weights are never cached as plain bytes: the group holds nothing and says why, once
    assert [(row["state"], row["bytes"]) for row in r["cache_rows"]] == [("aside", 0)], r["cache_rows"]
    assert "are QuantizedTensor, not plain tensors" in r["cache_rows"][0]["reason"]
    assert sum("are QuantizedTensor, not plain tensors" in ln for ln in proc.stderr.splitlines()) == 1
