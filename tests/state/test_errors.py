"""Clear errors: bad arguments name the argument, what was expected and what was received;
damaged files are not blamed on the model; every refusal names the key or the file."""

import keras
import numpy as np
import pytest
from conftest import to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.errors import MalformedKeyError
from keras_stable_state.format.writer import write_record


def _trained(data, opt=None):
    x, y = data
    m = mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound")
    if opt is not None:
        m.compile(optimizer=opt, loss="mse")
    m.fit(x, y, epochs=1, batch_size=8, verbose=0)
    return m


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "s.h5"
    kss.save_training_state(path, mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"))
    return path


class _NoState:
    pass


BAD_ARGUMENTS = [
    ({"model": None}, TypeError, r"`model` .* must be a keras.Model.*Received: model=None"),
    ({"model": "net"}, TypeError, r"`model` .*Received: model='net'"),
    ({"optimizer": 42}, TypeError, r"`optimizer` .*Optimizer instance or None.*Received: optimizer=42"),
    ({"optimizer": "adam"}, TypeError, r"A name such as 'adam' .*Received: optimizer='adam'"),
    (
        {"state": {"acc": 5}},
        TypeError,
        r"`state\['acc'\]` .*get_state\(\) and set_state.*Received: state\['acc'\]=5",
    ),
    ({"state": {"acc": _NoState()}}, TypeError, r"`state\['acc'\]` .*get_state\(\)"),
    ({"state": [1]}, TypeError, r"`state` .*dict.*Received: state=\[1\]"),
    ({"state": {"a/b": None}}, ValueError, r"`state` names .*without '/'.*'a/b'"),
    ({"callbacks": keras.callbacks.History()}, TypeError, r"`callbacks` .*list of keras.callbacks.Callback"),
    ({"callbacks": ["early"]}, TypeError, r"item 0 is not.*Received: callbacks\[0\]='early'"),
    ({"filepath": 42}, TypeError, r"`filepath` .*str or os.PathLike.*Received: filepath=42"),
    ({"filepath": None}, TypeError, r"`filepath` .*Received: filepath=None"),
    ({"include_rng": "yes"}, TypeError, r"`include_rng` .*True or False.*Received: include_rng='yes'"),
]


@pytest.mark.parametrize("verb", ["save", "restore"])
@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_ARGUMENTS)
def test_bad_arguments_name_the_argument(saved, verb, kwargs, error, match):
    args = {
        "filepath": saved,
        "model": mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"),
        **kwargs,
    }
    call = kss.save_training_state if verb == "save" else kss.restore_training_state
    if verb == "save":
        args["filepath"] = saved.parent / "new.h5" if "filepath" not in kwargs else args["filepath"]
    with pytest.raises(error, match=match):
        call(**args)


def test_restore_flag_types_checked(saved):
    with pytest.raises(TypeError, match=r"`strict` .*Received: strict='no'"):
        kss.restore_training_state(
            saved, mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"), strict="no"
        )


def test_bad_arguments_leave_no_file(tmp_path):
    with pytest.raises(TypeError, match="optimizer"):
        kss.save_training_state(
            tmp_path / "x.h5",
            mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"),
            optimizer="adam",
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_bytes_path_round_trips(tmp_path, data, ext):
    src = _trained(data)
    path = str(tmp_path / f"s.{ext}").encode()
    assert kss.save_training_state(path, src) == path.decode()
    dst = mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound")
    kss.restore_training_state(path, dst)
    for a, b in zip(src.variables, dst.variables, strict=True):
        np.testing.assert_array_equal(to_np(a), to_np(b))


# -- callbacks that never ran --------------------------------------------------------------
def test_early_stopping_before_training_round_trips(tmp_path, data):
    src = _trained(data)
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=3)
    es.wait, es.best, es.best_epoch, es.stopped_epoch = 2, 0.25, 4, 0  # as if 5 epochs ran
    kss.save_training_state(tmp_path / "s.h5", src, callbacks=[es])
    fresh = keras.callbacks.EarlyStopping(monitor="loss", patience=3)  # never ran on_train_begin
    report = kss.restore_training_state(
        tmp_path / "s.h5",
        mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"),
        callbacks=[fresh],
    )
    assert "callback:EarlyStopping/0" in report.restored_state
    assert (fresh.wait, fresh.best, fresh.best_epoch, fresh.stopped_epoch) == (2, 0.25, 4, 0)


def test_fresh_stateful_callbacks_save_without_training(tmp_path, data):
    callbacks = [
        keras.callbacks.EarlyStopping(),
        keras.callbacks.ReduceLROnPlateau(),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
        keras.callbacks.History(),
    ]
    kss.save_training_state(tmp_path / "s.h5", _trained(data), callbacks=callbacks)
    fresh = [
        type(cb)(
            **(
                {"filepath": str(tmp_path / "m.keras")}
                if isinstance(cb, keras.callbacks.ModelCheckpoint)
                else {}
            )
        )
        for cb in callbacks
    ]
    report = kss.restore_training_state(
        tmp_path / "s.h5",
        mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"),
        callbacks=fresh,
    )
    assert len(report.restored_state) == len(callbacks) + 2  # + rng, the metric variables
    assert "metrics" in report.restored_state
    assert fresh[0].best_epoch == 0 and fresh[0].best_weights is None


