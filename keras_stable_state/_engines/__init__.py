"""Where the bytes go: the engines that write a training state other than as one file
written in the calling thread (by `keras_stable_state.format.write_record`).

* `orbax`: a ``.orbax`` folder, its arrays an Orbax checkpoint (every JAX process its own
  shards). `folder_engine` gives it for a ``.orbax`` path, so that the restore core
  and ``save_training_state`` never import it: importing this package supplies
  ``format``'s ``.orbax`` reader with its array source (`orbax.open_source`: the arrays
  read with Orbax onto each variable's current sharding), so that
  `keras_stable_state.format.read_file` reads a ``.orbax`` folder for a restore as it
  reads any other layout.
* `background`: a file written in another thread (``blocking=False``).
"""

from __future__ import annotations

from types import ModuleType

from keras_stable_state._engines import orbax as _orbax
from keras_stable_state.format import orbax_file, orbax_layout

orbax_file.supply_arrays(_orbax.open_source)


def folder_engine(path: object) -> ModuleType | None:
    """The engine that writes ``path`` as a folder of its own: the Orbax engine (`orbax`:
    ``check_installed``, ``live_value``, ``write``) for a path named ``*.orbax``, else
    ``None`` (a file)."""
    return _orbax if orbax_layout.is_orbax_path(path) else None
