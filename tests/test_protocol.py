"""Unit tests of the wire protocol (workers/runtime/protocol.py) and the key/challenge helpers (workers/runtime/auth.py)."""
import asyncio
import io
import struct

import msgpack
import msgspec
import pytest

from workers.runtime import auth, protocol
from workers.runtime.protocol import ProtocolError, decode, encode
from workers.testing import protocol as test_protocol

pytestmark = pytest.mark.fast

SEG = "h3ms-123-0123456789abcdef-x"


def body(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def desc(**kw) -> protocol.TensorDesc:
    return protocol.TensorDesc(**{"seg": SEG, "off": 0, "dtype": "uint8", "shape": [1], **kw})


class Blob(protocol.Answer):
    """An answer with one free-form field, for the checks every answer's free-form fields meet."""

    a: protocol.Plain
    PLAIN = ("a",)


def answer(obj, kind: type[protocol.Answer] = Blob) -> protocol.Answer:
    """Decode the frame ``{k: ok, id: 1, r: obj}``, then its ``r`` as ``kind`` (as the channel
    does)."""
    msg = decode(body({"k": "ok", "id": 1, "r": obj}))
    assert isinstance(msg, protocol.Ok)
    return protocol.decode_answer(kind, msg.r)


def test_frame_is_big_endian_length_plus_msgpack_map():
    frame = encode(protocol.Ping(id=7))
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    assert msgpack.unpackb(frame[4:]) == {"k": "ping", "id": 7}
    assert decode(frame[4:]) == protocol.Ping(id=7)


@pytest.mark.parametrize("msg", [
    protocol.Ok(id=1, r=protocol.encode_answer(protocol.Ping(),
                                               protocol.Pong(pong=True, pid=1, rank=0))),
    protocol.Err(id=2, error="boom", tb="Traceback..."),
    protocol.Heartbeat(rss=10, vram=None, busy=False),
    protocol.Heartbeat(rss=10, vram=5, busy=True),
    protocol.Echo(id=3, src=desc(off=4096, dtype="bfloat16", shape=[2, 3]), dst=desc(shape=[12])),
    test_protocol.Crash(id=4),
    test_protocol.Crash(id=4, how="exit", code=3),
    test_protocol.Sleep(id=5, seconds=2.0),
])
def test_roundtrip(msg):
    got = decode(encode(msg)[4:])
    assert type(got) is type(msg) and got == msg


def test_program_messages_roundtrip():
    from workers.attention.protocol import AttnCall
    from workers.dit.protocol import DitStep
    from workers.vae.protocol import VaeChunk

    d = desc(dtype="float32", shape=[4, 8])
    step = DitStep(id=9, job=1, x=d, modulation=d, rope=d, segments=[(0, 2, 5), (2, 4, desc(dtype="int64", shape=[2]))],
                   tokens=(0, 2), arena="", layout={"world": 2}, exchange="host", chunks=1, abort_gen=0,
                   deadline_s=1.0, blocks=(0, 3), residency="auto")
    got = decode(encode(step)[4:])
    assert got == step and isinstance(got.segments[1][2], protocol.TensorDesc) and got.x.nbytes == 128
    for msg in (VaeChunk(id=1, job=1, index=0, z=d, out=None), AttnCall(id=2, job=1, first=True, tensors={"q": d}, meta={}, out=d)):
        assert decode(encode(msg)[4:]) == msg
    bad_exchange = msgpack.unpackb(encode(step)[4:])
    bad_exchange["exchange"] = "carrier pigeon"
    with pytest.raises(ProtocolError, match="exchange"):
        decode(body(bad_exchange))


def test_dit_refresh_names_blocks_once_in_order():
    from workers.dit.protocol import DitRefresh, DitRefreshed

    ok = DitRefresh(id=3, store=SEG, key="k", blocks=[(0, ["attn.qkv_proj.weight"]), (4, ["mlp.fc1.weight", "x"])])
    assert decode(encode(ok)[4:]) == ok and DitRefresh.ANSWER is DitRefreshed
    for blocks, needle in (([(1, ["a"]), (0, ["b"])], "ascending"), ([(1, ["a"]), (1, ["b"])], "each once"),
                           ([(-1, ["a"])], ">= 0"), ([(0, [])], "at least one tensor"), ([(0, [""])], "none empty")):
        frame = msgpack.unpackb(encode(ok)[4:])
        frame["blocks"] = blocks
        with pytest.raises(ProtocolError, match=needle):
            decode(body(frame))


@pytest.mark.parametrize("obj, needle", [
    ([1, 2], "Expected `object`, got `array`"),
    ({"id": 1}, "missing required field `k`"),
    ({"k": 5, "id": 1}, "`$.k`"),
    ({"k": "nope", "id": 1}, "unknown message kind 'nope'"),
    ({"k": "ping", "id": True}, "`$.id`"),
    ({"k": "ping", "id": -1}, "`$.id`"),
    ({"k": "ping", "id": 2 ** 63}, "`$.id`"),
    ({"k": "ping", "id": "1"}, "`$.id`"),
    ({"k": "ping", "id": 1, "extra": 1}, "unknown field `extra`"),
    ({"k": "hb", "id": 0, "rss": "x", "vram": None, "busy": True}, "`$.rss`"),
    ({"k": "hb", "id": 0, "rss": True, "vram": None, "busy": True}, "`$.rss`"),
    ({"k": "hb", "id": 0, "rss": 1.5, "vram": None, "busy": True}, "`$.rss`"),
    ({"k": "hb", "id": 0, "rss": None, "vram": None, "busy": True}, "`$.rss`"),
    ({"k": "hb", "id": 0, "rss": 1, "vram": None, "busy": 1}, "`$.busy`"),
    ({"k": "hb", "id": 0, "rss": 1, "busy": True}, "missing required field `vram`"),
    ({"k": "err", "id": 1, "error": b"bytes", "tb": ""}, "`$.error`"),
    ({"k": "crash", "id": 1, "how": "melt"}, "`$.how`"),
    ({"k": "echo", "id": 1, "src": {"seg": "../../etc/passwd", "off": 0, "dtype": "uint8", "shape": [1]},
      "dst": {"seg": SEG, "off": 0, "dtype": "uint8", "shape": [1]}},
      "is not a segment name h3ms-<pid>-<hex>-<tag> - at `$.src`"),
])
def test_schema_violations(obj, needle):
    with pytest.raises(ProtocolError) as ei:
        decode(body(obj))
    assert needle in str(ei.value)


def test_malformed_bodies():
    for raw in [b"", b"\xc1", b"\x81\xa1k", body({"k": "ping", "id": 1}) + b"\x00", b"\xff" * 10,
                msgpack.packb({"k": "ping", "id": 1, "x": msgpack.ExtType(5, b"ab")}),
                b"\x91" * 5000 + b"\xc0"]:
        with pytest.raises(ProtocolError):
            decode(raw)


def test_limits_before_allocation():
    big_str = body({"k": "err", "id": 1, "error": "x" * (protocol.MAX_STR_LEN + 1), "tb": ""})
    with pytest.raises(ProtocolError, match="length <= 4194304"):
        decode(big_str)
    with pytest.raises(ProtocolError, match="MAX_STR_LEN"):
        answer({"a": {"s": "x" * (protocol.MAX_STR_LEN + 1)}})
    with pytest.raises(ProtocolError, match="MAX_ARRAY_LEN"):
        answer({"a": {"a": [0] * (protocol.MAX_ARRAY_LEN + 1)}})
    # an array header claiming more items than the frame holds, with no items behind it
    claim = b"\x83\xa1k\xa2ok\xa2id\x01\xa1r\x81\xa1a\xdd" + struct.pack(">I", protocol.MAX_ARRAY_LEN + 1)
    with pytest.raises(ProtocolError, match="truncated"):
        decode(claim)
    with pytest.raises(ProtocolError, match="exceeds MAX_FRAME_BYTES"):
        decode(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))
    deep = {"a": 1}
    for _ in range(protocol.MAX_DEPTH + 2):
        deep = {"a": deep}
    with pytest.raises(ProtocolError, match="nested"):
        answer({"a": deep})


