"""Restore options: variables outside the model (issue 9, fault 6), report wording
(fault 12), deferred restore and per-key mappers."""

import re

import keras
import numpy as np
import pytest
from conftest import BACKEND, to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state._optimizer import keyed_optimizer_entries as _keyed_optimizer_entries


def _slots(optimizer, model, extras=None):
    """``{entry key: numpy array}`` keyed by ``model``'s paths and ``extras``' names."""
    return {e.key: to_np(e.variable) for e in _keyed_optimizer_entries(optimizer, model, extras)}


def _step(optimizer, variables, scale=1.0):
    grads = [keras.ops.ones(v.shape) * scale for v in variables]
    optimizer.apply(grads, variables)


def _trained_with_temperature():
    """A custom loop training ``log_alpha`` next to the model (SAC's temperature)."""
    model = mlp(4, 3, named=True, optimizer=None)
    log_alpha = keras.Variable(0.5, name="log_alpha")
    opt = keras.optimizers.Adam(0.1)
    for i in range(3):
        _step(opt, [*model.trainable_variables, log_alpha], scale=1.0 + i)
    return model, log_alpha, opt


# -- fault 6: variables outside the model --------------------------------------------
def test_extra_variable_value_and_slots_restored_by_key(tmp_path):
    model, log_alpha, opt = _trained_with_temperature()
    kss.save_training_state(tmp_path / "s.h5", model, opt, variables={"log_alpha": log_alpha})
    model2, log_alpha2, opt2 = (
        mlp(4, 3, named=True, optimizer=None),
        keras.Variable(0.5, name="log_alpha"),
        keras.optimizers.Adam(0.1),
    )
    report = kss.restore_training_state(tmp_path / "s.h5", model2, opt2, variables={"log_alpha": log_alpha2})
    np.testing.assert_array_equal(to_np(log_alpha2), to_np(log_alpha))
    assert float(to_np(log_alpha2)) != 0.5
    assert report.matched["var:log_alpha"] == "name"
    assert report.matched["var:log_alpha#momentums"] == "name"
    assert report.built_optimizer and len(opt2._trainable_variables) == 5
    assert not report.by_order and not report.left_fresh and not report.dropped
    saved = _slots(opt, model, {"log_alpha": log_alpha})
    live = _slots(opt2, model2, {"log_alpha": log_alpha2})
    assert saved.keys() == live.keys() and "var:log_alpha#velocities" in live
    for k in saved:
        np.testing.assert_array_equal(live[k], saved[k], err_msg=k)
    # training continues identically
    _step(opt, [*model.trainable_variables, log_alpha])
    _step(opt2, [*model2.trainable_variables, log_alpha2])
    np.testing.assert_array_equal(to_np(log_alpha2), to_np(log_alpha))


def test_slot_of_variable_outside_model_refused_at_save_naming_it(tmp_path):
    model, _, opt = _trained_with_temperature()
    with pytest.raises(kss.BindingError, match=r"log_alpha.*variables=\{'log_alpha': .*\}"):
        kss.save_training_state(tmp_path / "s.h5", model, opt)
    assert not (tmp_path / "s.h5").exists()


def test_extra_variable_missing_at_restore(tmp_path):
    model, log_alpha, opt = _trained_with_temperature()
    kss.save_training_state(tmp_path / "s.h5", model, opt, variables={"log_alpha": log_alpha})
    model2 = mlp(4, 3, named=True, optimizer=None)
    opt2 = keras.optimizers.Adam(0.1)
    with pytest.raises(kss.BindingError, match=r"var:log_alpha.*variables=\{'log_alpha'"):
        kss.restore_training_state(tmp_path / "s.h5", model2, opt2)
    assert not opt2.built
    report = kss.restore_training_state(tmp_path / "s.h5", model2, opt2, strict=False)
    assert set(report.dropped) == {"var:log_alpha", "var:log_alpha#momentums", "var:log_alpha#velocities"}
    assert "not passed in `variables=`" in report.dropped_reasons["var:log_alpha"]
    assert "not passed in `variables=`" in str(report)


