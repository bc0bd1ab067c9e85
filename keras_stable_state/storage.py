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
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tempfile
import zipfile
import zlib

import h5py
import ml_dtypes
import numpy as np

from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MEMBER",
    "StateRecord",
    "StockWeights",
    "write_record",
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
    return zlib.crc32(np.array(array, order="C", copy=False).tobytes()) & 0xFFFFFFFF


def _write_group(group, arrays: dict):
    for i, (key, value) in enumerate(arrays.items()):
        stored, name = _encode(np.asarray(value))
        ds = group.create_dataset(str(i), data=stored)
        ds.attrs["key"] = key
        ds.attrs["dtype"] = name
        ds.attrs["crc32"] = _crc(stored)


def _read_group(group, where: str) -> dict:
    out = {}
    for i in range(len(group)):
        name = str(i)
        if name not in group:
            raise CorruptCheckpointError(
                f"{where}: dataset {name!r} is missing ({len(group)} expected). The file is damaged.",
                key=name,
            )
        ds = group[name]
        key = ds.attrs.get("key")
        try:
            stored = ds[()]
        except (OSError, ValueError) as err:
            raise CorruptCheckpointError(
                f"{where}: array for key {key!r} cannot be read ({err}). The file is truncated or "
                "damaged; restore from an earlier checkpoint.",
                key=key,
            ) from err
        stored = np.asarray(stored)
        if _crc(stored) != int(ds.attrs.get("crc32", -1)):
            raise CorruptCheckpointError(
                f"{where}: array for key {key!r} fails its CRC-32 checksum (expected "
                f"{int(ds.attrs.get('crc32', -1))}, computed {_crc(stored)}). The file is damaged; "
                "restore from an earlier checkpoint.",
                key=key,
                expected=int(ds.attrs.get("crc32", -1)),
                received=_crc(stored),
            )
        dt = str(ds.attrs.get("dtype", stored.dtype.name))
        if str(key) in out:
            raise CorruptCheckpointError(
                f"{where}: key {key!r} appears twice. The file was not written by keras_stable_state "
                "or is damaged.",
                key=key,
            )
        out[str(key)] = stored.view(_EXOTIC[dt]) if dt in _EXOTIC else stored
    return out


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


def _parse_record(f: h5py.File, where: str) -> StateRecord:
    version = int(f.attrs.get("format_version", -1))
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where}: format version {version} is not one this version reads ({FORMAT_VERSION}). "
            "Upgrade keras_stable_state.",
            expected=FORMAT_VERSION,
            received=version,
        )
    try:
        metadata, contract, extra = (json.loads(f[name][()]) for name in ("metadata", "contract", "extra"))
    except (KeyError, ValueError, OSError) as err:
        raise CorruptCheckpointError(f"{where}: metadata is unreadable ({err}).") from err
    return StateRecord(
        metadata=metadata,
        contract=contract,
        model=_read_group(f["model"], where),
        optimizer=_read_group(f["optimizer"], where),
        extra=extra,
        arrays=_read_group(f["state"], where) if "state" in f else {},
    )


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


def _read_stock(f: h5py.File, source: str) -> StockWeights:
    arrays, optimizer = {}, []

    def value(ds):
        data = np.asarray(ds[()])
        if ds.attrs.get("dtype") == "bfloat16":
            data = (
                data.view(ml_dtypes.bfloat16) if data.dtype.itemsize == 2 else data.astype(ml_dtypes.bfloat16)
            )
        return data

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            arrays[name] = value(obj)

    f.visititems(visit)
    opt = {k[len("optimizer/vars/") :]: v for k, v in arrays.items() if k.startswith("optimizer/vars/")}
    keys = opt.pop("keys", None)
    missing = [str(i) for i in range(len(opt)) if str(i) not in opt]
    if missing:
        raise CorruptCheckpointError(
            f"{source}: optimizer variables {missing} are missing from 'optimizer/vars' ({len(opt)} datasets). "
            "The file is damaged.",
            key=f"optimizer/vars/{missing[0]}",
        )
    optimizer = [opt[str(i)] for i in range(len(opt))]
    if keys is not None:
        # written by a StableOptimizer inside Keras' own weights file: keyed, not positional
        names = json.loads(np.asarray(keys, dtype=np.uint8).tobytes().decode())
        optimizer = dict(zip(names, optimizer, strict=True))
        source += " (optimizer saved by key by StableOptimizer)"
    model = {k: v for k, v in arrays.items() if not k.startswith("optimizer/")}
    return StockWeights(arrays=model, optimizer=optimizer, source=source)


def read_file(filepath):
    """Read a training-state file, or a stock Keras weights file.

    Returns:
        :class:`StateRecord` for files written by keras_stable_state,
        :class:`StockWeights` for stock Keras ``.keras`` / ``.weights.h5`` files.

    Raises:
        FileNotFoundError: if the path does not exist.
        CorruptCheckpointError: if the file is truncated, not an archive/HDF5
            file, or an array fails its checksum.
        CheckpointFormatError: for an unknown format version.
    """
    path = os.fspath(filepath)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No training-state file at {path!r}.")
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
                if MEMBER in names:
                    with h5py.File(io.BytesIO(zf.read(MEMBER)), "r") as f:
                        return _parse_record(f, f"{path}:{MEMBER}")
                if KERAS_WEIGHTS_MEMBER in names:
                    with h5py.File(io.BytesIO(zf.read(KERAS_WEIGHTS_MEMBER)), "r") as f:
                        return _read_stock(f, "stock Keras .keras archive")
                raise CheckpointFormatError(
                    f"{path!r} is a zip archive without model weights or a training state."
                )
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") == FORMAT:
                return _parse_record(f, path)
            return _read_stock(f, "stock Keras .weights.h5 file")
    except (OSError, zipfile.BadZipFile, KeyError) as err:
        if isinstance(err, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(
            f"{path!r} cannot be read as a .keras archive or HDF5 file ({err}). It is truncated or "
            "damaged; restore from an earlier checkpoint.",
        ) from err