@pytest.mark.parametrize("r, kind, needle", [
    ([1], protocol.Pong, "Expected `object`, got `array`"),
    ({"pong": True, "pid": 1}, protocol.Pong, "missing required field `rank`"),
    ({"pong": "yes", "pid": 1, "rank": 0}, protocol.Pong, "`$.pong`"),
    ({"pong": True, "pid": 1, "rank": 0, "extra": 1}, protocol.Pong, "unknown field `extra`"),
    ({"released": True}, protocol.Pong, "unknown field `released`"),  # another kind's answer
    ({1: 2}, Blob, "Expected `str`"),
    ({"a": {"b": {1: 2}}}, Blob, "map key"),
    ({"a": {"x": msgpack.ExtType(5, b"ab")}}, Blob, "ext type 5"),
])
def test_answer_violations(r, kind, needle):
    """An ``ok`` frame's envelope decodes alone; its ``r`` is checked as the request kind's
    answer struct."""
    with pytest.raises(ProtocolError) as ei:
        answer(r, kind)
    assert needle in str(ei.value)


def test_answers_keep_the_wire_map():
    pong = protocol.Pong(pong=True, pid=7, rank=1, serves=["ping"])
    frame = encode(protocol.Ok(id=3, r=protocol.encode_answer(protocol.Ping(), pong)))
    wire = {"pong": True, "pid": 7, "rank": 1, "serves": ["ping"]}
    assert msgpack.unpackb(frame[4:]) == {"k": "ok", "id": 3, "r": wire}
    assert protocol.decode_answer(protocol.Ping.ANSWER, decode(frame[4:]).r) == pong
    assert test_protocol.Crash.ANSWER is protocol.Done and protocol.Echo.ANSWER is protocol.Echoed


