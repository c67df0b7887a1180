"""The wire protocol between the coordinator and its workers: typed messages, validated once, while
decoding.

Frame: a 4-byte big-endian unsigned length, then that many bytes holding exactly one msgpack map.
Every message is a
:class:`Message` struct (msgspec), tagged by its kind in field ``"k"``, with ``"id"`` (an int
request id; 0 for messages that answer nothing).  A struct's annotations are its schema:
:func:`decode` turns a frame into the struct of its kind with ``msgspec.msgpack.Decoder`` over the
union of every declared kind, which checks types, refuses unknown kinds, unknown fields and missing
ones, and runs each struct's ``__post_init__`` (the value checks a type cannot say, e.g. a tensor
descriptor's offset alignment).  ``__post_init__`` also runs when a sender builds a message, so a
sender meets the same value checks as its peer; the field types are the sender's type checker's job.
Both peers read frames with :func:`read_message`, so the limits hold on both sides and are checked
before anything is allocated.

Conversation (every arrow is one frame)::

    coordinator                                worker
        ── challenge {nonce} ─────────────────────►     (handshake: see auth.py)
        ◄──────────────────── auth {rank, pid, mac}     mac = HMAC-SHA256(key, nonce || rank)
        ── welcome {...} or refused {error} ──────►
        ── <request kind> {id: n, ...} ───────────►
        ◄──────── ok {id: n, r: {...}} | err {id: n, error, tb}     r: the kind's answer
        ◄──────── hb {id: 0, rss, vram, busy}        unsolicited, about every second

A rank program declares its requests as :class:`Request` subclasses in its own
``workers/<program>/protocol.py``; defining the class is the declaration (importing the module adds
it to the decoder). Each request kind names its answer, an :class:`Answer` struct declared next to
it (``ANSWER``): the worker's handler returns one, the ``ok`` frame carries it as the map ``r``, and
the coordinator decodes and validates ``r`` as that struct once, when the answer arrives
(:func:`decode_answer`).
"""

from __future__ import annotations

import asyncio
import re
import struct
import threading
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Union

import msgspec

from workers.runtime import config


class ProtocolError(ValueError):
    """A frame or message that breaks this protocol; the channel that carried it is closed."""


#: Largest frame body either side accepts or sends (override with H3MS_MAX_FRAME_BYTES; both sides
#: read it).
MAX_FRAME_BYTES: int = config.MAX_FRAME_BYTES.get()
#: Limits inside a message: longest str, most items of a free-form list or map, deepest nesting of a
#: free-form field (``r``, ``config``, ...).  A length header that claims more than the frame holds
#: is refused before anything is allocated.
MAX_STR_LEN = 4 * 1024 * 1024
MAX_ARRAY_LEN = 1 << 16
MAX_MAP_LEN = 1 << 16
MAX_DEPTH = 32
Text = Annotated[str, msgspec.Meta(max_length=MAX_STR_LEN)]
HEADER = struct.Struct(">I")
MAX_REQUEST_ID = (1 << 63) - 1
RequestId = Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUEST_ID)]

# -- tensor descriptors ----------------------------------------------------------------------------
#: dtype name -> element size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
#: h3ms-<owner pid>-<owner fd, 8 hex><inode, 16 hex>-<tag> (see workers/runtime/shm.py)
SEGMENT_NAME_RE = re.compile(r"^h3ms-([0-9]{1,10})-([0-9a-f]{8,64})-([A-Za-z0-9_.]{1,48})$")
MAX_DIMS = 8
_MAX_DIM = 1 << 40


