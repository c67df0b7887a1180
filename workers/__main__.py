"""Worker entry: ``python -m workers --rank R --world-size N --socket PATH --parent-pid P --device
DEV [--program P]``.

Started only by ``h3ms_async.runtime.pool.WorkerPool``: the pool key arrives on stdin, stdout/stderr
are the worker's log file.  Order matters: die-with-parent first, then pin the device (before any
CUDA call), read the key, import the runtime's handlers and the rank program's module, connect,
authenticate, serve until shutdown or EOF.

A rank program ``P`` is the module ``workers.P.rank``, found by name: importing it declares its
message kinds and registers its handlers (``workers.runtime.handlers.handler``), so adding a program
edits neither this file nor the pool.  Without ``--program`` a worker serves only the runtime's own
kinds.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from workers.runtime import auth, config, protocol

log = logging.getLogger("h3_multistream.worker")

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d); relying on channel EOF", ctypes.get_errno()
        )
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        log.error("parent %d is gone before start; exiting", parent_pid)
        os._exit(1)


class ProgramNotFound(ImportError):
    """``--program`` names no ``workers.<program>.rank`` module."""


def load_program(program: str | None) -> None:
    """Import the runtime's handlers, the rank program ``workers.<program>.rank`` when given, and
    the test hooks with ``H3MS_TEST_HOOKS=1``."""
    importlib.import_module("workers.runtime.handlers")
    if program is not None:
        name = f"workers.{program}.rank"
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if exc.name not in (name, f"workers.{program}"):  # it exists; one of its imports failed
                raise
            raise ProgramNotFound(
                f"rank program {program!r}: there is no module {name} (a rank program is a package "
                f"workers/{program}/ with a rank.py that registers its handlers)"
            ) from None
    if config.TEST_HOOKS.get():
        from workers.testing import hooks

        hooks.load()


def _rss() -> int:
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vram(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.memory_reserved(torch.device(device)))


@dataclass
class _Start:
    """Where this worker's start went before it answers the challenge (``protocol.Auth``)."""

    device_s: float = 0.0
    program_s: float = 0.0
    #: ``time.monotonic()`` when it began to connect
    connect_at: float = 0.0


async def _handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: bytes,
    rank: int,
    start: _Start,
) -> protocol.Welcome:
    msg = await asyncio.wait_for(protocol.read_message(reader), 30)
    if not isinstance(msg, protocol.Challenge):
        raise protocol.ProtocolError(f"expected a challenge first, got {msg.kind!r}")
    answer = protocol.Auth(
        rank=rank,
        pid=os.getpid(),
        mac=auth.response(key, msg.nonce, rank),
        device_s=start.device_s,
        program_s=start.program_s,
        connect_s=time.monotonic() - start.connect_at,
    )
    writer.write(protocol.encode(answer))
    await writer.drain()
    msg = await asyncio.wait_for(protocol.read_message(reader), 30)
    if isinstance(msg, protocol.Refused):
        raise auth.AuthError(f"coordinator refused this worker: {msg.error}")
    if not isinstance(msg, protocol.Welcome):
        raise protocol.ProtocolError(f"expected welcome, got {msg.kind!r}")
    return msg


def _make_context(args: argparse.Namespace, welcome: protocol.Welcome):
    from workers.runtime.handlers import WorkerContext
    from workers.runtime.shm import Segment

    control = Segment.attach(welcome.control)
    import torch

    return WorkerContext(
        rank=args.rank,
        world_size=welcome.world_size,
        device=welcome.device,
        run_dir=welcome.run_dir,
        log=log,
        doorbell_fds=list(welcome.doorbell_fds),
        control=control.base_tensor().view(torch.int64),
        control_segment=control,
    )


