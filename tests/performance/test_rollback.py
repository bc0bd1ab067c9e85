"""Rollback by reference: a restore keeps the variables' old values without copying them
(JAX: the old arrays; Torch: the parameters' old storage, the new value swapped in;
TensorFlow: a read of each variable, which TensorFlow copies on write), and a failure
after every new value is in place still puts back every variable exactly as it was.

Values are compared by position with values set by the test itself before the restore
(``before``) and with the saved ones (``saved``), both computed independently of the
restore.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND, to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state._core import apply, plan
from keras_stable_state.format.sandbox import aligned_empty


def _variables(model):
    return list(model.weights) + list(model.optimizer.variables)


def _fill(variables, shift):
    """Give every variable a value of its own: ``shift + i`` (float), ``i + shift`` (int)."""
    values = []
    for i, v in enumerate(variables):
        dtype = keras.backend.standardize_dtype(v.dtype)
        value = np.full(tuple(v.shape), shift + i, dtype=dtype)
        v.assign(value)
        values.append(value)
    return values


@pytest.fixture
def saved_model(tmp_path, data):
    x, y = data
    model = mlp(4, 16, named=True, seed=3)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    variables = _variables(model)
    saved = _fill(variables, 100)
    path = tmp_path / "state.h5"
    kss.save_training_state(path, model)
    before = _fill(variables, 1)
    return model, variables, path, saved, before


def _assert_values(variables, expected):
    assert len(variables) == len(expected)
    for i, (v, want) in enumerate(zip(variables, expected, strict=True)):
        np.testing.assert_array_equal(to_np(v), want, err_msg=f"variable {i} ({v.path})")


def _torch_storage(variables):
    """Torch: ``(parameter, data pointer)`` of every variable (the rollback swaps the old
    storage back into the same parameter)."""
    from keras_stable_state import _keras_compat

    params = [_keras_compat.variable_storage(v) for v in variables]
    return params, [p.data_ptr() for p in params]


def test_failure_after_every_variable_is_assigned_rolls_back_by_position(saved_model, monkeypatch):
    model, variables, path, saved, before = saved_model
    if BACKEND == "torch":
        params, pointers = _torch_storage(variables)
    reached = []

    def fail():
        # every variable holds its new value here: the swap (Torch) and assign are done
        reached.append([bool(np.array_equal(to_np(v), s)) for v, s in zip(variables, saved, strict=True)])
        raise RuntimeError("injected failure after the last assignment")

    real = plan.layers.finalize_steps
    monkeypatch.setattr(
        plan.layers,
        "finalize_steps",
        lambda m: [*real(m), apply.Step("injected", fail, lambda: ((lambda: None), (lambda: True)))],
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        kss.restore_training_state(path, model)
    assert reached and all(reached[0]), "the failure was injected before every variable was assigned"
    _assert_values(variables, before)
    if BACKEND == "torch":
        after, after_pointers = _torch_storage(variables)
        assert all(a is b for a, b in zip(params, after, strict=True))  # the same Parameters
        assert after_pointers == pointers  # holding their old storage again
        assert [p.requires_grad for p in after] == [v.trainable for v in variables]
    # and the same file restores once nothing fails
    monkeypatch.undo()
    kss.restore_training_state(path, model)
    _assert_values(variables, saved)


def test_variable_whose_assign_raises_after_the_swap_rolls_back(saved_model, monkeypatch):
    model, variables, path, saved, before = saved_model
    last = model.optimizer.variables[-1]
    calls = []

    def refuse(value):
        calls.append(to_np(last).copy())  # Torch: the new storage is swapped in already
        raise RuntimeError("backend refuses the variable")

    monkeypatch.setattr(last, "assign", refuse)
    with pytest.raises(RuntimeError, match="backend refuses the variable"):
        kss.restore_training_state(path, model)
    assert len(calls) == 1
    if BACKEND == "torch":  # the refusal came after the swap, and the swap was undone
        position = next(i for i, v in enumerate(variables) if v is last)
        np.testing.assert_array_equal(calls[0], saved[position])
    _assert_values(variables, before)


def test_restore_then_training_leaves_the_file_and_a_second_restore_exact(saved_model, data):
    """The variables may keep the restore's read arrays as their memory; training then
    writes into that memory, which nothing else reads: a second restore of the same file
    gives the saved values again."""
    model, variables, path, saved, before = saved_model
    x, y = data
    kss.restore_training_state(path, model)
    _assert_values(variables, saved)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert not np.array_equal(to_np(model.weights[0]), saved[0])
    kss.restore_training_state(path, model)
    _assert_values(variables, saved)


def test_kept_value_is_never_changed_by_what_the_variable_goes_through():
    """The rollback's kept value (no copy on any backend) keeps the old values through
    an assignment, in-place updates and an optimizer step. On TensorFlow this is the proof
    that a read of a variable (``ReadVariableOp``) is copy-on-write: it fails if
    TensorFlow ever updates a variable's buffer in place while a read shares it."""
    var = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4), trainable=True)
    old_values = np.arange(12, dtype="float32").reshape(3, 4)
    kept = apply._kept(var)
    value = aligned_empty((3, 4), "float32")  # as the reader allocates: taken without a copy
    value[...] = 7.0
    assert apply.shareable(value)
    step = apply.variable_step(var, value, owned=True)
    undo, _ = step.snapshot()
    step.apply()
    np.testing.assert_array_equal(to_np(var), np.full((3, 4), 7.0))
    var.assign_add(np.ones((3, 4), "float32"))
    var.assign_sub(np.full((3, 4), 3.0, "float32"))
    var.assign(np.full((3, 4), -1.0, "float32"))
    optimizer = keras.optimizers.Adam(learning_rate=0.5)
    optimizer.apply_gradients([(keras.ops.ones((3, 4)), var)])
    optimizer.apply_gradients([(keras.ops.ones((3, 4)), var)])
    assert not np.array_equal(to_np(var), old_values)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(kept), old_values)
    undo()
    np.testing.assert_array_equal(to_np(var), old_values)
    var.assign_add(np.ones((3, 4), "float32"))  # the put-back value is the variable's own again
    np.testing.assert_array_equal(to_np(var), old_values + 1)


