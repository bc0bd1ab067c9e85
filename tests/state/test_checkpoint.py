"""save_training_state / restore_training_state: formats, checks, all-or-nothing."""

import os
import zipfile

import keras
import numpy as np
import pytest
from conftest import BACKEND, slots_by_key, to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.format import writer
from keras_stable_state.format.record import MEMBER
from keras_stable_state.format.writer import write_record


def _trained(data, opt=None, epochs=2):
    x, y = data
    m = mlp(4, 8, activation="relu", named=True, optimizer=opt or "stable")
    m.fit(x, y, epochs=epochs, batch_size=8, verbose=0, shuffle=False)
    return m


def _weights(m):
    return [to_np(v) for v in m.variables]


def _assert_same_state(a, b):
    for va, vb in zip(_weights(a), _weights(b), strict=True):
        np.testing.assert_array_equal(va, vb)
    sa, sb = slots_by_key(a.optimizer), slots_by_key(b.optimizer)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize("ext", ["keras", "h5"])
def test_round_trip_into_compiled_unbuilt_optimizer(tmp_path, data, ext):
    src = _trained(data)
    path = tmp_path / f"state.{ext}"
    kss.save_training_state(path, src)
    dst = mlp(4, 8, activation="relu", named=True)
    assert not dst.optimizer.built
    report = kss.restore_training_state(path, dst)
    assert report.built_optimizer
    _assert_same_state(src, dst)
    assert int(dst.optimizer.iterations) == 8
    assert not report.by_order and not report.left_fresh and not report.dropped
    assert len(report.by_name) == len(src.variables) + len(src.optimizer.variables)
    assert report.writer["backend"] == BACKEND and report.writer["keras_version"] == keras.__version__


def test_plain_optimizer_saved_by_key_too(tmp_path, data):
    src = _trained(data, opt=keras.optimizers.RMSprop(1e-2, momentum=0.5))
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = mlp(4, 8, activation="relu", named=True, optimizer=keras.optimizers.RMSprop(1e-2, momentum=0.5))
    kss.restore_training_state(tmp_path / "s.h5", dst)
    _assert_same_state(src, dst)


def test_keras_file_still_loads_with_load_model(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.keras", src)
    with zipfile.ZipFile(tmp_path / "s.keras") as zf:
        assert MEMBER in zf.namelist() and "model.weights.h5" in zf.namelist()
    back = keras.saving.load_model(tmp_path / "s.keras")
    assert isinstance(back.optimizer, kss.StableOptimizer)
    back.optimizer.bind(back)  # the loaded slots are restored by key now
    _assert_same_state(src, back)
    x, _ = data
    np.testing.assert_array_equal(src.predict(x, verbose=0), back.predict(x, verbose=0))


@pytest.mark.parametrize("kind", ["weights.h5", "keras"])
def test_stock_keras_file_restores_by_order_with_report(tmp_path, data, kind):
    src = _trained(data, opt=keras.optimizers.Adam(1e-2))
    path = tmp_path / f"stock.{kind}"
    src.save_weights(path) if kind == "weights.h5" else src.save(path)
    dst = mlp(4, 8, activation="relu", named=True, optimizer=keras.optimizers.Adam(1e-2))
    report = kss.restore_training_state(path, dst)
    assert report.source.startswith("stock Keras")
    assert report.by_order and not report.by_name
    assert len(report.by_order) == len(src.variables) + len(src.optimizer.variables)
    _assert_same_state(src, dst)


def test_stock_file_count_mismatch_names_first_slot(tmp_path, data):
    src = _trained(data, opt=keras.optimizers.Adam(1e-2))
    src.save_weights(tmp_path / "stock.weights.h5")
    dst = mlp(4, 8, activation="relu", named=True, optimizer=keras.optimizers.SGD(1e-2, momentum=0.9))
    before = _weights(dst)
    with pytest.raises(
        kss.BindingError, match=r"positional order.*first that differs is #\d+ \(path:"
    ) as err:
        kss.restore_training_state(tmp_path / "stock.weights.h5", dst)
    assert err.value.expected != err.value.received
    for a, b in zip(before, _weights(dst), strict=True):  # all-or-nothing: nothing assigned
        np.testing.assert_array_equal(a, b)


def test_stock_file_shape_mismatch_names_slot(tmp_path, data):
    src = _trained(data, opt=keras.optimizers.Adam(1e-2))
    src.save_weights(tmp_path / "stock.weights.h5")
    # same variable count and shapes as a set, other order: hidden first is (4, 8) vs (8, 1)
    x, _ = data
    dst = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    dst.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    dst.optimizer.build(list(reversed(dst.trainable_variables)))
    with pytest.raises(
        kss.BindingError, match=r"Positional optimizer variable #2 .*path:layers/dense_1/bias"
    ):
        kss.restore_training_state(tmp_path / "stock.weights.h5", dst)


def test_restore_is_all_or_nothing(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="hidden"), keras.layers.Dense(2, name="out")]
    )
    dst.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=dst), loss="mse")
    before = _weights(dst)
    with pytest.raises(kss.ContractError, match="reshaped: path:layers/out/kernel saved"):
        kss.restore_training_state(tmp_path / "s.h5", dst)
    for a, b in zip(before, _weights(dst), strict=True):
        np.testing.assert_array_equal(a, b)


