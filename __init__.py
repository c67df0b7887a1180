"""H3 MultiStream (async): ComfyUI entry point.

ComfyUI imports this file as a package named after the pack's folder. The pack root is never put on ``sys.path``
(our ``nodes/`` would shadow ComfyUI's ``nodes.py``): the nodes are imported relative to this package. The core
(``h3ms_async``) and the worker code (``workers``) import themselves by their absolute names, because worker
processes run them with only the pack root on their path; here they are loaded from this folder under those names
with an explicit file spec, so exactly one copy of each exists in the process.

Importing never breaks ComfyUI's start-up: a node that cannot load is left out with one logged error, the others
load. Outside ComfyUI (no ``server`` module loaded) nothing is registered.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

_log = logging.getLogger("h3_multistream")
_ROOT = os.path.dirname(os.path.abspath(__file__))
_CORE_PACKAGES = ("workers", "h3ms_async")

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

# (module relative to this package, class name, display name)
_NODES = (
    (".nodes.multistream_node", "H3MultiStreamAsync", "H3 MultiStream"),
    (".nodes.gpu_set_node", "H3MSGPUSetAsync", "H3 MS GPU Set"),
    (".nodes.release_node", "H3MSReleaseResourcesAsync", "H3 MS Release Resources"),
    (".nodes.vae_split_node", "H3MSVAESplitDecodeAsync", "H3 MS VAE Split Decode"),
    (".nodes.vae_cache_node", "H3MSVAECacheAsync", "H3 MS VAE Cache"),
    (".nodes.text_cache_node", "H3MSTextEncoderCacheAsync", "H3 MS Text Encoder Cache"),
    (".nodes.attention_parallel_node", "H3AttentionParallelAsync", "H3 Attention Parallel"),
    (".nodes.sparse_attention_node", "H3MSSparseAttentionAsync", "H3 MS Sparse Attention"),
)


def _load_core_package(name: str) -> None:
    """Make ``import <name>`` resolve to this pack's folder of that name (already loaded from here: nothing to do)."""
    folder = os.path.join(_ROOT, name)
    existing = sys.modules.get(name)
    if existing is not None:
        where = os.path.dirname(os.path.realpath(getattr(existing, "__file__", "") or ""))
        if where != os.path.realpath(folder):
            raise ImportError(f"a different module named {name!r} is already loaded (from {where or 'nowhere'}); "
                              "remove the other package or custom node that provides it, then restart ComfyUI")
        return
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _load() -> None:
    problems: list[str] = []
    try:
        for name in _CORE_PACKAGES:
            _load_core_package(name)
    except Exception as exc:  # noqa: BLE001 - start-up must survive; say what is wrong once
        _log.error("[H3 MultiStream] core packages could not load, no nodes registered: %s: %s",
                   type(exc).__name__, exc)
        return
    for module_name, cls_name, display in _NODES:
        try:
            cls = getattr(importlib.import_module(module_name, __name__), cls_name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{cls_name} ({type(exc).__name__}: {exc})")
            continue
        NODE_CLASS_MAPPINGS[cls_name] = cls
        NODE_DISPLAY_NAME_MAPPINGS[cls_name] = display
    if problems:
        _log.error("[H3 MultiStream] these nodes could not load and are left out: %s", "; ".join(problems))
    server = sys.modules.get("server")  # ComfyUI's main.py has imported it before loading custom nodes
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return
    try:
        importlib.import_module(".nodes.routes", __name__).register(instance)
    except Exception as exc:  # noqa: BLE001
        _log.error("[H3 MultiStream] HTTP routes not registered (the nodes still work): %s: %s",
                   type(exc).__name__, exc)


_load()
