"""The wire protocol between the coordinator and its workers, written down once, in code that validates it.

Frame: a 4-byte big-endian unsigned length, then that many bytes holding exactly one msgpack map.
Every message map has ``"k"`` (its kind, a str) and ``"id"`` (an int request id; 0 for messages that answer
nothing).  ``KINDS`` declares, per kind, which other fields it carries and their types; :func:`decode` checks a
frame against it and raises :class:`ProtocolError` for anything else, and :func:`encode` refuses to send what the
peer would refuse.  Both peers read frames with :func:`read_message`, so the limits hold on both sides and are
checked before anything is allocated.

Conversation (every arrow is one frame)::

    coordinator                                worker
        ── challenge {nonce} ─────────────────────►
        ◄──────────────────── auth {rank, pid, mac}     mac = HMAC-SHA256(key, nonce || rank), see auth.py
        ── welcome {...} or refused {error} ──────►
        ── <request kind> {id: n, ...} ───────────►
        ◄──────── ok {id: n, r: {...}} | err {id: n, error, tb}
        ◄──────── hb {id: 0, rss, vram, busy}        unsolicited, about every second

Field types: ``int``, ``float`` (an int is accepted), ``str``, ``bytes``, ``bool``, ``list``, ``dict``, ``desc`` (a
tensor descriptor, see :func:`check_tensor_desc`).  A trailing ``|None`` makes the value nullable, a trailing ``?``
makes the field optional (it may be absent): ``"int|None"``, ``"float?"``, ``"str|None?"``.
"""
from __future__ import annotations

import asyncio
import re
import struct
from typing import Any, Mapping

import msgpack

from workers.runtime import config


class ProtocolError(Exception):
    """A frame or message that breaks this protocol; the channel that carried it is closed."""


#: Largest frame body either side accepts or sends (override with H3MS_MAX_FRAME_BYTES; both sides read it).
MAX_FRAME_BYTES: int = config.MAX_FRAME_BYTES.get()
#: Per-object msgpack limits; an object over them is refused before it is built.
MAX_STR_LEN = 4 * 1024 * 1024
MAX_BIN_LEN = MAX_FRAME_BYTES
MAX_ARRAY_LEN = 1 << 16
MAX_MAP_LEN = 1 << 16
#: Deepest nesting of lists/maps inside a message.
MAX_DEPTH = 32
HEADER = struct.Struct(">I")
MAX_REQUEST_ID = (1 << 63) - 1

_BASE_TYPES = ("int", "float", "str", "bytes", "bool", "list", "dict", "desc")


class FieldSpec:
    """One field's declared type: base type, whether ``None`` is allowed, whether the field may be absent."""

    __slots__ = ("base", "nullable", "optional")

    def __init__(self, spec: str) -> None:
        text = spec.strip()
        self.optional = text.endswith("?")
        text = text.rstrip("?")
        self.nullable = text.endswith("|None")
        if self.nullable:
            text = text[: -len("|None")]
        if text not in _BASE_TYPES:
            raise ValueError(f"field type {spec!r} is not one of {_BASE_TYPES} (optionally with '|None' and/or '?')")
        self.base = text

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        base = self.base
        if base == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if base == "float":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if base == "str":
            return isinstance(value, str)
        if base == "bytes":
            return isinstance(value, (bytes, bytearray, memoryview))
        if base == "bool":
            return isinstance(value, bool)
        if base == "list":
            return isinstance(value, (list, tuple))
        if base == "dict":
            return isinstance(value, dict)
        try:  # desc
            check_tensor_desc(value)
        except ProtocolError:
            return False
        return True

    def __repr__(self) -> str:
        return f"{self.base}{'|None' if self.nullable else ''}{'?' if self.optional else ''}"


#: kind -> {field name -> FieldSpec}; "k" and "id" are implicit in every kind.
KINDS: dict[str, dict[str, FieldSpec]] = {}