@pytest.mark.skipif(
    BACKEND != "torch", reason="the storage swap is Torch's (JAX and TensorFlow replace buffers)"
)
def test_torch_swap_keeps_the_parameter_and_its_gradient():
    import torch

    from keras_stable_state import _keras_compat

    var = keras.Variable(np.zeros((2, 3), "float32"), trainable=True)
    param = _keras_compat.variable_storage(var)
    param.grad = torch.ones((2, 3))
    value = np.arange(6, dtype="float32").reshape(2, 3)
    apply.apply_steps([apply.variable_step(var, value, owned=True)])
    assert _keras_compat.variable_storage(var) is param and isinstance(param, torch.nn.Parameter)
    assert param.requires_grad and param.grad is not None
    assert param.data_ptr() == value.ctypes.data  # the restore's array is the variable's memory
    np.testing.assert_array_equal(to_np(var), value)


def _on_cpu(var) -> bool:
    value = var.value
    if BACKEND == "jax":
        return all(d.platform == "cpu" for d in value.devices())
    return "cpu" in str(value.device).lower()


def test_owned_arrays_are_taken_without_a_copy_and_others_never_shared():
    """An array the restore owns becomes the variable's memory where the backend can
    (on the CPU; 64-byte aligned, as the reader allocates); a caller's array never does."""
    owned = aligned_empty((4, 8), "float32")
    owned[...] = 3.0
    assert owned.ctypes.data % 64 == 0 and apply.shareable(owned)
    var = keras.Variable(np.zeros((4, 8), "float32"))
    apply.apply_steps([apply.variable_step(var, owned, owned=True)])
    np.testing.assert_array_equal(to_np(var), np.full((4, 8), 3.0))
    if _on_cpu(var):  # nothing but the variable uses it after a restore; here: it is shared
        owned[0, 0] = 9.0
        assert to_np(var)[0, 0] == 9.0

    theirs = np.full((4, 8), 5.0, "float32")
    other = keras.Variable(np.zeros((4, 8), "float32"))
    apply.apply_steps([apply.variable_step(other, theirs)])
    theirs[...] = 0.0
    np.testing.assert_array_equal(to_np(other), np.full((4, 8), 5.0))


def _at_16_past_64(shape, fill):
    """A float32 array of ``shape`` filled with ``fill``, its data 16 bytes past a 64-byte boundary."""
    size = int(np.prod(shape))
    raw = np.zeros(size + 32, "float32")
    start = (-raw.ctypes.data % 64) // 4 + 4
    array = raw[start : start + size].reshape(shape)
    array[...] = fill
    assert array.ctypes.data % 64 == 16
    return array


