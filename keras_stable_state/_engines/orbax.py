"""Orbax as the storage engine of a ``.orbax`` training-state directory.

A path ending in ``.orbax`` is a directory::

    run.orbax/
        state.h5     our sealed record (format 3, written by
                     :func:`keras_stable_state.format.write_record`; see
                     ``docs/concepts/file-format.md``): metadata, contract,
                     other state and its small arrays, and in
                     ``metadata["orbax"]`` the index of the arrays below
        arrays/      an Orbax PyTree checkpoint (``orbax.checkpoint``) of every
                     model and optimizer array, ``{"model": {"0": ...},
                     "optimizer": {"0": ...}}``, numbered as in the index

The index lists ``[section, key, name, shape, dtype, hash]`` per array: our
stable key, the Orbax leaf name and a 64-bit position-keyed hash of its bytes.
Orbax checksums only its shard index, not the data, so each array is checked
against this hash when restored. The hash is a sum modulo 2**64 over elements
of ``mix(mix(flat_index + seed) ^ bits)``, ``mix`` being the SplitMix64
finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) and ``seed`` the CRC-32 (``zlib.crc32``) of the key,
dtype and shape (this hash is the engine's own, not the record's xxh3-64);
a sum of per-element hashes (an additive multiset hash, Bellare and Micciancio,
"A new paradigm for collision-free hashing", EUROCRYPT 1997) can be computed
shard by shard on each process and added up, so no process ever holds a whole
sharded array.

With several JAX processes each process writes only the shards it holds
(Orbax), process 0 writes ``state.h5``; on restore each process reads only the
shards of the variable's current sharding. ``orbax-checkpoint`` is imported
only here and only when a ``.orbax`` path is used.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from keras_stable_state import _processes as _multiprocess
from keras_stable_state import format as storage
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format.orbax_layout import (  # noqa: F401 (names of this engine)
    ARRAYS,
    INDEX,
    INDEX_VERSION,
    RECORD,
    SECTIONS,
    SUFFIX,
    block_hash,
    index_entries,
    is_orbax_path,
)

_MASK = (1 << 64) - 1
_SECTIONS = SECTIONS


def check_installed() -> None:
    """Raise a :class:`StateError` naming the extra to install if orbax-checkpoint is missing."""
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


# -- the hash (block_hash: format.orbax_layout) -----------------------------------------
def _shard_hashes(values: list, keys: list, dtypes: list) -> list:
    """The hash of each value (NumPy, or a JAX array summed over every process' shards)."""
    partial = []
    collective = False
    for value, key, dtype in zip(values, keys, dtypes, strict=True):
        shape = tuple(value.shape)
        if isinstance(value, np.ndarray) or not _multiprocess.is_sharded(value):
            total = block_hash(np.asarray(value), (0,) * len(shape), shape, key, dtype)
            # A whole array is hashed on every process; counted once (on process 0) when summed.
            partial.append(total if _multiprocess.process_index() == 0 else 0)
            continue
        collective = True
        total = 0
        for shard in value.addressable_shards:
            if shard.replica_id != 0:  # each block once, whichever device holds it
                continue
            start = tuple(0 if s.start is None else s.start for s in shard.index)
            total += block_hash(np.asarray(shard.data), start, shape, key, dtype)
        partial.append(total & _MASK)
    if _multiprocess.process_count() == 1 or not (collective or partial):
        return [p & _MASK for p in partial]
    from jax.experimental import multihost_utils

    halves = np.array([[p >> 32, p & 0xFFFFFFFF] for p in partial], dtype=np.uint32).reshape(-1, 2)
    every = np.asarray(multihost_utils.process_allgather(halves)).astype(np.uint64)
    sums = ((every[..., 0] << np.uint64(32)) | every[..., 1]).sum(axis=0, dtype=np.uint64)
    return [int(s) for s in sums]


# -- saving ------------------------------------------------------------------------------
def live_value(variable, to_numpy):
    """What the engine saves for ``variable``: its JAX array as it is (no gather), else NumPy."""
    value = getattr(variable, "value", variable)
    if _multiprocess.is_sharded(value):
        return value
    return to_numpy(variable)


def write(path: str, record: storage.StateRecord) -> str:
    """Write ``record`` to the ``.orbax`` directory ``path`` (every process calls this).

    ``record.model`` and ``record.optimizer`` hold NumPy arrays or sharded JAX
    arrays. The new directory is built beside ``path`` (``.<name>.kss-partial``)
    and then moved onto it; a previous directory is moved to
    ``<name>.kss-old`` first and removed last, so one of the two is whole at
    every moment.

    Raises:
        StateError: if orbax-checkpoint is not installed, or (on processes
            other than 0) if process 0 failed to write.
        CheckpointFormatError: if ``path`` is a file.
        OSError: naming the path when a write fails.
    """
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

    _multiprocess.run_on_primary(partial, clear)
    index, tree = [], {}
    # Values may be zero-argument callables (converted lazily, storage.StateRecord).
    entries = [(s, k, v() if callable(v) else v) for s in _SECTIONS for k, v in getattr(record, s).items()]
    dtypes = [storage.dtype_name(v) for _, _, v in entries]
    hashes = _shard_hashes([v for _, _, v in entries], [k for _, k, _ in entries], dtypes)
    counters = dict.fromkeys(_SECTIONS, 0)
    for (section, key, value), dtype, digest in zip(entries, dtypes, hashes, strict=True):
        leaf = str(counters[section])
        counters[section] += 1
        tree.setdefault(section, {})[leaf] = value
        index.append([section, key, leaf, list(map(int, value.shape)), dtype, f"{digest:016x}"])
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(os.path.join(partial, ARRAYS), args=ocp.args.PyTreeSave(tree))
    small = storage.StateRecord(
        metadata={**record.metadata, INDEX: {"version": INDEX_VERSION, "arrays": index}},
        contract=record.contract,
        model={},
        optimizer={},
        extra=record.extra,
        arrays=record.arrays,
    )

    def finish():
        storage.write_record(os.path.join(partial, RECORD), small)
        old = os.path.join(parent, f"{name}.kss-old")
        if os.path.isdir(old):
            shutil.rmtree(old)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(partial, final)
        if os.path.isdir(old):
            shutil.rmtree(old)

    _multiprocess.run_on_primary(path, finish)
    return path


# -- restoring ---------------------------------------------------------------------------
class OrbaxArray:
    """A saved array not read yet: its shape and dtype, read on demand.

    ``np.asarray`` reads it whole (on every process) and checks its hash;
    :func:`materialize` reads the arrays planned for variables at once, each
    process only the shards of the variable's current sharding.
    """

    def __init__(self, source, section, key, leaf, shape, dtype, digest):
        self.source, self.section, self.key, self.leaf = source, section, key, leaf
        self.shape, self.dtype, self.digest = tuple(shape), storage.numpy_dtype(dtype), digest
        self.ndim = len(self.shape)

    def __array__(self, dtype=None, copy=None):
        (value,) = self.source.load([(self, None)])
        return value if dtype is None else value.astype(dtype)

    def __float__(self):
        return float(np.asarray(self))


class _Source:
    def __init__(self, directory, where):
        self.directory, self.where = directory, where

    def load(self, wanted):
        """``[(OrbaxArray, sharding or None)]`` -> checked values (JAX arrays on a sharding, else NumPy)."""
        ocp = _ocp()
        item, args = {}, {}
        for lazy, sharding in wanted:
            item.setdefault(lazy.section, {})[lazy.leaf] = 0
            if sharding is None:
                arg = ocp.RestoreArgs(restore_type=np.ndarray)
            else:
                arg = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=lazy.shape)
            args.setdefault(lazy.section, {})[lazy.leaf] = arg
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
                restored = checkpointer.restore(
                    os.path.join(self.directory, ARRAYS),
                    args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
                )
        except (OSError, ValueError, KeyError) as err:
            raise CorruptCheckpointError(
                f"{self.where}: Orbax could not read the arrays ({type(err).__name__}: {err}); the "
                f"'{ARRAYS}' folder is damaged or incomplete. Restore from an earlier checkpoint.",
                key=wanted[0][0].key if wanted else None,
            ) from err
        values = [restored[lazy.section][lazy.leaf] for lazy, _ in wanted]
        for (lazy, _), value in zip(wanted, values, strict=True):
            found = (tuple(np.shape(value)), storage.dtype_name(value))
            if found != (lazy.shape, lazy.dtype.name):
                raise CorruptCheckpointError(
                    f"{self.where}: array {lazy.key} is {found[1]} of shape {found[0]} in '{ARRAYS}', but "
                    f"the sealed index says {lazy.dtype.name} of shape {lazy.shape}; the folder is "
                    "damaged or mixed with another checkpoint. Restore from an earlier checkpoint.",
                    key=lazy.key,
                    expected=(lazy.shape, lazy.dtype.name),
                    received=found,
                )
        hashes = _shard_hashes(values, [w.key for w, _ in wanted], [w.dtype.name for w, _ in wanted])
        bad = [w.key for (w, _), h in zip(wanted, hashes, strict=True) if f"{h:016x}" != w.digest]
        if bad:
            raise CorruptCheckpointError(
                f"{self.where}: arrays {bad} fail their hash: their bytes in '{ARRAYS}' are not the ones "
                "saved (damaged, or replaced). Nothing was restored. Restore from an earlier checkpoint.",
                key=bad[0],
                expected="the saved hash",
                received="another hash",
            )
        return values


