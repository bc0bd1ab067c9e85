"""Reading a training-state file, or a stock Keras weights file, with every check: two of
the layouts behind `keras_stable_state.format.open_file` (the door for every
layout, `keras_stable_state.format.layout`).

`CheckpointFile` opens a ``.keras`` archive or an HDF5
file (``.h5``, ``.weights.h5``), or bytes held in memory
(`CheckpointFile.from_bytes`), and lists every array from the HDF5
metadata alone; `CheckpointFile.read` reads and checksums one array at a
time (format 3: xxh3-64; formats 1-2, still read: CRC-32; stock Keras files
carry no checksum of their own); `read_checkpoint_file` and `read_bytes`
read a whole file through it. Opening composes a
`Source` (lock, seal or probe
process, archive checks), then a
`RecordListing` (records, index,
schema: our record, matched by key) or a `StockListing` (a stock Keras file, matched
by structure): which of the two a file is shows only once it is open. The
command line (`keras_stable_state.cli`) inspects, verifies and compares
files through `open_file`. The format and the order of the checks are
described in ``docs/concepts/file-format.md`` and ``docs/concepts/security.md``.

This module imports no Keras.
"""

from __future__ import annotations

import errno
import os
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format import image, keras_archive, sandbox
from keras_stable_state.format.codec import EXOTIC, decode_array, stored_dtype
from keras_stable_state.format.memory import out_of_memory
from keras_stable_state.format.opened import Opened
from keras_stable_state.format.probe import damaged
from keras_stable_state.format.record import (
    BLOB_TARGET,
    BY_KEY,
    BY_STRUCTURE,
    DATA_ALIGN,
    DATA_ALIGN_ABOVE,
    FORMAT,
    MEMBER,
    SECTIONS,
    Entry,
    MatchedBy,
    StateRecord,
)
from keras_stable_state.format.records import RecordListing
from keras_stable_state.format.source import Source
from keras_stable_state.format.stock import StockListing, StockWeights, stock_weights
from keras_stable_state.format.urls import refuse_url, resolve

# Blobs up to this size are kept after a read, for the next array of the same blob.
_BLOB_CACHE_LIMIT = 4 * BLOB_TARGET


