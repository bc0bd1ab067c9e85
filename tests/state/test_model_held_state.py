"""Issue 31, item 5: state a model holds besides its weights and optimizers.

* A ``keras.Model`` subclass with its own ``keras.metrics.Mean`` trackers and two
  optimizers (the GAN pattern of Keras' guides), trained by a custom loop and resumed
  through a ``CheckpointManager``: weights, both optimizers and the trackers' ``total`` /
  ``count`` come back, and every metric recorded after the resume equals the
  uninterrupted run's (every backend).
* A ``keras.layers.TorchModuleWrapper`` around a module with ``BatchNorm1d`` (Torch): its
  buffers (running statistics, ``num_batches_tracked``) are saved and restored exactly,
  and ``predict`` after a restore equals the saved model's.
* What is still left fresh is named in the report.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND, to_np
from keras import layers
from kit import grads

import keras_stable_state as kss

RNG = np.random.default_rng(11)
REAL = RNG.normal(size=(8, 8, 4)).astype("float32")  # 8 steps of 8 samples
NOISE = RNG.normal(size=(8, 8, 2)).astype("float32")


class GAN(keras.Model):
    """The GAN of Keras' guides, small: two sub-models, two optimizers, own loss trackers."""

    def __init__(self, seed, **kwargs):
        super().__init__(**kwargs)
        keras.utils.set_random_seed(seed)
        self.discriminator = keras.Sequential(
            [keras.Input((4,)), layers.Dense(8, activation="relu"), layers.Dense(1)], name="discriminator"
        )
        self.generator = keras.Sequential(
            [keras.Input((2,)), layers.Dense(8, activation="relu"), layers.Dense(4)], name="generator"
        )
        self.d_optimizer = keras.optimizers.Adam(1e-2)
        self.g_optimizer = keras.optimizers.Adam(1e-2)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def call(self, z):
        return self.discriminator(self.generator(z))


def _gan(seed):
    gan = GAN(seed)
    gan(NOISE[0])
    gan.d_optimizer.build(gan.discriminator.trainable_variables)
    gan.g_optimizer.build(gan.generator.trainable_variables)
    return gan


def _step(gan, i):
    """One step of the custom loop on batch ``i``; the trackers' results after it."""
    disc, gen = gan.discriminator, gan.generator
    real, z = REAL[i], NOISE[i]
    ops = keras.ops

    def d_loss():
        return ops.mean(ops.softplus(-disc(real))) + ops.mean(ops.softplus(disc(gen(z))))

    def g_loss():
        return ops.mean(ops.softplus(-disc(gen(z))))

    d_value = float(to_np(ops.stop_gradient(d_loss())))
    gan.d_optimizer.apply(grads(d_loss, disc.trainable_variables), disc.trainable_variables)
    g_value = float(to_np(ops.stop_gradient(g_loss())))
    gan.g_optimizer.apply(grads(g_loss, gen.trainable_variables), gen.trainable_variables)
    gan.d_loss_tracker.update_state(d_value)
    gan.g_loss_tracker.update_state(g_value)
    return float(to_np(gan.d_loss_tracker.result())), float(to_np(gan.g_loss_tracker.result()))


def _state(gan):
    """Every variable of the run, by position: weights, both optimizers, tracker totals/counts."""
    out = [to_np(v) for v in gan.weights]
    out += [to_np(v) for v in gan.d_optimizer.variables] + [to_np(v) for v in gan.g_optimizer.variables]
    out += [to_np(v) for v in gan.metrics_variables]
    return out


