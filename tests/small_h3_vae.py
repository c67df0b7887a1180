"""Small random H3 video and audio VAE state dicts with ComfyUI's real key names, for the scripts and servers that
run inside the ComfyUI tree (``comfy_tree.run_comfy_script``; they put this folder on ``sys.path`` from
``$H3MS_TESTS_DIR``). ComfyUI builds both VAEs with their constructors' size defaults; :func:`shrink_h3_vae_classes`
makes those defaults small, in whichever process then builds or loads one."""
from __future__ import annotations

import contextlib

import torch

#: Audio VAE sizes: encoder width, latent width (8 heads), decoder width (halved by each of its 7 upsamplings).
AUDIO_ENCODER_DIM, AUDIO_LATENT_DIM, AUDIO_DECODER_DIM = 8, 64, 128


def shrink_h3_vae_classes() -> None:
    """Shrink ComfyUI's H3 video VAE (``ch``, ``ch_mult``, ``num_res_blocks``; its ViT decoder's layers and heads)
    and audio VAE (encoder, latent and decoder widths) constructor defaults; idempotent."""
    import comfy.ldm.minimax.audio_vae as A
    import comfy.ldm.minimax.vae as V

    defaults = list(V.MiniMaxH3VideoVAE.__init__.__defaults__)
    defaults[2], defaults[5], defaults[6] = 32, (1,) * 6, 1  # ch, ch_mult, num_res_blocks
    V.MiniMaxH3VideoVAE.__init__.__defaults__ = tuple(defaults)
    defaults = list(V.ViT3DDecoder.__init__.__defaults__)
    defaults[4], defaults[5] = 2, 2  # num_layers, heads
    V.ViT3DDecoder.__init__.__defaults__ = tuple(defaults)
    defaults = list(A.MiniMaxH3AudioVAE.__init__.__defaults__)
    defaults[0], defaults[2], defaults[3] = AUDIO_ENCODER_DIM, AUDIO_LATENT_DIM, AUDIO_DECODER_DIM
    A.MiniMaxH3AudioVAE.__init__.__defaults__ = tuple(defaults)


@contextlib.contextmanager
def eager_comfy_ops():
    """ComfyUI's ops with their weights allocated at construction: under DynamicVRAM (comfy-aimdo on) a
    ``Linear`` leaves its weight ``None`` until a state dict is loaded, so the template would lack those keys."""
    import comfy.memory_management as mm

    before = mm.aimdo_enabled
    mm.aimdo_enabled = False
    try:
        yield
    finally:
        mm.aimdo_enabled = before


def _random_like(module: torch.nn.Module, seed: int, ones: tuple[str, ...], unit_stats: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Seeded random weights for every key of ``module``; names ending in ``ones`` around 1; the latent statistics
    as the module initialises them, or mean 0 / std 1 (``unit_stats``: the module leaves them uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in sorted(module.state_dict().items()):
        if name in ("latents_mean", "latents_std"):
            sd[name] = (torch.zeros(t.shape) if name == "latents_mean" else torch.ones(t.shape)) if unit_stats \
                else t.clone()
            continue
        x = torch.randn(t.shape, generator=gen) * 0.05
        sd[name] = x + 1 if name.endswith(ones) else x
    return sd


def small_h3_vae_state_dict(seed: int = 4321) -> dict[str, torch.Tensor]:
    """A small H3 video VAE (see :func:`shrink_h3_vae_classes`)."""
    import comfy.ldm.minimax.vae as V

    shrink_h3_vae_classes()
    with eager_comfy_ops():
        module = V.MiniMaxH3VideoVAE()
    return _random_like(module, seed, ("norm1.weight", "norm2.weight", "norm_out.weight"))


def small_h3_audio_vae_state_dict(seed: int = 4322) -> dict[str, torch.Tensor]:
    """A small H3 audio VAE (see :func:`shrink_h3_vae_classes`)."""
    import comfy.ldm.minimax.audio_vae as A

    shrink_h3_vae_classes()
    with eager_comfy_ops():
        module = A.MiniMaxH3AudioVAE()
    return _random_like(module, seed, (".alpha", "norm.weight"), unit_stats=True)