def _rewrite(path, out, fn):
    record = format.read_file(path)
    fn(record)
    write_record(out, record)


def test_float_dtype_difference_raises_unless_cast_allowed(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)

    def to_half(record):
        record.model["path:layers/hidden/kernel"] = record.model["path:layers/hidden/kernel"].astype(
            "float16"
        )

    _rewrite(tmp_path / "s.h5", tmp_path / "half.h5", to_half)
    dst = mlp(4, 8, activation="relu", named=True)
    with pytest.raises(
        kss.DtypeMismatchError, match=r"path:layers/hidden/kernel is float16.*allow_cast=True"
    ) as e:
        kss.restore_training_state(tmp_path / "half.h5", dst)
    assert (e.value.key, e.value.expected, e.value.received) == (
        "path:layers/hidden/kernel",
        "float32",
        "float16",
    )
    report = kss.restore_training_state(tmp_path / "half.h5", dst, allow_cast=True)
    assert ("path:layers/hidden/kernel", "float16", "float32") in report.casts
    want = to_np(src.layers[0].kernel).astype("float16").astype("float32")
    np.testing.assert_array_equal(to_np(dst.layers[0].kernel), want)


def test_integer_counter_cast_with_range_check(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)
    live = str(src.optimizer.iterations.dtype)
    other = "int32" if live == "int64" else "int64"

    def retype(record):
        record.optimizer["optimizer#iteration"] = record.optimizer["optimizer#iteration"].astype(other)

    _rewrite(tmp_path / "s.h5", tmp_path / "int.h5", retype)
    dst = mlp(4, 8, activation="relu", named=True)
    report = kss.restore_training_state(tmp_path / "int.h5", dst)
    assert ("optimizer#iteration", other, live) in report.casts
    assert int(dst.optimizer.iterations) == 8

    def huge(record):
        record.optimizer["optimizer#iteration"] = np.array(2**63, dtype="uint64")

    _rewrite(tmp_path / "s.h5", tmp_path / "huge.h5", huge)
    with pytest.raises(kss.DtypeMismatchError, match=r"optimizer#iteration .*does not fit .*wrap around"):
        kss.restore_training_state(tmp_path / "huge.h5", mlp(4, 8, activation="relu", named=True))


