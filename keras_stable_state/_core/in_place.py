"""The in-place restore: arrays of a file proven whole read straight into their variables,
with no copy of the values they replace, and the mark a model keeps when one fails part way.

Used where the live values are worth nothing (``restore_training_state(...,
all_or_nothing=False)``; ``StableCheckpoint`` resuming into the model ``fit`` has just
built): the file was proven whole first (its seal: `keras_stable_state.format.proven`),
so what can still fail is the read of an array (an I/O error, the file changed in place
under the reader, or an array's own checksum in a file sealed again over changed bytes).
Then the variables already assigned cannot be put back; the restore raises a
``CorruptCheckpointError`` (the file) or ``StateError`` (anything else) naming them and
marks the model (`mark_partial`): ``fit`` and ``save_training_state`` refuse it until a
restore into it succeeds (`clear_partial`). The all-or-nothing restore of a model on an
accelerator reads the same way, with each replaced value copied to the host first and put
back on failure instead of the mark (`keras_stable_state._core.host_rollback`).

Per backend: on Torch a CPU parameter of the array's dtype is read into in place (its own
memory: no allocation, its version counter bumped as an in-place ``copy_`` would); any
other variable gets the all-or-nothing restore's assignment one variable at a time
(`keras_stable_state._core.apply.variable_step`: the array is read into new 64-byte
aligned host memory, its old value dropped as the next is read); on TensorFlow a plain
variable is read through one reused host buffer the size of the largest array and copied
into its own buffer (`_tf_assign`); on JAX, whose arrays are immutable, each array is read
into one of two reused host buffers the size of the largest array and copied into a new
array of JAX's own (`_JaxPlacer`), replacing the old arrays one by one as stock
``load_weights`` does; an array the placer does not take (a sharded variable, another
dtype) gets the all-or-nothing restore's step, its new aligned host memory used by the new
JAX array as its own. At most one variable's worth of new memory (two buffers on JAX) is
held at a time.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_stable_state import _keras_compat, _processes
from keras_stable_state._core.apply import variable_step
from keras_stable_state.errors import CorruptCheckpointError, StateError, shown
from keras_stable_state.format.proven import DEFER_ABOVE
from keras_stable_state.format.sandbox import aligned_empty

# Dtypes TensorFlow takes from host memory through DLPack (not bool)
_TF_SHARED = frozenset(np.dtype(n) for n in ("float16", "float32", "int8", "int16", "int32", "uint8"))
# Dtypes JAX places from a host array as they are
_JAX_NATIVE = _TF_SHARED | {np.dtype("bool")}

__all__ = [
    "assign_in_place",
    "check_not_partial",
    "clear_partial",
    "mark_partial",
    "partial_reason",
    "put_back_or_mark",
]

_MARK = "_kss_partial_restore"  # the model attribute holding the reason, while marked
_SAVED = "_kss_make_train_function_before_mark"
_REFUSING = "make_train_function"  # fit and train_on_batch call it first, before touching the variables


def _name(var: Any) -> str:
    return str(getattr(var, "path", None) or var.name)


def _torch_target(var: Any, array: Any) -> np.ndarray | None:
    """The host memory of ``var``'s Torch parameter as a writable NumPy view, when ``array``
    can be read into it as it is (CPU, contiguous, same dtype and size, and ``assign`` would
    only copy onto that memory: `compat.torch_swap_is_assign`); else ``None``."""
    param = _keras_compat.variable_storage(var)
    if param.device.type != "cpu" or not param.is_contiguous() or not _keras_compat.torch_swap_is_assign(var):
        return None
    data = param.data
    try:
        host = data.numpy()
    except (TypeError, RuntimeError):  # bfloat16 and other dtypes NumPy has not
        return None
    if host.dtype != array.dtype or host.nbytes != array.nbytes or tuple(host.shape) != tuple(array.shape):
        return None
    return host


def _tf_assign(var: Any, array: Any, scratch: np.ndarray) -> bool:
    """On TensorFlow, read ``array`` into ``scratch`` (64-byte aligned host memory reused for
    every variable) and copy it into the variable's own buffer with
    ``ResourceStridedSliceAssign`` over the whole variable. ``AssignVariableOp`` would
    instead adopt a DLPack value's buffer (measured: two variables assigned from one buffer
    in turn then share it), and a value of TensorFlow's own memory costs a new buffer per
    variable, which TensorFlow's allocator keeps once freed. ``False`` (nothing done) where
    that is not the plain case: not a plain resource variable, another dtype, a dtype DLPack
    does not hand over, or no elements."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_array_ops

    resource = _keras_compat.tf_plain_resource(var)
    if (
        resource is None
        or array.dtype not in _TF_SHARED
        or not array.nbytes
        or not array.ndim
        or resource.dtype.as_numpy_dtype != array.dtype
    ):
        return False
    host = scratch[: array.nbytes].view(array.dtype).reshape(array.shape)
    array.read_into(host)
    gen_array_ops.resource_strided_slice_assign(
        ref=resource.handle,
        begin=[0] * array.ndim,
        end=list(array.shape),
        strides=[1] * array.ndim,
        value=tf.experimental.dlpack.from_dlpack(host.__dlpack__()),
    )
    return True


