"""Orbax as the storage engine of a ``.orbax`` training-state directory.

A path ending in ``.orbax`` is a directory::

    run.orbax/
        state.h5     our sealed record (format 3, written by
                     `keras_stable_state.format.writer.write_record`; see
                     ``docs/concepts/file-format.md``): metadata, contract,
                     other state and its small arrays, and in
                     ``metadata["orbax"]`` the index of the arrays below
        arrays/      an Orbax PyTree checkpoint (``orbax.checkpoint``) of every
                     model and optimizer array but scalars (kept in
                     ``state.h5``), ``{"model": {"0": ...},
                     "optimizer": {"0": ...}}``, numbered as in the index

The index (version 2) lists ``[section, key, name, shape, dtype, hash, block]``
per array: our stable key, the Orbax leaf name, a 64-bit hash of its bytes and
the block shape of that hash's grid. Orbax checksums only its shard index, not
the data, so each array is checked against this hash when restored. The hash
(``format.orbax_layout``) is the sum modulo 2**64 of the xxh3-64 of the bytes of
each block of the grid, seeded by the key, dtype, shape and the block's place;
the grid is the array's shards when saved (one block for an unsharded array).
Each process hashes the shards it writes, in place on the CPU (``np.asarray`` of
a CPU shard is its own buffer; on an accelerator it is a copy to the host beside
the one Orbax makes to write it), and the partial sums of the processes are added. On restore a process hashes the
shards it read, whole blocks at a time; when the current sharding cuts the
saved blocks (a restore onto another layout), the saved blocks are read from
``arrays/`` with TensorStore instead, split between the processes. States of
index version 1 (a per-element SplitMix64 hash) are still read and checked.

With several JAX processes each process writes only the shards it holds
(Orbax), process 0 writes ``state.h5``; on restore each process reads only the
shards of the variable's current sharding. ``orbax-checkpoint`` is imported
only here and only when a ``.orbax`` path is used.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_stable_state import _processes
from keras_stable_state._engines.write_request import WriteRequest
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format import orbax_file, orbax_layout, writer
from keras_stable_state.format.codec import dtype_name
from keras_stable_state.format.orbax_file import OrbaxArray  # noqa: F401 (its lazy arrays)
from keras_stable_state.format.orbax_layout import (  # noqa: F401 (names of this engine)
    ARRAYS,
    INDEX,
    INDEX_VERSION,
    RECORD,
    SECTIONS,
    SUFFIX,
    index_entries,
    is_orbax_path,
)
from keras_stable_state.format.record import StateRecord

_MASK = orbax_layout.MASK
_SECTIONS = SECTIONS


def check_installed() -> None:
    """Raise a [`StateError`][keras_stable_state.StateError] naming the extra to install if orbax-checkpoint is missing."""
    _ocp()


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise StateError(
            f"A '{SUFFIX}' training state is stored with Orbax, and orbax-checkpoint is not installed "
            f"({err}). Install it with `pip install 'keras-stable-state[orbax]'`, or save to a '.h5' "
            "or '.keras' path.",
            key=None,
            expected="orbax-checkpoint installed",
            received="ImportError",
        ) from err
    return ocp


# -- the hash (format.orbax_layout) ---------------------------------------------------
def _grid(value) -> tuple:
    """The block shape of the hash of ``value``: its shard shape when sharded, else its shape."""
    shape = tuple(map(int, value.shape))
    if 0 in shape or not _processes.is_sharded(value):
        return shape
    return tuple(map(int, value.sharding.shard_shape(shape)))


def _box(index, shape) -> tuple:
    """``(start, stop)`` of a shard's index (a tuple of slices) in an array of ``shape``."""
    start = tuple(0 if s.start is None else s.start for s in index)
    stop = tuple(n if s.stop is None else s.stop for s, n in zip(index, shape, strict=True))
    return start, stop


def _held(value, shape, block) -> bool:
    """Whether every shard of the sharded ``value`` is a union of whole blocks of ``block``."""
    boxes = value.sharding.devices_indices_map(shape).values()
    return all(orbax_layout.aligned(*_box(index, shape), shape, block) for index in boxes)


