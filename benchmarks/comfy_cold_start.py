"""Cold start through real ComfyUI: what a prompt pays before its steps run at speed, plain ComfyUI against the node,
from the same checkpoint file read from disk; then the node's second prompt, which must refill nothing.

    python benchmarks/comfy_cold_start.py --out "$OUT"        (after ``source benchmarks/device_setup.sh``; CUDA)
    python benchmarks/comfy_cold_start.py --dims tiny --layers 3 --ranks cpu,cpu --out /tmp/cold   (CPU)

ComfyUI starts as ``main.py`` starts (``import main``: DynamicVRAM on where CUDA is) and loads the pack with its own
loader. The script writes a random-weight H3 checkpoint in ComfyUI's int8 format (H3's key names; ``--dims full``:
5376 wide, 56 heads x 128, MLP 14336, bf16 adaLN and norms; ``--layers`` blocks, all 50 by default) into ComfyUI's
``diffusion_models`` folder, flushes it, and drops it from the page cache (``posix_fadvise``) before each load, so
both sides read it from disk. Then:

1. plain ComfyUI: ``UNETLoader``, then ``--steps`` sampling steps (cfg 1: one model call per step), each call's
   block stack timed between two forward hooks on ComfyUI's own modules (each syncs the GPU). ComfyUI's cold cost =
   the loader + (first block stack - the steady one): under DynamicVRAM the weights are read during the first call.
2. ``unload_all_models()``, as between prompts; the model is loaded again from the dropped file and H3 MultiStream
   (``--ranks``, host exchange, resident weights, weight cache on) patches it. The node's cold cost = the loader +
   (first block stack - the steady one): the workers' start, the weight-store fill, the ranks' load, the exactness
   probe, the first step's buffers (``SplitEngine.last_load`` and the verdicts break it down; the start, the ranks'
   load and the probe run beside the fill: ``weights`` gives their offsets from the load's start, the fill's end
   ``fill_end_s``, and ``probe.overlapped``; of the fill, ``fill_read_s`` in the reading thread, ComfyUI's rows and
   casts included, and ``fill_copy_s`` in the copy thread beside it, ``fill_file_bytes`` of the stored bytes read
   from the checkpoint by ``pread``, the tensors ComfyUI maps unchanged); ``rows_s``: the first call's seconds inside the
   blocks' adaLN linears (the modulation rows, which the fill computes block by block as it reads each block);
   ``cast_s`` and ``cast_calls``: the first prompt's seconds (each call synced) and calls inside ComfyUI's cast for
   the modules whose patches ComfyUI applies in its cast (``nodes/comfy_weights.py``: with ``--lora``, every
   block's qkv and fc1), the part of the fill a LoRA adds; of it ``cast_pin_s`` in ComfyUI pinning the module's host copy
   (``comfy.pinned_memory.pin_memory``) and ``cast_read_s`` in its file reads
   (``comfy.memory_management.read_tensor_file_slice_into``).
3. the second prompt on the same patched model: its first block stack against its steady one; ``refilled`` says
   whether the store was filled again (it must not be). ``bit_exact``: both prompts' samples equal plain ComfyUI's
   (None when ``split_proof``, per prompt, says why it does not prove that every model call split on every rank:
   ``tests/split_proof.py``; a refused plan runs ComfyUI's own blocks).

``--lora`` puts a rank-16 LoRA on every block's qkv and fc1 on both sides: ComfyUI then patches those weights in its
cast, and the node's fill takes them from that cast (``nodes/comfy_weights.py``), the slower path. Then a third
prompt runs with the LoRA at another strength (0.3 instead of 0.8): the node rewrites only the patched tensors in
place (``WeightStore.rewrite``); ``node_third_prompt`` gives its bytes and seconds (``refill``) beside the first
prompt's full fill (``full_fill``), whether the store segment stayed (``same_store``), and ``bit_exact`` whether its
samples equal plain ComfyUI's at that strength.

Last, ``node_other_rank_map``: the rank map one rank longer (its first device again), as a user trying another GPU
count, on the model last sampled: new workers that load the store the last prompt left (``same_store``,
``fill_bytes`` 0, ``kept_bytes``), the load's and the first block stack's seconds, and ``bit_exact``.

Beside them: the file's sequential read rate after a drop (its first 4 GiB, ``disk_read_gbps``, and the whole
file, ``disk_read_whole_gbps``: a virtual disk may serve part of a file just written from its host's cache), and the copy bandwidths the fill is bounded by (CUDA:
pinned and pageable device-to-host and host-to-device; CPU: a host memcpy). JSON: ``$OUT/comfy_cold_start.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import comfy_tree  # noqa: E402

_BODY = comfy_tree.BENCH_PRELUDE + r'''
import safetensors.torch
import comfy.model_management as mm
import comfy.sd
from h3ms_async.status.hub import get_hub  # the pack's own copy, loaded by start()
from page_cache import drop
from split_proof import SplitProof
cuda = torch.cuda.is_available()
dims = comfy_h3.FULL if {dims!r} == "full" else comfy_h3.Dims()
W, H, TEXT = {width}, {height}, 9
length = comfy_h3.length_for_tokens({tokens}, W, H, TEXT)
KW = dict(width=W, height=H, length=length, text_len=TEXT, steps={steps}, cfg=1.0)

def sync():
    if cuda:
        torch.cuda.synchronize()

name = {name!r}
path = os.path.join(comfy_h3.checkpoint_dir(), name)  # removed by main() whatever the run's end
t = time.perf_counter()
# a LoRA'd int8 layer is dequantized in ComfyUI's cast, whose kernels take [N, 1] row scales
sd = comfy_h3.state_dict(layers={layers}, int8=True, dtype=torch.bfloat16, dims=dims,
                         device="cuda" if cuda else "cpu", scale_2d={lora})
safetensors.torch.save_file(sd, path)
print("checkpoint written: " + path, flush=True)
del sd
gc.collect()
fd = os.open(path, os.O_RDONLY)
os.fsync(fd)  # dirty pages cannot be dropped
os.close(fd)
write_s = time.perf_counter() - t
file_bytes = os.path.getsize(path)

def disk_gbps(limit):
    """The file's sequential read rate after a drop, over its first ``limit`` bytes."""
    drop(path)
    t = time.perf_counter()
    read = 0
    with open(path, "rb", buffering=0) as fh:
        piece = bytearray(64 << 20)
        while read < limit and (got := fh.readinto(piece)):
            read += got
    return read / (time.perf_counter() - t) / 1e9

