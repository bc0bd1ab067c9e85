"""The ``keras-stable-state`` command line: ``inspect``, ``verify`` and ``diff`` checkpoints, ``ls`` directories.

Also run as ``python -m keras_stable_state``. It reads training-state files
written by [`keras_stable_state.save_training_state`][keras_stable_state.save_training_state] (``.keras`` archives,
``.h5`` files and ``.orbax`` folders, whose arrays are read with TensorStore, without
Orbax), stock Keras ``.keras`` / ``.weights.h5`` files, and lists the checkpoint
directories of ``StableCheckpoint`` and ``CheckpointManager`` (`list_directory`). Arrays
are read one at a time, on demand: ``inspect`` reads none, ``verify`` and
``diff`` read each once.

Output is a rich table view on a terminal and plain, aligned text without
escape codes when piped; ``--json`` prints one JSON document instead, the
``to_json()`` of the dataclass the command's data function returns. Progress
bars appear on stderr for large files, and only on a terminal.

Exit codes (see `main`): ``0`` done (``verify``: every array is intact;
``diff``: the states are equal within ``--atol``); ``1`` ``verify`` found damage,
``diff`` found the states different; ``2`` usage error, or a path that cannot be
used (missing, not a checkpoint file, unreadable, in use; for ``inspect``, ``diff``
and ``ls`` also a damaged file); ``3`` a file written by a newer keras_stable_state
(not damaged: upgrade to read it). A refusal is printed once: one line on stderr, or
with ``--json`` a ``{"error": {...}}`` document on stdout.

The same findings are available without printing: `inspect_file`,
`verify_file` and `diff_files` take a path and return dataclasses
(`RecordInspection` / `StockInspection`, `Verification`,
`Diff`).

Parts: `app` (``argparse``, exit codes),
`data` and `diff`
(what the commands find), `results` (the
dataclasses), `render` and
`output` (text). Files are read through
`keras_stable_state.format` (h5py, NumPy, xxhash). Nothing here imports
Keras or a backend; importing this package imports only ``argparse`` and
`keras_stable_state.errors` until a data name is first used or a command
runs (then NumPy and h5py load), so ``--help`` is quick.
"""

from keras_stable_state.cli.app import EXIT_DAMAGED, EXIT_DIFFERENT, EXIT_ERROR, EXIT_NEWER, EXIT_OK, main

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_DIFFERENT",
    "EXIT_ERROR",
    "EXIT_NEWER",
    "EXIT_OK",
    "ArrayInfo",
    "Damage",
    "CheckpointRow",
    "Diff",
    "Listing",
    "RecordInspection",
    "SectionDiff",
    "StockInspection",
    "VariableInfo",
    "Verification",
    "diff_files",
    "inspect_file",
    "list_directory",
    "main",
    "max_abs_difference",
    "verify_file",
]

# name -> submodule defining it; loaded on first use (PEP 562), so that importing the
# package (and `--help`) does not load NumPy or h5py.
_LAZY = {
    "ArrayInfo": "results",
    "Damage": "results",
    "RecordInspection": "results",
    "StockInspection": "results",
    "VariableInfo": "results",
    "Verification": "results",
    "CheckpointRow": "listing",
    "Listing": "listing",
    "list_directory": "listing",
    "Diff": "diff",
    "SectionDiff": "diff",
    "diff_files": "diff",
    "inspect_file": "data",
    "max_abs_difference": "data",
    "verify_file": "data",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
