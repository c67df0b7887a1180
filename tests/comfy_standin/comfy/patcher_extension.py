"""Stand-in for ``comfy.patcher_extension`` (facts: h3_dit_facts §3.2).

Wrappers live in ``{wrapper_type: {key: [fn, ...]}}``; ``get_all_wrappers`` concatenates the lists in key-insertion
order; a ``WrapperExecutor`` calls ``wrapper(executor, *args, **kwargs)`` and the last executor calls the original.
"""
from __future__ import annotations

from typing import Any, Callable


class WrappersMP:
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"


class CallbacksMP:
    ON_CLONE = "on_clone"
    ON_PRE_RUN = "on_pre_run"
    ON_CLEANUP = "on_cleanup"


def copy_nested_dicts(value: dict) -> dict:
    """Dicts copied recursively, lists shallow-copied (the shape ``prepare_model_patcher`` relies on)."""
    out = dict(value)
    for k, v in value.items():
        if isinstance(v, dict):
            out[k] = copy_nested_dicts(v)
        elif isinstance(v, list):
            out[k] = list(v)
    return out


def get_all_wrappers(wrapper_type: str, transformer_options: dict) -> list[Callable]:
    found: list[Callable] = []
    for fns in transformer_options.get("wrappers", {}).get(wrapper_type, {}).values():
        found.extend(fns)
    return found


class WrapperExecutor:
    """Calls wrapper ``idx`` with itself as the first argument; the executor past the last wrapper calls the original."""

    def __init__(self, original: Callable, class_obj: Any, wrappers: list[Callable], idx: int):
        self.original = original
        self.class_obj = class_obj  # wrappers reach the MiniMaxH3Model through this (facts §3.2)
        self.wrappers = list(wrappers)
        self.idx = idx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(*args, **kwargs)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)

    @classmethod
    def new_class_executor(cls, original: Callable, class_obj: Any, wrappers: list[Callable], idx: int = 0):
        return cls(original, class_obj, wrappers, idx)
