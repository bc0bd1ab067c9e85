"""Writing a training-state record (format 3), sealed and atomically.

The HDF5 image is written one array at a time (an array larger than
`PACK_LIMIT` bytes in a blob of its own,
smaller ones packed into shared blobs), each array's xxh3-64 in its index row
and each JSON record's xxh3-64 in its ``xxh3`` attribute; then the xxh3-128
seal is written into the user block (`keras_stable_state.format.seal`).
Inside a ``.keras`` archive the model arrays and the optimizer arrays larger than
``PACK_LIMIT`` that Keras' ``model.weights.h5`` already holds are referred to, not
written again
(`keras_stable_state.format.keras_archive`). The layout is described in
``docs/concepts/file-format.md``.

This module imports no Keras.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
import zipfile
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import h5py
import numpy as np

from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format import keras_archive, sandbox
from keras_stable_state.format.atomic import atomic_path, create_temporary, directory_error
from keras_stable_state.format.codec import aligned, encode_array, json_array
from keras_stable_state.format.record import (
    BLOB_TARGET,
    DATA_ALIGN,
    DATA_ALIGN_ABOVE,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    MEMBER,
    PACK_LIMIT,
    RECORDS,
    SECTIONS,
    SHARE_ABOVE,
    SHARED,
    SHARED_SECTIONS,
    USERBLOCK_SIZE,
    StateRecord,
)
from keras_stable_state.format.seal import CHUNK, seal, seal_file
from keras_stable_state.format.sink import Sink, room_for
from keras_stable_state.format.urls import refuse_url

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _SectionWriter:
    """Writes one section's arrays into numbered uint8 blobs (format 3), one array at a
    time, and builds the section's index rows."""

    def __init__(
        self, group: Any, shared: keras_archive.KerasWeights | None = None, share_above: int = 0
    ) -> None:
        self.group = group  # an h5py.Group
        self.shared = shared
        self.share_above = share_above
        self.rows: list[list[Any]] = []
        self.blobs = 0
        self.buf = bytearray()
        self.open = False  # a shared blob is being filled (it may hold zero-size arrays only)

    def add(self, key: str, value: Any) -> None:
        if callable(value):
            value = value()
        stored, name = encode_array(np.asarray(value))
        del value
        # C order (from encode_array): the raw view is the bytes of tobytes(), without the copy.
        raw = stored.reshape(-1).view(np.uint8)
        digest = f"{sandbox.digest_v3(str(key), name, stored.shape, raw):016x}"
        shape = [int(n) for n in stored.shape]
        ref = self.shared.find(stored) if self.shared is not None and raw.nbytes > self.share_above else None
        if ref is not None:  # the same bytes are in Keras' model.weights.h5: not written twice
            self.rows.append([str(key), name, shape, ref, 0, digest])
            return
        if raw.nbytes > PACK_LIMIT:
            self.flush()
            self.group.create_dataset(str(self.blobs), data=raw)
            self.rows.append([str(key), name, shape, self.blobs, 0, digest])
            self.blobs += 1
            return
        offset = aligned(len(self.buf)) if self.buf else 0
        self.buf += bytes(offset - len(self.buf))
        self.rows.append([str(key), name, shape, self.blobs, offset, digest])
        self.buf += raw.data
        self.open = True
        if len(self.buf) >= BLOB_TARGET:
            self.flush()

    def flush(self) -> None:
        if not self.open:
            return
        self.group.create_dataset(str(self.blobs), data=np.frombuffer(self.buf, dtype=np.uint8))
        self.blobs += 1
        self.buf = bytearray()
        self.open = False


