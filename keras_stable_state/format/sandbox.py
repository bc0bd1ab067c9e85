"""Structure checks of an HDF5 file that need h5py and NumPy only.

Used in two ways:

* imported by the reader (`keras_stable_state.format.records`,
  `keras_stable_state.format.index`), which runs these checks on every
  file before reading an array: no soft or external links, no external
  storage, no virtual, chunked or filtered datasets, plain little-endian
  numeric dtypes only, and each dataset's data inside the file (so a small
  file cannot make the reader allocate more than its own size); the writer
  and the reader also take the per-array digests from here (format 3:
  `digest_v3`, xxh3-64; formats 1-2, still read: `crc_v1`,
  `crc_v2`, CRC-32);
* run as a script (``python -I sandbox.py FILE [MEMBER] [EXPECT.json]``, by
  `keras_stable_state.format.probe`) in a separate process, to read a
  file that has no seal (stock Keras files, format-1 records) or whose seal
  fails: whatever HDF5 does with a damaged file (a segmentation fault, an
  endless loop) happens in that process, never in the training process. The
  script prints one JSON document: the structure problem, and the keys whose
  own checksum fails.

It imports nothing from keras_stable_state, so the script starts in a fraction
of a second. See ``docs/concepts/security.md``.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zipfile
import zlib
from typing import TYPE_CHECKING

import h5py
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterable
import xxhash

MAX_DEPTH = 64
FORMAT_1_RECORDS = ("metadata", "contract", "extra")
MAX_OBJECTS = 1_000_000
# Stored dtypes a file may hold: little-endian (or single-byte) bool, int, uint, float.
_KINDS = "biuf"


class StructureError(Exception):
    """A file's HDF5 structure is not one this library reads.

    Attributes:
        where: The HDF5 path of the object concerned.
        reason: What is wrong with it.
    """

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where!r} {reason}")
        self.where = where
        self.reason = reason


def crc_v2(key: str, dtype: str, shape: Iterable[int], data: bytes | np.ndarray) -> int:
    """CRC-32 (``zlib.crc32``) of a format-2 array: its key, dtype name and shape, then its bytes."""
    head = f"{key}\0{dtype}\0{','.join(str(int(n)) for n in shape)}\0".encode()
    return zlib.crc32(data, zlib.crc32(head)) & 0xFFFFFFFF


def digest_head(key: str, dtype: str, shape) -> bytes:
    """What a format-3 digest (`digest_v3`) hashes before the bytes: key, dtype name and shape."""
    return f"{key}\0{dtype}\0{','.join(str(int(n)) for n in shape)}\0".encode()


def digest_v3(key: str, dtype: str, shape, data) -> int:
    """xxh3-64 (``xxhash.xxh3_64``, https://github.com/Cyan4973/xxHash) of a format-3 array
    or record: its key, dtype name and shape (`digest_head`), then its bytes (any
    C-contiguous buffer)."""
    h = xxhash.xxh3_64(digest_head(key, dtype, shape))
    h.update(data)
    return h.intdigest()


def crc_v1(data: bytes | np.ndarray) -> int:
    """CRC-32 of a format-1 array: its bytes only."""
    return zlib.crc32(data) & 0xFFFFFFFF


def check_dtype(dtype, where: str) -> None:
    """Refuse anything but a plain little-endian bool/int/uint/float dtype."""
    dtype = np.dtype(dtype)
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in _KINDS:
        raise StructureError(where, f"has dtype {dtype} (only plain numeric arrays are read)")
    if dtype.byteorder not in ("<", "|", "=") or (dtype.byteorder == "=" and sys.byteorder != "little"):
        raise StructureError(where, f"has big-endian dtype {dtype.str} (files are written little-endian)")


def check_dataset(ds, data_limit: int, where: str | None = None) -> int | None:
    """Refuse a dataset whose data is not plain, contiguous and inside the file.

    Args:
        ds: An ``h5py.Dataset``.
        data_limit: The file's length in bytes (dataset offsets count from its start).
        where: Its path, as messages name it (default: ``ds.name``, which HDF5 works out
            from the file's links, 10-30 us a dataset here: `walk` passes the path it
            followed).

    Returns:
        The byte offset of a contiguous dataset's data in the file (inside it), or
        ``None`` for an empty or compact one (its data, if any, is in its header).

    Raises:
        StructureError: for virtual datasets, external storage, chunked or
            filtered layouts, non-numeric or big-endian dtypes, or data that
            does not lie inside the file.
    """
    where = ds.name if where is None else where
    dsid = ds.id  # h5py's low-level calls: a third of the high-level properties' cost
    plist = dsid.get_create_plist()
    layout = plist.get_layout()
    if layout == _VIRTUAL:
        raise StructureError(where, "is a virtual dataset (it would read other files)")
    if plist.get_external_count():
        raise StructureError(where, "keeps its data in an external file (it would read another file)")
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.COMPACT):
        raise StructureError(where, "is chunked (files are written contiguous)")
    if plist.get_nfilters():
        raise StructureError(where, "is compressed or filtered (files are written uncompressed)")
    dtype = dsid.dtype
    check_dtype(dtype, where)
    shape = dsid.shape
    count = 0 if shape is None else 1
    for n in shape or ():
        count *= int(n)
    nbytes = count * dtype.itemsize
    if nbytes > data_limit:
        raise StructureError(where, f"declares {nbytes} bytes of data in a file of {data_limit} bytes")
    if layout == h5py.h5d.CONTIGUOUS and nbytes:
        stored = dsid.get_storage_size()
        offset = dsid.get_offset()
        if stored != nbytes or offset is None or offset + stored > data_limit:
            raise StructureError(
                where, f"declares {nbytes} bytes but {stored} are stored at offset {offset} of {data_limit}"
            )
        return offset
    return None


_VIRTUAL = getattr(h5py.h5d, "VIRTUAL", -1)
# What a link other than a hard link is called in messages, by its h5py.h5l type.
_LINK_NAMES = {h5py.h5l.TYPE_SOFT: "SoftLink", h5py.h5l.TYPE_EXTERNAL: "ExternalLink"}


def walk(group, data_limit: int, prefix: str = "", depth: int = 0, seen=None, strings=(), spans=None) -> list:
    """Every dataset under ``group`` as ``(path, dataset)``, refusing links and odd objects.

    Only hard links are followed; soft links, external links, user-defined
    links, named datatypes and cycles are refused, as is nesting deeper than
    `MAX_DEPTH` or more than `MAX_OBJECTS` objects. Datasets named
    in ``strings`` (paths) may instead be scalar strings: format 1 kept its
    JSON records so. Objects are opened through h5py's low-level API (``h5l``,
    ``h5o``): about a third of what its high-level ``group[name]`` costs. With ``spans``
    (a dict), the data offset of every contiguous, non-empty dataset is put in it by path
    (`check_dataset`).

    Raises:
        StructureError: naming the object.
    """
    seen = set() if seen is None else seen
    if depth > MAX_DEPTH:
        raise StructureError(prefix or "/", f"is nested deeper than {MAX_DEPTH} groups")
    found = []
    gid = group.id
    for name in group:
        path = f"{prefix}{name}"
        encoded = name.encode("utf-8")
        kind = gid.links.get_info(encoded).type
        if kind != h5py.h5l.TYPE_HARD:
            what = _LINK_NAMES.get(kind, "user-defined link")
            raise StructureError(path, f"is a {what} (links are not followed)")
        oid = h5py.h5o.open(gid, encoded)
        addr = h5py.h5o.get_info(oid).addr
        if addr in seen:
            raise StructureError(path, "is linked twice (hard-link cycle or alias)")
        seen.add(addr)
        if len(seen) > MAX_OBJECTS:
            raise StructureError(path, f"is past {MAX_OBJECTS} objects")
        if isinstance(oid, h5py.h5d.DatasetID):
            obj = h5py.Dataset(oid, readonly=True)
            if path in strings:
                if obj.shape != () or h5py.check_string_dtype(obj.dtype) is None:
                    raise StructureError(path, f"is {obj.dtype} {obj.shape}, not a string record")
            else:
                offset = check_dataset(obj, data_limit, path)
                if spans is not None and offset is not None:
                    spans[path] = offset
                found.append((path, obj))
        elif isinstance(oid, h5py.h5g.GroupID):
            found += walk(h5py.Group(oid), data_limit, f"{path}/", depth + 1, seen, strings, spans)
        else:
            what = "Datatype" if isinstance(oid, h5py.h5t.TypeID) else type(oid).__name__
            raise StructureError(path, f"is a {what} (only groups and datasets are read)")
    return found


# Arrays are read into memory starting at a multiple of this many bytes: TensorFlow's CPU
# kernels need 64-byte alignment of a host buffer a tensor uses as its own (the restore
# hands a read array to a variable without a copy where the backend allows it).
READ_ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """A new, writable, C-order array of ``shape`` and ``dtype`` whose data starts at a
    multiple of `READ_ALIGN` bytes (a view of a slightly larger ``uint8`` buffer)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if dtype.hasobject or dtype.itemsize == 0:  # not a plain numeric dtype: NumPy's own
        return np.empty(shape, dtype)
    count = 1
    for n in shape:
        count *= n
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + READ_ALIGN, np.uint8)
    start = -raw.ctypes.data % READ_ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def read_dataset(ds) -> np.ndarray:
    """The dataset's data as stored (no dtype conversion), C order, in a new array whose
    data starts at a multiple of `READ_ALIGN` bytes (`aligned_empty`)."""
    dsid = ds.id
    out = aligned_empty(dsid.shape, dsid.dtype)
    if out.size:  # the whole dataset, through h5py's low-level read (no selection objects)
        dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
    return out


