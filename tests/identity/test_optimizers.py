"""StableOptimizer around every optimizer Keras ships.

For each optimizer: wrapping changes no number (bit-identical to the bare
optimizer) and the number of optimizer variables does not grow with training;
a save and restore into a model whose trainable variables come out permuted
puts every slot back on its own variable (matched by name) and training goes
on to the same bits; ``model.save`` / ``keras.saving.load_model`` round-trips
the wrapper. The backend-specific custom loops (JAX ``stateless_apply`` under
``jax.jit``, TF ``tf.function`` + ``GradientTape``, Torch autograd) are
bit-identical wrapped and unwrapped.

Speed (the file must stay near a minute per backend on two cores): models
train with eager ``train_on_batch`` steps (``run_eagerly=True``) followed by
``finalize_variable_values``, as ``fit`` ends; the ``-compiled`` cases train
with Keras' default compiled ``model.fit``. The compiled step of every
optimizer is covered by the custom-loop tests (``jax.jit``, ``tf.function``).
"""

import types

import keras
import numpy as np
import pytest
from conftest import BACKEND, slots_by_key, to_np
from keras import layers, ops

import keras_stable_state as kss

optimizers = keras.optimizers


def _multi():
    # Adam for branch_a (matched on variable.path), SGD with momentum for the rest.
    return optimizers.MultiOptimizer(
        optimizers.OptimizerMap(optimizers.SGD(0.01, momentum=0.9), {".*branch_a/.*": optimizers.Adam(0.01)})
    )


OPTIMIZERS = {
    "sgd": lambda: optimizers.SGD(0.01),
    "sgd_momentum": lambda: optimizers.SGD(0.01, momentum=0.9),
    "sgd_nesterov": lambda: optimizers.SGD(0.01, momentum=0.9, nesterov=True),
    "adam": lambda: optimizers.Adam(0.01),
    "adam_amsgrad": lambda: optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: optimizers.AdamW(0.01),
    "adamax": lambda: optimizers.Adamax(0.01),
    "adagrad": lambda: optimizers.Adagrad(0.05),
    "adadelta": lambda: optimizers.Adadelta(1.0),
    "rmsprop": lambda: optimizers.RMSprop(0.01, momentum=0.9),
    "rmsprop_centered": lambda: optimizers.RMSprop(0.01, momentum=0.9, centered=True),
    "nadam": lambda: optimizers.Nadam(0.01),
    "ftrl": lambda: optimizers.Ftrl(0.05),
    "lion": lambda: optimizers.Lion(0.01),
    "lamb": lambda: optimizers.Lamb(0.01),
    "adafactor": lambda: optimizers.Adafactor(0.01),
    "muon": lambda: optimizers.Muon(0.01),
    "loss_scale_adam": lambda: optimizers.LossScaleOptimizer(optimizers.Adam(0.01)),
    "adam_ema": lambda: optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=None),
    "adam_accum2": lambda: optimizers.Adam(0.01, gradient_accumulation_steps=2),
}
if hasattr(optimizers, "ScheduleFreeAdamW"):
    OPTIMIZERS["schedule_free_adamw"] = lambda: optimizers.ScheduleFreeAdamW(0.01)
if hasattr(optimizers, "MultiOptimizer"):
    OPTIMIZERS["multi_adam_sgd"] = _multi

NAMES = sorted(OPTIMIZERS)
# Also trained with Keras' default compiled `model.fit`. On JAX these two only train
# compiled: an eager step of an optimizer that branches with `ops.cond` (loss
# scaling, gradient accumulation) compiles its branches again at every step.
COMPILED = ("loss_scale_adam", "adam_accum2")

BATCH = 8
STEPS = 5
ATTRS = ("branch_a", "branch_b", "conv", "head")


class _Branches(keras.Model):
    """Two same-shape Dense(4) branches, a Conv1D and a Dense head.

    Subclasses create the layers in different orders, so ``trainable_variables``
    (and with them every optimizer's slot lists) come out permuted while the
    computation and the attribute names stay the same.
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


@pytest.fixture(autouse=True)
def _clean_session():
    """conftest's clean session and seeds, minus its ``gc.collect()``: with a backend
    loaded a collection takes ~0.3 s, twice per test, which would triple this file's
    run time. Keras' global state is still reset before and after every test."""
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield
    keras.backend.clear_session(free_memory=False)


# -- helpers -------------------------------------------------------------------
def _batches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH * STEPS, 4)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, 1)).astype("float32")
    return x, y


def _one_batch():
    rng = np.random.default_rng(7)
    return rng.normal(size=(BATCH, 4)).astype("float32"), rng.normal(size=(BATCH, 1)).astype("float32")


