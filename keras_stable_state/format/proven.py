"""A sealed record proven whole, its large arrays left in the file to be read into their
variables' own memory (the in-place restore).

`read_proven` opens a local format-3 ``.h5`` record as `open_file` does: its xxh3-128
seal, over every byte of the file, checked through a small buffer before HDF5 parses a
byte (the proof: the file is whole, every byte as its writer wrote it), then the
structure, records and index. It reads the small arrays as `read_file` does and leaves
every array of a dataset of its own (`DEFER_ABOVE` bytes or more) in the file as a
`FileArray`: nothing the size of the state is allocated. A `FileArray` is read later,
once, into memory its caller gives (`FileArray.read_into`: on Torch the variable's own)
and its own xxh3-64 checked there, so a file changed on disk after the proof cannot reach
a variable unnoticed.

The arrays' own checksums are not checked in a pass of their own before they are read
(`read_file` checks them before returning): inside a good seal they can only fail in a
file whose seal was made again over changed bytes, by another writer than ours. Such a
file fails at that array's read, after the arrays read before it were assigned (the
in-place restore marks the model then: `keras_stable_state._core.in_place`). Measured on
a 120 MB state (JAX, page cache warm): that pass cost 11 ms of a 56 ms restore, stock
``load_weights`` 45 ms.

The file stays open and locked (shared ``flock``) until the `ProvenFile` is
closed: a file replaced on disk (a writer's rename) is not what is read; a file
changed in place is caught by the second check. Reads are ``os.preadv`` at the
arrays' offsets (the page cache serves the second read of a file the proof has just
read), never a memory map, so a file cut short under the reader is an error, not a
``SIGBUS``.

This module imports no Keras.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from keras_stable_state.format import keras_archive, sandbox
from keras_stable_state.format.codec import numpy_dtype
from keras_stable_state.format.layout import read_file
from keras_stable_state.format.probe import damaged
from keras_stable_state.format.reader import CheckpointFile, check_members_or_refuse, state_record
from keras_stable_state.format.record import FORMAT, PACK_LIMIT, SECTIONS, Entry, StateRecord
from keras_stable_state.format.stock import StockWeights
from keras_stable_state.format.urls import resolve

__all__ = ["DEFER_ABOVE", "FileArray", "ProvenFile", "close_files", "read_proven"]

#: Arrays of this many bytes or more (those with a dataset of their own: format 3 packs
#: smaller ones into shared blobs) are left in the file; smaller ones are read at once.
DEFER_ABOVE = PACK_LIMIT


class ProvenFile:
    """The open, locked file a proven record's `FileArray` values are read from.

    Attributes:
        path: The file's path.
        where: The file as messages name it.
        arrays: Every `FileArray` of the record, in file order.
    """

    def __init__(self, file: CheckpointFile) -> None:
        self._file = file
        self.path, self.where = file.path, file.where
        self.arrays: list[FileArray] = []

    def fileno(self) -> int:
        """The open file's descriptor.

        Raises:
            ValueError: if the file is closed.
        """
        return self._file.fileno()

    def close(self) -> None:
        """Close the file and release its lock (twice is harmless); a `FileArray` read after
        raises ``ValueError``."""
        self._file.close()

    def __enter__(self) -> ProvenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileArray:
    """An array of a proven record, not read yet: its key, shape and dtype, read on demand.

    ``np.asarray(array)`` reads it into new 64-byte aligned memory; `read_into` reads
    it into the caller's. Each read checks the array's xxh3-64 (over its key, dtype,
    shape and bytes: `keras_stable_state.format.sandbox.digest_v3`) in the memory it
    was read into.

    Attributes:
        key: Its key in the record (``"path:layers/dense/kernel"``).
        shape: Its shape (tuple of ints).
        dtype: Its NumPy dtype (``ml_dtypes`` for ``bfloat16`` and float8).
        ndim, size, nbytes: As NumPy's.
        offset: Where its bytes start in the file.
    """

    def __init__(self, file: ProvenFile, entry: Entry, offset: int) -> None:
        self._file, self._entry = file, entry
        self.key, self.shape, self.offset = entry.key, tuple(entry.shape), offset
        self.dtype = numpy_dtype(entry.dtype)
        self.ndim = len(self.shape)
        self.nbytes = entry.nbytes
        self.size = self.nbytes // self.dtype.itemsize if self.dtype.itemsize else 0

    def __repr__(self) -> str:
        return f"FileArray({self.key!r}, shape={self.shape}, dtype={self.dtype.name}, at byte {self.offset})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = sandbox.aligned_empty(self.shape, self.dtype)
        self.read_into(out)
        return out if dtype is None else out.astype(dtype)

    def read_into(self, out: np.ndarray) -> None:
        """Read the array's bytes into ``out`` and check them there.

        Args:
            out: Writable, C-contiguous memory of exactly `nbytes` bytes (any dtype and
                shape: the bytes are copied as stored, little-endian).

        Raises:
            ValueError: if ``out`` is not such memory, or the file is closed.
            CorruptCheckpointError: naming `key` if reading fails (an I/O error), the file
                ends before the array does, or the bytes read fail the array's xxh3-64: the
                file was changed on disk after its seal was checked (or sealed again over
                changed bytes by another writer than ours).
        """
        if not (out.flags.c_contiguous and out.flags.writeable) or out.nbytes != self.nbytes:
            raise ValueError(
                f"{self.key}: reading {self.nbytes} bytes needs writable, C-contiguous memory of that size; "
                f"got {out.nbytes} bytes (C-contiguous: {out.flags.c_contiguous}, writable: {out.flags.writeable})"
            )
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        try:
            got = _pread_into(self._file.fileno(), view, self.offset)
        except OSError as err:
            raise damaged(
                self._file.where, f"array for key {self.key!r} cannot be read ({err})", key=self.key
            ) from err
        entry = self._entry
        if got != self.nbytes:
            raise damaged(
                self._file.where,
                f"array for key {self.key!r} ends after {got} of its {self.nbytes} bytes: the file was cut "
                "after it was proven whole",
                key=self.key,
                expected=self.nbytes,
                received=got,
            )
        computed = sandbox.digest_v3(entry.key, entry.dtype, entry.shape, view)
        if computed != entry.xxh3:
            raise damaged(
                self._file.where,
                f"array for key {self.key!r} fails its xxh3-64 checksum when read (expected {entry.xxh3:016x}, "
                f"computed {computed:016x}): the file was changed on disk after it was proven whole (its "
                "seal checked), or sealed again over changed bytes by another writer",
                key=self.key,
                expected=f"{entry.xxh3:016x}",
                received=f"{computed:016x}",
            )


def file_offset(file: CheckpointFile, entry: Entry) -> int | None:
    """Where the bytes of ``entry`` start in ``file``: a format-3 array with a contiguous
    dataset of its own, in a record opened from a file (not ``whole``): an ``.h5`` file, or
    a ``.keras`` archive whose record member (and Keras' weights member, for an array the
    record shares with it) is read where it lies; else ``None``."""
    src = file._src
    shared = entry.dataset.startswith(keras_archive.PREFIX)
    ds = (file._shared if shared else file._datasets).get(entry.dataset)
    if file.member is None:
        base = 0 if src.image is None and not shared else None
    else:
        base = src.shared_start if shared else src.member_start
    start = file._spans.get(entry.dataset)
    if (
        src.data is not None
        or base is None
        or entry.xxh3 is None
        or ds is None
        or start is None
        or entry.offset
    ):
        return None
    return base + start if ds.id.get_storage_size() == entry.nbytes else None


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into all of ``view`` from ``offset`` of ``fd``; the bytes read (fewer at the end of the file)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def read_proven(filepath: str, *, arrays: Any = None) -> StateRecord | StockWeights:
    """Read a training-state file for an in-place restore: the record, its seal checked, with
    its large arrays left in the open file (`FileArray`, each checked when it is read).

    Only a local, sealed format-3 record is read so: an ``.h5`` file, or a ``.keras`` archive
    whose record member is stored (its other members checked against their zip CRC-32
    first, as `read_file` does); any other file (a stock Keras file, an older format) is
    read whole by `read_file`, and a ``.orbax`` folder as it reads one (its arrays read on
    demand). A local path (a ``file://`` URL is the path it names): an object in a store is
    read whole from memory (`keras_stable_state.format.read_bytes`).

    Returns:
        The record; once its arrays are read, `close_files` closes the file they are read
        from (and releases its lock).

    Raises:
        Every error of `read_file`, for the same damage, before anything is returned, except
        an array's own checksum failing inside a good seal: `FileArray.read_into` raises that.
    """
    path = resolve(filepath)
    if not path.endswith((".h5", ".keras")) or path.endswith(".weights.h5"):
        return read_file(filepath, arrays=arrays)
    f = CheckpointFile(path)
    try:
        in_place = f.member is None or f._src.member_start is not None
        if f.kind != FORMAT or not f.sealed or f.version != 3 or not in_place:
            f.close()
            return read_file(filepath)
        check_members_or_refuse(f)
        proven = ProvenFile(f)
        arrays: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for e in f.entries:
            offset = file_offset(f, e) if e.section != "state" and e.nbytes >= DEFER_ABOVE else None
            if offset is None:
                arrays[e.section][e.key] = f.read(e)
            else:
                array = FileArray(proven, e, offset)
                proven.arrays.append(array)
                arrays[e.section][e.key] = array
    except BaseException:
        f.close()
        raise
    if not proven.arrays:
        f.close()
    return state_record(f, arrays)


def close_files(record: Any) -> None:
    """Close the file of every `FileArray` of ``record``'s model and optimizer sections (a
    `StateRecord`; anything else holds none)."""
    if not isinstance(record, StateRecord):
        return
    for section in (record.model, record.optimizer):
        for value in section.values():
            if isinstance(value, FileArray):
                value._file.close()
