"""A restore puts every value back where the variable lives: on its device (Torch, TensorFlow),
on its sharding (JAX: each sharded array built once from the host, straight onto its
sharding).

``make test-device`` runs this file on a machine's real devices (a GPU: the variables live
there) and, on JAX, with 4 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``) for the sharded case; ``make test``
runs the one-device case on every backend and skips the sharded one with its reason.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND, to_np

import keras_stable_state as kss


def _where(variable):
    """Where a variable's value lives: its JAX sharding, or its device's name."""
    value = variable.value
    if BACKEND == "jax":
        return value.sharding
    return str(value.device)


def _all(model):
    return [*model.weights, *model.optimizer.variables]


def _trained(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, name="hidden"), keras.layers.Dense(1, name="out")]
    )
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    rng = np.random.default_rng(seed)
    model.fit(rng.normal(size=(32, 6)), rng.normal(size=(32, 1)), batch_size=8, verbose=0)
    return model


@pytest.mark.parametrize("ext", [".h5", ".keras"])
def test_a_restore_lands_on_each_variables_device(tmp_path, ext):
    model = _trained()
    path = str(tmp_path / f"state{ext}")
    kss.save_training_state(path, model)
    saved = [to_np(v) for v in _all(model)]
    where = [_where(v) for v in _all(model)]
    for v in _all(model):  # other values, same variables
        v.assign(keras.ops.zeros(v.shape, dtype=v.dtype))
    kss.restore_training_state(path, model)
    for i, (v, a, w) in enumerate(zip(_all(model), saved, where, strict=True)):
        np.testing.assert_array_equal(to_np(v), a, err_msg=f"variable {i} ({v.path})")
        assert _where(v) == w, f"variable {i} ({v.path}) moved from {w} to {_where(v)}"


def _jax_devices():
    if BACKEND != "jax":
        return 0
    import jax

    return jax.device_count()


@pytest.mark.skipif(
    _jax_devices() < 4,
    reason="keras.distribution shards over JAX devices: needs 4 (make test-device simulates 4 CPU devices)",
)
def test_a_sharded_restore_keeps_each_layout_and_copies_each_shard_once(tmp_path, monkeypatch):
    import jax

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden.*kernel"] = (None, "model")
    layout_map[".*hidden.*bias"] = ("model",)
    layout_map[".*out.*kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    try:
        model = _trained()
        path = str(tmp_path / "state.h5")
        kss.save_training_state(path, model)
        saved = [to_np(v) for v in _all(model)]
        fresh = _trained(seed=3)  # another model, the same layouts
        where = [_where(v) for v in _all(fresh)]
        sharded = [v for v in _all(fresh) if len(v.value.sharding.device_set) > 1]
        assert sharded, "nothing was sharded: the test would check nothing"
        placed = []  # (shape) of each array built from the host onto its sharding
        real = jax.make_array_from_callback

        def counted(shape, sharding, callback, *args, **kwargs):
            placed.append(tuple(shape))
            return real(shape, sharding, callback, *args, **kwargs)

        monkeypatch.setattr(jax, "make_array_from_callback", counted)
        kss.restore_training_state(path, fresh)
        monkeypatch.undo()
        for i, (v, a, w) in enumerate(zip(_all(fresh), saved, where, strict=True)):
            np.testing.assert_array_equal(to_np(v), a, err_msg=f"variable {i} ({v.path})")
            assert _where(v).is_equivalent_to(w, v.value.ndim), f"variable {i} ({v.path}) changed its layout"
        # each sharded variable is built from the host once, straight onto its sharding
        # (each device receives its own block), never gathered or placed twice
        assert sorted(placed) == sorted(tuple(v.shape) for v in sharded), (placed, [v.path for v in sharded])
    finally:
        keras.distribution.set_distribution(None)


_COMPILES: list = []  # JAX compile events seen while _RECORDING holds True
_RECORDING = [False]


@pytest.mark.skipif(BACKEND != "jax", reason="XLA compilation at restore time is JAX's (jnp conversions)")
def test_a_restore_compiles_no_xla_program(tmp_path):
    """A restore moves host arrays to the device without compiling anything: under JAX 0.10
    ``jnp.asarray`` of a NumPy array stages it through a jitted identity (one compilation
    per new shape, and the first one starts XLA's compile-alarm thread, which aborts the
    process when a memory limit forbids a new thread). Shapes never used before in this
    process, so that any compilation would happen here (or be looked up in JAX's cache:
    the trace event fires either way)."""
    import jax

    if not _COMPILES and not getattr(jax.monitoring, "_kss_listening", False):
        jax.monitoring.register_event_duration_secs_listener(
            lambda name, secs, **kw: _COMPILES.append(name) if _RECORDING[0] else None
        )
        jax.monitoring._kss_listening = True
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(13, name="odd"), keras.layers.Dense(3)])
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    model.optimizer.build(model.trainable_variables)
    path = str(tmp_path / "state.h5")
    kss.save_training_state(path, model)
    saved = [to_np(v) for v in _all(model)]
    for v in _all(model):
        v.assign(np.full(v.shape, 5, dtype=v.dtype))
    _COMPILES.clear()
    _RECORDING[0] = True
    try:
        kss.restore_training_state(path, model)
    finally:
        _RECORDING[0] = False
    assert [n for n in _COMPILES if n.startswith("/jax/core/compile")] == []
    for i, (v, a) in enumerate(zip(_all(model), saved, strict=True)):
        np.testing.assert_array_equal(to_np(v), a, err_msg=f"variable {i} ({v.path})")
