"""A ``.orbax`` training-state folder read without Orbax, Keras or a backend: one of the
layouts behind `keras_stable_state.format.open_file`.

`OrbaxFile` opens ``<dir>/state.h5`` (our sealed record, with every check) and lists
the arrays of ``<dir>/arrays/`` from the index it seals (`orbax_layout`), so
listing reads no array data and needs h5py and NumPy only; `OrbaxFile.read` reads one
array with TensorStore (the storage library under Orbax, installed with the ``[orbax]``
extra; neither Orbax nor JAX is imported) and checks it against its hash in the index.

`read_orbax` reads a folder for a restore: the record, with each array of ``arrays/``
left as an `OrbaxArray` that is read on demand, through the array source its caller
gives: the Orbax engine's for a restore (``keras_stable_state._engines.orbax.open_source``:
every process the shards of its variables' current sharding, the hash summed over
processes), or by default `StoreArrays` (TensorStore, each array whole, on this process). `materialize` reads the arrays a restore planned, all at once.

This module imports no Keras and no Orbax.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format.codec import dtype_name, numpy_dtype
from keras_stable_state.format.opened import Opened
from keras_stable_state.format.orbax_layout import (
    ARRAYS,
    INDEX,
    RECORD,
    SECTIONS,
    SUFFIX,
    element_hash,
    index_entries,
    region_hash,
    store_spec,
)
from keras_stable_state.format.reader import open_checkpoint_file, read_checkpoint_file
from keras_stable_state.format.record import BY_KEY, FORMAT, Entry, MatchedBy, StateRecord

__all__ = ["CONTAINER", "ArraySource", "OrbaxArray", "OrbaxFile", "StoreArrays", "materialize", "read_orbax"]

CONTAINER = ".orbax directory"


class ArraySource(Protocol):
    """Where the arrays of one ``.orbax`` folder are read from.

    Attributes:
        directory: The folder.
        where: The folder as messages name it.
    """

    directory: str
    where: str

    def load(self, wanted: list[tuple[OrbaxArray, Any]]) -> list[Any]:
        """``[(array, placement or None)]`` -> the values read, each checked against its
        hash (``CorruptCheckpointError`` naming the key where one fails)."""
        ...

    def placement(self, variable: Any) -> Any:
        """Where ``variable``'s value is read onto (a sharding), or ``None``: whole, on the host."""
        ...


SourceFactory = Callable[[str, str], ArraySource]


