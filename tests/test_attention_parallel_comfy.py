"""H3 Attention Parallel inside the real ComfyUI tree (tests/comfy_tree.py), on CPU helpers.

ComfyUI runs with ``--cpu --use-ck-attention``; kitchen has no CPU kernel for INT8 attention, so the pack's CPU test
hook (``workers/testing/ck_cpu.py``: kitchen's packed layout and dataclass) is installed
before ComfyUI imports its
attention module, in ComfyUI's process and (through ``H3MS_CK_ATTENTION_CPU=1``) in the helpers.  Plain ComfyUI and the
node then sample the same tiny MiniMax H3 (random weights, real ComfyUI loader, sampler and H3 code) with that same
attention, and the latents must be equal bit for bit, with 2-4 devices (1-3 CPU helpers through ``H3MS_ATTN_HELPERS``),
each sampling's every attention call proven split over the devices (``tests/split_proof.py``).
"""
from __future__ import annotations

import json

import pytest

import comfy_tree

pytestmark = pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))

_HOOK = comfy_tree.CK_CPU_HOOK

#: Builds a tiny MiniMax H3 (H3MS_TEST_HEADS heads) through ComfyUI's own loader, loads the pack, and defines
#: ``sample(model)`` (2 euler steps at cfg 2 on an H3MS_TEST_LATENT=width,height,length AV latent) and
#: ``split_sample(model, helpers)``: ``sample`` under the split's proof (``tests/split_proof.py``: every attention call
#: split over the model's device and the ``H3MS_ATTN_HELPERS`` list ``helpers``; ``unsplit``: none did).
#: Needs ``H3MS_TESTS_DIR`` (this folder).
MODEL_SCRIPT = r'''
import asyncio, json, os, sys, time
import psutil, torch
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from split_proof import SplitProof
import comfy.ldm.modules.attention as attention
import comfy.model_patcher, comfy.ops, comfy.sd, nodes
from comfy.ldm.minimax.model import MiniMaxH3Model
from comfy_extras.nodes_minimax_h3 import _empty_av_latent

cfg = dict(hidden_size=128, num_layers=2, token_refiner_num_layers=1,
           num_attention_heads=int(os.environ.get("H3MS_TEST_HEADS", "8")), attention_head_dim=128,
           ffn_hidden_size=256, text_dim=64, timestep_input_dim=256, time_embed_hidden_size=128, time_embed_dim=64,
           rope_inv_freq_len=16)
shapes = MiniMaxH3Model(**cfg, dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init)
g = torch.Generator().manual_seed(0)
sd = {}
for name, t in shapes.state_dict().items():
    if name.endswith("inv_freq"):
        sd[name] = 1.0 / (10000 ** (torch.arange(t.shape[0], dtype=torch.float32) / t.shape[0]))
    elif t.dim() == 1 and "norm" in name:
        sd[name] = (1.0 + 0.1 * torch.randn(t.shape, generator=g)).to(t.dtype)
    else:
        sd[name] = (0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
model = comfy.sd.load_diffusion_model_state_dict(sd)
asyncio.run(nodes.load_custom_node(os.path.join("custom_nodes", "h3_multistream_async")))
AP = nodes.NODE_CLASS_MAPPINGS["H3AttentionParallelAsync"]
MS = nodes.NODE_CLASS_MAPPINGS["H3MultiStreamAsync"]
GPUSET = nodes.NODE_CLASS_MAPPINGS["H3MSGPUSetAsync"]

def sample(m):
    latent, _ = _empty_av_latent(*(int(x) for x in os.environ.get("H3MS_TEST_LATENT", "64,96,5").split(",")))
    g = torch.Generator().manual_seed(1)
    pos = [[torch.randn(1, 6, cfg["text_dim"], generator=g), {}]]
    neg = [[torch.randn(1, 6, cfg["text_dim"], generator=g), {}]]
    with torch.inference_mode():
        (out,) = nodes.common_ksampler(m, 7, 2, 2.0, "euler", "simple", pos, neg, latent)
    return out["samples"].unbind()

def split_sample(m, helpers, unsplit=False):
    """(the sampled streams, the proof's summary)."""
    with SplitProof([str(m.load_device)] + helpers.split(","), "attention", unsplit=unsplit) as proof:
        out = sample(m)
    return out, proof.summary()
'''

