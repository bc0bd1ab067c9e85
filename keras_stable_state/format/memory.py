"""Running out of memory, told apart from damage: `out_of_memory` recognises the
allocation failures of Python, NumPy, h5py and the backends (by the error's class name and
message: this module imports no Keras and no backend), and `memory_refusal` is the
[`StateError`][keras_stable_state.StateError] a restore raises for one.

The reader lets these errors through unchanged (a file that could not be read for want
of memory is not damaged, and must not be moved aside as unreadable); the restore core
turns them into `memory_refusal`, once nothing is changed.

This module imports no Keras.
"""

from __future__ import annotations

import errno

from keras_stable_state.errors import StateError

__all__ = ["out_of_memory", "memory_refusal"]

# Classes that mean "an allocation failed": Python's MemoryError (NumPy's
# _ArrayMemoryError is one), torch.OutOfMemoryError (CUDA and CPU), TensorFlow's
# ResourceExhaustedError.
_OOM_CLASSES = frozenset({"MemoryError", "OutOfMemoryError", "ResourceExhaustedError"})
# Classes whose message says what ran out: XLA's runtime errors (RESOURCE_EXHAUSTED),
# Torch's RuntimeError from its CPU allocator, h5py's OSError, a thread that cannot start.
_OOM_TEXT = (
    "resource_exhausted",
    "resource exhausted",
    "out of memory",
    "not enough memory",
    "can't allocate memory",
    "cannot allocate memory",
    "memory allocation failed",
    "unable to allocate",
    "std::bad_alloc",
    "oom when allocating",
    "can't start new thread",
)
_MESSAGE_LIMIT = 240


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is a failed allocation.

    A [`StateError`][keras_stable_state.StateError] never is: it already says what
    happened.
    """
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, StateError):
            return False
        if isinstance(err, MemoryError):
            return True
        names = {cls.__name__ for cls in type(err).__mro__}
        if names & _OOM_CLASSES:
            return True
        if isinstance(err, OSError) and err.errno == errno.ENOMEM:
            return True
        if (
            isinstance(err, RuntimeError | OSError | ValueError)
            or "XlaRuntimeError" in names
            or ("JaxRuntimeError" in names)
        ):
            text = str(err).lower()
            if any(fragment in text for fragment in _OOM_TEXT):
                return True
        err = err.__cause__
        seen += 1
    return False


def memory_refusal(where: str, err: BaseException) -> StateError:
    """The [`StateError`][keras_stable_state.StateError] of a restore of ``where`` that ran
    out of memory (``err``), raised once nothing is changed."""
    said = " ".join(str(err).split())
    if len(said) > _MESSAGE_LIMIT:
        said = said[: _MESSAGE_LIMIT - 3] + "..."
    return StateError(
        f"Restoring {where} ran out of memory ({type(err).__name__}: {said}). Nothing was changed: every "
        "model and optimizer variable and the rest of the training state are as they were before the "
        "call. The file is not known to be damaged. Free memory (or raise the process's memory limit, "
        "e.g. `ulimit -v`) and restore again; a restore needs two to four times the state's size "
        "in free memory besides the model (TensorFlow the most).",
        key=None,
        expected="memory for the restore",
        received=type(err).__name__,
    )
