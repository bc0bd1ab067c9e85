"""A directory of checkpoints for any training loop: [`CheckpointManager`][keras_stable_state.CheckpointManager] (``manager``,
its lock methods in ``holder``, its restores in ``restoring``), what it keeps and calls best
(``policy``), what it records (``records``), and the directory itself, one protocol for both
kinds (``protocols``): listing, pruning, temporary files, unreadable files moved aside and the
fallback over them (``directory``), its lock file (``lock``), the same in an object store
(``remote_directory``), ``.orbax`` step directories (``orbax_steps``; what needs the Orbax
engine: ``orbax_io``), several processes (``shared``, ``checkin``) and preemption signals
(``preemption``).

``directory``, ``remote_directory``, ``lock``, ``protocols``, ``policy``, ``records`` and
``orbax_steps`` import no Keras, and the names below load on first use
(PEP 562), so that the command line (``keras-stable-state ls``) lists a directory with the
manager's own rules without importing Keras."""

import importlib

from keras_stable_state._manager.directory import LOCK_NAME, UNREADABLE_DIR

__all__ = ["LOCK_NAME", "UNREADABLE_DIR", "CheckpointManager", "CheckpointMetadata", "wait_for_earlier_saves"]

_LAZY = {"CheckpointManager": "manager", "CheckpointMetadata": "manager", "wait_for_earlier_saves": "manager"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
