"""``python -m h3ms_async bench caches``: the text-encoder output cache and the pinned weight cache, in one run.

* Output cache: a transformer encoder stack (``--te-layers`` x ``--te-hidden`` in ``--dtype``, on ``--device``;
  on CUDA its weights stream from host RAM on every encode, as ComfyUI runs a large text encoder next to the
  diffusion model) encodes a prompt of ``--tokens`` tokens through ``OutputCache.fetch``, the call the node's hook
  makes, with the node's key layout (the miss: hashing, the encode and the store), then the same prompt again (the
  hit: hashing plus the copy out).  Reports both times, their ratio and the hashing alone (``hit_key_s``) from the
  same run; the hit must equal the miss bit for bit.
* Weight cache: a model of ``--weights-gb`` GiB in ``--dtype`` is filled into the cache, evicted (its weights dropped
  to the meta device), and restored from the pinned copy onto ``--device``.  The restore bandwidth (allocation
  included) is compared with one plain pinned->device copy of the same byte count into a fresh buffer, measured in
  the same run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from h3ms_async.caches import OutputCache, WeightCache, digest, named_tensors
from h3ms_async.tools.cli import ArgParser

GIB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _encoder(layers: int, hidden: int, dtype: torch.dtype, home: torch.device) -> torch.nn.TransformerEncoder:
    """A transformer encoder stack with seeded random weights, built without the (slow) default init."""
    with torch.device("meta"):
        layer = torch.nn.TransformerEncoderLayer(hidden, max(1, hidden // 128), 4 * hidden, batch_first=True)
        enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    enc = enc.to_empty(device=home).to(dtype).eval()
    gen = torch.Generator(device=home).manual_seed(0)
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return enc


def bench_outputs(device: torch.device, layers: int, hidden: int, tokens: int, repeats: int, stream: bool,
                  dtype: torch.dtype) -> dict:
    """``stream``: the encoder's weights stay in (pinned) host RAM and go to the device layer by layer on every
    encode, as ComfyUI runs a text encoder that does not fit next to the diffusion model."""
    enc = _encoder(layers, hidden, dtype, torch.device("cpu") if stream else device)
    if stream:
        for p in enc.parameters():
            p.data = p.data.pin_memory() if torch.cuda.is_available() else p.data
    ids = torch.randint(0, 150000, (1, tokens), generator=torch.Generator().manual_seed(1))
    pairs = [[(int(i), 1.0) for i in ids[0]]]
    embed = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(2)).to(device, dtype)

    def encode() -> torch.Tensor:
        x = embed
        for layer in enc.layers:
            if stream:
                weights = {n: t.to(device, non_blocking=True) for n, t in layer.state_dict().items()}
                x = torch.func.functional_call(layer, weights, (x,))
            else:
                x = layer(x)
        return x.to("cpu")

    cache = OutputCache()
    misses, hits, keys, equal = [], [], [], True
    for r in range(repeats):
        # The node's key layout (nodes/text_cache_node.py): encoder identity, patch state, layer options, tokens.
        key_parts = (("te", "bench-encoder", r), None, [("clip_l", "last", None, False)], pairs)

        def compute() -> tuple:
            with torch.inference_mode():
                return encode(), {"pooled_output": embed[:, -1].to("cpu")}

        _sync(device)
        t = time.perf_counter()
        out, _, hit = cache.fetch(key_parts, compute, 64)
        misses.append(time.perf_counter() - t)
        assert not hit
        t = time.perf_counter()
        again, _, hit = cache.fetch(key_parts, compute, 64)
        hits.append(time.perf_counter() - t)
        assert hit
        t = time.perf_counter()
        digest(*key_parts)
        keys.append(time.perf_counter() - t)
        equal &= torch.equal(again[0], out[0]) and torch.equal(again[1]["pooled_output"], out[1]["pooled_output"])
    miss_s, hit_s, key_s = (sorted(v)[len(v) // 2] for v in (misses, hits, keys))
    stats = cache.stats()
    return {"encoder": f"{layers} x {hidden} transformer, {dtype}, weights {'streamed from host' if stream else 'on'} "
                       f"{device}", "tokens": tokens, "output_bytes": stats["bytes"] // max(1, stats["entries"]),
            "miss_s": round(miss_s, 6), "hit_s": round(hit_s, 6), "hit_key_s": round(key_s, 6),
            "hit_fraction_of_miss": round(hit_s / miss_s, 6), "hit_equals_miss": equal, "stats": stats}


def bench_weights(device: torch.device, gib: float, dtype: torch.dtype) -> dict:
    elem = torch.empty((), dtype=dtype).element_size()
    per = 4096 * 4096
    n = max(1, int(gib * GIB / (per * elem)))
    model = torch.nn.ModuleList(torch.nn.Linear(4096, 4096, bias=False) for _ in range(n)).to(device, dtype)
    want = [p.detach().clone() for p in model.parameters()] if n <= 4 else None
    cache = WeightCache()
    entry = cache.fill("bench", ("bench", n), named_tensors(model))
    pinned = torch.ones(entry.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    torch.empty(1 << 20, dtype=torch.uint8, device=device).copy_(pinned[:1 << 20])  # warm the copy path
    _sync(device)
    # Both sides allocate their destination, as a restore must: the evicted model has no memory left.
    t = time.perf_counter()
    target = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
    target.copy_(pinned, non_blocking=True)
    _sync(device)
    copy_s = time.perf_counter() - t
    del target, pinned
    model.to_empty(device="meta")
    _sync(device)
    t = time.perf_counter()
    model.to_empty(device=device)
    nbytes = cache.restore(entry, model)
    _sync(device)
    restore_s = time.perf_counter() - t
    exact = want is None or all(torch.equal(a, b) for a, b in zip(model.parameters(), want))
    return {"bytes": nbytes, "tensors": len(entry.tensors), "pinned": torch.cuda.is_available(),
            "pinned_copy_gbps": round(nbytes / copy_s / 1e9, 3), "restore_gbps": round(nbytes / restore_s / 1e9, 3),
            "restore_fraction_of_copy": round(copy_s / restore_s, 4), "restore_exact": exact,
            "fill_s": round(entry.fill_seconds, 3)}


def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m h3ms_async bench caches", description=__doc__)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--te-layers", type=int, default=16)
    p.add_argument("--te-hidden", type=int, default=4096)
    p.add_argument("--te-stream", choices=("auto", "yes", "no"), default="auto",
                   help="stream the encoder's weights from host RAM on every encode (auto: on CUDA)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--weights-gb", type=float, default=4.0)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--out", default="", help="folder for bench_caches.json")
    a = p.parse_args(list(argv))
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    stream = a.te_stream == "yes" or (a.te_stream == "auto" and device.type == "cuda")
    result = {"outputs": bench_outputs(device, a.te_layers, a.te_hidden, a.tokens, a.repeats, stream, dtype),
              "weights": bench_weights(device, a.weights_gb, dtype), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_caches.json").write_text(text)
    ok = (result["outputs"]["hit_equals_miss"] and result["weights"]["restore_exact"]
          and result["outputs"]["hit_fraction_of_miss"] < 0.01 and result["weights"]["restore_fraction_of_copy"] >= 0.8)
    return 0 if ok else 1