class TensorDesc(msgspec.Struct, forbid_unknown_fields=True):
    """Where a tensor lives in shared memory: ``seg`` (a segment name of this pack, so a descriptor
    can never point at another file), ``off`` (bytes, a non-negative multiple of the element size),
    ``dtype`` (a key of
    :data:`DTYPE_SIZES`), ``shape`` (at most 8 non-negative ints).  On the wire: the map ``{seg,
    off, dtype, shape}``."""

    seg: str
    off: int
    dtype: str
    shape: list[int]

    def __post_init__(self) -> None:
        if not SEGMENT_NAME_RE.match(self.seg):
            raise ProtocolError(
                f"tensor descriptor seg {self.seg!r:.80} is not a segment name "
                "h3ms-<pid>-<hex>-<tag>"
            )
        size = DTYPE_SIZES.get(self.dtype)
        if size is None:
            raise ProtocolError(
                f"tensor descriptor dtype {self.dtype!r:.40} is not one of {sorted(DTYPE_SIZES)}"
            )
        if self.off < 0 or self.off % size:
            raise ProtocolError(
                f"tensor descriptor off {self.off} must be >= 0 and a multiple of the {self.dtype} "
                f"size ({size})"
            )
        if len(self.shape) > MAX_DIMS or not all(0 <= n < _MAX_DIM for n in self.shape):
            raise ProtocolError(
                f"tensor descriptor shape {list(self.shape)!r:.80} must be at most {MAX_DIMS} ints "
                ">= 0"
            )

    @property
    def nbytes(self) -> int:
        """Bytes the descriptor covers."""
        return tensor_nbytes(self.dtype, self.shape)


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a ``dtype`` (a key of :data:`DTYPE_SIZES`) tensor of ``shape``."""
    n = DTYPE_SIZES[dtype]
    for dim in shape:
        n *= dim
    return n


# -- free-form fields ------------------------------------------------------------------------------
#: A map of plain msgpack values (results, configs, layouts): checked by :func:`check_plain`.
Plain = dict[str, Any]


def check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Refuse what a typed field cannot: non-str map keys, values other than msgpack's plain types
    (no ext types, no timestamps), nesting deeper than :data:`MAX_DEPTH`, strs, lists and maps over
    their limits.  For the free-form fields, on both sides."""
    if isinstance(value, str):
        if len(value) > MAX_STR_LEN:
            raise ProtocolError(
                f"{where}: a str of {len(value)} chars exceeds MAX_STR_LEN={MAX_STR_LEN}"
            )
        return
    if value is None or isinstance(
        value, (bool, int, float, bytes, bytearray, memoryview, TensorDesc)
    ):
        return
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH}")
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_ARRAY_LEN:
            raise ProtocolError(
                f"{where}: a list of {len(value)} items exceeds MAX_ARRAY_LEN={MAX_ARRAY_LEN}"
            )
        for item in value:
            check_plain(item, where, depth + 1)
        return
    if isinstance(value, dict):
        if len(value) > MAX_MAP_LEN:
            raise ProtocolError(
                f"{where}: a map of {len(value)} items exceeds MAX_MAP_LEN={MAX_MAP_LEN}"
            )
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"{where}: map key {key!r:.60} is not a str")
            check_plain(item, where, depth + 1)
        return
    raise ProtocolError(f"{where}: value of type {type(value).__name__} is not allowed on the wire")


# -- messages --------------------------------------------------------------------------------------
_LOCK = threading.Lock()
_DECLARED: list[type[Message]] = []
_decoder: msgspec.msgpack.Decoder | None = None


class Message(msgspec.Struct, tag_field="k", kw_only=True, forbid_unknown_fields=True):
    """One frame's message; a subclass with ``tag="kind"`` declares a kind."""

    id: RequestId = 0
    #: The names of this kind's free-form (:data:`Plain`) fields, checked with :func:`check_plain`.
    PLAIN: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        global _decoder  # noqa: PLW0603 - the process's one decoder cache, rebuilt after a new kind
        with _LOCK:
            _DECLARED.append(cls)
            _decoder = None

    def __post_init__(self) -> None:
        for name in self.PLAIN:
            check_plain(getattr(self, name), f"{self.kind}.{name}")

    @property
    def kind(self) -> str:
        """The message's kind (its tag)."""
        return kind_of(type(self))


def kind_of(cls: type[Message]) -> str:
    """The kind (tag) of a message struct: a str, the class name unless ``tag=`` names it."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise ProtocolError(f"{cls.__qualname__} has the tag {tag!r}; a kind's tag is a str")
    return tag


class Answer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a worker answers one request kind with (the ``r`` map of its ``ok`` frame);
    a subclass declares one."""

    #: The names of this answer's free-form (:data:`Plain`) fields (:func:`check_plain`).
    PLAIN: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self.PLAIN:
            check_plain(getattr(self, name), f"{type(self).__name__}.{name}")


