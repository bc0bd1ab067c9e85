"""What a save hands to its engine: `WriteRequest`, built by ``save_training_state`` once
everything is checked and the record planned.

This module imports no Keras.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from keras_stable_state._engines.object_store import RemotePath
from keras_stable_state.format.record import StateRecord

__all__ = ["WriteRequest"]


@dataclasses.dataclass(frozen=True)
class WriteRequest:
    """One save, as an engine writes it.

    Attributes:
        path: Where: a local path (a ``file://`` URL resolved), a ``.orbax`` folder, or the
            object's URL.
        record: The training state (`StateRecord`), its arrays planned (host copies made as
            the file is written, or as the engine takes them).
        store: The object's `RemotePath` for an object-store URL, else ``None``.
        keras_archive: For a ``.keras`` path: writes Keras' own archive of the model at a
            temporary path (`keras_stable_state._engines.files.keras_archive`); else ``None``.
        started: ``time.perf_counter()`` when the save began in the calling thread.
    """

    path: str
    record: StateRecord
    store: RemotePath | None = None
    keras_archive: Callable[[str], object] | None = None
    started: float = 0.0
