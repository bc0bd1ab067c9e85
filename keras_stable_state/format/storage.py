"""The on-disk format of a training state.

A training-state record (format 3) is an HDF5 file (h5py) laid out as::

    user block (512 bytes)  "KSS-SEAL 3 xxh3-128 <hex> <length>\\n": xxh3-128 of every byte after it
    /                  attrs: format="keras_stable_state", format_version=3
    /metadata          JSON (UTF-8 bytes as uint8): backend, keras_version, dtype_policy, ...
    /contract          JSON: list of [key, shape, dtype]
    /extra             JSON: schedule, callbacks, RNG, position, providers
    /index             JSON: {section: [[key, dtype, shape, blob, offset, xxh3-64 hex], ...]}
    /model/0, /1 ...   blobs: uint8 datasets holding the model variables' bytes
    /optimizer/0 ...   blobs of the optimizer variables
    /state/0 ...       blobs of the other state's arrays (callbacks, RNG, accumulators)

Each JSON dataset carries an ``xxh3`` attribute (uint64): the xxh3-64 of its name and bytes.
An array larger than :data:`PACK_LIMIT` bytes has a blob of its own; smaller
arrays are packed, in index order, into shared blobs of about
:data:`BLOB_TARGET` bytes, each starting at an offset that is a multiple of
:data:`ALIGN`, so that thousands of small variables cost a few HDF5 datasets
rather than one each. The index lists every array in file order; a reader
requires the blobs to hold exactly the listed arrays, in that order, at those
offsets.

Formats 1 and 2 (one dataset per array with ``key``/``dtype``/``crc32``
attributes; format 2 sealed with SHA-256 and CRC-32 over key, dtype, shape and
bytes) are still read.

Inside a ``.keras`` archive the record is the member ``keras_stable_state.h5``
beside Keras' own ``config.json`` and ``model.weights.h5``, so
``keras.saving.load_model`` still loads the model. A plain ``.h5`` path holds
the record alone. Arrays whose dtype NumPy does not know natively
(``bfloat16``, float8 from ``ml_dtypes``) are stored as unsigned integers of
the same width, their dtype named in the index, so their bits are kept
exactly.

Integrity, in the order a reader checks it (see docs: Security and integrity):

1. The whole HDF5 image is covered by the seal in its user block (format 3:
   xxh3-128, https://github.com/Cyan4973/xxHash, through the ``xxhash``
   package; format 2: SHA-256). HDF5 skips the user block, so h5py and Keras
   still open the file. The seal is checked before HDF5 parses a byte: a
   damaged file is refused before it can crash or hang the HDF5 library. The
   seal detects damage, not forgery. Files without a seal (stock Keras files,
   format-1 records) are first read in a separate process
   (:mod:`keras_stable_state.format.sandbox`), so whatever HDF5 does with them
   cannot kill the caller.
2. The structure: only hard links, no external storage or virtual datasets,
   contiguous uncompressed data inside the file, plain little-endian numeric
   dtypes, exactly the groups and numbered datasets above, every attribute of
   the expected type; format 3: every index row well formed and the blobs
   holding exactly the listed arrays; formats 1-2: each dataset's stored dtype
   and shape equal to what its attributes say.
3. The records: each JSON record has its own checksum and a schema check
   (nesting depth, field types, RNG records, array references).
4. Each array's checksum (format 3: xxh3-64; format 2: CRC-32 ``zlib.crc32``)
   covers its key, dtype name, shape and bytes, checked when it is read.

Archives: members' zip CRC-32s are checked, members whose unpacked size is far
beyond their stored size are refused, and nothing in an archive is extracted,
deserialized or executed. Writes are atomic: a temporary file in the same
folder, ``fsync``, ``os.replace``, then ``fsync`` of the folder; the file gets
the permissions ``open`` would give (``0o666`` less the umask).

Stock Keras files (``.keras`` archives without the member, ``.weights.h5``)
are read through :class:`StockWeights`.

This module is the one reader of the format: :func:`open_file` lists every
array from the HDF5 metadata alone (:class:`CheckpointFile`, :class:`Entry`)
and reads and checksums one array at a time; :func:`read_file` reads a whole
file through it, with every check; the command line
(:mod:`keras_stable_state.cli`) inspects, verifies and compares files through
it. It imports no Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib

import h5py
import ml_dtypes
import numpy as np
import xxhash

from keras_stable_state.errors import (
    CheckpointFormatError,
    CheckpointInUseError,
    CorruptCheckpointError,
    StateError,
)
from keras_stable_state.format import keras_archive as _shared
from keras_stable_state.format import sandbox as checks

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; files are still checked
    fcntl = None

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
    "check_target",
    "open_file",
    "read_file",
    "read_bytes",
    "record_to_bytes",
    "atomic_path",
    "seal",
    "reseal",
]

FORMAT = "keras_stable_state"
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
MEMBER = "keras_stable_state.h5"
KERAS_WEIGHTS_MEMBER = "model.weights.h5"
USERBLOCK_SIZE = 512
SECTIONS = ("model", "optimizer", "state")
RECORDS = ("metadata", "contract", "extra")
INDEX = "index"
# Index field of a .keras record naming Keras' weights member it shares model arrays with.
SHARED = "shared"
# Format 3 packing: arrays up to PACK_LIMIT bytes share blobs, a blob is written once it
# holds BLOB_TARGET bytes (so a save holds at most about BLOB_TARGET + PACK_LIMIT bytes of
# packed arrays), and each packed array starts at a multiple of ALIGN.
PACK_LIMIT = 1 << 16
BLOB_TARGET = 1 << 20
ALIGN = 16
# Blobs up to this size are kept after a read, for the next array of the same blob.
_BLOB_CACHE_LIMIT = 4 * BLOB_TARGET
MAX_NDIM = 32
_HEX16 = re.compile(r"[0-9a-f]{16}")
JSON_MAX_DEPTH = 100
# An archive member may unpack to at most this many times its stored size (plus the slack).
MAX_UNPACK_RATIO = 100
UNPACK_SLACK = 1 << 20
PROBE_TIMEOUT = 60.0
# A file that already failed its seal is probed only to name its damaged keys: never wait long.
DIAGNOSE_TIMEOUT = 5.0
_SEAL_RE = re.compile(rb"KSS-SEAL (2 sha256 [0-9a-f]{64}|3 xxh3-128 [0-9a-f]{32}) ([0-9]{1,20})\n")
# The seal's hash by format version.
_SEAL_HASH = {2: ("SHA-256", hashlib.sha256), 3: ("xxh3-128", xxhash.xxh3_128)}
_SEAL_NAME = {2: b"sha256", 3: b"xxh3-128"}
_SEAL_MAGIC = b"KSS-SEAL"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_ZIP_SIGNATURE = b"PK\x03\x04"
_EXOTIC = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
_DTYPES = {
    "bool",
    *(f"int{n}" for n in (8, 16, 32, 64)),
    *(f"uint{n}" for n in (8, 16, 32, 64)),
    "float16",
    "float32",
    "float64",
    *_EXOTIC,
}
_RESTORE_HINT = "restore from an earlier checkpoint"
_CHUNK = 1 << 22


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

    For writing (:func:`write_record`), a value in ``model``, ``optimizer`` or
    ``arrays`` may also be a zero-argument callable returning the array: it is
    called when that array is written, and the array dropped once it is on disk,
    so a save holds one host copy at a time (``save_training_state`` passes the
    variables' conversions so; an asynchronous writer may pass host copies made
    beforehand). Records read back always hold arrays.
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


def _stored_dtype(name: str) -> np.dtype:
    """The little-endian dtype an array of dtype ``name`` is stored as."""
    if name in _EXOTIC:
        return np.dtype(f"<u{np.dtype(_EXOTIC[name]).itemsize}")
    return np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1 else np.dtype(name)


def _encode(array):
    # C order without a copy when it already is (the value is written, then dropped).
    array = np.asarray(array, order="C")
    name = dtype_name(array)
    if name not in _DTYPES:
        raise CheckpointFormatError(
            f"Arrays of dtype {name} cannot be stored (only bool, int, uint, float, bfloat16 and float8).",
            received=name,
        )
    # np.asarray(..., order="C") above made it C-contiguous; the view and astype keep the shape (0-d too).
    stored = (
        array.view(_stored_dtype(name)) if name in _EXOTIC else array.astype(_stored_dtype(name), copy=False)
    )
    return stored, name


# -- writing ------------------------------------------------------------------------------
class _SectionWriter:
    """Writes one section's arrays into numbered uint8 blobs (format 3), one array at a
    time, and builds the section's index rows."""

    def __init__(self, group, shared=None):
        self.group = group
        self.shared = shared
        self.rows = []
        self.blobs = 0
        self.buf = bytearray()
        self.open = False  # a shared blob is being filled (it may hold zero-size arrays only)

    def add(self, key, value):
        if callable(value):
            value = value()
        stored, name = _encode(np.asarray(value))
        del value
        # C order (from _encode): the raw view is the bytes of tobytes(), without the copy.
        raw = stored.reshape(-1).view(np.uint8)
        digest = f"{checks.digest_v3(str(key), name, stored.shape, raw):016x}"
        shape = [int(n) for n in stored.shape]
        ref = self.shared.find(stored) if self.shared is not None and raw.nbytes else None
        if ref is not None:  # the same bytes are in Keras' model.weights.h5: not written twice
            self.rows.append([str(key), name, shape, ref, 0, digest])
            return
        if raw.nbytes > PACK_LIMIT:
            self.flush()
            self.group.create_dataset(str(self.blobs), data=raw)
            self.rows.append([str(key), name, shape, self.blobs, 0, digest])
            self.blobs += 1
            return
        offset = _aligned(len(self.buf)) if self.buf else 0
        self.buf += bytes(offset - len(self.buf))
        self.rows.append([str(key), name, shape, self.blobs, offset, digest])
        self.buf += raw.data
        self.open = True
        if len(self.buf) >= BLOB_TARGET:
            self.flush()

    def flush(self):
        if not self.open:
            return
        self.group.create_dataset(str(self.blobs), data=np.frombuffer(self.buf, dtype=np.uint8))
        self.blobs += 1
        self.buf = bytearray()
        self.open = False