def test_frozen_layer_raises_contract_error_or_drops_slots(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = mlp(4, 8, activation="relu", named=True)
    dst.get_layer("hidden").trainable = False
    dst.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=dst), loss="mse")
    with pytest.raises(
        kss.ContractError, match=r"missing .*path:layers/hidden/kernel.*path:layers/hidden/bias"
    ) as e:
        kss.restore_training_state(tmp_path / "s.h5", dst)
    assert e.value.missing == ["path:layers/hidden/kernel", "path:layers/hidden/bias"]
    report = kss.restore_training_state(tmp_path / "s.h5", dst, strict=False)
    assert sorted(report.dropped) == sorted(
        f"path:layers/hidden/{v}#{s}" for v in ("kernel", "bias") for s in ("momentums", "velocities")
    )
    saved, live = slots_by_key(src.optimizer), slots_by_key(dst.optimizer)
    assert set(live) == {k for k in saved if "hidden" not in k}
    for k in live:
        np.testing.assert_array_equal(live[k], saved[k])
    np.testing.assert_array_equal(
        to_np(dst.get_layer("hidden").kernel), to_np(src.get_layer("hidden").kernel)
    )


def test_contract_round_trip_and_validate(data):
    m = _trained(data)
    c = kss.TrainableContract.capture(m)
    assert kss.TrainableContract.from_json(c.to_json()) == c
    c.validate(m)
    m.get_layer("out").trainable = False
    with pytest.raises(kss.ContractError, match="missing") as e:
        c.validate(m)
    assert e.value.missing == ["path:layers/out/kernel", "path:layers/out/bias"] and not e.value.unexpected


def test_corrupt_and_truncated_files_are_refused(tmp_path, data):
    src = _trained(data)
    path = tmp_path / "s.h5"
    kss.save_training_state(path, src)
    raw = bytearray(path.read_bytes())
    # flip bytes inside the largest array (hidden kernel: 32 float32 values)
    target = to_np(src.get_layer("hidden").kernel).tobytes()
    at = bytes(raw).find(target[:16])
    assert at > 0
    raw[at + 4] ^= 0xFF
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    with pytest.raises(kss.CorruptCheckpointError, match="path:layers/hidden/kernel.*checksum"):
        kss.restore_training_state(tmp_path / "bad.h5", mlp(4, 8, activation="relu", named=True))
    (tmp_path / "cut.h5").write_bytes(path.read_bytes()[: len(raw) // 2])
    with pytest.raises(kss.CorruptCheckpointError, match="truncated or damaged"):
        kss.restore_training_state(tmp_path / "cut.h5", mlp(4, 8, activation="relu", named=True))
    with pytest.raises(FileNotFoundError):
        kss.restore_training_state(tmp_path / "absent.h5", mlp(4, 8, activation="relu", named=True))


def test_malformed_key_in_file_raises(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)

    def bad_key(record):
        record.model["layers/hidden/kernel"] = record.model.pop("path:layers/hidden/kernel")

    _rewrite(tmp_path / "s.h5", tmp_path / "bad.h5", bad_key)
    with pytest.raises(kss.KeyFormatError, match="'layers/hidden/kernel'"):
        kss.restore_training_state(tmp_path / "bad.h5", mlp(4, 8, activation="relu", named=True))


def test_write_is_atomic(tmp_path, data, monkeypatch):
    src = _trained(data)
    path = tmp_path / "s.h5"
    kss.save_training_state(path, src)
    good = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "write_h5", boom)
    with pytest.raises(OSError, match="disk full"):
        kss.save_training_state(path, src)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["s.h5"]


def test_unknown_extension_refused(tmp_path, data):
    with pytest.raises(kss.CheckpointFormatError, match="'.keras' or '.h5'"):
        kss.save_training_state(tmp_path / "s.ckpt", _trained(data))


def test_unbuilt_model_refused(tmp_path):
    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(kss.StateError, match="not built"):
        kss.save_training_state(tmp_path / "s.h5", Lazy())


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy("float32")


def test_a_loss_scale_optimizer_wrapped_twice_by_compile_is_refused_naming_the_fix(
    tmp_path, data, mixed_float16
):
    """StableOptimizer(LossScaleOptimizer(...)) is not a LossScaleOptimizer, so compile under
    mixed_float16 wraps it in a second one (the loss scaled twice): refused at train begin;
    LossScaleOptimizer(StableOptimizer(...)) trains as LossScaleOptimizer(Adam) does."""
    x, y = data

    def build(wrap):
        keras.utils.set_random_seed(3)
        m = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")]
        )
        m.compile(optimizer=wrap(m), loss="mse")
        return m

    scaled = keras.optimizers.LossScaleOptimizer
    twice = build(lambda m: kss.StableOptimizer(scaled(keras.optimizers.Adam(1e-3)), model=m))
    assert isinstance(twice.optimizer, scaled) and isinstance(
        twice.optimizer.inner_optimizer, kss.StableOptimizer
    )
    with pytest.raises(kss.BindingError, match=r"scaled twice.*LossScaleOptimizer\(StableOptimizer\(inner\)"):
        twice.fit(x, y, epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path / "twice")])
    plain = build(lambda m: scaled(keras.optimizers.Adam(1e-3), initial_scale=2.0**8))
    plain.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    once = build(
        lambda m: scaled(kss.StableOptimizer(keras.optimizers.Adam(1e-3), model=m), initial_scale=2.0**8)
    )
    once.fit(
        x,
        y,
        epochs=2,
        batch_size=8,
        verbose=0,
        shuffle=False,
        callbacks=[kss.StableCheckpoint(tmp_path / "once")],
    )
    for a, b in zip(plain.weights, once.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(b), keras.ops.convert_to_numpy(a))


