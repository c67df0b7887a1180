"""H3 Attention Parallel on a CUDA GPU (skipped without one; the lead runs it on the H200, see docs/attention_parallel.md).

* the engine with 1 and 3 logical helpers on the model's GPU at 56 heads x 32768 tokens: every call ``torch.equal`` to
  kitchen's unsplit call, the first call after the helpers start included;
* real ComfyUI with ``--use-ck-attention``, the model on ``cuda:0``, 1 and 3 logical helpers (``H3MS_ATTN_HELPERS``),
  a >= 30k-token AV latent: every sampling output ``torch.equal`` to plain ComfyUI in the same process.
"""
from __future__ import annotations

import json

import pytest
import torch

import comfy_tree
from test_attention_parallel_comfy import MODEL_SCRIPT

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")]


@pytest.mark.parametrize("helpers", [1, 3])
def test_engine_on_logical_helpers_is_exact(helpers):
    import comfy_kitchen as ck

    from h3ms_async.attention_parallel import AttentionParallelEngine
    if not ck.int8_attention_is_available(torch.device("cuda:0")):
        pytest.skip("comfy-kitchen's INT8 attention is not available on cuda:0 (needs its CUDA build, SM >= 7.5)")
    g = torch.Generator(device="cuda:0").manual_seed(helpers)
    q, k, v = (torch.randn(1, 56, 32768, 128, generator=g, device="cuda:0", dtype=torch.bfloat16) for _ in range(3))
    with torch.inference_mode():
        pq = ck.prequantize_int8_attention(q, k, v)
        whole = ck.int8_attention_from_prequantized(pq)
        eng = AttentionParallelEngine(["cuda:0"] * (helpers + 1))
        try:
            for call in range(3):
                out = eng.attend(pq)
                assert out.device == whole.device and torch.equal(out, whole), f"call {call} differs"
        finally:
            eng.release()


_BODY = MODEL_SCRIPT + r'''
import importlib
ap = importlib.import_module("h3ms_async.attention_parallel")
print("load device", model.load_device, flush=True)
plain = sample(model)
res = {"load_device": str(model.load_device), "runs": {}}
for helpers in ("cuda:0", "cuda:0,cuda:0,cuda:0"):
    os.environ["H3MS_ATTN_HELPERS"] = helpers
    (patched,) = AP().patch(model, str(1 + len(helpers.split(","))), 32768)
    first = sample(patched)  # the first call after the helpers start
    second = sample(patched)
    eng = [e for e in ap.live_engines() if e.devices == ["cuda:0"] + helpers.split(",")][0]
    res["runs"][helpers] = {"first_equal": all(torch.equal(a, b) for a, b in zip(plain, first)),
                            "second_equal": all(torch.equal(a, b) for a, b in zip(plain, second)),
                            "calls": eng.snapshot()["calls"],
                            "tokens": max(c["tokens"] for c in eng.recent_calls())}
ap.release_all_engines()
print("RESULT " + json.dumps(res))
'''


def test_comfyui_sampling_equals_plain_with_ck_attention():
    reason = comfy_tree.skip_reason()
    if reason:
        pytest.skip(reason)
    proc = comfy_tree.run_comfy_script(
        _BODY, ["--use-ck-attention", "--disable-api-nodes"],
        env={"H3MS_TEST_HEADS": "56", "H3MS_TEST_LATENT": "928,896,124"}, timeout_s=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"ComfyUI script failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["load_device"].startswith("cuda")
    for helpers, run in res["runs"].items():
        assert run["tokens"] >= 30000, f"{helpers}: only {run['tokens']} tokens per attention call"
        assert run["calls"] > 0 and run["first_equal"] and run["second_equal"], f"{helpers}: {run}"
