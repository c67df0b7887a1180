"""The pack's one logger: ``h3_multistream``, every line prefixed ``[H3 MultiStream] [<subsystem>]``.

Records never get glued onto a tqdm bar: when a bar has drawn since our last record, a newline goes to stderr
first (tqdm redraws without a newline).
"""
from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "h3_multistream"
PREFIX = "[H3 MultiStream] "


class _PrefixFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            sub = getattr(record, "subsystem", None)
            record.msg = PREFIX + (f"[{sub}] " if sub else "") + record.msg
        _break_tqdm_line()
        return True


def _break_tqdm_line() -> None:
    tqdm_mod = sys.modules.get("tqdm.std")
    if tqdm_mod is None:
        return
    bars = getattr(tqdm_mod.tqdm, "_instances", None)
    if bars and any(not getattr(b, "disable", False) for b in list(bars)):
        try:
            sys.stderr.write("\n")
        except Exception:  # noqa: BLE001 - a closed stderr must not break logging
            pass


_logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(f, _PrefixFilter) for f in _logger.filters):
    _logger.addFilter(_PrefixFilter())
if os.environ.get("H3MS_DEBUG") == "1":
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