def register_kind(name: str, fields: Mapping[str, str]) -> None:
    """Declare a message kind and its fields (``{"step": "int", "x": "desc", "note": "str?"}``).

    Registering the same kind again with the same fields is a no-op (modules may be imported twice); with
    different fields it is an error, so two modules cannot silently disagree about a kind.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name):
        raise ValueError(f"message kind {name!r} must be lower-case letters, digits, '_' (1-32 chars)")
    specs = {}
    for field, spec in fields.items():
        if field in ("k", "id") or not isinstance(field, str) or not field:
            raise ValueError(f"kind {name!r}: field name {field!r} is reserved or empty")
        specs[field] = FieldSpec(spec)
    old = KINDS.get(name)
    if old is not None:
        if {f: repr(s) for f, s in old.items()} != {f: repr(s) for f, s in specs.items()}:
            raise ValueError(f"message kind {name!r} is already registered with other fields: {old}")
        return
    KINDS[name] = specs


def is_known(kind: str) -> bool:
    """Whether ``kind`` is in the table."""
    return kind in KINDS


# -- core kinds -------------------------------------------------------------------------------------------------
# handshake
register_kind("challenge", {"nonce": "bytes"})
register_kind("auth", {"rank": "int", "pid": "int", "mac": "bytes"})
register_kind("welcome", {
    "world_size": "int", "device": "str", "run_dir": "str", "doorbell_fds": "list", "control": "str",
    "hb_interval": "float",
})
register_kind("refused", {"error": "str"})
# answers and heartbeats (worker -> coordinator)
register_kind("ok", {"r": "dict"})
register_kind("err", {"error": "str", "tb": "str"})
register_kind("hb", {"rss": "int", "vram": "int|None", "busy": "bool"})
# core requests (coordinator -> worker)
register_kind("ping", {})
register_kind("echo", {"src": "desc", "dst": "desc"})
register_kind("drop_released", {})
register_kind("shutdown", {})
# test hooks: the worker serves them only with H3MS_TEST_HOOKS=1
register_kind("sleep", {"seconds": "float"})
register_kind("crash", {"how": "str?", "code": "int?"})
register_kind("hang", {"seconds": "float"})
register_kind("inject", {"raw": "bytes", "close": "bool?"})

#: Kinds a worker may send after the handshake.
WORKER_TO_COORDINATOR = frozenset({"ok", "err", "hb"})

# -- tensor descriptors -----------------------------------------------------------------------------------------
#: dtype name -> element size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
#: h3ms-<owner pid>-<owner fd, 8 hex><inode, 16 hex>-<tag> (see workers/runtime/shm.py)
SEGMENT_NAME_RE = re.compile(r"^h3ms-([0-9]{1,10})-([0-9a-f]{8,64})-([A-Za-z0-9_.]{1,48})$")
_DESC_KEYS = frozenset({"seg", "off", "dtype", "shape"})
MAX_DIMS = 8


def check_tensor_desc(d: Any) -> dict:
    """Validate a tensor descriptor ``{seg: str, off: int, dtype: str, shape: list[int]}`` and return it.

    ``seg`` must be a segment name of this pack (so a descriptor can never point at another file), ``off`` a
    non-negative multiple of the element size, ``shape`` at most 8 non-negative ints.
    """
    if not isinstance(d, dict):
        raise ProtocolError(f"tensor descriptor must be a map, got {type(d).__name__}")
    keys = set(d)
    if keys != _DESC_KEYS:
        raise ProtocolError(f"tensor descriptor keys {sorted(map(str, keys))} != {sorted(_DESC_KEYS)}")
    seg, off, dtype, shape = d["seg"], d["off"], d["dtype"], d["shape"]
    if not isinstance(seg, str) or not SEGMENT_NAME_RE.match(seg):
        raise ProtocolError(f"tensor descriptor seg {seg!r} is not a segment name h3ms-<pid>-<hex>-<tag>")
    if dtype not in DTYPE_SIZES:
        raise ProtocolError(f"tensor descriptor dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if not isinstance(off, int) or isinstance(off, bool) or off < 0 or off % DTYPE_SIZES[dtype]:
        raise ProtocolError(f"tensor descriptor off {off!r} must be an int >= 0, a multiple of the {dtype} size")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < (1 << 40) for n in shape):
        raise ProtocolError(f"tensor descriptor shape {shape!r} must be a list of at most {MAX_DIMS} ints >= 0")
    return d


def desc_nbytes(d: Mapping[str, Any]) -> int:
    """Bytes covered by a (valid) tensor descriptor."""
    n = DTYPE_SIZES[d["dtype"]]
    for dim in d["shape"]:
        n *= dim
    return n


# -- validation, encode, decode ---------------------------------------------------------------------------------
def _check_plain(value: Any, depth: int, where: str) -> None:
    """Only msgpack's plain types, string map keys, bounded nesting (no ext types, no timestamps)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, bytearray, memoryview)):
        return
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH}")
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, depth + 1, where)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"{where}: map key {key!r} is not a str")
            _check_plain(item, depth + 1, where)
        return
    raise ProtocolError(f"{where}: value of type {type(value).__name__} is not allowed on the wire")


