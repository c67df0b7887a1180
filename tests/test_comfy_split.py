"""The split inside the real ComfyUI tree (``tests/comfy_tree.py``), on CPU ranks: every output ``torch.equal`` to
plain ComfyUI.

Two ComfyUI processes (flags and the attention choice are process-wide): ``--cpu`` (ComfyUI's default CPU attention,
sub-quadratic) and ``--cpu --use-pytorch-cross-attention`` (SDPA). Each starts a real ``PromptServer``, loads the pack
with ComfyUI's own custom-node loader (``comfy_h3.start``), writes tiny 2-block H3 ``.safetensors`` files
(``tests/comfy_h3.py``) and samples them plain and through the node, with ``nodes.common_ksampler`` and, once, an
``execution.PromptExecutor`` graph from ``UNETLoader``, on 64x64x22 latents (~110 tokens: every rank's share is at
least 16 rows; the fp32 GEMMs of an x86 CPU can give an 8-row shard other bits than the whole, and the engine then
runs the step unsplit). Ranks come from ``H3MS_RANK_MAP``; shares from the H3 MS GPU Set node. Every split sampling
runs under ``tests/split_proof.py``'s proof: each of its model calls has a step record in which every expected rank
computed a non-empty part of the tokens and heads (a refused plan runs ComfyUI's own blocks and fails the case unless
the case expects it).

Weights: fp32; bf16 computed in fp32 (what CPU ComfyUI does: ``model_management.should_use_bf16`` is False for every
CPU device whatever the flags, so ``--bf16-unet`` / ``--force-fp16`` still give fp32 compute on CPU; bf16 compute
runs in ``tests/test_cuda_comfy.py`` and in the engine's own tests); int8.
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
import glob, json, os, sys, torch
sys.path.insert(0, {tests!r})
import comfy_h3, nodes, comfy.sd
from split_proof import SplitProof
import comfy.ldm.modules.attention as A
SERVER = comfy_h3.start(extras=("nodes_minimax_h3.py", "nodes_lotus.py"))
N = nodes.NODE_CLASS_MAPPINGS
from h3ms_async.dit import split as S
CKPT = comfy_h3.checkpoint_dir()

def proven(ranks, run, unsplit=False):
    """``run()`` under the split's proof (tests/split_proof.py): every model call it makes ran split on ``ranks``
    CPU ranks (``unsplit``: none did); (its output, the proof's summary)."""
    with SplitProof(["cpu"] * ranks, unsplit=unsplit) as proof:
        out = run()
    return out, proof.summary()

def report(case, plain, split, **extra):
    """One parity case: ``plain`` ComfyUI's output against ``split``, a :func:`proven` run."""
    out, proof = split
    eq, diff = comfy_h3.same(plain, out)
    print("CASE " + json.dumps(dict(case=case, equal=eq, max_diff=diff, proof=proof, **extra)), flush=True)

def note(case, **facts):
    print("CASE " + json.dumps(dict(case=case, **facts)), flush=True)

def node(model, ranks, shares="", exchange="host", chunks=0, residency="auto", cache=True, pattern="gather",
         verify=False):
    os.environ["H3MS_RANK_MAP"] = ",".join(["cpu"] * ranks)
    gpus = N["H3MSGPUSetAsync"]().build("auto", "", shares, 0.0, 8)[0] if shares else None
    return N["H3MultiStreamAsync"]().patch(model, True, -1, exchange, chunks, cache, 0.0, residency, gpus, verify,
                                           exchange_pattern=pattern)[0]

def write(tag, **kw):
    name = f"h3tiny-{{os.getpid()}}-{{tag}}.safetensors"
    names.append(name)
    comfy_h3.write_checkpoint(os.path.join(CKPT, name), layers=2, **kw)
    return name

def pids():
    return sorted(w["pid"] for e in S.engines() for w in e.pool.snapshot())

def store():
    return [e.loaded.store.segment.name if e.loaded else None for e in S.engines()]

LENGTH = 22  # the latent's frames (see the module doc)

def ksample(model):
    return comfy_h3.ksample(model, steps=1, length=LENGTH)

def split_ksample(model, ranks, unsplit=False):
    return proven(ranks, lambda: ksample(model), unsplit)

names = []
try:
'''

_EPILOGUE = r'''
finally:
    S.release_all_engines()
    for n in names:
        os.unlink(os.path.join(CKPT, n))
    from workers.runtime.shm import held_shm
    print("LEFT " + json.dumps(sorted(held_shm(os.getpid()))), flush=True)
'''


def _run(cases: str, comfy_args: list[str]) -> dict[str, dict]:
    body = _PRELUDE.format(tests=os.path.dirname(__file__)) + cases + _EPILOGUE
    r = comfy_tree.run_comfy_script(body, ["--cpu", "--disable-api-nodes", *comfy_args], timeout_s=400)
    lines = r.stdout.splitlines()
    out = [json.loads(line[5:]) for line in lines if line.startswith("CASE ")]
    left = [json.loads(line[5:]) for line in lines if line.startswith("LEFT ")]
    assert r.returncode == 0, f"ComfyUI run failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert left == [[]], f"shm segments left behind: {left}"
    for case in (c for c in out if "equal" in c):  # a parity case: the proof passed in ComfyUI's process
        assert case["equal"] and case["proof"]["failure"] is None, \
            f"{case} differs from plain ComfyUI\n{r.stderr[-4000:]}"
    return {c["case"]: c for c in out}


def test_default_cpu_attention():
    """ComfyUI's default CPU attention (sub-quadratic), which the ranks import and run themselves: a PromptExecutor
    graph from UNETLoader; fp32 / bf16->fp32 / int8; LoRA before and after the node; the settings switch keeping
    pids and store; 3 ranks with shares after 2 (new workers, the filled store kept); a whole-model attention
    override (unsplit); the release node."""
    cases = r'''
    assert A.optimized_attention.__name__ == "attention_sub_quad", A.optimized_attention.__name__
    import execution
    graph_ckpt = write("lotus", text_dim=comfy_h3.LOTUS_TEXT_DIM)
    def graph(split):
        model = ["ms", 0] if split else ["unet", 0]
        g = {"unet": {"class_type": "UNETLoader", "inputs": {"unet_name": graph_ckpt, "weight_dtype": "default"}},
             "pos": {"class_type": "LotusConditioning", "inputs": {}},
             "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
             "lat": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": LENGTH}},
             "ks": {"class_type": "KSampler", "inputs": {"model": model, "seed": 5, "steps": 2, "cfg": 2.0,
                    "sampler_name": "euler", "scheduler": "simple", "positive": ["pos", 0],
                    "negative": ["neg", 0], "latent_image": ["lat", 0], "denoise": 1.0}}}
        if split:
            g["ms"] = {"class_type": "H3MultiStreamAsync", "inputs": {"model": ["unet", 0], "enabled": True,
                       "second_gpu": -1, "exchange": "host", "exchange_chunks": 0, "weight_cache": True,
                       "cache_ram_reserve_gb": 0.0, "vram_residency": "auto"}}
        return g
    os.environ["H3MS_RANK_MAP"] = "cpu,cpu"
    executor = execution.PromptExecutor(SERVER, cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    def sampled(split):
        executor.execute(graph(split), f"prompt-{split}", {}, ["ks"])
        assert executor.success, executor.status_messages[-3:]
        entry = SERVER.loop.run_until_complete(executor.caches.outputs.get("ks"))
        return [t.clone() for t in entry.outputs[0][0]["samples"].unbind()]
    report("PromptExecutor graph UNETLoader -> node -> KSampler, 2 ranks", sampled(False),
           proven(2, lambda: sampled(True)), engines=len(S.engines()))
    fp32 = comfy_h3.load(write("fp32"))
    plain = ksample(fp32)
    split = node(fp32, 2)
    first_pids = pids()
    report("fp32 2 ranks", plain, split_ksample(split, 2))
    first_store = store()
    # per-step settings switched between two prompts: same processes, same filled store
    report("fp32 2 ranks chunks 4 stream", plain, split_ksample(node(fp32, 2, chunks=4, residency="stream"), 2))
    report("fp32 2 ranks gloo", plain, split_ksample(node(fp32, 2, exchange="nccl", chunks=2), 2),
           same_pids=pids() == first_pids, same_store=store() == first_store)
    bf16 = comfy_h3.load(write("bf16", dtype=torch.bfloat16), dtype=torch.bfloat16)
    assert bf16.model.manual_cast_dtype == torch.float32  # bf16 weights, fp32 compute: cast per layer on the ranks
    plain_bf16 = ksample(bf16)
    report("bf16->fp32 2 ranks", plain_bf16, split_ksample(node(bf16, 2), 2))
    # another GPU set and shares: new workers, the filled store kept (no fill)
    bf16_store = store()
    report("bf16->fp32 3 ranks shares 1,2,1", plain_bf16, split_ksample(node(bf16, 3, "1,2,1"), 3),
           shares=S.engines()[0].options.shares, kept=store() == bf16_store,
           filled=S.engines()[0].last_load.fill_bytes, kept_bytes=S.engines()[0].last_load.kept_bytes)
    int8 = comfy_h3.load(write("int8", int8=True))
    report("int8 2 ranks", ksample(int8), split_ksample(node(int8, 2), 2))
    lora = comfy_h3.lora_state_dict(2)
    with torch.inference_mode():
        before = comfy.sd.load_lora_for_models(fp32, None, lora, 0.8, 0)[0]
    plain_lora = ksample(before)
    report("lora before node", plain_lora, split_ksample(node(before, 2), 2))
    with torch.inference_mode():
        after = comfy.sd.load_lora_for_models(node(fp32, 2), None, lora, 0.8, 0)[0]
    report("lora after node", plain_lora, split_ksample(after, 2))
    # a whole-model attention override: the model runs unsplit (with one warning), as plain ComfyUI with it
    over = fp32.clone(); over.set_model_optimized_attention(A.attention_basic)
    over_split = node(fp32, 2).clone(); over_split.set_model_optimized_attention(A.attention_basic)
    report("attention override unsplit", ksample(over), split_ksample(over_split, 2, unsplit=True))
    last = pids()
    N["H3MSReleaseResourcesAsync"]().run(True, True, False)
    note("after release", engines=len(S.engines()), pids_gone=all(not os.path.exists(f"/proc/{p}") for p in last))
'''
    out = _run(cases, [])
    assert len(out) == 11, list(out)
    assert out["PromptExecutor graph UNETLoader -> node -> KSampler, 2 ranks"]["engines"] == 1
    assert out["fp32 2 ranks gloo"]["same_pids"] and out["fp32 2 ranks gloo"]["same_store"]
    three = out["bf16->fp32 3 ranks shares 1,2,1"]
    assert three["shares"] == [1.0, 2.0, 1.0]
    assert three["kept"] and three["filled"] == 0 and three["kept_bytes"] > 0, three
    assert out["after release"]["engines"] == 0 and out["after release"]["pids_gone"]


def test_pytorch_attention():
    """``--use-pytorch-cross-attention`` (SDPA): fp32 / bf16->fp32 / int8 on 2 ranks, int8 on 3 ranks with shares;
    the Ulysses pattern (the node's exchange_pattern) on 2 ranks and on 3 with shares."""
    cases = r'''
    assert A.optimized_attention.__name__ == "attention_pytorch", A.optimized_attention.__name__
    fp32 = comfy_h3.load(write("fp32"))
    report("fp32 2 ranks", ksample(fp32), split_ksample(node(fp32, 2), 2))
    bf16 = comfy_h3.load(write("bf16", dtype=torch.bfloat16), dtype=torch.bfloat16)
    report("bf16->fp32 2 ranks", ksample(bf16), split_ksample(node(bf16, 2), 2))
    int8 = comfy_h3.load(write("int8", int8=True))
    plain8 = ksample(int8)
    report("int8 2 ranks", plain8, split_ksample(node(int8, 2), 2))
    report("int8 3 ranks shares 1,2,1", plain8, split_ksample(node(int8, 3, "1,2,1"), 3))
    report("int8 2 ranks ulysses", plain8, split_ksample(node(int8, 2, pattern="ulysses"), 2),
           pattern=S.engines()[0].loaded.pattern)
    report("bf16->fp32 3 ranks ulysses shares 1,2,1", ksample(bf16),
           split_ksample(node(bf16, 3, "1,2,1", pattern="ulysses"), 3))
'''
    out = _run(cases, ["--use-pytorch-cross-attention"])
    assert len(out) == 6 and out["int8 2 ranks ulysses"]["pattern"] == "ulysses"


def test_modulation_rows_are_comfyuis_own():
    """The ranks get every block's adaLN rows from ComfyUI's own ``adaln_proj`` modules (``nodes/modulation.py``),
    not from weights of their own: the split equals plain ComfyUI (fp32, int8, a LoRA on the adaLN linears, which
    the rows must carry since the store holds no adaLN weights); with the rows of block 1 moved one unit in the last
    place on the ranks (``H3MS_TEST_MODULATION_FAULT``, a test hook), the sample differs from plain ComfyUI and
    ``verify`` names block 1."""
    cases = r'''
    from h3ms_async.status.hub import get_hub
    fp32 = comfy_h3.load(write("fp32"))
    plain32 = ksample(fp32)
    import time
    pools_at_rows = []  # the pools' states while the first split call reads block 0's adaLN weights
    def at_rows(module, args):
        """A read that takes as long as a cold disk's: the workers must be starting meanwhile (without the early
        start nothing starts them until the read ends, and the pool stays stopped)."""
        if pools_at_rows or not S.engines():
            return
        t = time.monotonic()
        while time.monotonic() - t < 10 and all(e.pool.state.value == "stopped" for e in S.engines()):
            time.sleep(0.01)
        pools_at_rows.extend(e.pool.state.value for e in S.engines())
    fill_at_rows = []  # (block, blocks the store had filled) as a filling step computes each block's adaLN row

    def fill_at(i):
        def hook(module, args):
            ld = S.engines()[0].loaded if S.engines() else None
            if ld is not None and ld.store.filled_at is None:
                fill_at_rows.append((i, ld.store.fill_progress().read()))
        return hook
    blocks = fp32.get_model_object("diffusion_model").blocks
    hooks = [blocks[0].adaln_proj.linear.register_forward_pre_hook(at_rows)]
    hooks += [b.adaln_proj.linear.register_forward_pre_hook(fill_at(i)) for i, b in enumerate(blocks)]
    report("fp32 2 ranks", plain32, split_ksample(node(fp32, 2), 2), blocks=len(blocks),
           store_keys=sorted({k for b in S.engines()[0].loaded.store.manifest for k in b}), pools_at_rows=pools_at_rows,
           fill_at_rows=fill_at_rows)
    for h in hooks:
        h.remove()
    int8 = comfy_h3.load(write("int8", int8=True))
    plain8 = ksample(int8)
    report("int8 2 ranks", plain8, split_ksample(node(int8, 2), 2))
    adaln_lora = {}
    g = torch.Generator().manual_seed(11)
    for i in range(2):
        w = int8.get_model_object("diffusion_model").blocks[i].adaln_proj.linear.weight
        base = f"diffusion_model.blocks.{i}.adaln_proj.linear"
        adaln_lora[f"{base}.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.1
        adaln_lora[f"{base}.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.1
    with torch.inference_mode():
        lora8 = comfy.sd.load_lora_for_models(int8, None, adaln_lora, 0.8, 0)[0]
    plain_lora = ksample(lora8)
    eq_lora, _ = comfy_h3.same(plain8, plain_lora)
    report("adaLN LoRA 2 ranks", plain_lora, split_ksample(node(lora8, 2), 2), lora_changes_output=not eq_lora)
    S.release_all_engines()  # the next workers start with the fault
    os.environ["H3MS_TEST_MODULATION_FAULT"] = "1"
    n0 = len(get_hub().exactness()["verify"])
    out, proof = split_ksample(node(int8, 2, verify=True), 2)
    eq, diff = comfy_h3.same(plain8, out)
    verified = [dict(bit_exact=v["bit_exact"], first=v["first_difference"])
                for v in get_hub().exactness()["verify"][n0:]]
    note("block 1 rows one ulp off", same_as_plain=eq, max_diff=diff, proof_failure=proof["failure"], verify=verified)
    del os.environ["H3MS_TEST_MODULATION_FAULT"]
'''
    out = _run(cases, ["--use-pytorch-cross-attention"])
    assert not any(k.startswith("adaln_proj.") for k in out["fp32 2 ranks"]["store_keys"])
    # fresh workers start beside ComfyUI's read of the adaLN weights, not after it
    assert out["fp32 2 ranks"]["pools_at_rows"] in (["starting"], ["running"]), out["fp32 2 ranks"]
    # the fill computes block i's row as it reads block i, in order, while the store fills: one pass over the
    # checkpoint (blocks 0..i-2 in the store, block i-1 in it or being copied beside this read)
    n, rows = out["fp32 2 ranks"]["blocks"], out["fp32 2 ranks"]["fill_at_rows"]
    assert n > 1 and [i for i, _ in rows] == list(range(1, n)), out["fp32 2 ranks"]
    assert all(i - 1 <= filled <= i for i, filled in rows), out["fp32 2 ranks"]
    assert out["adaLN LoRA 2 ranks"]["lora_changes_output"]
    faulty = out["block 1 rows one ulp off"]
    assert faulty["proof_failure"] is None, faulty  # it ran split
    assert not faulty["same_as_plain"], faulty  # parity catches rows one ulp off ComfyUI's
    assert faulty["verify"] and not faulty["verify"][0]["bit_exact"], faulty
    assert faulty["verify"][0]["first"].startswith("block 1 "), faulty


def test_lora_strength_change_rewrites_only_the_patched_tensors():
    """A LoRA on every block's qkv and fc1 at strength 0.8, then 0.3, then no LoRA, on 2 CPU ranks (each holding its
    head group's qkv rows as a copy): the first prompt fills the store; each later one rewrites in place exactly the
    tensors of the patched modules (the bytes counted equal those tensors' bytes in the store), keeping the store
    segment and the workers, and the ranks take the new qkv rows in again; every output equals plain ComfyUI at that
    strength. The same for an int8 checkpoint, where the case records whether the change kept the blocks' layout
    (in place) or changed it (a full fill, with the reason). A rewrite reads nothing of the checkpoint ahead (the
    patched modules are read by ComfyUI's cast; at 50 full-width blocks the whole-block readahead made the strength
    change read 24 GB it did not use), where the full fill does."""
    cases = r'''
    lora = comfy_h3.lora_state_dict(2)
    from h3ms_async.runtime.readahead import BlockReadahead
    made = []  # every readahead a load made, its file's name
    _of = BlockReadahead.of.__func__
    BlockReadahead.of = classmethod(lambda cls, path, wanted: made.append(os.path.basename(path)) or _of(cls, path, wanted))
    modules = {k.removeprefix("diffusion_model.").split(".lora_")[0] for k in lora}  # "blocks.<i>.<module>"

    def with_lora(model, strength):
        if strength is None:
            return model
        with torch.inference_mode():
            return comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0]

    def load_facts(seg, workers):
        eng = S.engines()[0]
        st, ld = eng.loaded.store, eng.last_load
        patched = [(i, n, t) for i in range(len(st.manifest)) for n, t in st.block(i).items()
                   if f"blocks.{i}.{n.rsplit('.', 1)[0]}" in modules]
        refill = ld.refill
        return dict(same_store=store() == seg, same_pids=pids() == workers, line=ld.line(), readaheads=made[:],
                    full_because=ld.full_because, refill=None if refill is None else dict(
                        tensors=refill.store.tensors, of_tensors=refill.store.of_tensors, bytes=refill.store.bytes,
                        names=sorted(f"{i}:{n}" for i, names in refill.store.blocks for n in names),
                        ranks_bytes=refill.ranks_bytes),
                    want_bytes=sum(t.numel() * t.element_size() for _, _, t in patched),
                    want_names=sorted(f"{i}:{n}" for i, n, _ in patched),
                    of_tensors=sum(len(b) for b in st.manifest))

    for kind, kw in (("fp32", {}), ("int8", dict(int8=True, scale_2d=True))):
        base = comfy_h3.load(write(kind, **kw))
        before = last = None
        for strength in (0.8, 0.3, None):
            model = with_lora(base, strength)
            plain = ksample(model)
            made.clear()
            split = split_ksample(node(model, 2), 2)
            extra = {}
            if before is not None:
                extra = dict(load_facts(*before), plain_changed=not comfy_h3.same(last, plain)[0])
            report(f"{kind} lora {strength}", plain, split, **extra)
            last = plain
            if before is None:
                before = (store(), pids())
                note(f"{kind} full fill", line=S.engines()[0].last_load.line(), readaheads=made[:])
        S.release_all_engines()
'''
    out = _run(cases, ["--use-pytorch-cross-attention"])
    for kind in ("fp32", "int8"):
        assert out[f"{kind} lora 0.8"]["proof"]["failure"] is None
        for strength in ("0.3", "None"):
            case = out[f"{kind} lora {strength}"]
            assert case["same_pids"] and case["plain_changed"], case
            if case["refill"] is None:  # int8 whose layout changed: a full fill, saying why
                assert kind == "int8" and "layout" in case["full_because"] and not case["same_store"], case
                assert len(case["readaheads"]) == 1, case
                continue
            assert case["same_store"] and case["full_because"] is None, case  # rewritten in place, no new segment
            assert case["readaheads"] == [], case
            r = case["refill"]
            assert r["names"] == case["want_names"] and r["bytes"] == case["want_bytes"], case
            assert r["of_tensors"] == case["of_tensors"] > r["tensors"] > 0, case
            assert r["ranks_bytes"] > 0, case  # each rank's qkv rows are its own copy: taken in again
    assert out["fp32 lora 0.3"]["refill"] is not None and out["fp32 lora None"]["refill"] is not None
    assert all(len(out[f"{kind} full fill"]["readaheads"]) == 1 for kind in ("fp32", "int8")), out
