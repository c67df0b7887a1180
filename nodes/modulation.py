"""The step's adaLN modulation rows, computed once per step in ComfyUI's process with ComfyUI's own
modules, so the ranks and the weight store hold no adaLN weights."""

from __future__ import annotations

from typing import Any

import torch


class BlockModulation:
    """Every block's raw adaLN output for ``t_emb`` [M, t_dim], block by block: :meth:`row` computes
    block i's once (a first prompt's weight-store fill asks for it as it reads block i, so one pass
    over the checkpoint file feeds both), :meth:`stacked` all of them as the step takes them.

    Block i's row is what its ``AdalnProj.forward`` (comfy/ldm/minimax/model.py) computes before
    it views and chunks: the block's own ``adaln_proj.linear`` (ComfyUI's ops: casts, LoRA
    patches, DynamicVRAM) on ``silu(t_emb)``, or on ``t_emb`` where the module's ``apply_silu``
    is off (curve-form checkpoints, fp32 adaLN). The ranks view and chunk it as that forward does
    (``workers.dit.ops.modulation``)."""

    def __init__(self, dm: Any, t_emb: torch.Tensor) -> None:
        self.dm = dm
        self.t_emb = t_emb
        self._silu: torch.Tensor | None = None  # the same input for every block: taken once
        self._rows: dict[int, torch.Tensor] = {}

    def row(self, i: int) -> torch.Tensor:
        """Block i's row [M, 18·hidden] on ComfyUI's device, in the dtype its linear returns."""
        if i not in self._rows:
            proj = self.dm.blocks[i].adaln_proj
            if proj.apply_silu and self._silu is None:
                self._silu = torch.nn.functional.silu(self.t_emb)
            self._rows[i] = proj.linear(self._silu if proj.apply_silu else self.t_emb)
        return self._rows[i]

    def stacked(self) -> torch.Tensor:
        """``[blocks, M, 18·hidden]``: every block's row (the ones not computed yet now)."""
        return torch.stack([self.row(i) for i in range(len(self.dm.blocks))])
