"""Command line: ``python -m h3ms_async demo | bench {ipc,split,exchange,gpu,attention,vae,caches} | serve``.

Each sub-command lives in its own module and is imported only when chosen, so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Sequence

#: Exit status of every command-line mistake (argparse's own convention).
USAGE_EXIT = 2


class UsageError(ValueError):
    """A bad command-line input or environment setting; the message names the input and the fix, in one line."""


def fail(message: str) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with status 2 (no usage block, no traceback)."""
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
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,4,8)") from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty; give comma-separated integers (e.g. 1,4,8)")
    return values


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; use 1-65535 (or 0 for any free port)")
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


def _demo(argv: Sequence[str]) -> int:
    from h3ms_async.tools.demo import main as demo_main
    return demo_main(argv)


def _bench(argv: Sequence[str]) -> int:
    benches: dict[str, Callable[[Sequence[str]], int]] = {}

    def ipc(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.ipc import main as m
        return m(a)

    def split(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.split import main as m
        return m(a)

    def exchange(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.exchange import main as m
        return m(a)

    def gpu(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.gpu import main as m
        return m(a)

    def attention(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.attention import main as m
        return m(a)

    def vae(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.vae import main as m
        return m(a)

    def caches(a: Sequence[str]) -> int:
        from h3ms_async.tools.bench.caches import main as m
        return m(a)

    benches.update(ipc=ipc, split=split, exchange=exchange, gpu=gpu, attention=attention, vae=vae, caches=caches)
    if not argv or argv[0] not in benches:
        got = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark given"
        fail(f"{got}; use python -m h3ms_async bench {{{'|'.join(benches)}}} [options]")
    return benches[argv[0]](argv[1:])


def _serve(argv: Sequence[str]) -> int:
    from h3ms_async.observability.serve import main as serve_main
    return serve_main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"demo": _demo, "bench": _bench, "serve": _serve}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a sub-command; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = ArgParser(
        prog="python -m h3ms_async",
        description="H3 MultiStream (async), standalone: split a reference MiniMax H3 DiT across rank workers.")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="demo, bench {ipc,split,exchange,gpu,attention,vae,caches} or serve")
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    if args[0] not in COMMANDS:
        parser.error(f"unknown command {args[0]!r}; choose one of {', '.join(sorted(COMMANDS))}")
    try:
        return COMMANDS[args[0]](args[1:])
    except UsageError as exc:
        fail(str(exc))
