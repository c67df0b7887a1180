"""The coordinator's end of one worker channel: handshake, framing, request ids, deadlines,
protocol-error close, and the one decode of each answer as its request kind's answer struct.

All methods run on the coordinator loop.  A protocol error or EOF closes the channel, fails every
pending request with :class:`ChannelClosed`, and calls ``on_close`` once; other channels are
unaffected.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import socket
import struct
from collections.abc import Callable

from h3ms_async.log import get_logger
from workers.runtime import auth, protocol

log = get_logger("channel")

#: Largest frame an unauthenticated peer may send (an ``auth`` answer is ~100 bytes): a stranger
#: cannot make the coordinator buffer MAX_FRAME_BYTES per connection.
AUTH_FRAME_MAX = 4096


class ChannelClosed(ConnectionError):
    """The channel is closed (peer gone or protocol error); ``reason`` says which."""


class RemoteError(RuntimeError):
    """The worker's handler raised; carries the worker's error text and traceback."""

    def __init__(self, name: str, kind: str, error: str, tb: str) -> None:
        super().__init__(
            f"{name}: {kind!r} failed: {error}"
            + (f"\n--- worker traceback ---\n{tb.rstrip()}" if tb else "")
        )
        self.error = error
        self.tb = tb


def peer_credentials(writer: asyncio.StreamWriter) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a unix socket."""
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


async def authenticate(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, timeout: float
) -> protocol.Auth:
    """Challenge a freshly connected peer; return its verified answer (rank, pid, start phases).

    Raises :class:`auth.AuthError` for a wrong key, :class:`protocol.ProtocolError` for anything
    that is not an ``auth`` answer, ``EOFError`` / ``TimeoutError`` if the peer goes away or stays
    silent.
    """
    nonce = auth.new_nonce()
    writer.write(protocol.encode(protocol.Challenge(nonce=nonce)))
    await writer.drain()
    try:
        msg = await asyncio.wait_for(protocol.read_message(reader, AUTH_FRAME_MAX), timeout)
    except TimeoutError:
        raise TimeoutError(f"the peer sent no auth answer within {timeout:g} s") from None
    if not isinstance(msg, protocol.Auth):
        raise protocol.ProtocolError(f"expected 'auth' as the first message, got {msg.kind!r}")
    if not auth.verify(key, nonce, msg.rank, msg.mac):
        raise auth.AuthError(f"wrong key (claimed rank {msg.rank}, pid {msg.pid})")
    return msg


class Channel:
    """Request/response over one authenticated connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        name: str,
        *,
        on_heartbeat: Callable[[protocol.Heartbeat], None] | None = None,
        on_close: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._on_heartbeat = on_heartbeat
        self._on_close = on_close
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[protocol.Request, asyncio.Future]] = {}
        self._task: asyncio.Task | None = None
        self.close_reason: str | None = None

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Start reading answers and heartbeats."""
        self._task = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"h3ms-read-{self.name}"
        )

    async def send(self, msg: protocol.Message) -> None:
        """Send one message."""
        if self.closed:
            raise ChannelClosed(f"{self.name}: channel closed ({self.close_reason})")
        self._writer.write(protocol.encode(msg))
        await self._writer.drain()

    async def request(self, msg: protocol.Request, timeout: float = 60.0) -> protocol.Answer:
        """Send a request (under a fresh request id; ``msg`` itself is left as it is) and wait for
        its answer, a ``msg.ANSWER`` struct (an answer that is not one breaks the protocol: the
        channel closes).

        Raises :class:`RemoteError` when the worker's handler failed, :class:`ChannelClosed` when
        the channel closes first, ``TimeoutError`` naming the channel and kind when ``timeout``
        passes.
        """
        if not isinstance(msg, protocol.Request):
            raise TypeError(
                f"{type(msg).__name__} is not a request; build a Request struct of "
                "workers/*/protocol.py"
            )
        kind = msg.kind
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (msg, fut)
        try:
            # A copy, not structs.replace: replace re-runs __post_init__, re-checking every
            # free-form field (a step's layout) the sender's build already checked, once per
            # request.
            sent = copy.copy(msg)
            sent.id = rid
            await self.send(sent)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"{self.name}: no answer to {kind!r} (request {rid}) within {timeout:g} s"
                ) from None
        finally:
            self._pending.pop(rid, None)  # from here on no answer can land in ``fut``
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                # An answer that landed while this request was being cancelled: the shield had
                # already let go of it, so nobody reads it, and asyncio would print it as "Future
                # exception was never retrieved".
                fut.exception()

    async def _read_loop(self) -> None:
        reason = "closed"
        try:
            while True:
                msg = await protocol.read_message(self._reader)
                if not isinstance(msg, protocol.WORKER_TO_COORDINATOR):
                    raise protocol.ProtocolError(f"a worker may not send {msg.kind!r}")
                if isinstance(msg, protocol.Heartbeat):
                    if self._on_heartbeat is not None:
                        self._on_heartbeat(msg)
                    continue
                entry = self._pending.get(msg.id)
                if entry is None:
                    log.debug(
                        "%s: answer to request %d that nobody waits for (timed out?)",
                        self.name,
                        msg.id,
                    )
                    continue
                req, fut = entry
                if fut.done():
                    continue
                if isinstance(msg, protocol.Ok):
                    fut.set_result(protocol.decode_answer(req.ANSWER, msg.r))
                else:
                    fut.set_exception(RemoteError(self.name, req.kind, msg.error, msg.tb))
        except EOFError:
            reason = "the worker closed its channel"
        except protocol.ProtocolError as exc:
            reason = f"protocol error: {exc}"
            log.error("%s: %s; closing this channel", self.name, reason)
        except (ConnectionError, OSError) as exc:
            reason = f"connection error: {exc}"
        except asyncio.CancelledError:
            reason = "channel closed by the coordinator"
            raise
        finally:
            self._shut(reason)

    def _shut(self, reason: str) -> None:
        if self.closed:
            return
        self.close_reason = reason
        self._writer.close()
        for req, fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(
                    ChannelClosed(f"{self.name}: {reason} while {req.kind!r} was pending")
                )
        if self._on_close is not None:
            self._on_close(reason)

    def close(self, reason: str = "closed by the coordinator") -> None:
        """Close now: pending requests fail, the reader stops."""
        self._shut(reason)
        if (
            self._task is not None
            and not self._task.done()
            and self._task is not asyncio.current_task()
        ):
            self._task.cancel()
