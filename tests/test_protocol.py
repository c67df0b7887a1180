"""Unit tests of the wire protocol (workers/runtime/protocol.py) and the key/challenge helpers (workers/runtime/auth.py)."""
import asyncio
import io
import struct

import msgpack
import pytest

from workers.runtime import auth, protocol
from workers.runtime.protocol import ProtocolError, decode, encode

SEG = "h3ms-123-0123456789abcdef-x"


def body(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_frame_is_big_endian_length_plus_msgpack_map():
    frame = encode({"k": "ping", "id": 7})
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    assert decode(frame[4:]) == {"k": "ping", "id": 7}


@pytest.mark.parametrize("msg", [
    {"k": "ok", "id": 1, "r": {"a": [1, 2.5, "x", b"\x00", None, True]}},
    {"k": "err", "id": 2, "error": "boom", "tb": "Traceback..."},
    {"k": "hb", "id": 0, "rss": 10, "vram": None, "busy": False},
    {"k": "hb", "id": 0, "rss": 10, "vram": 5, "busy": True},
    {"k": "echo", "id": 3, "src": {"seg": SEG, "off": 4096, "dtype": "bfloat16", "shape": [2, 3]},
     "dst": {"seg": SEG, "off": 0, "dtype": "uint8", "shape": [12]}},
    {"k": "crash", "id": 4},
    {"k": "crash", "id": 4, "how": "exit", "code": 3},
    {"k": "sleep", "id": 5, "seconds": 2},
])
def test_roundtrip(msg):
    assert decode(encode(msg)[4:]) == msg


@pytest.mark.parametrize("obj, needle", [
    ([1, 2], "must be a map"),
    ({"id": 1}, "'k'"),
    ({"k": 5, "id": 1}, "'k'"),
    ({"k": "nope", "id": 1}, "unknown message kind 'nope'"),
    ({"k": "ping"}, "'id'"),
    ({"k": "ping", "id": True}, "'id'"),
    ({"k": "ping", "id": -1}, "'id'"),
    ({"k": "ping", "id": "1"}, "'id'"),
    ({"k": "ping", "id": 1, "extra": 1}, "unexpected field 'extra'"),
    ({"k": "hb", "id": 0, "rss": "x", "vram": None, "busy": True}, "field 'rss' must be int"),
    ({"k": "hb", "id": 0, "rss": True, "vram": None, "busy": True}, "field 'rss' must be int"),
    ({"k": "hb", "id": 0, "rss": 1.5, "vram": None, "busy": True}, "field 'rss' must be int"),
    ({"k": "hb", "id": 0, "rss": None, "vram": None, "busy": True}, "field 'rss' must be int"),
    ({"k": "hb", "id": 0, "rss": 1, "vram": None, "busy": 1}, "field 'busy' must be bool"),
    ({"k": "hb", "id": 0, "rss": 1, "busy": True}, "required field 'vram'"),
    ({"k": "err", "id": 1, "error": b"bytes", "tb": ""}, "field 'error' must be str"),
    ({"k": "ok", "id": 1, "r": [1]}, "field 'r' must be dict"),
    ({"k": "ok", "id": 1, "r": {"a": {1: 2}}}, "map key"),
    ({"k": "echo", "id": 1, "src": {"seg": "../../etc/passwd", "off": 0, "dtype": "uint8", "shape": [1]},
      "dst": {"seg": SEG, "off": 0, "dtype": "uint8", "shape": [1]}}, "field 'src' must be desc"),
])
def test_schema_violations(obj, needle):
    with pytest.raises(ProtocolError, match=None) as ei:
        decode(body(obj))
    assert needle in str(ei.value)


def test_malformed_bodies():
    for raw in [b"", b"\xc1", b"\x81\xa1k", body({"k": "ping", "id": 1}) + b"\x00", b"\xff" * 10,
                msgpack.packb({"k": "ping", "id": 1, "x": msgpack.ExtType(5, b"ab")}),
                msgpack.packb({"k": "ok", "id": 1, "r": {"t": msgpack.Timestamp(1)}}, datetime=False),
                b"\x91" * 5000 + b"\xc0"]:
        with pytest.raises(ProtocolError):
            decode(raw)


def test_limits_before_allocation():
    big_str = body({"k": "err", "id": 1, "error": "x" * (protocol.MAX_STR_LEN + 1), "tb": ""})
    with pytest.raises(ProtocolError, match="msgpack"):
        decode(big_str)
    # an array header claiming more items than allowed, with no items behind it
    claim = b"\x83\xa1k\xa2ok\xa2id\x01\xa1r\x81\xa1a\xdd" + struct.pack(">I", protocol.MAX_ARRAY_LEN + 1)
    with pytest.raises(ProtocolError):
        decode(claim)
    with pytest.raises(ProtocolError, match="exceeds MAX_FRAME_BYTES"):
        decode(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))
    deep = {"a": 1}
    for _ in range(protocol.MAX_DEPTH + 2):
        deep = {"a": deep}
    with pytest.raises(ProtocolError, match="nested"):
        decode(body({"k": "ok", "id": 1, "r": deep}))


