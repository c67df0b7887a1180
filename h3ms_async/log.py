"""The pack's one logger: ``h3_multistream``, every line prefixed ``[H3 MultiStream] [<subsystem>]``.

Records never get glued onto a tqdm bar.  Standalone, our console handler prints through ``tqdm.write`` while a bar
is live, so the line lands above the bar and the bar redraws below it.  Inside ComfyUI (its handlers, its bars) a
newline goes to stderr first when a bar is live, since tqdm redraws without one.
"""
from __future__ import annotations

import logging
import os
import sys

from workers.runtime import config

LOGGER_NAME = "h3_multistream"
_TAIL_BLOCK = 64 * 1024
_TAIL_MAX_BYTES = 8 * 1024 * 1024  # 2000 lines of 4 KiB each; a log with longer lines is cut at this many bytes
PREFIX = "[H3 MultiStream] "


class _PrefixFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            sub = getattr(record, "subsystem", None)
            record.msg = PREFIX + (f"[{sub}] " if sub else "") + record.msg
        if not any(isinstance(h, _BarSafeHandler) for h in _logger.handlers) and _live_bar_class() is not None:
            try:
                sys.stderr.write("\n")
            except Exception:  # noqa: BLE001 - a closed stderr must not break logging
                pass
        return True


def _live_bar_class() -> type | None:
    """tqdm's bar class when at least one enabled bar exists (tqdm is never imported for this)."""
    tqdm_mod = sys.modules.get("tqdm.std")
    if tqdm_mod is None:
        return None
    bars = getattr(tqdm_mod.tqdm, "_instances", None)
    if bars and any(not getattr(b, "disable", False) for b in list(bars)):
        return tqdm_mod.tqdm
    return None


class _BarSafeHandler(logging.StreamHandler):
    """Prints a record above a live tqdm bar (``tqdm.write`` clears the bar, prints, redraws it)."""

    def emit(self, record: logging.LogRecord) -> None:
        bar_cls = _live_bar_class()
        if bar_cls is None:
            super().emit(record)
            return
        try:
            bar_cls.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


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
        handler = _BarSafeHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        _logger.addHandler(handler)
    if _logger.level == logging.NOTSET or _logger.level > level:
        _logger.setLevel(level)


def tail_file(path: str | os.PathLike, lines: int) -> list[str]:
    """The last ``lines`` lines of a text file, read backwards in blocks from the end (never the whole file).

    At most 8 MiB are read, so a pathological file costs a bounded read; when those 8 MiB hold no line start, the
    last line is returned cut to its final 64 KiB rather than nothing. A missing file (a worker that has not
    written yet) gives an empty list. Undecodable bytes are replaced, not fatal.
    """
    if lines <= 0:
        return []
    try:
        f = open(path, "rb")
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