_BODY = _HOOK + MODEL_SCRIPT + r'''
res = {"ck_attention": attention.optimized_attention is attention.attention_comfy_kitchen_int8}
import importlib
ap = importlib.import_module("h3ms_async.attention.engine")  # the pack loaded h3ms_async from its folder
hub = importlib.import_module("h3ms_async.status.hub").get_hub()

def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))

def run(m, helpers, unsplit=False):
    """A parity run: equal to plain ComfyUI, and the proof's summary."""
    out, proof = split_sample(m, helpers, unsplit)
    return {"equal": equal(plain, out), "proof": proof}

def error(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

plain = sample(model)
res["plain_nonzero"] = all(bool(x.abs().sum() > 0) for x in plain)
runs = {}
for helpers, devices, shares in (("cpu", "2", ""), ("cpu,cpu,cpu", "4", "1,2,1,1")):
    os.environ["H3MS_ATTN_HELPERS"] = helpers
    gpus = GPUSET().build("auto", "", shares, 0.0, 8)[0] if shares else None
    (patched,) = AP().patch(model, devices, 32768, gpus)
    runs[devices] = {**run(patched, helpers), "bounds": ap.live_engines()[-1].head_bounds(8)}
res["runs"] = runs
res["status_attention"] = hub.status().get("attention")
# auto (same helpers and shares: the same engine): calls under min_sequence_length stay on the model's device
(short,) = AP().patch(model, "auto", 1_000_000, gpus)
res["auto_short"] = run(short, helpers, unsplit=True)
(long_,) = AP().patch(model, "auto", 1, gpus)
res["auto_long"] = run(long_, helpers)
# refusals
override = long_.model_options["transformer_options"]["optimized_attention_override"]
q = torch.randn(1, 8, 40, 128)
res["mask_error"] = error(lambda: override(None, q, q, q, 8, mask=torch.ones(40, 40), skip_reshape=True))
res["gqa_error"] = error(lambda: override(None, q, q[:, :2], q[:, :2], 8, skip_reshape=True))
res["non_h3_error"] = error(lambda: AP().patch(comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2),
                                               torch.device("cpu"), torch.device("cpu")), "2", 32768))
res["ms_after_ap_error"] = error(lambda: MS().patch(long_, True, -1, "host", 0, True, 0.0, "auto"))
os.environ["H3MS_RANK_MAP"] = "cpu,cpu"
(ms_model,) = MS().patch(model, True, -1, "host", 0, True, 0.0, "auto")
res["ap_after_ms_error"] = error(lambda: AP().patch(ms_model, "2", 32768))
res["disabled_is_identity"] = AP().patch(model, "disabled", 32768)[0] is model
os.environ["H3MS_ATTN_HELPERS"] = "cuda:0"
res["kind_error"] = error(lambda: AP().patch(model, "2", 32768))
os.environ["H3MS_ATTN_HELPERS"] = "cpu"
res["too_many_error"] = error(lambda: AP().patch(model, "4", 32768))
spec = AP.INPUT_TYPES()
res["inputs"] = {"required": list(spec["required"]), "optional": list(spec["optional"]),
                 "devices": spec["required"]["devices"][0], "devices_default": spec["required"]["devices"][1]["default"],
                 "min_seq": {k: spec["required"]["min_sequence_length"][1][k] for k in ("default", "min", "advanced")},
                 "returns": list(AP.RETURN_TYPES), "display": nodes.NODE_DISPLAY_NAME_MAPPINGS["H3AttentionParallelAsync"]}
import comfy.cli_args
comfy.cli_args.args.use_ck_attention = False  # the node reads the flag when it runs, as after a restart without it
res["no_flag_error"] = error(lambda: AP().patch(model, "2", 32768))
ap.release_all_engines()
deadline = time.monotonic() + 5
while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
    time.sleep(0.05)
res["children_left"] = len(psutil.Process().children(recursive=True))
res["shm_left"] = sorted(importlib.import_module("workers.runtime.shm").held_shm(os.getpid()))
print("RESULT " + json.dumps(res))
'''

def _result(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"ComfyUI script failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_sampling_equals_plain_comfyui_with_ck_attention():
    proc = comfy_tree.run_comfy_script(
        _BODY, ["--cpu", "--use-ck-attention", "--disable-api-nodes"],
        env={"H3MS_PACK": str(comfy_tree.ROOT), "H3MS_TEST_HOOKS": "1", "H3MS_CK_ATTENTION_CPU": "1",
             "H3MS_TESTS_DIR": str(comfy_tree.ROOT / "tests")}, timeout_s=300)
    res = _result(proc)
    assert res["ck_attention"] and res["plain_nonzero"]
    for devices, run in [*res["runs"].items(), ("auto, short", res["auto_short"]), ("auto, long", res["auto_long"])]:
        # the proof passed in ComfyUI's process: every call split over the devices (short: none did)
        assert run["equal"] and run["proof"]["failure"] is None, f"devices={devices}: {run}"
    assert res["runs"]["2"]["bounds"] == [0, 4, 8]
    assert res["runs"]["4"]["bounds"] == [0, 1, 4, 6, 8]  # shares 1,2,1,1: largest remainder, ties to later
    engines = res["status_attention"]["engines"]
    assert engines and engines[-1]["helpers"] and engines[-1]["recent_calls"][-1]["ranks"][0]["device"] == "cpu"
    assert "does not split masked attention" in res["mask_error"]
    assert "grouped-query" in res["gqa_error"]
    assert "needs a MiniMax H3 model" in res["non_h3_error"]
    assert "keep one of the two" in res["ms_after_ap_error"]
    assert "keep one of the two" in res["ap_after_ms_error"]
    assert res["disabled_is_identity"]
    assert "devices=4: found 2 suitable device(s)" in res["too_many_error"]
    assert "the helpers must be the same kind of device as the model's (cpu)" in res["kind_error"]
    assert res["inputs"] == {"required": ["model", "devices", "min_sequence_length"], "optional": ["gpus"],
                             "devices": ["disabled", "auto", "2", "3", "4", "5", "6", "7", "8"],
                             "devices_default": "disabled", "min_seq": {"default": 32768, "min": 1, "advanced": True},
                             "returns": ["MODEL"], "display": "H3 Attention Parallel"}
    assert "add --use-ck-attention to ComfyUI's command line" in res["no_flag_error"]
    assert res["children_left"] == 0 and res["shm_left"] == []