# the first 4 GiB, and the whole file: a virtual disk may serve part of a file just written from its host's cache,
# faster than a whole checkpoint's read can go
disk_start_gbps = disk_gbps(4 << 30)
disk_whole_gbps = disk_gbps(file_bytes)

def gbps(fn, nbytes, reps=3):
    fn(); sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return round(nbytes * reps / (time.perf_counter() - t) / 1e9, 2)

n = 1 << 30
copies = {{}}
host = torch.empty(n, dtype=torch.uint8)
if cuda:
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    copies["d2h_pinned_gbps"] = gbps(lambda: pinned.copy_(dev, non_blocking=True), n)
    copies["h2d_pinned_gbps"] = gbps(lambda: dev.copy_(pinned, non_blocking=True), n)
    copies["d2h_pageable_gbps"] = gbps(lambda: host.copy_(dev), n)
    copies["h2d_pageable_gbps"] = gbps(lambda: dev.copy_(host), n)
    del dev, pinned
else:
    other = torch.ones(n, dtype=torch.uint8)
    copies["host_memcpy_gbps"] = gbps(lambda: host.copy_(other), n)
    del other
del host
gc.collect()

timer = comfy_h3.BlockStackTimer()
rows_s = []  # per model call: seconds inside the blocks' adaLN linears (ComfyUI's own, each synced)

