"""A real SD1-type CLIP (ComfyUI's tokenizer and encoder classes) shrunk to 2 layers of CLIP-L's width, with seeded
random weights loaded as a checkpoint, for the scripts that run inside the ComfyUI tree
(``comfy_tree.run_comfy_script``; they put this folder on ``sys.path`` from ``$H3MS_TESTS_DIR``)."""
from __future__ import annotations

import json
import os
from typing import Any

import torch


def small_clip(tmp_dir: str, seed: int = 3) -> Any:
    """A ``comfy.sd.CLIP`` built by ComfyUI (its patcher class is whatever ComfyUI's start-up chose)."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.supported_models_base
    import comfy.utils
    import safetensors.torch

    config = json.load(open("comfy/sd1_clip_config.json"))
    # CLIP-L's width with 2 layers: at a toy width (64) plain ComfyUI's own encode under DynamicVRAM fails on the
    # H200 (fc1 gets a [64, 128] weight: "mat1 and mat2 shapes cannot be multiplied (77x64 and 128x64)", before any
    # H3 MS hook is attached), a geometry no real text encoder has
    config.update(num_hidden_layers=2)
    config_path = os.path.join(tmp_dir, "small_clip.json")
    with open(config_path, "w") as f:
        json.dump(config, f)

    class SmallClip(comfy.sd1_clip.SDClipModel):
        def __init__(self, device: Any = "cpu", dtype: Any = None, model_options: dict = {}) -> None:
            super().__init__(device=device, dtype=dtype, model_options=model_options,
                             textmodel_json_config=config_path, return_projected_pooled=False)

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    # Shapes come from a throw-away instance on the meta device; the weights then travel as a text-encoder checkpoint
    # does (a safetensors file read by comfy.utils.load_torch_file, handed to comfy.sd.CLIP as a state dict list), so
    # the CLIP is built on ComfyUI's own loading path, DynamicVRAM's file-backed weights included.
    with torch.device("meta"):
        shapes = SmallClip(device="meta", dtype=torch.float32).transformer.state_dict()
    gen = torch.Generator().manual_seed(seed)
    sd = {name: (torch.randn(t.shape, generator=gen) * 0.02
                 + (1.0 if name.endswith("layer_norm1.weight") else 0.0)).to(torch.float16)
          for name, t in sorted(shapes.items()) if t.is_floating_point()}
    path = os.path.join(tmp_dir, "small_clip.safetensors")
    safetensors.torch.save_file(sd, path)
    return comfy.sd.CLIP(target, state_dict=[comfy.utils.load_torch_file(path, safe_load=True)],
                         parameters=sum(t.numel() for t in sd.values()), model_options={"clip_l_class": SmallClip})


def clip_l_files(tmp_dir: str, seed: int = 5) -> dict[str, str]:
    """A full-size CLIP-L text encoder file (every weight present, seeded random, fp16: what ``CLIPLoader`` reads
    as a complete ``stable_diffusion`` CLIP) and two LoRA files in ComfyUI's ``lora_te_`` / ``lora_unet_`` naming:
    one on the encoder's attention and MLP, one for a diffusion model only.  Returns their paths by name."""
    import comfy.sd1_clip
    import safetensors.torch

    with torch.device("meta"):
        shapes = comfy.sd1_clip.SDClipModel(device="meta", dtype=torch.float32).transformer.state_dict()
    gen = torch.Generator().manual_seed(seed)
    sd = {name: (torch.randn(t.shape, generator=gen) * 0.02
                 + (1.0 if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "final_layer_norm.weight"))
                    else 0.0)).to(torch.float16)
          for name, t in sorted(shapes.items()) if t.is_floating_point()}
    paths = {"clip": os.path.join(tmp_dir, "clip_l_small_test.safetensors")}
    safetensors.torch.save_file(sd, paths["clip"])

    def lora(keys: list[str], dims: tuple[int, int]) -> dict[str, torch.Tensor]:
        out = {}
        for k in keys:
            out[f"{k}.lora_up.weight"] = torch.randn(dims[0], 4, generator=gen) * 0.2
            out[f"{k}.lora_down.weight"] = torch.randn(4, dims[1], generator=gen) * 0.2
            out[f"{k}.alpha"] = torch.tensor(4.0)
        return out

    te = [f"lora_te_text_model_encoder_layers_{b}_self_attn_{p}" for b in range(3) for p in ("q_proj", "v_proj")]
    paths["lora"] = os.path.join(tmp_dir, "te_lora_test.safetensors")
    safetensors.torch.save_file(lora(te, (768, 768)), paths["lora"])
    paths["unet_lora"] = os.path.join(tmp_dir, "unet_only_lora_test.safetensors")
    safetensors.torch.save_file(lora(["lora_unet_down_blocks_0_attentions_0_proj_in"], (320, 320)),
                                paths["unet_lora"])
    return paths
