"""What a split step raises: failed, interrupted, or not exact on these ranks."""

from __future__ import annotations


class SplitError(RuntimeError):
    """A split step failed (a worker died, reported an error or missed its deadline)."""


class SplitInterrupted(SplitError):
    """The caller's interrupt probe turned true; every rank was aborted."""


class SplitUnsafe(SplitError):
    """This step cannot be split bit-exactly on these ranks (the caller should run it unsplit, or
    use fewer ranks).

    ``first`` is True the first time this plan is refused in this process: callers warn then, and
    only then."""

    def __init__(self, message: str, *, first: bool = True) -> None:
        super().__init__(message)
        self.first = first
