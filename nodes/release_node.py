"""The **H3 MS Release Resources** output node, and the release actions it adds to the core ones
(``h3ms_async.observability.routes``: workers, weight store) that the menu and HTTP routes share."""

from __future__ import annotations

from h3ms_async.log import get_logger
from h3ms_async.observability.routes import (
    action_clear_text_cache,
    action_clear_weights,
    action_release_workers,
)

from . import method_hooks
from .model_wrapper import detach_all

log = get_logger("Release")


def action_detach_hooks() -> dict:
    """Make every installed split run unsplit until its H3 MultiStream node runs again, and remove
    the VAE split, VAE cache and text-encoder cache hooks."""
    n = detach_all()
    hooks, kept = method_hooks.detach_all()
    msg = (
        f"detached {n} split wrapper(s) and {hooks} VAE/text-encoder hook(s); re-run the nodes to "
        "attach again"
    )
    if kept:
        msg += f"; {kept} hook(s) kept: another wrapper sits on top of them (see the log)"
    return {"message": msg}


def action_release_vae_workers() -> dict:
    """Stop the VAE split's worker processes, unless a decode is running (they restart at the next
    decode)."""
    from h3ms_async.vae.split import release_vae_engines

    released, busy = release_vae_engines()
    if busy:
        return {
            "message": f"VAE workers busy decoding: {busy} engine(s) kept, {released} released",
            "busy": True,
        }
    return {
        "message": f"VAE workers released ({released} engine(s))"
        if released
        else "no VAE workers were running",
        "busy": False,
    }


class H3MSReleaseResourcesAsync:
    CATEGORY = "advanced/model"
    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True
    DESCRIPTION = (
        "Frees what H3 MultiStream holds, from inside a workflow (the same actions are in the menu "
        "and on POST /h3multistream/...). Runs every time it is queued and shows what each action "
        "gave back: RAM freed, pinned memory returned, and what stays in RAM because a model still "
        "uses it."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "release_workers": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "Stop every H3 MultiStream worker process: the split's, the "
                        "attention helpers' and the VAE split's (their VRAM is freed).",
                    },
                ),
                "clear_weight_store": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Drop the shared-memory copy of the block weights and the "
                        "weight copies of the VAE Cache and Text Encoder Cache (the workers stay "
                        "up; the next run refills them). A cache copy's RAM is freed only while "
                        "ComfyUI has that model loaded: while it is unloaded the copy is its host "
                        "weights and stays with it (unpinned). The result says how much RAM was "
                        "freed and how much was kept.",
                    },
                ),
                "detach_hooks": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Make models already patched by H3 MultiStream run unsplit "
                        "until the node runs again, and remove the VAE split, VAE cache and "
                        "text-encoder cache hooks.",
                    },
                ),
            },
            # optional, so a workflow saved without them validates (ComfyUI refuses a graph that
            # lacks a required input) and runs with these defaults
            "optional": {
                "release_vae_workers": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "Stop the VAE split's worker processes (refused while a decode "
                        "runs; they restart at the next one).",
                    },
                ),
                "clear_text_cache": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Drop the cached text-encoder outputs (the cache's own copies: "
                        "their RAM is freed; the result says how much).",
                    },
                ),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **kwargs) -> float:
        return float(
            "nan"
        )  # never equal to itself, so ComfyUI never serves this node from its cache

    def run(
        self,
        release_workers: bool,
        clear_weight_store: bool,
        detach_hooks: bool,
        release_vae_workers: bool = True,
        clear_text_cache: bool = False,
    ) -> dict:
        lines = []
        if detach_hooks:
            lines.append(action_detach_hooks()["message"])
        if release_vae_workers:
            lines.append(action_release_vae_workers()["message"])
        if clear_text_cache:
            lines.append(action_clear_text_cache()["message"])
        if clear_weight_store:  # before the release, which drops the store with the workers anyway
            lines.append(action_clear_weights()["message"])
        if release_workers:
            lines.append(action_release_workers()["message"])
        if not lines:
            lines.append("nothing selected")
        from h3ms_async.runtime.host_memory import ram_info

        lines.append(ram_info().text)
        log.info(" | ".join(lines))
        return {"ui": {"text": lines}}