def _aligned(n: int) -> int:
    return n + (-n) % ALIGN


def _write_section(group, arrays, shared=None) -> list:
    """Write ``arrays`` into ``group`` as blobs (format 3); return the section's index rows.

    ``arrays``: a dict ``{key: array or zero-argument callable returning one}``, or
    an iterable of ``(key, array or callable)`` pairs; each is converted, written
    (or packed) and dropped in turn.
    """
    writer = _SectionWriter(group, shared)
    for key, value in arrays.items() if isinstance(arrays, dict) else arrays:
        writer.add(key, value)
    writer.flush()
    return writer.rows


def _json_array(value) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode("utf-8"), dtype=np.uint8)


def _seal_head(version: int, digest: str, length: int) -> bytes:
    return b"KSS-SEAL %d %s %s %d\n" % (version, _SEAL_NAME[version], digest.encode(), length)


def _seal_version(head: bytes) -> int:
    """The format version of an existing seal (format 2 files are resealed as such), else the current."""
    return 2 if head.startswith(b"KSS-SEAL 2 ") else FORMAT_VERSION


def seal(data: bytes) -> bytes:
    """``data`` (an HDF5 image written with a 512-byte user block) with its user block
    replaced by the seal ``KSS-SEAL 3 xxh3-128 <hex> <length>`` (``KSS-SEAL 2 sha256 ...``
    for an image that already carries a format-2 seal), zero padded."""
    version = _seal_version(data[:USERBLOCK_SIZE])
    body = data[USERBLOCK_SIZE:]
    head = _seal_head(version, _SEAL_HASH[version][1](body).hexdigest(), len(body))
    return head.ljust(USERBLOCK_SIZE, b"\0") + body


def _write_h5(target, record: StateRecord, shared: _shared.KerasWeights | None = None) -> None:
    """Write ``record``'s HDF5 image (format 3), user block left zero, to ``target`` (a
    path or a binary file object), one array at a time; model arrays found in
    ``shared`` (Keras' weights of the same archive) are referred to, not written."""
    with h5py.File(target, "w", userblock_size=USERBLOCK_SIZE) as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        index = {
            section: _write_section(f.create_group(section), arrays, shared if section == "model" else None)
            for section, arrays in zip(SECTIONS, (record.model, record.optimizer, record.arrays), strict=True)
        }
        if any(isinstance(row[3], str) for row in index["model"]):
            index[SHARED] = shared.spec
        # JSON records are uint8 datasets: no HDF5 attribute size cap, no variable-length types.
        for name in (*RECORDS, INDEX):
            data = _json_array(index if name == INDEX else getattr(record, name))
            ds = f.create_dataset(name, data=data)
            ds.attrs["xxh3"] = np.uint64(checks.digest_v3(name, "json", data.shape, data))


def _record_bytes(record: StateRecord) -> bytes:
    buf = io.BytesIO()
    _write_h5(buf, record)
    return seal(buf.getvalue())


def _seal_file(path: str) -> None:
    """Write the seal into the user block of the HDF5 image at ``path`` (as :func:`seal`),
    hashing the file in chunks of :data:`_CHUNK` bytes."""
    h = _SEAL_HASH[FORMAT_VERSION][1]()
    length = 0
    buf = bytearray(_CHUNK)
    with open(path, "rb+") as fh:
        fh.seek(USERBLOCK_SIZE)
        while n := fh.readinto(buf):
            h.update(memoryview(buf)[:n])
            length += n
        fh.seek(0)
        fh.write(_seal_head(FORMAT_VERSION, h.hexdigest(), length).ljust(USERBLOCK_SIZE, b"\0"))


def _write_sealed(path: str, record: StateRecord, shared=None) -> None:
    """A sealed record file at ``path``: the HDF5 image written array by array, then sealed."""
    _write_h5(path, record, shared)
    _seal_file(path)


