"""Where the bytes go: the engines that write a training state other than as one file
written in the calling thread (by `keras_stable_state.format.write_record`).

* `orbax`: a ``.orbax`` folder, its arrays an Orbax checkpoint (every JAX process its own
  shards). `folder_engine` gives it for a ``.orbax`` path, so that the restore core
  and ``save_training_state`` never import it; `array_source` gives its array source
  (`orbax.open_source`: the arrays read with Orbax onto each variable's current
  sharding), which the restore passes to `keras_stable_state.format.read_file`, so that a
  ``.orbax`` folder is read for a restore through the one door of every layout.
* `background`: a file written in another thread (``blocking=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from keras_stable_state._engines import orbax
from keras_stable_state.format import orbax_layout


def folder_engine(path: object) -> ModuleType | None:
    """The engine that writes ``path`` as a folder of its own: the Orbax engine (`orbax`:
    ``check_installed``, ``live_value``, ``write``) for a path named ``*.orbax``, else
    ``None`` (a file)."""
    return orbax if orbax_layout.is_orbax_path(path) else None


def array_source(path: object) -> Callable[[str, str], Any] | None:
    """The array source a restore reads the ``.orbax`` folder ``path`` through (the Orbax
    engine's `orbax.open_source`: each variable's shards onto its current sharding), to pass
    to `keras_stable_state.format.read_file` as ``arrays``; ``None`` for any other path."""
    return orbax.open_source if orbax_layout.is_orbax_path(path) else None