def _built(cls, weights_from=None):
    model = cls()
    model(np.zeros((1, 4), "float32"))
    if weights_from is not None:
        arrays = _weights(weights_from)
        for attr in ATTRS:
            for v in getattr(model, attr).weights:
                v.assign(arrays[f"{attr}/{v.name}"])
    return model


def _weights(model):
    """``{"branch_a/kernel": array, ...}``: model variables by attribute, whatever their order."""
    out = {f"{attr}/{v.name}": to_np(v) for attr in ATTRS for v in getattr(model, attr).weights}
    assert len(out) == len(model.weights) == 8
    return out


def _order(model):
    """Attribute paths of ``model.trainable_variables``, in their order."""
    where = {id(v): f"{attr}/{v.name}" for attr in ATTRS for v in getattr(model, attr).weights}
    return [where[id(v)] for v in model.trainable_variables]


def _assert_same_arrays(got, want, what):
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    differ = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not differ, f"{what}: arrays differ for {differ}"


def _assert_moved(after, before, what):
    assert any(not np.array_equal(after[k], before[k]) for k in before), f"{what}: training did not move"


def _compiled_by_default(name):
    return BACKEND == "jax" and name in COMPILED


def _compile(model, optimizer, compiled=False):
    if isinstance(optimizer, kss.StableOptimizer):
        optimizer.bind(model)  # explicit: nothing is guessed from the calling code
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=not compiled)


def _train(model, x, y, compiled, epochs=1):
    """``epochs`` passes over the batches of ``x``, in order: Keras' compiled ``fit``,
    or eager ``train_on_batch`` steps and then ``finalize_variable_values`` (what
    ``fit`` does when it ends, e.g. the EMA overwrite)."""
    if compiled:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
        return
    for _ in range(epochs):
        for i in range(0, len(x), BATCH):
            model.train_on_batch(x[i : i + BATCH], y[i : i + BATCH])
    model.optimizer.finalize_variable_values(model.trainable_weights)


def _build_other_things_first():
    """What a resuming process may have built before the model it restores into:
    other models and unnamed variables. Keras' process-global auto-naming counters
    (``dense_3``, ``variable_2``) then differ from the saving run's; keys must not."""
    for _ in range(2):
        keras.Variable(0.0)
        keras.layers.Dense(2).build((None, 3))


def _slot_keys(optimizer):
    return [e.key for e in optimizer.entries() if e.is_slot]


def _iterations(optimizer):
    return int(to_np(optimizer.iterations))


def _updates(name, steps):
    """``optimizer.iterations`` after ``steps`` training steps: it counts applied updates."""
    return steps // 2 if name == "adam_accum2" else steps


# ---------------------------------------------------------------------------
# (a) wrapping changes no number; (c) the variable count does not grow
# ---------------------------------------------------------------------------
FIT_CASES = [pytest.param(n, False, id=n) for n in NAMES if not _compiled_by_default(n)] + [
    pytest.param(n, True, id=f"{n}-compiled") for n in COMPILED if n in OPTIMIZERS
]


@pytest.mark.parametrize("name, compiled", FIT_CASES)
@pytest.mark.slow
def test_wrapped_is_bit_identical_to_unwrapped_and_does_not_grow(name, compiled):
    x, y = _batches()
    bare = _built(OptBranchesV1)
    wrapped = _built(OptBranchesV1, weights_from=bare)
    initial = _weights(bare)
    _compile(bare, OPTIMIZERS[name](), compiled)
    _compile(wrapped, kss.StableOptimizer(OPTIMIZERS[name]()), compiled)
    optimizer = wrapped.optimizer
    optimizer.build(wrapped.trainable_variables)
    n_vars = len(optimizer.variables)
    keys = [e.key for e in optimizer.entries()]

    _train(bare, x, y, compiled)
    _train(wrapped, x, y, compiled)

    # (a) bit-identical parameters and optimizer variables after 5 steps
    assert isinstance(wrapped.optimizer, kss.StableOptimizer)
    assert _iterations(bare.optimizer) == _iterations(wrapped.optimizer) == _updates(name, STEPS)
    after = _weights(bare)
    _assert_moved(after, initial, name)
    _assert_same_arrays(_weights(wrapped), after, f"{name}: parameters")
    bare_vars = [to_np(v) for v in bare.optimizer.variables]
    wrapped_vars = [to_np(v) for v in wrapped.optimizer.variables]
    assert len(bare_vars) == len(wrapped_vars)
    for i, (a, b) in enumerate(zip(bare_vars, wrapped_vars, strict=True)):
        assert np.array_equal(a, b), f"{name}: optimizer variable #{i} differs"

    # (c) counted when built, after 5 steps and after 5 more: no growth
    assert n_vars == len(bare.optimizer.variables) == len(keys) == len(set(keys))
    assert [e.key for e in optimizer.entries()] == keys
    _train(wrapped, x, y, compiled)
    assert _iterations(optimizer) == _updates(name, 2 * STEPS)
    assert len(optimizer.variables) == len(optimizer.inner_optimizer.variables) == n_vars
    assert [e.key for e in optimizer.entries()] == keys