def _attr(ds, name):
    value = ds.attrs.get(name)
    return value.decode() if isinstance(value, bytes) else value


def probe(data: bytes | None, path: str | None) -> dict:
    """Open an HDF5 image (``data``) or file (``path``), check its structure, read
    every dataset and check each keyed array's checksum (formats 1-2: CRC-32 attributes;
    format 3: the xxh3-64 of each record and, from an intact index, of each array).

    Returns:
        ``{"structure": None | "reason", "damaged": [[key, reason], ...], "datasets": n}``.
    """
    source = io.BytesIO(data) if data is not None else path
    with h5py.File(source, "r", locking=False) as f:
        limit = len(data) if data is not None else _file_size(path)
        version = f.attrs.get("format_version")
        strings = FORMAT_1_RECORDS if f.attrs.get("format") == "keras_stable_state" and version == 1 else ()
        try:
            datasets = walk(f, limit, strings=strings)
        except StructureError as err:
            return {"structure": str(err), "damaged": [], "datasets": 0}
        damaged = []
        for name, ds in datasets:
            array = read_dataset(ds)
            for attr in list(ds.attrs):
                ds.attrs[attr]  # noqa: B018 (reading every attribute is the probe)
            crc = _attr(ds, "crc32")
            if crc is None:
                continue
            # arrays carry key and dtype attributes; JSON records are named by their dataset
            key, dtype = str(_attr(ds, "key") or name), str(_attr(ds, "dtype") or "json")
            if version == 1:
                computed = crc_v1(array.tobytes())
            else:
                computed = crc_v2(key, dtype, array.shape, array.tobytes())
            if int(crc) != computed:
                damaged.append([key, "fails its CRC-32 checksum"])
        if f.attrs.get("format") == "keras_stable_state" and version == 3:
            damaged += _damaged_v3(dict(datasets))
    return {"structure": None, "damaged": damaged, "datasets": len(datasets)}


