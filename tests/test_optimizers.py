"""StableOptimizer around every optimizer Keras ships.

For each optimizer: wrapping changes no number (bit-identical to the bare
optimizer), a save and restore into a model whose trainable variables come out
permuted puts every slot back on its own variable (matched by name), the
number of optimizer variables does not grow with training, and
``model.save`` / ``keras.saving.load_model`` round-trips the wrapper. The
backend-specific custom loops (JAX ``stateless_apply``, TF ``tf.function`` +
``GradientTape``, Torch autograd) are bit-identical wrapped and unwrapped.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND, slots_by_key, to_np
from keras import layers, ops

import keras_stable_state as kss

O = keras.optimizers


def _multi():
    # Adam for branch_a (matched on variable.path), SGD with momentum for the rest.
    return O.MultiOptimizer(O.OptimizerMap(O.SGD(0.01, momentum=0.9), {".*branch_a/.*": O.Adam(0.01)}))


OPTIMIZERS = {
    "sgd": lambda: O.SGD(0.01),
    "sgd_momentum": lambda: O.SGD(0.01, momentum=0.9),
    "sgd_nesterov": lambda: O.SGD(0.01, momentum=0.9, nesterov=True),
    "adam": lambda: O.Adam(0.01),
    "adam_amsgrad": lambda: O.Adam(0.01, amsgrad=True),
    "adamw": lambda: O.AdamW(0.01),
    "adamax": lambda: O.Adamax(0.01),
    "adagrad": lambda: O.Adagrad(0.05),
    "adadelta": lambda: O.Adadelta(1.0),
    "rmsprop": lambda: O.RMSprop(0.01, momentum=0.9),
    "rmsprop_centered": lambda: O.RMSprop(0.01, momentum=0.9, centered=True),
    "nadam": lambda: O.Nadam(0.01),
    "ftrl": lambda: O.Ftrl(0.05),
    "lion": lambda: O.Lion(0.01),
    "lamb": lambda: O.Lamb(0.01),
    "adafactor": lambda: O.Adafactor(0.01),
    "muon": lambda: O.Muon(0.01),
    "loss_scale_adam": lambda: O.LossScaleOptimizer(O.Adam(0.01)),
    "adam_ema": lambda: O.Adam(0.01, use_ema=True, ema_overwrite_frequency=None),
    "adam_accum2": lambda: O.Adam(0.01, gradient_accumulation_steps=2),
}
if hasattr(O, "ScheduleFreeAdamW"):
    OPTIMIZERS["schedule_free_adamw"] = lambda: O.ScheduleFreeAdamW(0.01)
if hasattr(O, "MultiOptimizer"):
    OPTIMIZERS["multi_adam_sgd"] = _multi

NAMES = sorted(OPTIMIZERS)
# Optimizers whose training is continued one step after a restore (covers
# plain slots, amsgrad, centered, Muon's mixed slots, nested wrappers, EMA and
# a half-full gradient accumulation window).
CONTINUE = ["adam_amsgrad", "rmsprop_centered", "muon", "loss_scale_adam", "adam_accum2", "adam_ema"]
if "multi_adam_sgd" in OPTIMIZERS:
    CONTINUE.append("multi_adam_sgd")

BATCH = 8
STEPS = 5


class _Branches(keras.Model):
    """Two same-shape Dense(4) branches, a Conv1D and a Dense head.

    Subclasses create the layers in different orders, so ``trainable_variables``
    (and therefore every optimizer's slot lists) come out permuted while the
    computation and the attribute names are the same.
    """

    order = ()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        make = {
            "branch_a": lambda: layers.Dense(4, name="branch_a"),
            "branch_b": lambda: layers.Dense(4, name="branch_b"),
            "conv": lambda: layers.Conv1D(2, 2, name="conv"),
            "head": lambda: layers.Dense(1, name="head"),
        }
        for attr in self.order:
            setattr(self, attr, make[attr]())

    def call(self, x):
        h = self.branch_a(x) * 0.3 + self.branch_b(x) * 1.7
        c = self.conv(ops.expand_dims(h, -1))
        return self.head(ops.reshape(c, (-1, 6)))


@keras.saving.register_keras_serializable(package="tests")
class OptBranchesV1(_Branches):
    order = ("branch_a", "branch_b", "conv", "head")


@keras.saving.register_keras_serializable(package="tests")
class OptBranchesV2(_Branches):
    order = ("branch_b", "branch_a", "head", "conv")


def _batches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH * STEPS, 4)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, 1)).astype("float32")
    return x, y


def _built(cls, weights_from=None):
    model = cls()
    model(np.zeros((1, 4), "float32"))
    if weights_from is not None:
        _set_weights_by_path(model, _weights(weights_from))
    return model


def _rel(variable):
    """``variable.path`` without the (auto-named) model prefix: ``branch_a/kernel``."""
    return variable.path.split("/", 1)[1]


def _weights(model):
    return {_rel(v): to_np(v) for v in model.weights}


def _set_weights_by_path(model, arrays):
    for v in model.weights:
        v.assign(arrays[_rel(v)])


def _assert_same_arrays(got, want, what):
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    differ = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not differ, f"{what}: arrays differ for {differ}"


def _fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def _slot_keys(optimizer):
    return [e.key for e in optimizer.entries() if e.is_slot]


def _iterations(optimizer):
    return int(to_np(optimizer.iterations))


def _updates(name, steps):
    """``optimizer.iterations`` after ``steps`` training steps (it counts applied updates)."""
    return steps // 2 if name == "adam_accum2" else steps


# ---------------------------------------------------------------------------
# (a) wrapping changes no number
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_wrapped_is_bit_identical_to_unwrapped(name):
    x, y = _batches()
    bare = _built(OptBranchesV1)
    wrapped = _built(OptBranchesV1)
    wrapped.set_weights(bare.get_weights())
    initial = _weights(bare)
    bare.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    wrapped.compile(optimizer=kss.StableOptimizer(OPTIMIZERS[name]()), loss="mse")

    _fit(bare, x, y)
    _fit(wrapped, x, y)

    assert isinstance(wrapped.optimizer, kss.StableOptimizer)
    assert _iterations(bare.optimizer) == _iterations(wrapped.optimizer) == _updates(name, STEPS)
    after = _weights(bare)
    assert any(not np.array_equal(after[k], initial[k]) for k in initial), "training did not move"
    _assert_same_arrays(_weights(wrapped), after, f"{name}: parameters")
    # Optimizer variables too, in the inner optimizer's own order.
    bare_vars = [to_np(v) for v in bare.optimizer.variables]
    wrapped_vars = [to_np(v) for v in wrapped.optimizer.variables]
    assert len(bare_vars) == len(wrapped_vars)
    for i, (a, b) in enumerate(zip(bare_vars, wrapped_vars, strict=True)):
        assert np.array_equal(a, b), f"{name}: optimizer variable #{i} differs"


# ---------------------------------------------------------------------------
# (b) restore into a model whose trainable variables are permuted
# ---------------------------------------------------------------------------
def _trained_v1(name):
    x, y = _batches()
    model = _built(OptBranchesV1)
    model.compile(optimizer=kss.StableOptimizer(OPTIMIZERS[name]()), loss="mse")
    _fit(model, x, y)
    return model


def _fresh_v2(name):
    model = _built(OptBranchesV2)
    model.compile(optimizer=kss.StableOptimizer(OPTIMIZERS[name]()), loss="mse")
    return model


def _assert_permuted(v1, v2):
    p1 = [_rel(v) for v in v1.trainable_variables]
    p2 = [_rel(v) for v in v2.trainable_variables]
    assert sorted(p1) == sorted(p2) and p1 != p2
    # Same-shape variables swap positions: a positional restore would mix them up.
    assert p1.index("branch_a/kernel") == p2.index("branch_b/kernel")


def _restore_permuted(name, path):
    v1 = _trained_v1(name)
    saved = slots_by_key(v1.optimizer)
    saved_weights = _weights(v1)
    kss.save_training_state(path, v1)

    v2 = _fresh_v2(name)
    _assert_permuted(v1, v2)
    report = kss.restore_training_state(path, v2)
    return v1, v2, saved, saved_weights, report


@pytest.mark.parametrize("name", NAMES)
def test_restore_into_permuted_model_matches_every_slot_by_name(name, tmp_path):
    v1, v2, saved, saved_weights, report = _restore_permuted(name, tmp_path / "state.keras")

    # Every key is named: slots by the stable path of their variable.
    assert all(k.startswith(("path:", "optimizer#")) for k in saved), sorted(saved)
    slot_keys = _slot_keys(v1.optimizer)
    n_trainable = len(v1.trainable_variables)
    if name != "sgd":
        assert len(slot_keys) >= n_trainable, slot_keys
        assert all(k.startswith("path:") for k in slot_keys)
        # The slot lists really are in another order in the permuted model.
        assert _slot_keys(v2.optimizer) != slot_keys
        assert sorted(_slot_keys(v2.optimizer)) == sorted(slot_keys)
        assert any(np.any(saved[k] != 0) for k in slot_keys), "slots are all zero: nothing checked"

    restored = slots_by_key(v2.optimizer)
    _assert_same_arrays(restored, saved, f"{name}: optimizer variables by key")
    _assert_same_arrays(_weights(v2), saved_weights, f"{name}: model variables by path")
    assert _iterations(v2.optimizer) == _updates(name, STEPS)

    # The report: every optimizer variable and model variable matched by name.
    assert report.by_order == []
    assert report.left_fresh == []
    assert report.dropped == []
    for key in saved:
        assert report.matched.get(key) == "name", (key, report.matched.get(key))
    for key in slot_keys:
        assert report.matched[key] == "name"
    assert len(report.by_name) == len(saved) + len(v2.weights)


@pytest.mark.parametrize("ext", [".keras", ".h5"])
@pytest.mark.parametrize("name", CONTINUE)
def test_one_more_step_after_permuted_restore_is_bit_identical(name, ext, tmp_path):
    v1, v2, _, _, report = _restore_permuted(name, tmp_path / f"state{ext}")
    assert report.by_order == [] and report.left_fresh == []
    rng = np.random.default_rng(7)
    xb = rng.normal(size=(BATCH, 4)).astype("float32")
    yb = rng.normal(size=(BATCH, 1)).astype("float32")
    before = _weights(v1)

    v1.train_on_batch(xb, yb)
    v2.train_on_batch(xb, yb)

    assert _iterations(v1.optimizer) == _iterations(v2.optimizer) == _updates(name, STEPS + 1)
    after = _weights(v1)
    assert any(not np.array_equal(after[k], before[k]) for k in before), "the step did not move"
    _assert_same_arrays(_weights(v2), after, f"{name}: parameters after one more step")
    _assert_same_arrays(slots_by_key(v2.optimizer), slots_by_key(v1.optimizer), f"{name}: slots")


# ---------------------------------------------------------------------------
# (c) the number of optimizer variables does not grow with training
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_variable_count_does_not_grow_with_steps(name):
    x, y = _batches()
    model = _built(OptBranchesV1)
    optimizer = kss.StableOptimizer(OPTIMIZERS[name]())
    model.compile(optimizer=optimizer, loss="mse")
    model.train_on_batch(x[:BATCH], y[:BATCH])
    assert optimizer.built
    n_vars = len(optimizer.variables)
    keys = [e.key for e in optimizer.entries()]
    assert len(keys) == n_vars == len(set(keys))

    for i in range(10):
        j = (i % STEPS) * BATCH
        model.train_on_batch(x[j : j + BATCH], y[j : j + BATCH])

    assert _iterations(optimizer) == _updates(name, 11)
    assert len(optimizer.variables) == n_vars
    assert len(optimizer.inner_optimizer.variables) == n_vars
    assert [e.key for e in optimizer.entries()] == keys


# ---------------------------------------------------------------------------
# model.save / keras.saving.load_model
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_model_save_load_round_trip(name, tmp_path):
    model = _trained_v1(name)
    saved = slots_by_key(model.optimizer)
    saved_weights = _weights(model)
    path = tmp_path / "m.keras"
    model.save(path)

    loaded = keras.saving.load_model(path)

    assert isinstance(loaded, OptBranchesV1)
    assert isinstance(loaded.optimizer, kss.StableOptimizer)
    inner, loaded_inner = model.optimizer.inner_optimizer, loaded.optimizer.inner_optimizer
    assert type(loaded_inner) is type(inner)
    assert loaded_inner.get_config() == inner.get_config()
    assert loaded.optimizer.built
    _assert_same_arrays(_weights(loaded), saved_weights, f"{name}: model variables")
    assert all(k.startswith(("path:", "optimizer#")) for k in slots_by_key(loaded.optimizer))
    _assert_same_arrays(slots_by_key(loaded.optimizer), saved, f"{name}: optimizer variables by key")
    assert _iterations(loaded.optimizer) == _updates(name, STEPS)


# ---------------------------------------------------------------------------
# Custom loops, one per backend
# ---------------------------------------------------------------------------
def _grads_for(variables, step):
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=tuple(v.shape)).astype("float32") for v in variables]


@pytest.mark.parametrize("name", NAMES)
def test_jax_stateless_apply_matches_inner(name):
    if BACKEND != "jax":
        pytest.skip("stateless_apply custom loops are the JAX backend's training path")
    import jax

    model = _built(OptBranchesV1)
    bare = OPTIMIZERS[name]()
    wrapped = kss.StableOptimizer(OPTIMIZERS[name]())
    bare.build(model.trainable_variables)
    wrapped.build(model.trainable_variables)
    assert len(bare.variables) == len(wrapped.variables)

    results = []
    for opt in (bare, wrapped):
        step = jax.jit(opt.stateless_apply)
        train_vals = [v.value for v in model.trainable_variables]
        opt_vals = [v.value for v in opt.variables]
        for i in range(STEPS):
            train_vals, opt_vals = step(opt_vals, _grads_for(model.trainable_variables, i), train_vals)
        results.append(([np.asarray(a) for a in train_vals], [np.asarray(a) for a in opt_vals]))

    (bare_t, bare_o), (wrap_t, wrap_o) = results
    initial = [to_np(v) for v in model.trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(bare_t, initial, strict=True))
    for i, (a, b) in enumerate(zip(bare_t, wrap_t, strict=True)):
        assert np.array_equal(a, b), f"{name}: trainable variable #{i} differs"
    for i, (a, b) in enumerate(zip(bare_o, wrap_o, strict=True)):
        assert np.array_equal(a, b), f"{name}: optimizer variable #{i} differs"
    # stateless: the live variables were not touched
    assert _iterations(bare) == _iterations(wrapped) == 0


def _custom_loop_models(name):
    bare = _built(OptBranchesV1)
    wrapped = _built(OptBranchesV1, weights_from=bare)
    pairs = [(bare, OPTIMIZERS[name]()), (wrapped, kss.StableOptimizer(OPTIMIZERS[name]()))]
    for model, opt in pairs:
        opt.build(model.trainable_variables)
    return pairs


def _assert_loop_results(name, pairs, initial):
    (bare, bare_opt), (wrapped, wrapped_opt) = pairs
    assert _iterations(bare_opt) == _iterations(wrapped_opt) == _updates(name, STEPS)
    after = _weights(bare)
    assert any(not np.array_equal(after[k], initial[k]) for k in initial), "training did not move"
    _assert_same_arrays(_weights(wrapped), after, f"{name}: parameters")
    for i, (a, b) in enumerate(zip(bare_opt.variables, wrapped_opt.variables, strict=True)):
        assert np.array_equal(to_np(a), to_np(b)), f"{name}: optimizer variable #{i} differs"


@pytest.mark.parametrize("name", NAMES)
def test_tensorflow_gradient_tape_loop_matches_inner(name):
    if BACKEND != "tensorflow":
        pytest.skip("tf.function + tf.GradientTape custom loops need the TensorFlow backend")
    import tensorflow as tf

    x, y = _batches()
    pairs = _custom_loop_models(name)
    initial = _weights(pairs[0][0])
    for model, opt in pairs:

        @tf.function
        def train_step(xb, yb, model=model, opt=opt):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        for i in range(STEPS):
            train_step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
    _assert_loop_results(name, pairs, initial)


@pytest.mark.parametrize("name", NAMES)
def test_torch_autograd_loop_matches_inner(name):
    if BACKEND != "torch":
        pytest.skip("torch autograd custom loops need the Torch backend")
    import torch

    x, y = _batches()
    pairs = _custom_loop_models(name)
    initial = _weights(pairs[0][0])
    for model, opt in pairs:
        for i in range(STEPS):
            xb = ops.convert_to_tensor(x[i * BATCH : (i + 1) * BATCH])
            yb = ops.convert_to_tensor(y[i * BATCH : (i + 1) * BATCH])
            model.zero_grad()
            loss = torch.mean(torch.square(model(xb, training=True) - yb))
            opt.scale_loss(loss).backward()
            variables = model.trainable_variables
            grads = [v.value.grad for v in variables]
            with torch.no_grad():
                opt.apply(grads, variables)
    _assert_loop_results(name, pairs, initial)