# -- .keras needs a serializable model --------------------------------------------------------
class _Unserializable(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)


def test_subclassed_model_without_get_config_to_keras_explains(tmp_path, data):
    m = _Unserializable(2)
    m(data[0][:1])
    with pytest.raises(
        kss.CheckpointFormatError,
        match=r"Cannot save .*x\.keras.*serialize _Unserializable.*get_config\(\).*'\.h5' file holds the same training state",
    ) as err:
        kss.save_training_state(tmp_path / "x.keras", m)
    assert err.value.received == "_Unserializable"
    assert not any(p.name.startswith(".kss-") for p in tmp_path.iterdir())  # no temporary left
    kss.save_training_state(tmp_path / "x.h5", m)  # the advice works
    other = _Unserializable(2)
    other(data[0][:1])
    kss.restore_training_state(tmp_path / "x.h5", other)
    np.testing.assert_array_equal(to_np(other.dense.kernel), to_np(m.dense.kernel))


# -- stock .weights.h5 lacking a variable --------------------------------------------------------
def test_stock_weights_missing_variable_refused_under_strict(tmp_path, data):
    src = _trained(data, opt=keras.optimizers.Adam(1e-2))
    src.save_weights(tmp_path / "stock.weights.h5")
    dst = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
            keras.layers.Dense(1, name="extra"),
        ]
    )
    before = [to_np(v).copy() for v in dst.variables]  # not compiled: model variables only
    with pytest.raises(
        kss.BindingError,
        match=r"stock\.weights\.h5.*no value for model variables path:layers/extra/kernel \(at 'layers/dense_2/vars/0'\), "
        r"path:layers/extra/bias .*strict=False",
    ) as err:
        kss.restore_training_state(tmp_path / "stock.weights.h5", dst)
    assert err.value.key == "path:layers/extra/kernel"
    for a, v in zip(before, dst.variables, strict=True):
        np.testing.assert_array_equal(a, to_np(v))
    report = kss.restore_training_state(tmp_path / "stock.weights.h5", dst, strict=False)
    np.testing.assert_array_equal(to_np(dst.get_layer("out").kernel), to_np(src.get_layer("out").kernel))
    assert report.left_fresh == ["path:layers/extra/kernel", "path:layers/extra/bias"]


# -- a damaged key is not the model's fault -------------------------------------------------------
@pytest.mark.parametrize(
    ("section", "old", "new"),
    [
        ("model", "path:layers/hidden/kernel", "layers/hidden/kernel"),
        ("model", "path:layers/hidden/kernel", "path:/layers//hidden"),
        ("optimizer", "path:layers/hidden/kernel#momentums", "path:layers/hidden/kernel"),
        ("optimizer", "path:layers/hidden/kernel#momentums", "pa th:x#momentums"),
    ],
)
def test_malformed_key_is_a_damaged_file_naming_key_and_file(saved, tmp_path, section, old, new):
    record = format.read_file(saved)
    arrays = getattr(record, section)
    setattr(record, section, {(new if k == old else k): v for k, v in arrays.items()})
    write_record(tmp_path / "bad.h5", record)
    dst = mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound")
    before = [to_np(v).copy() for v in dst.variables]
    with pytest.raises(kss.CorruptCheckpointError, match=r"bad\.h5.* key .* is malformed") as err:
        kss.restore_training_state(tmp_path / "bad.h5", dst)
    assert isinstance(err.value, MalformedKeyError) and isinstance(err.value, kss.KeyFormatError)
    assert err.value.key == new and repr(new) in str(err.value)
    assert "do not pass strict=False" in str(err.value)
    for a, v in zip(before, dst.variables, strict=True):
        np.testing.assert_array_equal(a, to_np(v))


# -- casts between kinds ---------------------------------------------------------------------------
def test_cast_between_integer_and_float_refused_even_with_allow_cast(saved, tmp_path):
    record = format.read_file(saved)
    record.model["path:layers/hidden/kernel"] = record.model["path:layers/hidden/kernel"].view("int32")
    write_record(tmp_path / "int.h5", record)
    with pytest.raises(
        kss.DtypeMismatchError,
        match=r"path:layers/hidden/kernel is int32.*Only floating-point arrays are cast",
    ):
        kss.restore_training_state(
            tmp_path / "int.h5",
            mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"),
            allow_cast=True,
        )


def test_missing_provider_state_names_it(saved):
    class P:
        def get_state(self):
            return {}

        def set_state(self, value):
            pass

    with pytest.raises(kss.StateError, match=r"s\.h5.* no state for provider 'acc'"):
        kss.restore_training_state(
            saved, mlp(4, 8, activation="relu", named=True, optimizer="stable-unbound"), state={"acc": P()}
        )


def test_a_callback_with_no_known_state_is_refused_naming_its_class():
    from keras_stable_state import _state

    class Plain(keras.callbacks.Callback):
        pass

    assert _state.callback_state(Plain()) is None
    for call in (
        lambda: _state.set_callback_state(Plain(), {}),
        lambda: _state.parse_callback_state(Plain(), {}, "callbacks/Plain/0"),
    ):
        with pytest.raises(kss.StateError, match="Callback Plain has no known state") as err:
            call()
        assert err.value.key == "Plain"
