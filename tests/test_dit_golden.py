"""The reference block math reproduces ComfyUI's recorded H3 DiT blocks bit for bit (shared/golden/dit_*.pt).

The recording ran ATen's AVX2 kernels (8-float lanes: an AVX-512 CPU's default 16-lane norms and softmax round
differently) and MKL's AVX2 branch, while oneDNN picked its GEMM kernels from the CPU: the bf16 GEMMs took the
AVX2-class path and int8 ``torch._int_mm`` ran exact integer kernels (VNNI/AVX-512).  On a CPU with avx512_bf16 no
single oneDNN ISA cap gives both: bf16 matches only under ``ONEDNN_MAX_CPU_ISA=AVX2``, and under that cap ``_int_mm``
is no longer exact integer arithmetic (AVX2 int8 saturates 16-bit pair sums) so int8 matches only uncapped.  These
settings are read once per process, so each file is checked in a fresh interpreter with its own
(``tests/cpu_paths.py``), and skipped with the reason where that path cannot run on this CPU.  Each check also
compares the rope table built from the recorded positions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import GOLDEN_DIR, ROOT
from cpu_paths import GOLDEN_CAPABILITY, golden_env, golden_refusal

from h3ms_async.dit.layout import build_layout
from h3ms_async.dit.reference import DiTConfig

#: case -> (ONEDNN_MAX_CPU_ISA: None for the CPU's best, whether its attention runs in bf16)
CASES = {"fp32": (None, False), "bf16": ("AVX2", True), "int8": (None, True)}
#: The cases whose GEMMs are MKL's (fp32 weights); the others' are oneDNN's.
MKL_CASES = {"fp32"}

_CHILD = r"""
import json, sys, torch
from h3ms_async.dit.reference import DiTConfig, ReferenceDiT, rope_table
g = torch.load(sys.argv[1], weights_only=True)
cfg = DiTConfig.from_golden(g["config"]["model_kwargs"], eps=g["config"]["norm_eps"])
model = ReferenceDiT(cfg, g["config"]["weights"], seed=0)
model.load_state_dict(dict(g["state_dict"]))
inp = g["inputs"]
segs = [tuple(s) for s in inp["mod_segments"]]
rope = rope_table(g["model"]["position_ids"], cfg.rope_pairs, inp["rope_freqs"].dtype)
report = {"rope_equal": torch.equal(rope, inp["rope_freqs"]), "blocks": [],
          "isa": torch.backends.cpu.get_cpu_capability()}
from workers.dit.loop import BlockInputs, block_forward_unsplit
h = inp["h"].clone()
mod = model.modulation(inp["t_emb"])
with torch.inference_mode():
    for i in range(cfg.layers):
        h = block_forward_unsplit(h, model.block_weights(i), BlockInputs(mod[i : i + 1], segs, inp["rope_freqs"]),
                                  cfg.heads, cfg.head_dim, cfg.eps)
        ref = g["block_outputs"][i]
        report["blocks"].append([torch.equal(h, ref), (h.float() - ref.float()).abs().max().item()])
    report["final_equal"] = torch.equal(h, g["final"])
    whole = model.forward_blocks(inp["h"].clone(), inp["t_emb"], segs, inp["rope_freqs"])
    report["forward_blocks_equal"] = torch.equal(whole, g["final"])
print("REPORT " + json.dumps(report))
"""


def _golden(case: str):
    path = GOLDEN_DIR / f"dit_{case}.pt"
    if not path.is_file():
        pytest.skip(f"golden tensors not found ({path} is missing): set H3MS_SHARED to the project's shared/ folder "
                    "(or H3MS_GOLDEN_DIR to its golden/ directory) to run the bit-exactness checks against ComfyUI")
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_blocks_bit_exact(case: str) -> None:
    path = _golden(case)
    isa, bf16_attention = CASES[case]
    refusal = golden_refusal(isa, bf16_attention, mkl_gemms=case in MKL_CASES)
    if refusal:
        pytest.skip(f"dit_{case}.pt: {refusal}")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    env.update(golden_env(isa), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env, cwd=str(ROOT), capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    assert report["isa"] == GOLDEN_CAPABILITY, report["isa"]
    assert report["rope_equal"], "rope table from model.position_ids differs from the recorded rope_freqs"
    for i, (equal, diff) in enumerate(report["blocks"]):
        assert equal, f"{case} block {i} differs (max |diff| {diff}; oneDNN cap {isa}, ATen {report['isa']})"
    assert report["final_equal"] and report["forward_blocks_equal"]


def test_golden_layout_reproduced() -> None:
    g = torch.load(_golden("int8"), weights_only=True)
    m = g["model"]
    layout = build_layout(7, 5, 4, 6, 10, keyframes=1, text_tags=m["payload"]["text_token_tags"], sigma=0.7)
    assert [list(s) for s in layout.segments] == [list(s) for s in m["layout_segments"]]
    assert [list(s) for s in layout.mod_segments] == [list(s) for s in g["inputs"]["mod_segments"]]
    assert torch.equal(layout.position_ids, m["position_ids"])
    assert torch.equal(torch.tensor(layout.t_values, dtype=torch.float32), m["t_values"])


def test_golden_int8_weights_are_rowwise_quantized_bf16() -> None:
    from h3ms_async.dit.reference import quantize_rowwise

    q8 = torch.load(_golden("int8"), weights_only=True)["state_dict"]
    bf = torch.load(_golden("bf16"), weights_only=True)["state_dict"]
    for lin in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
        q, s = quantize_rowwise(bf[f"blocks.1.{lin}.weight"])
        assert torch.equal(q, q8[f"blocks.1.{lin}.weight"]) and torch.equal(s, q8[f"blocks.1.{lin}.weight_scale"])


def test_golden_config_maps_to_dit_config() -> None:
    g = torch.load(_golden("fp32"), weights_only=True)
    cfg = DiTConfig.from_golden(g["config"]["model_kwargs"])
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.head_dim, cfg.ffn, cfg.t_dim, cfg.rope_pairs) == (
        256, 3, 8, 32, 320, 16, 12)
