"""The control block of one pool start: a shared-memory segment every rank maps (its abort word
holds the abort generation) and one eventfd doorbell per rank; an abort bumps the generation and
rings every doorbell, so a rank stops its current exchange."""

from __future__ import annotations

import contextlib
import os
import struct

from workers.runtime.shm import ABORT_WORD, CONTROL_SIZE, Segment


class ControlBlock:
    """The control segment and the doorbells of one pool start."""

    def __init__(self, tag: str, ranks: int) -> None:
        self.segment = Segment.create(CONTROL_SIZE, tag)
        try:
            self.doorbells = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(ranks)]
        except BaseException:
            self.segment.close()
            raise

    @property
    def generation(self) -> int:
        """The abort generation (0 before the first abort)."""
        with self.segment.buffer(ABORT_WORD * 8, 8) as word:
            return struct.unpack("=q", word)[0]

    def abort(self) -> int:
        """Bump the abort generation and ring every doorbell; returns the new generation.
        Thread-safe."""
        bells = list(self.doorbells)
        with self.segment.buffer(ABORT_WORD * 8, 8) as word:
            (gen,) = struct.unpack("=q", word)
            struct.pack_into("=q", word, 0, gen + 1)
        for fd in bells:
            # counter full or fd closed by a concurrent release: the generation word still tells
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)
        return gen + 1

    def close(self) -> None:
        """Close the doorbells and the segment."""
        for fd in self.doorbells:
            os.close(fd)
        self.doorbells = []
        self.segment.close()