def validate(msg: Any) -> dict:
    """Check one message map against the kind table; return it or raise :class:`ProtocolError`."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a map, got {type(msg).__name__}")
    kind = msg.get("k")
    if not isinstance(kind, str):
        raise ProtocolError(f"message field 'k' must be a str kind, got {kind!r:.60}")
    specs = KINDS.get(kind)
    if specs is None:
        raise ProtocolError(f"unknown message kind {kind!r:.60}")
    rid = msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_REQUEST_ID:
        raise ProtocolError(f"{kind}: field 'id' must be an int in [0, 2^63), got {rid!r:.60}")
    for field, value in msg.items():
        if field in ("k", "id"):
            continue
        spec = specs.get(field) if isinstance(field, str) else None
        if spec is None:
            raise ProtocolError(f"{kind}: unexpected field {field!r:.60}")
        if not spec.accepts(value):
            raise ProtocolError(f"{kind}: field {field!r} must be {spec!r}, got {type(value).__name__} {value!r:.60}")
        _check_plain(value, 0, f"{kind}.{field}")
    for field, spec in specs.items():
        if not spec.optional and field not in msg:
            raise ProtocolError(f"{kind}: required field {field!r} ({spec!r}) is missing")
    return msg


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


def decode(body: bytes) -> dict:
    """Decode and validate one frame body (without its length header).  Raises only :class:`ProtocolError`."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext, timestamp=0,
            max_str_len=MAX_STR_LEN, max_bin_len=MAX_BIN_LEN, max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, UnicodeDecodeError, ...
        raise ProtocolError(f"frame is not one valid msgpack map: {type(exc).__name__}: {exc}"[:300]) from None
    return validate(msg)


def encode(msg: Mapping[str, Any]) -> bytes:
    """Validate and encode one message as a whole frame (header + body)."""
    validate(dict(msg))
    try:
        body = msgpack.packb(msg, use_bin_type=True)
    except Exception as exc:  # unencodable values
        raise ProtocolError(f"{msg.get('k')}: cannot encode message: {exc}") from None
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"{msg.get('k')}: message of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}; "
            "move large payloads to shared memory and send a tensor descriptor")
    return HEADER.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, max_bytes: int | None = None) -> dict:
    """Read and decode one frame of at most ``max_bytes`` (default ``MAX_FRAME_BYTES``).  EOF exactly at a frame
    boundary raises ``EOFError``; anything else that is wrong (over-long length, truncated frame, bad body) raises
    :class:`ProtocolError`."""
    limit, name = (MAX_FRAME_BYTES, "MAX_FRAME_BYTES") if max_bytes is None else (max_bytes, "the pre-auth limit")
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError("peer closed the channel") from None
        raise ProtocolError(f"truncated frame header ({len(exc.partial)} of {HEADER.size} bytes)") from None
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise ProtocolError(f"frame length {length} exceeds {name}={limit}")
    if length == 0:
        raise ProtocolError("empty frame")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"truncated frame: {len(exc.partial)} of {length} bytes before EOF") from None
    return decode(body)
