"""Check first, assign last: applying every step of a restore or, when one fails, putting
back every value already assigned. (Saved arrays are checked and converted for their
variables before, by `keras_stable_state._identity.dtypes.coerce`.)"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_stable_state import _keras_compat, _processes, _state
from keras_stable_state._identity.keys import file_label, malformed_key
from keras_stable_state._numpy import private_copy, to_numpy
from keras_stable_state.errors import KeyFormatError, MalformedKeyError, StateError
from keras_stable_state.format.image import aligned_copy as _aligned_copy


def _dtype(variable) -> str:
    return keras.backend.standardize_dtype(variable.dtype)


# -- assigning: all or nothing ----------------------------------------------------------
@dataclasses.dataclass
class Step:
    """One assignment of a restore. ``snapshot()`` (called for every step before the
    first step of the restore is applied) makes everything the step needs (the value
    to assign, converted; the current value, kept) and returns ``(undo, changed)``: a
    callable putting the current value back without allocating new memory where the
    backend allows it (see `variable_step`), and one telling whether the value
    differs from it now."""

    name: str
    apply: object
    snapshot: object
    nbytes: int = 0  # the bytes its snapshot allocates to convert the value (see _check_headroom)
    # JAX: ``(host array, owned)`` for `_put_on_devices` to place with every other
    # step's in one ``jax.device_put``, and the callable taking the placed array.
    host: tuple | None = None
    receive: object = None


# Dtypes every backend holds as they are (native byte order): a host array of one of
# these is handed to ``Variable.assign`` as the backend's own tensor (see _native).
_NATIVE_DTYPES = frozenset(
    np.dtype(n) for n in ("float16", "float32", "int8", "int16", "int32", "uint8", "bool")
)
# Dtypes a TensorFlow variable takes from a host array without a copy (through DLPack).
_TF_SHARED_DTYPES = _NATIVE_DTYPES - {np.dtype("bool")}
# TensorFlow's CPU kernels need a tensor's buffer at a multiple of 64 bytes (a variable
# holding a less aligned one crashes the process in its next copy kernel).
_TF_ALIGN = 64
_TO_TENSOR = {}  # backend name -> host array to tensor (imported once)


def _to_tensor_fn(backend):
    if backend == "torch":
        import torch

        # torch.from_numpy warns on read-only memory: such an array is left to ``assign``.
        return lambda value: torch.from_numpy(value) if value.flags.writeable else value
    if backend == "jax":
        import jax

        # A 64-byte aligned copy of the host array, put on the default device, where JAX uses
        # its memory (on the CPU, JAX 0.10's device_put uses a 64-byte aligned NumPy array's
        # memory even with may_alias=False, measured: never the caller's array, which the
        # caller may still change). jnp.asarray would copy, but through a jitted identity:
        # one XLA compilation per new shape and dtype, whose first one also starts XLA's
        # compile-alarm thread.
        return lambda value: jax.device_put(_aligned_copy(value), may_alias=True)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.constant  # what tf.convert_to_tensor does with a NumPy array
    return lambda value: value


def _native(value):
    """``value`` as the backend's own tensor when it is a host array of a plain dtype.

    ``Variable.assign`` converts a NumPy array itself, through Keras'
    ``convert_to_tensor`` with the variable's dtype, which costs more than the copy
    for small arrays (dtype parsing: 10-40 us per variable); a tensor of the
    variable's dtype skips it. It is the same conversion (``torch.from_numpy``,
    ``jax.device_put`` of a copy, ``tf.constant``, onto the default device); the
    shape is the variable's already (`coerce`). Anything else
    (bfloat16, 64-bit types, a read-only array on torch, a placed ``jax.Array``) is
    returned as it is, for ``assign`` to convert.
    """
    if type(value) is not np.ndarray or value.dtype not in _NATIVE_DTYPES:
        return value
    backend = keras.backend.backend()
    convert = _TO_TENSOR.get(backend)
    if convert is None:
        convert = _TO_TENSOR[backend] = _to_tensor_fn(backend)
    return convert(value)


def takes_unaligned() -> bool:
    """Whether a variable of Keras' backend can use host memory at any offset as its own
    (Torch), so that a reader's views of a file image at unaligned offsets are worth
    keeping (``unaligned_views`` of `read_file`); see
    `shareable`."""
    return keras.backend.backend() == "torch"


def shareable(array, backend=None) -> bool:
    """Whether a variable of ``backend`` (default: Keras' backend) can use the memory of
    the host array ``array`` as its own, with no copy: on Torch a writable, C-order
    NumPy array of a dtype in `_NATIVE_DTYPES`; on JAX the same with its data at a
    multiple of 64 bytes (as the reader's arrays with a dataset of their own are, over
    4 KiB: views of a 64-byte aligned file image at 64-byte offsets,
    `image`, or arrays
    `read_dataset` reads; arrays packed in a
    blob are 16-byte aligned, Keras' own datasets not at all); on the CPU, JAX then uses
    the host memory, which nothing writes afterwards; on an accelerator it copies it
    there); on TensorFlow the same, but not ``bool`` and not empty. Never on other
    backends."""
    if type(array) is not np.ndarray or array.dtype not in _NATIVE_DTYPES:
        return False
    flags = array.flags
    if not (flags.writeable and flags.c_contiguous and flags.aligned):
        return False
    backend = backend or keras.backend.backend()
    if backend == "torch":
        return True
    if backend == "tensorflow":
        return array.dtype in _TF_SHARED_DTYPES and array.size > 0 and array.ctypes.data % _TF_ALIGN == 0
    if backend == "jax":
        return array.ctypes.data % _TF_ALIGN == 0
    return False


def _prepared(var, array, owned):
    """``array`` as the value ``var.assign`` takes without converting or allocating: the
    backend's own tensor of the variable's dtype, on its device (on JAX: placed on its
    current sharding). Called for every variable before the first assignment, so that
    running out of memory here changes nothing.

    With ``owned`` (the array is the restore's alone and `shareable`), the tensor
    uses the array's memory (Torch: ``torch.from_numpy``; TensorFlow: DLPack), which the
    variable then keeps as its own: no copy on the CPU. Otherwise the tensor is a copy of
    its own (the caller's array is never shared with a variable): on TensorFlow the
    memory of a 64-byte aligned host copy
    (`aligned_copy`), handed over the same way.
    On JAX the all-or-nothing restore places a host array of a dtype in
    `_NATIVE_DTYPES` for an unsharded variable first (`_put_on_devices`, owned or
    not); what gets here (the in-place restore's arrays, one at a time) is handed to
    ``jax.device_put`` as it is where ``owned`` (and `shareable`), else as a 64-byte
    aligned copy (`_native`); any other dtype goes through Keras' conversion (a copy).
    """
    value = _processes.place(var, array)
    if type(value) is not np.ndarray:
        return value  # a placed jax.Array (sharded, or read by the Orbax engine)
    backend = keras.backend.backend()
    if backend == "tensorflow" and value.dtype in _TF_SHARED_DTYPES and value.size:
        import tensorflow as tf

        # DLPack costs 2-4 us per array against 20-70 us for tf.constant (which copies too).
        host = value if owned and shareable(value, backend) else _aligned_copy(value)
        return tf.experimental.dlpack.from_dlpack(host.__dlpack__())
    if backend == "torch" and owned and shareable(value, backend):
        import torch

        tensor = torch.from_numpy(value)
    elif backend == "jax" and owned and shareable(value, backend):
        import jax

        # The restore's own 64-byte aligned array (the in-place restore's read of one
        # array): JAX uses its memory on the CPU, with no copy (an accelerator copies it there).
        tensor = jax.device_put(value, may_alias=True)
    elif value.dtype in _NATIVE_DTYPES and (backend != "torch" or value.flags.writeable):
        tensor = _native(value)  # tf.constant (TensorFlow: bool, empty); JAX: device_put of a copy
    else:  # bfloat16, 64-bit types, a read-only array on torch: Keras' own conversion
        tensor = keras.ops.convert_to_tensor(value, dtype=_dtype(var))
    if backend == "torch":
        param = _keras_compat.variable_storage(var)
        if tensor.dtype != param.dtype:  # what assign would convert (the swap keeps the dtype)
            tensor = tensor.to(param.dtype)
        device = param.device
        if tensor.device != device:
            tensor = tensor.to(device)  # the one host-to-device copy
        elif not owned and tensor.data_ptr() == value.ctypes.data:
            tensor = tensor.clone()  # it shares the caller's array: the variable gets its own copy
    return tensor


def _kept(var):
    """The variable's current value, kept by reference for a rollback that allocates
    nothing (no copy on any backend).

    JAX arrays are immutable and ``assign`` replaces the variable's array: the old
    array itself is kept. On Torch the variable's parameter is given the new value's
    storage (`_swap`), so the old storage (its tensor, ``Parameter.data``) is
    kept as it is. On TensorFlow the kept value is a read of the variable
    (``ReadVariableOp``), which shares the variable's buffer: TensorFlow copies on
    write (an assignment gives the variable the new buffer; an in-place update such
    as ``assign_add`` or an optimizer's ``ResourceApply*`` copies a buffer still
    shared with a read first), so the read keeps the old values
    (``tests/performance/test_rollback.py`` proves it).
    """
    value = var.value
    backend = keras.backend.backend()
    if backend == "jax":
        return value
    if backend == "torch":
        return _keras_compat.variable_storage(var).data
    if backend == "tensorflow":
        read = _keras_compat.tf_read(var)  # the ReadVariableOp below, without 40-100 us of Python
        if read is not None:
            return read
        import tensorflow as tf

        return tf.convert_to_tensor(value)
    return private_copy(to_numpy(var))


def _assign(var, value) -> None:
    """``var.assign(value)`` of a value `_prepared` made (of the variable's shape,
    `coerce` checked it); on TensorFlow, with ``value`` a tensor of the variable's
    dtype, the ``AssignVariableOp`` that ``assign`` ends in, written to the variable's
    resource directly where that is all ``assign`` does (`compat.tf_plain_resource`):
    it costs about 20 us per variable instead of 120."""
    if keras.backend.backend() == "tensorflow" and type(value) is not np.ndarray:
        resource = _keras_compat.tf_plain_resource(var)
        if resource is not None and value.dtype == resource.dtype:
            from tensorflow.python.ops import gen_resource_variable_ops

            gen_resource_variable_ops.assign_variable_op(resource.handle, value)
            return
    var.assign(value)


def _swap(var, tensor):
    """On Torch: make ``tensor`` (of the variable's shape, dtype and device) the storage
    of the variable's parameter, in place of its current one. The ``Parameter``
    itself (what modules and Keras' optimizers hold), its ``requires_grad`` and
    ``.grad`` stay as they are. Its version counter is increased, as an in-place
    ``copy_`` would: a graph that saved the old value refuses ``backward()`` after the
    restore (Torch's "modified by an inplace operation") instead of using the new one."""
    import torch

    parameter = _keras_compat.variable_storage(var)
    parameter.data = tensor  # (``.data`` is not recorded by autograd)
    torch.autograd.graph.increment_version(parameter)


def _differs(var, old) -> bool:
    """Whether ``var`` holds another value than ``old`` (kept by `_kept`)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return var.value is not old
    if backend == "torch":
        import torch

        return not torch.equal(var.value.detach(), old)
    current = to_numpy(var)
    return not _state.same_state(np.asarray(current), np.asarray(getattr(old, "numpy", lambda: old)()))


def variable_step(var, array, name=None, *, owned=False):
    """The step assigning ``array`` to ``var``: its snapshot converts ``array`` for the
    variable (`_prepared`) and keeps the current value (`_kept`), both before
    the first assignment of the restore; its undo puts the kept value back.

    Every step assigns once with no copy of its own beyond the conversion: on Torch
    the parameter is given the prepared tensor's storage (`_swap`); that is the
    assignment where ``var.assign`` would only copy that memory onto itself (Keras' own
    ``assign``, outside a stateless scope: `compat.torch_swap_is_assign`), else
    ``var.assign`` runs after it, and an ``assign`` that raises swaps the old storage
    back before the error goes on; the undo swaps the old storage back, then calls
    ``var.assign`` with it (always). On TensorFlow ``assign`` shares the prepared
    tensor's buffer (no copy); the undo assigns the kept read back. On JAX ``assign``
    replaces the array.

    Args:
        var: The ``keras.Variable``.
        array: Its value, of its shape (a host array, or a placed ``jax.Array``).
        name: For messages; default the variable's path.
        owned: ``array`` is the restore's alone (read from the file by it; nothing the
            caller holds shares its memory): the variable may keep its memory as its
            own (`shareable`). Default ``False``: a copy.
    """
    prepared = []
    backend = keras.backend.backend()
    torch_backend = backend == "torch"

    def snapshot():
        if not prepared:  # (JAX: placed already by _put_on_devices)
            prepared.append(_prepared(var, array, owned))
        old = _kept(var)
        if torch_backend:

            def undo():
                _swap(var, old)
                var.assign(old)

            return undo, (lambda: _differs(var, old))
        return (lambda: var.assign(old)), (lambda: _differs(var, old))

    def apply():
        value = prepared.pop()  # dropped once assigned: the variable holds it, or a copy
        if torch_backend:
            old = _keras_compat.variable_storage(var).data
            _swap(var, value)
            if _keras_compat.torch_swap_is_assign(var):
                return  # assign would copy the memory onto itself
            try:
                var.assign(value)
            except BaseException:
                _swap(var, old)
                raise
            return
        _assign(var, _native(value) if type(value) is np.ndarray else value)

    shared = owned and shareable(array)
    nbytes = 0 if shared else int(getattr(array, "nbytes", 0))
    step = Step(name or getattr(var, "path", var.name), apply, snapshot, nbytes)
    if (
        backend == "jax"
        and type(array) is np.ndarray
        and array.dtype in _NATIVE_DTYPES
        and not _processes.is_sharded(getattr(var, "value", None))
    ):  # what _prepared puts on the default device, one array at a time
        step.host, step.receive = (array, owned), prepared.append
    return step


def _put_on_devices(steps) -> None:
    """On JAX, place the host array of every step that has one (``Step.host``) with one
    ``jax.device_put`` of them all, on the default device: JAX's per-call cost is about
    half of a small array's restore (60-100 us here), and a list pays most of it once.

    An array the restore owns (see `variable_step`) is handed over as it is, with
    ``may_alias=True``: JAX uses its memory where it is 64-byte aligned
    (`shareable`) and otherwise copies it into memory of its own, which costs
    less than a 64-byte aligned NumPy copy first (75 MB in 48 arrays at 16-byte
    offsets: 18.6 ms against 28.2 ms; 20k small arrays: 1.92 s against 2.11 s; medians,
    2026-12-04). A caller's array is first copied into 64-byte aligned memory of the
    restore's own (JAX 0.10 on the CPU uses an aligned array's memory even with
    ``may_alias=False``; a variable must never share the caller's memory)."""
    pending = [step for step in steps if getattr(step, "host", None) is not None]
    if not pending:
        return
    import jax

    hosts = [array if owned else _aligned_copy(array) for array, owned in (s.host for s in pending)]
    for step, value in zip(pending, jax.device_put(hosts, may_alias=True), strict=True):
        step.receive(value)


def _check_headroom(steps) -> None:
    """On TensorFlow, raise ``MemoryError`` unless what the restore allocates from here
    on can be allocated now. TensorFlow keeps no copy for the rollback (the kept
    values are reads of the variables' buffers, `_kept`) and its ``assign``
    shares the converted value's buffer; what it allocates is the conversion of
    every value that is not handed over as it is (``step.nbytes``, kept by the
    variables afterwards: a 64-byte aligned NumPy copy handed over through DLPack, or
    for ``bool`` and empty values Keras' conversion) plus a transient second copy of
    the largest of them (``convert_to_tensor`` copies a host array, then may copy it
    again into memory of its own alignment). TensorFlow's conversion and its copy kernel die with SIGSEGV
    when its allocator cannot grow (its oneDNN CPU allocator grows its pool by
    regions up to the pool's size) instead of raising; so that running out of memory
    is an error and not a crash, twice these bytes are first allocated (and freed at
    once) by NumPy, which raises ``MemoryError``. The other backends raise their own
    out-of-memory errors."""
    if keras.backend.backend() != "tensorflow":
        return
    sizes = [getattr(step, "nbytes", 0) for step in steps]
    need = 2 * (sum(sizes) + max(sizes, default=0))
    if need:
        probe = np.empty(need, np.uint8)
        del probe


def state_step(name, get, put, value):
    def snapshot():
        old = _state.copy_state(get())
        return (lambda: put(_state.copy_state(old))), (lambda: not _state.same_state(get(), old))

    return Step(name, lambda: put(value), snapshot)


def rng_step(parsed):
    def snapshot():
        undo = _state.rng_snapshot()
        return undo, (lambda: True)

    return Step("rng", lambda: _state.apply_rng_state(parsed), snapshot)


def apply_steps(steps, where=None):
    """Apply ``steps`` in order. If one raises, put back every step already applied
    (and the failing one, if it changed anything) from snapshots taken before the
    first, then re-raise.

    Every snapshot is taken before the first step is applied, and a snapshot makes
    everything its step allocates (on JAX the host arrays of every step are placed
    together first, `_put_on_devices`): running out of memory there (or anywhere before
    the first assignment) changes nothing, and putting values back allocates no new
    memory for model and optimizer variables: their old values are kept by
    reference, not copied (JAX keeps the old arrays, Torch the parameters' old
    storage, TensorFlow a copy-on-write read of each variable; see `_kept`), and
    putting one back hands that back to the variable.

    Raises:
        The error of the failing step (a ``KeyFormatError`` from a provider as
        [`MalformedKeyError`][keras_stable_state.MalformedKeyError]), or [`StateError`][keras_stable_state.StateError] naming what could
        not be put back when the rollback itself fails.
    """
    _check_headroom(steps)
    _put_on_devices(steps)
    snapshots = [step.snapshot() for step in steps]
    done = []
    for step, (undo, changed) in zip(steps, snapshots, strict=True):
        try:
            step.apply()
        except BaseException as err:
            failed = _roll_back([*reversed(done), (step, undo, changed, True)])
            if failed:
                raise StateError(
                    f"Restoring {file_label(where)} failed at {step.name} ({type(err).__name__}: {err}), and "
                    f"putting back the values from before the restore failed for {failed}: the model "
                    "and training state are now partly restored. Restore a checkpoint again (or rebuild "
                    "the model) before training.",
                    key=step.name,
                ) from err
            if isinstance(err, KeyFormatError) and not isinstance(err, MalformedKeyError):
                raise malformed_key(file_label(where), step.name, err.key, err) from err
            raise
        done.append((step, undo, changed, False))


def _changed(changed) -> bool:
    """``changed()``, or ``True`` when it cannot tell (it ran out of memory comparing): an
    undo puts back a kept value, which is harmless when nothing changed."""
    try:
        return changed()
    except Exception:  # noqa: BLE001 - undoing is always safe; not knowing means undo
        return True


def _roll_back(applied) -> list:
    """Undo ``(step, undo, changed, failing)`` in order; the names that could not be undone."""
    failed = []
    for step, undo, changed, failing in applied:
        try:
            if failing and not _changed(changed):
                continue
            undo()
        except Exception as err:  # noqa: BLE001 - every failure is reported by name to the caller
            failed.append(f"{step.name} ({type(err).__name__}: {err})")
    return failed
