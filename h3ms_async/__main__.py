"""``python -m h3ms_async demo | bench
{ipc,split,exchange,gpu,attention,vae,caches,invariance,sparse,model} | serve``: the standalone
entry.

Each sub-command lives in its own module (with a ``main(argv) -> int``) and is imported only when
chosen, so ``--help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from h3ms_async.tools.cli import ArgParser, UsageError, fail

#: command -> its module; ``bench <name>`` runs ``h3ms_async.tools.bench.<name>``
COMMANDS = {"demo": "h3ms_async.tools.demo", "serve": "h3ms_async.tools.serve"}
BENCHES = (
    "ipc",
    "split",
    "exchange",
    "gpu",
    "attention",
    "vae",
    "caches",
    "invariance",
    "sparse",
    "model",
)
NAMES = sorted([*COMMANDS, "bench"])


def _run(module: str, argv: Sequence[str]) -> int:
    return importlib.import_module(module).main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a sub-command; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = ArgParser(
        prog="python -m h3ms_async",
        description="H3 MultiStream (async), standalone: split a reference MiniMax H3 DiT across "
        "rank workers.",
    )
    parser.add_argument(
        "command", choices=NAMES, help=f"demo, bench {{{','.join(BENCHES)}}} or serve"
    )
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    if args[0] not in NAMES:
        parser.error(f"unknown command {args[0]!r}; choose one of {', '.join(NAMES)}")
    try:
        if args[0] != "bench":
            return _run(COMMANDS[args[0]], args[1:])
        if len(args) < 2 or args[1] not in BENCHES:
            got = f"unknown benchmark {args[1]!r}" if len(args) > 1 else "no benchmark given"
            fail(f"{got}; use python -m h3ms_async bench {{{'|'.join(BENCHES)}}} [options]")
        return _run(f"h3ms_async.tools.bench.{args[1]}", args[2:])
    except UsageError as exc:
        fail(str(exc))


if __name__ == "__main__":
    raise SystemExit(main())
