"""Explicit binding (issue 9, faults 1, 7 and 10).

* An optimizer is bound to its model explicitly (``StableOptimizer(inner,
  model=...)``, ``bind(model)``, or by save/restore/StableCheckpoint through the
  model given); nothing is found by scanning stack frames, and slots are never
  keyed by registration order unless the caller asks (``allow_order_keys``).
* Callbacks are keyed by a name the caller gives.
* Custom optimizers that keep slots in dicts, pair lists or attributes restore
  every slot onto its own variable, or are refused by name.
* A checkpoint taken mid-window is refused by an optimizer with another
  ``gradient_accumulation_steps``.
"""

import keras
import numpy as np
import pytest
from conftest import to_np
from keras import layers

import keras_stable_state as kss

RNG = np.random.default_rng(3)
X = RNG.normal(size=(16, 4)).astype("float32")
Y = RNG.normal(size=(16, 1)).astype("float32")


class _Branches(keras.Model):
    """Two same-shape Dense branches created in ``order``: a permuted order swaps their slots."""

    order = ("a", "b")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for attr in self.order:
            setattr(self, attr, layers.Dense(3, name=attr))
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.a(x) * 0.5 + self.b(x) * 1.5)


@keras.saving.register_keras_serializable(package="tests_binding")
class BranchesAB(_Branches):
    order = ("a", "b")


@keras.saving.register_keras_serializable(package="tests_binding")
class BranchesBA(_Branches):
    order = ("b", "a")


# Its own model: subclassed, with its branches created in either order, what binding must not see.
def _model(order=("a", "b")):
    model = BranchesAB() if order == ("a", "b") else BranchesBA()
    model(X[:1])
    return model


def _grads(model, x=X, y=Y):
    """Gradients of the MSE on one batch, by each backend's autodiff."""
    backend = keras.backend.backend()
    variables = model.trainable_variables
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return tape.gradient(loss, variables)
    if backend == "torch":
        import torch

        model.zero_grad()
        loss = torch.mean(torch.square(model(torch.from_numpy(x)) - torch.from_numpy(y)))
        loss.backward()
        return [v.value.grad.detach().clone() for v in variables]
    import jax

    def loss_fn(values):
        out, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables], x)
        return jax.numpy.mean((out - y) ** 2)

    return jax.grad(loss_fn)([v.value for v in variables])


def _step(model, opt, n=1):
    for _ in range(n):
        grads = _grads(model)
        if keras.backend.backend() == "torch":
            import torch

            with torch.no_grad():
                opt.apply(grads, model.trainable_variables)
        else:
            opt.apply(grads, model.trainable_variables)


def _by_attr(model, opt):
    """``{"a/kernel#m": array}``: slots by the attribute of their variable, whatever the order."""
    where = {id(v): f"{attr}/{v.name}" for attr in ("a", "b", "head") for v in getattr(model, attr).weights}
    return {
        f"{where[id(e.reference)]}#{e.key.split('#')[1]}": to_np(e.variable)
        for e in opt.entries()
        if e.is_slot
    }


# -- fault 1: explicit binding ----------------------------------------------------------
class Trainer:
    """A custom loop that holds its model on ``self.model`` (no model in any local)."""

    def __init__(self, optimizer):
        self.model = _model()
        self.optimizer = optimizer
        self.optimizer.build(self.model.trainable_variables)

    def train(self, n):
        _step(self.model, self.optimizer, n)


@pytest.mark.slow
def test_unbound_optimizer_refuses_to_key_slots_naming_the_fix(tmp_path):
    trainer = Trainer(kss.StableOptimizer(keras.optimizers.Adam(1e-2)))
    trainer.train(2)
    with pytest.raises(kss.BindingError, match=r"not bound to a model.*bind\(model\).*allow_order_keys=True"):
        trainer.optimizer.entries()


def test_model_save_with_unbound_optimizer_raises_binding_error(tmp_path):
    model = _model()
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    model.train_on_batch(X, Y)
    with pytest.raises(kss.BindingError, match=r"StableOptimizer\(inner, model=model\)"):
        model.save(tmp_path / "m.keras")


