"""The block patches this pack installs, and what it does with the user's own block patches.

ComfyUI keeps one ``("double_block", i)`` patch per key (``docs/comfyui_facts.md`` §8.1): a user
patch set on a key *before* ours is kept inside our patch (``displaced``), one set *after* it
replaces ours. User patches may only adjust ``transformer_options`` (:func:`capture_block_options`
records what they change for the ranks); ComfyUI's Model Sparse Attention patch is refused
(:func:`refuse_comfy_sparse`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .errors import MultiStreamError


class UnsplitRunner(Protocol):
    """The per-call block-0 runner that a :class:`PassThroughPatch` defers to in an unsplit step."""

    unsplit: bool

    def run_unsplit(self, i: int, args: dict, extra: dict) -> dict: ...


class OwnPatch:
    """Marks the patches this pack installs; ``displaced`` is the user patch that held the key
    before ours."""

    def __init__(self, displaced: Any = None):
        self.displaced = displaced


class PassThroughPatch(OwnPatch):
    """Blocks 1..L-1: block 0 already ran them on the workers, unless it fell back to running this
    step unsplit (``stack.unsplit``): then each block runs here as in plain ComfyUI, with the user's
    own patch if any."""

    def __init__(
        self, displaced: Any = None, stack: UnsplitRunner | None = None, index: int = 0
    ) -> None:
        super().__init__(displaced)
        self.stack = stack
        self.index = index

    def __call__(self, args: dict, extra: dict) -> dict:
        if self.stack is not None and self.stack.unsplit:
            return self.stack.run_unsplit(self.index, args, extra)
        return {"img": args["img"]}


class StackPatch(OwnPatch):
    """Block 0 at node time; the wrapper swaps in a per-call runner that does the work
    (``nodes/model_wrapper.py``)."""

    def __call__(self, args: dict, extra: dict) -> dict:
        raise MultiStreamError(
            "H3 MultiStream's block patch ran without its DIFFUSION_MODEL wrapper; another node "
            "removed the wrapper. Put H3 MultiStream last in the model chain."
        )


def collect_user_patches(transformer_options: Mapping, n_blocks: int) -> dict[int, Any]:
    """User ``("double_block", i)`` patches by block, ours set aside; any other ``dit`` key is
    refused."""
    dit = transformer_options.get("patches_replace", {}).get("dit", {})
    found: dict[int, Any] = {}
    other = []
    for key, patch in dit.items():
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and key[0] == "double_block"
            and isinstance(key[1], int)
            and 0 <= key[1] < n_blocks
        ):
            other.append(key)
            continue
        user = patch.displaced if isinstance(patch, OwnPatch) else patch
        if user is not None:
            found[key[1]] = user
    if other:
        raise MultiStreamError(
            f"unsupported dit patches: {other!r}; H3 MultiStream only runs ('double_block', i) "
            "patches. Remove the node that sets them or disable H3 MultiStream."
        )
    return found


#: How ComfyUI's Model Sparse Attention node (ComfyUI 0.35+,
#: ``comfy_extras/nodes_sparse_attention.py``) marks a model: the key of its ON_PREPARE_STATE /
#: ON_CLEANUP callbacks, and the module its attention override
#: (``transformer_options['optimized_attention_override']``) and H3 block patches
#: (``("double_block", i)``) come from.
COMFY_SPARSE_KEY = "block_sparse_attention"
COMFY_SPARSE_MODULE = "nodes_sparse_attention"


def _from_comfy_sparse(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").rsplit(".", 1)[-1] == COMFY_SPARSE_MODULE


def refuse_comfy_sparse(patcher: Any, transformer_options: Mapping | None = None) -> None:
    """Raise when ComfyUI's Model Sparse Attention patch is on the model: its sparse attention runs
    in ComfyUI's process on whole blocks (a block patch with its own attention, an attention
    override), which the ranks cannot run, and a split that ignored it would silently attend dense.
    ``transformer_options``: the call's (default: the patcher's)."""
    to = (
        transformer_options
        if transformer_options is not None
        else getattr(patcher, "model_options", {}).get("transformer_options", {})
    )
    found = []
    if any(
        COMFY_SPARSE_KEY in by_key
        for by_key in (getattr(patcher, "callbacks", None) or {}).values()
    ):
        found.append(f"callbacks '{COMFY_SPARSE_KEY}'")
    if _from_comfy_sparse(to.get("optimized_attention_override")):
        found.append("its attention override")
    dit = to.get("patches_replace", {}).get("dit", {})
    blocks = [
        k[1]
        for k, p in dit.items()
        if isinstance(k, tuple)
        and len(k) == 2
        and _from_comfy_sparse(p.displaced if isinstance(p, OwnPatch) else p)
    ]
    if blocks:
        found.append(f"block patches on {len(blocks)} block(s)")
    if found:
        raise MultiStreamError(
            f"the model carries ComfyUI's Model Sparse Attention patch ({', '.join(found)}); it "
            "runs sparse attention inside ComfyUI's own blocks, which the split's rank workers "
            "cannot run. To run sparse attention split, remove the Model Sparse Attention node "
            "and connect an H3 MS Sparse Attention node (same settings) to H3 MultiStream's "
            "sparse_attention input; or set H3 MultiStream's enabled=false to keep ComfyUI's node"
        )


def _replaces(i: int, why: str) -> MultiStreamError:
    return MultiStreamError(
        f"block {i} carries a patch that replaces the block computation ({why}); H3 MultiStream "
        "only supports patches that adjust transformer_options (e.g. a per-block attention "
        "backend). Remove that patch, or set H3 MultiStream's enabled=false for this model."
    )


def capture_block_options(
    user_patches: Mapping[int, Any], args: Mapping, n_blocks: int
) -> list[dict] | None:
    """Run each user patch against a recording ``original_block`` and keep what it changes in
    transformer_options.

    The patch sees block ``i``'s args with a meta-device ``img`` (same shape and dtype, no data, so
    a patch that computes on the stream cannot touch the real one). It must call ``original_block``
    exactly once, with the args it got except for ``transformer_options``, pass no ``attention``
    callable, and return what ``original_block`` returned. Returns one dict per block (the keys the
    patch set or replaced), or None when nothing changed.
    """
    if not user_patches:
        return None
    base_to = args["transformer_options"]
    probe = torch.empty_like(args["img"], device="meta")
    per_block: list[dict] = [{} for _ in range(n_blocks)]
    for i, patch in sorted(user_patches.items()):
        given_to = dict(base_to)
        given_to["block_index"] = i
        snapshot = dict(given_to)
        call_args = dict(args, img=probe, transformer_options=given_to)
        seen: list[dict] = []

        def original_block(a: dict, seen: list[dict] = seen) -> dict:
            seen.append(dict(a))
            return {"img": a["img"]}

        try:
            out = patch(call_args, {"original_block": original_block})
        except MultiStreamError:
            raise
        except Exception as exc:
            # a patch that computes on the stream fails on the meta probe
            raise _replaces(
                i, f"it failed on a data-free probe: {type(exc).__name__}: {exc}"
            ) from exc
        if len(seen) != 1:
            raise _replaces(i, f"it called original_block {len(seen)} times, not once")
        rec = seen[0]
        if rec.get("attention") is not None:
            raise _replaces(i, "it passes its own attention module")
        for name in ("img", "t_emb", "mod_segments", "rope_freqs"):
            if rec.get(name) is not call_args[name]:
                raise _replaces(i, f"it changes args[{name!r}]")
        if not isinstance(out, Mapping) or out.get("img") is not probe:
            raise _replaces(i, "it does not return original_block's output")
        rec_to = rec.get("transformer_options", {})
        removed = [k for k in snapshot if k not in rec_to]
        if removed:
            raise _replaces(i, f"it removes transformer_options keys {removed}")
        per_block[i] = {
            k: v for k, v in rec_to.items() if k not in snapshot or snapshot[k] is not v
        }
    return per_block if any(per_block) else None