def _damaged_v3(datasets: dict) -> list:
    """``[[name, reason]]`` for the JSON records and indexed arrays of a format-3 record
    whose xxh3-64 fails; arrays are checked only when the index itself is intact."""
    damaged, index = [], None
    for name in ("metadata", "contract", "extra", "index"):
        ds = datasets.get(name)
        stored = _attr(ds, "xxh3") if ds is not None else None
        if stored is None:
            continue
        raw = read_dataset(ds)
        if not isinstance(stored, np.unsignedinteger) or int(stored) != digest_v3(
            name, "json", raw.shape, raw
        ):
            damaged.append([name, "fails its xxh3-64 checksum"])
        elif name == "index":
            try:
                index = json.loads(raw.tobytes())
            except (ValueError, RecursionError):
                index = None
    if not isinstance(index, dict):
        return damaged
    blobs = {}
    for section, rows in index.items():
        for row in rows if isinstance(rows, list) else ():
            try:
                key, dtype, shape, blob, offset, digest = row
                name = f"{section}/{blob}"
                if name not in blobs:
                    blobs[name] = read_dataset(datasets[name])
                nbytes = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
                raw = blobs[name][offset : offset + nbytes]
                if digest != f"{digest_v3(key, dtype, shape, raw):016x}":
                    damaged.append([key, "fails its xxh3-64 checksum"])
            except (ValueError, TypeError, KeyError, IndexError, OverflowError):
                continue
    return damaged


