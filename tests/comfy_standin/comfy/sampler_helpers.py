"""Stand-in for the one step of ``comfy.sampler_helpers.prepare_model_patcher`` the pack depends on (facts §3.2):
the patcher's wrappers are copied (nested dict/list copy) into ``model_options["transformer_options"]["wrappers"]``
at sampling start, and the patcher's ``pre_run`` callbacks fire."""
from __future__ import annotations

from .patcher_extension import copy_nested_dicts


def prepare_model_patcher(model, conds, model_options: dict) -> None:
    model_options["transformer_options"]["wrappers"] = copy_nested_dicts(model.wrappers)
    model.pre_run()
