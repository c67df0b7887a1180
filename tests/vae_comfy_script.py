"""Body run inside the real ComfyUI tree by tests/test_vae_split_comfy.py (``comfy_tree.run_comfy_script``).

Builds a small random H3 video VAE with real key names through ComfyUI's own loader (``comfy.sd.VAE``; the two
constructors' size defaults are shrunk for the test), decodes every case's latent with plain ComfyUI (no hook), then
through the H3 MS VAE Split Decode node at the case's CPU rank count and return path, each split decode compared under
the split's proof (``tests/split_proof.py``: the case's ranks decoded every chunk), and prints one JSON line per case
and a final ``RESULT`` line.  Cases come as JSON in ``VAE_CASES``: ``[{"ranks", "T", "h", "dtype",
"transport"}]``, optionally ``"skew_rank": r`` (that worker's decode differs from rank 0's on purpose, through
the test hook ``H3MS_TEST_VAE_SKEW_RANK``: the exactness probe must drop it), ``"cold_skew_rank": r`` (only that
worker's first decode differs, ``H3MS_TEST_VAE_COLD_SKEW_RANK``: the probe must keep it) and ``"dit_map": n`` (the ranks come
from an n-rank ``H3MS_RANK_MAP``, capped to ``ranks`` by ``max_gpus``); ``transport`` "no_shm" makes the output
segment fail as a full /dev/shm would, "crash" makes a worker die in the middle of the decode (the decode must fail
naming it, and the next one succeed).  dtype
"dynamic_bf16" is a bf16 checkpoint as ComfyUI's DynamicVRAM leaves it (see :func:`dynamic_bf16_vae`).
"""
import asyncio
import json
import os
import sys
import time

import torch

import comfy.sd
import nodes

t0 = time.time()
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"])
from small_h3_vae import small_h3_vae_state_dict  # noqa: E402
from split_proof import SplitProof  # noqa: E402

sd = small_h3_vae_state_dict()


def dynamic_bf16_vae() -> comfy.sd.VAE:
    """A bf16 checkpoint computed in fp16 as DynamicVRAM leaves it on a GPU: every ``comfy.ops`` module keeps the
    stored bf16 weights (``load_state_dict(assign=True)``) and casts them per layer (``comfy_cast_weights``), every
    other parameter and buffer is in the fp16 ComfyUI built the model in.  ComfyUI's DynamicVRAM patcher hands CPU
    devices to the legacy one (``ModelPatcherDynamic.__new__``), so on CPU its load is replayed here; the CUDA test
    (tests/test_vae_split_cuda.py) runs the real one."""
    stored = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    vae = comfy.sd.VAE(sd=stored, dtype=torch.float16)
    for name, mod in vae.first_stage_model.named_modules():
        if hasattr(mod, "comfy_cast_weights"):
            mod.comfy_cast_weights = True
            for p in ("weight", "bias"):
                if getattr(mod, p, None) is not None:
                    setattr(mod, p, torch.nn.Parameter(stored[f"{name}.{p}"], requires_grad=False))
    return vae


cases = json.loads(os.environ["VAE_CASES"])
vaes = {d: dynamic_bf16_vae() if d == "dynamic_bf16" else
        comfy.sd.VAE(sd=sd, dtype={"fp32": torch.float32, "fp16": torch.float16}[d])
        for d in sorted({c["dtype"] for c in cases})}
assert asyncio.run(nodes.load_custom_node(os.path.join(os.getcwd(), "custom_nodes", "h3_multistream_async")))
Split = nodes.NODE_CLASS_MAPPINGS["H3MSVAESplitDecodeAsync"]
from h3ms_async.vae import split as vae_split  # noqa: E402  (loaded by the pack above)
from workers.runtime.shm import ShmError, held_shm  # noqa: E402

torch.manual_seed(7)
latents = {(c["T"], c["h"]): torch.randn(1, 24, c["T"], c["h"], 3) for c in cases}
with torch.inference_mode():
    refs = {(k, d): vae.decode(z) for k, z in latents.items() for d, vae in vaes.items()}
print("references decoded in", round(time.time() - t0, 1), "s", flush=True)


class NoRoomSegment(vae_split.Segment):
    """/dev/shm without room for the chunk outputs (as in a container mounting 64 MB)."""

    @classmethod
    def create(cls, size, tag):
        if tag == "vae_out":
            raise ShmError(f"/dev/shm has 64.0 MiB free but {size / 2**20:.1f} MiB are needed (test)")
        return super().create(size, tag)


