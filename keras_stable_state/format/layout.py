"""One door for every layout a training state is read from.

Three layouts: our record (an ``.h5`` file, or the member ``keras_stable_state.h5`` of a
``.keras`` archive), a stock Keras file (``.keras``, ``.weights.h5``), and a ``.orbax``
folder (our record beside an Orbax checkpoint of the arrays). Each opens as a `Layout`:
its arrays listed (``entries``) and read one at a time, each checked (``read``,
``check``), the writer's records (``metadata``, ``contract``, ``extra``), and how its
arrays are matched to the live variables (``matched_by``): by key (`BY_KEY`: our record,
``.orbax``) or by structure (`BY_STRUCTURE`: a stock Keras file, by the HDF5 paths of the
model's layers, as ``load_weights`` matches them). The records read whole
(`StateRecord`, `StockWeights`) say the same in ``matched_by``: which layout a file has is
decided here, in ``format``, and nowhere above it.

`open_file` and `read_file` pick the layout of a path from `LAYOUTS`, the first whose
``claims`` takes it (as orbax v1's layout registry does): a local path named ``*.orbax``
is a ``.orbax`` folder (`orbax_file`), anything else a ``.keras`` or HDF5 file
(`reader`), whose record or stock layout shows once it is open (its ``format``
attribute). These take local paths (a ``file://`` URL is the path it names): an object in a
store is fetched by the object-store engine and read from memory (`reader.read_bytes`,
`CheckpointFile.from_bytes`), which ``keras_stable_state.format.open_file`` and
``read_file``, the package's public door, do for a URL.

This module imports no Keras.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal, Protocol

import numpy as np

from keras_stable_state.format.orbax_file import OrbaxFile, SourceFactory, read_orbax
from keras_stable_state.format.orbax_layout import is_orbax_path
from keras_stable_state.format.reader import open_checkpoint_file, read_checkpoint_file
from keras_stable_state.format.record import BY_KEY, BY_STRUCTURE, Entry, MatchedBy, StateRecord
from keras_stable_state.format.stock import StockWeights
from keras_stable_state.format.urls import is_remote

__all__ = ["BY_KEY", "BY_STRUCTURE", "LAYOUTS", "Layout", "LayoutKind", "open_file", "read_file"]


class Layout(Protocol):
    """A training state opened for reading, whatever its layout (`open_file`).

    Attributes:
        path: What was opened (``"<bytes>"`` for bytes in memory).
        where: What error messages call it.
        kind: ``"keras_stable_state"`` for our record (a ``.orbax`` folder's included),
            ``"stock"`` for a stock Keras file.
        container: ``".keras archive"``, ``".h5 file"``, ``".weights.h5 file"`` or
            ``".orbax directory"``.
        version: The record's format version (``None`` for stock files).
        matched_by: `BY_KEY` or `BY_STRUCTURE`.
        checksum: The name of the checksum its arrays carry, ``None`` if none.
        metadata, contract, extra: The writer's records (a stock file: Keras'
            ``metadata.json`` of an archive or ``{}``, ``None``, ``{}``).
        entries: Every array, as `Entry`, in file order.
        members, member, damaged_members, optimizer_keys, model_class, problems: What a
            ``.keras`` archive and a stock file add (see `CheckpointFile`); empty otherwise.
    """

    path: str
    where: str
    kind: str
    container: str
    version: int | None
    metadata: dict[str, Any]
    contract: list[list[Any]] | None
    extra: dict[str, Any]
    entries: list[Entry]
    members: list[tuple[str, int]]
    member: str | None
    damaged_members: list[tuple[str, str]]
    optimizer_keys: dict[str, str]
    model_class: str | None
    problems: list[tuple[str, str]]

    @property
    def matched_by(self) -> MatchedBy: ...

    @property
    def checksum(self) -> str | None: ...

    @property
    def total_bytes(self) -> int: ...

    def read(self, entry: Entry) -> np.ndarray:
        """Read one array and check it (``CorruptCheckpointError`` naming its key if it fails)."""
        ...

    def check(self, progress: Callable[[int], object] | None = None) -> list[tuple[str, str]]:
        """Read every array (and archive member) and check it; ``[(key or member, reason)]``
        of the damaged."""
        ...

    def section(self, name: str) -> list[Entry]:
        """The entries of one section (``"model"``, ``"optimizer"``, ``"state"``)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Layout: ...

    def __exit__(self, *exc: object) -> Literal[False]: ...


