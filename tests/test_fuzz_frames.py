"""Property tests: decode never raises anything but ProtocolError, and a live pool survives 1000+ random frames."""
import os
import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h3ms_async.runtime.coordinator import get_coordinator
from h3ms_async.runtime.pool import WorkerPool
from workers.attention import protocol as _attn  # noqa: F401 - every program's kinds are fuzzed too
from workers.dit import protocol as _dit  # noqa: F401
from workers.runtime import protocol
from workers.runtime.protocol import ProtocolError
from workers.runtime.shm import held_shm
from workers.vae import protocol as _vae  # noqa: F401

KINDS = sorted(protocol.kinds())
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
field_names = st.sampled_from(["r", "rss", "vram", "busy", "error", "tb", "nonce", "rank", "pid", "mac", "src",
                               "dst", "seconds", "how", "code", "raw", "x", "seg", "off", "job", "index", "z", "out",
                               "meta", "tensors", "segments", "tokens"])
messages = st.fixed_dictionaries(
    {"k": st.one_of(st.sampled_from(KINDS), st.text(max_size=8), st.integers(-(2 ** 63), 2 ** 64 - 1)),
     "id": st.one_of(st.integers(-5, 2 ** 64 - 1), st.booleans(), st.none())},
    optional={"extra": values}).flatmap(
    lambda base: st.dictionaries(field_names, values, max_size=4).map(lambda more: {**more, **base}))


def check_decode(body: bytes) -> None:
    try:
        msg = protocol.decode(body)
    except ProtocolError:
        return
    frame = protocol.encode(msg)  # whatever decodes is a message that re-encodes to the same message
    assert protocol.encode(protocol.decode(frame[4:])) == frame


@pytest.mark.fast
@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_only_raises_protocol_error(body):
    check_decode(body)


@pytest.mark.fast
@settings(max_examples=1000, deadline=None)
@given(messages)
def test_random_maps_decode_only_raises_protocol_error(msg):
    check_decode(msgpack.packb(msg, use_bin_type=True))


@pytest.mark.fast
@settings(max_examples=300, deadline=None)
@given(messages, st.integers(0, 40), st.binary(max_size=8))
def test_mutated_frames_decode_only_raises_protocol_error(msg, cut, junk):
    body = msgpack.packb(msg, use_bin_type=True)
    check_decode(body[:cut] + junk + body[cut:])


@pytest.fixture(scope="module")
def live_pool():
    pool = WorkerPool(["cpu"], name="fuzz")
    get_coordinator().run(pool.start(), 120)
    yield pool
    get_coordinator().run(pool.release(), 60)
    assert held_shm(os.getpid()) == set()


flat_messages = st.fixed_dictionaries(
    {"k": st.one_of(st.sampled_from(KINDS), st.text(max_size=8)), "id": st.integers(-5, 2 ** 64 - 1)},
    optional={"rank": scalars, "pid": scalars, "mac": scalars, "rss": scalars, "r": scalars})
frames = st.one_of(
    st.binary(max_size=64),  # framing garbage
    flat_messages.map(lambda m: msgpack.packb(m, use_bin_type=True)).map(lambda b: struct.pack(">I", len(b)) + b),
    st.tuples(st.integers(0, 2 ** 32 - 1), st.binary(max_size=64)).map(lambda t: struct.pack(">I", t[0]) + t[1]),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames)
def test_live_pool_survives_random_frames(live_pool, raw):
    """Each random frame goes to the pool's socket as a fresh peer; the coordinator must close that peer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    with s:
        s.connect(live_pool.socket_path)
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us mid-send: refused early, which is fine


def test_live_pool_still_answers_after_fuzzing(live_pool):
    pong = get_coordinator().run(live_pool.request(0, protocol.Ping(), timeout=10), 20)
    assert pong.pong and live_pool.starts == 1
