"""The on-disk format of a training state: the public door of ``keras_stable_state.format``.

A training state (format 3) is an HDF5 file sealed by the xxh3-128 of its bytes
in a 512-byte user block, with JSON records (metadata, contract, other state,
index) each carrying an xxh3-64, and every array's bytes in numbered blobs,
its xxh3-64 over key, dtype, shape and bytes in the index. Formats 1 and 2
(CRC-32 per array; format 2 sealed with SHA-256) are still read. The format is
described once, in ``docs/concepts/file-format.md``; what a reader refuses, in
``docs/concepts/security.md``.

* `open_file` is the one reader: it opens a training state (``.h5``, or
  the member ``keras_stable_state.h5`` of a ``.keras`` archive) or a stock Keras
  ``.keras`` / ``.weights.h5`` file, with every check, and reads one array at a
  time; `read_file` and `read_bytes` read a whole file through it.
* `fs_path` takes every path a user gives (``str``, ``bytes``, ``os.PathLike``);
  `open_regular` opens every file the library opens by path, regular files only
  (`files`).
* `remote` reads and writes object stores (``s3://``,
  ``gs://``...) through fsspec; no other door takes a URL for a local path.
* `write_record` writes a `StateRecord` atomically;
  `record_to_bytes` returns the bytes of a sealed ``.h5`` instead.

Modules: `record` (names, limits, records),
`codec` (dtypes, array encoding),
`seal`, `writer`,
`atomic`, `files`,
`reader`
(with `source`,
`records`, `index`,
`schema`, `stock`),
`probe` and `sandbox`
(the separate probe process), `keras_archive`
(arrays shared with Keras' ``model.weights.h5``).

This package imports no Keras and no backend: h5py, NumPy, ml_dtypes and xxhash only.
"""

from keras_stable_state.format import remote
from keras_stable_state.format.atomic import atomic_path
from keras_stable_state.format.codec import DTYPES, dtype_name, encode_array, numpy_dtype, stored_dtype
from keras_stable_state.format.files import fs_path, open_regular
from keras_stable_state.format.proven import FileArray, close_files, read_proven
from keras_stable_state.format.reader import CheckpointFile, open_file, read_bytes, read_file
from keras_stable_state.format.record import (
    ALIGN,
    BLOB_TARGET,
    FORMAT,
    FORMAT_VERSION,
    KERAS_WEIGHTS_MEMBER,
    MEMBER,
    PACK_LIMIT,
    SECTIONS,
    USERBLOCK_SIZE,
    Entry,
    StateRecord,
)
from keras_stable_state.format.seal import seal
from keras_stable_state.format.stock import StockWeights
from keras_stable_state.format.writer import check_target, record_to_bytes, reseal, write_record

__all__ = [
    "ALIGN",
    "BLOB_TARGET",
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "KERAS_WEIGHTS_MEMBER",
    "MEMBER",
    "PACK_LIMIT",
    "SECTIONS",
    "USERBLOCK_SIZE",
    "CheckpointFile",
    "Entry",
    "FileArray",
    "StateRecord",
    "StockWeights",
    "atomic_path",
    "check_target",
    "close_files",
    "dtype_name",
    "encode_array",
    "fs_path",
    "numpy_dtype",
    "open_file",
    "open_regular",
    "remote",
    "read_bytes",
    "read_file",
    "read_proven",
    "record_to_bytes",
    "reseal",
    "seal",
    "stored_dtype",
    "write_record",
]