def synced():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()

def time_rows(model):
    dm = model.get_model_object("diffusion_model")
    dm.time_embedder.register_forward_hook(lambda m, a, o: rows_s.append(0.0))
    started = []
    for b in dm.blocks:
        b.adaln_proj.linear.register_forward_pre_hook(lambda m, a: started.append(synced()))
        b.adaln_proj.linear.register_forward_hook(
            lambda m, a, o: rows_s.__setitem__(-1, rows_s[-1] + synced() - started.pop()))

# the fill's reads through ComfyUI's cast (LoRA-patched modules): seconds, calls, and inside those calls the seconds
# in ComfyUI's pinning of the module's host copy and in its file reads (comfy-aimdo's reader)
cast = dict(s=0.0, calls=0, pin_s=0.0, read_s=0.0)
inside_cast = [False]

def time_casts():
    import comfy.memory_management, comfy.pinned_memory
    mod = next(m for k, m in list(sys.modules.items())
               if k.endswith("nodes.comfy_weights") and hasattr(m, "_cast_path_tensors"))
    inner = mod._cast_path_tensors

    def timed(*a, **kw):
        t0 = synced()
        inside_cast[0] = True
        try:
            return inner(*a, **kw)
        finally:
            inside_cast[0] = False
            cast["s"] += synced() - t0
            cast["calls"] += 1
    mod._cast_path_tensors = timed
    for owner, name, key in ((comfy.pinned_memory, "pin_memory", "pin_s"),
                             (comfy.memory_management, "read_tensor_file_slice_into", "read_s")):
        depth = [0]  # ComfyUI's read of an int8 tensor calls itself for the tensor's data: time the outer call

        def part(*a, _fn=getattr(owner, name), _key=key, _depth=depth, **kw):
            if not inside_cast[0] or _depth[0]:
                return _fn(*a, **kw)
            t0 = time.perf_counter()
            _depth[0] += 1
            try:
                return _fn(*a, **kw)
            finally:
                _depth[0] -= 1
                cast[_key] += time.perf_counter() - t0
        setattr(owner, name, part)

lora = comfy_h3.lora_state_dict({layers}, rank=16, dims=dims) if {lora} else None

def with_lora(model, strength):
    with torch.inference_mode():
        return comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0]

def loaded():
    """UNETLoader on the dropped file, hooks on the new model's own modules; (patcher, seconds, the unpatched
    patcher)."""
    drop(path)
    t = time.perf_counter()
    base = model = comfy_h3.load(name)
    if {lora}:
        model = with_lora(base, 0.8)
    s = time.perf_counter() - t
    timer.attach(model)
    return model, s, base

def sample(model):
    """(block-stack seconds per call, the sampled streams)."""
    timer.times.clear()
    out = comfy_h3.ksample(model, **KW)
    return [round(x, 4) for x in timer.times], out

def rnd(s):
    return None if s is None else round(s, 3)

def cold(load_s, stacks):
    return round(load_s + stacks[0] - min(stacks[1:]), 4)

model, plain_load_s, _ = loaded()
patcher = type(model).__name__
plain, plain_out = sample(model)
del model
mm.unload_all_models()
gc.collect()
mm.soft_empty_cache()

os.environ["H3MS_RANK_MAP"] = {ranks!r}
model, node_load_s, base = loaded()
time_rows(model)
split = N["H3MultiStreamAsync"]().patch(model, True, -1, "host", 8, True, 0.0, "auto", None)[0]
time_casts()
from h3ms_async.dit import split as S
proofs = [SplitProof({ranks!r}.split(","), strict=False) for _ in range(2)]  # every call split, per prompt
with proofs[0]:
    first, first_out = sample(split)
first_cast = dict(cast)
eng = S.engines()[0]
load = eng.last_load
segment = eng.loaded.store.segment.name
with proofs[1]:
    second, second_out = sample(split)
