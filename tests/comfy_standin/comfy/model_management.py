"""Stand-in for ComfyUI's interrupt flag (facts: a module-global flag under an RLock; the ``throw`` variant clears the
flag and raises ``InterruptProcessingException``).  Tests set it with ``interrupt_current_processing``."""
from __future__ import annotations

import threading


class InterruptProcessingException(Exception):
    pass


_mutex = threading.RLock()
_interrupted = False


def interrupt_current_processing(value: bool = True) -> None:
    global _interrupted
    with _mutex:
        _interrupted = value


def processing_interrupted() -> bool:
    with _mutex:
        return _interrupted


def throw_exception_if_processing_interrupted() -> None:
    global _interrupted
    with _mutex:
        if _interrupted:
            _interrupted = False
            raise InterruptProcessingException()