def test_mixed_precision_auto_wrap_keys_and_round_trip(tmp_path, data, mixed_float16):
    """Keras wraps the StableOptimizer in a LossScaleOptimizer; a model with as many
    trainable variables as the LossScaleOptimizer has own variables (4) must not make
    those look like slots (regression: they were keyed '#variables')."""
    x, y = data

    def build():
        m = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")]
        )
        m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-3), model=m), loss="mse")
        return m

    src = build()
    src.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    assert isinstance(src.optimizer, keras.optimizers.LossScaleOptimizer)
    saved = slots_by_key(src.optimizer)
    assert {
        "optimizer#step_counter",
        "optimizer#dynamic_scale",
        "optimizer#inner_optimizer/iteration",
    } <= set(saved)
    assert sum(k.endswith("#inner_optimizer/momentums") for k in saved) == 4
    assert not any(k.endswith("#variables") for k in saved)
    kss.save_training_state(tmp_path / "s.keras", src)
    dst = build()
    kss.restore_training_state(tmp_path / "s.keras", dst)
    back = keras.saving.load_model(tmp_path / "s.keras")
    back.optimizer.inner_optimizer.bind(back)  # the StableOptimizer inside Keras' LossScaleOptimizer
    for other in (dst, back):
        got = slots_by_key(other.optimizer)
        assert got.keys() == saved.keys()
        for k in saved:
            np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


def test_bfloat16_variables_and_slots_round_trip_exactly(tmp_path, data):
    x, y = data
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, dtype="bfloat16"), keras.layers.Dense(1)])
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=m), loss="mse")
    m.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    assert str(m.layers[0].kernel.dtype) == "bfloat16"
    kss.save_training_state(tmp_path / "s.h5", m)
    record = format.read_file(tmp_path / "s.h5")
    assert format.dtype_name(record.model["path:layers/dense/kernel"]) == "bfloat16"
    dst = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, dtype="bfloat16"), keras.layers.Dense(1)]
    )
    dst.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=dst), loss="mse")
    kss.restore_training_state(tmp_path / "s.h5", dst)
    _assert_same_state(m, dst)
    bits = to_np(dst.layers[0].kernel).view("uint16")
    np.testing.assert_array_equal(bits, to_np(m.layers[0].kernel).view("uint16"))


