"""``python -m h3ms_async serve [--host H] [--port P]``: the standalone server
(:mod:`h3ms_async.observability.serve`) from the command line, a failed bind as one line naming
the input and the fix."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence

from h3ms_async.log import ensure_console_handler
from h3ms_async.observability.serve import serve
from h3ms_async.tools.cli import ArgParser, fail
from h3ms_async.tools.cli import port as port_type


def bind_error_text(flag: str, host: str, port: int, exc: OSError) -> str:
    """One line for a failed bind: which input, why, and what to do (port taken, no permission, bad
    host)."""
    if exc.errno == errno.EADDRINUSE:
        why = (
            f"port {port} on {host} is already in use (another server, or an earlier run still up)"
        )
        fix = f"choose another {flag} or stop what holds it (ss -ltnp | grep :{port})"
    elif exc.errno == errno.EACCES:
        why = f"port {port} needs privileges on this machine"
        fix = f"use a {flag} above 1023"
    elif exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
        why = f"{host!r} is not an address of this machine"
        fix = "use --host 127.0.0.1 (or another local address)"
    else:
        why = f"cannot listen on {host}:{port} ({exc.strerror or exc})"
        fix = f"choose another {flag}"
    return f"{flag} {port}: {why}; {fix}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m h3ms_async serve [--host H] [--port P]``."""
    p = ArgParser(
        prog="python -m h3ms_async serve",
        description="Serve the H3 MultiStream status routes and live panel.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=port_type, default=8189, help="TCP port (default 8189; 0: any free port)"
    )
    args = p.parse_args(list(argv) if argv is not None else None)
    ensure_console_handler(logging.INFO)
    try:
        serve(args.host, args.port)
    except OSError as exc:
        fail(bind_error_text("--port", args.host, args.port, exc))
    return 0
