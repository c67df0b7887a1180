"""Recognising ComfyUI's H3 DiT on a ModelPatcher; its block-stack config from the live modules."""

from __future__ import annotations

from typing import Any

H3_CLASS_NAME = "MiniMaxH3Model"


def diffusion_model_of(patcher: Any) -> Any | None:
    """The patcher's diffusion model (object patches honoured), or None when it has none."""
    getter = getattr(patcher, "get_model_object", None)
    if getter is None:
        return None
    try:
        return getter("diffusion_model")
    except (AttributeError, KeyError):
        return None


def is_h3(diffusion_model: Any) -> bool:
    """True for ComfyUI's ``comfy.ldm.minimax.model.MiniMaxH3Model`` (or a subclass); not for
    minimax_music."""
    return any(
        c.__name__ == H3_CLASS_NAME and c.__module__.endswith("minimax.model")
        for c in type(diffusion_model).__mro__
    )


def read_config(dm: Any):
    """The block-stack config, read from the live modules (pruned checkpoints differ)."""
    from h3ms_async.dit.reference import DiTConfig

    b0 = dm.blocks[0]
    head_dim = int(b0.attn.q_norm.weight.shape[0])
    return DiTConfig(
        hidden=int(b0.norm1.weight.shape[0]),
        layers=len(dm.blocks),
        heads=int(getattr(b0.attn, "heads", b0.attn.qkv_proj.weight.shape[0] // (3 * head_dim))),
        head_dim=head_dim,
        ffn=int(b0.mlp.fc1.weight.shape[0] // 2),
        t_dim=int(b0.adaln_proj.linear.weight.shape[1]),
        rope_pairs=3 * int(dm.rope.inv_freq.shape[0]),  # t, h, w (docs/comfyui_facts.md §2.2)
        eps=float(b0.norm1.eps),
    )
