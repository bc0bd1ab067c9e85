"""The whole-file seal in a record's 512-byte HDF5 user block.

Format 3 writes ``KSS-SEAL 3 xxh3-128 <32 hex digits> <length>\\n``, zero padded
to 512 bytes: the xxh3-128 (https://github.com/Cyan4973/xxHash, through the
``xxhash`` package) of every byte after the user block, and their count. The
reader still reads format-2 seals (``KSS-SEAL 2 sha256 <64 hex digits> <length>``,
SHA-256), and `seal` keeps a format-2 seal on a format-2 image. HDF5 skips
the user block, so h5py and Keras open a sealed file as usual; the reader checks
the seal before HDF5 parses a byte. The seal detects damage, not forgery. See
``docs/concepts/file-format.md``.

This module imports no Keras.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Callable
from typing import Protocol

import xxhash

from keras_stable_state.errors import CorruptCheckpointError
from keras_stable_state.format.probe import damaged, newer_format
from keras_stable_state.format.record import FORMAT_VERSION, USERBLOCK_SIZE

MAGIC = b"KSS-SEAL"
# Bytes read at a time when hashing a file.
CHUNK = 1 << 22
# The seal of a later format: "KSS-SEAL <version> " and whatever that format puts after it.
_NEWER_RE = re.compile(rb"KSS-SEAL ([0-9]{1,9}) ")
_SEAL_RE = re.compile(rb"KSS-SEAL (2 sha256 [0-9a-f]{64}|3 xxh3-128 [0-9a-f]{32}) ([0-9]{1,20})\n")


class _Hasher(Protocol):
    """What the seal needs of a hashlib-style hasher (hashlib's and xxhash's)."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...
    def hexdigest(self) -> str: ...


# The seal's hash by format version: (name in messages, hashlib-style constructor).
_HASH: dict[int, tuple[str, Callable[..., _Hasher]]] = {
    2: ("SHA-256", hashlib.sha256),
    3: ("xxh3-128", xxhash.xxh3_128),
}
_NAME = {2: b"sha256", 3: b"xxh3-128"}


def head(version: int, digest: str, length: int) -> bytes:
    """The seal line (not padded) for a ``digest`` (hex) of ``length`` bytes."""
    return b"KSS-SEAL %d %s %s %d\n" % (version, _NAME[version], digest.encode(), length)


def _version_of(user_block: bytes) -> int:
    """The format version of an existing seal (format 2 files are resealed as such), else the current."""
    return 2 if user_block.startswith(b"KSS-SEAL 2 ") else FORMAT_VERSION


def seal(data: bytes) -> bytes:
    """``data`` (an HDF5 image written with a 512-byte user block) with its user block
    replaced by the seal ``KSS-SEAL 3 xxh3-128 <hex> <length>`` (``KSS-SEAL 2 sha256 ...``
    for an image that already carries a format-2 seal), zero padded."""
    version = _version_of(data[:USERBLOCK_SIZE])
    body = data[USERBLOCK_SIZE:]
    line = head(version, _HASH[version][1](body).hexdigest(), len(body))
    return line.ljust(USERBLOCK_SIZE, b"\0") + body


def seal_file(path: str) -> None:
    """Write the format-3 seal into the user block of the HDF5 image at ``path`` (as
    `seal`), hashing the file in chunks of `CHUNK` bytes."""
    h = _HASH[FORMAT_VERSION][1]()
    length = 0
    buf = bytearray(CHUNK)
    with open(path, "rb+") as fh:
        fh.seek(USERBLOCK_SIZE)
        while n := fh.readinto(buf):
            h.update(memoryview(buf)[:n])
            length += n
        fh.seek(0)
        fh.write(head(FORMAT_VERSION, h.hexdigest(), length).ljust(USERBLOCK_SIZE, b"\0"))


def parse(user_block: bytes, where: str) -> tuple[int, bytes, int]:
    """``(format version, digest, length)`` of a seal.

    Raises:
        NewerFormatError: for the seal of a format version above `FORMAT_VERSION`.
        CorruptCheckpointError: if the seal is malformed or followed by anything but zeros.
    """
    match = _SEAL_RE.match(user_block)
    newer = _NEWER_RE.match(user_block) if match is None else None
    if newer is not None and int(newer.group(1)) > FORMAT_VERSION:
        raise newer_format(where, int(newer.group(1)))
    if match is None or any(user_block[match.end() : USERBLOCK_SIZE]):
        raise damaged(where, "its seal (the hash header in the first 512 bytes) is malformed")
    version, _, digest = match.group(1).decode().split(" ")
    return int(version), bytes.fromhex(digest), int(match.group(2))


def start(user_block: bytes, size: int, where: str) -> tuple[int, str, _Hasher, bytes]:
    """Parse the seal of a file of ``size`` bytes whose first 512 bytes are ``user_block``
    and check its length, before hashing it.

    Returns:
        ``(format version, hash name, a new hasher, the digest the seal holds)``.

    Raises:
        NewerFormatError: for the seal of a newer format.
        CorruptCheckpointError: if the seal is malformed, or the file is not as long as it says.
    """
    version, digest, length = parse(user_block, where)
    if size != USERBLOCK_SIZE + length:
        raise damaged(
            where,
            f"it is truncated or damaged: {size} bytes long, but its seal says {USERBLOCK_SIZE + length}",
            expected=USERBLOCK_SIZE + length,
            received=size,
        )
    name, hasher = _HASH[version]
    return version, name, hasher(), digest


def truncated(where: str, size: int, got: int, key: str | None = None) -> CorruptCheckpointError:
    """The error for a file that ended after ``got`` of its ``size`` bytes while being read
    (``key``: the archive member concerned, if any)."""
    return damaged(
        where,
        f"it is truncated or was cut while being read: {got} of its {size} bytes could be read",
        key=key,
        expected=size,
        received=got,
    )


def check_stream(fh: io.BufferedIOBase, user_block: bytes, size: int, where: str) -> tuple[int, str, bool]:
    """Check the seal of the file ``fh`` (``size`` bytes, its first 512 bytes
    ``user_block``), hashing it in chunks; ``fh`` is left at offset 0.

    Returns:
        ``(format version, hash name, whether the digest matches)``.

    Raises:
        NewerFormatError: for the seal of a format version this version does not read.
        CorruptCheckpointError: if the seal is malformed, or the file is not as long as it says.
    """
    version, name, h, digest = start(user_block, size, where)
    fh.seek(USERBLOCK_SIZE)
    buf = bytearray(CHUNK)
    while n := fh.readinto(buf):
        h.update(memoryview(buf)[:n])
    fh.seek(0)
    return version, name, h.digest() == digest


def check_bytes(data: bytes, where: str) -> tuple[int, str, bool]:
    """Check the seal of an image held in memory (an archive member).

    Returns:
        ``(format version, hash name, whether its length and digest match)``.

    Raises:
        CorruptCheckpointError: if the seal is malformed.
    """
    version, digest, length = parse(data[:USERBLOCK_SIZE], where)
    name, hasher = _HASH[version]
    ok = len(data) == USERBLOCK_SIZE + length and hasher(memoryview(data)[USERBLOCK_SIZE:]).digest() == digest
    return version, name, ok