def _local_hash(value, key, dtype, block):
    """``(hash, whole)``: this process' part of the hash of ``value`` (a NumPy array or a
    JAX array); ``whole`` if this process holds it all (an unsharded value)."""
    shape = tuple(map(int, value.shape))
    if block is None:  # index version 1: per element
        part = orbax_layout.element_hash
        if isinstance(value, np.ndarray) or not _processes.is_sharded(value):
            return part(np.asarray(value), (0,) * len(shape), shape, key, dtype), True
        total = 0
        for shard in value.addressable_shards:
            if shard.replica_id == 0:  # each block once, whichever device holds it
                total += part(np.asarray(shard.data), _box(shard.index, shape)[0], shape, key, dtype)
        return total & _MASK, False
    if 0 in shape:  # no element (nothing to read, not even on another process)
        return orbax_layout.region_hash(
            np.zeros(shape, np.uint8), (0,) * len(shape), shape, block, key, dtype
        ), True
    if isinstance(value, np.ndarray) or not _processes.is_sharded(value):
        return orbax_layout.region_hash(np.asarray(value), (0,) * len(shape), shape, block, key, dtype), True
    total = 0
    for shard in value.addressable_shards:
        if shard.replica_id == 0:  # each block once, whichever device holds it
            start = _box(shard.index, shape)[0]
            total += orbax_layout.region_hash(np.asarray(shard.data), start, shape, block, key, dtype)
    return total & _MASK, False


def _stored_hash(lazy) -> int:
    """This process' part of the hash of ``lazy``'s saved blocks, read from ``arrays/`` with
    TensorStore: the blocks whose number modulo the process count is this process' index."""
    import tensorstore as ts

    where = lazy.source.where
    spec = orbax_layout.store_spec(lazy.source.directory, f"{lazy.section}.{lazy.leaf}", where)
    count, me = _processes.process_count(), _processes.process_index()
    try:
        store = ts.open(spec, open=True).result()
        total = 0
        for number, first in enumerate(orbax_layout.block_starts(lazy.shape, lazy.block)):
            if number % count != me:
                continue
            box = tuple(
                slice(f, min(f + b, n)) for f, b, n in zip(first, lazy.block, lazy.shape, strict=True)
            )
            block = np.asarray(store[box].read().result())
            total += orbax_layout.region_hash(block, first, lazy.shape, lazy.block, lazy.key, lazy.dtype.name)
    except (OSError, ValueError, RuntimeError) as err:
        raise CorruptCheckpointError(
            f"{where}: array {lazy.key} cannot be read from '{ARRAYS}' to check it ({err}); the folder is "
            "damaged or incomplete. Restore from an earlier checkpoint.",
            key=lazy.key,
        ) from err
    return total & _MASK


def _combine(parts: list) -> np.ndarray:
    """The local parts ``[(hash, whole)]`` of every process, ``uint64`` of shape ``(processes, n)``
    (a collective with several processes)."""
    local = np.array([[h for h, _ in parts]], dtype=np.uint64).reshape(1, -1)
    if _processes.process_count() == 1 or not parts:
        return local
    from jax.experimental import multihost_utils

    halves = np.stack([local[0] >> np.uint64(32), local[0] & np.uint64(0xFFFFFFFF)], axis=-1).astype(
        np.uint32
    )
    every = np.asarray(multihost_utils.process_allgather(halves)).astype(np.uint64)
    return (every[..., 0] << np.uint64(32)) | every[..., 1]


def _fails(column: np.ndarray, whole: bool, digest: str) -> bool:
    """Whether the parts ``column`` of every process miss ``digest``: each process' own hash
    of a value it holds whole, or their sum for a sharded one."""
    if whole:
        return any(f"{int(h):016x}" != digest for h in column)
    return f"{int(column.sum(dtype=np.uint64)):016x}" != digest


def _digests(parts: list) -> list:
    """The hash of each array from its local parts: a whole value's from process 0, a sharded one's
    the sum over processes."""
    every = _combine(parts)
    return [
        int(every[0, i]) if whole else int(every[:, i].sum(dtype=np.uint64))
        for i, (_, whole) in enumerate(parts)
    ]


# -- saving ------------------------------------------------------------------------------
def live_value(variable: Any, to_numpy: Callable[[Any], Any]) -> Any:
    """What the engine saves for ``variable``: its JAX array as it is (no gather, no copy:
    JAX arrays are immutable, and a blocking save reads them at a step boundary), else NumPy."""
    value = getattr(variable, "value", variable)
    jax = sys.modules.get("jax")  # (no JAX imported: not a JAX array)
    if jax is not None and isinstance(value, jax.Array):
        return value
    return to_numpy(variable)


def _inline(value) -> bool:
    """Whether ``value`` is stored in ``state.h5`` rather than in ``arrays/``: a scalar (an
    optimizer's ``iterations``, its learning rate) that this process holds whole. Such
    values are checked before anything is assigned; read from ``arrays/`` they would cost
    an Orbax restore of their own (10-15 ms of fixed cost)."""
    return np.ndim(value) == 0 and not _processes.is_sharded(value)


