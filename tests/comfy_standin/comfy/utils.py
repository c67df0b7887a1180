"""Stand-in for ``comfy.utils.get_attr`` (dotted attribute lookup, used by ModelPatcher.get_model_object)."""
from __future__ import annotations

from typing import Any


def get_attr(obj: Any, name: str) -> Any:
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
