"""How a command-line process ends: Ctrl-C and SIGTERM end it with one line and a full release,
never a traceback.

Nothing this pack holds can outlive the process anyway (unnamed shm segments, run dirs with a
reaper, workers that die with their parent); the release here makes the end prompt and quiet, and
keeps it from being interrupted by a second Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

#: Exit codes of a process ended by SIGINT / SIGTERM, as a shell reports them.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM (a BaseException, like KeyboardInterrupt: no handler
    swallows it)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def run_guarded(body: Callable[[], int], release: Callable[[], None], what: str) -> int:
    """``body()``'s exit code; Ctrl-C gives 130 and SIGTERM 143, each with one line on stderr.
    ``release`` runs exactly once at the end with SIGINT and SIGTERM ignored, so a storm of Ctrl-C
    cannot cut it short; after a signal they stay ignored until the process exits.

    Off the main thread (where signals cannot be handled) it is a plain try/finally.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main else None
    code = 1
    try:
        code = body()
    except KeyboardInterrupt:
        print(f"{what}: interrupted (Ctrl-C); workers and shared memory released", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Terminated:
        print(f"{what}: terminated (SIGTERM); workers and shared memory released", file=sys.stderr)
        code = EXIT_TERMINATED
    finally:
        if main:
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            release()
        finally:
            # After a signal the process is ending: a storm that goes on must not break interpreter
            # shutdown.
            if main and code not in (EXIT_INTERRUPTED, EXIT_TERMINATED):
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, previous)
    return code
