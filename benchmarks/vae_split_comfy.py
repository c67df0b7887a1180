"""ComfyUI-side body of ``python -m h3ms_async bench vae`` (run inside a ComfyUI root, flags already parsed).

Full-size H3 video VAE (ComfyUI's ``MiniMaxH3VideoVAE`` with its default, real shapes) with seeded random weights on
the device, a random latent; decodes it unsplit through ComfyUI's own ``decode`` (as ``comfy.sd.VAE.decode`` calls a
chunked-io VAE: preallocated float32 output buffer), then through the H3 MS VAE Split Decode node at each rank count
(``H3MS_VAE_RANK_MAP``: logical ranks on one GPU), twice (the first call starts the workers and ships the weights).
Prints one ``RESULT <json>`` line.  Config: JSON in ``H3MS_VAE_BENCH`` (pack, device, dtype, ranks, T, height, width,
layers, heads, seed).
"""
import importlib.util
import json
import os
import sys
import time
import types

import torch

cfg = json.loads(os.environ["H3MS_VAE_BENCH"])
spec = importlib.util.spec_from_file_location("h3ms_pack", os.path.join(cfg["pack"], "__init__.py"),
                                              submodule_search_locations=[cfg["pack"]])
pack = importlib.util.module_from_spec(spec)
sys.modules["h3ms_pack"] = pack
spec.loader.exec_module(pack)
Split = pack.NODE_CLASS_MAPPINGS["H3MSVAESplitDecodeAsync"]
from h3ms_async.vae import split as vae_split  # noqa: E402  (loaded by the pack)

import comfy.ldm.minimax.vae as V  # noqa: E402
import comfy.model_management as mm  # noqa: E402

dev = torch.device(cfg["device"])
cuda = dev.type == "cuda"
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[cfg["dtype"]]
t0 = time.perf_counter()
model = V.MiniMaxH3VideoVAE()
if (cfg["layers"], cfg["heads"]) != (36, 32):  # a smaller decoder for a smoke run
    model.decoder = V.ViT3DDecoder(num_layers=cfg["layers"], heads=cfg["heads"])
model.encoder = None  # decode never uses it; keeps host RAM and VRAM for the decoder
model.quant_conv = None
model = model.to(dev, dtype)
gen = torch.Generator(device=dev).manual_seed(cfg["seed"])
with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
        p.normal_(0.0, 0.02, generator=gen)
        if name.endswith(("norm1.weight", "norm2.weight", "norm_out.weight")):
            p.add_(1.0)
vae = types.SimpleNamespace(first_stage_model=model, device=dev, patcher=None, vae_dtype=dtype)
z = torch.randn(1, 24, cfg["T"], cfg["height"], cfg["width"], generator=torch.Generator().manual_seed(cfg["seed"]))
z = z.to(dev, dtype)
build_s = time.perf_counter() - t0
n_params = sum(p.numel() for p in model.parameters())


def decode() -> tuple[torch.Tensor, float, int]:
    out = torch.empty(model.decode_output_shape(tuple(z.shape)), dtype=torch.float32, device=mm.intermediate_device())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    with torch.inference_mode():
        model.decode(z, output_buffer=out)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t, int(torch.cuda.max_memory_allocated(dev)) if cuda else 0


decode()  # warm-up: the first pass of a process may round differently (tests/test_cuda.py)
ref, unsplit_s, unsplit_peak = decode()
runs = []
for ranks in cfg["ranks"]:
    rank_devices = [cfg["device"]] * ranks
    os.environ["H3MS_VAE_RANK_MAP"] = ",".join(rank_devices)
    Split().patch(vae, True, -1, None, ranks)
    engine = vae_split.get_vae_engine(rank_devices)
    first, first_s, _ = decode()
    first_rec = engine.last_record
    again, again_s, peak = decode()
    runs.append({"ranks": ranks, "equal_first": bool(torch.equal(first, ref)), "equal": bool(torch.equal(again, ref)),
                 "first_wall_s": round(first_s, 3), "wall_s": round(again_s, 3), "speedup": round(unsplit_s / again_s, 3),
                 "main_peak_vram_bytes": peak, "first_record": first_rec, "record": engine.last_record})
    del first, again
    Split().patch(vae, False, -1)  # removes the hook and releases the workers
print("RESULT " + json.dumps({
    "dtype": cfg["dtype"], "latent": list(z.shape), "output": list(ref.shape), "decoder_params": n_params,
    "build_s": round(build_s, 2), "unsplit_s": round(unsplit_s, 3), "unsplit_peak_vram_bytes": unsplit_peak,
    "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__, "runs": runs}), flush=True)
