"""Fault family: hostile or vanished peers.  Strangers flooding the pool's socket with silent connections, a log
with no newlines, an event-stream client that leaves: each costs a bounded amount, briefly, and says why."""
import asyncio
import gc
import logging
import socket
import time
from pathlib import Path

import msgspec
import pytest

from h3ms_async.observability import serve
from h3ms_async.runtime.channel import Channel, ChannelClosed, RemoteError
from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.observability.routes import tail_file
from h3ms_async.runtime import admission
from h3ms_async.runtime.admission import MAX_HANDSHAKES_PER_RANK
from h3ms_async.runtime.pool import WorkerPool
from h3ms_async.status.hub import StatusHub
from workers.runtime import protocol


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(15)
    s.connect(path)
    return s


def _first_frame(s: socket.socket) -> protocol.Message | None:
    """The coordinator's first frame (its challenge), or None when it closed the connection instead."""
    head = s.recv(4)
    if not head:
        return None
    (n,) = protocol.HEADER.unpack(head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return protocol.decode(body)


def test_silent_strangers_get_bounded_slots_and_a_reason(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("H3MS_RUN_DIR", str(tmp_path))
    caplog.set_level(logging.ERROR, logger="h3_multistream")
    coord = get_coordinator()
    pool = WorkerPool(["cpu"], name="flood")
    coord.run(pool.start(), 120)
    monkeypatch.setattr(admission, "AUTH_TIMEOUT_S", 2.0)  # the pool's 10 s, shortened
    try:
        silent = [_connect(pool.socket_path) for _ in range(MAX_HANDSHAKES_PER_RANK)]
        assert all(isinstance(_first_frame(s), protocol.Challenge) for s in silent)
        extra = _connect(pool.socket_path)
        assert _first_frame(extra) is None  # over the limit: closed at once, nothing buffered for it
        extra.close()
        pong = coord.run(pool.request(0, protocol.Ping(), timeout=30), 60)
        assert pong.pong is True  # the pool serves on
        t0 = time.monotonic()
        for s in silent:  # each silent stranger is dropped after the auth deadline, with the reason
            answer = _first_frame(s)
            assert isinstance(answer, protocol.Refused)
            assert "no auth answer within 2 s" in answer.error
            assert s.recv(1) == b"" and time.monotonic() - t0 < 7
            s.close()
        logged = [r.getMessage() for r in caplog.records]
        refusals = "TimeoutError: the peer sent no auth answer within 2 s"
        assert sum(refusals in m for m in logged) == len(silent)
        assert any("handshakes already pending" in m for m in logged)
        again = _connect(pool.socket_path)  # the slots are free again
        assert isinstance(_first_frame(again), protocol.Challenge)
        again.close()
    finally:
        coord.run(pool.release(force=True), 60)


def _bytes_read() -> int:
    """This process's bytes read by system calls so far (``rchar``)."""
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io["rchar"])


def test_tail_of_a_huge_log_without_newlines_reads_a_bounded_part_and_is_not_empty(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_bytes(b"x" * 50_000_000 + b"END")
    before = _bytes_read()
    lines = tail_file(log, 200)
    assert _bytes_read() - before <= 9 * 2**20  # its 8 MiB bound (and what else this process read meanwhile)
    assert len(lines) == 1 and lines[0].endswith("xEND") and len(lines[0]) == 64 * 1024
    log.write_bytes(b"a\n" * 10 + b"last")
    assert tail_file(log, 3) == ["a", "a", "last"]


@pytest.mark.asyncio
async def test_an_event_stream_slot_is_freed_soon_after_its_client_leaves(aiohttp_client):
    app = serve.build_app(hub=StatusHub())
    client = await aiohttp_client(app)
    resp = await client.get("/h3multistream/events?timeout=60")
    assert resp.status == 200 and len(app[serve._STREAMS]) == 1
    resp.close()
    t0 = time.monotonic()
    while app[serve._STREAMS]:
        assert time.monotonic() - t0 < 3.0, "the stream slot stayed taken after its client left"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(5))
async def test_an_answer_landing_while_its_request_is_cancelled_is_never_printed(turns):
    """Ctrl-C during a step cancels the rank requests while the ranks' abort errors arrive: whichever lands first,
    no "Future exception was never retrieved" traceback may reach the user's terminal (it did, 1 run in 5)."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    ours, peer = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    channel = Channel(reader, writer, "rank 0 (cpu)")  # answers are delivered by hand, at a chosen turn
    task = asyncio.ensure_future(channel.request(protocol.Ping(), timeout=30))
    while not channel.pending:
        await asyncio.sleep(0)
    ((_, (req, answer)),) = channel._pending.items()
    task.cancel()
    for _ in range(turns):  # the cancellation unwinds through wait_for and the shield, one loop turn at a time
        await asyncio.sleep(0)
    if not answer.done():
        answer.set_exception(RemoteError(channel.name, req.kind, "ExchangeAborted: aborted",
                                         "Traceback ..."))
    with pytest.raises((asyncio.CancelledError, RemoteError)):
        await task
    del answer, task
    gc.collect()
    await asyncio.sleep(0)
    writer.close()
    peer.close()
    assert not [c for c in reported if "never retrieved" in c.get("message", "")]


@pytest.mark.asyncio
async def test_an_answer_is_decoded_as_its_request_kinds_struct():
    """The channel hands back the request kind's answer struct; an ``r`` that is not one closes
    the channel, naming the field, and fails the request."""
    ours, peer = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    peer_reader, peer_writer = await asyncio.open_unix_connection(sock=peer)
    channel = Channel(reader, writer, "rank 0 (cpu)")
    channel.start()

    async def answer(r: dict) -> None:
        msg = await protocol.read_message(peer_reader)
        body = msgspec.msgpack.encode({"k": "ok", "id": msg.id, "r": r})
        peer_writer.write(protocol.HEADER.pack(len(body)) + body)
        await peer_writer.drain()

    good = asyncio.ensure_future(channel.request(protocol.Ping(), timeout=10))
    await answer({"pong": True, "pid": 5, "rank": 0})
    assert await good == protocol.Pong(pong=True, pid=5, rank=0)
    bad = asyncio.ensure_future(channel.request(protocol.Ping(), timeout=10))
    await answer({"pong": True, "pid": "five", "rank": 0})
    with pytest.raises(ChannelClosed,
                       match=r"invalid Pong answer: Expected `int`, got `str` - at `\$.pid`"):
        await bad
    assert channel.closed
    peer_writer.close()