class OrbaxArray:
    """A saved array of a ``.orbax`` folder not read yet: its shape and dtype, read on demand.

    ``np.asarray`` reads it whole and checks its hash; `materialize` reads the arrays
    planned for variables at once. ``block`` is the grid of its hash (``None``: index
    version 1, per element).
    """

    def __init__(
        self,
        source: ArraySource,
        section: str,
        key: str,
        leaf: str,
        shape: Any,
        dtype: str,
        digest: str,
        block: Any = None,
    ) -> None:
        self.source, self.section, self.key, self.leaf = source, section, key, leaf
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype, self.digest = numpy_dtype(dtype), digest
        self.block = None if block is None else tuple(block)
        self.ndim = len(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        (value,) = self.source.load([(self, None)])
        return np.asarray(value) if dtype is None else np.asarray(value).astype(dtype)

    def __float__(self) -> float:
        return float(np.asarray(self))


def _tensorstore(where: str) -> Any:
    try:
        import tensorstore
    except ImportError as err:
        raise StateError(
            f"{where}: reading the arrays of a '{SUFFIX}' training state needs TensorStore, "
            f"which is not installed ({err}). Install it with pip install 'keras-stable-state[orbax]' "
            "(orbax-checkpoint brings it); `inspect` works without it.",
            expected="tensorstore installed",
            received="ImportError",
        ) from err
    return tensorstore


class StoreArrays:
    """The arrays of a ``.orbax`` folder read with TensorStore: each whole, on this process,
    checked against its hash in the sealed index."""

    def __init__(self, directory: str, where: str) -> None:
        self.directory, self.where = directory, where

    def placement(self, variable: Any) -> None:
        return None

    def load(self, wanted: list[tuple[OrbaxArray, Any]]) -> list[Any]:
        """The arrays ``wanted`` read whole (placements are ignored).

        Raises:
            CorruptCheckpointError: naming the key if an array cannot be read, has another
                shape or dtype than the index says, or fails its hash.
            StateError: if TensorStore is not installed (the ``[orbax]`` extra).
        """
        return [self._read(lazy) for lazy, _ in wanted]

    def _read(self, lazy: OrbaxArray) -> np.ndarray:
        ts = _tensorstore(self.where)
        key, dtype = lazy.key, lazy.dtype.name
        spec = store_spec(self.directory, f"{lazy.section}.{lazy.leaf}", self.where)
        try:
            value = np.asarray(ts.open(spec, open=True).result().read().result())
        except (ValueError, OSError, RuntimeError) as err:
            raise CorruptCheckpointError(
                f"{self.where}: array {key!r} cannot be read from {ARRAYS}/ ({err}); the "
                "folder is damaged or incomplete. Restore from an earlier checkpoint.",
                key=key,
            ) from err
        found = (tuple(value.shape), dtype_name(value))
        if found != (lazy.shape, dtype):
            raise CorruptCheckpointError(
                f"{self.where}: array {key!r} is {found[1]} of shape {found[0]} in {ARRAYS}/, "
                f"but the sealed index says {dtype} of shape {lazy.shape}. Restore from an "
                "earlier checkpoint.",
                key=key,
                expected=(lazy.shape, dtype),
                received=found,
            )
        start = (0,) * value.ndim
        if lazy.block is None:  # index version 1
            computed = element_hash(value, start, value.shape, key, dtype)
        else:
            computed = region_hash(value, start, value.shape, lazy.block, key, dtype)
        hexed = f"{computed:016x}"
        if hexed != lazy.digest:
            raise CorruptCheckpointError(
                f"{self.where}: array {key!r} fails its hash (expected {lazy.digest}, computed {hexed}): "
                f"its bytes in {ARRAYS}/ are not the ones saved. Restore from an earlier checkpoint.",
                key=key,
                expected=lazy.digest,
                received=hexed,
            )
        return value


def _check_folder(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"No training state at {path!r} (a '{SUFFIX}' directory).")
    if not (os.path.isdir(path) and os.path.lexists(os.path.join(path, RECORD))):
        raise CheckpointFormatError(
            f"{path!r} is not a '{SUFFIX}' training state: it has no {RECORD!r} (a directory written by "
            f"save_training_state holds {RECORD} and {ARRAYS}/). Pass the directory that "
            f"save_training_state(... '{SUFFIX}') wrote.",
            key=None,
            expected=f"a directory with {RECORD}",
            received=path,
        )


def _lazy_arrays(source: ArraySource, metadata: Any, where: str) -> list[OrbaxArray]:
    return [
        OrbaxArray(source, section, key, leaf, shape, dtype, digest, block)
        for section, key, leaf, shape, dtype, digest, block in index_entries(metadata, where)
    ]


def read_orbax(path: str | os.PathLike[str], source: SourceFactory | None = None) -> StateRecord:
    """Read the sealed record of the ``.orbax`` folder ``path``; its arrays in ``arrays/``
    are `OrbaxArray`, read through ``source(directory, where)`` (the caller's: the Orbax
    engine gives its own for a restore; default `StoreArrays`, without Orbax).

    Raises:
        FileNotFoundError: if there is no such folder.
        CheckpointFormatError: if ``path`` is not a ``.orbax`` training-state folder.
        CorruptCheckpointError: if ``state.h5`` fails its checks (its xxh3-128 seal,
            its records' and arrays' xxh3-64) or its index is malformed.
        NewerFormatError: if its index version is above the newest this version reads.
        StateError: what ``source`` raises (the Orbax engine's: orbax-checkpoint not installed).
    """
    path = os.fspath(path)
    where = repr(path)
    factory = source or StoreArrays
    arrays = factory(path, where)
    _check_folder(path)
    record = read_checkpoint_file(os.path.join(path, RECORD))
    lazies = _lazy_arrays(arrays, record.metadata, where)  # (a stock file has none: refused)
    assert isinstance(record, StateRecord)
    for lazy in lazies:
        getattr(record, lazy.section)[lazy.key] = lazy
    return record


def materialize(plan: list[tuple[Any, Any]]) -> tuple[list[tuple[Any, Any]], set[int]]:
    """``([(variable, value)], fresh)``: ``plan`` with every `OrbaxArray` read (one read
    for all, each onto its variable's placement), other values left as they are;
    ``fresh`` holds the ``id`` of each NumPy array read here, which nothing else holds (a
    variable may keep its memory: see ``keras_stable_state._core.apply.variable_step``).

    Raises:
        The errors of the arrays' source (``CorruptCheckpointError`` naming the key of an
        array that cannot be read or fails its hash).
    """
    wanted = [(i, value) for i, (_, value) in enumerate(plan) if isinstance(value, OrbaxArray)]
    if not wanted:
        return plan, set()
    source = wanted[0][1].source
    values = source.load([(lazy, source.placement(plan[i][0])) for i, lazy in wanted])
    plan = list(plan)
    for (i, _), value in zip(wanted, values, strict=True):
        plan[i] = (plan[i][0], value)
    return plan, {id(value) for value in values if type(value) is np.ndarray}


class OrbaxFile(Opened):
    """A ``.orbax`` training state opened for reading: a `Layout` (see
    `keras_stable_state.format.layout`), its arrays matched by key.

    Args:
        path: The ``.orbax`` folder.

    Attributes:
        path, where, kind, version, metadata (the writer's, without the array index),
        contract, extra, entries (the arrays of ``arrays/``, then those of ``state.h5``):
            as `CheckpointFile` has them.
        container: ``".orbax directory"``.
        members, member, damaged_members, problems, optimizer_keys, model_class: empty
            (what a ``.keras`` archive or a stock file has).

    Raises:
        FileNotFoundError: if there is no such folder.
        CheckpointFormatError: if ``path`` holds no ``state.h5`` (not a ``.orbax``
            training state).
        CorruptCheckpointError: if ``state.h5`` fails its checks or its index is malformed.
        NewerFormatError: if its index version is above the newest this version reads.
        The other errors of `open_checkpoint_file` for ``state.h5``.
    """

    container = CONTAINER
    matched_by: MatchedBy = BY_KEY

    @property
    def checksum(self) -> str:
        """What its arrays are checked with: ``"Orbax index hashes and xxh3-64"``."""
        return "Orbax index hashes and xxh3-64"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.where = repr(self.path)
        _check_folder(self.path)
        self._file = open_checkpoint_file(os.path.join(self.path, RECORD))
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _open(self) -> None:
        f = self._file
        self.kind, self.version, self.contract, self.extra = f.kind, f.version, f.contract, f.extra
        meta = dict(f.metadata) if f.kind == FORMAT else None
        self._store = StoreArrays(self.path, self.where)
        lazies = _lazy_arrays(self._store, meta, self.where)
        self.metadata = {k: v for k, v in (meta or {}).items() if k != INDEX}
        self.members: list[tuple[str, int]] = []
        self.member: str | None = None
        self.damaged_members: list[tuple[str, str]] = []
        self.problems: list[tuple[str, str]] = []
        self.optimizer_keys: dict[str, str] = {}
        self.model_class: str | None = None
        self._lazy: dict[str, OrbaxArray] = {}
        indexed = []
        for lazy in lazies:
            nbytes = int(np.prod(lazy.shape, dtype=np.int64)) * lazy.dtype.itemsize
            dataset = f"{ARRAYS}/{lazy.section}.{lazy.leaf}"
            indexed.append(Entry(lazy.section, lazy.key, dataset, lazy.shape, lazy.dtype.name, nbytes))
            self._lazy[dataset] = lazy
        own = [e for e in f.entries if e.section not in SECTIONS]
        self.entries: list[Entry] = indexed + own

    def read(self, entry: Entry) -> np.ndarray:
        """Read one array and check it: the index's hash for an Orbax array, else the record's checksum.

        Raises:
            CorruptCheckpointError: naming ``entry.key`` if it cannot be read, has another
                shape or dtype than the index says, or fails its hash.
            StateError: if TensorStore is not installed (the ``[orbax]`` extra).
        """
        lazy = self._lazy.get(entry.dataset)
        if lazy is None:
            return self._file.read(entry)
        (value,) = self._store.load([(lazy, None)])
        return np.asarray(value)

    def check(self, progress: Callable[[int], object] | None = None) -> list[tuple[str, str]]:
        """Read every array (and ``state.h5``'s own) and check it; ``[(key, reason)]`` of the damaged."""
        damaged = []
        for e in self.entries:
            try:
                self.read(e)
            except CorruptCheckpointError as err:
                damaged.append((str(err.key), str(err)))
            if progress is not None:
                progress(e.nbytes)
        return damaged

    def close(self) -> None:
        """Close ``state.h5`` and release its lock. Closing twice is harmless."""
        self._file.close()
