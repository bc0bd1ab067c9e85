"""The on-disk format of a training state: the public door of ``keras_stable_state.format``.

A training state (format 3) is an HDF5 file sealed by the xxh3-128 of its bytes
in a 512-byte user block, with JSON records (metadata, contract, other state,
index) each carrying an xxh3-64, and every array's bytes in numbered blobs,
its xxh3-64 over key, dtype, shape and bytes in the index. Formats 1 and 2
(CRC-32 per array; format 2 sealed with SHA-256) are still read. The format is
described once, in ``docs/concepts/file-format.md``; what a reader refuses, in
``docs/concepts/security.md``.

What a tool that reads training states needs is here (`__all__`):

* `open_file` is the one door for every layout (`layout`): it opens a training
  state (``.h5``, or the member ``keras_stable_state.h5`` of a ``.keras`` archive), a
  stock Keras ``.keras`` / ``.weights.h5`` file (a `CheckpointFile`) or a ``.orbax``
  folder (an `orbax_file.OrbaxFile`), with every check, as a
  `layout.Layout` that reads one array at a time; `read_file` and `read_bytes` read a
  whole state through it, into a `StateRecord` (or `StockWeights` for a stock Keras
  file). Each says how its arrays are matched to the live variables (``matched_by``):
  by key, or by the model's structure (a stock Keras file).
* `Entry` is one array of a file, listed by `CheckpointFile`; `SECTIONS` names
  the sections of a record.
* `FORMAT` and `FORMAT_VERSION` are the format's name and the version written.
* `DTYPES` are the dtype names a file may hold; `dtype_name` and `numpy_dtype`
  go between those names and NumPy dtypes.

The library's own writers and readers import the rest from the modules that
define it: `writer` (`write_record` writes a `StateRecord` atomically,
`record_to_bytes` returns the bytes of a sealed ``.h5``), `proven` (arrays left in a
file proven whole), `files` (`fs_path` takes every path a user gives, ``str``,
``bytes``, ``os.PathLike``; `open_regular` opens every file the library opens by
path, regular files only), `remote` (object stores, ``s3://``, ``gs://``...,
through fsspec; no other door takes a URL for a local path), `atomic`, and `layout`
(`Layout`; the registry of layouts, `LAYOUTS`) and `record` (``BY_KEY``,
``BY_STRUCTURE``: how a layout's arrays are matched).

Modules: `layout` (the `Layout` protocol and the registry of layouts),
`record` (names, limits, records),
`codec` (dtypes, array encoding),
`seal`, `writer`,
`atomic`, `files`,
`reader`
(with `source`,
`records`, `index`,
`schema`, `stock`), `orbax_file` and `orbax_layout` (``.orbax`` folders),
`probe` and `sandbox`
(the separate probe process), `keras_archive`
(arrays shared with Keras' ``model.weights.h5``).

This package imports no Keras, no backend and no Orbax: h5py, NumPy, ml_dtypes and xxhash
only (and TensorStore to read the arrays of a ``.orbax`` folder).
"""

from keras_stable_state.format.codec import DTYPES, dtype_name, numpy_dtype
from keras_stable_state.format.layout import open_file, read_file
from keras_stable_state.format.reader import CheckpointFile, read_bytes
from keras_stable_state.format.record import FORMAT, FORMAT_VERSION, SECTIONS, Entry, StateRecord
from keras_stable_state.format.stock import StockWeights

__all__ = [
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "SECTIONS",
    "CheckpointFile",
    "Entry",
    "StateRecord",
    "StockWeights",
    "dtype_name",
    "numpy_dtype",
    "open_file",
    "read_bytes",
    "read_file",
]