class CheckpointFile(Opened):
    """A training-state file or stock Keras weights file, opened for reading.

    Opening checks the whole-file seal (records: format 3 xxh3-128, format 2 SHA-256),
    or reads the file once in a probe process (unsealed files: stock Keras files,
    format-1 records), then lists every array (`entries`) from the HDF5 metadata and
    checks the structure and the records' schema; `read` reads one array and checks its
    checksum; `check` reads everything. The file is held with a shared ``flock`` while
    open, so a writer holding it exclusively is detected. Use as a context manager (see
    `open_file`), or call `close`.

    Args:
        path: A ``.keras`` archive or an HDF5 file (``.h5``, ``.weights.h5``).
        data: The file's bytes, held in memory (`from_bytes`), or ``None``.
        whole: For a reader of every array (`read_file`): a sealed record is read once,
            whole, into one buffer as its seal is checked (`image`), and `read` returns views
            of it (one kept alive keeps it all). Otherwise the seal is hashed in chunks and
            each array is read from the file when asked.
        unaligned_views: With ``whole``: whether the caller can use an array at any offset
            (Torch can; TensorFlow and JAX copy memory not 64-byte aligned). With ``False``,
            arrays Keras or an older writer did not align are read one by one into aligned
            memory from the same handle: no image is held while its views would be copied.

    Attributes:
        path: The file's path (``"<bytes>"`` for `from_bytes`).
        kind: ``"keras_stable_state"`` for training states, ``"stock"`` for stock Keras files.
        container: ``".keras archive"``, ``".h5 file"`` or ``".weights.h5 file"``.
        where: What error messages call it: the path, or ``"<path>:<member>"``.
        version: The record's format version (``None`` for stock files).
        sealed: ``True`` when the file carries a seal (format 3: xxh3-128; format 2: SHA-256).
        seal_version: The format version its seal names (3 or 2), or ``None`` when unsealed.
        metadata: The writer's metadata (stock archives: Keras' ``metadata.json``).
        contract: ``[key, shape, dtype]`` lists, or ``None``.
        extra: Other state as JSON (schedule, callbacks, providers, RNG), or ``{}``.
        entries: Every array, as `Entry`, in file order (stock files: by HDF5 path, numbers in numeric order).
        optimizer_keys: For stock files saved with ``StableOptimizer``:
            ``{dataset path: entry key}`` (``{"optimizer/vars/0": "optimizer#iteration"}``); else ``{}``.
        members: ``(name, size in bytes)`` of every archive member; ``[]`` for HDF5 files.
        member: The archive member holding the arrays (`MEMBER`, ``"model.weights.h5"``) or ``None``.
        model_class: The model's class name from an archive's ``config.json``, or ``None``.
        damaged_members: ``(member, reason)`` for archive members found damaged by `check`.
        problems: Always empty (kept for callers of version 0.1: problems now raise).

    Raises:
        TypeError: if ``path`` is not a ``str``, ``bytes`` or ``os.PathLike``.
        FileNotFoundError: if ``path`` does not exist (or is a symbolic link to nothing).
        PermissionError: if ``path`` cannot be opened for reading.
        CheckpointFormatError: if ``path`` is not a regular file (a directory, a FIFO, a
            device such as ``/dev/zero``, a socket; a symbolic link is followed), a URL
            (``s3://...``: `open_file` reads object stores), for a format version this
            version does not read, a legacy Keras HDF5 file, or a zip archive holding
            neither a training state nor Keras weights.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: if the file is truncated, fails its seal, is not a
            ``.keras`` archive or HDF5 file, has links, external or virtual storage,
            non-numeric or big-endian dtypes, data outside the file, missing or unexpected
            objects or attributes, malformed JSON records or index, an archive member that
            unpacks far beyond its stored size, or crashes or hangs HDF5 in the probe
            process, naming the key, dataset or member concerned where there is one.
        MalformedKeyError: (a ``CorruptCheckpointError``) for a key restore could not parse.
    """

    def __init__(
        self, path: object, *, data: bytes | None = None, whole: bool = False, unaligned_views: bool = True
    ) -> None:
        data = None if data is None else bytes(data)
        if data is not None and not isinstance(path, str):
            path = "<bytes>"
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"A checkpoint path must be a str or os.PathLike. Received: {type(path).__name__} {path!r}"
            )
        self.path = os.fspath(path)
        if data is None:
            refuse_url(self.path, "training-state path")  # object stores: _engines.object_store
        self.kind = "stock"
        self.version: int | None = None
        self.metadata: dict[str, Any] = {}
        self.contract: list[list[Any]] | None = None
        self.extra: dict[str, Any] = {}
        self.entries: list[Entry] = []
        self.optimizer_keys: dict[str, str] = {}
        self.damaged_members: list[tuple[str, str]] = []
        self.problems: list[tuple[str, str]] = []
        self._src = Source(self.path, data, whole, unaligned_views)
        self._spans: dict[str, int] = {}
        self._handed: set[str] = set()  # Keras' datasets an array was read from (views of Keras' member)
        self._key_groups: set[str] = set()
        self._blob: tuple[str, np.ndarray] | tuple[None, None] = (None, None)
        self._shared: dict[str, Any] = {}
        self._datasets: dict[str, Any] = {}
        self._sync_source()
        if data is None and not os.path.exists(self.path):
            link = f" (a symbolic link to {os.readlink(self.path)!r})" if os.path.islink(self.path) else ""
            raise FileNotFoundError(
                errno.ENOENT, f"No training-state file at {self.path!r}{link}.", self.path
            )
        if data is None and os.path.isdir(self.path):
            raise CheckpointFormatError(
                f"{self.path!r} is a directory, not a training-state file. Pass one .keras or .h5 file "
                "(StableCheckpoint keeps ckpt-<step>.h5 files in its directory; the newest is the last "
                "in name order).",
                received=self.path,
            )
        try:
            self._open()
            if whole and not unaligned_views and self._misaligned():
                self._read_in_chunks()
        except BaseException as err:
            self.close()
            if isinstance(err, StateError | FileNotFoundError | PermissionError) or out_of_memory(err):
                raise  # not damage (memory ran out: the restore core says so)
            if isinstance(
                err,
                OSError
                | KeyError
                | ValueError
                | RuntimeError
                | EOFError
                | TypeError
                | zipfile.BadZipFile
                | zlib.error
                | RecursionError
                | UnicodeError,
            ):
                raise damaged(
                    self.path, f"it cannot be read as a .keras archive or HDF5 file ({err})"
                ) from err
            raise

    @classmethod
    def from_bytes(
        cls, data: bytes, name: str = "<bytes>", *, whole: bool = False, unaligned_views: bool = True
    ) -> CheckpointFile:
        """Open a training state held in memory (e.g. fetched from an object store), with
        the same checks as a file; `path` is ``name`` (``"<bytes>"``; the object's
        URL for one read from a store), which messages name.

        Raises:
            TypeError: if ``data`` is not ``bytes``, ``bytearray`` or ``memoryview``.
            The errors of `CheckpointFile`.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"A training state in memory must be bytes. Received: {type(data).__name__}")
        return cls(str(name), data=data, whole=whole, unaligned_views=unaligned_views)

    def _misaligned(self) -> bool:
        """Whether the record's image holds an array of
        `DATA_ALIGN_ABOVE` bytes or more that does
        not start at a multiple of `DATA_ALIGN`
        bytes (a file written before the writer aligned them)."""
        if self._src.image is None:
            return False
        return any(
            offset % DATA_ALIGN
            for name, offset in self._spans.items()
            if name in self._datasets and self._datasets[name].id.get_storage_size() >= DATA_ALIGN_ABOVE
        )

    def _read_in_chunks(self) -> None:
        """Let the image go and list the file again from its open, locked handle: for a
        caller that needs aligned memory (``unaligned_views=False``), the views of a
        misaligned image would each be copied while the image is still held (twice the
        state at the peak); the arrays are read one by one into aligned memory instead
        (the seal already checked; each array still checked against its own checksum)."""
        self._src.drop_image()
        self._blob = (None, None)
        self._list()

    def _sync_source(self) -> None:
        src = self._src
        self.container, self.where, self.sealed, self.seal_version = (
            src.container,
            src.where,
            src.sealed,
            src.seal_version,
        )
        self.members, self.member, self.model_class = src.members, src.member, src.model_class

    def _open(self) -> None:
        self._src.open()
        self._sync_source()
        self._list()

    def _list(self) -> None:
        src = self._src
        is_record = src.h5.attrs.get("format") == FORMAT
        if self.sealed and not is_record:
            raise damaged(self.where, f"a sealed record whose format attribute is not {FORMAT!r}")
        if is_record:
            self.kind = FORMAT
            listing: RecordListing | StockListing
            listing = RecordListing(src)
            listing.list()
            self.version = listing.version
            self.metadata, self.contract, self.extra = listing.metadata, listing.contract, listing.extra
            self._shared = listing.shared
            self._datasets = listing.datasets
            self._spans = {**listing.spans, **listing.shared_spans}
        elif self.member == MEMBER:
            raise damaged(self.where, f"the member does not say it is a {FORMAT} record")
        else:
            listing = StockListing(src)
            listing.list()
            self.metadata = listing.metadata
            self.optimizer_keys = listing.optimizer_keys
            self._key_groups = listing.key_groups
        self.entries = listing.entries

    # -- reading --------------------------------------------------------------------------
    def read(self, entry: Entry) -> np.ndarray:
        """Read one array and, in a keras_stable_state file, check its checksum.

        Args:
            entry: One of `entries`.

        Returns:
            The array, of shape ``entry.shape``; ``bfloat16`` and float8 arrays
            (stored as unsigned integers of the same width) are viewed as their
            ``ml_dtypes`` dtype, others keep their stored dtype. A file opened
            ``whole`` returns a view of the buffer read on opening (all arrays of a
            sealed record share that buffer, none overlaps another: a second array
            read from one dataset of Keras' weights member, as rows of equal arrays
            are, is a copy); otherwise a new array read from the file.

        Raises:
            CorruptCheckpointError: naming ``entry.key`` if the array cannot be
                read (truncation) or fails its checksum (``.expected`` the
                stored, ``.received`` the computed value): format 3, the
                xxh3-64 of its key, dtype, shape and bytes (hex strings);
                format 2, the CRC-32 of the same; format 1, the CRC-32 of its
                bytes (ints).
            ValueError: if the file is closed.
            MemoryError: (or h5py's error saying so) if memory ran out reading it: the
                file is not called damaged.
        """
        h5 = self._src.h5
        if h5 is None:
            raise ValueError(
                f"{self.path}: the file is closed; read inside `with keras_stable_state.format.open_file(path)`."
            )
        if entry.xxh3 is not None:
            return self._read_packed(entry)
        try:
            stored = self._load(entry.dataset, h5[entry.dataset])
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            if out_of_memory(err):
                raise
            raise damaged(
                self.where, f"array for key {entry.key!r} cannot be read ({err})", key=entry.key
            ) from err
        if self.kind == FORMAT:
            # zlib reads the (C-order) array's buffer: the bytes of tobytes(), without the copy.
            if self.version == 1:
                computed = sandbox.crc_v1(stored)
            else:
                computed = sandbox.crc_v2(entry.key, entry.dtype, stored.shape, stored)
            if computed != entry.crc32:
                raise self._failed_checksum(entry, entry.crc32, computed)
        if entry.dtype in EXOTIC and stored.dtype.name != entry.dtype:
            target = np.dtype(EXOTIC[entry.dtype])
            if target.itemsize != stored.dtype.itemsize:
                raise damaged(self.where, f"array for key {entry.key!r} is not {entry.dtype}", key=entry.key)
            return stored.view(target)
        return stored

    def _load(self, name: str, ds: Any) -> np.ndarray:
        """The data of the dataset ``ds`` at ``name`` as stored: a view of the image read
        whole (`image`; the record's, or for a name in Keras'
        weights member that member's), else read from the file into a new 64-byte aligned
        array."""
        src = self._src
        whole = src.shared_image if name.startswith(keras_archive.PREFIX) else src.image
        offset = self._spans.get(name)
        if whole is not None and offset is not None:
            return image.dataset_view(whole, offset, ds.id)
        return sandbox.read_dataset(ds)

    def _failed_checksum(self, entry: Entry, expected: object, computed: object) -> CorruptCheckpointError:
        return damaged(
            self.where,
            f"array for key {entry.key!r} fails its {entry.checksum} checksum (expected {expected}, "
            f"computed {computed})",
            key=entry.key,
            expected=expected,
            received=computed,
        )

    def _read_packed(self, entry: Entry) -> np.ndarray:
        """Format 3: the array's bytes from its blob (a blob up to `_BLOB_CACHE_LIMIT`
        bytes is kept for the next array in it), checked against its xxh3-64."""
        try:
            name, blob = self._blob
            if entry.dataset.startswith(keras_archive.PREFIX):
                blob = self._load(entry.dataset, self._shared[entry.dataset]).reshape(-1).view(np.uint8)
                if entry.dataset in self._handed and self._src.shared_image is not None:
                    # rows of equal arrays referring to one dataset (files written before
                    # each got its own): each array has memory of its own
                    blob = image.aligned_copy(blob)
                self._handed.add(entry.dataset)
            elif name != entry.dataset:
                ds = self._datasets.get(entry.dataset)
                blob = self._load(entry.dataset, self._src.h5[entry.dataset] if ds is None else ds)
                self._blob = (entry.dataset, blob) if blob.nbytes <= _BLOB_CACHE_LIMIT else (None, None)
            assert blob is not None  # else name == entry.dataset: the blob cached with it
            raw = blob[entry.offset : entry.offset + entry.nbytes]
            if raw.nbytes != entry.nbytes:
                raise ValueError(f"{raw.nbytes} of its {entry.nbytes} bytes are in the blob")
            computed = sandbox.digest_v3(entry.key, entry.dtype, entry.shape, raw)
            stored = raw.view(stored_dtype(entry.dtype)).reshape(entry.shape)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            if out_of_memory(err):
                raise
            raise damaged(
                self.where, f"array for key {entry.key!r} cannot be read ({err})", key=entry.key
            ) from err
        if computed != entry.xxh3:
            raise self._failed_checksum(entry, f"{entry.xxh3:016x}", f"{computed:016x}")
        return decode_array(stored, entry.dtype)

    def check_members(self, progress: Callable[[int], object] | None = None) -> None:
        """Read every other archive member to the end, so that zip checks its CRC-32.

        A member a hash checked on opening covers whole (the sealed record member read
        in place, Keras' weights member whose xxh3-128 the sealed index records) is not
        read again. Appends failures to `damaged_members`; does nothing for HDF5 files.

        Args:
            progress: Optional callable given the number of bytes read after each chunk.
        """
        zf = self._src.zip
        if zf is None:
            return
        for name, _ in self.members:
            if name == self.member or name in self._src.hashed_members:
                continue
            if any(name == d for d, _ in self.damaged_members):
                continue
            try:
                with zf.open(name) as fh:
                    while chunk := fh.read(1 << 20):
                        if progress is not None:
                            progress(len(chunk))
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as err:
                self.damaged_members.append((name, str(err)))

    def check(self, progress: Callable[[int], object] | None = None) -> list[tuple[str, str]]:
        """Read every array and every archive member and check them.

        Args:
            progress: Optional callable given the bytes read after each array or chunk.

        Returns:
            ``[(key or member, reason)]`` for everything damaged; empty when intact.
        """
        damaged_ = []
        for e in self.entries:
            try:
                self.read(e)
            except CorruptCheckpointError as err:
                damaged_.append((str(err.key), str(err)))
            if progress is not None:
                progress(e.nbytes)
        self.check_members(progress)
        damaged_ += [
            (member, f"archive member {member!r} fails its zip CRC-32 ({reason})")
            for member, reason in self.damaged_members
        ]
        return damaged_

    def fileno(self) -> int:
        """The descriptor of the open file (``ValueError`` if closed or bytes in memory)."""
        fh = self._src.fh
        if fh is None or self._src.data is not None:
            raise ValueError(f"{self.path}: no open file to read from (closed, or bytes in memory).")
        return fh.fileno()

    @property
    def matched_by(self) -> MatchedBy:
        """`BY_KEY` for our record, `BY_STRUCTURE` for a stock Keras file."""
        return BY_KEY if self.kind == FORMAT else BY_STRUCTURE

    def close(self) -> None:
        """Close the file and release its lock; `read` then raises ``ValueError``.
        Closing twice is harmless."""
        self._src.close()
        self._blob = (None, None)
        self._shared = {}
        self._datasets = {}


def open_checkpoint_file(
    filepath: object, *, whole: bool = False, unaligned_views: bool = True
) -> CheckpointFile:
    """The `CheckpointFile` of a local ``.keras`` or HDF5 file (a ``file://`` URL is the
    local file it names; any other URL is refused: an object in a store is fetched by the
    object-store engine and opened with `CheckpointFile.from_bytes`): what
    `keras_stable_state.format.layout.open_file` opens for every path but a ``.orbax``
    folder.

    Raises:
        CheckpointFormatError: for a URL other than ``file://``.
        FileNotFoundError: naming the path if there is no such file.
        The errors of `CheckpointFile`.
    """
    if isinstance(filepath, bytes | str | os.PathLike):
        filepath = resolve(os.fsdecode(os.fspath(filepath)))
    return CheckpointFile(filepath, whole=whole, unaligned_views=unaligned_views)


def read_bytes(
    data: bytes, name: str = "<bytes>", *, unaligned_views: bool = True
) -> StateRecord | StockWeights:
    """`keras_stable_state.format.read_file` for a training state held in
    memory (``.h5`` or ``.keras`` bytes); messages name it ``name`` (the URL of an object
    read from a store).

    Raises:
        TypeError: if ``data`` is not bytes-like.
        The errors of `read_checkpoint_file`.
    """
    return read_whole(CheckpointFile.from_bytes(data, name, whole=True, unaligned_views=unaligned_views))


def read_checkpoint_file(filepath: object, *, unaligned_views: bool = True) -> StateRecord | StockWeights:
    """Read a ``.keras`` or HDF5 file whole, with every check: what
    `keras_stable_state.format.read_file` reads for every path but a
    ``.orbax`` folder.

    Every array is read and (keras_stable_state files) checked against its
    checksum (format 3: xxh3-64; formats 1-2: CRC-32), and every archive member
    against its zip CRC-32, before anything is returned. Built on
    `open_checkpoint_file`; the command line's ``verify`` runs exactly these checks. A sealed
    record is read once, whole, and its arrays are views of that buffer
    (`CheckpointFile`'s ``whole``); ``unaligned_views=False`` is for a caller
    that needs 64-byte aligned memory (see `CheckpointFile`).

    Returns:
        `StateRecord` for files written by keras_stable_state,
        `StockWeights` for stock Keras ``.keras`` / ``.weights.h5`` files.

    Raises:
        FileNotFoundError: if the path does not exist.
        PermissionError: if the file cannot be opened for reading.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: for every kind of damage `CheckpointFile`
            lists, an array failing its checksum (naming its key), an archive
            member failing its zip CRC-32 (naming it), or positional optimizer
            variables or their ``StableOptimizer`` keys missing.
        CheckpointFormatError: for a directory or another file that is not a regular
            file (FIFO, device, socket), an unknown format version, a
            legacy Keras HDF5 file, or a zip archive holding neither a training
            state nor Keras weights.
    """
    f = open_checkpoint_file(filepath, whole=True, unaligned_views=unaligned_views)
    return read_whole(f)


def read_whole(f: CheckpointFile) -> StateRecord | StockWeights:
    """Every array of the open file ``f`` read and checked, and its archive members (then
    ``f`` is closed): the `StateRecord` or `StockWeights` it holds.

    Raises:
        The errors of `read_checkpoint_file` for the same damage."""
    with f:
        arrays: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for e in f.entries:
            arrays[e.section][e.key] = f.read(e)
        check_members_or_refuse(f)
        if f.kind != FORMAT:
            return stock_weights(f.member is not None, arrays, f.optimizer_keys, f._key_groups)
        return state_record(f, arrays)


def check_members_or_refuse(f: CheckpointFile) -> None:
    """`CheckpointFile.check_members`; a ``CorruptCheckpointError`` names the first that fails."""
    f.check_members()
    if f.damaged_members:
        member, reason = f.damaged_members[0]
        raise damaged(f.path, f"archive member {member!r} fails its zip CRC-32 ({reason})", key=member)


def state_record(f: CheckpointFile, arrays: dict[str, dict[str, Any]]) -> StateRecord:
    """The `StateRecord` of the record file ``f`` holding ``arrays`` (``{section: {key: array}}``)."""
    return StateRecord(
        metadata=f.metadata,
        contract=f.contract,
        model=arrays["model"],
        optimizer=arrays["optimizer"],
        extra=f.extra,
        arrays=arrays["state"],
    )