def test_gan_custom_loop_resumed_with_the_manager_equals_the_uninterrupted_run(tmp_path):
    reference = _gan(seed=1)
    recorded = [_step(reference, i) for i in range(8)]
    assert [float(to_np(v)) for v in reference.metrics_variables][1::2] == [8.0, 8.0]  # both counts

    first = _gan(seed=1)
    before = [_step(first, i) for i in range(4)]
    assert before == recorded[:4]
    with kss.CheckpointManager(tmp_path / "ckpts") as mgr:
        mgr.save(4, first, metrics={"d_loss": before[-1][0], "g_loss": before[-1][1]})

    resumed = _gan(seed=2)  # other initial weights: everything must come from the checkpoint
    with kss.CheckpointManager(tmp_path / "ckpts") as mgr:
        report = mgr.restore(resumed)
    assert mgr.restored_step == 4
    assert not report.left_fresh and not report.dropped
    assert "metrics" in report.restored_state
    assert [float(to_np(v)) for v in resumed.metrics_variables][1::2] == [4.0, 4.0]
    after = [_step(resumed, i) for i in range(4, 8)]
    assert after == recorded[4:]  # every metric recorded after the resume, by position
    for i, (a, b) in enumerate(zip(_state(resumed), _state(reference), strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {i}")


def test_metric_trackers_round_trip_through_save_training_state(tmp_path):
    saved = _gan(seed=1)
    for i in range(3):
        _step(saved, i)
    kss.save_training_state(tmp_path / "gan.h5", saved)
    other = _gan(seed=2)
    _step(other, 0)
    report = kss.restore_training_state(tmp_path / "gan.h5", other)
    for a, b in zip(saved.metrics_variables, other.metrics_variables, strict=True):
        np.testing.assert_array_equal(to_np(b), to_np(a))
    assert [float(to_np(v)) for v in other.metrics_variables][1::2] == [3.0, 3.0]
    assert "metrics" in report.restored_state and not report.left_fresh

    # include_metrics=False keeps the live values, and says so.
    fresh = _gan(seed=2)
    report = kss.restore_training_state(tmp_path / "gan.h5", fresh, include_metrics=False)
    assert [float(to_np(v)) for v in fresh.metrics_variables] == [0.0, 0.0, 0.0, 0.0]
    assert "metrics" not in report.restored_state


def test_a_file_without_metric_values_names_them_left_fresh(tmp_path):
    from keras_stable_state import format
    from keras_stable_state.format.writer import write_record

    saved = _gan(seed=1)
    _step(saved, 0)
    kss.save_training_state(tmp_path / "gan.h5", saved)
    record = format.read_file(tmp_path / "gan.h5")
    del record.extra["providers"]["metrics"]  # as written before metric variables were saved
    record.arrays = {k: v for k, v in record.arrays.items() if not k.startswith("providers/metrics")}
    write_record(tmp_path / "old.h5", record)
    other = _gan(seed=2)
    report = kss.restore_training_state(tmp_path / "old.h5", other)
    assert sorted(report.left_fresh) == [
        "metric:d_loss/count",
        "metric:d_loss/total",
        "metric:g_loss/count",
        "metric:g_loss/total",
    ]
    assert "metric:d_loss/count" in str(report)
    for a, b in zip(saved.weights, other.weights, strict=True):
        np.testing.assert_array_equal(to_np(b), to_np(a))


# -- wrapped Torch modules ---------------------------------------------------------------------
# Its own model: a wrapped torch.nn.Module with BatchNorm buffers, the state the tests check.
def _torch_model(seed):
    import torch

    keras.utils.set_random_seed(seed)
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    inputs = keras.Input((4,))
    model = keras.Model(
        inputs, layers.TorchModuleWrapper(module, name="wrapped", output_shape=(None, 1))(inputs)
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model, module


@pytest.mark.skipif(
    BACKEND != "torch", reason="TorchModuleWrapper wraps a torch.nn.Module: Torch backend only"
)
@pytest.mark.parametrize("how", ["save_training_state", "manager"])
def test_wrapped_torch_module_buffers_restore_exactly(tmp_path, how):
    x = RNG.normal(size=(32, 4)).astype("float32")
    y = x[:, :1] * 2.0 + 1.0
    model, module = _torch_model(seed=1)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    buffers = {n: b.detach().clone().numpy() for n, b in module.named_buffers()}
    assert int(buffers["1.num_batches_tracked"]) == 8
    predicted = model.predict(x, verbose=0)

    other, other_module = _torch_model(seed=2)
    other.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # other statistics, 1 batch tracked
    if how == "manager":
        with kss.CheckpointManager(tmp_path / "ckpts") as mgr:
            mgr.save(8, model)
            report = mgr.restore(other)
    else:
        kss.save_training_state(tmp_path / "run.h5", model)
        report = kss.restore_training_state(tmp_path / "run.h5", other)
    assert not report.left_fresh
    restored = dict(other_module.named_buffers())
    assert sorted(restored) == sorted(buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for name, want in buffers.items():
        np.testing.assert_array_equal(restored[name].detach().numpy(), want, err_msg=name)
        assert f"buffer:layers/wrapped/{name}" in report.restored_state
    np.testing.assert_array_equal(other.predict(x, verbose=0), predicted)
    for a, b in zip(model.weights, other.weights, strict=True):
        np.testing.assert_array_equal(to_np(b), to_np(a))


@pytest.mark.skipif(
    BACKEND != "torch", reason="TorchModuleWrapper wraps a torch.nn.Module: Torch backend only"
)
def test_buffers_absent_from_the_file_are_named_left_fresh(tmp_path):
    x = RNG.normal(size=(16, 4)).astype("float32")
    model, _ = _torch_model(seed=1)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    kss.save_training_state(tmp_path / "run.h5", model, model_state="trainable")  # no buffers saved
    other, other_module = _torch_model(seed=2)
    before = {n: b.detach().clone().numpy() for n, b in other_module.named_buffers()}
    report = kss.restore_training_state(tmp_path / "run.h5", other)
    assert sorted(k for k in report.left_fresh if k.startswith("buffer:")) == [
        "buffer:layers/wrapped/1.num_batches_tracked",
        "buffer:layers/wrapped/1.running_mean",
        "buffer:layers/wrapped/1.running_var",
    ]
    for name, b in other_module.named_buffers():
        np.testing.assert_array_equal(b.detach().numpy(), before[name])
