"""The small part of a training state's records, read fast: its ``metadata`` and ``extra``
records and its format version, for listing a directory of many checkpoints
(``keras-stable-state ls``, ``CheckpointManager.metadata``, ``best_step``, ``all_steps``).

A sealed format-3 file (of up to `LEAN_MAX_BYTES`) is read whole once (one ``read``), its
seal checked over those bytes, and its two records read from that image, each against its
own xxh3-64: what is shown is what was sealed. The index, the arrays and the schema of the records are not
read or checked (`open_file` does that; a restore reads every array). Anything else (an
older format, a stock Keras file, an archive, anything not as written: a bad seal, an
unexpected root object or attribute) goes through `open_file`, which says what is wrong
in its own words.

This module imports no Keras.
"""

from __future__ import annotations

import json
import os
from typing import Any

import h5py
import numpy as np

from keras_stable_state.format import files, sandbox
from keras_stable_state.format.reader import open_file
from keras_stable_state.format.record import FORMAT, INDEX, RECORDS, SECTIONS
from keras_stable_state.format.schema import check_json_depth
from keras_stable_state.format.seal import MAGIC, check_bytes

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_ROOT = {*RECORDS, *SECTIONS, INDEX}
_LEAN_VERSION = 3
LEAN_MAX_BYTES = 64 << 20
"""The largest file read whole into memory here; a larger one goes through `open_file`
(which hashes it in chunks): a listing never holds a large checkpoint in memory."""

Summary = tuple[dict[str, Any], dict[str, Any], int | None]


def read_summary(path: str, provider: str) -> Summary:
    """``(metadata, extra, format version)`` of the training state at ``path``: its seal
    checked, its arrays not read (see the module docstring). Of ``extra`` only the record
    of the state provider ``provider`` is kept (``{"providers": {provider: ...}}``, or
    ``{}`` if it has none): the rest (random states, callbacks) is what a listing never
    shows.

    Raises:
        Every error of `keras_stable_state.format.open_file`.
    """
    found = _lean(path, provider)
    if found is not None:
        return found
    with open_file(path) as f:
        return dict(f.metadata), _only(f.extra, provider), f.version


def _only(extra: Any, provider: str) -> dict[str, Any]:
    providers = extra.get("providers") if isinstance(extra, dict) else None
    if not isinstance(providers, dict) or provider not in providers:
        return {}
    return {"providers": {provider: providers[provider]}}


def _lean(path: str, provider: str) -> Summary | None:
    """The summary of a sealed format-3 record from one read of its bytes, or ``None``
    where `open_file` is to read it (and raise what is wrong)."""
    try:
        fh = files.open_binary(path)
    except (OSError, ValueError):
        return None  # open_file raises its own error for it
    with fh:
        if fcntl is not None:
            try:  # a file locked for writing: open_file says it is in use
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return None
        if os.fstat(fh.fileno()).st_size > LEAN_MAX_BYTES:
            return None
        data = fh.read(LEAN_MAX_BYTES + 1)
    if len(data) > LEAN_MAX_BYTES or not data.startswith(MAGIC):
        return None
    try:
        version, _, ok = check_bytes(data, path)
    except Exception:  # noqa: BLE001 - a malformed or newer seal: open_file says which
        return None
    if not ok or version != _LEAN_VERSION:
        return None
    try:
        return _records(data, path, provider)
    except Exception:  # noqa: BLE001 - anything not as written: open_file says what
        return None


def _records(data: bytes, where: str, provider: str) -> Summary | None:
    fid = h5py.h5f.open_file_image(data)
    try:
        root = h5py.h5g.open(fid, b"/")
        names = {root.get_objname_by_idx(i).decode("utf-8") for i in range(root.get_num_objs())}
        if names != _ROOT:
            return None
        attrs = {
            h5py.h5a.open(root, index=i).get_name().decode("utf-8")
            for i in range(h5py.h5a.get_num_attrs(root))
        }
        if attrs != {"format", "format_version"}:
            return None
        if _attr(root, b"format") not in (FORMAT, FORMAT.encode()):
            return None
        version = _attr(root, b"format_version")
        if not isinstance(version, np.integer) or int(version) != _LEAN_VERSION:
            return None
        metadata, extra = (_json(fid, name, where) for name in ("metadata", "extra"))
    finally:
        fid.close()
    if not isinstance(metadata, dict) or not isinstance(extra, dict):
        return None
    check_json_depth(metadata, where)
    extra = _only(extra, provider)
    check_json_depth(extra, where)  # what is kept: the rest is never looked at
    return metadata, extra, _LEAN_VERSION


def _attr(obj, name: bytes):
    attr = h5py.h5a.open(obj, name)
    if attr.get_space().get_simple_extent_ndims() != 0 or attr.dtype.kind not in "iuSO":
        return None
    value = np.empty((), dtype=attr.dtype)
    attr.read(value)
    return value[()]


def _json(fid, name: str, where: str) -> Any:
    ds = h5py.h5d.open(fid, name.encode())
    if ds.dtype != np.uint8 or ds.get_space().get_simple_extent_ndims() != 1:
        raise ValueError(name)
    if h5py.h5a.get_num_attrs(ds) != 1:
        raise ValueError(name)
    stored = np.empty((), dtype=np.uint64)
    attr = h5py.h5a.open(ds, b"xxh3")
    if attr.dtype != np.uint64:
        raise ValueError(name)
    attr.read(stored)
    (size,) = ds.get_space().get_simple_extent_dims()
    raw = np.empty((size,), dtype=np.uint8)
    ds.read(h5py.h5s.ALL, h5py.h5s.ALL, raw)
    if int(stored) != sandbox.digest_v3(name, "json", raw.shape, raw):
        raise ValueError(name)
    return json.loads(raw.tobytes().decode("utf-8"))  # too deep: RecursionError, the full path