async def _serve(
    ctx, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hb_interval: float
) -> str:
    from workers.runtime.handlers import HANDLERS, Handler, WorkerUnusable

    ctx.state["_writer"] = writer
    tasks: set[asyncio.Task] = set()

    def send(msg: protocol.Message) -> None:
        try:
            frame = protocol.encode(msg)
        except protocol.ProtocolError as exc:
            frame = protocol.encode(
                protocol.Err(id=msg.id, error=f"bad answer: {exc}", tb=traceback.format_exc())
            )
        if not writer.is_closing():
            writer.write(frame)

    async def heartbeat() -> None:
        while True:
            send(protocol.Heartbeat(rss=_rss(), vram=_vram(ctx.device), busy=ctx.inflight > 0))
            await asyncio.sleep(hb_interval)

    async def run_one(fn: Handler, msg: protocol.Request) -> None:
        ctx.inflight += 1
        unusable = False
        try:
            try:
                result = await fn(ctx, msg)
                r = protocol.encode_answer(msg, result)
                answer: protocol.Message = protocol.Ok(id=msg.id, r=r)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # every handler error (a malformed result included) goes to the coordinator
                log.exception("request %s (id %d) failed", msg.kind, msg.id)
                answer = protocol.Err(
                    id=msg.id, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()
                )
                unusable = isinstance(exc, WorkerUnusable)
            send(answer)
            if unusable:
                log.error("this worker cannot serve again; closing its channel")
                await writer.drain()
                writer.close()  # the read loop ends on EOF, and the process with it
        finally:
            ctx.inflight -= 1

    hb = asyncio.create_task(heartbeat())
    try:
        while True:
            try:
                msg = await protocol.read_message(reader)
            except EOFError:
                return "coordinator closed the channel"
            except protocol.ProtocolError as exc:
                log.error("protocol error from the coordinator: %s", exc)
                return "protocol error"
            if isinstance(msg, protocol.Shutdown):
                stopping = protocol.Stopping(pid=os.getpid())
                send(protocol.Ok(id=msg.id, r=protocol.encode_answer(msg, stopping)))
                await writer.drain()
                return "shutdown requested"
            if not isinstance(msg, protocol.Request) or (fn := HANDLERS.get(type(msg))) is None:
                send(
                    protocol.Err(id=msg.id, error=f"this worker does not serve {msg.kind!r}", tb="")
                )
                continue
            task = asyncio.create_task(run_one(fn, msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        hb.cancel()
        for task in tasks:
            task.cancel()


async def _main_async(args: argparse.Namespace, key: bytes, start: _Start) -> str:
    reader, writer = await asyncio.open_unix_connection(args.socket, limit=1 << 20)
    welcome = await _handshake(reader, writer, key, args.rank, start)
    ctx = _make_context(args, welcome)
    log.info(
        "rank %d/%d ready on %s (pid %d, %s loop)",
        ctx.rank,
        ctx.world_size,
        ctx.device,
        os.getpid(),
        type(asyncio.get_running_loop()).__module__.split(".")[0],
    )
    try:
        return await _serve(ctx, reader, writer, welcome.hb_interval)
    finally:
        writer.close()
        ctx.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m workers", description="H3 MultiStream worker (started by the pool)"
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--program", default=None, help="rank program: imports workers.<program>.rank")
    args = p.parse_args(argv)

    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if config.DEBUG.get() else logging.INFO,
        format=f"%(asctime)s.%(msecs)03d rank{args.rank} %(levelname)s %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    _die_with_parent(args.parent_pid)
    start = _Start()
    t = time.monotonic()
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(args.device))
        start.device_s = time.monotonic() - t
    try:
        key = auth.read_key(sys.stdin.buffer)
    except auth.AuthError as exc:
        log.error("%s", exc)
        return 2
    t = time.monotonic()
    try:
        load_program(args.program)
    except ProgramNotFound as exc:
        log.error("%s", exc)
        return 2
    start.program_s = time.monotonic() - t
    start.connect_at = time.monotonic()
    loop = _new_loop()
    try:
        reason = loop.run_until_complete(_main_async(args, key, start))
    except (TimeoutError, auth.AuthError, protocol.ProtocolError, OSError) as exc:
        log.error("rank %d stopping: %s: %s", args.rank, type(exc).__name__, exc)
        return 2
    log.info("rank %d exiting: %s", args.rank, reason)
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # A compute thread may still be running a kernel; do not wait for it.
    os._exit(code)
