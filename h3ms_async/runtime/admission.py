"""Admission on a pool start's socket: a connecting worker answers the auth challenge, must come
from its rank's own process (peer credentials) and connect once; it is then welcomed (world size,
device, run dir, doorbells, control block) and ready once it answers its first ping.  Pending
handshakes are bounded, so a flood of silent connections cannot hold the pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from functools import partial

from h3ms_async.log import get_logger
from h3ms_async.runtime.channel import (
    Channel,
    ChannelClosed,
    RemoteError,
    authenticate,
    peer_credentials,
)
from h3ms_async.runtime.control_block import ControlBlock
from h3ms_async.runtime.heartbeat import HB_INTERVAL, on_heartbeat, watch_heartbeat
from h3ms_async.runtime.worker_handle import StartTimes, WorkerHandle, WorkerState
from workers.runtime import auth, protocol

log = get_logger("pool")

#: Unauthenticated connections the pool serves at once, per rank; more are closed at once.
MAX_HANDSHAKES_PER_RANK = 2
#: How long a connecting peer has to answer the auth challenge before it is refused.
AUTH_TIMEOUT_S = 10.0


class Admission:
    """Admits the workers of one pool start (:meth:`on_connect` serves the start's socket)."""

    def __init__(
        self,
        *,
        pool: str,
        workers: Sequence[WorkerHandle],
        socket_path: str,
        key: bytes,
        run_dir: str,
        control: ControlBlock,
        start_timeout: float,
        hb_timeout: float,
    ) -> None:
        self._pool = pool
        self._workers = workers
        self._socket_path = socket_path
        self._key = key
        self._run_dir = run_dir
        self._control = control
        self._start_timeout = start_timeout
        self._hb_timeout = hb_timeout
        self._handshakes = 0

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Admit one connection, or refuse it when too many handshakes are pending."""
        if self._handshakes >= MAX_HANDSHAKES_PER_RANK * max(1, len(self._workers)):
            log.error(
                "pool %r refused a connection on %s: %d handshakes already pending",
                self._pool,
                self._socket_path,
                self._handshakes,
            )
            writer.close()
            return
        self._handshakes += 1
        try:
            await self._admit(reader, writer)
        finally:
            self._handshakes -= 1

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        workers = self._workers
        try:
            answer = await authenticate(reader, writer, self._key, timeout=AUTH_TIMEOUT_S)
            answered_at = time.monotonic()
            rank = answer.rank
            if not 0 <= rank < len(workers):
                raise auth.AuthError(f"rank {rank} is not in this pool of {len(workers)}")
            w = workers[rank]
            peer_pid = peer_credentials(writer)[0]
            if w.proc is None or peer_pid != w.proc.pid:
                raise auth.AuthError(
                    f"rank {rank} connected from pid {peer_pid}, but its worker is pid {w.pid}"
                )
            if w.state != WorkerState.STARTING or w.channel is not None:
                raise auth.AuthError(f"rank {rank} is already connected")
        except (TimeoutError, protocol.ProtocolError, auth.AuthError, EOFError, OSError) as exc:
            log.error(
                "pool %r refused a connection on %s: %s: %s",
                self._pool,
                self._socket_path,
                type(exc).__name__,
                exc,
            )
            # the peer may already be gone
            with contextlib.suppress(Exception):
                writer.write(
                    protocol.encode(protocol.Refused(error=f"{type(exc).__name__}: {exc}"[:400]))
                )
            writer.close()
            return
        ch = Channel(
            reader,
            writer,
            f"rank {rank} ({w.device})",
            on_heartbeat=partial(on_heartbeat, w),
            on_close=partial(_on_channel_close, w),
        )
        w.channel = ch
        ch.start()
        try:
            await ch.send(
                protocol.Welcome(
                    world_size=len(workers),
                    device="cuda:0" if w.device.startswith("cuda") else "cpu",
                    run_dir=self._run_dir,
                    doorbell_fds=list(self._control.doorbells),
                    control=self._control.segment.name,
                    hb_interval=HB_INTERVAL,
                )
            )
            pong = await ch.request(protocol.Ping(), timeout=self._start_timeout)
            assert isinstance(pong, protocol.Pong)  # decoded as Ping's ANSWER
        except (ChannelClosed, RemoteError, TimeoutError, OSError) as exc:
            w.mark_dead(f"failed its first ping: {exc}")
            return
        if w.state == WorkerState.STARTING:
            w.state = WorkerState.READY
            w.serves = frozenset(pong.serves or ())
            w.last_hb = time.monotonic()
            reported = answer.device_s + answer.program_s + answer.connect_s
            w.start = StartTimes(
                python_s=max(0.0, answered_at - w.started_at - reported),
                device_s=answer.device_s,
                program_s=answer.program_s,
                connect_s=answer.connect_s,
                welcome_s=w.last_hb - answered_at,
            )
            watch_heartbeat(w, self._hb_timeout)
            w.changed.set()


def _on_channel_close(w: WorkerHandle, reason: str) -> None:
    if w.state in (WorkerState.STARTING, WorkerState.READY):
        w.mark_dead(f"channel closed: {reason}")