def write(request: WriteRequest) -> str:
    """Write ``request.record`` to the ``.orbax`` directory ``request.path`` (every process
    calls this); the path.

    ``record.model`` and ``record.optimizer`` hold NumPy arrays or sharded JAX
    arrays; scalars (`_inline`) are stored with the record in ``state.h5``
    (sealed and hashed as any array of a record), every other array in
    ``arrays/``. The new directory is built beside ``path`` (``.<name>.kss-partial``)
    and then moved onto it; a previous directory is moved to
    ``<name>.kss-old`` first and removed last, so one of the two is whole at
    every moment.

    Raises:
        StateError: if orbax-checkpoint is not installed, or (on processes
            other than 0) if process 0 failed to write.
        CheckpointFormatError: if ``path`` is a file.
        OSError: naming the path when a write fails.
    """
    path, record = request.path, request.record
    ocp = _ocp()
    final = os.path.abspath(path.rstrip("/\\"))
    parent, name = os.path.split(final)
    partial = os.path.join(parent, f".{name}.kss-partial")
    if os.path.isfile(final):
        raise CheckpointFormatError(
            f"{path!r} is a file; a '{SUFFIX}' training state is a directory. Choose another path, or "
            "remove the file.",
            key=None,
            expected="a directory or no file",
            received=path,
        )

    def clear():
        if os.path.isdir(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)

    with _processes.on_primary(partial) as turn:
        if turn.runs:
            clear()
    index, tree = [], {}
    # Values may be zero-argument callables (converted lazily, storage.StateRecord).
    entries = [(s, k, v() if callable(v) else v) for s in _SECTIONS for k, v in getattr(record, s).items()]
    inline = {section: {} for section in _SECTIONS}
    for section, key, value in entries:
        if _inline(value):
            inline[section][key] = np.asarray(value)
    entries = [(s, k, v) for s, k, v in entries if k not in inline[s]]
    dtypes = [dtype_name(v) for _, _, v in entries]
    grids = [_grid(v) for _, _, v in entries]
    parts = [_local_hash(v, k, d, g) for (_, k, v), d, g in zip(entries, dtypes, grids, strict=True)]
    hashes = _digests(parts)
    counters = dict.fromkeys(_SECTIONS, 0)
    for (section, key, value), dtype, digest, grid in zip(entries, dtypes, hashes, grids, strict=True):
        leaf = str(counters[section])
        counters[section] += 1
        tree.setdefault(section, {})[leaf] = value
        shape = list(map(int, value.shape))
        index.append([section, key, leaf, shape, dtype, f"{digest:016x}", list(grid)])
    if tree:  # (a state of scalars only has no arrays/)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            checkpointer.save(os.path.join(partial, ARRAYS), args=ocp.args.PyTreeSave(tree))
    small = StateRecord(
        metadata={**record.metadata, INDEX: {"version": INDEX_VERSION, "arrays": index}},
        contract=record.contract,
        model=inline["model"],
        optimizer=inline["optimizer"],
        extra=record.extra,
        arrays=record.arrays,
    )

    def finish():
        writer.write_record(os.path.join(partial, RECORD), small)
        old = os.path.join(parent, f"{name}.kss-old")
        if os.path.isdir(old):
            shutil.rmtree(old)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(partial, final)
        if os.path.isdir(old):
            shutil.rmtree(old)

    with _processes.on_primary(path) as turn:
        if turn.runs:
            finish()
    return path


# -- restoring ---------------------------------------------------------------------------
def _path_refusal(err: BaseException) -> bool:
    """Whether Orbax's ``err`` refuses the path it was given (e.g. "Checkpoint path should be
    absolute") rather than reporting what it read: not damage, so no file is blamed for it."""
    text = str(err).lower()
    return isinstance(err, ValueError) and "path" in text and "absolute" in text


