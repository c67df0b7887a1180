"""Tiny MiniMax H3 checkpoints and sampling runs, imported *inside* a real ComfyUI process (``tests/comfy_tree.py``).

The state dict carries H3's real key names at a tiny width, so ComfyUI's own ``model_detection`` recognises it and
``UNETLoader`` / ``comfy.sd.load_diffusion_model_state_dict`` build ComfyUI's own ``MiniMaxH3Model`` from it. Latent
channels (24 video, 32 audio) are the model family's fixed ones. An int8 checkpoint is written in ComfyUI's quantized
format: ``<linear>.weight`` int8, ``<linear>.weight_scale`` fp32, ``<linear>.comfy_quant`` JSON bytes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: Block linears an int8 H3 checkpoint quantizes (the same four as real int8 H3 files).
INT8_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
HIDDEN, HEADS, HEAD_DIM, FFN, TEXT_DIM, T_IN, T_HID, T_DIM, ROPE = 128, 4, 32, 192, 48, 32, 64, 64, 4
#: The width of ComfyUI's ``LotusConditioning`` output: a real node that makes CONDITIONING from no input (H3's own
#: text encoder is a 32B Qwen3-VL, far too big to build for a test), so a graph needs no custom test node.
LOTUS_TEXT_DIM = 1024
PACK_NAME = "h3_multistream_async"


@dataclass(frozen=True)
class Dims:
    """The block-stack shape of a generated H3 (everything outside the blocks stays tiny)."""

    hidden: int = HIDDEN
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    ffn: int = FFN
    t_dim: int = T_DIM
    rope: int = ROPE


#: The real H3 block stack (5376 wide, 56 heads x 128, MLP 14336), for the node-level GPU benchmark.
FULL = Dims(hidden=5376, heads=56, head_dim=128, ffn=14336, t_dim=2688, rope=16)


def _block(r: Callable[..., torch.Tensor], prefix: str, with_adaln: bool, d: Dims) -> dict[str, torch.Tensor]:
    sd = {
        "norm1.weight": 1 + r(d.hidden), "norm2.weight": 1 + r(d.hidden),
        "attn.qkv_proj.weight": r(3 * d.heads * d.head_dim, d.hidden),
        "attn.q_norm.weight": 1 + r(d.head_dim), "attn.k_norm.weight": 1 + r(d.head_dim),
        "attn.out_proj.weight": r(d.hidden, d.heads * d.head_dim),
        "mlp.fc1.weight": r(2 * d.ffn, d.hidden), "mlp.fc2.weight": r(d.hidden, d.ffn),
    }
    if with_adaln:
        sd["adaln_proj.linear.weight"] = r(6 * d.hidden * 3, d.t_dim)
        sd["adaln_proj.linear.bias"] = r(6 * d.hidden * 3)
    return {prefix + k: v for k, v in sd.items()}


def state_dict(layers: int = 3, dtype: torch.dtype = torch.float32, int8: bool = False, seed: int = 0,
               text_dim: int = TEXT_DIM, dims: Dims = Dims(), device: str = "cpu", scale_2d: bool = False
               ) -> dict[str, torch.Tensor]:
    """A tiny H3 state dict with ComfyUI's key names (``dtype``: float weights; ``int8``: block linears quantized;
    ``text_dim``: the conditioning width ComfyUI reads from ``condition_proj``, e.g. :data:`LOTUS_TEXT_DIM`;
    ``dims``: the block stack's shape, e.g. :data:`FULL`; ``device``: where the random numbers are drawn, e.g.
    ``cuda`` for full width; ``scale_2d``: int8 row scales as ``[N, 1]``, the shape kitchen's eager dequantize takes,
    which ComfyUI's cast runs on a patched int8 layer; otherwise ``[N]``). Tensors come back on the CPU. Each block
    is converted as soon as it is drawn, so a full-width stack never exists in fp32 at once."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape: int, s: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * s).cpu()

    d = dims
    sd: dict[str, torch.Tensor] = {
        "video_patch_proj.weight": r(d.hidden, 96), "video_patch_proj.bias": r(d.hidden),
        "audio_patch_proj.weight": r(d.hidden, 32), "audio_patch_proj.bias": r(d.hidden),
        "condition_proj.weight": r(d.hidden, text_dim), "condition_proj.bias": r(d.hidden),
        "time_embedder.proj_in.weight": r(T_HID, T_IN), "time_embedder.proj_in.bias": r(T_HID),
        "time_embedder.proj_out.weight": r(d.t_dim, T_HID), "time_embedder.proj_out.bias": r(d.t_dim),
        "rope.inv_freq": 1.0 / (100.0 ** (torch.arange(d.rope, dtype=torch.float32) / d.rope)),
        "token_refiner.final_norm.weight": 1 + r(d.hidden),
        "final_layer.norm.weight": 1 + r(d.hidden),
        "final_layer.adaln_proj.linear.weight": r(2 * d.hidden, d.t_dim),
        "final_layer.adaln_proj.linear.bias": r(2 * d.hidden),
        "final_layer.video_out.weight": r(96, d.hidden), "final_layer.video_out.bias": r(96),
        "final_layer.audio_out.weight": r(32, d.hidden), "final_layer.audio_out.bias": r(32),
    }
    sd.update(_block(r, "token_refiner.blocks.0.", False, d))
    fp32_islands = ("video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer.video_out",
                    "final_layer.audio_out", "rope.")
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode("utf-8")), dtype=torch.uint8)

    def converted(part: dict[str, torch.Tensor], quantized: str | None) -> dict[str, torch.Tensor]:
        out = {k: v if k.startswith(fp32_islands) else v.to(dtype) for k, v in part.items()}
        for lin in INT8_LINEARS if quantized is not None else ():
            key = f"{quantized}{lin}"
            w = part[f"{key}.weight"].float()
            scale = w.abs().amax(dim=1) / 127.0
            out[f"{key}.weight"] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            out[f"{key}.weight_scale"] = scale.float().reshape((-1, 1) if scale_2d else (-1,))
            out[f"{key}.comfy_quant"] = conf.clone()
        return out

    out = converted(sd, None)
    for i in range(layers):
        prefix = f"blocks.{i}."
        out.update(converted(_block(r, prefix, True, d), prefix if int8 else None))
    return out