def test_encode_refuses_invalid_and_oversized():
    with pytest.raises(ProtocolError, match="unknown message kind"):
        encode({"k": "bogus", "id": 1})
    with pytest.raises(ProtocolError, match="shared memory"):
        encode({"k": "ok", "id": 1, "r": {"blob": b"\x00" * (protocol.MAX_FRAME_BYTES + 1)}})
    with pytest.raises(ProtocolError, match="not allowed on the wire"):
        encode({"k": "ok", "id": 1, "r": {"obj": object()}})


def test_tensor_desc():
    good = {"seg": SEG, "off": 8, "dtype": "int64", "shape": [3, 0, 2]}
    assert protocol.check_tensor_desc(good) is good
    assert protocol.desc_nbytes({"seg": SEG, "off": 0, "dtype": "bfloat16", "shape": [4, 5]}) == 40
    for bad in [
        {**good, "off": 4},            # not a multiple of 8 bytes
        {**good, "off": -8},
        {**good, "dtype": "complex64"},
        {**good, "shape": [1, -1]},
        {**good, "shape": [True]},
        {**good, "shape": [1] * 9},
        {**good, "seg": "h3ms-1-zz-x"},
        {k: v for k, v in good.items() if k != "off"},
        {**good, "extra": 1},
        "not a map",
    ]:
        with pytest.raises(ProtocolError):
            protocol.check_tensor_desc(bad)


def test_register_kind():
    protocol.register_kind("t_proto_kind", {"n": "int", "x": "float|None", "note": "str?", "d": "desc?"})
    protocol.register_kind("t_proto_kind", {"n": "int", "x": "float|None", "note": "str?", "d": "desc?"})
    assert decode(encode({"k": "t_proto_kind", "id": 1, "n": 2, "x": None})[4:])["n"] == 2
    assert decode(encode({"k": "t_proto_kind", "id": 1, "n": 2, "x": 1, "note": "hi"})[4:])["x"] == 1
    with pytest.raises(ProtocolError, match="required field 'x'"):
        decode(body({"k": "t_proto_kind", "id": 1, "n": 2}))
    with pytest.raises(ProtocolError, match="field 'note'"):
        decode(body({"k": "t_proto_kind", "id": 1, "n": 2, "x": 1.0, "note": None}))
    with pytest.raises(ValueError, match="already registered"):
        protocol.register_kind("t_proto_kind", {"n": "str"})
    with pytest.raises(ValueError, match="field type"):
        protocol.register_kind("t_proto_bad", {"n": "tensor"})
    with pytest.raises(ValueError, match="reserved"):
        protocol.register_kind("t_proto_bad", {"id": "int"})
    with pytest.raises(ValueError, match="lower-case"):
        protocol.register_kind("Bad Kind", {})


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


def test_read_message():
    async def go():
        frame = encode({"k": "ping", "id": 3})
        r = _reader(frame + frame)
        assert (await protocol.read_message(r))["id"] == 3
        assert (await protocol.read_message(r))["id"] == 3
        with pytest.raises(EOFError):
            await protocol.read_message(r)
        with pytest.raises(ProtocolError, match="truncated frame header"):
            await protocol.read_message(_reader(b"\x00\x00"))
        with pytest.raises(ProtocolError, match="truncated frame: 3 of 100"):
            await protocol.read_message(_reader(struct.pack(">I", 100) + b"abc"))
        with pytest.raises(ProtocolError, match="empty frame"):
            await protocol.read_message(_reader(struct.pack(">I", 0)))
        # refused from the header alone: no body was fed and no EOF is needed
        over = _reader(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1), eof=False)
        with pytest.raises(ProtocolError, match="exceeds MAX_FRAME_BYTES"):
            await asyncio.wait_for(protocol.read_message(over), 2)

    asyncio.run(go())


def test_auth_challenge_response():
    key, nonce = auth.new_key(), auth.new_nonce()
    assert len(key) == auth.KEY_BYTES and key != auth.new_key()
    mac = auth.response(key, nonce, 3)
    assert auth.verify(key, nonce, 3, mac)
    assert not auth.verify(auth.new_key(), nonce, 3, mac)
    assert not auth.verify(key, nonce, 4, mac)            # bound to the rank
    assert not auth.verify(key, auth.new_nonce(), 3, mac)  # bound to the nonce
    assert not auth.verify(key, nonce, -1, mac)
    assert auth.read_key(io.BytesIO(auth.key_line(key))) == key
    for bad in [b"", b"zz\n", b"abcd\n", key.hex().encode()[:-2] + b"\n"]:
        with pytest.raises(auth.AuthError, match="hex key line"):
            auth.read_key(io.BytesIO(bad))