def _write_section(
    group: Any,
    arrays: dict[str, Any] | Iterable[tuple[str, Any]],
    shared: keras_archive.KerasWeights | None = None,
    share_above: int = 0,
) -> list[list[Any]]:
    """Write ``arrays`` into ``group`` as blobs (format 3); return the section's index rows.

    ``arrays``: a dict ``{key: array or zero-argument callable returning one}``, or
    an iterable of ``(key, array or callable)`` pairs; each is converted, written
    (or packed) and dropped in turn. An array of more than ``share_above`` bytes whose
    dtype, shape and bytes ``shared`` holds is referred to instead.
    """
    writer = _SectionWriter(group, shared, share_above)
    for key, value in arrays.items() if isinstance(arrays, dict) else arrays:
        writer.add(key, value)
    writer.flush()
    return writer.rows


def write_h5(
    target: str | BinaryIO, record: StateRecord, shared: keras_archive.KerasWeights | None = None
) -> None:
    """Write ``record``'s HDF5 image (format 3), user block left zero, to ``target`` (a
    path or a binary file object), one array at a time; model arrays, and optimizer
    arrays larger than `PACK_LIMIT` bytes, found in
    ``shared`` (Keras' weights of the same archive) are referred to, not written.

    A path is written through a `Sink`, so a
    failed write (a full disk, the file-size limit) never leaves HDF5 with a file it
    cannot close; the image is still built to its end, to count the bytes it needs.

    Raises:
        CheckpointFormatError: for an array of a dtype a training state cannot hold.
        OSError: for a path, the first failed write (its errno), with ``needed_bytes``
            (the file's length) and ``needed_exact`` (whether the image was built to
            its end) set.
    """
    if hasattr(target, "seek"):
        _write_image(target, record, shared)
        return
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        sink = Sink(fd)
        try:
            _write_image(sink, record, shared)
        except Exception:
            if sink.error is None:
                raise
            sink.check(exact=False)  # HDF5 read back a part the failed write dropped
        sink.check(exact=True)
    finally:
        os.close(fd)


def _write_image(
    target: str | BinaryIO | Sink, record: StateRecord, shared: keras_archive.KerasWeights | None
) -> None:
    with h5py.File(
        target,
        "w",
        userblock_size=USERBLOCK_SIZE,
        alignment_threshold=DATA_ALIGN_ABOVE,
        alignment_interval=DATA_ALIGN,
    ) as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        index: dict[str, Any] = {
            section: _write_section(
                f.create_group(section),
                arrays,
                shared if section in SHARE_ABOVE else None,
                SHARE_ABOVE.get(section, 0),
            )
            for section, arrays in zip(SECTIONS, (record.model, record.optimizer, record.arrays), strict=True)
        }
        sharing = [s for s in SHARE_ABOVE if any(isinstance(row[3], str) for row in index[s])]
        if sharing:
            assert shared is not None  # rows refer to shared arrays only when given them
            index[SHARED] = shared.spec
        if set(sharing) - {"model"}:  # absent, a reader lets the model alone share
            index[SHARED_SECTIONS] = sharing
        # JSON records are uint8 datasets: no HDF5 attribute size cap, no variable-length types.
        for name in (*RECORDS, INDEX):
            data = json_array(index if name == INDEX else getattr(record, name))
            ds = f.create_dataset(name, data=data)
            ds.attrs["xxh3"] = np.uint64(sandbox.digest_v3(name, "json", data.shape, data))


def record_to_bytes(record: StateRecord) -> bytes:
    """``record`` as the bytes of a sealed ``.h5`` training state (for object stores);
    `read_bytes` reads them back.

    Raises:
        CheckpointFormatError: for an array of a dtype a training state cannot hold.
    """
    buf = io.BytesIO()
    write_h5(buf, record)
    return seal(buf.getvalue())


def _write_sealed(path: str, record: StateRecord, shared: keras_archive.KerasWeights | None = None) -> None:
    """A sealed record file at ``path``: the HDF5 image written array by array, then sealed."""
    write_h5(path, record, shared)
    seal_file(path)


