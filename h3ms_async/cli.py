"""Command line: ``python -m h3ms_async demo | bench {ipc,split,exchange,gpu,attention,vae,caches} | serve``.

Each sub-command lives in its own module and is imported only when chosen, so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


def _demo(argv: Sequence[str]) -> int:
    from h3ms_async.demo import main as demo_main
    return demo_main(argv)


def _bench(argv: Sequence[str]) -> int:
    benches: dict[str, Callable[[Sequence[str]], int]] = {}

    def ipc(a: Sequence[str]) -> int:
        from h3ms_async.bench_ipc import main as m
        return m(a)

    def split(a: Sequence[str]) -> int:
        from h3ms_async.bench_split import main as m
        return m(a)

    def exchange(a: Sequence[str]) -> int:
        from h3ms_async.bench_exchange import main as m
        return m(a)

    def gpu(a: Sequence[str]) -> int:
        from h3ms_async.bench_gpu import main as m
        return m(a)

    def attention(a: Sequence[str]) -> int:
        from h3ms_async.bench_attention import main as m
        return m(a)

    def vae(a: Sequence[str]) -> int:
        from h3ms_async.bench_vae import main as m
        return m(a)

    def caches(a: Sequence[str]) -> int:
        from h3ms_async.bench_caches import main as m
        return m(a)

    benches.update(ipc=ipc, split=split, exchange=exchange, gpu=gpu, attention=attention, vae=vae, caches=caches)
    if not argv or argv[0] not in benches:
        print(f"usage: python -m h3ms_async bench {{{'|'.join(benches)}}} [options]", file=sys.stderr)
        return 2
    return benches[argv[0]](argv[1:])


def _serve(argv: Sequence[str]) -> int:
    from h3ms_async.serve import main as serve_main
    return serve_main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"demo": _demo, "bench": _bench, "serve": _serve}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a sub-command; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m h3ms_async",
        description="H3 MultiStream (async), standalone: split a reference MiniMax H3 DiT across rank workers.")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="demo, bench {ipc,split,exchange,gpu,attention,vae,caches} or serve")
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    if args[0] not in COMMANDS:
        parser.error(f"unknown command {args[0]!r}; choose one of {', '.join(sorted(COMMANDS))}")
    return COMMANDS[args[0]](args[1:])
