"""Challenge-response between the coordinator and a worker.

The coordinator makes a fresh random key per pool start and writes it, hex-encoded on one line, to
each worker's stdin pipe (never argv or the environment, which other local users can read through
/proc).  On connect the coordinator sends a random nonce; the worker proves it holds the key with
HMAC-SHA256(key, nonce || rank), the rank as 4 big-endian bytes so that an answer for one rank
cannot be replayed for another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import BinaryIO

KEY_BYTES = 32
NONCE_BYTES = 32


class AuthError(Exception):
    """The peer could not prove it holds the pool key (or the key could not be read)."""


def new_key() -> bytes:
    """A fresh random pool key."""
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    """A fresh random challenge."""
    return secrets.token_bytes(NONCE_BYTES)


def response(key: bytes, nonce: bytes, rank: int) -> bytes:
    """The MAC a worker of ``rank`` answers to ``nonce``."""
    if not 0 <= rank < (1 << 32):
        raise AuthError(f"rank {rank} out of range")
    return hmac.new(key, nonce + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def verify(key: bytes, nonce: bytes, rank: int, mac: bytes) -> bool:
    """Constant-time check of a worker's answer."""
    if not 0 <= rank < (1 << 32):
        return False
    return hmac.compare_digest(response(key, nonce, rank), bytes(mac))


def key_line(key: bytes) -> bytes:
    """What the coordinator writes to a worker's stdin."""
    return key.hex().encode("ascii") + b"\n"


def read_key(stream: BinaryIO) -> bytes:
    """Read the pool key from a worker's stdin (one hex line); :class:`AuthError` if it is missing
    or malformed."""
    line = stream.readline(2 * KEY_BYTES + 2)
    text = line.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise AuthError(
            f"expected a {KEY_BYTES}-byte hex key line on stdin, got {len(line)} bytes; workers "
            "are started by the coordinator's WorkerPool, not by hand"
        )
    return key