def test_explicit_model_keys_slots_by_path_in_a_trainer_class():
    trainer = Trainer(kss.StableOptimizer(keras.optimizers.Adam(1e-2)))
    trainer.optimizer.bind(trainer.model)
    trainer.train(2)
    keys = [e.key for e in trainer.optimizer.entries() if e.is_slot]
    assert keys and all(k.startswith("path:") for k in keys), keys
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=trainer.model)
    opt.build(trainer.model.trainable_variables)
    assert [e.key for e in opt.entries()] == [e.key for e in trainer.optimizer.entries()]


def test_bind_to_a_sub_model_is_refused_naming_the_variables_outside_it():
    outer = _model()
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2))
    opt.build(outer.trainable_variables)
    sub = keras.Sequential([outer.a])
    with pytest.raises(kss.BindingError, match=r"does not hold: \[.*b/kernel.*head/bias'\]"):
        opt.bind(sub)
    with pytest.raises(TypeError, match="binds to a keras.Model"):
        opt.bind(outer.a)


def test_order_keys_only_when_asked_and_the_report_says_so(tmp_path):
    model = _model()
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), allow_order_keys=True)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(X, Y)
    keys = [e.key for e in opt.entries() if e.is_slot]
    assert keys and all(k.startswith("order:") for k in keys)
    assert kss.StableOptimizer.from_config(opt.get_config()).allow_order_keys
    model.save(tmp_path / "m.keras")  # allowed: keyed by order
    report = kss.restore_training_state(tmp_path / "m.keras", model)
    assert report.order_keys and all(k.startswith("order:") for k in report.order_keys)
    assert "allow_order_keys=True" in str(report)


def test_load_model_state_waits_for_bind_and_training_before_it_raises(tmp_path):
    model = _model()
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(X, Y)
    saved = {e.key: to_np(e.variable) for e in opt.entries()}
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    with pytest.raises(kss.BindingError, match=r"not applied yet.*bind\(model\)"):
        loaded.train_on_batch(X, Y)
    loaded.optimizer.bind(loaded)
    got = {e.key: to_np(e.variable) for e in loaded.optimizer.entries()}
    assert set(got) == set(saved)
    for k in saved:
        np.testing.assert_array_equal(got[k], saved[k])


def test_a_load_whose_assignment_fails_puts_every_slot_back_and_stays_pending():
    """``StableOptimizer``'s own load path is all or nothing past the checks too: when an
    assignment raises, every slot already assigned gets its value from before back, and the
    loaded state stays pending (its ``variables`` refuse, as a training step does)."""
    model = _model()
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(X, Y)
    store = {}
    opt.save_own_variables(store)
    model.train_on_batch(X, Y)  # the slots move on from the stored ones
    slots = {e.key: e.variable for e in opt.entries()}  # (read directly: entries() refuses while pending)
    before = {key: to_np(var) for key, var in slots.items()}
    failing = list(slots.values())[len(slots) // 2]  # the ones before it are assigned first

    def refuse(value):
        raise RuntimeError("assignment refused")

    failing.assign = refuse
    try:
        with pytest.raises(RuntimeError, match="assignment refused"):
            opt.load_own_variables(store)
    finally:
        del failing.assign
    for key, value in before.items():
        np.testing.assert_array_equal(to_np(slots[key]), value, err_msg=key)
    with pytest.raises(kss.BindingError, match=r"not applied yet"):
        _ = opt.variables


def test_stable_checkpoint_binds_the_fit_models_optimizer(tmp_path):
    model = _model()
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss="mse")
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path / "c")])
    assert opt.bound_model() is model
    model.save(tmp_path / "m.keras")


# -- fault 1: callbacks by name -----------------------------------------------------------
def test_callbacks_are_keyed_by_the_callers_names(tmp_path):
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    es = keras.callbacks.EarlyStopping(patience=5)
    es.set_model(model)
    es.on_train_begin()
    es.wait, es.best = 3, 0.25
    kss.save_training_state(tmp_path / "s.h5", model, callbacks={"stop": es})
    back = keras.callbacks.EarlyStopping(patience=5)
    report = kss.restore_training_state(tmp_path / "s.h5", model, callbacks={"stop": back})
    assert "callback:stop" in report.restored_state
    assert (back.wait, back.best) == (3, 0.25)
    other = keras.callbacks.EarlyStopping(patience=5)
    report = kss.restore_training_state(tmp_path / "s.h5", model, callbacks={"other": other})
    assert "callback:other" in report.left_fresh
    with pytest.raises(
        ValueError, match="`callbacks` names of save_training_state must be non-empty strings without .#."
    ):
        kss.save_training_state(tmp_path / "s.h5", model, callbacks={"a#b": es})