def test_extra_variable_not_in_file(tmp_path):
    model = mlp(4, 3, named=True, optimizer=None)
    opt = keras.optimizers.Adam(0.1)
    _step(opt, model.trainable_variables)
    kss.save_training_state(tmp_path / "s.h5", model, opt)
    extra = keras.Variable(1.0, name="log_alpha")
    with pytest.raises(kss.BindingError, match=r"var:log_alpha"):
        kss.restore_training_state(
            tmp_path / "s.h5", mlp(4, 3, named=True, optimizer=None), opt, variables={"log_alpha": extra}
        )
    report = kss.restore_training_state(
        tmp_path / "s.h5",
        mlp(4, 3, named=True, optimizer=None),
        keras.optimizers.Adam(0.1),
        strict=False,
        variables={"log_alpha": extra},
    )
    assert "var:log_alpha" in report.left_fresh and float(to_np(extra)) == 1.0


def test_variables_argument_checked():
    model = mlp(4, 3, named=True, optimizer=None)
    v = keras.Variable(1.0)
    with pytest.raises(TypeError, match=r"`variables` of save_training_state must be a dict"):
        kss.save_training_state("x.h5", model, variables=[v])
    with pytest.raises(TypeError, match=r"variables\['t'\].*keras.Variable"):
        kss.save_training_state("x.h5", model, variables={"t": 1.0})
    with pytest.raises(ValueError, match=r"names .* non-empty strings"):
        kss.save_training_state("x.h5", model, variables={"a#b": v})
    with pytest.raises(ValueError, match=r"path:layers/hidden/kernel"):
        kss.save_training_state("x.h5", model, variables={"k": model.get_layer("hidden").kernel})
    with pytest.raises(ValueError, match=r"both 'a' and 'b'"):
        kss.restore_training_state("x.h5", model, variables={"a": v, "b": v})


def test_var_key_grammar():
    key = kss.VariableKey.parse("var:log_alpha")
    assert key.kind == "var" and key.named and str(key) == "var:log_alpha"
    with pytest.raises(kss.KeyFormatError):
        kss.VariableKey.parse("var:a/b")


# -- fault 12: report wording -----------------------------------------------------------
def test_drop_reasons_are_distinct(tmp_path):
    model = mlp(4, 3, named=True, optimizer=None)
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    x = np.ones((4, 4), "float32")
    model.fit(x, x[:, :1], verbose=0)
    kss.save_training_state(tmp_path / "s.h5", model)
    # renamed layer: its weights and slots are "not in the model", not "no longer trained"
    renamed = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="hidden"), keras.layers.Dense(1, name="head")]
    )
    renamed.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    report = kss.restore_training_state(tmp_path / "s.h5", renamed, strict=False)
    assert "path:layers/out/kernel" in report.dropped
    assert report.dropped_reasons["path:layers/out/kernel"].startswith("not in the model")
    assert report.dropped_reasons["path:layers/out/kernel#momentums"].startswith("not in the model")
    text = str(report)
    assert "no longer trained" not in text and "not in the model (renamed or removed)" in text
    assert "path:layers/head/kernel#momentums" in report.left_fresh
    # frozen layer: "no longer trained"
    frozen = mlp(4, 3, named=True, optimizer=None)
    frozen.get_layer("hidden").trainable = False
    frozen.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    report = kss.restore_training_state(tmp_path / "s.h5", frozen, strict=False)
    assert report.dropped_reasons["path:layers/hidden/kernel#momentums"] == "no longer trained"
    assert "dropped (no longer trained)" in str(report)
    # no optimizer: every optimizer key dropped with its own reason
    bare = mlp(4, 3, named=True, optimizer=None)
    report = kss.restore_training_state(tmp_path / "s.h5", bare)
    assert "optimizer#iteration" in report.dropped
    assert set(report.dropped) == set(_slots(model.optimizer, model))
    assert {r for r in report.dropped_reasons.values()} == {
        "no optimizer to restore into (compile the model or pass optimizer=)"
    }
    assert "dropped (no optimizer to restore into" in str(report)
    assert "no longer trained" not in str(report)


