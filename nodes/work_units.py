"""ComfyUI's own MultiGPU CFG Split (its work units) beside the split: refused, in one line.

That node (``comfy_extras/nodes_multigpu.py``, ``MultiGPU_WorkUnits``) loads a whole copy of the
model on each extra GPU (the model's ``"multigpu"`` additional models) and runs the prompt's and the
negative prompt's calls on those copies in threads. The split runs every call on its ranks, on the
same GPUs: the copies would take their VRAM and each copy's call would queue behind the other on
the ranks, so nothing would run faster. Refused where the node runs (ComfyUI's node before ours
in the chain) and where sampling starts (after ours: ComfyUI's node clones the model with our
wrapper on it).
"""

from __future__ import annotations

from typing import Any

from .errors import MultiStreamError

#: ComfyUI's key for the per-GPU model copies of its MultiGPU CFG Split.
MULTIGPU_KEY = "multigpu"


def refuse_work_units(patcher: Any) -> None:
    """Raise when ``patcher`` (a ComfyUI ``ModelPatcher``) carries ComfyUI's MultiGPU CFG Split
    copies (or is one)."""
    copies = patcher.get_additional_models_with_key(MULTIGPU_KEY)
    if not copies and not getattr(patcher, "is_multigpu_base_clone", False):
        return
    where = ", ".join(str(getattr(c, "load_device", "?")) for c in copies) or str(
        getattr(patcher, "load_device", "?")
    )
    raise MultiStreamError(
        f"the model carries ComfyUI's MultiGPU CFG Split (model copies on {where}); it runs the "
        "prompt's and the negative prompt's calls on a model copy per GPU, but H3 MultiStream "
        "runs every call on its own ranks, so the two calls would only queue there while the "
        "copies take memory on those GPUs. Remove the MultiGPU CFG Split node to split each call "
        "over the GPUs, or set H3 MultiStream's enabled=false to keep ComfyUI's node"
    )