def reseal(filepath) -> None:
    """Recompute the seal of a record edited on purpose (tests, tools); ``.h5`` or ``.keras``.

    The seal detects damage, not forgery: anyone who can write the file can reseal it.
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


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _fsync_dir(folder: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(path: str, err: OSError) -> OSError:
    reason = err.strerror or str(err)
    extra = " (the disk is full)" if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return OSError(
        err.errno,
        f"Could not write the training state to {path!r}: {reason}{extra}. Nothing was written there: "
        "the file that was at that path, if any, is unchanged. Free space or choose another folder.",
        path,
    )


def _directory_error(path: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path!r} is a directory; a training state is one file. Choose a file path "
        "(e.g. 'run.h5' or 'run.keras').",
        received=path,
    )


class atomic_path:
    """Context manager yielding a temporary path beside ``filepath``; on success the
    file gets ``0o666 & ~umask`` permissions, is fsynced and renamed onto
    ``filepath`` (``os.replace``), and the folder is fsynced; on error it is removed.

    Raises:
        CheckpointFormatError: if ``filepath`` is a directory.
        OSError: naming ``filepath`` when writing fails (disk full, permissions);
            the previous file at ``filepath`` is left as it was.
    """

    def __init__(self, filepath, suffix=""):
        self.filepath = os.fsdecode(os.fspath(filepath))
        self.suffix = suffix

    def __enter__(self):
        if os.path.isdir(self.filepath):
            raise _directory_error(self.filepath)
        folder = os.path.dirname(os.path.abspath(self.filepath))
        try:
            os.makedirs(folder, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix=".kss-", suffix=self.suffix, dir=folder)
        except OSError as err:
            raise _write_error(self.filepath, err) from err
        os.close(fd)
        self.folder = folder
        return self.tmp

    def _discard(self):
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._discard()
            if isinstance(exc, OSError) and not isinstance(exc, StateError):
                raise _write_error(self.filepath, exc) from exc
            return False
        try:
            os.chmod(self.tmp, 0o666 & ~_umask())
            with open(self.tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(self.tmp, self.filepath)
        except OSError as err:
            self._discard()
            raise _write_error(self.filepath, err) from err
        _fsync_dir(self.folder)
        return False


def record_to_bytes(record: StateRecord) -> bytes:
    """``record`` as the bytes of a sealed ``.h5`` training state (for object stores);
    :func:`read_bytes` reads them back."""
    return _record_bytes(record)


def check_target(filepath) -> str:
    """``filepath`` as a ``str``, if a training state can be written there.

    Raises:
        CheckpointFormatError: for an extension other than ``.keras`` / ``.h5``, or
            a path that is a directory.
    """
    path = os.fsdecode(os.fspath(filepath))
    if not path.endswith((".keras", ".h5")):
        raise CheckpointFormatError(
            f"Unsupported training-state path {path!r}: use a '.keras' or '.h5' extension.",
            received=path,
        )
    if os.path.isdir(path):
        raise _directory_error(path)
    return path


def write_record(filepath, record: StateRecord, keras_archive_writer=None):
    """Write ``record`` atomically to ``filepath``.

    Args:
        filepath: ``.h5`` (record alone) or ``.keras`` (archive with the record as a member).
        record: What to write.
        keras_archive_writer: For ``.keras``: a callable taking a temporary
            path and writing Keras' own archive there (``model.save``).

    Raises:
        CheckpointFormatError: for another extension, or a path that is a directory.
        OSError: naming the path when the write fails (e.g. disk full); the
            previous file at that path is left intact.
    """
    path = check_target(filepath)
    if path.endswith(".keras"):
        with atomic_path(path, suffix=".keras") as tmp:
            keras_archive_writer(tmp)
            member = f"{tmp}.member.h5"
            try:
                _write_sealed(member, record, _shared.KerasWeights.of_archive(tmp))
                _append_member(tmp, member)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(member)
    else:
        with atomic_path(path, suffix=".h5") as tmp:
            _write_sealed(tmp, record)


def _append_member(archive: str, member_path: str) -> None:
    """Append the file at ``member_path`` to the zip ``archive`` as :data:`MEMBER`, stored,
    copied in chunks (as ``ZipFile.writestr`` would store it, without holding it in memory)."""
    size = os.path.getsize(member_path)
    with zipfile.ZipFile(archive, "a") as zf:
        info = zipfile.ZipInfo(MEMBER, date_time=time.localtime(time.time())[:6])
        info.compress_type = zf.compression
        info.external_attr = 0o600 << 16
        info.file_size = size
        with open(member_path, "rb") as src, zf.open(info, "w") as out:
            shutil.copyfileobj(src, out, _CHUNK)


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
_STOCK_OPTIMIZER = "optimizer/vars/"


@dataclasses.dataclass
class Entry:
    """One array of a file, described from the HDF5 metadata without reading its data.

    Attributes:
        section: ``"model"``, ``"optimizer"`` or ``"state"`` (other state's arrays;
            stock Keras files have only the first two).
        key: Its key (``"path:layers/dense/kernel"``, ``"path:layers/dense/kernel#momentums"``,
            ``"optimizer#iteration"``) or, in a stock Keras file, its HDF5 path
            (``"layers/dense/vars/0"``).
        dataset: The HDF5 path of the dataset holding it (``"/model/0"``; format 3: its
            blob, shared with other arrays when small).
        shape: Its shape, a tuple of ints.
        dtype: Its dtype name (``"bfloat16"`` for arrays stored as their bits).
        nbytes: Size of its stored data in bytes.
        crc32: Its stored CRC-32 (formats 1-2), else ``None`` (stock Keras files carry none).
        offset: Format 3: where its bytes start in its blob; else 0.
        xxh3: Format 3: its stored xxh3-64 (over key, dtype, shape and bytes), else ``None``.
    """

    section: str
    key: str
    dataset: str
    shape: tuple
    dtype: str
    nbytes: int
    crc32: int | None = None
    offset: int = 0
    xxh3: int | None = None

    @property
    def checksum(self) -> str:
        """The name of the checksum it carries: ``"xxh3-64"``, ``"CRC-32"`` or ``""`` (stock files)."""
        return "xxh3-64" if self.xxh3 is not None else "CRC-32" if self.crc32 is not None else ""


def _natural(path: str):
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("/"))


def _damaged(where: str, what: str, key=None, **kw) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}. The file is damaged; {_RESTORE_HINT}.", key=key, **kw)


def _probe(path: str, member: str | None = None, timeout: float = PROBE_TIMEOUT, expect=None) -> dict:
    """Read an HDF5 file (or archive member) in a separate process.

    Args:
        expect: Optional ``[[key, dtype, shape, dataset path, xxh3-64 hex]]`` rows whose
            datasets the probe also checks (:func:`keras_stable_state.format.sandbox.check_expected`).

    Returns:
        The probe's findings (see :func:`keras_stable_state.format.sandbox.probe`),
        or ``{"crashed": reason}`` when the process died, hung or raised.
    """
    with tempfile.TemporaryDirectory(prefix="kss-probe-") as folder:
        rows = ""
        if expect:
            rows = os.path.join(folder, "expect.json")
            with open(rows, "w") as fh:
                json.dump(expect, fh)
        cmd = [sys.executable, "-I", checks.__file__, path, member or "", rows]
        return _run_probe(cmd, timeout)


def _run_probe(cmd: list, timeout: float) -> dict:
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"crashed": f"reading it did not finish within {timeout:.0f} s"}
    if done.returncode < 0:
        return {"crashed": f"reading it killed a probe process (signal {-done.returncode})"}
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return {"crashed": f"HDF5 cannot read it ({last[0][:300]})"}
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"crashed": "the probe process printed no result"}


def _probe_or_refuse(where: str, path: str, member: str | None = None) -> None:
    """Refuse a file that crashes, hangs or fails a structure check in a probe process."""
    result = _probe(path, member)
    if "crashed" in result:
        raise _damaged(where, f"{result['crashed']}; its HDF5 structure is broken")
    if result.get("structure"):
        raise _damaged(where, f"HDF5 object {result['structure']}")


def _diagnose(
    where: str, path: str, member: str | None, what: str, default_key=None, expect=None
) -> CorruptCheckpointError:
    """A refusal for a file that fails its seal, naming the damaged keys a probe finds."""
    result = _probe(path, member, timeout=DIAGNOSE_TIMEOUT, expect=expect)
    found = result.get("damaged", [])
    damaged = [key for key, _ in found]
    if damaged:
        listed = ", ".join(repr(k) for k in damaged)
        # the probe's reason: "fails its CRC-32 checksum" (formats 1-2) or "fails its xxh3-64 checksum"
        verb = found[0][1] if len(damaged) == 1 else found[0][1].replace("fails its", "fail their") + "s"
        return _damaged(where, f"{what}: {listed} {verb}", key=damaged[0])
    if "crashed" in result:
        return _damaged(where, f"{what}; {result['crashed']}", key=default_key)
    return _damaged(where, f"{what} (its metadata, a record or the layout was changed)", key=default_key)


def _parse_seal(head: bytes, where: str) -> tuple[int, bytes, int]:
    """``(format version, digest, length)`` of a seal."""
    match = _SEAL_RE.match(head)
    if match is None or any(head[match.end() : USERBLOCK_SIZE]):
        raise _damaged(where, "its seal (the hash header in the first 512 bytes) is malformed")
    version, _, digest = match.group(1).decode().split(" ")
    return int(version), bytes.fromhex(digest), int(match.group(2))


def _check_json_depth(value, where: str):
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > JSON_MAX_DEPTH:
            raise _damaged(where, f"a JSON record is nested deeper than {JSON_MAX_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _refs(value) -> list:
    """Every ``{"__array__": name}`` reference inside a JSON value."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if set(item) == {"__array__"}:
                found.append(item["__array__"])
                continue
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_key(where: str, section: str, key: str) -> None:
    """Refuse a key that restore could not parse (verify and restore refuse the same files)."""
    from keras_stable_state._identity import keys

    if section == "model":
        keys.parse_model_key(key, where)
    elif section == "optimizer":
        keys.parse_optimizer_key(key, where)