@pytest.mark.skipif(BACKEND != "jax", reason="the one device_put of every host array is JAX's")
def test_jax_places_owned_arrays_as_they_are_and_copies_a_callers_first(monkeypatch):
    """On JAX an array the restore owns goes to ``device_put`` as it is (JAX copies one it
    cannot alias itself); a caller's array is first copied into memory of the restore's
    own, so that no variable shares the caller's memory, whatever its alignment."""
    copied = []
    original = apply._aligned_copy

    def counting(array):
        copied.append(array.ctypes.data)
        return original(array)

    monkeypatch.setattr(apply, "_aligned_copy", counting)
    owned = [_at_16_past_64((4, 8), 3.0), aligned_empty((4, 8), "float32"), _at_16_past_64((5,), 4.0)]
    owned[1][...] = 6.0
    variables = [keras.Variable(np.zeros(a.shape, "float32")) for a in owned]
    apply.apply_steps([apply.variable_step(v, a, owned=True) for v, a in zip(variables, owned, strict=True)])
    assert copied == []
    for var, value in zip(variables, (3.0, 6.0, 4.0), strict=True):
        np.testing.assert_array_equal(to_np(var), np.full(var.shape, value))

    theirs = [_at_16_past_64((4, 8), 5.0), aligned_empty((4, 8), "float32")]
    theirs[1][...] = 7.0
    others = [keras.Variable(np.zeros((4, 8), "float32")) for _ in theirs]
    apply.apply_steps([apply.variable_step(v, a) for v, a in zip(others, theirs, strict=True)])
    assert copied == [a.ctypes.data for a in theirs]
    for array in theirs:
        array[...] = 0.0
    for var, value in zip(others, (5.0, 7.0), strict=True):
        np.testing.assert_array_equal(to_np(var), np.full((4, 8), value))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the 64-byte alignment is TensorFlow's")
def test_tensorflow_refuses_to_share_an_unaligned_array():
    array = _at_16_past_64((4, 8), 0.0)
    assert not apply.shareable(array)
    var = keras.Variable(np.zeros((4, 8), "float32"))
    array[...] = 2.0
    apply.apply_steps([apply.variable_step(var, array, owned=True)])
    array[...] = 0.0
    np.testing.assert_array_equal(to_np(var), np.full((4, 8), 2.0))
    var.assign_add(np.ones((4, 8), "float32"))  # a copy kernel on it: no crash
    np.testing.assert_array_equal(to_np(var), np.full((4, 8), 3.0))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="resource variables are TensorFlow's")
def test_tensorflow_writes_a_resource_directly_only_where_that_is_all_assign_does(saved_model):
    """A restore assigns a plain variable's resource itself (AssignVariableOp), optimizer
    slots built inside fit's tf.function included; a variable with an ``assign`` of its own,
    or one in a stateless scope, goes through Keras."""
    from keras_stable_state import _keras_compat

    model, variables, path, saved, before = saved_model
    assert all(_keras_compat.tf_plain_resource(v) is _keras_compat.variable_storage(v) for v in variables)
    plain = keras.Variable(np.zeros((2, 3), "float32"))
    read = _keras_compat.tf_read(plain)
    plain.assign(np.ones((2, 3), "float32"))
    np.testing.assert_array_equal(read.numpy(), np.zeros((2, 3)))  # the read kept its buffer
    with keras.StatelessScope():
        assert _keras_compat.tf_plain_resource(plain) is None and _keras_compat.tf_read(plain) is None
    calls = []
    last = variables[-1]
    original = last.assign

    def own(value):
        calls.append(np.array(value))
        return original(value)

    last.assign = own
    assert _keras_compat.tf_plain_resource(last) is None
    kss.restore_training_state(path, model)
    assert len(calls) == 1  # only the variable with an assign of its own went through it
    np.testing.assert_array_equal(calls[0], saved[-1])
    _assert_values(variables, saved)