refilled = eng.last_load is not load or eng.loaded.store.segment.name != segment
third = None
if {lora}:  # the LoRA at another strength: only the patched tensors are rewritten
    relora = with_lora(base, 0.3)
    proofs.append(SplitProof({ranks!r}.split(","), strict=False))
    with proofs[2]:
        third_stacks, third_out = sample(N["H3MultiStreamAsync"]().patch(relora, True, -1, "host", 8, True, 0.0,
                                                                          "auto", None)[0])
    refill = eng.last_load
    _, plain_third = sample(relora)
    third = dict(strength=0.3, block_stack_s=third_stacks,
                 first_over_steady_s=round(third_stacks[0] - min(third_stacks[1:]), 4),
                 same_store=eng.loaded.store.segment.name == segment, full_because=refill.full_because,
                 refill=None if refill.refill is None else dict(
                     tensors=refill.refill.store.tensors, of_tensors=refill.refill.store.of_tensors,
                     bytes=refill.fill_bytes, store_s=round(refill.fill_s, 4),
                     store_read_s=round(refill.refill.store.read_s, 4),
                     ranks_s=round(refill.ranks_load_s, 4), ranks_bytes=refill.refill.ranks_bytes,
                     wall_s=round(refill.wall_s, 4), line=refill.line()),
                 full_fill=dict(bytes=load.fill_bytes, fill_s=round(load.fill_s, 6), wall_s=round(load.wall_s, 3)),
                 bit_exact=comfy_h3.same(plain_third, third_out)[0] if proofs[2].failure is None else None)
# another rank map (one rank more) on the model last sampled: new workers, which load the store the last prompt left
last_model, last_plain = (relora, plain_third) if {lora} else (model, plain_out)
last_segment = S.engines()[0].loaded.store.segment.name
more = {ranks!r} + "," + {ranks!r}.split(",")[0]
os.environ["H3MS_RANK_MAP"] = more
proofs.append(SplitProof(more.split(","), strict=False))
with proofs[-1]:
    more_stacks, more_out = sample(N["H3MultiStreamAsync"]().patch(last_model, True, -1, "host", 8, True, 0.0, "auto",
                                                                   None)[0])
more_eng = S.engines()[0]
ml = more_eng.last_load
other_rank_map = dict(devices=more_eng.devices, block_stack_s=more_stacks,
                      first_over_steady_s=round(more_stacks[0] - min(more_stacks[1:]), 4),
                      same_store=more_eng.loaded.store.segment.name == last_segment, fill_bytes=ml.fill_bytes,
                      kept_bytes=ml.kept_bytes, workers_start_s=round(ml.workers_start_s, 3),
                      ranks_load_s=round(ml.ranks_load_s, 3), wall_s=round(ml.wall_s, 3), line=ml.line(),
                      bit_exact=comfy_h3.same(last_plain, more_out)[0] if proofs[-1].failure is None else None)
