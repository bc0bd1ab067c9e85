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
  by key, or by the model's structure (a stock Keras file). An object-store URL
  (``s3://``, ``gs://``...) is fetched whole by the object-store engine
  (``keras_stable_state._engines.object_store``, through fsspec) and read from memory
  with the same checks: this package's ``__init__`` is the public door above the
  engines, while its modules keep the bytes (they import no fsspec).
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
path, regular files only), `urls` (a URL told from a local path: no door of the modules
takes a URL for a local path), `atomic`, and `layout`
(`Layout`; the registry of layouts, `LAYOUTS`) and `record` (``BY_KEY``,
``BY_STRUCTURE``: how a layout's arrays are matched).

Modules: `layout` (the `Layout` protocol and the registry of layouts),
`record` (names, limits, records),
`codec` (dtypes, array encoding),
`seal`, `writer`,
`atomic`, `files`, `urls`,
`reader`
(with `source`,
`records`, `index`,
`schema`, `stock`), `orbax_file` and `orbax_layout` (``.orbax`` folders),
`probe` and `sandbox`
(the separate probe process), `keras_archive`
(arrays shared with Keras' ``model.weights.h5``).

This package imports no Keras, no backend and no Orbax: h5py, NumPy, ml_dtypes and xxhash
only (and TensorStore to read the arrays of a ``.orbax`` folder); its modules import no
fsspec: the object-store engine does, for a URL given to `open_file` or `read_file`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

from keras_stable_state._engines import object_store
from keras_stable_state.format import layout
from keras_stable_state.format.codec import DTYPES, dtype_name, numpy_dtype
from keras_stable_state.format.orbax_file import SourceFactory
from keras_stable_state.format.reader import CheckpointFile, read_bytes
from keras_stable_state.format.record import FORMAT, FORMAT_VERSION, SECTIONS, Entry, StateRecord
from keras_stable_state.format.stock import StockWeights
from keras_stable_state.format.urls import is_remote

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


def _url(filepath: object) -> str | None:
    """``filepath`` if it is an object-store URL (not ``file://``), else ``None``."""
    if isinstance(filepath, bytes | str | os.PathLike):
        path = os.fsdecode(os.fspath(filepath))
        return path if is_remote(path) else None
    return None


def open_file(filepath: object, *, storage_options: Mapping[str, Any] | None = None) -> layout.Layout:
    """Open a training state for reading, lazily, in its layout: a training-state file, a
    stock Keras weights file or a ``.orbax`` folder.

    The seal (or, for unsealed files, a probe process), the structure and the
    records are checked; no array is read until ``read``.
    An object-store URL (``s3://bucket/run.h5``) is downloaded whole into memory first,
    through fsspec (the object-store engine), then opened with the same checks (messages
    name the URL); a ``file://`` URL is the local file it names.

    Args:
        filepath: A path (``str``, ``bytes``, ``os.PathLike``) or a URL.
        storage_options: For a URL: ``dict`` passed to the fsspec filesystem, or ``None``.

    Examples:
        >>> with format.open_file("run.keras") as f:
        ...     kernel = f.read(f.section("model")[0])

    Returns:
        A `layout.Layout`, to use as a context manager: a `CheckpointFile`
        (``.keras``, ``.h5``, ``.weights.h5``) or an `orbax_file.OrbaxFile`
        (``.orbax``, whose ``read`` reads with TensorStore).

    Raises:
        StorageBackendError: for a URL whose fsspec implementation is not installed.
        FileNotFoundError: naming the path or URL if there is nothing there.
        The errors of `CheckpointFile` and of `orbax_file.OrbaxFile`, and the store's
        (``StorageError``...).
    """
    url = _url(filepath)
    if url is None:
        return layout.open_file(filepath)
    return cast("layout.Layout", CheckpointFile.from_bytes(object_store.fetch(url, storage_options), url))


def read_file(
    filepath: object,
    *,
    storage_options: Mapping[str, Any] | None = None,
    unaligned_views: bool = True,
    arrays: SourceFactory | None = None,
) -> StateRecord | StockWeights:
    """Read a training state whole, in its layout, with every check.

    A ``.keras`` or HDF5 file is read by `reader.read_checkpoint_file`: every array read
    and checked, and every archive member, before anything is returned (the command line's
    ``verify`` runs exactly these checks); ``unaligned_views=False`` is for a caller that
    needs 64-byte aligned memory (see `CheckpointFile`). A ``.orbax`` folder is read by
    `orbax_file.read_orbax`: its ``state.h5`` so, its arrays in ``arrays/`` read on demand
    through ``arrays`` (an array source the caller gives: the Orbax engine's for a restore
    onto each variable's sharding; ``None``: TensorStore, without Orbax), each checked
    against its hash. A URL is read as `open_file` reads it (``storage_options`` for its
    filesystem), then with `read_bytes`.

    Returns:
        `StateRecord` for a state written by keras_stable_state (matched by key),
        `StockWeights` for a stock Keras ``.keras`` / ``.weights.h5`` file (matched by structure).

    Raises:
        FileNotFoundError: if the path does not exist.
        PermissionError: if the file cannot be opened for reading.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: for every kind of damage `CheckpointFile`
            lists, an array failing its checksum (naming its key), an archive
            member failing its zip CRC-32 (naming it), or positional optimizer
            variables or their ``StableOptimizer`` keys missing; a ``.orbax`` folder's
            malformed index.
        CheckpointFormatError: for a directory (but a ``.orbax`` training state) or another
            file that is not a regular file (FIFO, device, socket), an unknown format version, a
            legacy Keras HDF5 file, or a zip archive holding neither a training
            state nor Keras weights.
        NewerFormatError: (a ``CheckpointFormatError``) for a state of a newer keras_stable_state.
        StorageBackendError: for a URL whose fsspec implementation is not installed.
        StateError: for a ``.orbax`` folder, what its array source raises (the Orbax
            engine's: orbax-checkpoint not installed).
    """
    url = _url(filepath)
    if url is None:
        return layout.read_file(filepath, unaligned_views=unaligned_views, arrays=arrays)
    return read_bytes(object_store.fetch(url, storage_options), url, unaligned_views=unaligned_views)
