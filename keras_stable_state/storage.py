"""The on-disk format of a training state.

A training-state record is an HDF5 file (h5py) laid out as::

    /                  attrs: format="keras_stable_state", format_version=1
    /metadata          JSON string: backend, keras_version, dtype_policy, model_state, ...
    /contract          JSON string: list of [key, shape, dtype]
    /extra             JSON string: schedule, callbacks, RNG, position, providers
    /model/0, /1 ...   one dataset per model variable; attrs: key, crc32, dtype
    /optimizer/0 ...   one dataset per optimizer variable; same attrs
    /state/0 ...       arrays of the other state (callbacks, RNG, accumulators); same attrs

Inside a ``.keras`` archive the record is the member ``keras_stable_state.h5``
beside Keras' own ``config.json`` and ``model.weights.h5``, so
``keras.saving.load_model`` still loads the model. A plain ``.h5`` path holds
the record alone. Arrays whose dtype NumPy does not know natively
(``bfloat16``, float8 from ``ml_dtypes``) are stored as unsigned integers of
the same width with their dtype in the ``dtype`` attribute, so their bits are
kept exactly. Each array carries a CRC-32 (``zlib.crc32``) of its bytes, read
back and checked before anything is restored. Writes are atomic: a temporary
file in the same folder, ``fsync``, then ``os.replace``.

Stock Keras files (``.keras`` archives without the member, ``.weights.h5``)
are read through :class:`StockWeights`.

This module is the one reader of the format: :func:`open_file` lists every
array from the HDF5 metadata alone (:class:`CheckpointFile`, :class:`Entry`)
and reads and checksums one array at a time; :func:`read_file` reads a whole
file through it; the command line (:mod:`keras_stable_state.cli`) inspects,
verifies and compares files through it. It imports no Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import struct
import tempfile
import zipfile
import zlib

import h5py
import ml_dtypes
import numpy as np

from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MEMBER",
    "SECTIONS",
    "StateRecord",
    "StockWeights",
    "Entry",
    "CheckpointFile",
    "write_record",
    "open_file",
    "read_file",
    "atomic_path",
]

FORMAT = "keras_stable_state"
FORMAT_VERSION = 1
MEMBER = "keras_stable_state.h5"
KERAS_WEIGHTS_MEMBER = "model.weights.h5"
_EXOTIC = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


@dataclasses.dataclass
class StateRecord:
    """A training-state record held in memory.

    Attributes:
        metadata: Writer backend, Keras version, dtype policy, format version.
        contract: ``[key, shape, dtype]`` lists, or ``None``.
        model: Model variable arrays by key (insertion order = file order).
        optimizer: Optimizer variable arrays by entry key.
        extra: Other state (schedule, callbacks, RNG, position, providers) as
            JSON, with arrays replaced by references into ``arrays``.
        arrays: Arrays of the other state by name.
    """

    metadata: dict
    contract: list | None
    model: dict
    optimizer: dict
    extra: dict = dataclasses.field(default_factory=dict)
    arrays: dict = dataclasses.field(default_factory=dict)


def numpy_dtype(name: str):
    """The NumPy dtype for a Keras dtype name (ml_dtypes for ``bfloat16`` and float8)."""
    return np.dtype(_EXOTIC.get(name, name))


def dtype_name(array) -> str:
    """Standard name of an array's dtype (``"bfloat16"`` for ml_dtypes arrays)."""
    return np.dtype(array.dtype).name


def _encode(array):
    array = np.array(array, order="C", copy=True)
    name = dtype_name(array)
    if name in _EXOTIC:
        return array.view(np.dtype(f"uint{array.dtype.itemsize * 8}")), name
    return array, name


def _crc(array) -> int:
    # tobytes() is C order whatever the layout: the same bytes the writer stored.
    return zlib.crc32(np.asarray(array).tobytes()) & 0xFFFFFFFF


def _write_group(group, arrays: dict):
    for i, (key, value) in enumerate(arrays.items()):
        stored, name = _encode(np.asarray(value))
        ds = group.create_dataset(str(i), data=stored)
        ds.attrs["key"] = key
        ds.attrs["dtype"] = name
        ds.attrs["crc32"] = _crc(stored)


