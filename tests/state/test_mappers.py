"""Per-key mappers: save_training_state(..., mappers={pattern: mapper}); restore decodes from the file."""

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import hypothesis_examples, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state._core import mappers
from keras_stable_state._optimizer import keyed_optimizer_entries
from keras_stable_state.format.writer import record_to_bytes

KERNELS = r"^path:.*kernel$"
SLOTS = r"^path:.*#"


def slots_by_key(model):
    """``{slot key as in the file: value}`` of ``model.optimizer``."""
    return {e.key: to_np(e.variable) for e in keyed_optimizer_entries(model.optimizer, model)}


def _values(model):
    reg = kss.VariableRegistry.from_model(model)
    return {str(k): to_np(v) for k, v in reg.entries}


@pytest.fixture(scope="module")
def trained():
    """A trained model and its values, shared by the tests (they only read it)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model = mlp(4, 3, named=True, seed=0, optimizer="plain")
    model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    return model, _values(model), slots_by_key(model)


def _restored(path_or_bytes, **kwargs):
    model = mlp(4, 3, named=True, seed=1, optimizer="plain")
    model.build((None, 4))
    if isinstance(path_or_bytes, bytes):
        report = kss.restore_training_state_from_bytes(path_or_bytes, model, **kwargs)
    else:
        report = kss.restore_training_state(path_or_bytes, model, **kwargs)
    return model, report


def _bf16(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_bfloat16_round_trip_is_the_cast_of_the_saved_values(trained, tmp_path):
    model, values, slots = trained
    path = tmp_path / "run.h5"
    kss.save_training_state(path, model, mappers={KERNELS: kss.CastMapper("bfloat16")})
    with format.open_file(path) as f:
        stored = {e.key: e.dtype for e in f.entries}
    assert stored["path:layers/hidden/kernel"] == "bfloat16"
    assert stored["path:layers/hidden/bias"] == "float32"
    back, report = _restored(path)
    for key, value in _values(back).items():
        expected = _bf16(values[key]) if key.endswith("kernel") else values[key]
        np.testing.assert_array_equal(value, expected, err_msg=key)
        assert value.dtype == np.float32
    for key, value in slots_by_key(back).items():
        np.testing.assert_array_equal(value, slots[key], err_msg=key)
    assert sorted(report.mapped) == ["path:layers/hidden/kernel", "path:layers/out/kernel"]
    assert report.lossy == sorted(report.mapped) or sorted(report.lossy) == sorted(report.mapped)
    assert report.mapped["path:layers/hidden/kernel"] == "CastMapper(dtype='bfloat16')"


def test_quantized_slots_within_the_documented_bound_and_reported(trained):
    model, values, slots = trained
    data = kss.training_state_to_bytes(model, mappers={SLOTS: kss.QuantizeMapper()})
    back, report = _restored(data)
    mapped = [k for k in slots if k.startswith("path:")]
    assert sorted(report.mapped) == sorted(mapped) and sorted(report.lossy) == sorted(mapped)
    restored = slots_by_key(back)
    for key in mapped:
        err = np.abs(restored[key].astype(np.float64) - slots[key].astype(np.float64))
        bound = kss.QuantizeMapper.bound(slots[key])
        assert err.max() <= bound, (key, err.max(), bound)
        assert np.abs(slots[key]).max() == 0 or np.abs(restored[key]).max() > 0
    assert restored["optimizer#iteration"] == slots["optimizer#iteration"]
    for key, value in _values(back).items():
        np.testing.assert_array_equal(value, values[key], err_msg=key)
    text = str(report)
    assert "stored through QuantizeMapper(), decoded:" in text
    assert "not restored bit-exactly (lossy mappers" in text and mapped[0] in text


def test_lossless_cast_is_not_reported_lossy(trained):
    model, values, _ = trained
    back, report = _restored(kss.training_state_to_bytes(model, mappers={KERNELS: kss.CastMapper("float64")}))
    assert len(report.mapped) == 2 and report.lossy == []
    assert "not restored bit-exactly" not in str(report)
    for key, value in _values(back).items():
        np.testing.assert_array_equal(value, values[key], err_msg=key)


def test_mapper_on_an_integer_counter_is_refused_at_save_naming_the_key(trained, tmp_path):
    model, _, _ = trained
    with pytest.raises(kss.DtypeMismatchError, match=r"optimizer#iteration, which is int"):
        kss.save_training_state(tmp_path / "x.h5", model, mappers={"#": kss.CastMapper()})
    assert not (tmp_path / "x.h5").exists()


def test_bad_mapper_arguments_are_refused(trained):
    model, _, _ = trained
    with pytest.raises(ValueError, match=r"match no saved key"):
        kss.training_state_to_bytes(model, mappers={"^nothing$": kss.CastMapper()})
    with pytest.raises(ValueError, match=r"all match path:layers/hidden/kernel"):
        kss.training_state_to_bytes(
            model, mappers={KERNELS: kss.CastMapper(), "hidden/kernel": kss.CastMapper()}
        )
    with pytest.raises(TypeError, match=r"must be a keras_stable_state.StateMapper"):
        kss.training_state_to_bytes(model, mappers={KERNELS: "bfloat16"})
    with pytest.raises(ValueError, match=r"`dtype` of CastMapper must be one of"):
        kss.CastMapper("int8")

    class Unregistered(kss.CastMapper):
        pass

    with pytest.raises(TypeError, match=r"not registered with Keras"):
        kss.training_state_to_bytes(model, mappers={KERNELS: Unregistered()})


def test_overflowing_cast_is_refused_naming_the_key(trained):
    model, values, _ = trained
    kernel = model.get_layer("out").kernel
    kernel.assign(np.full((3, 1), 1e6, "float32"))
    try:
        with pytest.raises(
            kss.StateError, match=r"path:layers/out/kernel: values up to 1e\+06 overflow float16"
        ):
            kss.training_state_to_bytes(model, mappers={KERNELS: kss.CastMapper("float16")})
    finally:
        kernel.assign(values["path:layers/out/kernel"])  # the shared model, as the other tests read it


def test_unregistered_mapper_at_restore_is_refused_naming_the_key(trained):
    model, _, _ = trained

    @keras.saving.register_keras_serializable(package="kss_test_gone")
    class Half(kss.StateMapper):
        lossy = True

        def encode(self, key, array):
            return array.astype("float16"), {}

        def decode(self, key, array, dtype, params):
            return array.astype(dtype)

    data = kss.training_state_to_bytes(model, mappers={KERNELS: Half()})
    back, report = _restored(data)
    assert report.mapped["path:layers/hidden/kernel"] == "Half()"
    keras.saving.get_custom_objects().pop("kss_test_gone>Half")
    target = mlp(4, 3, named=True, seed=2, optimizer="plain")
    target.build((None, 4))
    before = _values(target)
    with pytest.raises(
        kss.StateError, match=r"path:layers/\w+/kernel was stored through mapper 'kss_test_gone>Half'"
    ):
        kss.restore_training_state_from_bytes(data, target)
    for key, value in _values(target).items():
        np.testing.assert_array_equal(value, before[key])
    assert not target.optimizer.built


def test_bad_mapper_config_in_the_file_is_refused_naming_the_key(trained):
    model, _, _ = trained
    record = format.read_bytes(kss.training_state_to_bytes(model, mappers={KERNELS: kss.CastMapper()}))
    record.extra["mappers"]["path:layers/out/kernel"]["mapper"]["config"] = {"dtype": "int4"}
    with pytest.raises(
        kss.StateError,
        match=r"config of mapper 'keras_stable_state>CastMapper' stored for path:layers/out/kernel",
    ):
        _restored(record_to_bytes(record))
    record.extra["mappers"]["path:layers/out/kernel"]["shape"] = "3x1"
    with pytest.raises(
        kss.CorruptCheckpointError, match=r"mapper record for 'path:layers/out/kernel' is malformed"
    ):
        _restored(record_to_bytes(record))


def test_mapper_config_round_trips():
    for mapper in (kss.CastMapper("float16"), kss.QuantizeMapper()):
        config = keras.saving.serialize_keras_object(mapper)
        back = keras.saving.deserialize_keras_object(config)
        assert type(back) is type(mapper) and back.get_config() == mapper.get_config()


_FLOAT_ARRAYS = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    elements=st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32),
)


@settings(
    max_examples=hypothesis_examples(10),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(a=_FLOAT_ARRAYS, b=_FLOAT_ARRAYS)
def test_round_trip_through_the_file_property(a, b):
    """Any float array, any shape: bfloat16 equals the cast; int8 stays within the bound."""
    rules = mappers.check_mappers(
        {"^path:a$": kss.CastMapper("bfloat16"), "^path:b$": kss.QuantizeMapper()}, "t"
    )
    model, opt, section, found = mappers.encode_arrays(rules, {"path:a": a, "path:b": b}, {})
    record = format.StateRecord(
        metadata={"backend": "jax", "keras_version": "3"},
        contract=None,
        model=model,
        optimizer=opt,
        extra={"mappers": section},
        arrays=found,
    )
    decoded, used = mappers.decode_record(format.read_bytes(record_to_bytes(record)), "<bytes>")
    assert set(used) == {"path:a", "path:b"}
    back_a, back_b = decoded.model["path:a"], decoded.model["path:b"]
    assert back_a.dtype == a.dtype and back_a.shape == a.shape
    np.testing.assert_array_equal(back_a, a.astype(ml_dtypes.bfloat16).astype(a.dtype))
    assert back_b.dtype == b.dtype and back_b.shape == b.shape
    if b.size:
        err = np.abs(back_b.astype(np.float64) - b.astype(np.float64))
        assert err.max() <= kss.QuantizeMapper.bound(b, b.dtype.name)
        np.testing.assert_array_equal(back_b[b == 0], 0)