# On JAX the reused buffers start this many bytes past a multiple of 64: JAX 0.10 on the CPU
# uses a 64-byte aligned host array's memory as the new array's own even with
# may_alias=False, which the next read into the buffer would overwrite; from any other
# address it copies into memory of its own.
_JAX_OFFSET = 16


# On JAX, arrays of this many bytes or more go through `_JaxPlacer`: every array an in-place
# restore reads (`FileArray`s are `DEFER_ABOVE` bytes or more). Read into new host memory
# instead (the all-or-nothing restore's step), each array's pages are new to the process in
# a fresh one (page faults at a fraction of copy speed) and faulted in on the restore's own
# thread, inside the read; through the placer they are faulted in by JAX's copies, on JAX's
# thread, while the next array is read and checked. Measured 2026-12-07 at 120 MB
# (arrays of about 5 MB), fresh processes (the resume a user does), 7 and 9 interleaved
# rounds: new host memory / the placer 1.11x and 1.43x (stock load_weights / itself, A/A:
# 0.81x and 1.12x); one warm process, 15 rounds: 1.015x (A/A 1.07x); extra peak memory 107
# against 111 MB. At 1 GB (arrays of about 42 MB) on 2026-12-06: the placer 0.94x stock,
# new host memory 3.0x.
_JAX_COPY_ABOVE = DEFER_ABOVE


def jax_placer(arrays: list) -> _JaxPlacer | None:
    """A `_JaxPlacer` for the arrays of ``arrays`` of `_JAX_COPY_ABOVE` bytes or more; ``None``
    where there are none."""
    large = [a.nbytes for a in arrays if a.nbytes >= _JAX_COPY_ABOVE]
    return _JaxPlacer(max(large)) if large else None