# ---------------------------------------------------------------------------
# The original run, shared by the restore and load_model tests of one optimizer
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def original(request, tmp_path_factory):
    """Train an ``OptBranchesV1`` for 5 steps with a wrapped optimizer, save it three
    ways (``model.save``, ``save_training_state`` to ``.keras`` and ``.h5``), then
    train it one more step. Returns what was saved and what the extra step gave."""
    name = request.param
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    compiled = _compiled_by_default(name)
    x, y = _batches()
    model = _built(OptBranchesV1)
    _compile(model, kss.StableOptimizer(OPTIMIZERS[name]()), compiled)
    _train(model, x, y, compiled)

    out = tmp_path_factory.mktemp(name)
    run = types.SimpleNamespace(
        name=name,
        compiled=compiled,
        slots=slots_by_key(model.optimizer),
        slot_keys=_slot_keys(model.optimizer),
        weights=_weights(model),
        order=_order(model),
        n_trainable=len(model.trainable_variables),
        inner_class=type(model.optimizer.inner_optimizer),
        inner_config=model.optimizer.inner_optimizer.get_config(),
        model_file=out / "m.keras",
        state_files={ext: out / f"state{ext}" for ext in (".keras", ".h5")},
    )
    model.save(run.model_file)
    for path in run.state_files.values():
        kss.save_training_state(path, model)

    model.train_on_batch(*_one_batch())
    run.next_weights = _weights(model)
    run.next_slots = slots_by_key(model.optimizer)
    _assert_moved(run.next_weights, run.weights, name)
    return run


# ---------------------------------------------------------------------------
# (b) restore into a model whose trainable variables are permuted
# ---------------------------------------------------------------------------
# Every optimizer through ``.h5``; ``.keras`` holds the same record in a zip member, so
# it is restored for one optimizer of each kind of state (none, plain slots, a wrapper's
# own variables, branches with ops.cond, several inner optimizers, a matrix optimizer).
KERAS_FILE_NAMES = [
    n for n in ("sgd", "adam", "loss_scale_adam", "adam_accum2", "adam_ema", "muon") if n in NAMES
]
KERAS_FILE_NAMES += [n for n in NAMES if n.startswith("multi")][:1]


@pytest.mark.parametrize(
    ("original", "ext"),
    [(n, ".h5") for n in NAMES] + [(n, ".keras") for n in KERAS_FILE_NAMES],
    indirect=["original"],
)
def test_restore_into_permuted_model_matches_every_slot_by_name(original, ext):
    run, name = original, original.name
    what = f"{name} ({ext})"
    # Every saved key is named: slots by the stable path of their variable.
    assert all(k.startswith(("path:", "optimizer#")) for k in run.slots), sorted(run.slots)
    assert all(k.startswith("path:") for k in run.slot_keys), run.slot_keys
    if name != "sgd":  # plain SGD has no slots
        assert len(run.slot_keys) >= run.n_trainable, run.slot_keys
        assert any(np.any(run.slots[k] != 0) for k in run.slot_keys), "slots are all zero: nothing checked"

    _build_other_things_first()
    v2 = _built(OptBranchesV2)
    _compile(v2, kss.StableOptimizer(OPTIMIZERS[name]()), run.compiled)
    order = _order(v2)
    assert sorted(order) == sorted(run.order) and order != run.order
    # Same-shape variables swap positions: a positional restore would mix them up.
    assert run.order.index("branch_a/kernel") == order.index("branch_b/kernel")

    report = kss.restore_training_state(run.state_files[ext], v2)
    assert report.built_optimizer  # compiled, not built: the restore built it

    if run.slot_keys:  # the slot lists really are in another order in the permuted model
        assert _slot_keys(v2.optimizer) != run.slot_keys
    _assert_same_arrays(slots_by_key(v2.optimizer), run.slots, f"{what}: optimizer variables by key")
    _assert_same_arrays(_weights(v2), run.weights, f"{what}: model variables")
    assert _iterations(v2.optimizer) == _updates(name, STEPS)
    # The report: every slot, optimizer variable and model variable matched by name.
    assert report.by_order == [], report.by_order
    assert report.left_fresh == [] and report.dropped == []
    not_by_name = {k: report.matched.get(k) for k in run.slots if report.matched.get(k) != "name"}
    assert not not_by_name, f"{what}: not matched by name: {not_by_name}"
    assert len(report.by_name) == len(run.slots) + len(v2.weights)

    # One more step after the restore equals one more step of the original, bit for bit.
    v2.train_on_batch(*_one_batch())
    assert _iterations(v2.optimizer) == _updates(name, STEPS + 1)
    _assert_same_arrays(_weights(v2), run.next_weights, f"{what}: parameters after one more step")
    _assert_same_arrays(slots_by_key(v2.optimizer), run.next_slots, f"{what}: slots after one more step")


