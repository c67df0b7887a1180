"""The node layer's one error type: a model or patch set the split cannot run."""

from __future__ import annotations


class MultiStreamError(RuntimeError):
    """A model or patch set the split cannot run; the message names the cause and the fix."""
