"""The one engine a save writes through, and the one door a restore reads through.

`save_engine` picks, from the path and ``blocking``, the engine that writes a save's
`WriteRequest` (each has ``live_value``, how it takes a variable's value, and ``write``):
the Orbax engine for a ``.orbax`` folder, the background engine for ``blocking=False``,
else the file engine (a local file, or an object uploaded whole). `read` reads a
training state for a restore: an object store's object fetched whole and read from memory,
a ``.orbax`` folder's arrays through the Orbax engine's array source, every layout through
`keras_stable_state.format`'s readers.
"""

from __future__ import annotations

from types import ModuleType

from keras_stable_state import _processes
from keras_stable_state._engines import background, files, orbax
from keras_stable_state._engines.object_store import RemotePath
from keras_stable_state.errors import CheckpointFormatError, StateError
from keras_stable_state.format import orbax_layout, proven
from keras_stable_state.format.layout import read_file
from keras_stable_state.format.reader import read_bytes
from keras_stable_state.format.record import StateRecord
from keras_stable_state.format.stock import StockWeights

__all__ = ["read", "save_engine"]


def save_engine(path: str, *, blocking: bool) -> ModuleType:
    """The engine that writes ``path``: `orbax` for a ``*.orbax`` path (orbax-checkpoint
    installed), `background` for ``blocking=False``, else `files`.

    Raises:
        StateError: if orbax-checkpoint is not installed (a ``.orbax`` path), or for
            ``blocking=False`` with several processes.
        CheckpointFormatError: for a ``.orbax`` path with ``blocking=False``.
    """
    if orbax_layout.is_orbax_path(path):
        orbax.check_installed()
        if not blocking:
            raise CheckpointFormatError(
                f"Cannot save {path!r} with blocking=False: the '.orbax' engine writes in the calling "
                "thread. Pass blocking=True, or save to a '.h5' / '.keras' path in the background.",
                expected="blocking=True for a '.orbax' path",
                received="blocking=False",
            )
        return orbax
    if blocking:
        return files
    if _processes.process_count() > 1:
        raise StateError(
            f"Cannot save {path!r} with blocking=False with {_processes.process_count()} "
            f"{_processes.runtime()} processes: the save runs collectives on the calling thread. Pass "
            "blocking=True (CheckpointManager: save_on_background=False)."
        )
    return background


def read(
    path: str, store: RemotePath | None, *, in_place: bool, unaligned_views: bool = True
) -> StateRecord | StockWeights:
    """The training state at ``path``, read with every check, once a background save of this
    process into its folder has ended (as Orbax's ``AsyncCheckpointer.restore`` waits: the
    file read is the last one saved, not a race).

    An object (``store``) is fetched whole and read from memory (`read_bytes`, naming its
    URL); a ``.orbax`` folder's arrays are read on demand through the Orbax engine's array
    source (onto each variable's sharding); with ``in_place`` a local sealed record's large
    arrays are left in the open file (`proven.read_proven`), else every array is read
    (`read_file`; ``unaligned_views`` as there).

    Raises:
        The errors of `keras_stable_state.format.read_file` and of the store.
    """
    background.wait_for_folder(background.folder_of(path))
    if store is not None:
        return read_bytes(store.read_bytes(), path, unaligned_views=unaligned_views or in_place)
    arrays = orbax.open_source if orbax_layout.is_orbax_path(path) else None
    if in_place:
        return proven.read_proven(path, arrays=arrays)
    return read_file(path, unaligned_views=unaligned_views, arrays=arrays)
