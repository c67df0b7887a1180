"""A real SD1-type CLIP (ComfyUI's tokenizer and encoder classes) shrunk to 2 layers of 64 with seeded random
weights, for the scripts that run inside the ComfyUI tree (``comfy_tree.run_comfy_script``; they put this folder on
``sys.path`` from ``$H3MS_TESTS_DIR``)."""
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

    config = json.load(open("comfy/sd1_clip_config.json"))
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  projection_dim=64)
    config_path = os.path.join(tmp_dir, "small_clip.json")
    with open(config_path, "w") as f:
        json.dump(config, f)

    class SmallClip(comfy.sd1_clip.SDClipModel):
        def __init__(self, device: Any = "cpu", dtype: Any = None, model_options: dict = {}) -> None:
            super().__init__(device=device, dtype=dtype, model_options=model_options,
                             textmodel_json_config=config_path, return_projected_pooled=False)

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    clip = comfy.sd.CLIP(target, model_options={"clip_l_class": SmallClip})
    # Weights go in as a checkpoint's do (CLIP.load_sd): under DynamicVRAM the parameters are placeholders until a
    # state dict is assigned to them, so writing into them in place would leave the model without weights.
    gen = torch.Generator().manual_seed(seed)
    sd = {name: (torch.randn(p.shape, generator=gen) * 0.02
                 + (1.0 if name.endswith("layer_norm1.weight") else 0.0)).to(p.dtype)
          for name, p in sorted(clip.cond_stage_model.named_parameters())}
    clip.load_sd(sd, full_model=True)
    return clip