def test_stable_checkpoint_saves_the_fit_callbacks_named_or_not(tmp_path):
    def fit(directory, named, epochs):
        model = _model()
        model.compile(optimizer=kss.StableOptimizer(keras.optimizers.SGD(1e-2)), loss="mse")
        es = keras.callbacks.EarlyStopping(monitor="loss", patience=50)
        ckpt = kss.StableCheckpoint(directory, callbacks={"es": es} if named else None)
        model.fit(X, Y, epochs=epochs, batch_size=8, verbose=0, callbacks=[ckpt, es])
        return ckpt

    fit(tmp_path / "named", True, 1)
    resumed = fit(tmp_path / "named", True, 2)
    assert "callback:es" in resumed.restore_report.restored_state
    # An unnamed stateful sibling is saved too (issue 33), keyed by class and position among
    # the fit's callbacks of that class, with the fit call's History; nothing is warned.
    fit(tmp_path / "none", False, 1)
    resumed = fit(tmp_path / "none", False, 2)
    assert resumed.restore_report is not None
    assert sorted(s for s in resumed.restore_report.restored_state if s.startswith("callback:")) == [
        "callback:EarlyStopping/0",
        "callback:History/0",
    ]


# -- fault 7: custom optimizers' slot containers ------------------------------------------
class _Custom(keras.optimizers.Optimizer):
    """Momentum SGD whose slots live in ``container``: "dict" (keyed by variable.path, all
    named "m"), "pairs" (a list of (variable, slot)), "attrs" (one attribute each, created
    with add_variable_from_reference), or "unaligned" (a list one longer than the variables,
    all named "m": the order decides, so it is refused)."""

    container = "dict"

    def __init__(self, learning_rate=0.05, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        kind = self.container
        if kind == "dict":
            self._m = {v.path: self.add_variable(v.shape, name="m") for v in var_list}
        elif kind == "pairs":
            self._m = [(v, self.add_variable(v.shape, name="m")) for v in var_list]
        elif kind == "attrs":
            self._names = []
            for i, v in enumerate(var_list):
                setattr(self, f"_m{i}", self.add_variable_from_reference(v, "m"))
                self._names.append(f"_m{i}")
        else:
            self._m = [self.add_variable(v.shape, name="m") for v in [*var_list, var_list[0]]]

    def _slot(self, variable):
        kind = self.container
        # `variable` may be the backend's own (TensorFlow): look it up by index.
        index = self._get_variable_index(variable)
        if kind == "dict":
            return self._m[self._trainable_variables[index].path]
        if kind == "pairs":
            return self._m[index][1]
        if kind == "attrs":
            return getattr(self, self._names[index])
        return self._m[index]

    def update_step(self, gradient, variable, learning_rate):
        m = self._slot(variable)
        self.assign(m, keras.ops.add(keras.ops.multiply(m, 0.9), gradient))
        self.assign_sub(variable, keras.ops.multiply(m, keras.ops.cast(learning_rate, variable.dtype)))


@pytest.mark.parametrize("container", ["dict", "pairs", "attrs"])
def test_custom_slot_containers_restore_onto_their_own_variables(tmp_path, container):
    opt_cls = type(f"Custom_{container}", (_Custom,), {"container": container})
    model = _model(("a", "b"))
    opt = kss.StableOptimizer(opt_cls(), model=model)
    opt.build(model.trainable_variables)
    _step(model, opt, 3)
    want = _by_attr(model, opt)
    assert any(np.any(a != 0) for a in want.values())
    kss.save_training_state(tmp_path / "s.h5", model, opt)
    _step(model, opt, 1)
    after = {v.path.split("/", 1)[1]: to_np(v) for v in model.trainable_variables}

    permuted = _model(("b", "a"))
    opt2 = kss.StableOptimizer(opt_cls(), model=permuted)
    opt2.build(permuted.trainable_variables)
    report = kss.restore_training_state(tmp_path / "s.h5", permuted, opt2)
    assert report.by_order == []
    got = _by_attr(permuted, opt2)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    _step(permuted, opt2, 1)
    for v in permuted.trainable_variables:
        np.testing.assert_allclose(to_np(v), after[v.path.split("/", 1)[1]], rtol=1e-6, atol=1e-7)


def test_custom_slots_whose_order_decides_are_refused_by_name(tmp_path):
    opt_cls = type("Custom_unaligned", (_Custom,), {"container": "unaligned"})
    model = _model()
    opt = kss.StableOptimizer(opt_cls(), model=model)
    opt.build(model.trainable_variables)
    with pytest.raises(kss.BindingError, match=r"share a name.*\('m', 7\).*depend on their order"):
        kss.save_training_state(tmp_path / "s.h5", model, opt)


# -- fault 10: the accumulation window ------------------------------------------------------
@pytest.mark.slow
def test_mid_window_checkpoint_refused_by_another_accumulation_window(tmp_path):
    model = _model()
    opt = keras.optimizers.SGD(1e-2, gradient_accumulation_steps=4)
    opt.build(model.trainable_variables)
    _step(model, opt, 6)  # one update applied, 2 micro-steps into the second window
    kss.save_training_state(tmp_path / "s.h5", model, opt)

    model2 = _model()
    other = keras.optimizers.SGD(1e-2, gradient_accumulation_steps=2)
    other.build(model2.trainable_variables)
    with pytest.raises(
        kss.BindingError,
        match=r"gradient_accumulation_steps=4, the live one has gradient_accumulation_steps=2\. "
        r"The checkpoint was taken 2 micro-step",
    ) as err:
        kss.restore_training_state(tmp_path / "s.h5", model2, other)
    assert (err.value.key, err.value.expected, err.value.received) == ("gradient_accumulation_steps", 4, 2)

    same = keras.optimizers.SGD(1e-2, gradient_accumulation_steps=4)
    same.build(model2.trainable_variables)
    kss.restore_training_state(tmp_path / "s.h5", model2, same)
    assert int(to_np(same._iterations)) == 6


def test_a_stepped_optimizer_bound_to_an_uncompiled_model_is_not_left_out_of_a_save(tmp_path):
    """A custom loop's StableOptimizer (the model is not compiled with it) left out of a
    save: refused naming it and the fix, as for a torch.optim optimizer; passed, or before
    its first step (nothing to lose), the save goes through."""
    model = keras.Sequential([keras.Input((3,)), layers.Dense(2)])
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    opt.build(model.trainable_variables)
    kss.save_training_state(str(tmp_path / "before.h5"), model)  # iterations 0: nothing lost
    grads = [keras.ops.ones(v.shape) for v in model.trainable_variables]
    opt.apply(grads, model.trainable_variables)
    with pytest.raises(
        kss.StateError, match=r"'stable_optimizer' \(StableOptimizer\).*stepped 1 times.*optimizer=opt"
    ) as caught:
        kss.save_training_state(str(tmp_path / "left-out.h5"), model)
    assert caught.value.key == opt.name
    assert not (tmp_path / "left-out.h5").exists()
    path = kss.save_training_state(str(tmp_path / "passed.h5"), model, optimizer=opt)
    fresh = keras.Sequential([keras.Input((3,)), layers.Dense(2)])
    fresh_opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=fresh)
    kss.restore_training_state(path, fresh, optimizer=fresh_opt)
    assert int(to_np(fresh_opt.iterations)) == 1
    for a, b in zip(opt.variables, fresh_opt.variables, strict=True):
        np.testing.assert_array_equal(to_np(a), to_np(b))


def test_a_stepped_keras_optimizer_of_a_custom_loop_is_not_left_out_of_a_save(tmp_path):
    """A plain Keras optimizer (not wrapped, the model not compiled with it) that trained the
    model in a custom loop, and a save given no optimizer at all: refused naming it."""
    model = keras.Sequential([keras.Input((3,)), layers.Dense(2)])
    adam = keras.optimizers.Adam(1e-2)
    adam.build(model.trainable_variables)
    kss.save_training_state(str(tmp_path / "before.h5"), model)  # not stepped: nothing lost
    adam.apply([keras.ops.ones(v.shape) for v in model.trainable_variables], model.trainable_variables)
    with pytest.raises(kss.StateError, match=r"\(Adam\) trains model .*stepped 1 times.*optimizer=opt"):
        kss.save_training_state(str(tmp_path / "left-out.h5"), model)
    assert not (tmp_path / "left-out.h5").exists()
    other = keras.Sequential([keras.Input((3,)), layers.Dense(2)])  # trained by nothing
    kss.save_training_state(str(tmp_path / "other.h5"), other)
