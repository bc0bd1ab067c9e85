"""Issue 31, item 4: the optimizer's iteration counter and variables re-typed between float
dtypes. A wrapped (negative) counter is refused at save; ``StableCheckpoint`` warns at train
begin when the planned batches would wrap it (naming the global step); ``allow_cast=True``
restores a variable whose float dtype changed (bfloat16, float16, float32, either way),
listed in ``report.casts`` and, where the cast can round, in ``report.lossy``; without it
the refusal names ``allow_cast=True``."""

import os

import keras
import numpy as np
import pytest
from conftest import to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format

FLOATS = ("bfloat16", "float16", "float32")
EXACT = {("bfloat16", "float32"), ("float16", "float32")}
OUT = ("path:layers/dense_1/kernel", "path:layers/dense_1/bias")


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    return x, x[:, :1] * 0.5


def _counter(model):
    return model.optimizer.iterations


def _limit(model):
    return int(np.iinfo(np.dtype(keras.backend.standardize_dtype(_counter(model).dtype))).max)


# -- the counter -----------------------------------------------------------------------------
def test_a_wrapped_counter_is_refused_at_save_naming_it(tmp_path):
    model = mlp(seed=1, optimizer="plain")
    x, y = _batch()
    model.train_on_batch(x, y)
    limit = _limit(model)
    _counter(model).assign(limit)
    model.train_on_batch(x, y)  # one step past the maximum: Keras wraps it without a word
    wrapped = int(to_np(_counter(model)))
    assert wrapped == -limit - 1
    with pytest.raises(
        kss.StateError, match=rf"optimizer#iteration.*is {wrapped}, negative.*TensorFlow"
    ) as e:
        kss.save_training_state(tmp_path / "run.h5", model)
    assert (e.value.key, e.value.received) == ("optimizer#iteration", wrapped)
    assert not os.path.exists(tmp_path / "run.h5")
    with kss.CheckpointManager(tmp_path / "ckpts") as mgr, pytest.raises(kss.StateError, match="negative"):
        mgr.save(1, model)
    assert mgr.all_steps() == []


def test_a_counter_at_its_maximum_still_saves_and_restores(tmp_path):
    model = mlp(seed=1, optimizer="plain")
    x, y = _batch()
    model.train_on_batch(x, y)
    limit = _limit(model)
    _counter(model).assign(limit)
    kss.save_training_state(tmp_path / "run.h5", model)
    other = mlp(seed=2, optimizer="plain")
    other.train_on_batch(x, y)
    report = kss.restore_training_state(tmp_path / "run.h5", other)
    assert int(to_np(_counter(other))) == limit
    assert [c[0] for c in report.counters_near_limit] == ["optimizer#iteration"]


def test_fit_warns_at_train_begin_naming_the_step_that_wraps_the_counter(tmp_path):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x[:, :1] * 0.5
    model = mlp(seed=1, optimizer="plain")
    model.train_on_batch(x[:8], y[:8])
    limit = _limit(model)
    _counter(model).assign(limit - 2)  # 4 batches an epoch: the third wraps it (global step 3)
    ckpt = kss.StableCheckpoint(tmp_path / "ckpts")
    with (
        pytest.warns(kss.InexactResumeWarning, match=r"wraps to -\d+ at global step 3 \(epoch 0, batch 2\)"),
        pytest.raises(kss.StateError, match="negative"),  # and the epoch-end save is refused
    ):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ckpt])
    assert ckpt.checkpoints() == []


def test_fit_far_from_the_counter_limit_does_not_warn(tmp_path):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model = mlp(seed=1, optimizer="plain")
    model.train_on_batch(x[:8], x[:8, :1])
    _counter(model).assign(_limit(model) - 4)  # exactly the 4 planned batches: at the maximum, no wrap
    ckpt = kss.StableCheckpoint(tmp_path / "ckpts")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ckpt])
    assert int(to_np(_counter(model))) == _limit(model)
    assert len(ckpt.checkpoints()) == 1


# -- re-typed float variables ----------------------------------------------------------------
def _saved_and_other(tmp_path, src, dst):
    x, y = _batch()
    saved = mlp(seed=1, out_dtype=src)
    saved.train_on_batch(x, y)
    kss.save_training_state(tmp_path / "run.h5", saved)
    other = mlp(seed=2, out_dtype=dst)
    other.train_on_batch(x, y)
    return saved, other


@pytest.mark.parametrize("src,dst", [(a, b) for a in FLOATS for b in FLOATS if a != b])
@pytest.mark.parametrize("strict", [True, False])
def test_float_variable_retyped_since_save_restores_with_allow_cast(tmp_path, src, dst, strict):
    saved, other = _saved_and_other(tmp_path, src, dst)
    report = kss.restore_training_state(tmp_path / "run.h5", other, allow_cast=True, strict=strict)
    out_keys = {k for k, _, _ in report.casts}
    assert {k for k in out_keys if "#" not in k} == set(OUT)
    assert all((s, d) == (src, dst) for _, s, d in report.casts)
    assert set(report.lossy) == (set() if (src, dst) in EXACT else out_keys)
    assert not report.left_fresh and not report.dropped
    assert [to_np(v).dtype for v in other.layers[-1].weights] == [format.numpy_dtype(dst)] * 2
    for a, b in zip(saved.weights, other.weights, strict=True):  # every weight, by position
        want = to_np(a).astype(to_np(b).dtype)
        np.testing.assert_array_equal(to_np(b).astype("float32"), want.astype("float32"))
    for a, b in zip(saved.optimizer.variables, other.optimizer.variables, strict=True):
        want = to_np(a).astype(to_np(b).dtype)
        np.testing.assert_array_equal(to_np(b).astype("float64"), want.astype("float64"))


@pytest.mark.parametrize("strict", [True, False])
def test_float_variable_retyped_without_allow_cast_is_refused_naming_it(tmp_path, strict):
    saved, other = _saved_and_other(tmp_path, "bfloat16", "float32")
    before = [to_np(v) for v in other.weights]
    with pytest.raises(kss.ContractError, match=r"(?s)re-typed.*bfloat16.*pass allow_cast=True") as e:
        kss.restore_training_state(tmp_path / "run.h5", other, strict=strict)
    assert "strict=False" not in str(e.value) and "frozen" not in str(e.value).split("\n", 2)[-1]
    assert [k for k, _, _ in e.value.retyped] == list(OUT)
    for a, b in zip(before, other.weights, strict=True):
        np.testing.assert_array_equal(to_np(b), a)
