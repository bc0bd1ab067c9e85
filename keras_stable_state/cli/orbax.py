"""``.orbax`` training-state directories for ``inspect``, ``verify`` and ``diff``, without Orbax.

`OrbaxState` opens ``<dir>/state.h5`` (our sealed record, read by
`keras_stable_state.format.open_file` with every check) and lists the arrays
of ``<dir>/arrays/`` from the index it seals (`keras_stable_state.format.orbax_layout`),
so ``inspect`` reads no array data and needs nothing but h5py and NumPy. ``verify`` and
``diff`` read those arrays with TensorStore (the storage library under Orbax, installed
with the ``[orbax]`` extra; neither Orbax nor JAX is imported) and check each one against
its hash in the index.
"""

from __future__ import annotations

import os

import numpy as np

from keras_stable_state import format as storage
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format import orbax_layout as layout

__all__ = ["CONTAINER", "OrbaxState", "is_orbax_state"]

CONTAINER = ".orbax directory"


def is_orbax_state(path: str) -> bool:
    """Whether ``path`` is a folder named ``*.orbax`` (a ``.orbax`` training state, or meant to be)."""
    return layout.is_orbax_path(path) and os.path.isdir(path)


def _tensorstore(where: str):
    try:
        import tensorstore
    except ImportError as err:
        raise StateError(
            f"{where}: reading the arrays of a '{layout.SUFFIX}' training state needs TensorStore, "
            f"which is not installed ({err}). Install it with pip install 'keras-stable-state[orbax]' "
            "(orbax-checkpoint brings it); `inspect` works without it.",
            expected="tensorstore installed",
            received="ImportError",
        ) from err
    return tensorstore


class OrbaxState:
    """A ``.orbax`` training state opened for reading, with the interface of
    `CheckpointFile` that the commands use
    (``entries``, ``section``, ``read``, ``check``, ``metadata``, ``contract``, ``extra``).

    Args:
        path: The ``.orbax`` directory.

    Raises:
        CheckpointFormatError: if ``path`` holds no regular ``state.h5`` (not a ``.orbax``
            training state).
        CorruptCheckpointError: if ``state.h5`` fails its checks or its index is malformed.
        NewerFormatError: if its index version is above the newest this version reads.
        The other errors of `keras_stable_state.format.open_file` for ``state.h5``.
    """

    # set by _open, as CheckpointFile has them
    members: list[tuple[str, int]]
    member: str | None
    damaged_members: list[tuple[str, str]]
    problems: list[tuple[str, str]]
    optimizer_keys: dict[str, str]
    model_class: str | None

    def __init__(self, path: str):
        self.path = path
        record = os.path.join(path, layout.RECORD)
        if not os.path.lexists(record):
            raise CheckpointFormatError(
                f"{path!r} is not a '{layout.SUFFIX}' training state: it has no {layout.RECORD!r} (a "
                f"directory written by save_training_state holds {layout.RECORD} and "
                f"{layout.ARRAYS}/). Pass the directory that save_training_state(... '{layout.SUFFIX}') "
                "wrote.",
                expected=f"a directory with {layout.RECORD}",
                received=path,
            )
        self._file = storage.open_file(record)
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _open(self):
        f = self._file
        self.kind, self.version, self.contract, self.extra = f.kind, f.version, f.contract, f.extra
        self.container, self.where = CONTAINER, repr(self.path)
        meta = dict(f.metadata) if f.kind == storage.FORMAT else None
        items = layout.index_entries(meta, self.where)
        self.metadata = {k: v for k, v in meta.items() if k != layout.INDEX}
        self.members, self.member, self.damaged_members, self.problems = [], None, [], []
        self.optimizer_keys, self.model_class = {}, None
        self._digests, self._blocks = {}, {}
        own = [e for e in f.entries if e.section not in layout.SECTIONS]
        indexed = []
        for section, key, leaf, shape, dtype, digest, block in items:
            nbytes = int(np.prod(shape, dtype=np.int64)) * storage.numpy_dtype(dtype).itemsize
            entry = storage.Entry(
                section, key, f"{layout.ARRAYS}/{section}.{leaf}", tuple(shape), dtype, nbytes
            )
            self._digests[entry.dataset], self._blocks[entry.dataset] = digest, block
            indexed.append(entry)
        self.entries = indexed + own

    def read(self, entry) -> np.ndarray:
        """Read one array and check it: the index's hash for an Orbax array, else the record's checksum.

        Raises:
            CorruptCheckpointError: naming ``entry.key`` if it cannot be read, has another
                shape or dtype than the index says, or fails its hash.
            StateError: if TensorStore is not installed (the ``[orbax]`` extra).
        """
        digest = self._digests.get(entry.dataset)
        if digest is None:
            return self._file.read(entry)
        ts = _tensorstore(self.where)
        spec = layout.store_spec(self.path, entry.dataset.split("/", 1)[1], self.where)
        try:
            value = np.asarray(ts.open(spec, open=True).result().read().result())
        except (ValueError, OSError, RuntimeError) as err:
            raise CorruptCheckpointError(
                f"{self.where}: array {entry.key!r} cannot be read from {layout.ARRAYS}/ ({err}); the "
                "folder is damaged or incomplete. Restore from an earlier checkpoint.",
                key=entry.key,
            ) from err
        found = (tuple(value.shape), storage.dtype_name(value))
        if found != (tuple(entry.shape), entry.dtype):
            raise CorruptCheckpointError(
                f"{self.where}: array {entry.key!r} is {found[1]} of shape {found[0]} in {layout.ARRAYS}/, "
                f"but the sealed index says {entry.dtype} of shape {tuple(entry.shape)}. Restore from an "
                "earlier checkpoint.",
                key=entry.key,
                expected=(tuple(entry.shape), entry.dtype),
                received=found,
            )
        block, start = self._blocks[entry.dataset], (0,) * value.ndim
        if block is None:  # index version 1
            computed = layout.element_hash(value, start, value.shape, entry.key, entry.dtype)
        else:
            computed = layout.region_hash(value, start, value.shape, block, entry.key, entry.dtype)
        computed = f"{computed:016x}"
        if computed != digest:
            raise CorruptCheckpointError(
                f"{self.where}: array {entry.key!r} fails its hash (expected {digest}, computed {computed}): "
                f"its bytes in {layout.ARRAYS}/ are not the ones saved. Restore from an earlier checkpoint.",
                key=entry.key,
                expected=digest,
                received=computed,
            )
        return value

    def check(self, progress=None) -> list:
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

    def section(self, name: str) -> list:
        return [e for e in self.entries if e.section == name]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
