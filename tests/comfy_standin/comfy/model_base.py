"""Stand-in for ``comfy.model_base.MiniMaxH3`` (facts §1.1, §2.1): a BaseModel holding ``diffusion_model`` (a
``MiniMaxH3Model``) and ``current_patcher``; ``apply_model`` copies transformer_options, adds
``prefetch_dynamic_vbars`` and calls the diffusion model.  The sigma/latent preparation of ``_apply_model`` is left
out: tests pass the diffusion model's own inputs."""
from __future__ import annotations

import torch

from .ldm.minimax.model import MiniMaxH3Model


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model: torch.nn.Module):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.current_patcher = None
        self.device = torch.device("cpu")

    def apply_model(self, x, timestep, context, transformer_options: dict, **extra):
        to = dict(transformer_options)
        to["prefetch_dynamic_vbars"] = bool(self.current_patcher is not None and self.current_patcher.is_dynamic())
        return self.diffusion_model(x, timestep, context, transformer_options=to, **extra)


class MiniMaxH3(BaseModel):
    def __init__(self, diffusion_model: MiniMaxH3Model):
        super().__init__(diffusion_model)


class OtherModel(BaseModel):
    """Any non-H3 model (e.g. a Flux/SD patcher) for the pass-through test."""
