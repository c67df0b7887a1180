"""The **H3 MS Sparse Attention** node: sparse attention settings for H3 MultiStream's
``sparse_attention`` input (validated here, in the core's ``SparseSettings``; run on the ranks by
``workers.dit.sparse``)."""

from __future__ import annotations

from typing import Any

from h3ms_async.log import get_logger

log = get_logger("Sparse")

#: The type of the node's output and of H3 MultiStream's optional input.
SPARSE_TYPE = "H3MS_SPARSE_ATTENTION"


class H3MSSparseAttentionAsync:
    CATEGORY = "advanced/model"
    RETURN_TYPES = (SPARSE_TYPE,)
    RETURN_NAMES = ("sparse_attention",)
    FUNCTION = "build"
    DESCRIPTION = (
        "Sparse attention for H3 MultiStream (connect to its sparse_attention input): "
        "comfy-kitchen's Sol-Attn kernels, each rank over its own attention heads, so the split "
        "gives exactly what the same sparse attention gives on one GPU (sparse attention itself "
        "differs from dense attention). Long sequences get faster; outside start/end_percent, in "
        "dense_blocks and under min_tokens attention stays dense. Needs CUDA GPUs of SM 8.0 or "
        "newer and a bfloat16 model; elsewhere attention stays dense, with one log line. Use this "
        "instead of ComfyUI's Model Sparse Attention, which H3 MultiStream refuses."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "method": (
                    ["sol-attn", "top-k"],
                    {
                        "default": "sol-attn",
                        "tooltip": "sol-attn: a training-free adaptive threshold per head and "
                        "query block (tau). top-k: each query block keeps a fixed share of its "
                        "highest-scoring key blocks (keep_percent; the selection SLA-style LoRAs "
                        "are distilled against). VSA is not offered.",
                    },
                ),
                "tau": (
                    "FLOAT",
                    {
                        "default": 1.3,
                        "min": 0.0,
                        "max": 4.0,
                        "step": 0.05,
                        "tooltip": "sol-attn threshold in score-distribution sigmas; higher is "
                        "sparser: 1.0 keeps ~16% of key blocks exact, 1.5 ~7%, 2.0 ~2.7%. Ignored "
                        "by top-k.",
                    },
                ),
                "keep_percent": (
                    "FLOAT",
                    {
                        "default": 10.0,
                        "min": 0.5,
                        "max": 95.0,
                        "step": 0.5,
                        "tooltip": "top-k: percent of key blocks each query block keeps exactly "
                        "(sinks ride on top). Ignored by sol-attn.",
                    },
                ),
                "start_percent": (
                    "FLOAT",
                    {
                        "default": 0.2,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.01,
                        "tooltip": "Point of the sampling schedule where sparse attention begins; "
                        "earlier steps stay dense.",
                    },
                ),
                "end_percent": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.01,
                        "tooltip": "Point of the schedule where sparse attention ends; later steps "
                        "are dense again.",
                    },
                ),
            },
            "optional": {
                "dense_blocks": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Transformer blocks that always run dense, e.g. '0, 1, 47-49' "
                        "(H3 has blocks 0-49).",
                    },
                ),
                "min_tokens": (
                    "INT",
                    {
                        "default": 12288,
                        "min": 0,
                        "max": 1 << 20,
                        "step": 512,
                        "tooltip": "Sequences shorter than this stay dense (short sequences are "
                        "usually faster dense).",
                    },
                ),
                "extra_tokens": (
                    "INT",
                    {
                        "default": 256,
                        "min": 0,
                        "max": 256,
                        "step": 64,
                        "tooltip": "Extra top-scoring tokens each query block attends beyond its "
                        "selected blocks (64-token tiles): closer to dense for more attention "
                        "time; 0 turns it off.",
                    },
                ),
                "sink_conditioning": (
                    ["exact_kv_and_rows", "exact_kv", "off"],
                    {
                        "default": "exact_kv_and_rows",
                        "tooltip": "exact_kv: every query attends H3's packed text, keyframe and "
                        "audio rows exactly (~3% cost). exact_kv_and_rows: also runs the "
                        "target-audio query rows dense (keeps generated audio intact). off: no "
                        "sinks.",
                    },
                ),
            },
        }

    def build(
        self,
        method: str,
        tau: float,
        keep_percent: float,
        start_percent: float,
        end_percent: float,
        dense_blocks: str = "",
        min_tokens: int = 12288,
        extra_tokens: int = 256,
        sink_conditioning: str = "exact_kv_and_rows",
    ) -> tuple[Any]:
        from h3ms_async.dit.sparse import SparseSettings

        settings = SparseSettings(
            method=method,
            tau=float(tau),
            keep_percent=float(keep_percent),
            start_percent=float(start_percent),
            end_percent=float(end_percent),
            dense_blocks=str(dense_blocks),
            min_tokens=int(min_tokens),
            extra_tokens=int(extra_tokens),
            sink_conditioning=sink_conditioning,
        )
        log.info("sparse attention settings: %s", settings.describe())
        return (settings,)
