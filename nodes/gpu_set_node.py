"""The **H3 MS GPU Set** node: which GPUs the split uses (validated right away,
``docs/comfyui_facts.md`` §7)."""

from __future__ import annotations

from typing import Any

from h3ms_async.log import get_logger

log = get_logger("GPUs")

MAX_GPUS = 8


class H3MSGPUSetAsync:
    CATEGORY = "advanced/model"
    RETURN_TYPES = ("H3MS_GPUS",)
    RETURN_NAMES = ("gpus",)
    FUNCTION = "build"
    DESCRIPTION = (
        "Selects the GPUs for the nodes with a gpus input: H3 MultiStream, H3 MS VAE Split Decode "
        "and H3 Attention Parallel. Without it each of them uses every visible GPU (or its own "
        "legacy second_gpu input). The GPU of the model (of the VAE, for the VAE split) always "
        "takes part, as rank 0."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "gpus": (
                    "STRING",
                    {
                        "default": "auto",
                        "tooltip": "auto = every visible CUDA GPU; otherwise a list such as 0,1,3. "
                        "The model's GPU is always rank 0, the others follow in this order.",
                    },
                ),
                "exclude": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "GPUs to leave out, e.g. a card reserved for another service.",
                    },
                ),
                "shares": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Optional relative speed per selected GPU, in the order of gpus "
                        "(or by index for auto), e.g. 1,1,0.7. Sizes each rank's tokens and heads.",
                    },
                ),
                "min_free_vram_gb": (
                    "FLOAT",
                    {
                        "default": 0.0,
                        "min": 0.0,
                        "max": 1024.0,
                        "step": 0.5,
                        "tooltip": "Skip GPUs with less free VRAM than this when the plan is made "
                        "(the model's GPU is never skipped). 0 = no check.",
                    },
                ),
                "max_gpus": (
                    "INT",
                    {
                        "default": MAX_GPUS,
                        "min": 1,
                        "max": MAX_GPUS,
                        "tooltip": "Upper limit on the GPUs used; 1 runs unsplit.",
                    },
                ),
            },
        }

    def build(
        self, gpus: str, exclude: str, shares: str, min_free_vram_gb: float, max_gpus: int
    ) -> tuple[Any]:
        from h3ms_async.runtime.plans import GPUSet

        gpu_set = GPUSet.parse(gpus, exclude, shares, float(min_free_vram_gb), int(max_gpus))
        log.info("GPU set: %s", gpu_set.describe())
        return (gpu_set,)
