"""A small random H3 video VAE state dict with ComfyUI's real key names, for the scripts that run inside the ComfyUI
tree (``comfy_tree.run_comfy_script``): they put this folder on ``sys.path`` from ``$H3MS_TESTS_DIR``."""
from __future__ import annotations

import torch


def small_h3_vae_state_dict(seed: int = 4321) -> dict[str, torch.Tensor]:
    """Shrink the two H3 VAE constructors' size defaults (as ``comfy.sd.VAE`` builds with them) and return seeded
    random weights for every key; norms around 1, the latent statistics as ComfyUI initialises them."""
    import comfy.ldm.minimax.vae as V

    defaults = list(V.MiniMaxH3VideoVAE.__init__.__defaults__)
    defaults[2], defaults[5], defaults[6] = 32, (1,) * 6, 1  # ch, ch_mult, num_res_blocks
    V.MiniMaxH3VideoVAE.__init__.__defaults__ = tuple(defaults)
    defaults = list(V.ViT3DDecoder.__init__.__defaults__)
    defaults[4], defaults[5] = 2, 2  # num_layers, heads
    V.ViT3DDecoder.__init__.__defaults__ = tuple(defaults)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in sorted(V.MiniMaxH3VideoVAE().state_dict().items()):
        if name in ("latents_mean", "latents_std"):
            sd[name] = t.clone()
            continue
        x = torch.randn(t.shape, generator=gen) * 0.05
        sd[name] = x + 1 if name.endswith(("norm1.weight", "norm2.weight", "norm_out.weight")) else x
    return sd
