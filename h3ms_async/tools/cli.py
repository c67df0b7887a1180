"""What every sub-command of ``python -m h3ms_async`` parses its arguments with (the dispatch is
``h3ms_async/__main__.py``): one ``error: ...`` line on stderr naming the input and the fix, exit
status 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from workers.dit.protocol import PATTERNS

#: Exit status of every command-line mistake (argparse's own convention).
USAGE_EXIT = 2


class UsageError(ValueError):
    """A bad command-line input or environment setting; the message names the input and the fix, in
    one line."""


def fail(message: str) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with status 2 (no usage block, no
    traceback)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(USAGE_EXIT)


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <what> (see --help)`` on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)")


def int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers such as ``1,4,8``."""
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 1,4,8)"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(
            "the list is empty; give comma-separated integers (e.g. 1,4,8)"
        )
    return values


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a TCP port; use 1-65535 (or 0 for any free port)"
        )
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return value


def add_pattern_argument(p: argparse.ArgumentParser) -> None:
    """``--pattern``: how a split block's attention gets its inputs (``SplitOptions.pattern``)."""
    p.add_argument(
        "--pattern",
        choices=[*PATTERNS, "auto"],
        default="gather",
        help="how attention gets its inputs: the all-gather of the block input, Ulysses (an "
        "all-to-all of q, k, v), or auto (the one the speed model predicts faster at this rank "
        "count)",
    )
