"""Test request kinds: a worker serves them only with ``H3MS_TEST_HOOKS=1``."""

from __future__ import annotations

from typing import ClassVar, Literal

from workers.runtime.protocol import Answer, Request


class Slept(Answer):
    """How long a :class:`Sleep` slept."""

    slept: float


class Sleep(Request, tag="sleep"):
    """Sleep ``seconds``, or fail as soon as the pool aborts."""

    seconds: float
    ANSWER: ClassVar[type[Answer]] = Slept


class Crash(Request, tag="crash"):
    """Die at once: SIGKILL (``kill``) or ``os._exit(code)`` (``exit``); or fail as a worker that
    must not serve again (``unusable``: ``WorkerUnusable``, answered, then the worker ends)."""

    how: Literal["kill", "exit", "unusable"] = "kill"
    code: int = 3


class Hang(Request, tag="hang"):
    """Block the worker's loop (and its heartbeats) for ``seconds``."""

    seconds: float


class Inject(Request, tag="inject"):
    """Write ``raw`` on the worker's channel as it is (then end it with ``close``)."""

    raw: bytes
    close: bool = False
