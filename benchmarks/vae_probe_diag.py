"""Why a VAE worker's probe decode differs from ComfyUI's (GPU diagnosis; prints one JSON line).

Inside real ComfyUI (started as ``main.py`` starts; ``--disable-dynamic-vram`` as a flag of this script turns
DynamicVRAM off) a bf16-stored small H3 VAE decodes the probe latent of a 1x24x7x4x6 chunk three times; then

- ``in_process``: the decoder a worker builds (``workers.vae.rank.build_decoder`` + ``load_tensors`` from the
  tensors the split ships) decodes it in ComfyUI's own process,
- ``child``: a fresh process imports ComfyUI as a worker does (``import_comfy_vae`` with ComfyUI's argv, the
  worker's SDPA warm-up) and decodes it three times,

each compared with ComfyUI's decode module by module (forward hooks on every decoder module, in call order): the
first module whose output differs names the cause.
    python benchmarks/vae_probe_diag.py [--disable-dynamic-vram] > diag.json   (on the GPU machine)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPE = (1, 24, 7, 4, 6)


def _hooked(model, outs: list):
    """Forward hooks recording every module's first tensor output (CPU copy), in call order."""
    import torch

    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def rec(_m, _i, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                outs.append((name, t.detach().to("cpu").clone()))

        handles.append(mod.register_forward_hook(rec))
    return handles


def _first_diff(mine: list, ref: list) -> dict | None:
    import torch

    for (n, a), (m, b) in zip(mine, ref):
        if n != m or a.shape != b.shape or a.dtype != b.dtype:
            return {"module": n, "ref_module": m, "why": f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"}
        if not torch.equal(a, b):
            d = (a.float() - b.float()).abs()
            return {"module": n, "max_abs": float(d.max()), "n_diff": int((a != b).sum()), "numel": a.numel()}
    if len(mine) != len(ref):
        return {"module": None, "why": f"{len(mine)} vs {len(ref)} module calls"}
    return None


def _decode_hooked(model, z):
    import torch

    from workers.vae.protocol import chunk_digest

    outs: list = []
    hs = _hooked(model, outs)
    try:
        with torch.inference_mode():
            raw = model._adaptive_decode(z)
    finally:
        for h in hs:
            h.remove()
    return chunk_digest(raw), outs


def child(path: str) -> None:
    import torch

    from workers.dit import ops as dit_ops
    from workers.runtime.shm import torch_dtype
    from workers.vae import rank

    blob = torch.load(path, weights_only=False)
    vae_mod = rank.import_comfy_vae(blob["comfy"])
    dtype = torch_dtype(blob["dtype"])
    stored = {n: str(t.dtype).removeprefix("torch.") for n, t in blob["tensors"].items()}
    model = rank.build_decoder(vae_mod, blob["arch"], dtype, stored).to_empty(device=blob["device"])
    rank.load_tensors(model, dict(blob["tensors"]), blob["device"])
    model = model.eval().requires_grad_(False)
    warm = os.environ.get("DIAG_WARM", "1") == "1"
    if warm:
        dit_ops.warm_up(lambda q, k, v, heads: vae_mod.optimized_attention(q, k, v, heads, skip_reshape=True),
                        torch.device(blob["device"]), [dtype])
    res = []
    for _ in range(3):
        dg, outs = _decode_hooked(model, blob["z"].to(blob["device"]))
        res.append({"digest": dg[:12], "equal": dg == blob["digests"][-1], "first_diff": _first_diff(outs, blob["outs"])})
    import comfy.model_management as mm

    print("CHILD " + json.dumps({"warm": warm, "decodes": res, "cudnn_benchmark": torch.backends.cudnn.benchmark,
                                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                                 "attention": getattr(vae_mod.optimized_attention, "__name__", "?"),
                                 "vram_state": str(mm.vram_state)}))


PARENT = r'''
import json, os, subprocess, sys, torch
import main  # noqa: F401
import comfy.sd, nodes
sys.path.insert(0, os.environ["H3MS_TESTS_DIR"]); sys.path.insert(0, os.environ["H3MS_PACK"])
sys.path.insert(0, os.environ["VAE_DIAG_DIR"])
import vae_probe_diag as D
from small_h3_vae import small_h3_vae_state_dict
from h3ms_async.vae import split as vs, exactness
from workers.vae import rank
from workers.vae.protocol import chunk_digest
from workers.runtime.shm import torch_dtype
sd = {k: v.to(torch.bfloat16) for k, v in small_h3_vae_state_dict().items()}
vae = comfy.sd.VAE(sd=sd)
z0 = torch.randn(1, 24, 20, 4, 6, generator=torch.Generator().manual_seed(7))
with torch.inference_mode():
    vae.decode(z0)  # loads the VAE as ComfyUI does, warm
model = vae.first_stage_model
dev = next(p.device for p in model.decoder.parameters())
z = exactness.probe_latent(D.SHAPE, vae.vae_dtype).to(dev)
digests, outs = [], None
for _ in range(3):
    dg, o = D._decode_hooked(model, z)
    digests.append(dg); outs = outs or o
arch, dt = vs.describe_decoder(model, vae.vae_dtype)
tensors = {n: t.detach().to("cpu").clone() for n, t in vs.decoder_tensors(model).items()}
stored = {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()}
import comfy.ldm.minimax.vae as vae_mod
try:
    mine = rank.build_decoder(vae_mod, arch, torch_dtype(dt), stored).to_empty(device=str(dev))
    rank.load_tensors(mine, dict(tensors), str(dev))
    mine = mine.eval().requires_grad_(False)
    dg_in, outs_in = D._decode_hooked(mine, z)
    in_process = {"equal": dg_in == digests[-1], "first_diff": D._first_diff(outs_in, outs)}
    mine_dtypes = sorted({f"{type(m).__name__}:{p.dtype}:{getattr(m, 'comfy_cast_weights', None)}"
                          for m in mine.decoder.modules() for p in m.parameters(recurse=False)})
except Exception as exc:
    in_process, mine_dtypes = {"error": repr(exc)}, []
layer_dtypes = sorted({f"{type(m).__name__}:{p.dtype}:{getattr(m, 'comfy_cast_weights', None)}"
                       for m in model.decoder.modules() for p in m.parameters(recurse=False)})
path = "/tmp/vae_probe_diag.pt"
torch.save({"comfy": {"root": os.getcwd(), "sys_path": [p for p in sys.path if isinstance(p, str) and p],
                      "argv": sys.argv[1:]},
            "arch": arch, "dtype": dt, "device": str(dev), "tensors": tensors, "z": z.cpu(), "digests": digests, "outs": outs}, path)
children = []
for warm in ("1", "0"):
    r = subprocess.run([sys.executable, os.path.join(os.environ["VAE_DIAG_DIR"], "vae_probe_diag.py"),
                        "--child", path], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DIAG_WARM": warm, "PYTHONPATH": os.environ["H3MS_PACK"] + os.pathsep + os.environ.get("PYTHONPATH", "")})
    got = [ln[6:] for ln in r.stdout.splitlines() if ln.startswith("CHILD ")]
    children.append(json.loads(got[0]) if got else {"rc": r.returncode, "stderr": r.stderr[-3000:]})
import comfy.model_management as mm
print("RESULT " + json.dumps({
    "patcher": type(vae.patcher).__name__, "vae_dtype": str(vae.vae_dtype), "arch_cast_flags": arch["cast_flags"],
    "parent_self_equal": len(set(digests)) == 1, "parent_digests": [d[:12] for d in digests],
    "in_process": in_process,
    "parent_layer_dtypes": layer_dtypes, "worker_layer_dtypes": mine_dtypes,
    "parent_attention": getattr(vae_mod.optimized_attention, "__name__", "?"),
    "cudnn_benchmark": torch.backends.cudnn.benchmark, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    "vram_state": str(mm.vram_state), "children": children}))
'''


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(ROOT))
        child(sys.argv[2])
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    import comfy_tree

    args = ["--disable-api-nodes", *sys.argv[1:]]
    env = {"H3MS_TESTS_DIR": str(ROOT / "tests"), "H3MS_PACK": str(ROOT), "VAE_DIAG_DIR": str(HERE)}
    r = comfy_tree.run_comfy_script(PARENT, args, env=env, timeout_s=500)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        print(json.dumps({"rc": r.returncode, "stdout": r.stdout[-3000:], "stderr": r.stderr[-6000:]}))
        return 1
    print(lines[-1][len("RESULT "):])
    return 0


if __name__ == "__main__":
    sys.exit(main())
