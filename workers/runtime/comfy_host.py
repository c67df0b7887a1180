"""A rank worker started from inside ComfyUI runs ComfyUI's own attention function, under ComfyUI's
own flags.

ComfyUI picks its attention function once per process from its command line and the machine
(``comfy.ldm.modules.attention.optimized_attention``: sub-quadratic on CPU, SDPA with a backend
priority on NVIDIA, comfy-kitchen INT8 with ``--use-ck-attention``, split / sage / flash / xformers
by flag). The parent sends the function's name, ComfyUI's root and ComfyUI's argv in ``ENV`` (JSON);
the worker imports that ComfyUI with those flags and calls the very function of that name, so the
ranks can never attend with another kernel than ComfyUI. Importing ComfyUI also applies ComfyUI's
own comfy-kitchen backend policy (``comfy.quant_ops``, incl. ``--enable-triton-backend``) in the
worker. Without ``ENV`` (standalone use) the worker applies the pack's copy of that policy
(``dit_ops.apply_kitchen_policy``) and attends with ``dit_ops``' own kernels.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from workers.dit.ops import Attend
from workers.runtime import config

ENV = config.COMFY_HOST.name
#: Attention names the split runs head-split: each is exact per head (no cross-head state).
#: ComfyUI's others (xformers, sage, flash-attn packages, split) are not vetted: the node runs those
#: models unsplit.
HEAD_SPLIT_SAFE = (
    "attention_pytorch",
    "attention_sub_quad",
    "attention_basic",
    "attention_comfy_kitchen_int8",
)


@dataclass(frozen=True)
class ComfyHost:
    """Where the parent ComfyUI lives and how it was started, plus the attention function it
    selected."""

    root: str
    argv: tuple[str, ...]
    attention: str

    def to_env(self) -> dict[str, str]:
        """The worker environment entry that carries this host."""
        return {
            ENV: json.dumps(
                {"root": self.root, "argv": list(self.argv), "attention": self.attention}
            )
        }

    @classmethod
    def from_env(cls) -> ComfyHost | None:
        raw = config.COMFY_HOST.get()
        if not raw:
            return None
        d = json.loads(raw)
        return cls(str(d["root"]), tuple(str(a) for a in d["argv"]), str(d["attention"]))


def _import_comfy(host: ComfyHost) -> Any:
    if not os.path.isfile(os.path.join(host.root, "comfy", "ldm", "modules", "attention.py")):
        raise RuntimeError(
            f"{ENV}: {host.root} is not a ComfyUI root (no comfy/ldm/modules/attention.py); the "
            "parent must send ComfyUI's own root"
        )
    if host.root not in sys.path:
        sys.path.insert(0, host.root)
    # ComfyUI parses sys.argv when comfy.cli_args is first imported (after enable_args_parsing), as
    # main.py does.
    saved = sys.argv
    sys.argv = ["main.py", *host.argv]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.ldm.modules.attention as attention
    finally:
        sys.argv = saved
    return attention


def comfy_attend(host: ComfyHost) -> Attend:
    """The parent's attention function, called exactly as ComfyUI's H3 ``Attention.forward`` calls
    it."""
    attention = _import_comfy(host)
    fn = getattr(attention, host.attention, None)
    if fn is None or not callable(fn):
        raise RuntimeError(
            f"ComfyUI at {host.root} has no attention function {host.attention!r}; the worker and "
            "ComfyUI must come from the same tree"
        )
    container = attention.AttentionTensorContainer

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
        return fn(
            container(q),
            container(k),
            container(v),
            heads,
            mask=None,
            skip_reshape=True,
            transformer_options={},
        ).squeeze(0)

    return attend


def subquad_unchunked(heads: int, tokens: int, element_size: int, free_bytes: int) -> bool:
    """Whether ComfyUI's sub-quadratic attention takes its largest query chunk and one KV chunk for
    this call.

    Its chunk sizes come from free memory (``attention_sub_quad``: the first query chunk in 4096,
    2048, ... whose ``free / (batch*heads * bytes * chunk * 4)`` covers the keys). A rank holds
    fewer heads than the unsplit call, so it needs less memory: when the unsplit call already takes
    the largest chunk, every rank does too and the chunking (hence the rounding) is the same.
    Otherwise the decisions may differ and the step must run unsplit.
    """
    return free_bytes / (heads * element_size * 4096 * 4.0) >= tokens
