"""The pack's one logger: ``h3_multistream``, every line prefixed ``[H3 MultiStream]
[<subsystem>]``.

Records never get glued onto a tqdm bar.  Standalone, a bar's owner wraps its lifetime in
:func:`above_bars` (tqdm's ``logging_redirect_tqdm``), so our console handler prints through
``tqdm.write`` and the bar redraws below the line.  Inside ComfyUI (its handlers, its bars) a
newline goes to stderr first when a bar is live, since tqdm redraws without one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from workers.runtime import config

LOGGER_NAME = "h3_multistream"
_TAIL_BLOCK = 64 * 1024
# 2000 lines of 4 KiB each; a log with longer lines is cut at this many bytes
_TAIL_MAX_BYTES = 8 * 1024 * 1024
PREFIX = "[H3 MultiStream] "


class _PrefixFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            sub = getattr(record, "subsystem", None)
            record.msg = PREFIX + (f"[{sub}] " if sub else "") + record.msg
        if not _logger.handlers and _bar_is_live():
            # a closed stderr must not break logging
            with contextlib.suppress(Exception):
                sys.stderr.write("\n")
        return True


def _bar_is_live() -> bool:
    """Whether at least one enabled tqdm bar exists (tqdm is never imported for this)."""
    tqdm_mod = sys.modules.get("tqdm.std")
    bars = getattr(tqdm_mod.tqdm, "_instances", None) if tqdm_mod is not None else None
    return bars is not None and any(not getattr(b, "disable", False) for b in list(bars))


_logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(f, _PrefixFilter) for f in _logger.filters):
    _logger.addFilter(_PrefixFilter())
if config.DEBUG.get():
    _logger.setLevel(logging.DEBUG)


def get_logger(subsystem: str) -> logging.LoggerAdapter:
    """A logger for one subsystem; its lines read ``[H3 MultiStream] [subsystem] message``."""
    return logging.LoggerAdapter(_logger, {"subsystem": subsystem})


def ensure_console_handler(level: int = logging.INFO) -> None:
    """Standalone runs (no ComfyUI handlers): print our records to stderr once."""
    if not _logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        _logger.addHandler(handler)
    if _logger.level == logging.NOTSET or _logger.level > level:
        _logger.setLevel(level)


@contextlib.contextmanager
def above_bars() -> Iterator[None]:
    """While a standalone run's tqdm bar lives, our console lines print above it (tqdm.write)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[_logger]):
        yield


def tail_file(path: str | os.PathLike, lines: int) -> list[str]:
    """The last ``lines`` lines of a text file, read backwards in blocks from the end (never the
    whole file).

    At most 8 MiB are read, so a pathological file costs a bounded read; when those 8 MiB hold no
    line start, the last line is returned cut to its final 64 KiB rather than nothing. A missing
    file (a worker that has not written yet) gives an empty list. Undecodable bytes are replaced,
    not fatal.
    """
    if lines <= 0:
        return []
    try:
        f = open(path, "rb")  # noqa: SIM115 - opened outside `with` so read errors still raise
    except OSError:
        return []
    chunks: list[bytes] = []
    newlines = 0
    with f:
        pos = f.seek(0, os.SEEK_END)
        read = 0
        # lines + 1 newlines guarantee `lines` complete lines (the last line may lack its newline)
        while pos > 0 and newlines <= lines and read < _TAIL_MAX_BYTES:
            step = min(_TAIL_BLOCK, pos, _TAIL_MAX_BYTES - read)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
            read += step
    out = b"".join(reversed(chunks)).decode("utf-8", errors="replace").splitlines()
    if pos > 0 and len(out) > 1:
        out = out[1:]  # the first line is cut at a block boundary
    elif pos > 0 and out:
        out = [out[0][-_TAIL_BLOCK:]]  # one huge line: its end is what there is to show
    return out[-lines:]