class CheckpointFile:
    """A training-state file or stock Keras weights file, opened for reading.

    Opening checks the whole-file seal (records), or reads the file once in a
    probe process (unsealed files), then lists every array (:attr:`entries`)
    from the HDF5 metadata and checks the structure and the records' schema;
    :meth:`read` reads one array and checks its CRC-32; :meth:`check` reads
    everything. The file is held with a shared ``flock`` while open, so a
    writer holding it exclusively is detected. Use as a context manager (see
    :func:`open_file`), or call :meth:`close`.

    Args:
        path: A ``.keras`` archive or an HDF5 file (``.h5``, ``.weights.h5``).

    Attributes:
        path: The file's path.
        kind: ``"keras_stable_state"`` for training states, ``"stock"`` for stock Keras files.
        container: ``".keras archive"``, ``".h5 file"`` or ``".weights.h5 file"``.
        where: What error messages call it: the path, or ``"<path>:<member>"``.
        version: The record's format version (``None`` for stock files).
        sealed: ``True`` when the file carries the SHA-256 seal (format 2).
        metadata: The writer's metadata (stock archives: Keras' ``metadata.json``).
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
        damaged_members: ``(member, reason)`` for archive members found damaged by :meth:`check`.
        problems: Always empty (kept for callers of version 0.1: problems now raise).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CheckpointFormatError: if ``path`` is a directory, for a format version
            this version does not read, a legacy Keras HDF5 file, or a zip
            archive holding neither a training state nor Keras weights.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: if the file is truncated, fails its seal, is
            not a ``.keras`` archive or HDF5 file, has links, external or
            virtual storage, non-numeric or big-endian dtypes, data outside the
            file, missing or unexpected objects or attributes, malformed JSON
            records, an archive member that unpacks far beyond its stored
            size, or crashes or hangs HDF5 in the probe process. The message
            names the key, dataset or member concerned where there is one.
    """

    def __init__(self, path, *, data: bytes | None = None):
        self._data = None if data is None else bytes(data)
        if self._data is not None:
            path = "<bytes>"
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"A checkpoint path must be a str or os.PathLike. Received: {type(path).__name__} {path!r}"
            )
        self.path = os.fspath(path)
        self.kind = "stock"
        self.container = ".h5 file"
        self.where = self.path
        self.version = None
        self.sealed = False
        self.seal_version = None
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
        self._fh = None
        self._zip = None
        self._h5 = None
        self._keras_metadata = {}
        self._key_groups = set()
        self._blob = (None, None)
        self._shared_h5 = None
        self._shared = {}
        if self._data is None and not os.path.exists(self.path):
            raise FileNotFoundError(f"No training-state file at {self.path!r}.")
        if self._data is None and os.path.isdir(self.path):
            raise CheckpointFormatError(
                f"{self.path!r} is a directory, not a training-state file. Pass one .keras or .h5 file "
                "(StableCheckpoint keeps ckpt-<step>.h5 files in its directory; the newest is the last "
                "in name order).",
                received=self.path,
            )
        try:
            self._open()
        except BaseException as err:
            self.close()
            if isinstance(err, StateError | FileNotFoundError):
                raise
            if isinstance(err, OSError | KeyError | ValueError | RuntimeError | EOFError | TypeError):
                raise _damaged(
                    self.path, f"it cannot be read as a .keras archive or HDF5 file ({err})"
                ) from err
            if isinstance(err, zipfile.BadZipFile | zlib.error | RecursionError | UnicodeError):
                raise _damaged(
                    self.path, f"it cannot be read as a .keras archive or HDF5 file ({err})"
                ) from err
            raise

    # -- opening --------------------------------------------------------------------------
    def _lock(self):
        if fcntl is None:
            return
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise CheckpointInUseError(
                f"{self.path!r} is in use: another process holds it locked for writing (h5py open in "
                "'w'/'a'/'r+' mode, or an exclusive flock). The file is not known to be damaged; wait for "
                "that process to close it, then retry.",
                path=self.path,
            ) from err

    @classmethod
    def from_bytes(cls, data: bytes) -> CheckpointFile:
        """Open a training state held in memory (e.g. fetched from an object store), with
        the same checks as a file; :attr:`path` is ``"<bytes>"``."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"A training state in memory must be bytes. Received: {type(data).__name__}")
        return cls("<bytes>", data=data)

    @contextlib.contextmanager
    def _on_disk(self):
        """A path holding the file's bytes, for a probe process."""
        if self._data is None:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="kss-probe-") as folder:
            copy = os.path.join(folder, "state")
            with open(copy, "wb") as fh:
                fh.write(self._data)
            yield copy

    def _open(self):
        if self._data is not None:
            self._fh = io.BytesIO(self._data)
        else:
            self._fh = open(self.path, "rb")  # noqa: SIM115 (held open, and locked, until close())
            self._lock()
        head = self._fh.read(USERBLOCK_SIZE)
        self._fh.seek(0)
        if head.startswith(_SEAL_MAGIC):
            size = self._fh.seek(0, 2)
            self._fh.seek(0)
            self._check_seal_stream(head, size)
            self._h5 = h5py.File(self._fh, "r")
            self.sealed = True
        elif head.startswith(_HDF5_SIGNATURE):
            with self._on_disk() as path:
                _probe_or_refuse(self.path, path)
            self._h5 = h5py.File(self._fh, "r")
        elif head[: len(_SEAL_MAGIC)] != _SEAL_MAGIC and self._hdf5_after_user_block():
            raise _damaged(self.path, "its seal (the first 512 bytes) is missing or damaged")
        elif head.startswith(_ZIP_SIGNATURE) or zipfile.is_zipfile(self._fh):
            self._fh.seek(0)
            if not zipfile.is_zipfile(self._fh):
                raise _damaged(
                    self.path, "the zip archive has no central directory at its end: it is truncated"
                )
            self._fh.seek(0)
            self._open_archive()
        else:
            raise _damaged(
                self.path, "it is neither a .keras archive nor an HDF5 file (no zip, HDF5 or seal signature)"
            )
        if self.path.endswith(".weights.h5"):
            self.container = ".weights.h5 file"
        if self.sealed and self._h5.attrs.get("format") != FORMAT:
            raise _damaged(self.where, f"a sealed record whose format attribute is not {FORMAT!r}")
        if self._h5.attrs.get("format") == FORMAT:
            self.kind = FORMAT
            self._list_record()
        elif self.member == MEMBER:
            raise _damaged(self.where, f"the member does not say it is a {FORMAT} record")
        else:
            self._list_stock()

    def _hdf5_after_user_block(self) -> bool:
        self._fh.seek(USERBLOCK_SIZE)
        found = self._fh.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
        self._fh.seek(0)
        return found

    def _check_seal_stream(self, head: bytes, size: int):
        version, digest, length = _parse_seal(head, self.path)
        if size != USERBLOCK_SIZE + length:
            raise _damaged(
                self.path,
                f"it is truncated or damaged: {size} bytes long, but its seal says {USERBLOCK_SIZE + length}",
                expected=USERBLOCK_SIZE + length,
                received=size,
            )
        name, hasher = _SEAL_HASH[version]
        h = hasher()
        self._fh.seek(USERBLOCK_SIZE)
        buf = bytearray(_CHUNK)
        while n := self._fh.readinto(buf):
            h.update(memoryview(buf)[:n])
        self._fh.seek(0)
        if h.digest() != digest:
            with self._on_disk() as path:
                raise _diagnose(self.path, path, None, f"its content fails its {name} seal")
        self.seal_version = version

    def _open_archive(self):
        self.container = ".keras archive"
        self._zip = zipfile.ZipFile(self._fh)
        infos = self._zip.infolist()
        names = [info.filename for info in infos]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise _damaged(self.path, f"archive members {twice} appear twice")
        for info in infos:
            name = info.filename
            if name.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", name) or ":" in name.split("/")[0]:
                raise _damaged(self.path, f"archive member {name!r} has an unsafe path (absolute or '..')")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise _damaged(
                    self.path, f"archive member {name!r} uses compression method {info.compress_type}"
                )
            if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
                raise _damaged(
                    self.path,
                    f"archive member {name!r} is stored uncompressed but declares {info.file_size} bytes "
                    f"for {info.compress_size} stored",
                )
            if info.file_size > MAX_UNPACK_RATIO * info.compress_size + UNPACK_SLACK:
                raise _damaged(
                    self.path,
                    f"archive member {name!r} would unpack to {info.file_size} bytes from "
                    f"{info.compress_size} stored (more than {MAX_UNPACK_RATIO}x): refused as a "
                    "decompression bomb",
                    key=name,
                )
        self.members = [(info.filename, info.file_size) for info in infos]
        present = set(names)
        if MEMBER in present:
            self.member = MEMBER
        elif KERAS_WEIGHTS_MEMBER in present:
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
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
            raise self._diagnose_member(f"the archive member fails its zip CRC-32 ({err})") from err
        if data.startswith(_SEAL_MAGIC):
            version, digest, length = _parse_seal(data[:USERBLOCK_SIZE], self.where)
            name, hasher = _SEAL_HASH[version]
            if (
                len(data) != USERBLOCK_SIZE + length
                or hasher(memoryview(data)[USERBLOCK_SIZE:]).digest() != digest
            ):
                with self._on_disk() as path:
                    raise _diagnose(self.where, path, self.member, f"its content fails its {name} seal")
            self.sealed = True
            self.seal_version = version
        elif data.startswith(_HDF5_SIGNATURE):
            with self._on_disk() as path:
                _probe_or_refuse(self.where, path, self.member)
        else:
            raise _damaged(self.where, "the archive member is not an HDF5 file", key=self.member)
        self._h5 = h5py.File(io.BytesIO(data), "r")
        self._data_size = len(data)
        for name in ("metadata.json", "config.json"):
            if name not in present:
                continue
            try:
                value = json.loads(self._zip.read(name))
                _check_json_depth(value, f"{self.path}:{name}")
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RecursionError) as err:
                raise _damaged(
                    f"{self.path}:{name}", f"the archive member is unreadable ({err})", key=name
                ) from err
            if isinstance(value, dict) and name == "config.json":
                cls = value.get("class_name")
                self.model_class = cls if isinstance(cls, str) else None
            elif isinstance(value, dict):
                self._keras_metadata = value

    def _diagnose_member(self, what: str) -> CorruptCheckpointError:
        """Name the damaged arrays of a member that fails its zip CRC-32: its raw bytes,
        read past the zip check, are probed in a separate process."""
        try:
            raw = checks.raw_member(self._fh, self._zip.getinfo(self.member))
        except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as err:
            return _damaged(self.where, f"{what}, and it cannot be read past it ({err})", key=self.member)
        with tempfile.TemporaryDirectory(prefix="kss-probe-") as folder:
            copy = os.path.join(folder, "member.h5")
            with open(copy, "wb") as fh:
                fh.write(raw)
            return _diagnose(self.where, copy, None, what, default_key=self.member)

    def _data_limit(self) -> int:
        # Dataset offsets count from the start of the file, user block included.
        if self._zip is not None:
            return self._data_size
        return len(self._data) if self._data is not None else os.fstat(self._fh.fileno()).st_size

    def _walk(self, strings=()):
        try:
            return checks.walk(self._h5, self._data_limit(), strings=strings)
        except checks.StructureError as err:
            key = self._key_of(err.where)
            named = f"array for key {key!r}: " if key != err.where else ""
            if self.version is not None and self.version >= 3 and key != err.where:
                raise self._refuse_blob(
                    err.where.lstrip("/"), None, f"is refused: HDF5 object {err}"
                ) from err
            raise _damaged(self.where, f"{named}HDF5 object {err}", key=key) from err

    def _key_of(self, where: str) -> str:
        """The ``key`` attribute of the object at ``where`` when it is plain text (format 3:
        the first key the index puts in that blob), else ``where``."""
        if self.version is not None and self.version >= 3:
            keys = self._blob_keys(where)
            return keys[0] if keys else where
        try:
            key = self._h5[where].attrs.get("key")
        except (KeyError, OSError, ValueError, TypeError, RuntimeError):
            return where
        return key if isinstance(key, str) and key else where

    def _blob_keys(self, where: str, rows=None) -> list:
        """Format 3: the keys the index puts in blob ``where`` (``"model/0"``), to name them
        when the blob is refused; ``[]`` when the index itself cannot be read."""
        match = re.fullmatch(r"/?(model|optimizer|state)/([0-9]+)", where)
        if match is None:
            return []
        section, blob = match.group(1), int(match.group(2))
        if rows is None:
            if self._h5 is None or INDEX not in self._h5:
                return []
            try:
                checks.check_dataset(self._h5[INDEX], self._data_limit())
                rows = self._read_json(INDEX)[section]
            except (StateError, checks.StructureError, KeyError, TypeError, OSError, ValueError):
                return []
        return [
            row[0]
            for row in rows
            if isinstance(row, list) and len(row) > 3 and isinstance(row[0], str) and row[3] == blob
        ]

    def _refuse_blob(self, name: str, rows: list, what: str, **kw):
        keys = self._blob_keys(name, rows)
        named = ""
        if keys:
            listed = ", ".join(repr(k) for k in keys[:4]) + (
                f" and {len(keys) - 4} more" if len(keys) > 4 else ""
            )
            named = f" (it holds the array{'s' if len(keys) > 1 else ''} for key{'s' if len(keys) > 1 else ''} {listed})"
        return _damaged(self.where, f"{name}{named} {what}", key=keys[0] if keys else name, **kw)

    # -- records --------------------------------------------------------------------------
    def _root_attrs(self):
        f = self._h5
        unknown = sorted(set(f.attrs) - {"format", "format_version"})
        if unknown:
            raise _damaged(self.where, f"unexpected root attributes {unknown}")
        version = f.attrs.get("format_version")
        if not isinstance(version, int | np.integer) or isinstance(version, bool):
            raise _damaged(self.where, f"its format_version attribute is {version!r}, not an integer")
        version = int(version)
        if version not in READ_VERSIONS:
            raise CheckpointFormatError(
                f"{self.where}: format version {version} is not one this version reads "
                f"({', '.join(map(str, READ_VERSIONS))}). Upgrade keras_stable_state.",
                expected=FORMAT_VERSION,
                received=version,
            )
        if version >= 2 and not self.sealed:
            raise _damaged(self.where, f"a format-{version} record without its seal")
        if version >= 2 and version != self.seal_version:
            raise _damaged(self.where, f"a format-{version} record under a format-{self.seal_version} seal")
        self.version = version

    def _read_json(self, name: str):
        f = self._h5
        if name not in f or not isinstance(f[name], h5py.Dataset):
            raise _damaged(self.where, f"record {name!r} is missing", key=name)
        ds = f[name]
        try:
            if self.version == 1:
                text = ds[()]
                text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            else:
                if ds.dtype != np.uint8 or ds.ndim != 1:
                    raise _damaged(
                        self.where, f"record {name!r} is {ds.dtype} {ds.shape}, not UTF-8 bytes", key=name
                    )
                attr = "crc32" if self.version == 2 else "xxh3"
                if set(ds.attrs) != {attr}:
                    raise _damaged(self.where, f"record {name!r} has attributes {sorted(ds.attrs)}", key=name)
                raw = checks.read_dataset(ds)
                stored = ds.attrs[attr]
                if self.version == 2:
                    ok = isinstance(stored, int | np.integer) and int(stored) == checks.crc_v2(
                        name, "json", raw.shape, raw.tobytes()
                    )
                else:
                    ok = isinstance(stored, np.unsignedinteger) and int(stored) == checks.digest_v3(
                        name, "json", raw.shape, raw
                    )
                if not ok:
                    what = "CRC-32" if self.version == 2 else "xxh3-64"
                    raise _damaged(self.where, f"record {name!r} fails its {what} checksum", key=name)
                text = raw.tobytes().decode("utf-8")
            value = json.loads(text)
        except (ValueError, RecursionError, UnicodeError, OSError) as err:
            raise _damaged(self.where, f"record {name!r} is not valid JSON ({err})", key=name) from err
        _check_json_depth(value, self.where)
        return value

    def _list_record(self):
        self._root_attrs()
        f = self._h5
        expected = {*RECORDS, *SECTIONS, *((INDEX,) if self.version >= 3 else ())}
        unknown = sorted(set(f) - expected)
        if unknown:
            raise _damaged(self.where, f"unexpected objects {unknown} at the root", key=unknown[0])
        datasets = dict(self._walk(RECORDS if self.version == 1 else ()))
        self.metadata, self.contract, self.extra = (self._read_json(name) for name in RECORDS)
        if self.version >= 3:
            self._list_index(datasets, self._read_json(INDEX))
            self._check_schema()
            return
        for section in SECTIONS:
            seen = set()
            for name, ds in self._numbered(section, datasets, "datasets", optional=section == "state"):
                entry = self._record_entry(section, name, ds)
                self._add_entry(entry, seen)
        self._check_schema()

    def _add_entry(self, entry: Entry, seen: set) -> None:
        """Append ``entry`` after checking its key parses and is new in its section (``seen``)."""
        _check_key(self.where, entry.section, entry.key)
        if entry.key in seen:
            raise _damaged(self.where, f"key {entry.key!r} appears twice in {entry.section!r}", key=entry.key)
        seen.add(entry.key)
        self.entries.append(entry)

    def _numbered(self, section: str, datasets: dict, what: str, optional=False) -> list:
        """``[(path, dataset)]`` of ``section/0``, ``section/1``, ... in order, refusing a
        missing group (unless ``optional``), other names or objects that are not datasets."""
        if section not in self._h5:
            if optional:
                return []
            raise _damaged(self.where, f"group {section!r} is missing", key=section)
        group = self._h5[section]
        if not isinstance(group, h5py.Group):
            raise _damaged(self.where, f"{section!r} is not a group", key=section)
        names = set(group)
        if names != {str(i) for i in range(len(names))}:
            odd = sorted(names - {str(i) for i in range(len(names))})
            raise _damaged(
                self.where,
                f"group {section!r} holds {odd}, not only {what} numbered 0..{len(names) - 1}",
                key=section,
            )
        found = []
        for i in range(len(names)):
            name = f"{section}/{i}"
            if datasets.get(name) is None:
                raise _damaged(self.where, f"{name} is not a dataset", key=name)
            found.append((name, datasets[name]))
        return found

    def _blobs(self, section: str, datasets: dict, rows: list) -> list:
        """Sizes in bytes of the blobs ``section/0``, ``section/1``, ... (format 3)."""
        sizes = []
        for name, ds in self._numbered(section, datasets, "blobs"):
            if ds.dtype != np.uint8 or ds.ndim != 1 or len(ds.attrs):
                raise self._refuse_blob(
                    name,
                    rows,
                    f"is stored as {ds.dtype.str} {ds.shape} with attributes {sorted(ds.attrs)}, not as the "
                    "uint8 blob without attributes the index describes",
                )
            sizes.append(int(ds.shape[0]))
        return sizes

    def _list_index(self, datasets: dict, index):
        """List the arrays of a format-3 record from its index, checking that each
        section's blobs hold exactly the listed arrays, in order, at the offsets the
        writer gives them (packed from 0, each start aligned to :data:`ALIGN`)."""
        if not isinstance(index, dict) or set(index) - {SHARED} != set(SECTIONS):
            raise _damaged(
                self.where,
                f"record 'index' is not an object with exactly the sections {list(SECTIONS)}",
                key=INDEX,
            )
        if SHARED in index:
            self._open_shared(index[SHARED], index["model"])
        for section in SECTIONS:
            rows = index[section]
            if not isinstance(rows, list):
                raise _damaged(self.where, f"record 'index': section {section!r} is not a list", key=INDEX)
            sizes = self._blobs(section, datasets, rows)
            ends = [None] * len(sizes)
            seen = set()
            for row in rows:
                entry = self._index_entry(section, row, sizes, ends)
                self._add_entry(entry, seen)
            for i, (end, size) in enumerate(zip(ends, sizes, strict=True)):
                if end is None:
                    raise _damaged(
                        self.where,
                        f"blob {section}/{i} ({size} bytes) holds no array of the index",
                        key=f"{section}/{i}",
                    )
                if end != size:
                    raise self._refuse_blob(
                        f"{section}/{i}",
                        rows,
                        f"is {size} bytes long, but the arrays the index puts in it end at byte {end}",
                        expected=end,
                        received=size,
                    )

    def _index_entry(self, section: str, row, sizes: list, ends: list) -> Entry:
        ok = (
            isinstance(row, list)
            and len(row) == 6
            and isinstance(row[0], str)
            and row[0]
            and isinstance(row[1], str)
            and isinstance(row[2], list)
            and len(row[2]) <= MAX_NDIM
            and all(_is_int(n) and 0 <= n < 2**62 for n in row[2])
            and (_is_int(row[3]) or isinstance(row[3], str))
            and _is_int(row[4])
            and isinstance(row[5], str)
            and _HEX16.fullmatch(row[5]) is not None
        )
        if not ok:
            key = row[0] if isinstance(row, list) and row and isinstance(row[0], str) and row[0] else INDEX
            raise _damaged(
                self.where,
                f"record 'index': row {str(row)[:160]} of {section!r} is not "
                "[key, dtype, shape, blob, offset, xxh3-64 hex]",
                key=key,
            )
        key, dtype, shape, blob, offset, digest = row
        if dtype not in _DTYPES:
            raise _damaged(
                self.where,
                f"array for key {key!r} says dtype {dtype!r}, not one this library writes",
                key=key,
            )
        if isinstance(blob, str):
            return self._shared_entry(section, row)
        if not 0 <= blob < len(sizes):
            raise _damaged(
                self.where,
                f"array for key {key!r} is in blob {blob}, but {section!r} has blobs 0..{len(sizes) - 1}",
                key=key,
            )
        nbytes = math.prod(shape) * _stored_dtype(dtype).itemsize
        start = _aligned(ends[blob] or 0)
        if offset != start:
            raise _damaged(
                self.where,
                f"array for key {key!r} starts at byte {offset} of blob {section}/{blob}, where the arrays "
                f"before it put the next start at byte {start}",
                key=key,
                expected=start,
                received=offset,
            )
        if offset + nbytes > sizes[blob]:
            raise _damaged(
                self.where,
                f"array for key {key!r} ({dtype} {tuple(shape)}: {nbytes} bytes at byte {offset}) runs past "
                f"the end of blob {section}/{blob} ({sizes[blob]} bytes)",
                key=key,
            )
        ends[blob] = offset + nbytes
        return Entry(
            section=section,
            key=key,
            dataset=f"/{section}/{blob}",
            shape=tuple(shape),
            dtype=dtype,
            nbytes=nbytes,
            offset=offset,
            xxh3=int(digest, 16),
        )

    def _open_shared(self, spec, rows):
        """Keras' weights member a ``.keras`` record shares model arrays with: its length
        and xxh3-128 are checked against ``spec`` (from the sealed index) before HDF5
        parses it, then its structure, as for a record (:mod:`keras_stable_state.format.keras_archive`)."""
        where = f"{self.path}:{_shared.MEMBER}"
        ok = (
            isinstance(spec, dict)
            and set(spec) == {"member", "bytes", "xxh3-128"}
            and spec["member"] == _shared.MEMBER
            and _is_int(spec["bytes"])
            and isinstance(spec["xxh3-128"], str)
            and re.fullmatch(r"[0-9a-f]{32}", spec["xxh3-128"]) is not None
        )
        if not ok:
            raise _damaged(
                self.where, f"record 'index': field {SHARED!r} is malformed: {str(spec)[:160]}", key=INDEX
            )
        if self._zip is None:
            raise _damaged(
                self.where,
                f"record 'index' shares arrays with Keras' {_shared.MEMBER}, but this is not a .keras archive",
                key=INDEX,
            )
        try:
            info = self._zip.getinfo(_shared.MEMBER)
        except KeyError:
            raise _damaged(
                self.path,
                f"the record shares model arrays with {_shared.MEMBER}, which the archive lacks",
                key=_shared.MEMBER,
            ) from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise _damaged(
                where,
                "the member is compressed, but the record reads its arrays in place (Keras and this "
                "library write it stored); it was rewritten by another tool",
                key=_shared.MEMBER,
            )
        start, size = _shared.member_span(self._fh, info)
        if size != spec["bytes"] or _shared.hash_span(self._fh, start, size) != spec["xxh3-128"]:
            what = (
                f"the member ({size} bytes) is not the one the training state was written with "
                f"({spec['bytes']} bytes, xxh3-128 {spec['xxh3-128']}); its model arrays cannot be trusted"
            )
            expect = (
                [
                    [r[0], r[1], r[2], r[3][len(_shared.PREFIX) :], r[5]]
                    for r in rows
                    if isinstance(r, list) and len(r) == 6 and isinstance(r[3], str)
                ]
                if isinstance(rows, list)
                else None
            )
            with self._on_disk() as path:
                raise _diagnose(where, path, _shared.MEMBER, what, default_key=_shared.MEMBER, expect=expect)
        self._shared_h5 = h5py.File(_shared.Window(self._fh, start, size), "r")
        try:
            self._shared = {f"{_shared.PREFIX}/{path}": ds for path, ds in checks.walk(self._shared_h5, size)}
        except checks.StructureError as err:
            raise _damaged(where, f"HDF5 object {err}", key=_shared.MEMBER) from err

    def _shared_entry(self, section: str, row) -> Entry:
        key, dtype, shape, ref, offset, digest = row
        ds = self._shared.get(ref) if section == "model" and offset == 0 else None
        stored = _stored_dtype(dtype)
        if ds is None or ds.dtype != stored or tuple(ds.shape) != tuple(shape):
            found = "no such dataset" if ds is None else f"{ds.dtype.str} {tuple(ds.shape)}"
            raise _damaged(
                self.where,
                f"array for key {key!r} refers to {ref!r} at offset {offset} in section {section!r}, but "
                f"that is {found}, not the model array {stored.str} {tuple(shape)} the index says",
                key=key,
            )
        return Entry(
            section=section,
            key=key,
            dataset=ref,
            shape=tuple(shape),
            dtype=dtype,
            nbytes=math.prod(shape) * stored.itemsize,
            offset=0,
            xxh3=int(digest, 16),
        )

    def _record_entry(self, section: str, name: str, ds) -> Entry:
        attrs = set(ds.attrs)
        if attrs != {"key", "dtype", "crc32"}:
            raise _damaged(
                self.where, f"dataset {name} has attributes {sorted(attrs)}, not key, dtype, crc32", key=name
            )
        key, dtype, crc = ds.attrs["key"], ds.attrs["dtype"], ds.attrs["crc32"]
        if not isinstance(key, str) or not key or not isinstance(dtype, str):
            raise _damaged(
                self.where, f"dataset {name} has a key or dtype attribute that is not text", key=name
            )
        if not isinstance(crc, int | np.integer) or isinstance(crc, bool) or not 0 <= int(crc) <= 0xFFFFFFFF:
            raise _damaged(self.where, f"array for key {key!r} has a malformed crc32 attribute", key=key)
        if dtype not in _DTYPES:
            raise _damaged(
                self.where,
                f"array for key {key!r} says dtype {dtype!r}, not one this library writes",
                key=key,
            )
        stored = _stored_dtype(dtype)
        if ds.dtype != stored:
            raise _damaged(
                self.where,
                f"array for key {key!r} is stored as {ds.dtype.str} but its dtype attribute {dtype!r} "
                f"means {stored.str}",
                key=key,
                expected=stored.str,
                received=ds.dtype.str,
            )
        return Entry(
            section=section,
            key=key,
            dataset=ds.name,
            shape=tuple(int(n) for n in ds.shape),
            dtype=dtype,
            nbytes=int(ds.size) * ds.dtype.itemsize,
            crc32=int(crc),
        )

    def _check_schema(self):
        """Field types of the metadata, the contract and the other-state record."""
        where, m = self.where, self.metadata

        def bad(record, what):
            return _damaged(where, f"record {record!r}: {what}", key=record)

        if not isinstance(m, dict):
            raise bad("metadata", f"is a {type(m).__name__}, not an object")
        for field in ("backend", "keras_version"):
            if not isinstance(m.get(field), str):
                raise bad("metadata", f"field {field!r} is {m.get(field)!r}, not text")
        if m.get("model_state", "all") not in ("all", "trainable", "none"):
            raise bad("metadata", f"model_state is {m.get('model_state')!r}")
        classes = m.get("optimizer_classes")
        if classes is not None and not (
            isinstance(classes, list) and all(isinstance(c, str) for c in classes)
        ):
            raise bad("metadata", f"optimizer_classes is {classes!r}, not a list of names")
        if self.contract is not None:
            if not isinstance(self.contract, list):
                raise bad("contract", "is not a list")
            for item in self.contract:
                if not (
                    isinstance(item, list)
                    and len(item) == 3
                    and isinstance(item[0], str)
                    and isinstance(item[1], list)
                    and all(_is_int(n) and n >= 0 for n in item[1])
                    and isinstance(item[2], str)
                ):
                    raise bad("contract", f"entry {str(item)[:120]} is not [key, shape, dtype]")
        x = self.extra
        if not isinstance(x, dict):
            raise bad("extra", "is not an object")
        for field in ("callbacks", "providers"):
            if not isinstance(x.get(field, {}), dict):
                raise bad("extra", f"{field!r} is not an object")
        if not isinstance(x.get("schedule", {}), dict | None):
            raise bad("extra", "'schedule' is not an object")
        state = {e.key: e for e in self.section("state")}
        refs = _refs(x)
        for ref in refs:
            if not isinstance(ref, str) or ref not in state:
                raise bad("extra", f"refers to array {ref!r}, which the file does not hold")
        orphans = sorted(set(state) - set(refs))
        if orphans:
            raise bad("extra", f"arrays {orphans} of the other state are referred to by nothing")
        if x.get("rng") is not None:
            self._check_rng(x["rng"], state, bad)
        if "mappers" in x:
            self._check_mappers(x["mappers"], bad)

    def _check_mappers(self, mappers, bad):
        """``extra["mappers"]``: ``{key: {mapper: {class_name, config}, dtype, shape, params}}``
        for keys of the model and optimizer sections (see :mod:`keras_stable_state._core.mappers`)."""
        keys = {e.key for e in self.entries if e.section in ("model", "optimizer")}
        if not isinstance(mappers, dict):
            raise bad("extra", "'mappers' is not an object")
        for key, spec in mappers.items():
            mapper = spec.get("mapper") if isinstance(spec, dict) else None
            ok = (
                key in keys
                and set(spec) == {"mapper", "dtype", "shape", "params"}
                and isinstance(mapper, dict)
                and set(mapper) == {"class_name", "config"}
                and isinstance(mapper["class_name"], str)
                and isinstance(mapper["config"], dict)
                and spec["dtype"] in _DTYPES
                and isinstance(spec["shape"], list)
                and all(_is_int(n) and n >= 0 for n in spec["shape"])
                and isinstance(spec["params"], dict)
            )
            if not ok:
                raise bad("extra", f"mapper record for {key!r} is malformed: {str(spec)[:160]}")

    @staticmethod
    def _check_rng(rng, state, bad):
        def array(value, name, dtype, shape=None):
            ref = value.get("__array__") if isinstance(value, dict) else None
            e = state.get(ref)
            if e is None or e.dtype != dtype or (shape is not None and e.shape != shape):
                raise bad(
                    "extra",
                    f"RNG record {name!r} is not a {dtype} array{'' if shape is None else f' of shape {shape}'}",
                )

        if not isinstance(rng, dict):
            raise bad("extra", "the RNG record is not an object")
        n, p = rng.get("numpy"), rng.get("python")
        if not (
            isinstance(n, dict)
            and n.get("name") == "MT19937"
            and _is_int(n.get("pos"))
            and 0 <= n["pos"] <= 624
            and n.get("has_gauss") in (0, 1)
            and isinstance(n.get("cached"), float | int)
        ):
            raise bad("extra", "RNG record 'rng/numpy' is malformed")
        array(n.get("keys"), "rng/numpy/keys", "uint32", (624,))
        internal = p.get("internal") if isinstance(p, dict) else None
        if not (
            isinstance(p, dict)
            and _is_int(p.get("version"))
            and isinstance(internal, list)
            and len(internal) == 625
            and all(_is_int(v) and 0 <= v < 2**32 for v in internal)
            and internal[-1] <= 624
            and (p.get("gauss") is None or isinstance(p.get("gauss"), float))
        ):
            raise bad("extra", "RNG record 'rng/python' is malformed")
        if rng.get("keras_global_seed") is not None:
            ref = (
                rng["keras_global_seed"].get("__array__")
                if isinstance(rng["keras_global_seed"], dict)
                else None
            )
            if ref not in state:
                raise bad("extra", "RNG record 'rng/keras_global_seed' is not an array")
        if rng.get("torch") is not None:
            array(rng["torch"], "rng/torch", "uint8")

    def _list_stock(self):
        f = self._h5
        if "model_weights" in f or "layer_names" in f.attrs or "model_config" in f.attrs:
            raise CheckpointFormatError(
                f"{self.where}: this is a legacy Keras HDF5 file (`model.save('x.h5')` or "
                "`save_weights('x.h5')` of Keras 2 / tf.keras), which keeps weights by layer order and no "
                "optimizer state by key. Load it with `keras.models.load_model` or `model.load_weights`, "
                "then save a training state with save_training_state.",
                received=self.where,
            )
        self.metadata = dict(self._keras_metadata)
        datasets = self._walk()
        if not datasets:
            raise CheckpointFormatError(
                f"{self.where}: this HDF5 file holds no arrays; it is neither a training state nor a Keras "
                "weights file.",
                received=self.where,
            )
        for name, ds in sorted(datasets, key=lambda item: _natural(item[0])):
            if name.startswith("optimizer/") and name.endswith("/keys"):
                # StableOptimizer.save_own_variables: the entry keys of datasets "0", "1", ...
                group = name[: -len("keys")]
                self._key_groups.add(group)
                try:
                    keys = json.loads(checks.read_dataset(ds).astype(np.uint8).tobytes().decode())
                except (ValueError, TypeError, OSError, RecursionError, UnicodeError) as err:
                    raise _damaged(
                        self.where, f"optimizer keys {name!r} are unreadable ({err})", key=name
                    ) from err
                if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
                    raise _damaged(self.where, f"optimizer keys {name!r} are not a list of keys", key=name)
                self.optimizer_keys.update({f"{group}{i}": k for i, k in enumerate(keys)})
                continue
            dtype = "bfloat16" if ds.attrs.get("dtype") == "bfloat16" else ds.dtype.name
            self.entries.append(
                Entry(
                    section="optimizer" if name.startswith("optimizer/") else "model",
                    key=name,
                    dataset=name,
                    shape=tuple(int(n) for n in ds.shape),
                    dtype=dtype,
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
                read (truncation) or fails its CRC-32 checksum (``.expected`` the
                stored, ``.received`` the computed value; format 2 covers the
                key, dtype, shape and bytes).
            ValueError: if the file is closed.
        """
        if self._h5 is None:
            raise ValueError(f"{self.path}: the file is closed; read inside `with storage.open_file(path)`.")
        if entry.xxh3 is not None:
            return self._read_packed(entry)
        try:
            stored = checks.read_dataset(self._h5[entry.dataset])
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            raise _damaged(
                self.where, f"array for key {entry.key!r} cannot be read ({err})", key=entry.key
            ) from err
        if self.kind == FORMAT:
            # zlib reads the (C-order) array's buffer: the bytes of tobytes(), without the copy.
            if self.version == 1:
                computed = checks.crc_v1(stored)
            else:
                computed = checks.crc_v2(entry.key, entry.dtype, stored.shape, stored)
            if computed != entry.crc32:
                raise self._failed_checksum(entry, entry.crc32, computed)
        if entry.dtype in _EXOTIC and stored.dtype.name != entry.dtype:
            target = np.dtype(_EXOTIC[entry.dtype])
            if target.itemsize != stored.dtype.itemsize:
                raise _damaged(self.where, f"array for key {entry.key!r} is not {entry.dtype}", key=entry.key)
            return stored.view(target)
        return stored

    def _failed_checksum(self, entry: Entry, expected, computed) -> CorruptCheckpointError:
        return _damaged(
            self.where,
            f"array for key {entry.key!r} fails its {entry.checksum} checksum (expected {expected}, "
            f"computed {computed})",
            key=entry.key,
            expected=expected,
            received=computed,
        )

    def _read_packed(self, entry: Entry) -> np.ndarray:
        """Format 3: the array's bytes from its blob (a blob up to :data:`_BLOB_CACHE_LIMIT`
        bytes is kept for the next array in it), checked against its xxh3-64."""
        try:
            name, blob = self._blob
            if entry.dataset.startswith(_shared.PREFIX):
                blob = checks.read_dataset(self._shared[entry.dataset]).reshape(-1).view(np.uint8)
            elif name != entry.dataset:
                blob = checks.read_dataset(self._h5[entry.dataset])
                self._blob = (entry.dataset, blob) if blob.nbytes <= _BLOB_CACHE_LIMIT else (None, None)
            raw = blob[entry.offset : entry.offset + entry.nbytes]
            if raw.nbytes != entry.nbytes:
                raise ValueError(f"{raw.nbytes} of its {entry.nbytes} bytes are in the blob")
            computed = checks.digest_v3(entry.key, entry.dtype, entry.shape, raw)
            stored = raw.view(_stored_dtype(entry.dtype)).reshape(entry.shape)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
            raise _damaged(
                self.where, f"array for key {entry.key!r} cannot be read ({err})", key=entry.key
            ) from err
        if computed != entry.xxh3:
            raise self._failed_checksum(entry, f"{entry.xxh3:016x}", f"{computed:016x}")
        if entry.dtype in _EXOTIC:
            return stored.view(np.dtype(_EXOTIC[entry.dtype]))
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

    def check(self, progress=None) -> list:
        """Read every array and every archive member and check them.

        Args:
            progress: Optional callable given the bytes read after each array or chunk.

        Returns:
            ``[(key or member, reason)]`` for everything damaged; empty when intact.
        """
        damaged = []
        for e in self.entries:
            try:
                self.read(e)
            except CorruptCheckpointError as err:
                damaged.append((str(err.key), str(err)))
            if progress is not None:
                progress(e.nbytes)
        self.check_members(progress)
        damaged += [
            (member, f"archive member {member!r} fails its zip CRC-32 ({reason})")
            for member, reason in self.damaged_members
        ]
        return damaged

    def section(self, name: str) -> list:
        """The entries of one section (``"model"``, ``"optimizer"``, ``"state"``), in file order."""
        return [e for e in self.entries if e.section == name]

    @property
    def total_bytes(self) -> int:
        """Bytes of array data in the file."""
        return sum(e.nbytes for e in self.entries)

    def close(self):
        """Close the file and release its lock; :meth:`read` then raises ``ValueError``.
        Closing twice is harmless."""
        for handle in (self._shared_h5, self._h5, self._zip, self._fh):
            if handle is not None:
                with contextlib.suppress(OSError, ValueError, RuntimeError):
                    handle.close()
        self._h5 = self._zip = self._fh = self._shared_h5 = None
        self._blob = (None, None)
        self._shared = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def open_file(filepath) -> CheckpointFile:
    """Open a training-state file or stock Keras weights file for reading, lazily.

    The seal (or, for unsealed files, a probe process), the structure and the
    records are checked; no array is read until :meth:`CheckpointFile.read`.

    Example:
        >>> with storage.open_file("run.keras") as f:
        ...     kernel = f.read(f.section("model")[0])

    Returns:
        A :class:`CheckpointFile`, to use as a context manager.

    Raises:
        The errors of :class:`CheckpointFile`.
    """
    return CheckpointFile(filepath)


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


def read_bytes(data: bytes):
    """:func:`read_file` for a training state held in memory (``.h5`` or ``.keras`` bytes)."""
    return _read_whole(CheckpointFile.from_bytes(data))


def read_file(filepath):
    """Read a training-state file, or a stock Keras weights file, whole, with every check.

    Every array is read and (keras_stable_state files) checked against its
    CRC-32, and every archive member against its zip CRC-32, before anything
    is returned. Built on :func:`open_file`; the command line's ``verify``
    runs exactly these checks.

    Returns:
        :class:`StateRecord` for files written by keras_stable_state,
        :class:`StockWeights` for stock Keras ``.keras`` / ``.weights.h5`` files.

    Raises:
        FileNotFoundError: if the path does not exist.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: for every kind of damage :class:`CheckpointFile`
            lists, an array failing its checksum (naming its key), an archive
            member failing its zip CRC-32 (naming it), or positional optimizer
            variables or their ``StableOptimizer`` keys missing.
        CheckpointFormatError: for a directory, an unknown format version, a
            legacy Keras HDF5 file, or a zip archive holding neither a training
            state nor Keras weights.
    """
    return _read_whole(open_file(filepath))


def _read_whole(f: CheckpointFile):
    with f:
        arrays = {section: {} for section in SECTIONS}
        for e in f.entries:
            arrays[e.section][e.key] = f.read(e)
        f.check_members()
        if f.damaged_members:
            member, reason = f.damaged_members[0]
            raise _damaged(f.path, f"archive member {member!r} fails its zip CRC-32 ({reason})", key=member)
        if f.kind != FORMAT:
            return _stock_weights(f, arrays)
        return StateRecord(
            metadata=f.metadata,
            contract=f.contract,
            model=arrays["model"],
            optimizer=arrays["optimizer"],
            extra=f.extra,
            arrays=arrays["state"],
        )