@pytest.mark.skipif(BACKEND != "torch", reason="the storage swap is Torch's")
def test_torch_swap_is_the_assignment_only_where_that_is_all_assign_does(saved_model, monkeypatch):
    """A restore gives each parameter the new storage and calls no ``assign`` where
    Keras' own would only copy that memory onto itself; a variable with an ``assign``
    of its own, a subclass's ``_direct_assign``, or a stateless scope goes through
    ``assign``."""
    from keras.src.backend.torch.core import Variable as TorchVariable

    from keras_stable_state import _keras_compat

    model, variables, path, saved, before = saved_model
    assert all(_keras_compat.torch_swap_is_assign(v) for v in variables)
    with keras.StatelessScope():
        assert not _keras_compat.torch_swap_is_assign(variables[0])
    direct = []

    def counted(self, value):
        direct.append(self.path)
        return original_direct(self, value)

    original_direct = TorchVariable._direct_assign
    calls = []
    last = variables[-1]
    original = last.assign

    def own(value):
        calls.append(np.array(keras.ops.convert_to_numpy(value)))
        return original(value)

    last.assign = own
    assert not _keras_compat.torch_swap_is_assign(last)
    monkeypatch.setattr(TorchVariable, "_direct_assign", counted)
    assert not _keras_compat.torch_swap_is_assign(variables[0])
    monkeypatch.undo()
    kss.restore_training_state(path, model)
    assert len(calls) == 1  # only the variable with an assign of its own went through it
    np.testing.assert_array_equal(calls[0], saved[-1])
    _assert_values(variables, saved)
    _fill(variables, 7)
    monkeypatch.setattr(TorchVariable, "_direct_assign", counted)
    kss.restore_training_state(path, model)  # a replaced _direct_assign: every variable through it
    # every variable through it (the last one's own assign calls it too), and the model's metric
    # variables, which the restore puts back as well (they are not in the swap's list)
    metrics = [v.path for v in model.metrics_variables]
    assert sorted(direct) == sorted([v.path for v in variables] + metrics)
    _assert_values(variables, saved)


@pytest.mark.skipif(BACKEND != "torch", reason="the storage swap and version counters are Torch's")
def test_torch_swap_skips_assign_and_counts_as_an_in_place_write(saved_model):
    """Each parameter's version counter rises by exactly one in a restore (the swap counts
    as one in-place write; Keras' ``assign``, a ``copy_``, would add a second), and a
    graph built on the old values refuses ``backward()`` after the restore, as it would
    after ``assign``, instead of silently using the restored values."""
    from keras_stable_state import _keras_compat

    model, variables, path, saved, before = saved_model
    trainable = [_keras_compat.variable_storage(v) for v in model.trainable_variables]
    loss = sum((p * p).sum() for p in trainable)  # saves every trainable parameter
    params = [_keras_compat.variable_storage(v) for v in variables]
    versions = [p._version for p in params]
    kss.restore_training_state(path, model)
    _assert_values(variables, saved)
    assert [p._version for p in params] == [n + 1 for n in versions]
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


@pytest.mark.skipif(BACKEND != "torch", reason="the storage swap is Torch's")
@pytest.mark.parametrize("member", ["_convert_to_tensor", "value", "shape"])
def test_torch_variable_subclass_with_its_own_members_goes_through_assign(member):
    """A variable whose class replaces a member ``assign`` runs through (a clipping
    ``_convert_to_tensor``; its own ``value`` or ``shape``) is given the new value by its
    ``assign``: a clipping class receives the clipped value, what ``variable.assign``
    gives it, not the array swapped in as it is."""
    from keras.src.backend.torch.core import Variable as TorchVariable

    from keras_stable_state import _keras_compat

    def clip(self, value, dtype=None):
        return TorchVariable._convert_to_tensor(self, value, dtype).clamp(-1.0, 1.0)

    if member == "_convert_to_tensor":
        body = {member: clip}
    else:  # the same getter in a property of the subclass's own: only that member replaced
        body = {member: property(getattr(TorchVariable, member).fget)}
    kind = type("Clipped", (TorchVariable,), body)
    var = kind(np.zeros(3, "float32"))
    plain = keras.Variable(np.zeros(3, "float32"))
    assert not _keras_compat.torch_swap_is_assign(var) and _keras_compat.torch_swap_is_assign(plain)
    new = np.array([5.0, -5.0, 0.5], "float32")
    expected = np.clip(new, -1.0, 1.0) if member == "_convert_to_tensor" else new
    var.assign(np.zeros(3, "float32"))
    versions = [_keras_compat.variable_storage(v)._version for v in (var, plain)]
    apply.apply_steps([apply.variable_step(var, new.copy()), apply.variable_step(plain, new.copy())])
    np.testing.assert_array_equal(to_np(var), expected)
    np.testing.assert_array_equal(to_np(plain), new)
    # the swap writes once; the subclass's assign (a copy_) once more, the plain one's not at all
    after = [_keras_compat.variable_storage(v)._version for v in (var, plain)]
    assert after == [versions[0] + 2, versions[1] + 1]
