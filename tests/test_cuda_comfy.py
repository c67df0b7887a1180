"""The split inside real ComfyUI on CUDA, started as ``main.py`` starts: every output ``torch.equal`` to plain ComfyUI,
including the first call after the workers start, with no warm-up anywhere in the test, and every model call proven
split on the case's ranks (``tests/split_proof.py``).

``import main`` runs ComfyUI's own start-up code (up to its ``__main__`` guards): comfy-aimdo is initialised and the
patcher class becomes ``ModelPatcherDynamic`` (DynamicVRAM, ComfyUI's default on NVIDIA) unless
``--disable-dynamic-vram`` (or ``--novram``, which also leaves every layer offloaded, so the classic patcher applies a
LoRA in ``comfy.ops``' cast); the test asserts which patcher ComfyUI really used. One ComfyUI process per flag set
(flags are process-wide); inside it each case patches the model with ``H3MS_RANK_MAP`` set to its logical ranks on
``cuda:0`` (a new rank map starts new workers, so every case's first split call is a fresh worker's first step).
Tiny width, 2 blocks, >= 8000 packed tokens; bf16 weights compute in bf16 on the H200, int8 in bf16 too.

On the GPU machine: ``source benchmarks/device_setup.sh && bash benchmarks/device_comfy.sh`` (JSON + logs to
``$OUT``), or ``python -m pytest -q -m cuda tests/test_cuda_comfy.py`` after the set-up.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import comfy_tree  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(comfy_tree.skip_reason() is not None, reason=str(comfy_tree.skip_reason()))]

_BODY = r'''
import json, os, sys, torch
sys.path.insert(0, {tests!r})
import main  # noqa: F401  (ComfyUI's start-up: comfy-aimdo and the ModelPatcherDynamic swap)
import comfy_h3, nodes, comfy.sd, comfy.model_patcher
from split_proof import SplitProof
comfy_h3.start()
N = nodes.NODE_CLASS_MAPPINGS
from h3ms_async.dit import split as S
from h3ms_async.status.hub import get_hub
KW = dict(width=1280, height=768, length=56, steps=2)  # 8,7xx packed tokens
for cid, ranks, shares, int8, lora in {cases!r}:
    name = f"h3cuda-{{os.getpid()}}-{{cid}}.safetensors"
    path = os.path.join(comfy_h3.checkpoint_dir(), name)
    comfy_h3.write_checkpoint(path, layers=2, int8=int8, dtype=torch.bfloat16, scale_2d=int8 and lora)
    try:
        model = comfy_h3.load(name)
        if lora:
            with torch.inference_mode():
                model = comfy.sd.load_lora_for_models(model, None, comfy_h3.lora_state_dict(2, rank=16), 0.8, 0)[0]
        os.environ["H3MS_RANK_MAP"] = ranks
        gpus = N["H3MSGPUSetAsync"]().build("auto", "", shares, 0.0, 8)[0] if shares else None
        split = N["H3MultiStreamAsync"]().patch(model, True, -1, "host", 8, True, 0.0, "auto", gpus, {verify!r})[0]
        n_verify = len(get_hub().exactness()["verify"])
        proofs = [SplitProof(ranks.split(",")), SplitProof(ranks.split(","))]  # every call split on these ranks
        with proofs[0]:
            first = comfy_h3.ksample(split, **KW)   # the first calls after this rank map's workers start
        rec = get_hub().recent_steps(1)[-1]
        verified = get_hub().exactness()["verify"][n_verify:]
        plain = comfy_h3.ksample(model, **KW)
        with proofs[1]:
            second = comfy_h3.ksample(split, **KW)
        r = dict(case=cid, ranks=ranks, shares=shares, int8=int8, lora=lora, patcher=type(model).__name__,
                 core_patcher=comfy.model_patcher.CoreModelPatcher.__name__,
                 compute_dtype=str(model.model.get_dtype() if model.model.manual_cast_dtype is None
                                   else model.model.manual_cast_dtype),
                 tokens=rec["tokens"], proofs=[p.summary() for p in proofs], first=comfy_h3.same(plain, first),
                 second=comfy_h3.same(plain, second), verify=verified)
        print("CASE " + json.dumps(r), flush=True)
    finally:
        os.unlink(path)
S.release_all_engines()
'''

GROUPS = [
    # (id, ComfyUI flags, [(case id, rank map, shares, int8, lora)], the patcher ComfyUI must use)
    # A LoRA under DynamicVRAM is applied inside comfy.ops' cast (re-quantized for int8): the split takes those weights
    # from that cast; reading them any other way once wrote into comfy-aimdo's read-only mapping (a segfault).
    ("sdpa-dynamic", [], [("bf16-lora-2ranks", "cuda:0,cuda:0", "", False, True),
                          ("int8-lora-2ranks", "cuda:0,cuda:0", "", True, True),
                          ("int8-3ranks-121", "cuda:0,cuda:0,cuda:0", "1,2,1", True, False)], "ModelPatcherDynamic"),
    # --novram: the classic patcher leaves every layer offloaded and applies the LoRA in the cast (LowVramPatch).
    ("sdpa-novram", ["--novram"], [("bf16-lora-2ranks", "cuda:0,cuda:0", "", False, True),
                                   ("int8-lora-2ranks", "cuda:0,cuda:0", "", True, True)], "ModelPatcher"),
    ("sdpa-nodynamic", ["--disable-dynamic-vram"], [("bf16-lora-2ranks", "cuda:0,cuda:0", "", False, True)],
     "ModelPatcher"),
    ("ck-dynamic", ["--use-ck-attention"], [("int8-2ranks", "cuda:0,cuda:0", "", True, False),
                                            ("bf16-3ranks-121", "cuda:0,cuda:0,cuda:0", "1,2,1", False, False)],
     "ModelPatcherDynamic"),
]


@pytest.mark.parametrize("group", GROUPS, ids=[g[0] for g in GROUPS])
def test_split_equals_comfyui_on_cuda(group):
    gid, flags, cases, patcher = group
    verify = patcher == "ModelPatcherDynamic"  # the opt-in verify, checked where DynamicVRAM is on
    body = _BODY.format(tests=os.path.dirname(os.path.abspath(__file__)), cases=cases, verify=verify)
    with tempfile.TemporaryDirectory() as web_root:  # ComfyUI's frontend package is not on the GPU machine
        r = comfy_tree.run_comfy_script(body, ["--disable-api-nodes", "--front-end-root", web_root, *flags],
                                        timeout_s=300)
    out = [json.loads(x[5:]) for x in r.stdout.splitlines() if x.startswith("CASE ")]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"cuda_comfy-{gid}.json"), "w") as fh:
            json.dump({"group": gid, "flags": flags, "results": out, "rc": r.returncode}, fh, indent=1)
        with open(os.path.join(os.environ["OUT"], f"cuda_comfy-{gid}.log"), "w") as fh:
            fh.write(r.stdout + "\n" + r.stderr)
    assert r.returncode == 0 and len(out) == len(cases), r.stderr[-4000:]
    for case in out:
        assert case["patcher"] == patcher and case["core_patcher"] == patcher, case  # DynamicVRAM really on/off
        assert case["tokens"] >= 8000, case
        assert case["int8"] or case["compute_dtype"] == "torch.bfloat16", case  # bf16 weights compute in bf16
        assert all(p["failure"] is None for p in case["proofs"]), case  # tests/split_proof.py, in ComfyUI's process
        assert case["first"][0] and case["second"][0], case
        if verify:  # one result per prompt's first split step, each bit-exact on the ranks' GPUs
            assert case["verify"], case
            assert all(v["bit_exact"] and v["first_difference"] is None for v in case["verify"]), case


_LORA_BODY = r'''
import json, os, sys, torch
sys.path.insert(0, {tests!r})
import main  # noqa: F401  (ComfyUI's start-up: comfy-aimdo and the ModelPatcherDynamic swap)
import comfy_h3, nodes, comfy.sd
from split_proof import SplitProof
comfy_h3.start()
N = nodes.NODE_CLASS_MAPPINGS
from h3ms_async.dit import split as S
KW = dict(width=1280, height=768, length=56, steps=2)
RANKS = "cuda:0,cuda:0"
os.environ["H3MS_RANK_MAP"] = RANKS
lora = comfy_h3.lora_state_dict(2, rank=16)
modules = {{k.removeprefix("diffusion_model.").split(".lora_")[0] for k in lora}}
for kind, int8 in (("bf16", False), ("int8", True)):
    name = f"h3cuda-{{os.getpid()}}-lora-{{kind}}.safetensors"
    path = os.path.join(comfy_h3.checkpoint_dir(), name)
    comfy_h3.write_checkpoint(path, layers=2, int8=int8, dtype=torch.bfloat16, scale_2d=int8)
    try:
        base = comfy_h3.load(name)
        first = None
        for strength in (0.8, 0.3, None):
            before = S.engines()[0].loaded.store.segment.name if first is not None else None
            model = base
            if strength is not None:
                with torch.inference_mode():
                    model = comfy.sd.load_lora_for_models(base, None, lora, strength, 0)[0]
            split = N["H3MultiStreamAsync"]().patch(model, True, -1, "host", 8, True, 0.0, "resident", None, False)[0]
            proof = SplitProof(RANKS.split(","))
            with proof:
                out = comfy_h3.ksample(split, **KW)
            plain = comfy_h3.ksample(model, **KW)
            eng = S.engines()[0]
            st, ld = eng.loaded.store, eng.last_load
            if first is None:
                first = (st.segment.name, sorted(w["pid"] for w in eng.pool.snapshot()))
            r = ld.refill
            r = dict(case=f"{{kind}} lora {{strength}}", patcher=type(model).__name__, proof=proof.summary(),
                     same=comfy_h3.same(plain, out), same_store=st.segment.name == (before or first[0]),
                     same_pids=sorted(w["pid"] for w in eng.pool.snapshot()) == first[1],
                     full_because=ld.full_because, line=ld.line(),
                     refill=None if r is None else dict(bytes=r.store.bytes, tensors=r.store.tensors,
                                                        ranks_bytes=r.ranks_bytes),
                     want_bytes=sum(t.numel() * t.element_size() for i in range(len(st.manifest))
                                    for n, t in st.block(i).items()
                                    if f"blocks.{{i}}.{{n.rsplit('.', 1)[0]}}" in modules))
            print("CASE " + json.dumps(r), flush=True)
    finally:
        S.release_all_engines()
        os.unlink(path)
'''


def test_lora_strength_change_refreshes_resident_blocks():
    """Under DynamicVRAM (the LoRA applied in ``comfy.ops``' cast) on ranks cuda:0,cuda:0 with every block resident in
    VRAM: a LoRA at 0.8, then 0.3, then none. The later prompts rewrite only the patched tensors in place (the bytes
    counted equal those tensors' bytes in the store; same segment, same workers) and each rank copies them into its
    resident blocks again; every output equals plain ComfyUI at that strength, every call proven split. An int8
    change whose cast result changes the blocks' layout is filled anew instead, saying why."""
    body = _LORA_BODY.format(tests=os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as web_root:
        r = comfy_tree.run_comfy_script(body, ["--disable-api-nodes", "--front-end-root", web_root], timeout_s=400)
    out = {c["case"]: c for c in (json.loads(x[5:]) for x in r.stdout.splitlines() if x.startswith("CASE "))}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cuda_comfy-lora-refresh.json"), "w") as fh:
            json.dump({"results": out, "rc": r.returncode}, fh, indent=1)
    assert r.returncode == 0 and len(out) == 6, r.stderr[-4000:]
    for case in out.values():
        assert case["patcher"] == "ModelPatcherDynamic" and case["proof"]["failure"] is None, case
        assert case["same"][0], case
        if case["case"].endswith("0.8"):
            continue
        assert case["same_pids"], case
        if case["refill"] is None:
            assert case["case"].startswith("int8") and "layout" in case["full_because"], case
            continue
        assert case["same_store"] and case["refill"]["bytes"] == case["want_bytes"] > 0, case
        assert case["refill"]["ranks_bytes"] > 0, case  # the resident blocks' copies
    assert out["bf16 lora 0.3"]["refill"] is not None and out["bf16 lora None"]["refill"] is not None