def reseal(filepath: str | os.PathLike[str]) -> None:
    """Recompute the seal of a record edited on purpose (tests, tools); ``.h5`` or ``.keras``.

    A format-3 record gets its xxh3-128 seal again, a format-2 record its SHA-256
    seal. The seal detects damage, not forgery: anyone who can write the file can reseal it.
    """
    path = os.fspath(filepath)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            members = [(info, zf.read(info.filename)) for info in zf.infolist()]
        with zipfile.ZipFile(path, "w") as zf:
            for info, data in members:
                zf.writestr(info, seal(data) if info.filename == MEMBER else data)
        return
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(seal(data))


def check_target(filepath: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """``filepath`` as a ``str``, if a training state can be written there.

    Raises:
        CheckpointFormatError: for an extension other than ``.keras`` / ``.h5``, a
            path that is a directory, or a URL (``s3://...``: the object-store engine,
            ``keras_stable_state._engines.object_store``, writes those).
    """
    path = os.fsdecode(os.fspath(filepath))
    refuse_url(path, "training-state path")  # object stores: keras_stable_state._engines.object_store
    if not path.endswith((".keras", ".h5")):
        raise CheckpointFormatError(
            f"Unsupported training-state path {path!r}: use a '.keras' or '.h5' extension.",
            received=path,
        )
    if os.path.isdir(path):
        raise directory_error(path)
    return path


def write_record(
    filepath: str | bytes | os.PathLike[str] | os.PathLike[bytes],
    record: StateRecord,
    keras_archive_writer: Callable[[str], object] | None = None,
) -> None:
    """Write ``record`` atomically to ``filepath``.

    Args:
        filepath: ``.h5`` (record alone) or ``.keras`` (archive with the record as a member).
        record: What to write.
        keras_archive_writer: For ``.keras``: a callable taking a temporary
            path and writing Keras' own archive there (``model.save``).

    Raises:
        CheckpointFormatError: for another extension, a path that is a directory,
            or an array of a dtype a training state cannot hold.
        OSError: naming the path when the write fails (e.g. disk full); the
            previous file at that path is left intact.
    """
    path = check_target(filepath)
    if path.endswith(".keras"):
        with atomic_path(path, suffix=".keras") as tmp:
            if keras_archive_writer is None:  # as calling None would: a TypeError, inside the write
                raise TypeError(
                    "write_record: a '.keras' path needs keras_archive_writer (it writes Keras' archive)."
                )
            keras_archive_writer(tmp)
            fd, member = create_temporary(os.path.dirname(tmp), ".member.h5")  # never a name taken
            os.close(fd)
            archive_bytes = os.path.getsize(tmp)
            try:
                _write_sealed(member, record, keras_archive.KerasWeights.of_archive(tmp))
                _append_member(tmp, member)
            except OSError as err:
                if hasattr(err, "needed_bytes"):  # the member, then its copy in the archive
                    err.needed_bytes = archive_bytes + 2 * err.needed_bytes
                raise
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(member)
    else:
        with atomic_path(path, suffix=".h5") as tmp:
            _write_sealed(tmp, record)


# Bytes a stored member adds to a zip besides its own: local header, central directory entry.
_ZIP_OVERHEAD = 4096


def _append_member(archive: str, member_path: str) -> None:
    """Append the file at ``member_path`` to the zip ``archive`` as `MEMBER`, stored,
    copied in chunks (as ``ZipFile.writestr`` would store it, without holding it in memory)."""
    size = os.path.getsize(member_path)
    room_for(os.path.getsize(archive) + size + _ZIP_OVERHEAD, size)
    try:
        with zipfile.ZipFile(archive, "a") as zf:
            info = zipfile.ZipInfo(MEMBER, date_time=time.localtime(time.time())[:6])
            info.compress_type = zf.compression
            info.external_attr = 0o600 << 16
            info.file_size = size
            with open(member_path, "rb") as src, zf.open(info, "w") as out:
                shutil.copyfileobj(src, out, CHUNK)
    except OSError as err:
        err.needed_bytes = size  # type: ignore[attr-defined]  # an attribute added to OSError (sink.room_for's too)
        raise