def test_senders_meet_the_value_checks():
    with pytest.raises(ProtocolError, match="not allowed on the wire"):
        Blob(a={"obj": object()})
    with pytest.raises(ProtocolError, match="map key"):
        Blob(a={"a": {1: 2}})
    with pytest.raises(ProtocolError, match="answered with Done, not Pong"):
        protocol.encode_answer(protocol.Ping(), protocol.Done())
    big = msgspec.Raw(msgspec.msgpack.encode({"a": b"\x00" * (protocol.MAX_FRAME_BYTES + 1)}))
    with pytest.raises(ProtocolError, match="shared memory"):
        encode(protocol.Ok(id=1, r=big))
    with pytest.raises(ProtocolError, match="build a message struct"):
        encode({"k": "ping", "id": 1})


def test_tensor_desc():
    good = {"seg": SEG, "off": 8, "dtype": "int64", "shape": [3, 0, 2]}
    assert protocol.TensorDesc(**good).nbytes == 0
    assert desc(dtype="bfloat16", shape=[4, 5]).nbytes == 40
    for bad, needle in [
        ({**good, "off": 4}, "multiple of the int64 size"),
        ({**good, "off": -8}, "must be >= 0"),
        ({**good, "dtype": "complex64"}, "dtype 'complex64'"),
        ({**good, "shape": [1, -1]}, "shape"),
        ({**good, "shape": [1] * 9}, "at most 8"),
        ({**good, "seg": "h3ms-1-zz-x"}, "segment name"),
    ]:
        with pytest.raises(ProtocolError, match=needle):
            protocol.TensorDesc(**bad)
        with pytest.raises(ProtocolError, match=needle):  # the same check on the receiving side
            decode(body({"k": "echo", "id": 1, "src": bad, "dst": good}))
    for bad in [{**good, "shape": [True]}, {k: v for k, v in good.items() if k != "off"}, {**good, "extra": 1},
                "not a map"]:
        with pytest.raises(ProtocolError, match="src"):
            decode(body({"k": "echo", "id": 1, "src": bad, "dst": good}))


def test_declaring_kinds():
    class TProtoKind(protocol.Request, tag="t_proto_kind"):
        n: int
        x: float | None
        note: str = ""

    assert protocol.kinds()["t_proto_kind"] is TProtoKind
    assert decode(encode(TProtoKind(id=1, n=2, x=None))[4:]).n == 2
    assert decode(encode(TProtoKind(id=1, n=2, x=1.0, note="hi"))[4:]).note == "hi"
    with pytest.raises(ProtocolError, match="missing required field `x`"):
        decode(body({"k": "t_proto_kind", "id": 1, "n": 2}))
    with pytest.raises(ProtocolError, match=r"`\$\.note`"):
        decode(body({"k": "t_proto_kind", "id": 1, "n": 2, "x": 1.0, "note": None}))

    class Twin(protocol.Request, tag="t_proto_kind"):
        pass

    with pytest.raises(ProtocolError, match="declared twice"):
        protocol.kinds()
    protocol._DECLARED.remove(Twin)
    protocol._DECLARED.remove(TProtoKind)
    protocol._decoder = None
    assert "t_proto_kind" not in protocol.kinds()


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


def test_read_message():
    async def go():
        frame = encode(protocol.Ping(id=3))
        r = _reader(frame + frame)
        assert (await protocol.read_message(r)).id == 3
        assert (await protocol.read_message(r)).id == 3
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