real_segment = vae_split.Segment
results = []
for c in cases:
    vae = vaes[c["dtype"]]
    os.environ.pop("H3MS_VAE_RANK_MAP" if c.get("dit_map") else "H3MS_RANK_MAP", None)
    os.environ["H3MS_RANK_MAP" if c.get("dit_map") else "H3MS_VAE_RANK_MAP"] = ",".join(
        ["cpu"] * c.get("dit_map", c["ranks"]))
    os.environ["H3MS_VAE_TRANSPORT"] = "auto" if c["transport"] in ("no_shm", "crash") else c["transport"]
    vae_split.Segment = NoRoomSegment if c["transport"] == "no_shm" else real_segment
    # read by the workers this case's engine starts (another rank count than the last case)
    for var, key in (("H3MS_TEST_VAE_SKEW_RANK", "skew_rank"), ("H3MS_TEST_VAE_COLD_SKEW_RANK", "cold_skew_rank")):
        if c.get(key):
            os.environ[var] = str(c[key])
        else:
            os.environ.pop(var, None)
    assert Split().patch(vae, True, -1, None, c["ranks"])[0] is vae
    t = time.time()
    crash_error = None
    if c["transport"] == "crash":
        with torch.inference_mode():
            vae.decode(latents[(c["T"], c["h"])])  # workers up and loaded
        open(os.environ["H3MS_TEST_VAE_CRASH_FILE"], "w").close()
        try:
            with torch.inference_mode():
                vae.decode(latents[(c["T"], c["h"])])
        except Exception as exc:  # noqa: BLE001 - the error text is what the test checks
            crash_error = f"{type(exc).__name__}: {exc}"
    ref = refs[((c["T"], c["h"]), c["dtype"])]
    proofs = []

    def split_decode():
        """One decode under the split's proof: the case's ranks (less the skewed one) decoded every chunk."""
        with SplitProof(["cpu"] * c["ranks"], "vae", dropped=[c["skew_rank"]] if c.get("skew_rank") else []) as p:
            with torch.inference_mode():
                out = vae.decode(latents[(c["T"], c["h"])])
        proofs.append(p.summary())
        return out

    got = split_decode()
    again = split_decode() if c.get("skew_rank") else got  # the verdict is kept
    rec = vae_split.get_vae_engine(["cpu"] * c["ranks"]).last_record
    unchecked_equal = None
    if c.get("skew_rank"):  # the same decode with every rank taken as exact: the skew reaches the output
        known = vae_split.exactness.known
        vae_split.exactness.known = lambda key: True
        with torch.inference_mode():
            unchecked_equal = bool(torch.equal(vae.decode(latents[(c["T"], c["h"])]), ref))
        vae_split.exactness.known = known
    row = {**c, "equal": bool(torch.equal(got, ref)) and bool(torch.equal(again, ref)), "record": rec, "proofs": proofs,
           "unchecked_equal": unchecked_equal, "crash_error": crash_error, "seconds": round(time.time() - t, 2),
           "std": float(ref.float().std()), "saturated": float((ref == 0).float().mean() + (ref == 1).float().mean()),
           "block_dtypes": sorted({str(p.dtype) for n, p in vae.first_stage_model.named_parameters()
                                   if n.startswith("decoder.transformer_blocks.")})}
    results.append(row)
    print("CASE", json.dumps({k: v for k, v in row.items() if k not in ("record", "crash_error", "proofs")}), "load",
          rec and rec["load_s"],
          flush=True)
vae_split.Segment = real_segment

# fp16 through the node's enabled=false, the rest through Release Resources (detach_hooks + release_vae_workers).
if "fp16" in vaes:
    Split().patch(vaes["fp16"], False, -1)
release = nodes.NODE_CLASS_MAPPINGS["H3MSReleaseResourcesAsync"]().run(False, False, True, True, False)["ui"]["text"]
hooked = [d for d, vae in vaes.items() if "decode_temporal" in vae.first_stage_model.__dict__]
busy = sum("busy" in line for line in release)
workers_alive = [p for e in vae_split.live_vae_engines() for p in e.pool.snapshot() if p["state"] != "stopped"]
from h3ms_async.status.hub import get_hub  # noqa: E402
print("RESULT", json.dumps({"cases": results, "hooked_after_disable": hooked, "busy": busy,
                            "verdicts": get_hub().status()["exactness"]["verdicts"],
                            "shm_left": sorted(held_shm(os.getpid())),
                            "workers_alive": workers_alive, "total_s": round(time.time() - t0, 1)}), flush=True)