class _Source:
    """Where the arrays of a ``.orbax`` state are read from with Orbax (the
    `keras_stable_state.format.orbax_file.ArraySource` this engine supplies):
    ``directory``, made absolute here (Orbax refuses a relative path), and ``where``, the
    path as messages name it."""

    def __init__(self, directory, where):
        self.directory, self.where = os.path.abspath(directory), where

    def placement(self, variable):
        """The sharding of ``variable``'s value when it is sharded (each process reads only
        its shards), else ``None`` (read whole, as NumPy)."""
        value = getattr(variable, "value", None)
        return getattr(value, "sharding", None) if _processes.is_sharded(value) else None

    def _restore(self, wanted):
        ocp = _ocp()
        item, args = {}, {}
        for lazy, sharding in wanted:
            item.setdefault(lazy.section, {})[lazy.leaf] = 0
            if sharding is None:
                arg = ocp.RestoreArgs(restore_type=np.ndarray)
            else:
                arg = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=lazy.shape)
            args.setdefault(lazy.section, {})[lazy.leaf] = arg
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                os.path.join(self.directory, ARRAYS),
                args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
            )
        return [restored[lazy.section][lazy.leaf] for lazy, _ in wanted]

    def load(self, wanted):
        """``[(OrbaxArray, sharding or None)]`` -> checked values (JAX arrays on a sharding, else NumPy).

        Raises:
            CorruptCheckpointError: naming the first damaged key (``.key``; the message
                names every one found) if Orbax cannot read an array, an array has another
                shape or dtype than the sealed index says, or fails its hash.
            StateError: if Orbax refuses the path itself (`_path_refusal`): the folder
                is not damaged, so nothing is moved aside for it.
        """
        try:
            values = self._restore(wanted)
        except (OSError, ValueError, KeyError) as err:
            if _path_refusal(err):  # the engine refused the path: the folder is not damaged
                raise StateError(
                    f"{self.where}: Orbax refused the path {os.path.join(self.directory, ARRAYS)!r} "
                    f"({type(err).__name__}: {err}). The checkpoint is not damaged and was left in place; "
                    "nothing was restored. Pass the directory as an absolute path.",
                    key=None,
                    expected="a path Orbax accepts (absolute)",
                    received=os.path.join(self.directory, ARRAYS),
                ) from err
            unreadable = []
            if len(wanted) > 1:  # which arrays: each read alone (only when a read failed)
                for one in wanted:
                    try:
                        self._restore([one])
                    except (OSError, ValueError, KeyError) as one_err:
                        if not _path_refusal(one_err):
                            unreadable.append(one[0].key)
            keys = unreadable or [w.key for w, _ in wanted]
            raise CorruptCheckpointError(
                f"{self.where}: Orbax could not read the arrays {keys} ({type(err).__name__}: {err}); the "
                f"'{ARRAYS}' folder is damaged or incomplete. Nothing was restored. Restore from an earlier "
                "checkpoint.",
                key=keys[0] if keys else None,
                expected="readable arrays",
                received=keys,
            ) from err
        for (lazy, _), value in zip(wanted, values, strict=True):
            found = (tuple(np.shape(value)), dtype_name(value))
            if found != (lazy.shape, lazy.dtype.name):
                raise CorruptCheckpointError(
                    f"{self.where}: array {lazy.key} is {found[1]} of shape {found[0]} in '{ARRAYS}', but "
                    f"the sealed index says {lazy.dtype.name} of shape {lazy.shape}; the folder is "
                    "damaged or mixed with another checkpoint. Restore from an earlier checkpoint.",
                    key=lazy.key,
                    expected=(lazy.shape, lazy.dtype.name),
                    received=found,
                )
        parts = []
        for (lazy, _), value in zip(wanted, values, strict=True):
            sharded = lazy.block is not None and 0 not in lazy.shape and _processes.is_sharded(value)
            if sharded and not _held(value, lazy.shape, lazy.block):  # shards cut the saved blocks
                parts.append((_stored_hash(lazy), False))
            else:
                parts.append(_local_hash(value, lazy.key, lazy.dtype.name, lazy.block))
        every = _combine(parts)
        bad = [
            w.key
            for i, ((w, _), (_, whole)) in enumerate(zip(wanted, parts, strict=True))
            if _fails(every[:, i], whole, w.digest)
        ]
        if bad:
            raise CorruptCheckpointError(
                f"{self.where}: arrays {bad} fail their hash: their bytes in '{ARRAYS}' are not the ones "
                "saved (damaged, or replaced). Nothing was restored. Restore from an earlier checkpoint.",
                key=bad[0],
                expected="the saved hash",
                received="another hash",
            )
        return values


def open_source(directory: str, where: str) -> _Source:
    """The array source of the ``.orbax`` folder ``directory`` (``where``: as messages name
    it), which a restore passes to `keras_stable_state.format.orbax_file` (through
    ``keras_stable_state._engines.read``).

    Raises:
        StateError: if orbax-checkpoint is not installed.
    """
    _ocp()
    return _Source(directory, where)


def read(path: str) -> StateRecord:
    """Read the sealed record of the ``.orbax`` directory ``path``; its arrays are `OrbaxArray`,
    read through this engine (`keras_stable_state.format.orbax_file.read_orbax`).

    Raises:
        FileNotFoundError: if there is no such directory.
        CheckpointFormatError: if ``path`` is not a ``.orbax`` training-state directory.
        CorruptCheckpointError: if ``state.h5`` fails its checks (its xxh3-128 seal,
            its records' and arrays' xxh3-64) or its index is malformed.
        NewerFormatError: if its index version is above the newest this version reads.
        StateError: if orbax-checkpoint is not installed.

    A relative ``path`` is read from the current directory: its arrays are read through
    its absolute path (Orbax refuses a relative one); messages name ``path`` as given.
    """
    return orbax_file.read_orbax(path, open_source)