class _JaxPlacer:
    """On JAX: each array of `_JAX_COPY_ABOVE` bytes or more read into one of two reused host
    buffers (`_JAX_OFFSET`) and placed with ``jax.device_put(..., may_alias=False)``, which
    copies it asynchronously, on a thread of JAX's, into new memory of JAX's own (as stock
    ``load_weights``' arrays are copied: h5py's are not 64-byte aligned); a buffer is read into
    again only once the copy out of it is done (``block_until_ready``), so the read and check
    of one array overlap the copy of the other. JAX's CPU allocator gives every new array
    pages new to the process whether or not a dropped array was freed first (measured
    2026-12-07: one page fault per 4 KiB page of every copy, 1,280 for 5 MiB, 10,753 for
    42 MiB): those faults are paid on JAX's thread, beside the reads. Measured 2026-12-06 in fresh processes
    (``benchmarks/memory.py``, package loaded first), against stock ``load_weights``: at 1 GB
    (arrays of about 42 MB) 0.94x, where a new host array per variable took 3.0x; at 120 MB
    (arrays of about 5 MB) 1.10x, where a new host array per variable took 0.87x, which the
    longer runs of 2026-12-07 reversed (see `_JAX_COPY_ABOVE`)."""

    def __init__(self, nbytes: int) -> None:
        self.buffers = [aligned_empty((_JAX_OFFSET + nbytes,), np.uint8) for _ in range(2)]
        self.pending: list[Any] = [None, None]
        self.turn = 0

    def assign(self, var: Any, array: Any) -> bool:
        """Read ``array`` and place it into ``var``; ``False`` (nothing done) for an array under
        `_JAX_COPY_ABOVE` bytes, a variable sharded over several devices or of another dtype,
        or a dtype JAX does not place as it is."""
        import jax

        value = getattr(var, "value", None)
        if (
            not isinstance(value, jax.Array)
            or array.nbytes < _JAX_COPY_ABOVE
            or _processes.is_sharded(value)
            or np.dtype(value.dtype) != array.dtype
            or array.dtype not in _JAX_NATIVE
        ):
            return False
        turn, self.turn = self.turn, 1 - self.turn
        if self.pending[turn] is not None:
            self.pending[turn].block_until_ready()
            self.pending[turn] = None
        buffer = self.buffers[turn][_JAX_OFFSET : _JAX_OFFSET + array.nbytes]
        host = buffer.view(array.dtype).reshape(array.shape)
        array.read_into(host)
        placed = jax.device_put(host, value.sharding, may_alias=False)
        var.assign(placed)
        self.pending[turn] = placed
        return True

    def finish(self) -> None:
        """Wait for the copies still running (the buffers may then go)."""
        for placed in self.pending:
            if placed is not None:
                placed.block_until_ready()
        self.pending = [None, None]


def _assign_one(var: Any, array: Any, scratch: np.ndarray | None, placer: _JaxPlacer | None) -> None:
    backend = keras.backend.backend()
    if backend == "torch":
        host = _torch_target(var, array)
        if host is not None:
            import torch

            array.read_into(host)
            torch.autograd.graph.increment_version(_keras_compat.variable_storage(var))
            return
    if backend == "tensorflow" and scratch is not None and _tf_assign(var, array, scratch):
        return
    if placer is not None and placer.assign(var, array):
        return
    step = variable_step(var, np.asarray(array), owned=True)  # new aligned memory, read and checked
    step.snapshot()  # converts for the variable; the old value it keeps is dropped below
    step.apply()


def assign_in_place(pairs: list, model: Any, where: str, rollback: Any = None) -> None:
    """Read each ``(variable, FileArray)`` of ``pairs`` into its variable, in order.

    With ``rollback`` (a `keras_stable_state._core.host_rollback.HostRollback`), each
    variable's value is copied into host memory just before it is assigned, and a failure
    puts every copied value back before its error goes on (nothing is marked); a value
    that cannot be put back marks the model and raises ``StateError`` naming it.

    Raises:
        CorruptCheckpointError: if the file changed on disk since it was proven whole (or a
            read of it fails, or an array fails its own checksum): naming the array's key
            and the variables already assigned (which keep their new values); ``model`` is
            marked (`mark_partial`). A directory of checkpoints moves such a file aside and
            restores the next older one. With ``rollback``: the error as raised, after every
            value was put back (nothing marked).
        StateError: if an assignment fails otherwise, naming the variable, the error and the
            variables already assigned; ``model`` is marked. With ``rollback``: the error as
            raised once every value was put back, or a ``StateError`` naming a value that
            could not be (``model`` marked).
    """
    done: list[str] = []
    backend = keras.backend.backend()
    largest = max(array.nbytes for _, array in pairs)
    scratch = aligned_empty((largest,), np.uint8) if backend == "tensorflow" else None
    placer = jax_placer([array for _, array in pairs]) if backend == "jax" else None
    try:
        _assign_all(pairs, model, where, done, scratch, placer, rollback)
    finally:
        if placer is not None:
            placer.finish()


