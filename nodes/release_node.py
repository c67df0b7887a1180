"""The **H3 MS Release Resources** output node, and the detach action it adds to the core release actions
(``h3ms_async.http_routes``) that the menu and HTTP routes share."""
from __future__ import annotations

from h3ms_async.http_routes import action_clear_weights, action_release_workers
from h3ms_async.log import get_logger

from .model_adapter import detach_all

log = get_logger("Release")


def action_detach_hooks() -> dict:
    """Make every installed split run unsplit until its H3 MultiStream node runs again."""
    n = detach_all()
    return {"message": f"detached {n} split wrapper(s); re-run H3 MultiStream to attach again"}


class H3MSReleaseResourcesAsync:
    CATEGORY = "advanced/model"
    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True
    DESCRIPTION = ("Frees what H3 MultiStream holds, from inside a workflow (the same actions are in the menu and "
                   "on POST /h3multistream/...). Runs every time it is queued.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "release_workers": ("BOOLEAN", {"default": True, "tooltip": "Stop the split's worker processes "
                                    "(their VRAM is freed)."}),
                "clear_weight_store": ("BOOLEAN", {"default": False, "tooltip": "Drop the shared-memory copy of the "
                                       "block weights (RAM is freed; the workers stay up and the next run "
                                       "refills it)."}),
                "detach_hooks": ("BOOLEAN", {"default": False, "tooltip": "Make models already patched by H3 "
                                 "MultiStream run unsplit until the node runs again."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **kwargs) -> float:
        return float("nan")  # never equal to itself, so ComfyUI never serves this node from its cache

    def run(self, release_workers: bool, clear_weight_store: bool, detach_hooks: bool) -> dict:
        lines = []
        if detach_hooks:
            lines.append(action_detach_hooks()["message"])
        if clear_weight_store:  # before the release, which drops the store with the workers anyway
            lines.append(action_clear_weights()["message"])
        if release_workers:
            lines.append(action_release_workers()["message"])
        if not lines:
            lines.append("nothing selected")
        from h3ms_async.status import ram_info
        lines.append(ram_info()["text"])
        log.info(" | ".join(lines))
        return {"ui": {"text": lines}}
