"""The pack's nodes as the frontend and saved workflows see them: each node's class, and the inputs of its first
release (from git history), the widest "old format" a saved workflow can have.

A saved API workflow names only the inputs its node had when it was saved; ComfyUI refuses a graph that lacks a
required input, so every input added after a node's first release must be optional (RULES: new inputs go under
"optional" with a default).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Inputs at each node's first commit (1d85fb6: MultiStream, GPU Set, Release Resources; 2614579: VAE Split Decode;
#: 332e7d4: Attention Parallel; 1376235: both caches; the merge of the sparse-attention branch: Sparse Attention), in
#: declaration order.
FIRST_RELEASE: dict[str, tuple[str, ...]] = {
    "H3MultiStreamAsync": ("model", "enabled", "second_gpu", "exchange", "exchange_chunks", "weight_cache",
                           "cache_ram_reserve_gb", "vram_residency", "gpus"),
    "H3MSGPUSetAsync": ("gpus", "exclude", "shares", "min_free_vram_gb", "max_gpus"),
    "H3MSReleaseResourcesAsync": ("release_workers", "clear_weight_store", "detach_hooks"),
    "H3MSVAESplitDecodeAsync": ("vae", "enabled", "second_gpu", "gpus", "max_gpus"),
    "H3MSVAECacheAsync": ("vae", "enabled", "weight_cache", "cache_ram_reserve_gb"),
    "H3MSTextEncoderCacheAsync": ("clip", "enabled", "weight_cache", "cond_cache_entries", "cache_ram_reserve_gb"),
    "H3AttentionParallelAsync": ("model", "devices", "min_sequence_length", "gpus"),
    "H3MSSparseAttentionAsync": ("method", "tau", "keep_percent", "start_percent", "end_percent", "dense_blocks",
                                 "min_tokens", "extra_tokens", "sink_conditioning"),
}


def pack_nodes() -> list[tuple[str, str, str]]:
    """``(module, class name, display name)`` of every node, read from the pack root's ``_NODES`` table (the one
    ComfyUI's import registers), so a node added there is checked here without a second list."""
    tree = ast.parse((ROOT / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_NODES"]:
            return [(m.lstrip("."), c, d) for m, c, d in ast.literal_eval(node.value)]
    raise AssertionError("the pack root has no _NODES table")


def node_classes() -> dict[str, Any]:
    """NODE_CLASS_MAPPINGS as the pack registers it (class key -> class), imported from ``nodes/``."""
    return {cls: getattr(importlib.import_module(module), cls) for module, cls, _ in pack_nodes()}