def _itemsize(dtype: str) -> int:
    bits = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
    return bits[dtype] if dtype in bits else np.dtype(dtype).itemsize


def _file_size(path: str) -> int:
    with open(path, "rb") as fh:
        return fh.seek(0, 2)


def member_start(fh, info: zipfile.ZipInfo) -> int:
    """Where a zip member's (stored or compressed) bytes start in the archive file ``fh``.

    Raises:
        zipfile.BadZipFile: if its local header is not where the central directory says.
    """
    fh.seek(info.header_offset)
    header = fh.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for member {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def raw_member(fh, info: zipfile.ZipInfo) -> bytes:
    """A zip member's bytes without the zip CRC check (to find which array is damaged)."""
    fh.seek(member_start(fh, info))
    data = fh.read(info.compress_size)
    if info.compress_type == zipfile.ZIP_DEFLATED:
        return zlib.decompressobj(-15).decompress(data, info.file_size)
    return data


def check_expected(data: bytes | None, path: str | None, rows: list) -> list:
    """``[[key, reason]]`` for each ``[key, dtype, shape, dataset path, xxh3-64 hex]`` row
    whose dataset's bytes fail the xxh3-64 the training state recorded (the arrays a
    ``.keras`` record shares with Keras' ``model.weights.h5``)."""
    damaged = []
    source = io.BytesIO(data) if data is not None else path
    with h5py.File(source, "r", locking=False) as f:
        for key, dtype, shape, name, digest in rows:
            try:
                raw = read_dataset(f[name]).reshape(-1).view(np.uint8)
            except (KeyError, OSError, ValueError, TypeError) as err:
                damaged.append([key, f"cannot be read ({err})"])
                continue
            if f"{digest_v3(key, dtype, shape, raw):016x}" != digest:
                damaged.append([key, "fails its xxh3-64 checksum"])
    return damaged


def main(argv) -> int:
    path = argv[0]
    member = argv[1] if len(argv) > 1 and argv[1] else None
    data = None
    if member is not None:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
            data = raw_member(fh, zf.getinfo(member))
    result = probe(data, None if data is not None else path)
    if len(argv) > 2 and argv[2] and result.get("structure") is None:
        with open(argv[2]) as fh:
            result["damaged"] += check_expected(data, None if data is not None else path, json.load(fh))
    sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
