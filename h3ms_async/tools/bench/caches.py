"""``python -m h3ms_async bench caches``: the text-encoder output cache and the pinned weight cache,
in one run.

* Output cache: a transformer encoder stack (``--te-layers`` x ``--te-hidden`` in ``--dtype``, on
  ``--device``; on CUDA its weights stream from host RAM on every encode, as ComfyUI runs a large
  text encoder next to the diffusion model) encodes a prompt of ``--tokens`` tokens through
  ``OutputCache.fetch`` (the lookup and store the node's hook makes), with a key shaped like the
  node's (the miss: hashing, the encode and the store), then the same prompt again (the hit: hashing
  plus the copy out).  Reports both times, their ratio and the hashing alone (``hit_key_s``) from
  the same run; the hit must equal the miss bit for bit.
* Weight cache: a model of ``--weights-gb`` GiB in ``--dtype`` goes to host RAM and back to
  ``--device`` as ComfyUI's unload and load move it: once from pageable RAM (the reload), once after
  the cache homed the host weights into its pinned buffers (the restore); both times and bandwidths,
  from the same run.  Then the cache is released (``released``: what that gave back): on a GPU the
  model sits there, so the whole copy is freed; on the CPU the buffers are the model's own weights
  and stay (``kept_bytes``).  The same through ComfyUI's own unload/load, at H3's sizes:
  ``tests/test_caches_cuda.py`` (``benchmarks/device_run.sh caches``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from h3ms_async.caches import OutputCache, WeightCache, digest
from h3ms_async.tools.cli import ArgParser

GIB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _encoder(
    layers: int, hidden: int, dtype: torch.dtype, home: torch.device
) -> torch.nn.TransformerEncoder:
    """A transformer encoder stack with seeded random weights, built without the (slow) default
    init."""
    with torch.device("meta"):
        layer = torch.nn.TransformerEncoderLayer(
            hidden, max(1, hidden // 128), 4 * hidden, batch_first=True
        )
        enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    enc = enc.to_empty(device=home).to(dtype).eval()
    gen = torch.Generator(device=home).manual_seed(0)
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return enc


def bench_outputs(
    device: torch.device,
    layers: int,
    hidden: int,
    tokens: int,
    repeats: int,
    stream: bool,
    dtype: torch.dtype,
) -> dict:
    """``stream``: the encoder's weights stay in (pinned) host RAM and go to the device layer by
    layer on every encode, as ComfyUI runs a text encoder that does not fit next to the diffusion
    model."""
    enc = _encoder(layers, hidden, dtype, torch.device("cpu") if stream else device)
    if stream:
        for p in enc.parameters():
            p.data = p.data.pin_memory() if torch.cuda.is_available() else p.data
    ids = torch.randint(0, 150000, (1, tokens), generator=torch.Generator().manual_seed(1))
    pairs = [[(int(i), 1.0) for i in ids[0]]]
    embed = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(2)).to(
        device, dtype
    )

    def encode() -> torch.Tensor:
        x = embed
        for layer in enc.layers:
            if stream:
                weights = {
                    n: t.to(device, non_blocking=True) for n, t in layer.state_dict().items()
                }
                x = torch.func.functional_call(layer, weights, (x,))
            else:
                x = layer(x)
        return x.to("cpu")

    cache = OutputCache()
    misses, hits, keys, equal = [], [], [], True
    for r in range(repeats):
        # Shaped like the node's key (nodes/text_cache_node.py): encoder files, patch fingerprint,
        # method, layer, the call's arguments with the tokens.
        key_parts = (
            ("te", "bench-encoder", r),
            "0" * 64,
            "encode_from_tokens",
            None,
            {"tokens": pairs},
        )

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
        equal &= torch.equal(again[0], out[0]) and torch.equal(
            again[1]["pooled_output"], out[1]["pooled_output"]
        )
    miss_s, hit_s, key_s = (sorted(v)[len(v) // 2] for v in (misses, hits, keys))
    stats = cache.stats()
    return {
        "encoder": f"{layers} x {hidden} transformer, {dtype}, weights "
        f"{'streamed from host' if stream else 'on'} "
        f"{device}",
        "tokens": tokens,
        "output_bytes": stats["bytes"] // max(1, stats["entries"]),
        "miss_s": round(miss_s, 6),
        "hit_s": round(hit_s, 6),
        "hit_key_s": round(key_s, 6),
        "hit_fraction_of_miss": round(hit_s / miss_s, 6),
        "hit_equals_miss": equal,
        "stats": stats,
    }


def bench_weights(device: torch.device, gib: float, dtype: torch.dtype) -> dict:
    """What ComfyUI's unload and load do to a model's weights, with and without the cache: the
    weights go to host RAM (``.to("cpu")``, pageable), then back to ``device`` (the reload); then
    the cache homes them into its pinned buffers and they go back again (the restore)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per = 4096 * 4096
    n = max(1, int(gib * GIB / (per * elem)))
    model = torch.nn.ModuleList(torch.nn.Linear(4096, 4096, bias=False) for _ in range(n)).to(
        device, dtype
    )
    want = [p.detach().to("cpu", copy=True) for p in model.parameters()] if n <= 4 else None

    def to_device() -> float:
        _sync(device)
        t = time.perf_counter()
        model.to(device)
        _sync(device)
        return time.perf_counter() - t

    model.to("cpu")
    reload_s = to_device()
    model.to("cpu")
    cache = WeightCache()
    t = time.perf_counter()
    cache.home("bench", ("bench", n), model)
    home_s = time.perf_counter() - t
    restore_s = to_device()
    counted = cache.note_loaded("bench", model)
    nbytes = cache.bytes_held()
    exact = want is None or all(
        torch.equal(a.to("cpu"), b) for a, b in zip(model.parameters(), want)
    )
    released = cache.release("bench")
    return {
        "bytes": nbytes,
        "pinned": torch.cuda.is_available(),
        "reload_s": round(reload_s, 4),
        "restore_s": round(restore_s, 4),
        "home_s": round(home_s, 3),
        "reload_gbps": round(nbytes / reload_s / 1e9, 3),
        "restore_gbps": round(nbytes / restore_s / 1e9, 3),
        "restore_counted": counted,
        "restore_exact": exact,
        "released": released.as_dict(),
    }


def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m h3ms_async bench caches", description=__doc__)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--te-layers", type=int, default=16)
    p.add_argument("--te-hidden", type=int, default=4096)
    p.add_argument(
        "--te-stream",
        choices=("auto", "yes", "no"),
        default="auto",
        help="stream the encoder's weights from host RAM on every encode (auto: on CUDA)",
    )
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--weights-gb", type=float, default=4.0)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--out", default="", help="folder for bench_caches.json")
    a = p.parse_args(list(argv))
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    stream = a.te_stream == "yes" or (a.te_stream == "auto" and device.type == "cuda")
    outputs = bench_outputs(device, a.te_layers, a.te_hidden, a.tokens, a.repeats, stream, dtype)
    w = bench_weights(device, a.weights_gb, dtype)
    result = {
        "outputs": outputs,
        "weights": w,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_caches.json").write_text(text)
    ok = (
        outputs["hit_equals_miss"]
        and w["restore_exact"]
        and w["released"]["kept_bytes"] == (w["bytes"] if device.type == "cpu" else 0)
        and outputs["hit_fraction_of_miss"] < 0.01
        and (device.type == "cpu" or w["restore_counted"])
    )
    return 0 if ok else 1
