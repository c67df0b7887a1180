"""Interrupt bridge: ComfyUI's cancel flag as the split's ``interrupt()`` probe, and the split's
abort as ComfyUI's ``InterruptProcessingException`` (so ComfyUI reports "interrupted", not an
error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


def interrupt_probe() -> Callable[[], bool]:
    """``comfy.model_management.processing_interrupted``: True once the user pressed cancel (the
    flag is only read)."""
    import comfy.model_management as mm

    return mm.processing_interrupted


def raise_interrupted(cause: BaseException | None = None) -> NoReturn:
    """Raise ComfyUI's interrupt exception for a split the cancel flag aborted (``cause``) or
    stopped before it started (None); clears the flag like ComfyUI does."""
    import comfy.model_management as mm

    mm.interrupt_current_processing(False)
    raise mm.InterruptProcessingException() from cause