class Done(Answer):
    """The answer of a request that reports nothing but its completion."""


class Request(Message):
    """A coordinator -> worker request; the worker answers it with :class:`Ok` (carrying an
    ``ANSWER``) or :class:`Err`."""

    #: The struct this kind is answered with.
    ANSWER: ClassVar[type[Answer]] = Done


def kinds() -> dict[str, type[Message]]:
    """Every declared kind -> its struct (those of the rank programs imported so far)."""
    with _LOCK:
        declared = list(_DECLARED)
    out: dict[str, type[Message]] = {}
    for cls in declared:
        if cls is Request:  # the base of the requests, not a kind
            continue
        tag = kind_of(cls)
        if tag in out and out[tag] is not cls:
            raise ProtocolError(
                f"message kind {tag!r} is declared twice: {out[tag].__qualname__} and "
                f"{cls.__qualname__}; give one of them another tag"
            )
        out[tag] = cls
    return out


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


def _get_decoder() -> msgspec.msgpack.Decoder:
    global _decoder  # noqa: PLW0603 - the process's one decoder cache, rebuilt after a new kind
    dec = _decoder
    if dec is None:
        with _LOCK:
            declared = len(_DECLARED)
        every_kind: Any = Union[tuple(kinds().values())]  # noqa: UP007 - built at runtime, no X | Y
        dec = msgspec.msgpack.Decoder(every_kind, ext_hook=_refuse_ext)
        with _LOCK:
            if len(_DECLARED) == declared:
                # a kind declared meanwhile makes the next call build again
                _decoder = dec
    return dec


# handshake
class Challenge(Message, tag="challenge"):
    nonce: bytes


class Auth(Message, tag="auth"):
    rank: int
    pid: int
    mac: bytes
    #: seconds of the worker's start before this answer, by phase: a CUDA rank importing torch and
    #: pinning its device, importing the rank program, connecting and awaiting the challenge (the
    #: interpreter's own start is what the pool measures beyond their sum)
    device_s: float = 0.0
    program_s: float = 0.0
    connect_s: float = 0.0


class Welcome(Message, tag="welcome"):
    world_size: int
    device: str
    run_dir: str
    doorbell_fds: list[int]
    control: str
    hb_interval: float


class Refused(Message, tag="refused"):
    error: Text


# answers and heartbeats (worker -> coordinator)
class Ok(Message, tag="ok"):
    """A request's answer: ``r`` is its kind's :class:`Answer`, encoded (:func:`encode_answer`)
    and decoded (:func:`decode_answer`) apart from the envelope, as the request's kind says."""

    r: msgspec.Raw


class Err(Message, tag="err"):
    error: Text
    tb: Text


class Heartbeat(Message, tag="hb"):
    rss: int
    vram: int | None
    busy: bool


#: Kinds a worker may send after the handshake.
WORKER_TO_COORDINATOR = (Ok, Err, Heartbeat)


# core requests (coordinator -> worker) and their answers
class Pong(Answer):
    """The worker's pid and rank; ``serves`` (the kinds it serves) only in its first answer."""

    pong: bool
    pid: int
    rank: int
    serves: list[str] | None = None


class Ping(Request, tag="ping"):
    ANSWER: ClassVar[type[Answer]] = Pong


class Echoed(Answer):
    """The bytes copied, their sha256, the copies' seconds, whether ``src`` is CUDA-registered."""

    bytes: int
    sha256: str
    seconds: float
    registered: bool


class Echo(Request, tag="echo"):
    """Copy the bytes of ``src`` to ``dst`` (equal byte sizes) through the worker's device; answer
    their sha256."""

    src: TensorDesc
    dst: TensorDesc
    ANSWER: ClassVar[type[Answer]] = Echoed


class Dropped(Answer):
    """How many things (segments, held chunks, statistics) the request dropped."""

    dropped: int


