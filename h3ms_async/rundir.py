"""The pool's private run directory: sockets and worker logs live there.

``<base>/h3ms-<owner pid>-<random>`` with mode 0700, where base is ``$H3MS_RUN_DIR`` or the temp dir (``$TMPDIR``).
The owner pid in the name lets the next start remove directories of processes that died without cleaning up.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

from workers.shm import dead_owner_entries

from h3ms_async.log import get_logger

log = get_logger("rundir")

#: Longest socket path AF_UNIX accepts on Linux (sun_path is 108 bytes including the terminating NUL).
MAX_SOCKET_PATH = 107
_NAME_RE = re.compile(r"^h3ms-([0-9]+)-[A-Za-z0-9_]+$")
_live: set[str] = set()


class RunDirError(RuntimeError):
    """The run directory or a socket path in it cannot be used."""


def base_dir() -> str:
    """Where run dirs are made: ``$H3MS_RUN_DIR`` if set, else the system temp dir."""
    return os.environ.get("H3MS_RUN_DIR") or tempfile.gettempdir()


def check_base() -> str:
    """The base dir, checked: it exists, is a directory we can write, and leaves room for a socket path.

    Raises ``RunDirError`` naming the variable and the fix, so a bad setting fails before any worker starts."""
    base = base_dir()
    var = "H3MS_RUN_DIR" if os.environ.get("H3MS_RUN_DIR") else "TMPDIR (the temp dir)"
    if not os.path.isdir(base):
        raise RunDirError(f"{var}={base!r} is not an existing directory; set H3MS_RUN_DIR to a writable directory "
                          "such as /tmp")
    if not os.access(base, os.W_OK | os.X_OK):
        raise RunDirError(f"{var}={base!r} is not writable by this user; set H3MS_RUN_DIR to a writable directory "
                          "such as /tmp")
    # the socket the pool makes in its run dir: h3ms-<pid>-<8 random chars>/ctl.sock
    longest = len(os.fsencode(os.path.join(base, f"h3ms-{os.getpid()}-xxxxxxxx", "ctl.sock")))
    if longest > MAX_SOCKET_PATH:
        raise RunDirError(f"{var}={base!r} is too long for AF_UNIX socket paths ({longest} > {MAX_SOCKET_PATH} "
                          "bytes); set H3MS_RUN_DIR to a short path such as /tmp")
    return base


def create() -> str:
    """Sweep dead owners' run dirs, then make a fresh private one; it is removed at exit if still there."""
    base = check_base()
    sweep_dead(base)
    path = tempfile.mkdtemp(prefix=f"h3ms-{os.getpid()}-", dir=base)
    os.chmod(path, 0o700)
    _live.add(path)
    return path


def socket_path(run_dir: str, name: str) -> str:
    """``run_dir/name``, checked against the AF_UNIX path limit."""
    path = os.path.join(run_dir, name)
    n = len(os.fsencode(path))
    if n > MAX_SOCKET_PATH:
        raise RunDirError(
            f"socket path {path!r} is {n} bytes, over the {MAX_SOCKET_PATH}-byte AF_UNIX limit; "
            "set H3MS_RUN_DIR (or TMPDIR) to a shorter directory, e.g. H3MS_RUN_DIR=/tmp")
    return path


def remove(path: str) -> None:
    """Delete a run dir made by :func:`create` (missing is fine)."""
    _live.discard(path)
    shutil.rmtree(path, ignore_errors=True)


def sweep_dead(base: str | None = None) -> list[str]:
    """Remove ``h3ms-<pid>-*`` directories in ``base`` whose owner pid is dead and that belong to us."""
    removed = [p for p in dead_owner_entries(base or base_dir(), _NAME_RE) if os.path.isdir(p)]
    for full in removed:
        shutil.rmtree(full, ignore_errors=True)
    if removed:
        log.info("removed %d run dir(s) left by dead processes: %s", len(removed), removed[:8])
    return removed


@atexit.register
def _remove_live() -> None:
    for path in list(_live):
        remove(path)
