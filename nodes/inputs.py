"""Input declarations several nodes share, declared once so their defaults, ranges and wording
cannot drift."""

from __future__ import annotations

import copy
from typing import ClassVar


def enabled_input(tooltip: str) -> tuple:
    """The on/off switch; ``tooltip`` says what off does for that node (and that bypassing is not
    the same)."""
    return ("BOOLEAN", {"default": True, "tooltip": tooltip})


#: One extra GPU by CUDA index: the input saved workflows carry, kept so they load unchanged.
SECOND_GPU_INPUT = (
    "INT",
    {
        "default": -1,
        "min": -1,
        "max": 15,
        "tooltip": "Legacy: CUDA index of one extra GPU; -1 = every visible GPU. Ignored when a "
        "GPU set is connected.",
    },
)


def ram_reserve_input(tooltip: str) -> tuple:
    """The RAM a cache or weight store must leave available; ``tooltip`` says what holds back when
    it is reached."""
    return ("FLOAT", {"default": 0.0, "min": 0.0, "max": 512.0, "step": 0.5, "tooltip": tooltip})


class PatchNode:
    """A node that returns its input patched: entry point ``patch``, inputs declared as data in
    ``INPUTS``."""

    FUNCTION = "patch"
    INPUTS: ClassVar[dict] = {}

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        """ComfyUI's input declaration: a copy of ``INPUTS``, so nothing ComfyUI does to it reaches
        the class."""
        return copy.deepcopy(cls.INPUTS)


class ModelPatchNode(PatchNode):
    """MODEL → MODEL: where the pack's model nodes sit in the menu and what they return."""

    CATEGORY = "advanced/model"
    RETURN_TYPES = ("MODEL",)
