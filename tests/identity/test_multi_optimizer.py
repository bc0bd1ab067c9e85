"""Several optimizers and parameter groups (issue 9, faults 5 and 9).

* A GAN-like model holding ``d_optimizer`` and ``g_optimizer`` as attributes:
  every optimizer the model tracks is saved under its attribute name and
  restored into a fresh model; ``optimizer={"d": ..., "g": ...}`` for custom loops.
* ``MultiOptimizer`` parameter groups: the record holds each variable's group by
  stable key; an unbuilt optimizer is routed as saved, a live one that routes
  differently is refused naming the change; per-group clipping is kept.
"""

import keras
import numpy as np
import pytest
from conftest import to_np
from keras import layers
from kit import grads

import keras_stable_state as kss
from keras_stable_state._optimizer import optimizer_entries

RNG = np.random.default_rng(5)
Z = RNG.normal(size=(8, 4)).astype("float32")
T = RNG.normal(size=(8, 4)).astype("float32")
L = RNG.normal(size=(8, 1)).astype("float32")


def _apply(opt, grads, variables):
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            opt.apply(grads, variables)
    else:
        opt.apply(grads, variables)


# -- fault 5: a GAN-like model with two optimizers as attributes ---------------------------
class Gan(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = layers.Dense(4, name="generator")
        self.discriminator = layers.Dense(1, name="discriminator")
        self.d_optimizer = keras.optimizers.Adam(1e-2)
        self.g_optimizer = keras.optimizers.RMSprop(1e-2, momentum=0.9)

    def call(self, z):
        return self.discriminator(self.generator(z))

    def step(self):
        """One discriminator step, then one generator step (a custom ``train_step``)."""
        d_vars = self.discriminator.trainable_variables
        d_grads = grads(
            lambda: (
                keras.ops.mean(keras.ops.subtract(self.discriminator(T), L) ** 2)
                + keras.ops.mean(self.discriminator(self.generator(Z)) ** 2)
            ),
            d_vars,
        )
        _apply(self.d_optimizer, d_grads, d_vars)
        g_vars = self.generator.trainable_variables
        g_grads = grads(lambda: keras.ops.mean((self.discriminator(self.generator(Z)) - 1.0) ** 2), g_vars)
        _apply(self.g_optimizer, g_grads, g_vars)


def _gan():
    gan = Gan()
    gan(Z)
    gan.compile()  # Keras' default optimizer: tracked too, never built by these steps
    return gan


def _state(opt, model, name):
    entries = optimizer_entries(
        opt, kss.VariableRegistry.from_model(model, opt._trainable_variables), name=name
    )
    return {e.key: to_np(e.variable) for e in entries}


def _same(got, want, what):
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


@pytest.mark.parametrize("explicit", [False, True], ids=["tracked", "explicit-dict"])
def test_gan_saves_and_restores_both_optimizers(tmp_path, explicit):
    gan = _gan()
    for _ in range(8):
        gan.step()
    path = tmp_path / "gan.h5"
    given = {"d": gan.d_optimizer, "g": gan.g_optimizer} if explicit else None
    names = ("d", "g") if explicit else ("d_optimizer", "g_optimizer")
    kss.save_training_state(path, gan, given)
    want = {n: _state(o, gan, n) for n, o in zip(names, (gan.d_optimizer, gan.g_optimizer), strict=True)}
    assert all(any(k.startswith("path:generator/") for k in want[names[1]]) for _ in [0])
    for _ in range(3):
        gan.step()
    reference = {v.path.split("/", 1)[1]: to_np(v) for v in gan.trainable_variables}

    fresh = _gan()
    given = {"d": fresh.d_optimizer, "g": fresh.g_optimizer} if explicit else None
    report = kss.restore_training_state(path, fresh, given)
    assert report.built_optimizer
    assert int(to_np(fresh.d_optimizer.iterations)) == int(to_np(fresh.g_optimizer.iterations)) == 8
    for name, opt in zip(names, (fresh.d_optimizer, fresh.g_optimizer), strict=True):
        _same(_state(opt, fresh, name), want[name], name)
    for _ in range(3):
        fresh.step()
    for v in fresh.trainable_variables:
        np.testing.assert_allclose(to_np(v), reference[v.path.split("/", 1)[1]], rtol=1e-6, atol=1e-7)


def test_gan_restore_refuses_a_missing_optimizer_by_name(tmp_path):
    gan = _gan()
    gan.step()
    kss.save_training_state(tmp_path / "gan.h5", gan)
    fresh = _gan()
    del fresh.g_optimizer
    with pytest.raises(
        kss.BindingError, match=r"optimizers \['g_optimizer'\], which the model does not track"
    ):
        kss.restore_training_state(tmp_path / "gan.h5", fresh)


# -- fault 9: MultiOptimizer parameter groups -----------------------------------------------
class Tower(keras.Model):
    """Layers named by Keras' counter (``dense``, ``dense_1``...): their ``variable.path``
    depends on what was built before, so path patterns route them differently."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = layers.Dense(4)
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.body(x))


def _multi():
    # The body's group clips its gradients hard: a lost group would show in the numbers.
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(1e-2, momentum=0.9),
            {".*/dense/.*": keras.optimizers.Adam(1e-2, clipnorm=1e-2)},
        )
    )


def _tower():
    model = Tower()
    model(Z)
    return model


def _train(model, opt, n):
    variables = model.trainable_variables
    for _ in range(n):
        _apply(opt, grads(lambda: keras.ops.mean(keras.ops.subtract(model(Z), L) ** 2), variables), variables)


def _groups(model, opt):
    multi = opt.inner_optimizer if isinstance(opt, kss.StableOptimizer) else opt
    where = {id(v): f"{a}/{v.name}" for a in ("body", "head") for v in getattr(model, a).weights}
    return {where[id(v)]: multi._var_to_optimizer_idx[multi._var_key(v)] for v in model.trainable_variables}


def _saved_run(tmp_path):
    keras.backend.clear_session(free_memory=False)
    model = _tower()  # first Dense of the session: the body is "dense"
    opt = _multi()
    opt.build(model.trainable_variables)
    assert _groups(model, opt) == {"body/kernel": 0, "body/bias": 0, "head/kernel": 1, "head/bias": 1}
    _train(model, opt, 4)
    kss.save_training_state(tmp_path / "m.h5", model, opt)
    _train(model, opt, 2)
    return {f"{a}/{v.name}": to_np(v) for a in ("body", "head") for v in getattr(model, a).weights}


def _later_tower():
    """The same model built after other Dense layers: its body is "dense_2" now."""
    layers.Dense(2).build((None, 3))
    layers.Dense(2).build((None, 3))
    return _tower()


def test_unbuilt_multi_optimizer_is_routed_as_saved_and_continues_exactly(tmp_path):
    reference = _saved_run(tmp_path)
    model = _later_tower()
    opt = _multi()
    report = kss.restore_training_state(tmp_path / "m.h5", model, opt)
    assert report.built_optimizer and report.by_order == []
    # Routed by the record, not by the patterns (which would send the body to SGD now).
    assert _groups(model, opt) == {"body/kernel": 0, "body/bias": 0, "head/kernel": 1, "head/bias": 1}
    _train(model, opt, 2)
    for a in ("body", "head"):
        for v in getattr(model, a).weights:
            np.testing.assert_allclose(to_np(v), reference[f"{a}/{v.name}"], rtol=1e-6, atol=1e-7)


def test_built_multi_optimizer_routing_differently_is_refused_naming_the_change(tmp_path):
    _saved_run(tmp_path)
    model = _later_tower()
    opt = _multi()
    opt.build(model.trainable_variables)  # the patterns route the body ("dense_2") to SGD
    assert _groups(model, opt)["body/kernel"] == 1
    with pytest.raises(
        kss.BindingError,
        match=r"parameter groups of model.optimizer differ.*path:body/kernel: saved in group 0, "
        r"the live MultiOptimizer routes it to group 1 \(SGD; its pattern sees variable.path '.*dense_[0-9]+/kernel'\)",
    ):
        kss.restore_training_state(tmp_path / "m.h5", model, opt)


@keras.saving.register_keras_serializable(package="tests_multi")
class SavedTower(Tower):
    pass


def test_load_model_with_other_routing_is_refused_naming_the_groups(tmp_path):
    keras.backend.clear_session(free_memory=False)
    model = SavedTower()
    model(Z)
    opt = kss.StableOptimizer(_multi(), model=model)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(Z, L)
    model.save(tmp_path / "m.keras")
    layers.Dense(2).build((None, 3))
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    with pytest.raises(
        kss.BindingError, match=r"Parameter groups differ: .* saved in group optimizers/0.*group optimizers/1"
    ):
        loaded.optimizer.bind(loaded)
