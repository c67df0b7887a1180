"""The pool's private run directory: sockets and worker logs live there.

``<base>/h3ms-<owner pid>-<random>`` with mode 0700, where base is ``$H3MS_RUN_DIR`` or the temp dir
(``$TMPDIR``). It cannot outlive its owner:

* a reaper (``/bin/sh``, a few hundred KiB, in its own session so a terminal's Ctrl-C does not reach
  it) waits for EOF on a pipe whose only write end the owner holds, then removes the directory: the
  kernel closes that end when the owner dies, however it dies (SIGKILL, the OOM killer), so the
  directory goes within moments;
* the owner holds an ``flock`` on ``<dir>/owner.lock`` for the directory's life.  Should the reaper
  die too (a container stop kills everything at once), the next :func:`create` removes directories
  whose lock it can take. A lock, unlike a pid in the name, cannot be mistaken across PID namespaces
  (containers sharing a directory).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from h3ms_async.log import get_logger
from workers.runtime import config

log = get_logger("rundir")

#: Longest socket path AF_UNIX accepts on Linux (sun_path is 108 bytes including the terminating
#: NUL).
MAX_SOCKET_PATH = 107
LOCK_NAME = "owner.lock"
_NAME_RE = re.compile(r"^h3ms-[0-9]+-[A-Za-z0-9_]+$")
_REAPER_SCRIPT = 'read _ ; rm -rf -- "$1"'


@dataclass
class _Held:
    lock_fd: int
    reaper_pipe: int
    reaper: subprocess.Popen


_live: dict[str, _Held] = {}


class RunDirError(RuntimeError):
    """The run directory or a socket path in it cannot be used."""


def base_dir() -> str:
    """Where run dirs are made: ``$H3MS_RUN_DIR`` if set, else the system temp dir."""
    return config.RUN_DIR.get() or tempfile.gettempdir()


def check_base() -> str:
    """The base dir, checked: it exists, is a directory we can write, and leaves room for a socket
    path.

    Raises ``RunDirError`` naming the variable and the fix, so a bad setting fails before any worker
    starts."""
    base = base_dir()
    var = "H3MS_RUN_DIR" if config.RUN_DIR.is_set() else "TMPDIR (the temp dir)"
    if not os.path.isdir(base):
        raise RunDirError(
            f"{var}={base!r} is not an existing directory; set H3MS_RUN_DIR to a writable "
            "directory such as /tmp"
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise RunDirError(
            f"{var}={base!r} is not writable by this user; set H3MS_RUN_DIR to a writable "
            "directory such as /tmp"
        )
    # the socket the pool makes in its run dir: h3ms-<pid>-<8 random chars>/ctl.sock
    longest = len(os.fsencode(os.path.join(base, f"h3ms-{os.getpid()}-xxxxxxxx", "ctl.sock")))
    if longest > MAX_SOCKET_PATH:
        raise RunDirError(
            f"{var}={base!r} is too long for AF_UNIX socket paths ({longest} > {MAX_SOCKET_PATH} "
            "bytes); set H3MS_RUN_DIR to a short path such as /tmp"
        )
    return base


def create() -> str:
    """Sweep abandoned run dirs, then make a fresh private one, locked and watched by a reaper
    (module doc)."""
    base = check_base()
    sweep_dead(base)
    path = tempfile.mkdtemp(prefix=f"h3ms-{os.getpid()}-", dir=base)
    os.chmod(path, 0o700)
    lock_fd = os.open(os.path.join(path, LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    read_end, write_end = os.pipe()
    try:
        reaper = subprocess.Popen(
            ["/bin/sh", "-c", _REAPER_SCRIPT, "h3ms-reaper", path],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        os.close(write_end)
        os.close(lock_fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        os.close(read_end)
    _live[path] = _Held(lock_fd, write_end, reaper)
    return path


def socket_path(run_dir: str, name: str) -> str:
    """``run_dir/name``, checked against the AF_UNIX path limit."""
    path = os.path.join(run_dir, name)
    n = len(os.fsencode(path))
    if n > MAX_SOCKET_PATH:
        raise RunDirError(
            f"socket path {path!r} is {n} bytes, over the {MAX_SOCKET_PATH}-byte AF_UNIX limit; "
            "set H3MS_RUN_DIR (or TMPDIR) to a shorter directory, e.g. H3MS_RUN_DIR=/tmp"
        )
    return path


def remove(path: str) -> None:
    """Delete a run dir made by :func:`create` (missing is fine) and let its reaper go."""
    shutil.rmtree(path, ignore_errors=True)
    held = _live.pop(path, None)
    if held is None:
        return
    os.close(held.reaper_pipe)  # EOF: the reaper finds nothing left and exits
    os.close(held.lock_fd)
    try:
        held.reaper.wait(5.0)
    except subprocess.TimeoutExpired:
        held.reaper.kill()
        held.reaper.wait()


def _abandoned(path: str) -> bool:
    """Whether ``path``'s owner is gone: its lock can be taken.  No lock file: not ours to judge,
    keep it."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def sweep_dead(base: str | None = None) -> list[str]:
    """Remove this user's ``h3ms-*`` directories in ``base`` whose owner no longer holds their
    lock."""
    base = base or base_dir()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    uid = os.getuid()
    removed = []
    for name in names:
        full = os.path.join(base, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if (
            _NAME_RE.match(name)
            and st.st_uid == uid
            and os.path.isdir(full)
            and not os.path.islink(full)
            and full not in _live
            and _abandoned(full)
        ):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    if removed:
        log.info("removed %d run dir(s) left by dead processes: %s", len(removed), removed[:8])
    return removed
