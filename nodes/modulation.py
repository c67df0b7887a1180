"""The step's adaLN modulation rows, computed once per step in ComfyUI's process with ComfyUI's own
modules, so the ranks and the weight store hold no adaLN weights."""

from __future__ import annotations

from typing import Any

import torch


def block_modulation(dm: Any, t_emb: torch.Tensor) -> torch.Tensor:
    """Every block's raw adaLN output for ``t_emb`` [M, t_dim]: ``[blocks, M, 18·hidden]`` on
    ComfyUI's device, in the dtype ComfyUI's linear returns.

    Block i's row is what its ``AdalnProj.forward`` (comfy/ldm/minimax/model.py) computes before
    it views and chunks: the block's own ``adaln_proj.linear`` (ComfyUI's ops: casts, LoRA
    patches, DynamicVRAM) on ``silu(t_emb)``, or on ``t_emb`` where the module's ``apply_silu``
    is off (curve-form checkpoints, fp32 adaLN). The ranks view and chunk it as that forward does
    (``workers.dit.ops.modulation``)."""
    silu = torch.nn.functional.silu(t_emb)  # the same input for every block: taken once
    return torch.stack(
        [b.adaln_proj.linear(silu if b.adaln_proj.apply_silu else t_emb) for b in dm.blocks]
    )