def test_report_never_prints_order_keys_for_slots_of_path_keyed_variables(tmp_path):
    model, log_alpha, opt = _trained_with_temperature()
    kss.save_training_state(tmp_path / "s.h5", model, opt, variables={"log_alpha": log_alpha})
    bigger = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="hidden"),
            keras.layers.Dense(1, name="out"),
            keras.layers.Dense(1, name="new"),
        ]
    )
    report = kss.restore_training_state(
        tmp_path / "s.h5",
        bigger,
        keras.optimizers.Adam(0.1),
        strict=False,
        variables={"log_alpha": keras.Variable(0.5)},
    )
    assert "path:layers/new/kernel#momentums" in report.left_fresh
    assert not re.search(r"order:[0-9]", str(report))


# -- deferred restore: before the model is built ----------------------------------------
def _unbuilt():
    model = keras.Sequential([keras.layers.Dense(3, name="hidden"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model


def _trained_compiled(tmp_path):
    src = mlp(4, 3, named=True, optimizer=None)
    src.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    src.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0)
    kss.save_training_state(tmp_path / "s.h5", src)
    return src, x


def test_deferred_restore_waits_for_the_variables(tmp_path):
    src, x = _trained_compiled(tmp_path)
    dst = _unbuilt()
    pending = kss.restore_training_state(tmp_path / "s.h5", dst, defer=True)
    assert isinstance(pending, kss.PendingRestore) and not pending.done
    (tmp_path / "s.h5").unlink()  # the arrays were read (and checked) already
    dst.build((None, 4))
    report = pending.restore()
    assert pending.done and pending.report is report and report.built_optimizer
    for a, b in zip(src.variables, dst.variables, strict=True):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    assert _slots(dst.optimizer, dst).keys() == _slots(src.optimizer, src).keys()
    with pytest.raises(kss.StateError, match=r"already restored"):
        pending.restore()


def test_deferred_restore_as_fit_callback(tmp_path):
    src, x = _trained_compiled(tmp_path)
    dst = _unbuilt()
    pending = kss.restore_training_state(tmp_path / "s.h5", dst, defer=True)
    if BACKEND == "tensorflow":  # fit builds the model inside its first step: too late
        with pytest.raises(kss.StateError, match=r"not built .* by on_train_begin .*pending.restore\(\)"):
            dst.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[pending])
        assert not pending.done
        dst = _unbuilt()
        pending = kss.restore_training_state(tmp_path / "s.h5", dst, defer=True)
        dst.build((None, 4))
        pending.restore()
    dst.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[pending])
    assert pending.done
    assert int(to_np(dst.optimizer.iterations)) == int(to_np(src.optimizer.iterations)) + 2


def test_deferred_restore_checks_file_now_and_model_later(tmp_path):
    src, x = _trained_compiled(tmp_path)
    (tmp_path / "bad.h5").write_bytes(b"not a checkpoint")
    with pytest.raises(kss.StateError):
        kss.restore_training_state(tmp_path / "bad.h5", _unbuilt(), defer=True)
    other = keras.Sequential([keras.layers.Dense(5, name="hidden"), keras.layers.Dense(1, name="out")])
    pending = kss.restore_training_state(tmp_path / "s.h5", other, defer=True)
    other.build((None, 4))
    with pytest.raises(kss.ContractError):
        pending.restore()
    assert not pending.done
    with pytest.raises(TypeError, match=r"`defer`"):
        kss.restore_training_state(tmp_path / "s.h5", other, defer="yes")


def test_deferred_restore_of_built_model_restores_at_once(tmp_path):
    _trained_compiled(tmp_path)
    dst = mlp(4, 3, named=True, optimizer=None)
    dst.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    pending = kss.restore_training_state(tmp_path / "s.h5", dst, defer=True)
    assert pending.done and isinstance(pending.report, kss.RestoreReport)