# ---------------------------------------------------------------------------
# model.save / keras.saving.load_model
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("original", NAMES, indirect=True)
def test_model_save_load_model_round_trip(original):
    run, name = original, original.name
    _build_other_things_first()

    loaded = keras.saving.load_model(run.model_file)
    loaded.optimizer.bind(loaded)  # the loaded slots are restored by key now

    assert isinstance(loaded, OptBranchesV1)
    assert isinstance(loaded.optimizer, kss.StableOptimizer)
    assert type(loaded.optimizer.inner_optimizer) is run.inner_class
    assert loaded.optimizer.inner_optimizer.get_config() == run.inner_config
    assert loaded.optimizer.built
    _assert_same_arrays(_weights(loaded), run.weights, f"{name}: model variables")
    loaded_slots = slots_by_key(loaded.optimizer)
    assert all(k.startswith(("path:", "optimizer#")) for k in loaded_slots), sorted(loaded_slots)
    _assert_same_arrays(loaded_slots, run.slots, f"{name}: optimizer variables by key")
    assert _iterations(loaded.optimizer) == _updates(name, STEPS)


# ---------------------------------------------------------------------------
# Custom loops, one per backend
# ---------------------------------------------------------------------------
def _grads_for(variables, step):
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=tuple(v.shape)).astype("float32") for v in variables]


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply custom loops are a JAX-backend path")
@pytest.mark.parametrize("name", NAMES)
def test_jax_stateless_apply_matches_inner(name):
    import jax

    model = _built(OptBranchesV1)
    bare = OPTIMIZERS[name]()
    wrapped = kss.StableOptimizer(OPTIMIZERS[name]())
    bare.build(model.trainable_variables)
    wrapped.build(model.trainable_variables)
    assert len(bare.variables) == len(wrapped.variables)
    initial = [to_np(v) for v in model.trainable_variables]

    results = []
    for opt in (bare, wrapped):
        step = jax.jit(opt.stateless_apply)
        train_vals = [v.value for v in model.trainable_variables]
        opt_vals = [v.value for v in opt.variables]
        for i in range(STEPS):
            train_vals, opt_vals = step(opt_vals, _grads_for(model.trainable_variables, i), train_vals)
        results.append(([np.asarray(a) for a in train_vals], [np.asarray(a) for a in opt_vals]))

    (bare_t, bare_o), (wrap_t, wrap_o) = results
    assert any(not np.array_equal(a, b) for a, b in zip(bare_t, initial, strict=True)), "did not move"
    for i, (a, b) in enumerate(zip(bare_t, wrap_t, strict=True)):
        assert np.array_equal(a, b), f"{name}: trainable variable #{i} differs"
    for i, (a, b) in enumerate(zip(bare_o, wrap_o, strict=True)):
        assert np.array_equal(a, b), f"{name}: optimizer variable #{i} differs"
    # Stateless: neither the live optimizer variables nor the model moved.
    assert _iterations(bare) == _iterations(wrapped) == 0
    assert all(np.array_equal(to_np(v), a) for v, a in zip(model.trainable_variables, initial, strict=True))


def _custom_loop_pairs(name):
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
    _assert_moved(after, initial, name)
    _assert_same_arrays(_weights(wrapped), after, f"{name}: parameters")
    assert len(bare_opt.variables) == len(wrapped_opt.variables)
    for i, (a, b) in enumerate(zip(bare_opt.variables, wrapped_opt.variables, strict=True)):
        assert np.array_equal(to_np(a), to_np(b)), f"{name}: optimizer variable #{i} differs"


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.function + tf.GradientTape loops need the TensorFlow backend"
)
@pytest.mark.parametrize("name", NAMES)
def test_tensorflow_gradient_tape_loop_matches_inner(name):
    import tensorflow as tf

    x, y = _batches()
    pairs = _custom_loop_pairs(name)
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


@pytest.mark.skipif(BACKEND != "torch", reason="torch autograd loops need the Torch backend")
@pytest.mark.parametrize("name", NAMES)
def test_torch_autograd_loop_matches_inner(name):
    import torch

    x, y = _batches()
    pairs = _custom_loop_pairs(name)
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
