"""Transfer learning: wrapped and nested models (issue 9, fault 8) and the
fine-tuning learning rate (fault 11)."""

import keras
import numpy as np
import pytest
from conftest import to_np

import keras_stable_state as kss
from keras_stable_state._optimizer import keyed_optimizer_entries as _keyed_optimizer_entries


def _slots(optimizer, model, extras=None):
    """``{entry key: numpy array}`` keyed by ``model``'s paths and ``extras``' names."""
    return {e.key: to_np(e.variable) for e in _keyed_optimizer_entries(optimizer, model, extras)}


def _base(name="base"):
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="d0"), keras.layers.Dense(4, name="d1")], name=name
    )


def _auto_base():
    """Layers without chosen names: their keys are 'dense', 'dense_1' (as the wrapper's head)."""
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)], name="base")


def _x():
    return np.random.default_rng(0).normal(size=(8, 4)).astype("float32")


def _trained_base(make=_base, lr=1e-3):
    base = make()
    base.compile(optimizer=keras.optimizers.Adam(lr), loss="mse")
    base.fit(_x(), _x(), epochs=2, batch_size=4, verbose=0)
    return base


def _sequential_wrapper(base):
    wrap = keras.Sequential([keras.Input((4,)), base, keras.layers.Dense(4)])
    wrap.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return wrap


def _functional_wrapper(base):
    inp = keras.Input((4,))
    wrap = keras.Model(inp, keras.layers.Dense(4)(base(inp)))
    wrap.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return wrap


WRAPPERS = {"sequential": _sequential_wrapper, "functional": _functional_wrapper}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("strict", [True, False])
def test_no_bind_across_scopes(tmp_path, wrapper, strict):
    """The base's first layer ('dense') must never land on the wrapper's head ('dense')."""
    src = _trained_base(_auto_base)
    kss.save_training_state(tmp_path / "b.h5", src)
    wrap = WRAPPERS[wrapper](_auto_base())
    head = wrap.layers[-1]
    before = to_np(head.kernel)
    with pytest.raises(kss.BindingError, match=r"nested .*prefix='layers/base'"):
        kss.restore_training_state(tmp_path / "b.h5", wrap, strict=strict)
    np.testing.assert_array_equal(to_np(head.kernel), before)
    assert not wrap.optimizer.built


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_prefix_restores_base_into_wrapper(tmp_path, wrapper):
    src = _trained_base()
    kss.save_training_state(tmp_path / "b.h5", src)
    base = _base()
    wrap = WRAPPERS[wrapper](base)
    report = kss.restore_training_state(tmp_path / "b.h5", wrap, strict=False, prefix="layers/base")
    for a, b in zip(src.variables, base.variables, strict=True):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    saved, live = _slots(src.optimizer, src), _slots(wrap.optimizer, wrap)
    for key, value in saved.items():
        new = key if key.startswith("optimizer#") else key.replace("path:", "path:layers/base/", 1)
        np.testing.assert_array_equal(live[new], value, err_msg=new)
    assert ("path:layers/d0/kernel", "path:layers/base/layers/d0/kernel") in report.renamed
    assert "path:layers/dense/kernel#momentums" in report.left_fresh
    assert len(wrap.optimizer._trainable_variables) == 6
    assert "renamed" in str(report)
    wrap.fit(_x(), _x(), verbose=0)  # the optimizer trains every variable of the wrapper


def test_rename_rules_restore_wrapper_state_into_bare_base(tmp_path):
    wrap = _sequential_wrapper(_base())
    wrap.fit(_x(), _x(), verbose=0)
    kss.save_training_state(tmp_path / "w.h5", wrap)
    base = _base()
    base.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    with pytest.raises(kss.BindingError, match=r"contains this model at 'layers/base'"):
        kss.restore_training_state(tmp_path / "w.h5", base, strict=False)
    rules = [(r"^path:layers/base/", "path:")]
    with pytest.raises(kss.BindingError, match=r"no rename rule matches.*path:layers/dense/kernel"):
        kss.restore_training_state(tmp_path / "w.h5", base, rename=rules)
    report = kss.restore_training_state(tmp_path / "w.h5", base, strict=False, rename=rules)
    for a, b in zip(wrap.get_layer("base").variables, base.variables, strict=True):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    assert report.dropped_reasons["path:layers/dense/kernel"] == "no rename rule matches"
    assert report.dropped_reasons["path:layers/dense/kernel#momentums"] == "no rename rule matches"
    np.testing.assert_array_equal(to_np(base.optimizer.iterations), to_np(wrap.optimizer.iterations))