verdicts = [v for v in get_hub().exactness()["verdicts"] if v["program"] == "dit"]
comfy_cold, node_cold = cold(plain_load_s, plain), cold(node_load_s, first)
print("RESULT " + json.dumps(dict(
    patcher=patcher, devices=eng.devices, layers={layers}, dims={dims!r}, lora={lora}, tokens=proofs[0].calls[0][0],
    width=W, height=H, length=length, checkpoint_bytes=file_bytes, checkpoint_write_s=round(write_s, 2),
    disk_read_gbps=round(disk_start_gbps, 4), disk_read_whole_gbps=round(disk_whole_gbps, 4), copies=copies,
    plain=dict(load_s=round(plain_load_s, 4), block_stack_s=plain, cold_s=comfy_cold),
    node_first_prompt=dict(load_s=round(node_load_s, 4), block_stack_s=first, cold_s=node_cold,
                           weights=dict(workers_start_s=round(load.workers_start_s, 3), fill_s=round(load.fill_s, 6),
                                        fill_bytes=load.fill_bytes, fill_gbps=round(load.fill_gbps, 2),
                                        start_wait_s=round(load.start_wait_s, 3),
                                        ranks_load_s=round(load.ranks_load_s, 3), wall_s=round(load.wall_s, 3),
                                        fill_end_s=round(load.fill_end_s, 3),
                                        fill_read_s=round(load.fill_read_s, 3),
                                        fill_copy_s=round(load.fill_copy_s, 3),
                                        fill_file_bytes=load.fill_file_bytes,
                                        ranks_first_block_s=rnd(load.ranks_first_block_s),
                                        ranks_last_block_s=rnd(load.ranks_last_block_s),
                                        probe=None if load.probe is None else dict(
                                            start_s=round(load.probe.start_s, 3), end_s=round(load.probe.end_s, 3),
                                            probed=load.probe.probed, overlapped=load.probe_overlapped)),
                           probe_ms=max((v["probe_ms"] for v in verdicts), default=0.0),
                           rows_s=round(rows_s[0], 6) if rows_s else None,
                           cast_s=round(first_cast["s"], 6), cast_calls=first_cast["calls"],
                           cast_pin_s=round(first_cast["pin_s"], 6), cast_read_s=round(first_cast["read_s"], 6)),
    node_second_prompt=dict(block_stack_s=second, first_over_steady_s=round(second[0] - min(second[1:]), 4),
                            refilled=refilled),
    node_third_prompt=third,
    node_other_rank_map=other_rank_map,
    node_cold_over_comfy_cold=round(node_cold / comfy_cold, 3) if comfy_cold > 0 else None,
    split_proof=[p.failure for p in proofs],
    bit_exact=comfy_h3.same(plain_out, first_out)[0] and comfy_h3.same(plain_out, second_out)[0]
    if not any(p.failure for p in proofs[:2]) else None,
)), flush=True)
N["H3MSReleaseResourcesAsync"]().run(True, True, True)
'''
CHECKPOINT = "h3ms_cold_start.safetensors"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", choices=("full", "tiny"), default="full", help="block-stack width (full: H3's own)")
    p.add_argument("--layers", type=int, default=50, help="blocks in the checkpoint (H3 has 50)")
    p.add_argument("--tokens", type=int, default=20000, help="packed tokens wanted per step")
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--steps", type=int, default=2, help="sampling steps per prompt (>= 2: the first is the cold one)")
    p.add_argument("--ranks", default="cuda:0,cuda:0", help="the node's rank map (H3MS_RANK_MAP)")
    p.add_argument("--lora", action="store_true",
                   help="a rank-16 LoRA on every block's qkv and fc1 (ComfyUI patches those in its cast)")
    p.add_argument("--timeout", type=float, default=560.0, help="seconds for the whole ComfyUI run")
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, ".out")))
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be >= 2: a prompt's cold cost is its first block stack over a steady one")
    os.makedirs(a.out, exist_ok=True)
    body = _BODY.format(name=CHECKPOINT, tests=os.path.join(ROOT, "tests"), dims=a.dims, layers=a.layers, tokens=a.tokens,
                        width=a.width, height=a.height, steps=a.steps, ranks=a.ranks, lora=a.lora)
    args = ["--disable-api-nodes"] + ([] if a.ranks.startswith("cuda") else ["--cpu"])
    try:
        res = comfy_tree.run_comfy_result(body, args, os.path.join(a.out, "comfy_cold_start_comfyui.log"), a.timeout)
    finally:  # ended, failed or killed: tens of GB must not stay on the disk (the next run could not write its own)
        # ComfyUI writes diffusion_models/ to the first folder it lists for them (models/unet/ in this tree)
        for leftover in (comfy_tree.COMFY_ROOT / "models").glob(f"*/{CHECKPOINT}"):
            leftover.unlink()
    if res is None:
        return 1
    with open(os.path.join(a.out, "comfy_cold_start.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
