"""The split inside the real ComfyUI tree (``tests/comfy_tree.py``), on CPU ranks: every output ``torch.equal`` to
plain ComfyUI.

Each test is one fresh ComfyUI process (its flags and attention choice are process-wide) that loads the pack with
ComfyUI's own custom-node loader, writes a tiny H3 ``.safetensors`` (``tests/comfy_h3.py``) and samples it with
``nodes.common_ksampler`` / ``execution.PromptExecutor``, plain and through the node, and prints one JSON line per
case. Ranks come from ``H3MS_RANK_MAP``; shares from the H3 MS GPU Set node.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import comfy_tree  # noqa: E402

pytestmark = pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))

_PRELUDE = r'''
import asyncio, glob, json, os, sys, torch
sys.path.insert(0, {tests!r})
import comfy_h3, nodes, comfy.sd
asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
N = nodes.NODE_CLASS_MAPPINGS
assert "H3MultiStreamAsync" in N, "ComfyUI's loader did not load the pack"
from h3ms_async import split as S
CKPT = comfy_h3.checkpoint_dir()

def report(case, a, b, **extra):
    eq, diff = comfy_h3.same(a, b)
    print("CASE " + json.dumps(dict(case=case, equal=eq, max_diff=diff, **extra)), flush=True)

def node(model, ranks, shares="", exchange="host", chunks=0, residency="auto", cache=True):
    os.environ["H3MS_RANK_MAP"] = ",".join(["cpu"] * ranks)
    gpus = N["H3MSGPUSetAsync"]().build("auto", "", shares, 0.0, 8)[0] if shares else None
    return N["H3MultiStreamAsync"]().patch(model, True, -1, exchange, chunks, cache, 0.0, residency, gpus)[0]

def write(tag, **kw):
    name = f"h3tiny-{{os.getpid()}}-{{tag}}.safetensors"
    comfy_h3.write_checkpoint(os.path.join(CKPT, name), **kw)
    return name

def pids():
    return sorted(w["pid"] for e in S.engines() for w in e.pool.snapshot())

def store():
    return [e._loaded.store.segment.name if e._loaded else None for e in S.engines()]

names = []
try:
'''

_EPILOGUE = r'''
finally:
    S.release_all_engines()
    for n in names:
        os.unlink(os.path.join(CKPT, n))
    print("LEFT " + json.dumps(sorted(glob.glob(f"/dev/shm/h3ms-{os.getpid()}-*"))), flush=True)
'''


def _run(cases: str, comfy_args: list[str]) -> list[dict]:
    body = _PRELUDE.format(tests=os.path.dirname(__file__)) + cases + _EPILOGUE
    r = comfy_tree.run_comfy_script(body, ["--cpu", "--disable-api-nodes", *comfy_args], timeout_s=400)
    lines = r.stdout.splitlines()
    out = [json.loads(line[5:]) for line in lines if line.startswith("CASE ")]
    left = [json.loads(line[5:]) for line in lines if line.startswith("LEFT ")]
    assert r.returncode == 0, f"ComfyUI run failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert left == [[]], f"shm segments left behind: {left}"
    for case in out:
        assert case["equal"], f"{case} differs from plain ComfyUI\n{r.stderr[-4000:]}"
    return out


def test_default_cpu_attention_fp32_bf16_int8_lora_release():
    """ComfyUI's default CPU attention (sub-quadratic), which the ranks import and run themselves."""
    cases = r'''
    names.append(write("fp32", layers=3))
    names.append(write("bf16", layers=3, dtype=torch.bfloat16))
    names.append(write("int8", layers=3, int8=True))
    import comfy.ldm.modules.attention as A
    assert A.optimized_attention.__name__ == "attention_sub_quad", A.optimized_attention.__name__
    fp32 = comfy_h3.load(names[0])
    plain = comfy_h3.ksample(fp32)
    report("fp32 2 ranks", plain, comfy_h3.ksample(node(fp32, 2)))
    first_pids, first_store = pids(), store()
    # per-step settings switched between two prompts: same processes, same filled store
    report("fp32 2 ranks chunks 4 stream", plain, comfy_h3.ksample(node(fp32, 2, chunks=4, residency="stream")))
    report("fp32 2 ranks gloo", plain, comfy_h3.ksample(node(fp32, 2, exchange="nccl", chunks=2)),
           same_pids=pids() == first_pids, same_store=store() == first_store)
    # bf16 weights, fp32 compute (what CPU ComfyUI does): weights cast per layer on the ranks
    bf16 = comfy.sd.load_diffusion_model(os.path.join(CKPT, names[1]), model_options={"dtype": torch.bfloat16})
    assert bf16.model.manual_cast_dtype == torch.float32
    report("bf16->fp32 3 ranks shares 1,2,1", comfy_h3.ksample(bf16), comfy_h3.ksample(node(bf16, 3, "1,2,1")))
    int8 = comfy_h3.load(names[2])
    report("int8 2 ranks", comfy_h3.ksample(int8), comfy_h3.ksample(node(int8, 2)))
    # LoRA before the node, and after it (a LoRA clone of the split model)
    lora = comfy_h3.lora_state_dict(3)
    with torch.inference_mode():
        before = comfy.sd.load_lora_for_models(fp32, None, lora, 0.8, 0)[0]
    report("lora before node", comfy_h3.ksample(before), comfy_h3.ksample(node(before, 2)))
    with torch.inference_mode():
        after = comfy.sd.load_lora_for_models(node(fp32, 2), None, lora, 0.8, 0)[0]
    report("lora after node", comfy_h3.ksample(before), comfy_h3.ksample(after))
    # a whole-model attention override: the model runs unsplit (with one warning), as plain ComfyUI with it
    over = fp32.clone(); over.set_model_optimized_attention(A.attention_basic)
    over_split = node(fp32, 2).clone(); over_split.set_model_optimized_attention(A.attention_basic)
    report("attention override unsplit", comfy_h3.ksample(over), comfy_h3.ksample(over_split))
    # the release node stops the workers and drops the store
    N["H3MSReleaseResourcesAsync"]().run(True, True, False)
    report("after release", [], [], engines=len(S.engines()), pids_gone=all(
        not os.path.exists(f"/proc/{p}") for p in first_pids))
'''
    out = {c["case"]: c for c in _run(cases, [])}
    assert len(out) == 9
    assert out["fp32 2 ranks gloo"]["same_pids"] and out["fp32 2 ranks gloo"]["same_store"]
    assert out["after release"]["engines"] == 0 and out["after release"]["pids_gone"]


def test_pytorch_attention_three_ranks():
    """``--use-pytorch-cross-attention``: bf16->fp32 / int8, 2 and 3 ranks with shares."""
    cases = r'''
    names.append(write("fp32", layers=3))
    names.append(write("int8", layers=4, int8=True))
    import comfy.ldm.modules.attention as A
    assert A.optimized_attention.__name__ == "attention_pytorch", A.optimized_attention.__name__
    int8 = comfy_h3.load(names[1])
    plain8 = comfy_h3.ksample(int8)
    report("int8 3 ranks shares 1,2,1", plain8, comfy_h3.ksample(node(int8, 3, "1,2,1")))
    report("int8 2 ranks", plain8, comfy_h3.ksample(node(int8, 2)))
    bf16 = comfy.sd.load_diffusion_model(os.path.join(CKPT, names[0]), model_options={"dtype": torch.bfloat16})
    report("bf16->fp32 2 ranks", comfy_h3.ksample(bf16), comfy_h3.ksample(node(bf16, 2)))
'''
    out = _run(cases, ["--use-pytorch-cross-attention"])
    assert len(out) == 3