def _record_bytes(record: StateRecord) -> bytes:
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        # JSON records are string datasets, not attributes: HDF5 caps attributes at 64 KiB.
        for name in ("metadata", "contract", "extra"):
            f.create_dataset(name, data=json.dumps(getattr(record, name)))
        _write_group(f.create_group("model"), record.model)
        _write_group(f.create_group("optimizer"), record.optimizer)
        _write_group(f.create_group("state"), record.arrays)
    return buf.getvalue()


class atomic_path:
    """Context manager yielding a temporary path beside ``filepath``; on success it
    is fsynced and renamed onto ``filepath`` (``os.replace``), on error removed."""

    def __init__(self, filepath, suffix=""):
        self.filepath = os.fspath(filepath)
        self.suffix = suffix

    def __enter__(self):
        folder = os.path.dirname(os.path.abspath(self.filepath))
        os.makedirs(folder, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=".kss-", suffix=self.suffix, dir=folder)
        os.close(fd)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
            return False
        with open(self.tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(self.tmp, self.filepath)
        return False


def write_record(filepath, record: StateRecord, keras_archive_writer=None):
    """Write ``record`` atomically to ``filepath``.

    Args:
        filepath: ``.h5`` (record alone) or ``.keras`` (archive with the record as a member).
        record: What to write.
        keras_archive_writer: For ``.keras``: a callable taking a temporary
            path and writing Keras' own archive there (``model.save``).

    Raises:
        CheckpointFormatError: for another extension.
    """
    path = os.fspath(filepath)
    data = _record_bytes(record)
    if path.endswith(".keras"):
        with atomic_path(path, suffix=".keras") as tmp:
            keras_archive_writer(tmp)
            with zipfile.ZipFile(tmp, "a") as zf:
                zf.writestr(MEMBER, data)
    elif path.endswith(".h5"):
        with atomic_path(path, suffix=".h5") as tmp:
            with open(tmp, "wb") as fh:
                fh.write(data)
    else:
        raise CheckpointFormatError(
            f"Unsupported training-state path {path!r}: use a '.keras' or '.h5' extension.",
            received=path,
        )


@dataclasses.dataclass
class StockWeights:
    """Arrays of a stock Keras weights file, by their HDF5 path.

    Attributes:
        arrays: ``{"layers/dense/vars/0": array, ...}`` for model variables.
        optimizer: Optimizer arrays in their positional order (``"0"``, ``"1"``...),
            or ``{key: array}`` when a ``StableOptimizer`` wrote them.
        source: What the file is (``".keras archive"`` / ``".weights.h5"``).
    """

    arrays: dict
    optimizer: list
    source: str


# -- reading ------------------------------------------------------------------------------
SECTIONS = ("model", "optimizer", "state")
_STOCK_OPTIMIZER = "optimizer/vars/"
_RESTORE_HINT = "restore from an earlier checkpoint"
# What h5py, zipfile and zlib raise on a truncated or malformed file.
_READ_ERRORS = (OSError, KeyError, ValueError, RuntimeError, EOFError, zipfile.BadZipFile, zlib.error)


@dataclasses.dataclass
class Entry:
    """One array of a file, described from the HDF5 metadata without reading its data.

    Attributes:
        section: ``"model"``, ``"optimizer"`` or ``"state"`` (other state's arrays;
            stock Keras files have only the first two).
        key: Its key (``"path:layers/dense/kernel"``, ``"path:layers/dense/kernel#momentums"``,
            ``"optimizer#iteration"``) or, in a stock Keras file, its HDF5 path
            (``"layers/dense/vars/0"``).
        dataset: The HDF5 path of the dataset holding it (``"/model/0"``).
        shape: Its shape, a tuple of ints.
        dtype: Its dtype name (``"bfloat16"`` for arrays stored as their bits).
        nbytes: Size of its stored data in bytes.
        crc32: Its stored CRC-32, ``None`` in stock Keras files (they carry none).
    """

    section: str
    key: str
    dataset: str
    shape: tuple
    dtype: str
    nbytes: int
    crc32: int | None = None


def _natural(path: str):
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("/"))


def _raw_member(path: str, info: zipfile.ZipInfo) -> bytes:
    """A zip member's bytes without the zip CRC check (to find which array is damaged)."""
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"bad local header for member {info.filename!r}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        fh.seek(info.header_offset + 30 + name_len + extra_len)
        data = fh.read(info.compress_size)
    if info.compress_type == zipfile.ZIP_STORED:
        return data
    if info.compress_type == zipfile.ZIP_DEFLATED:
        return zlib.decompressobj(-15).decompress(data)
    raise zipfile.BadZipFile(f"member {info.filename!r} uses compression {info.compress_type}")