def read(path: str) -> storage.StateRecord:
    """Read the sealed record of the ``.orbax`` directory ``path``; its arrays are :class:`OrbaxArray`.

    Raises:
        FileNotFoundError: if there is no such directory.
        CheckpointFormatError: if ``path`` is not a ``.orbax`` training-state directory.
        CorruptCheckpointError: if ``state.h5`` fails its checks (its xxh3-128 seal,
            its records' and arrays' xxh3-64) or its index is malformed.
        StateError: if orbax-checkpoint is not installed.
    """
    _ocp()
    where = repr(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No training state at {path!r} (a '{SUFFIX}' directory).")
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, RECORD))):
        raise CheckpointFormatError(
            f"{path!r} is not a '{SUFFIX}' training state: it has no {RECORD!r} (a directory written by "
            "save_training_state holds state.h5 and arrays/). Pass the directory that "
            f"save_training_state(... '{SUFFIX}') wrote.",
            key=None,
            expected=f"a directory with {RECORD}",
            received=path,
        )
    record = storage.read_file(os.path.join(path, RECORD))
    metadata = record.metadata if isinstance(record, storage.StateRecord) else None
    entries = index_entries(metadata, where)
    source = _Source(path, where)
    for item in entries:
        section, key, leaf, shape, dtype, digest = item
        getattr(record, section)[key] = OrbaxArray(source, section, key, leaf, shape, dtype, digest)
    return record


def materialize(plan: list) -> list:
    """``[(variable, value)]`` with every :class:`OrbaxArray` read (one Orbax restore for all)
    onto its variable's current sharding; other values are left as they are."""
    wanted = [
        (i, value, getattr(getattr(var, "value", None), "sharding", None))
        for i, (var, value) in enumerate(plan)
        if isinstance(value, OrbaxArray)
    ]
    if not wanted:
        return plan
    loads = [
        (v, s if _multiprocess.is_sharded(getattr(plan[i][0], "value", None)) else None) for i, v, s in wanted
    ]
    values = wanted[0][1].source.load(loads)
    plan = list(plan)
    for (i, _, _), value in zip(wanted, values, strict=True):
        plan[i] = (plan[i][0], value)
    return plan
