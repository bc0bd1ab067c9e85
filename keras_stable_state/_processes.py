"""Several JAX processes (``jax.distributed``): who writes, gathering and placing arrays.

On the TensorFlow and PyTorch backends, and on JAX with one process, every
function here is the one-process case (no collective is run). With several JAX
processes every function that gathers or agrees is a collective: every process
must call it, in the same order, as ``jax.experimental.multihost_utils``
requires.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_stable_state.errors import StateError


def _jax():
    if keras.backend.backend() != "jax":
        return None
    import jax

    return jax


def process_count() -> int:
    """The number of JAX processes (``jax.process_count()``); 1 on other backends."""
    jax = _jax()
    return 1 if jax is None else jax.process_count()


def process_index() -> int:
    """This process' index (``jax.process_index()``); 0 on other backends."""
    jax = _jax()
    return 0 if jax is None else jax.process_index()


def is_sharded(value) -> bool:
    """Whether ``value`` is a ``jax.Array`` with shards on more than one device."""
    jax = _jax()
    return jax is not None and isinstance(value, jax.Array) and len(value.sharding.device_set) > 1


def gather(value) -> np.ndarray:
    """The whole of a JAX array as NumPy, on every process.

    An array that this process holds whole (one process, or replicated on its
    devices) is copied to the host; otherwise every process takes part in
    ``multihost_utils.process_allgather`` (a collective).
    """
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def place(variable, array):
    """``array`` put on ``variable``'s current sharding, each process building only its own shards.

    On backends other than JAX, for an unsharded variable, or for a value that
    is already a ``jax.Array`` (placed by the Orbax engine), ``array`` is
    returned as it is and ``variable.assign`` places it.
    """
    jax = _jax()
    if jax is None or isinstance(array, jax.Array):
        return array
    current = getattr(variable, "value", None)
    if not is_sharded(current):
        return array
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, current.sharding, lambda index: host[index])


def run_on_primary(what: str, write):
    """Call ``write()`` on process 0 only; every process returns once it is done.

    The other processes wait for process 0's outcome (a broadcast, so also a
    barrier): if it failed there, process 0 re-raises its error and the others
    raise a [`StateError`][keras_stable_state.StateError] saying so.

    Args:
        what: The file written, for the message.
        write: A callable doing the write.

    Raises:
        StateError: on processes other than 0, when the write failed on process 0.
        Exception: on process 0, whatever ``write`` raised.
    """
    if process_count() == 1:
        return write()
    from jax.experimental import multihost_utils

    failure = None
    result = None
    if process_index() == 0:
        try:
            result = write()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others heard of it
            failure = err
    ok = int(multihost_utils.broadcast_one_to_all(np.int32(failure is None)))
    if failure is not None:
        raise failure
    if not ok:
        raise StateError(
            f"Process 0 failed to write {what!r} (its error is raised there); nothing was written by this "
            f"process ({process_index()}), which only gathers arrays for process 0. Fix the error that "
            "process 0 reports and save again.",
            key=None,
            expected="a write on process 0",
            received="a failure on process 0",
        )
    return result


def any_process(flag: bool, step: int, what: str) -> bool:
    """Whether ``flag`` is true on any process, every process asking at the same ``step``.

    With one process this is ``bool(flag)`` (no collective). With several JAX processes every
    process gathers every process' ``(flag, step)`` (``multihost_utils.process_allgather``, a
    collective: every process calls it at each step, in the same order) and decides with
    `agree`.

    Raises:
        StateError: if the processes asked at different steps (see `agree`).
    """
    if process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    mine = np.array([int(bool(flag)), int(step) % (2**31 - 1)], dtype=np.int32)
    return agree(np.asarray(multihost_utils.process_allgather(mine)), what)


def agree(table, what: str) -> bool:
    """The decision of `any_process` from its gathered table, one row ``(flag, step)``
    per process (row ``i``: process ``i``): whether any flag is set.

    Raises:
        StateError: if the rows hold different steps: the processes do not run in step (one
            skipped a call), so they could not save at one step. ``what`` names the caller.
    """
    rows = np.asarray(table).reshape(-1, 2)
    steps = {int(i): int(s) for i, s in enumerate(rows[:, 1])}
    if len(set(steps.values())) > 1:
        raise StateError(
            f"{what}: the processes asked at different steps ({steps}, process: step), so they "
            "cannot agree on one step to save and stop at. Call it on every process at every "
            "step, with the same step number.",
            key=None,
            expected="one step on every process",
            received=steps,
        )
    return bool(rows[:, 0].any())


def share_from_primary(what: str, compute):
    """``compute()`` run on process 0 only, its result (JSON values) returned on every process.

    As `run_on_primary` (the others wait; a failure on process 0 is raised there and
    a [`StateError`][keras_stable_state.StateError] on the others), then the result is broadcast to all.
    """
    result = run_on_primary(what, compute)
    if process_count() == 1:
        return result
    import json

    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(result).encode("utf-8"), dtype=np.uint8) if process_index() == 0 else None
    size = int(multihost_utils.broadcast_one_to_all(np.int32(0 if data is None else data.size)))
    buffer = np.zeros(size, dtype=np.uint8) if data is None else data
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes().decode("utf-8"))


def gather_ints(value: int) -> list:
    """``value`` of every process, by process index (a collective; ``[value]`` with one)."""
    if process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(value))).reshape(-1)]