class DropReleased(Request, tag="drop_released"):
    """Unmap every segment the coordinator has released."""

    ANSWER: ClassVar[type[Answer]] = Dropped


class Released(Answer):
    """Whether the worker held what a release request dropped."""

    released: bool


class Stopping(Answer):
    """The pid of the worker that stops serving."""

    pid: int


class Shutdown(Request, tag="shutdown"):
    """Answer, then stop serving (the worker exits)."""

    ANSWER: ClassVar[type[Answer]] = Stopping


# -- encode, decode --------------------------------------------------------------------------------
_ENCODER = msgspec.msgpack.Encoder()
_ANSWER_DECODERS: dict[type[Answer], msgspec.msgpack.Decoder] = {}


def decode(body: bytes) -> Message:
    """Decode and validate one frame body (without its length header).  Raises only
    :class:`ProtocolError`."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    try:
        return _get_decoder().decode(body)
    except ProtocolError:
        raise
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Invalid value") and text.endswith("at `$.k`"):
            text = f"unknown message kind {text[len('Invalid value ') : -len(' - at `$.k`')]:.60}"
        raise ProtocolError(f"invalid message: {text}"[:300]) from None
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:
        raise ProtocolError(
            f"frame is not one valid msgpack map: {type(exc).__name__}: {exc}"[:300]
        ) from None


def encode(msg: Message) -> bytes:
    """Encode one message as a whole frame (header + body)."""
    if not isinstance(msg, Message):
        raise ProtocolError(
            f"cannot send a {type(msg).__name__}: build a message struct of workers/*/protocol.py"
        )
    try:
        body = _ENCODER.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:  # unencodable values
        raise ProtocolError(f"{msg.kind}: cannot encode message: {exc}") from None
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"{msg.kind}: message of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}; "
            "move large payloads to shared memory and send a tensor descriptor"
        )
    return HEADER.pack(len(body)) + body


def encode_answer(request: Request, answer: Answer) -> msgspec.Raw:
    """``answer`` as the ``r`` of an :class:`Ok` to ``request``; refuses a struct other than
    the kind's ``ANSWER``."""
    if type(answer) is not request.ANSWER:
        raise ProtocolError(
            f"{request.kind}: answered with {type(answer).__name__}, not {request.ANSWER.__name__}"
        )
    try:
        return msgspec.Raw(_ENCODER.encode(answer))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{request.kind}: cannot encode answer: {exc}") from None


def decode_answer(answer: type[Answer], raw: msgspec.Raw | bytes) -> Answer:
    """Decode and validate the ``r`` of an :class:`Ok` as the struct ``answer``.  Raises only
    :class:`ProtocolError`."""
    dec = _ANSWER_DECODERS.get(answer)
    if dec is None:
        dec = _ANSWER_DECODERS[answer] = msgspec.msgpack.Decoder(answer, ext_hook=_refuse_ext)
    try:
        return dec.decode(raw)
    except ProtocolError:
        raise
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid {answer.__name__} answer: {exc}"[:300]) from None
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:
        text = f"{answer.__name__} answer is not one valid msgpack map: {exc}"
        raise ProtocolError(text[:300]) from None


async def read_message(reader: asyncio.StreamReader, max_bytes: int | None = None) -> Message:
    """Read and decode one frame of at most ``max_bytes`` (default ``MAX_FRAME_BYTES``).  EOF
    exactly at a frame boundary raises ``EOFError``; anything else that is wrong (over-long length,
    truncated frame, bad body) raises :class:`ProtocolError`."""
    limit, name = (
        (MAX_FRAME_BYTES, "MAX_FRAME_BYTES")
        if max_bytes is None
        else (max_bytes, "the pre-auth limit")
    )
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError("peer closed the channel") from None
        raise ProtocolError(
            f"truncated frame header ({len(exc.partial)} of {HEADER.size} bytes)"
        ) from None
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise ProtocolError(f"frame length {length} exceeds {name}={limit}")
    if length == 0:
        raise ProtocolError("empty frame")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            f"truncated frame: {len(exc.partial)} of {length} bytes before EOF"
        ) from None
    return decode(body)
