"""Dropping a file from the page cache, so the next read comes from the disk (the readahead test and the fill and
cold-start benchmarks)."""
from __future__ import annotations

import os


def drop(path: str) -> None:
    """Write the file's dirty pages back (those cannot be dropped), then ask the kernel to drop every cached page."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
