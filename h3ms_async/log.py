"""The pack's one logger: ``h3_multistream``, every line prefixed ``[H3 MultiStream] [<subsystem>]``.

Records never get glued onto a tqdm bar.  Standalone, our console handler prints through ``tqdm.write`` while a bar
is live, so the line lands above the bar and the bar redraws below it.  Inside ComfyUI (its handlers, its bars) a
newline goes to stderr first when a bar is live, since tqdm redraws without one.
"""
from __future__ import annotations

import logging
import sys

from workers.runtime import config

LOGGER_NAME = "h3_multistream"
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
