"""The small part of a training state's records, read fast: its ``metadata`` and ``extra``
records and its format version, for listing a directory of many checkpoints
(``keras-stable-state ls``, ``CheckpointManager.metadata``, ``best_step``, ``all_steps``).

A sealed format-3 file (of up to `LEAN_MAX_BYTES`) is read whole once (one ``read``), its
seal checked over those bytes (every byte after the user block: the records among them),
and its two records read from that image: what is shown is what was sealed. The index, the arrays and the schema of the records are not
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

from keras_stable_state.format import files
from keras_stable_state.format.reader import open_checkpoint_file, read_whole
from keras_stable_state.format.record import INDEX, RECORDS, SECTIONS
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
    shows. Of ``metadata``, a sealed format-3 file keeps its plain values (``backend``,
    the versions), the others all of it.

    Raises:
        Every error of `keras_stable_state.format.open_file`.
    """
    found = _lean(path, provider)
    if found is not None:
        return found
    with open_checkpoint_file(path) as f:
        return dict(f.metadata), _only(f.extra, provider), f.version


def read_summary_whole(filepath: object) -> Summary:
    """``(metadata, extra, format version)`` of a file
    `read_checkpoint_file` reads whole, with every
    check (every array read and checked): one open for both.

    Raises:
        Every error of `read_checkpoint_file`.
    """
    f = open_checkpoint_file(filepath, whole=True)
    read_whole(f)
    return dict(f.metadata), dict(f.extra), f.version


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
    """The two records of a sealed format-3 image ``data``, read from their places in
    ``data``: the seal, checked over every byte after the user block, covers them (their
    own xxh3-64 is checked by `open_file`); ``None`` for an image not as this version writes
    it (other root objects or attributes, a record not stored whole)."""
    fid = h5py.h5f.open_file_image(data)
    try:
        root = h5py.h5g.open(fid, b"/")
        if root.get_num_objs() != len(_ROOT) or h5py.h5a.get_num_attrs(root) != 2:
            return None  # a newer writer's objects or attributes: open_file says so
        metadata, extra = (_json(fid, data, name) for name in (b"metadata", b"extra"))
    finally:
        fid.close()
    if not isinstance(metadata, dict) or not isinstance(extra, dict):
        return None
    # what is kept: the provider's record and the writer's plain facts (backend, versions);
    # the rest is never looked at
    extra = _only(extra, provider)
    check_json_depth(extra, where)
    metadata = {k: v for k, v in metadata.items() if isinstance(v, str | int | float | bool) or v is None}
    return metadata, extra, _LEAN_VERSION


def _json(fid: Any, data: bytes, name: bytes) -> Any:
    """The JSON record ``name``: its bytes where HDF5 stored them whole in ``data``."""
    ds = h5py.h5d.open(fid, name)
    offset, size = ds.get_offset(), ds.get_storage_size()
    if offset is None or offset + size > len(data):
        raise ValueError(name)  # not stored whole: open_file reads it
    return json.loads(data[offset : offset + size].decode("utf-8"))  # too deep: RecursionError, open_file