def write_checkpoint(path: str, **kwargs: Any) -> str:
    """Write :func:`state_dict` as ``.safetensors`` at ``path``; returns ``path``."""
    import safetensors.torch
    safetensors.torch.save_file(state_dict(**kwargs), path)
    return path


def lora_state_dict(layers: int, rank: int = 4, seed: int = 7, blocks: tuple[int, ...] | None = None,
                    dims: Dims = Dims()) -> dict[str, torch.Tensor]:
    """A LoRA on the blocks' qkv and fc1 in ComfyUI's ``diffusion_model.<key>.lora_{down,up}`` form, for a block stack
    of shape ``dims``."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    d = dims
    for i in (range(layers) if blocks is None else blocks):
        for lin, (n_out, n_in) in (("attn.qkv_proj", (3 * d.heads * d.head_dim, d.hidden)),
                                   ("mlp.fc1", (2 * d.ffn, d.hidden))):
            base = f"diffusion_model.blocks.{i}.{lin}"
            sd[f"{base}.lora_down.weight"] = torch.randn(rank, n_in, generator=g) * 0.1
            sd[f"{base}.lora_up.weight"] = torch.randn(n_out, rank, generator=g) * 0.1
    return sd


def inputs(seed: int = 3, text_len: int = 9, width: int = 64, height: int = 64, length: int = 5) -> tuple:
    """``(positive, negative, latent)`` for one H3 sampling run: random text states, an empty AV latent."""
    import comfy.nested_tensor
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV
    g = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, text_len, TEXT_DIM, generator=g), {}]]
    neg = [[torch.randn(1, text_len, TEXT_DIM, generator=g), {}]]
    latent = EmptyMiniMaxH3LatentAV.execute(width, height, length).result[0]
    assert isinstance(latent["samples"], comfy.nested_tensor.NestedTensor)
    return pos, neg, latent


def ksample(model: Any, steps: int = 2, seed: int = 5, cfg: float = 2.0, **input_kwargs: Any) -> list[torch.Tensor]:
    """``nodes.common_ksampler`` as KSampler runs it; returns the sampled streams (video, audio) on the CPU."""
    import nodes
    pos, neg, latent = inputs(**input_kwargs)
    with torch.inference_mode():
        out = nodes.common_ksampler(model, seed, steps, cfg, "euler", "simple", pos, neg, latent, denoise=1.0)[0]
    return [t.detach().cpu().clone() for t in out["samples"].unbind()]


def length_for_tokens(tokens: int, width: int, height: int, text_len: int) -> int:
    """The smallest video length on H3's 17k+5 frame grid whose packed sequence (text, video, audio) at
    ``width`` x ``height`` has at least ``tokens`` tokens."""
    from comfy_extras.nodes_minimax_h3 import temporal_shape
    length = 5
    while True:
        _, lat_t, audio_t = temporal_shape(length)
        if text_len + lat_t * (height // 32) * (width // 32) + audio_t >= tokens:
            return length
        length += 17


class BlockStackTimer:
    """Each model call's block-stack seconds (``times``), taken between two forward hooks on ComfyUI's own modules:
    after ``time_embedder``, the last module before the block loop, and before ``final_layer``; each syncs a CUDA
    device first."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def attach(self, patcher: Any) -> None:
        dm = patcher.get_model_object("diffusion_model")
        dm.time_embedder.register_forward_hook(self._start)
        dm.final_layer.register_forward_pre_hook(self._stop)

    @staticmethod
    def _now() -> float:
        import time
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _start(self, module: Any, args: Any, out: Any) -> None:
        self._t0 = self._now()

    def _stop(self, module: Any, args: Any) -> None:
        self.times.append(self._now() - self._t0)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    """(bit-identical, max abs difference) of two lists of streams."""
    eq = len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    diff = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)), default=0.0) \
        if len(a) == len(b) else float("inf")
    return eq, diff


