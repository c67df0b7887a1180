"""A weight store's fill progress, in the store's own segment: the one layout both sides use.

The store (``h3ms_async/runtime/weight_store.py``) reserves one int64 word ahead of the blocks and
writes into it, after each block's bytes are in, how many blocks are complete, or :data:`FAILED`
when the fill stopped.  A rank (``workers/dit/rank.py``) takes block ``i`` in once the word passed
``i``, so it loads while the store still fills.  The word only grows until the fill ends; a block's
bytes are written before the count that covers them (the filler's copy returns before it publishes,
and x86's stores are seen in order), so a reader that saw the count sees the bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from workers.runtime.protocol import ProtocolError, TensorDesc

if TYPE_CHECKING:
    from workers.runtime.shm import Segment

#: The word's dtype and shape in the store segment.
DTYPE = "int64"
SHAPE = (1,)
#: The fill stopped before every block was complete (the filler raised).
FAILED = -1
#: A waiting rank polls the word this often at first, doubling up to :data:`POLL_MAX_S`.
POLL_MIN_S = 0.0005
POLL_MAX_S = 0.01


class FillFailed(RuntimeError):
    """The store's fill stopped (the filler marked it failed), its waiter gave up, or was
    aborted."""


def check_desc(desc: TensorDesc, store: str) -> None:
    """Refuse a progress descriptor that is not one int64 word in the store segment ``store``."""
    if desc.dtype != DTYPE or tuple(desc.shape) != SHAPE or desc.seg != store:
        raise ProtocolError(
            f"fill progress must be one {DTYPE} word {list(SHAPE)} in the store segment {store}, "
            f"got {desc.dtype} {list(desc.shape)} in {desc.seg}"
        )


class FillProgress:
    """The progress word ``desc`` (:func:`check_desc`) of a store of ``blocks`` blocks in
    ``segment``.  Each access makes its own view of the word: an exception raised while waiting
    keeps no view alive in its frames, so the segment can be unmapped while it propagates."""

    def __init__(self, segment: Segment, desc: TensorDesc, blocks: int) -> None:
        check_desc(desc, segment.name)
        self._segment = segment
        self._desc = desc
        self.blocks = blocks

    def read(self) -> int:
        """Blocks complete, or :data:`FAILED`."""
        return int(self._segment.tensor(self._desc)[0])

    def publish(self, done: int) -> None:
        """``done`` blocks are complete (call after their bytes are written)."""
        if not 0 <= done <= self.blocks:
            raise ValueError(f"{done} blocks complete of {self.blocks}")
        self._segment.tensor(self._desc)[0] = done

    def fail(self) -> None:
        """The fill stopped: every waiter raises."""
        self._segment.tensor(self._desc)[0] = FAILED

    async def wait_for(
        self, i: int, deadline_s: float, aborted: Callable[[], bool] = lambda: False
    ) -> None:
        """Return once block ``i`` is complete; raise :class:`FillFailed` when the fill failed,
        ``aborted()`` turns true, or ``deadline_s`` passes without the block (the event loop keeps
        serving meanwhile)."""
        deadline = time.monotonic() + deadline_s
        poll = POLL_MIN_S
        while True:
            done = self.read()
            if done == FAILED:
                raise FillFailed(
                    "the weight store's fill failed before block "
                    f"{i} of {self.blocks} was complete (the coordinator reports why)"
                )
            if done > i:
                return
            if aborted():
                raise FillFailed(f"aborted while waiting for block {i} of the weight store")
            if time.monotonic() >= deadline:
                raise FillFailed(
                    f"block {i} of the weight store was not complete within {deadline_s:g} s "
                    f"({done} of {self.blocks} were)"
                )
            await asyncio.sleep(poll)
            poll = min(POLL_MAX_S, poll * 2)