def test_rename_arguments_checked(tmp_path):
    src = _trained_base()
    kss.save_training_state(tmp_path / "b.h5", src)
    wrap = _sequential_wrapper(_base())
    with pytest.raises(ValueError, match=r"`prefix` .* Received: prefix='/layers/base/'"):
        kss.restore_training_state(tmp_path / "b.h5", wrap, prefix="/layers/base/")
    with pytest.raises(ValueError, match=r"either `prefix` or `rename`"):
        kss.restore_training_state(tmp_path / "b.h5", wrap, prefix="a", rename=[("a", "b")])
    with pytest.raises(TypeError, match=r"`rename` .* list of \(pattern, replacement\)"):
        kss.restore_training_state(tmp_path / "b.h5", wrap, rename={"a": "b"})
    with pytest.raises(ValueError, match=r"rename rule .*'\('.*not a valid regular expression"):
        kss.restore_training_state(tmp_path / "b.h5", wrap, rename=[("(", "x")])
    with pytest.raises(
        ValueError, match=r"rename rule .* turns 'path:layers/d0/kernel' into 'layers/d0/kernel'"
    ):
        kss.restore_training_state(tmp_path / "b.h5", wrap, strict=False, rename=[("^path:", "")])
    assert not wrap.optimizer.built


def test_unbuilt_wrapper_optimizer_never_built_on_nested_base(tmp_path):
    src = _trained_base()
    kss.save_training_state(tmp_path / "b.h5", src)
    base = _base()
    wrap = _sequential_wrapper(base)
    with pytest.raises(kss.BindingError, match=r"'base' is used as a layer inside another model"):
        kss.restore_training_state(tmp_path / "b.h5", base, wrap.optimizer)
    assert not wrap.optimizer.built
    kss.restore_training_state(tmp_path / "b.h5", wrap, strict=False, prefix="layers/base")
    wrap.fit(_x(), _x(), verbose=0)


def test_built_wrapper_optimizer_into_nested_base_names_outside_variables(tmp_path):
    src = _trained_base()
    kss.save_training_state(tmp_path / "b.h5", src)
    base = _base()
    wrap = _sequential_wrapper(base)
    wrap.fit(_x(), _x(), verbose=0)
    before = _slots(wrap.optimizer, wrap)
    with pytest.raises(kss.BindingError, match=r"outside model 'base'.*dense/kernel.*prefix="):
        kss.restore_training_state(tmp_path / "b.h5", base, wrap.optimizer, strict=False)
    after = _slots(wrap.optimizer, wrap)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


# -- fault 11: fine-tuning learning rate ------------------------------------------------
def test_finetuning_learning_rate_replacement_reported_or_kept(tmp_path):
    src = _trained_base(lr=1e-3)
    src.get_layer("d0").trainable = False
    src.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    src.fit(_x(), _x(), verbose=0)
    kss.save_training_state(tmp_path / "s.h5", src)
    # unfreeze, compile at 1e-4
    dst = _base()
    dst.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    report = kss.restore_training_state(tmp_path / "s.h5", dst, strict=False)
    assert float(to_np(dst.optimizer.learning_rate)) == pytest.approx(1e-3)
    assert len(report.learning_rates) == 1
    key, live, saved, action = report.learning_rates[0]
    assert key == "optimizer#learning_rate" and action == "replaced"
    assert live == pytest.approx(1e-4) and saved == pytest.approx(1e-3)
    assert "learning rate optimizer#learning_rate: compiled 0.0001 replaced by saved 0.001" in str(report)
    assert "keep_learning_rate=True" in str(report)
    assert len(dst.optimizer._trainable_variables) == 4  # d0 unfrozen: built on all it trains
    dst.fit(_x(), _x(), verbose=0)
    # keep the compiled value
    dst = _base()
    dst.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    report = kss.restore_training_state(tmp_path / "s.h5", dst, strict=False, keep_learning_rate=True)
    assert float(to_np(dst.optimizer.learning_rate)) == pytest.approx(1e-4)
    assert report.learning_rates[0][3] == "kept"
    assert "optimizer#learning_rate" not in report.matched
    assert "compiled 0.0001 kept (saved 0.001)" in str(report)
    assert int(to_np(dst.optimizer.iterations)) == int(to_np(src.optimizer.iterations))


def test_same_learning_rate_not_reported(tmp_path):
    src = _trained_base(lr=1e-3)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = _base()
    dst.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    report = kss.restore_training_state(tmp_path / "s.h5", dst)
    assert report.learning_rates == [] and "learning rate" not in str(report)


def test_keep_learning_rate_with_schedule_skips_schedule_check(tmp_path):
    src = _base()
    sched = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=10, decay_rate=0.9)
    src.compile(optimizer=keras.optimizers.Adam(sched), loss="mse")
    src.fit(_x(), _x(), verbose=0)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = _base()
    dst.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    with pytest.raises(kss.ScheduleMismatchError):
        kss.restore_training_state(tmp_path / "s.h5", dst)
    kss.restore_training_state(tmp_path / "s.h5", dst, keep_learning_rate=True)
    assert float(to_np(dst.optimizer.learning_rate)) == pytest.approx(1e-4)