def checkpoint_dir() -> str:
    """ComfyUI's ``diffusion_models`` folder (UNETLoader lists files there)."""
    import folder_paths
    d = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(d, exist_ok=True)
    return d


def load(name: str, dtype: torch.dtype | None = None) -> Any:
    """``UNETLoader`` on ``diffusion_models/<name>`` (``dtype``: ComfyUI's ``model_options`` weight dtype instead),
    under ``torch.inference_mode()`` as ComfyUI's executor runs loaders."""
    import comfy.sd
    import folder_paths
    import nodes
    with torch.inference_mode():
        if dtype is None:
            return nodes.UNETLoader().load_unet(name, "default")[0]
        return comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", name),
                                             model_options={"dtype": dtype})


def start(extras: tuple[str, ...] = ("nodes_minimax_h3.py",), server: bool = True) -> Any:
    """ComfyUI's start-up as far as the tests need it: a real ``server.PromptServer`` on a new event loop (so the
    pack registers its routes, as under ``main.py``), then ComfyUI's own loader (``nodes.load_custom_node``) on the
    named ``comfy_extras`` files and on the pack in ``custom_nodes/``. Loading only the extras a test uses keeps a
    process start ~10 s shorter than ``init_extra_nodes``. Returns the PromptServer (None with ``server=False``)."""
    import asyncio

    import folder_paths
    import nodes
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    instance = None
    if server:
        import server as comfy_server
        instance = comfy_server.PromptServer(loop)
        instance.last_prompt_id = None  # what ComfyUI's progress hook reads when nodes are called directly
    extras_dir = os.path.join(os.path.dirname(os.path.realpath(nodes.__file__)), "comfy_extras")
    for name in extras:
        if not loop.run_until_complete(nodes.load_custom_node(os.path.join(extras_dir, name),
                                                              module_parent="comfy_extras")):
            raise RuntimeError(f"ComfyUI could not load comfy_extras/{name}")
    pack = os.path.join(folder_paths.get_folder_paths("custom_nodes")[0], PACK_NAME)
    if not loop.run_until_complete(nodes.load_custom_node(pack)) or "H3MultiStreamAsync" not in \
            nodes.NODE_CLASS_MAPPINGS:
        raise RuntimeError(f"ComfyUI's loader did not load the pack from {pack}")
    return instance


def pack_module(name: str) -> Any:
    """The pack's module ``name`` (e.g. ``nodes.model_wrapper``) as ComfyUI's loader loaded it: under the package
    name the loader gave the pack's folder (its path, dots escaped), never as top-level ``nodes`` (ComfyUI's own)."""
    import importlib
    import sys
    init = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "__init__.py"))
    pack = next((n for n, m in list(sys.modules.items())
                 if os.path.realpath(getattr(m, "__file__", None) or "/") == init), None)
    if pack is None:
        raise RuntimeError("the pack is not loaded: call start() first")
    return importlib.import_module(f"{pack}.{name}")


def model(layers: int = 3, dtype: torch.dtype = torch.float32, int8: bool = False, seed: int = 0,
          weight_dtype: torch.dtype | None = None) -> Any:
    """A tiny H3 ``ModelPatcher`` straight from a state dict (``comfy.sd.load_diffusion_model_state_dict``), under
    ``torch.inference_mode()``; ``weight_dtype``: ComfyUI's ``model_options`` dtype."""
    import comfy.sd
    options = {"dtype": weight_dtype} if weight_dtype is not None else {}
    with torch.inference_mode():
        return comfy.sd.load_diffusion_model_state_dict(state_dict(layers, dtype, int8, seed), model_options=options)