def _unreadable(path: str, err: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path!r} cannot be read as a .keras archive or HDF5 file ({err}). It is truncated or "
        f"damaged; {_RESTORE_HINT}.",
    )


class CheckpointFile:
    """A training-state file or stock Keras weights file, opened for reading.

    Lists every array (:attr:`entries`) from the HDF5 metadata alone;
    :meth:`read` reads one array and checks its CRC-32. Use as a context
    manager (see :func:`open_file`), or call :meth:`close`. Listing refuses a
    file whose structure is broken; damage that does not stop the listing
    (a duplicate key, an archive member failing its zip CRC-32) is recorded in
    :attr:`problems` and :attr:`damaged_members` so that a caller can name
    everything wrong. :func:`read_file` refuses such a file.

    Args:
        path: A ``.keras`` archive or an HDF5 file (``.h5``, ``.weights.h5``).

    Attributes:
        path: The path given, as a string.
        kind: ``"keras_stable_state"`` (:data:`FORMAT`) or ``"stock"``.
        container: ``".keras archive"``, ``".h5 file"`` or ``".weights.h5 file"``.
        where: How error messages name the data: ``path``, or ``"path:member"`` in an archive.
        metadata: Writer metadata (backend, Keras version, dtype policy, ...);
            for stock archives Keras' ``metadata.json``; else ``{}``.
        contract: ``[key, shape, dtype]`` lists, or ``None``.
        extra: Other state as JSON (schedule, callbacks, providers, RNG), or ``{}``.
        entries: Every array, as :class:`Entry`, in file order (stock files: by
            HDF5 path, numbers in numeric order).
        optimizer_keys: For stock files saved with ``StableOptimizer``:
            ``{dataset path: entry key}`` (``{"optimizer/vars/0": "optimizer#iteration"}``); else ``{}``.
        members: ``(name, size in bytes)`` of every archive member; ``[]`` for HDF5 files.
        member: The archive member holding the arrays (:data:`MEMBER` or
            ``"model.weights.h5"``), or ``None`` for HDF5 files.
        model_class: The model's class name from an archive's ``config.json``, or ``None``.
        damaged_members: ``(member, reason)`` for archive members whose zip CRC-32
            fails; the arrays of a damaged :attr:`member` are still listed and
            read past the zip check, so their own checksums name the damaged keys.
        problems: ``(key or dataset, reason)`` found while listing: a key that
            appears twice in a section, a dataset without a key, unreadable
            ``StableOptimizer`` keys.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CorruptCheckpointError: if the file is truncated, not a ``.keras``
            archive or HDF5 file, lacks its metadata, a group or a numbered
            dataset, or a damaged archive member cannot be read at all.
        CheckpointFormatError: for a format version this version does not
            read, or a zip archive holding neither a training state nor Keras weights.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.kind = "stock"
        self.container = ".h5 file"
        self.where = self.path
        self.metadata = {}
        self.contract = None
        self.extra = {}
        self.entries = []
        self.optimizer_keys = {}
        self.members = []
        self.member = None
        self.model_class = None
        self.damaged_members = []
        self.problems = []
        self._zip = None
        self._h5 = None
        self._keras_metadata = {}
        self._key_groups = set()
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"No training-state file at {self.path!r}.")
        try:
            self._open()
        except BaseException as err:
            self.close()
            if isinstance(err, _READ_ERRORS) and not isinstance(err, StateError):
                raise _unreadable(self.path, err) from err
            raise

    # -- opening --------------------------------------------------------------------------
    def _open(self):
        if zipfile.is_zipfile(self.path):
            self._open_archive()
        else:
            with open(self.path, "rb") as fh:
                head = fh.read(4)
            if head == b"PK\x03\x04":
                raise CorruptCheckpointError(
                    f"{self.path}: the zip archive has no central directory at its end: the file is "
                    f"truncated or damaged; {_RESTORE_HINT}."
                )
            self._h5 = h5py.File(self.path, "r")
            if self.path.endswith(".weights.h5"):
                self.container = ".weights.h5 file"
            if self._h5.attrs.get("format") == FORMAT:
                self.kind = FORMAT
        if self.kind == FORMAT:
            self._list_record()
        else:
            self._list_stock()

    def _open_archive(self):
        self.container = ".keras archive"
        self._zip = zipfile.ZipFile(self.path)
        infos = {info.filename: info for info in self._zip.infolist()}
        self.members = [(name, info.file_size) for name, info in infos.items()]
        if MEMBER in infos:
            self.member, self.kind = MEMBER, FORMAT
        elif KERAS_WEIGHTS_MEMBER in infos:
            self.member = KERAS_WEIGHTS_MEMBER
        else:
            raise CheckpointFormatError(
                f"{self.path}: this zip archive holds neither a training state ({MEMBER}) nor Keras "
                f"weights ({KERAS_WEIGHTS_MEMBER}). Pass a file written by save_training_state or "
                "keras' model.save.",
                received=self.path,
            )
        self.where = f"{self.path}:{self.member}"
        try:
            data = self._zip.read(self.member)
        except (zipfile.BadZipFile, zlib.error, EOFError) as err:
            # Read it anyway: the per-array checksums then name the damaged arrays.
            self.damaged_members.append((self.member, str(err)))
            try:
                data = _raw_member(self.path, infos[self.member])
            except (OSError, zipfile.BadZipFile, zlib.error) as raw_err:
                raise CorruptCheckpointError(
                    f"{self.where}: the archive member fails its zip CRC-32 ({err}) and cannot be read "
                    f"past it ({raw_err}). The file is damaged; {_RESTORE_HINT}."
                ) from raw_err
        self._h5 = h5py.File(io.BytesIO(data), "r")
        for name in ("metadata.json", "config.json"):
            if name not in infos:
                continue
            try:
                value = json.loads(self._zip.read(name))
            except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as err:
                self.damaged_members.append((name, str(err)))
                continue
            if isinstance(value, dict) and name == "config.json":
                self.model_class = value.get("class_name")
            elif isinstance(value, dict):
                self._keras_metadata = value

    def _list_record(self):
        f = self._h5
        version = int(f.attrs.get("format_version", -1))
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{self.where}: format version {version} is not one this version reads ({FORMAT_VERSION}). "
                "Upgrade keras_stable_state.",
                expected=FORMAT_VERSION,
                received=version,
            )
        try:
            self.metadata, self.contract, self.extra = (
                json.loads(f[name][()]) for name in ("metadata", "contract", "extra")
            )
        except (KeyError, ValueError, OSError) as err:
            raise CorruptCheckpointError(
                f"{self.where}: the metadata is unreadable ({err}). The file is damaged; {_RESTORE_HINT}."
            ) from err
        for section in SECTIONS:
            if section not in f:
                if section == "state":
                    continue
                raise CorruptCheckpointError(
                    f"{self.where}: group {section!r} is missing. The file is damaged; {_RESTORE_HINT}.",
                    key=section,
                )
            group = f[section]
            seen = set()
            for i in range(len(group)):
                name = f"{section}/{i}"
                ds = group.get(str(i))
                if not isinstance(ds, h5py.Dataset):
                    raise CorruptCheckpointError(
                        f"{self.where}: dataset {name} is missing ({len(group)} arrays expected). The file "
                        f"is damaged; {_RESTORE_HINT}.",
                        key=name,
                    )
                key = ds.attrs.get("key")
                if key is None:
                    self.problems.append((name, "has no key attribute"))
                    key = name
                key = str(key)
                if key in seen:
                    self.problems.append((key, f"appears twice in {section!r}"))
                seen.add(key)
                crc = ds.attrs.get("crc32")
                self.entries.append(
                    Entry(
                        section=section,
                        key=key,
                        dataset=ds.name,
                        shape=tuple(int(n) for n in ds.shape),
                        dtype=str(ds.attrs.get("dtype", ds.dtype.name)),
                        nbytes=int(ds.size) * ds.dtype.itemsize,
                        crc32=None if crc is None else int(crc),
                    )
                )

    def _list_stock(self):
        self.metadata = dict(self._keras_metadata)
        found = []

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                found.append(name)

        self._h5.visititems(visit)
        for name in sorted(found, key=_natural):
            ds = self._h5[name]
            if name.startswith("optimizer/") and name.endswith("/keys"):
                # StableOptimizer.save_own_variables: the entry keys of datasets "0", "1", ...
                group = name[: -len("keys")]
                self._key_groups.add(group)
                try:
                    keys = json.loads(np.asarray(ds[()], dtype=np.uint8).tobytes().decode())
                except (ValueError, TypeError, OSError) as err:
                    self.problems.append((name, f"optimizer keys are unreadable ({err})"))
                    continue
                self.optimizer_keys.update({f"{group}{i}": str(k) for i, k in enumerate(keys)})
                continue
            self.entries.append(
                Entry(
                    section="optimizer" if name.startswith("optimizer/") else "model",
                    key=name,
                    dataset=name,
                    shape=tuple(int(n) for n in ds.shape),
                    dtype="bfloat16" if ds.attrs.get("dtype") == "bfloat16" else ds.dtype.name,
                    nbytes=int(ds.size) * ds.dtype.itemsize,
                )
            )

    # -- reading --------------------------------------------------------------------------
    def read(self, entry: Entry) -> np.ndarray:
        """Read one array and, in a keras_stable_state file, check its CRC-32.

        Args:
            entry: One of :attr:`entries`.

        Returns:
            The array, of shape ``entry.shape``; ``bfloat16`` and float8 arrays
            (stored as unsigned integers of the same width) are viewed as their
            ``ml_dtypes`` dtype, others keep their stored dtype.

        Raises:
            CorruptCheckpointError: naming ``entry.key`` if the array cannot be
                read (truncation), fails its CRC-32 checksum (``.expected`` the
                stored, ``.received`` the computed value), or, in a
                keras_stable_state file, carries no checksum.
            ValueError: if the file is closed.
        """
        if self._h5 is None:
            raise ValueError(f"{self.path}: the file is closed; read inside `with storage.open_file(path)`.")
        ds = self._h5[entry.dataset]
        try:
            stored = np.asarray(ds[()])
        except (OSError, ValueError, RuntimeError) as err:
            raise CorruptCheckpointError(
                f"{self.where}: array for key {entry.key!r} cannot be read ({err}). The file is truncated "
                f"or damaged; {_RESTORE_HINT}.",
                key=entry.key,
            ) from err
        if self.kind == FORMAT:
            if entry.crc32 is None:
                raise CorruptCheckpointError(
                    f"{self.where}: array for key {entry.key!r} has no CRC-32 checksum. The file was not "
                    f"written by keras_stable_state or is damaged; {_RESTORE_HINT}.",
                    key=entry.key,
                )
            computed = _crc(stored)
            if computed != entry.crc32:
                raise CorruptCheckpointError(
                    f"{self.where}: array for key {entry.key!r} fails its CRC-32 checksum (expected "
                    f"{entry.crc32}, computed {computed}). The file is damaged; {_RESTORE_HINT}.",
                    key=entry.key,
                    expected=entry.crc32,
                    received=computed,
                )
        if entry.dtype in _EXOTIC and stored.dtype.name != entry.dtype:
            target = np.dtype(_EXOTIC[entry.dtype])
            return stored.view(target) if target.itemsize == stored.dtype.itemsize else stored.astype(target)
        return stored

    def check_members(self, progress=None):
        """Read every other archive member to the end, so that zip checks its CRC-32.

        Appends failures to :attr:`damaged_members`; does nothing for HDF5 files.

        Args:
            progress: Optional callable given the number of bytes read after each chunk.
        """
        if self._zip is None:
            return
        for name, _ in self.members:
            if name == self.member or any(name == d for d, _ in self.damaged_members):
                continue
            try:
                with self._zip.open(name) as fh:
                    while chunk := fh.read(1 << 20):
                        if progress is not None:
                            progress(len(chunk))
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as err:
                self.damaged_members.append((name, str(err)))

    def section(self, name: str) -> list:
        """The entries of one section (``"model"``, ``"optimizer"``, ``"state"``), in file order."""
        return [e for e in self.entries if e.section == name]

    @property
    def total_bytes(self) -> int:
        """Bytes of array data in the file."""
        return sum(e.nbytes for e in self.entries)

    def close(self):
        """Close the file; :meth:`read` then raises ``ValueError``. Closing twice is harmless."""
        for handle in (self._h5, self._zip):
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.close()
        self._h5 = self._zip = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def open_file(filepath) -> CheckpointFile:
    """Open a training-state file or stock Keras weights file for reading, lazily.

    Nothing but HDF5 metadata is read until :meth:`CheckpointFile.read`.

    Example:
        >>> with storage.open_file("run.keras") as f:
        ...     kernel = f.read(f.section("model")[0])

    Returns:
        A :class:`CheckpointFile`, to use as a context manager.

    Raises:
        FileNotFoundError: if the path does not exist.
        CorruptCheckpointError: if the file is truncated or not a ``.keras``/HDF5 file.
        CheckpointFormatError: for an unknown format version, or a zip archive
            holding neither a training state nor Keras weights.
    """
    return CheckpointFile(filepath)


def _refuse_damage(f: CheckpointFile):
    for member, reason in f.damaged_members:
        if member == f.member:
            raise CorruptCheckpointError(
                f"{f.where}: the archive member fails its zip CRC-32 ({reason}). The file is damaged; "
                f"{_RESTORE_HINT}."
            )
    if f.problems:
        listed = "; ".join(f"{where!r} {reason}" for where, reason in f.problems)
        raise CorruptCheckpointError(
            f"{f.where}: {listed}. The file was not written by keras_stable_state or is damaged.",
            key=f.problems[0][0],
        )


def _stock_weights(f: CheckpointFile, arrays: dict) -> StockWeights:
    source = "stock Keras .keras archive" if f.member else "stock Keras .weights.h5 file"
    opt = {
        k[len(_STOCK_OPTIMIZER) :]: v
        for k, v in arrays["optimizer"].items()
        if k.startswith(_STOCK_OPTIMIZER)
    }
    missing = [str(i) for i in range(len(opt)) if str(i) not in opt]
    if missing:
        raise CorruptCheckpointError(
            f"{source}: optimizer variables {missing} are missing from 'optimizer/vars' ({len(opt)} datasets). "
            "The file is damaged.",
            key=f"{_STOCK_OPTIMIZER}{missing[0]}",
        )
    optimizer = [opt[str(i)] for i in range(len(opt))]
    if _STOCK_OPTIMIZER in f._key_groups:
        # written by a StableOptimizer inside Keras' own weights file: keyed, not positional
        names = {p: k for p, k in f.optimizer_keys.items() if p[len(_STOCK_OPTIMIZER) :].isdigit()}
        paths = [f"{_STOCK_OPTIMIZER}{i}" for i in range(len(optimizer))]
        if len(names) != len(optimizer) or any(p not in names for p in paths):
            raise CorruptCheckpointError(
                f"{source}: 'optimizer/vars/keys' names {len(names)} optimizer variables, the file holds "
                f"{len(optimizer)}. The file is damaged.",
                key="optimizer/vars/keys",
                expected=len(optimizer),
                received=len(names),
            )
        optimizer = dict(zip((names[p] for p in paths), optimizer, strict=True))
        source += " (optimizer saved by key by StableOptimizer)"
    return StockWeights(arrays=arrays["model"], optimizer=optimizer, source=source)


def read_file(filepath):
    """Read a training-state file, or a stock Keras weights file, whole.

    Every array is read and (keras_stable_state files) checked against its
    CRC-32 before anything is returned. Built on :func:`open_file`.

    Returns:
        :class:`StateRecord` for files written by keras_stable_state,
        :class:`StockWeights` for stock Keras ``.keras`` / ``.weights.h5`` files.

    Raises:
        FileNotFoundError: if the path does not exist.
        CorruptCheckpointError: if the file is truncated, not an archive/HDF5
            file, an array fails its checksum (naming its key, also when the
            archive member holding it fails its zip CRC-32), the archive
            member fails its zip CRC-32, a key appears twice in a section, or
            positional optimizer variables or their ``StableOptimizer`` keys are missing.
        CheckpointFormatError: for an unknown format version, or a zip archive
            holding neither a training state nor Keras weights.
    """
    with open_file(filepath) as f:
        try:
            arrays = {section: {e.key: f.read(e) for e in f.section(section)} for section in SECTIONS}
            _refuse_damage(f)
            if f.kind != FORMAT:
                return _stock_weights(f, arrays)
        except StateError:
            raise
        except _READ_ERRORS as err:
            raise _unreadable(f.path, err) from err
        return StateRecord(
            metadata=f.metadata,
            contract=f.contract,
            model=arrays["model"],
            optimizer=arrays["optimizer"],
            extra=f.extra,
            arrays=arrays["state"],
        )