def _assign_all(
    pairs: list, model: Any, where: str, done: list, scratch: Any, placer: Any, rollback: Any
) -> None:
    for var, array in pairs:
        try:
            if rollback is not None:
                rollback.keep(var)
            _assign_one(var, array, scratch, placer)
        except BaseException as err:
            if rollback is not None:
                if placer is not None:
                    placer.finish()
                put_back_or_mark(rollback, model, where, err)
                raise
            if isinstance(err, KeyboardInterrupt | SystemExit) and not done:
                raise
            reason = (
                f"restoring {where} in place failed at {_name(var)} ({type(err).__name__}: {err}) after the "
                f"file was proven whole; {len(done)} variable(s) were already assigned"
                + (f" ({shown(done)})" if done else "")
                + " and an in-place restore keeps no copy of the values it replaces"
            )
            mark_partial(model, reason)
            tail = (
                ". The model is marked: fit and save_training_state refuse it until a restore into it "
                "succeeds. Restore an older checkpoint (or this one again, once it is whole), or rebuild "
                "the model."
            )
            if isinstance(err, CorruptCheckpointError):  # the file changed: damaged, as a directory sees it
                raise CorruptCheckpointError(
                    f"Model {model.name!r}: {reason}{tail}",
                    key=err.key,
                    expected=err.expected,
                    received=err.received,
                ) from err
            raise StateError(
                f"Model {model.name!r}: {reason}{tail}",
                key=_name(var),
                expected="every variable assigned",
                received=f"{len(done)} assigned",
            ) from err
        done.append(_name(var))


def put_back_or_mark(rollback: Any, model: Any, where: str, err: BaseException) -> None:
    """Put back the values ``rollback`` kept (a restore failed with ``err``); return if every
    one was put back (the caller raises ``err``).

    Raises:
        StateError: naming the variables that could not be put back; ``model`` is marked.
    """
    failed = rollback.put_back()
    if not failed:
        return
    reason = (
        f"restoring {where} failed ({type(err).__name__}: {err}), and putting back the values from "
        f"before the restore failed for {shown(failed)}"
    )
    mark_partial(model, reason)
    raise StateError(
        f"Model {model.name!r}: {reason}. The model is marked: fit and save_training_state refuse it "
        "until a restore into it succeeds.",
        key=failed[0].split(" ", 1)[0],
    ) from err


def partial_reason(model: Any) -> str | None:
    """Why ``model`` is marked (`mark_partial`), or ``None``."""
    return getattr(model, _MARK, None)


def mark_partial(model: Any, reason: str) -> None:
    """Mark ``model`` as partly restored: ``fit`` and ``train_on_batch`` refuse to train it (its
    ``make_train_function``, which they call before anything else, raises a ``StateError``
    with ``reason``: before JAX's ``fit`` moves the variables' values into its own state),
    and `check_not_partial` refuses it, until `clear_partial`."""
    if partial_reason(model) is None:
        object.__setattr__(model, _SAVED, model.__dict__.get(_REFUSING))

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise StateError(
            f"Model {model.name!r} is partly restored and cannot be trained: {reason}. Restore a "
            "checkpoint into it (or rebuild it) first.",
            key=None,
            expected="a model restored whole",
            received="a partly restored model",
        )

    object.__setattr__(model, _MARK, reason)
    object.__setattr__(model, _REFUSING, refused)


def clear_partial(model: Any) -> None:
    """Lift `mark_partial` (a restore into ``model`` succeeded)."""
    if partial_reason(model) is None:
        return
    before = model.__dict__.pop(_SAVED, None)
    model.__dict__.pop(_MARK, None)
    model.__dict__.pop(_REFUSING, None)
    if before is not None:
        object.__setattr__(model, _REFUSING, before)


def check_not_partial(model: Any, verb: str) -> None:
    """Raise unless ``model`` is whole.

    Raises:
        StateError: if ``model`` is marked partly restored (`mark_partial`), naming why.
    """
    reason = partial_reason(model)
    if reason is not None:
        raise StateError(
            f"{verb}: model {model.name!r} is partly restored ({reason}); its state is neither the saved "
            "one nor the one before. Restore a checkpoint into it (or rebuild it) first.",
            key=None,
            expected="a model restored whole",
            received="a partly restored model",
        )
