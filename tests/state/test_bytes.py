"""training_state_to_bytes / restore_training_state_from_bytes, and refusals that leave an
unbuilt optimizer unbuilt."""

import functools

import keras
import numpy as np
import pytest
from conftest import hypothesis_examples, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.format.writer import record_to_bytes


def _everything(model):
    """Every model and optimizer variable, by position (the optimizer's slots only when built)."""
    values = {f"model/{i}": to_np(v) for i, v in enumerate(model.variables)}
    values.update({f"optimizer/{i}": to_np(v) for i, v in enumerate(model.optimizer.variables)})
    return values


def _fresh():
    model = mlp(4, 3, named=True, seed=7, optimizer="plain")
    model.build((None, 4))
    return model


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _train(model, data, epochs):
    model.fit(*data, epochs=epochs, batch_size=8, shuffle=False, verbose=0)


def test_bytes_round_trip_equals_file_round_trip_and_training_resumes_exactly(data, tmp_path):
    model = mlp(4, 3, named=True, seed=0, optimizer="plain")
    _train(model, data, 2)
    saved = [to_np(v) for v in model.variables] + [to_np(v) for v in model.optimizer.variables]
    blob = kss.training_state_to_bytes(model)
    kss.save_training_state(tmp_path / "run.h5", model)
    _train(model, data, 2)  # uninterrupted
    from_bytes, from_file = _fresh(), _fresh()
    report = kss.restore_training_state_from_bytes(blob, from_bytes)
    kss.restore_training_state(tmp_path / "run.h5", from_file)
    for restored in (from_bytes, from_file):
        values = [to_np(v) for v in restored.variables] + [to_np(v) for v in restored.optimizer.variables]
        for a, b in zip(values, saved, strict=True):
            np.testing.assert_array_equal(a, b)
    assert report.by_order == [] and len(report.matched) == len(saved)
    (tmp_path / "copy.h5").write_bytes(blob)  # the bytes are a file restore_training_state reads
    kss.restore_training_state(tmp_path / "copy.h5", _fresh())
    _train(from_bytes, data, 2)
    for a, b in zip(from_bytes.variables, model.variables, strict=True):
        np.testing.assert_allclose(to_np(a), to_np(b), rtol=1e-6, atol=1e-7)


def test_non_bytes_input_is_refused_clearly(tmp_path):
    model = _fresh()
    with pytest.raises(
        TypeError, match=r"must be bytes .*To restore from a file, call restore_training_state"
    ):
        kss.restore_training_state_from_bytes(str(tmp_path / "run.h5"), model)
    with pytest.raises(TypeError, match=r"must be bytes .*Received: NoneType"):
        kss.restore_training_state_from_bytes(None, model)
    with pytest.raises(kss.CorruptCheckpointError):
        kss.restore_training_state_from_bytes(b"", model)


@functools.lru_cache(maxsize=1)
def _blob_and_values(backend):
    keras.backend.clear_session(free_memory=False)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model = mlp(4, 3, named=True, seed=0, optimizer="plain")
    _train(model, (x, x[:, :1]), 1)
    return kss.training_state_to_bytes(model, include_rng=False), _everything(model)


@settings(
    max_examples=hypothesis_examples(10),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(position=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255), truncate=st.booleans())
@pytest.mark.slow
def test_any_flip_or_truncation_is_refused_and_leaves_the_model_untouched(position, flip, truncate):
    blob, saved = _blob_and_values(keras.backend.backend())
    i = int(position * len(blob))
    damaged = blob[:i] if truncate else blob[:i] + bytes([blob[i] ^ flip]) + blob[i + 1 :]
    target = _fresh()
    before, built = _everything(target), target.optimizer.built
    try:
        kss.restore_training_state_from_bytes(damaged, target, include_rng=False)
    except kss.CorruptCheckpointError:
        assert target.optimizer.built == built
        _assert_same(_everything(target), before)
    else:  # a byte nothing reads (the seal block's padding): the state restored is the one saved
        assert not truncate
        _assert_same(_everything(target), saved)


# -- a refused restore leaves an unbuilt optimizer unbuilt (and every value as it was) ------
class _Provider:
    def __init__(self, fail=False):
        self.value, self.fail = 0, fail

    def get_state(self):
        return {"value": self.value}

    def set_state(self, state):
        if self.fail:
            raise RuntimeError("this provider refuses to be set")
        self.value = state["value"]


def _half_slot(blob):
    record = format.read_bytes(blob)
    key = next(k for k in record.optimizer if k.endswith("kernel#momentums"))
    record.optimizer[key] = record.optimizer[key].astype("float16")
    return record_to_bytes(record)


@pytest.fixture(scope="module")
def saved_and_continued():
    """A model trained one epoch: its state (bytes, with provider ``p``) and values, and its
    values after one more epoch (the uninterrupted run). Shared: the tests only read them."""
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32"))
    model = mlp(4, 3, named=True, seed=0, optimizer="plain")
    _train(model, data, 1)
    saved = _everything(model)
    blob = kss.training_state_to_bytes(model, state={"p": _Provider()})
    _train(model, data, 1)
    return data, blob, saved, [to_np(v) for v in model.variables]


@pytest.mark.parametrize(
    "case",
    ["slot dtype", "provider not saved", "provider set_state fails"],
)
def test_refusal_after_the_build_leaves_the_optimizer_unbuilt(saved_and_continued, case):
    data, good_blob, saved, continued = saved_and_continued
    target = _fresh()
    assert not target.optimizer.built
    before = _everything(target)
    blob, kwargs = good_blob, {"state": {"p": _Provider()}}
    if case == "slot dtype":
        blob, error, match = _half_slot(blob), kss.DtypeMismatchError, r"kernel#momentums is float16"
    elif case == "provider not saved":
        kwargs, error, match = {"state": {"p": _Provider(), "q": _Provider()}}, kss.StateError, "provider 'q'"
    else:
        kwargs, error, match = {"state": {"p": _Provider(fail=True)}}, RuntimeError, "refuses to be set"
    with pytest.raises(error, match=match):
        kss.restore_training_state_from_bytes(blob, target, **kwargs)
    assert not target.optimizer.built
    _assert_same(_everything(target), before)
    # The optimizer put back unbuilt builds and restores as if the refusal never happened.
    report = kss.restore_training_state_from_bytes(good_blob, target, state={"p": _Provider()})
    assert report.built_optimizer
    _assert_same(_everything(target), saved)
    _train(target, data, 1)
    for a, b in zip(target.variables, continued, strict=True):
        np.testing.assert_allclose(to_np(a), b, rtol=1e-6, atol=1e-7)