def test_counter_that_does_not_fit_the_readers_dtype_raises_naming_key(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)

    def big(record):  # as if written by TensorFlow (int64 counter) after 2**31 steps
        record.optimizer["optimizer#iteration"] = np.array(2**31, dtype="int64")

    _rewrite(tmp_path / "s.h5", tmp_path / "big.h5", big)
    dst = mlp(4, 8, activation="relu", named=True)
    if str(src.optimizer.iterations.dtype) == "int64":
        report = kss.restore_training_state(tmp_path / "big.h5", dst)
        assert int(dst.optimizer.iterations) == 2**31 and not report.casts
    else:
        with pytest.raises(
            kss.DtypeMismatchError, match=r"optimizer#iteration .*2147483648.*does not fit .*int32"
        ):
            kss.restore_training_state(tmp_path / "big.h5", dst)


def test_report_names_writer_and_differences(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)

    def other_writer(record):
        record.metadata["backend"] = "elsewhere"
        record.metadata["keras_version"] = "3.0.0"

    _rewrite(tmp_path / "s.h5", tmp_path / "o.h5", other_writer)
    report = kss.restore_training_state(tmp_path / "o.h5", mlp(4, 8, activation="relu", named=True))
    assert report.writer["backend"] == "elsewhere"
    assert report.writer_differs == [
        ("backend", "elsewhere", BACKEND),
        ("keras_version", "3.0.0", keras.__version__),
    ]
    assert f"written with backend elsewhere, read with {BACKEND}" in str(report)
    assert (
        kss.restore_training_state(tmp_path / "s.h5", mlp(4, 8, activation="relu", named=True)).writer_differs
        == []
    )


def test_plain_model_save_with_stable_optimizer_restores_slots_by_key(tmp_path, data):
    """A .keras file from model.save() (no training-state member): the model weights are read
    by structure and the StableOptimizer's slots by key, not dropped."""
    src = _trained(data)
    src.save(tmp_path / "plain.keras")
    dst = mlp(4, 8, activation="relu", named=True)
    report = kss.restore_training_state(tmp_path / "plain.keras", dst)
    assert "by key" in report.source
    opt_keys = [k for k in report.matched if "#" in k]
    assert opt_keys and all(report.matched[k] == "name" for k in opt_keys)
    _assert_same_state(src, dst)


def test_subclassed_model_without_variables_is_refused_clearly(tmp_path, data):
    kss.save_training_state(tmp_path / "s.h5", _trained(data))

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(1)

        def call(self, x):
            return self.d(x)

    m = Sub()
    with pytest.warns(UserWarning, match=r"does not have a `build\(\)` method"):
        m.build((None, 4))  # Keras marks it built without creating variables
    with pytest.raises(kss.StateError, match="has no variables yet; call it on a batch"):
        kss.restore_training_state(tmp_path / "s.h5", m)


def test_cyclic_gc_paused_during_a_call_and_restored_after(tmp_path, data):
    import gc

    class Probe:
        """A provider recording whether the cyclic collector runs while it is saved and restored."""

        seen = []

        def get_state(self):
            Probe.seen.append(gc.isenabled())
            return {}

        def set_state(self, state):
            Probe.seen.append(gc.isenabled())

    m, path = _trained(data), tmp_path / "s.h5"
    assert gc.isenabled()
    kss.save_training_state(path, m, state={"p": Probe()})
    kss.restore_training_state(path, m, state={"p": Probe()})
    assert len(Probe.seen) >= 3 and not any(Probe.seen)
    assert gc.isenabled()
    with pytest.raises(kss.StateError):  # a refused call re-enables it too
        kss.restore_training_state(path, m, state={"missing": Probe()})
    assert gc.isenabled()
    gc.disable()
    try:  # a collector the caller paused stays paused
        kss.save_training_state(path, m)
        kss.restore_training_state(path, m)
        assert not gc.isenabled()
    finally:
        gc.enable()