@dataclasses.dataclass(frozen=True)
class LayoutKind:
    """One entry of the registry `LAYOUTS`.

    Attributes:
        name: What it reads (``".orbax folder"``).
        claims: Whether a path (``str``) has this layout, from the path alone.
        open: ``(path) -> Layout``.
        read: ``(path, unaligned_views, arrays) -> StateRecord | StockWeights``, every array read (or, in a ``.orbax`` folder, read on demand
            through ``arrays``, the caller's array source, or TensorStore if ``None``) and
            checked.
    """

    name: str
    claims: Callable[[str], bool]
    open: Callable[[Any], Layout]
    read: Callable[[Any, bool, Any], StateRecord | StockWeights]


def _local_orbax(path: str) -> bool:
    return not is_remote(path) and is_orbax_path(path)


LAYOUTS: tuple[LayoutKind, ...] = (
    LayoutKind(
        ".orbax folder",
        _local_orbax,
        lambda path: OrbaxFile(path),
        lambda path, _unaligned, arrays: read_orbax(path, arrays),
    ),
    LayoutKind(
        ".keras or HDF5 file (our record, or a stock Keras file)",
        lambda path: True,
        open_checkpoint_file,
        lambda path, unaligned, _arrays: read_checkpoint_file(path, unaligned_views=unaligned),
    ),
)


def _kind(filepath: object) -> LayoutKind:
    """The first entry of `LAYOUTS` that claims ``filepath`` (any other object: the file
    reader's, which refuses it with a ``TypeError``)."""
    if isinstance(filepath, bytes | str | os.PathLike):
        path = os.fsdecode(os.fspath(filepath))
        return next(kind for kind in LAYOUTS if kind.claims(path))
    return LAYOUTS[-1]


def open_file(filepath: object) -> Layout:
    """Open a local training state for reading, lazily, in its layout: a training-state
    file, a stock Keras weights file or a ``.orbax`` folder (what
    ``keras_stable_state.format.open_file`` opens for every path but an object-store URL).

    The seal (or, for unsealed files, a probe process), the structure and the
    records are checked; no array is read until ``read``. A ``file://`` URL is the local
    file it names; any other URL is refused (`keras_stable_state.format.urls.refuse_url`).

    Args:
        filepath: A path (``str``, ``bytes``, ``os.PathLike``).

    Examples:
        >>> with format.open_file("run.keras") as f:
        ...     kernel = f.read(f.section("model")[0])

    Returns:
        A `Layout`, to use as a context manager: a `CheckpointFile`
        (``.keras``, ``.h5``, ``.weights.h5``) or an `OrbaxFile`
        (``.orbax``, whose ``read`` reads with TensorStore).

    Raises:
        FileNotFoundError: naming the path if there is nothing there.
        The errors of `CheckpointFile` and of `OrbaxFile`.
    """
    return _kind(filepath).open(filepath)


def read_file(
    filepath: object, *, unaligned_views: bool = True, arrays: SourceFactory | None = None
) -> StateRecord | StockWeights:
    """Read a local training state whole, in its layout, with every check (what
    ``keras_stable_state.format.read_file`` reads for every path but an object-store URL).

    A ``.keras`` or HDF5 file is read by `read_checkpoint_file`: every array read and
    checked, and every archive member, before anything is returned (the command line's
    ``verify`` runs exactly these checks); ``unaligned_views=False`` is for a caller that
    needs 64-byte aligned memory (see `CheckpointFile`). A ``.orbax`` folder is read by
    `read_orbax`: its ``state.h5`` so, its arrays in ``arrays/`` read on demand through
    ``arrays`` (an array source the caller gives: the Orbax engine's for a restore onto
    each variable's sharding; ``None``: TensorStore, without Orbax), each checked against
    its hash. A ``file://`` URL is the local file it names; any other URL is refused.

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
        StateError: for a ``.orbax`` folder, what its array source raises (the Orbax
            engine's: orbax-checkpoint not installed).
    """
    return _kind(filepath).read(filepath, unaligned_views, arrays)
