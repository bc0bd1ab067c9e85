"""State a layer carries beside its named variables (issue 9, faults 2-4).

* unnamed weights (``add_weight(shape=...)``) are keyed by their place in their
  layer, not by Keras' global counter (``variable_3``);
* derived state is recomputed after a restore (``finalize_state``: an adapted
  ``Normalization``);
* lookup vocabularies and ``Discretization`` bin boundaries are saved and restored.

Keras models take string inputs only on the TensorFlow backend, so string lookups
are held by a model and applied to the data outside ``call`` (as in a ``tf.data``
pipeline) on every backend; the functional string-input case runs on TensorFlow.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND, slots_by_key, to_np

import keras_stable_state as kss
from keras_stable_state._identity.registry import VariableRegistry

# Keras' lookup layers (StringLookup, IntegerLookup, TextVectorization) and Discretization's
# adapt run on TensorFlow whatever the backend ("Layer IntegerLookup requires TensorFlow").
NEEDS_TF_LAYERS = pytest.mark.frameworks("tensorflow")


def _keys(model):
    return [str(k) for k in VariableRegistry.from_model(model).keys()]


# -- fault 2: unnamed weights -------------------------------------------------------
class _Scale(keras.layers.Layer):
    """Two unnamed weights held as attributes (a=2, b=5)."""

    def build(self, input_shape):
        self.a = self.add_weight(shape=(3,), initializer=keras.initializers.Constant(2.0))
        self.b = self.add_weight(shape=(3,), initializer=keras.initializers.Constant(5.0))

    def call(self, x):
        return x * self.a + self.b


class _ListScale(keras.layers.Layer):
    """Two unnamed weights held in a list (no attribute names them)."""

    def build(self, input_shape):
        self.ws = [
            self.add_weight(shape=(3,), initializer=keras.initializers.Constant(2.0)),
            self.add_weight(shape=(3,), initializer=keras.initializers.Constant(5.0)),
        ]

    def call(self, x):
        return x * self.ws[0] + self.ws[1]


def _scaled(layer_cls):
    model = keras.Sequential([keras.Input((3,)), layer_cls(name="scale"), keras.layers.Dense(1)])
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    return model


@pytest.mark.parametrize(
    ("layer_cls", "names"), [(_Scale, ["a", "b"]), (_ListScale, ["variable@0", "variable@1"])]
)
def test_unnamed_weights_restore_exactly_after_the_global_counter_moved(tmp_path, layer_cls, names):
    src = _scaled(layer_cls)
    assert _keys(src)[:2] == [f"path:layers/scale/{n}" for n in names]
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    src.fit(x, y, epochs=1, verbose=0)
    saved = [to_np(v) for v in src.layers[0].weights]
    kss.save_training_state(tmp_path / "s.h5", src)

    keras.Variable(np.zeros(3, "float32"))  # another unnamed variable: every counter name shifts
    dst = _scaled(layer_cls)
    assert [v.name for v in dst.layers[0].weights] != [v.name for v in src.layers[0].weights]
    assert _keys(dst) == _keys(src)
    for v in dst.layers[0].weights:
        v.assign(np.zeros(3, "float32"))
    report = kss.restore_training_state(tmp_path / "s.h5", dst, strict=True)

    for got, want in zip(dst.layers[0].weights, saved, strict=True):
        np.testing.assert_array_equal(to_np(got), want)
    assert saved[0][0] != saved[1][0]  # a and b still differ after training: a swap would show
    assert not report.by_order
    want_slots = slots_by_key(src.optimizer)
    got_slots = slots_by_key(dst.optimizer)
    assert set(got_slots) == set(want_slots)
    for key, value in want_slots.items():
        np.testing.assert_array_equal(got_slots[key], value, err_msg=key)


class _LayerScale(keras.layers.Layer):
    """ConvNeXt's LayerScale: one unnamed weight ``gamma``."""

    def __init__(self, init_values, dim, **kwargs):
        super().__init__(**kwargs)
        self.init_values, self.dim = init_values, dim

    def build(self, input_shape):
        self.gamma = self.add_weight(
            shape=(self.dim,), initializer=keras.initializers.Constant(self.init_values)
        )

    def call(self, x):
        return x * self.gamma


def _convnext_like():
    """A stand-in for ConvNeXtTiny: nested Sequential downsampling blocks and LayerScale."""
    inp = keras.Input((4,))
    h = inp
    for i in range(3):
        block = keras.Sequential([keras.layers.LayerNormalization(), keras.layers.Dense(4)], name=f"down_{i}")
        h = _LayerScale(0.5 + i, 4, name=f"scale_{i}")(block(h))
    return keras.Model(inp, h)


def test_second_convnext_like_model_in_the_process_has_the_same_keys(tmp_path):
    first = _convnext_like()
    second = _convnext_like()
    keys = _keys(first)
    assert keys == _keys(second)
    assert not [k for k in keys if k.startswith("order:") or "variable" in k]
    assert "path:layers/scale_1/gamma" in keys
    assert "path:layers/down_2/layers/dense/kernel" in keys
    kss.save_training_state(tmp_path / "s.h5", first)
    for v in second.variables:
        v.assign(np.zeros(v.shape, v.dtype))
    kss.restore_training_state(tmp_path / "s.h5", second, strict=True)
    for got, want in zip(second.variables, first.variables, strict=True):
        np.testing.assert_array_equal(to_np(got), to_np(want))
    np.testing.assert_array_equal(to_np(second.get_layer("scale_1").gamma), np.full(4, 1.5, "float32"))


# -- fault 3: derived state ----------------------------------------------------------
def _normalized(data=None):
    norm = keras.layers.Normalization(name="norm")
    if data is not None:
        norm.adapt(data)
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(1, name="head")(norm(inp)))


def test_adapted_normalization_restored_into_an_unadapted_model_predicts_the_same(tmp_path):
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(64, 4)) * 5 + 20).astype("float32")
    src = _normalized(data)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = _normalized()
    before = to_np(dst(data))
    kss.restore_training_state(tmp_path / "s.h5", dst)
    np.testing.assert_array_equal(
        to_np(dst.get_layer("norm").adapt_mean), to_np(src.get_layer("norm").adapt_mean)
    )
    np.testing.assert_allclose(to_np(dst(data)), to_np(src(data)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(before, to_np(src(data)), atol=1.0)


class _FinalizeFails(keras.layers.Layer):
    """A layer with a variable whose finalize_state refuses once asked to."""

    fail = False

    def build(self, input_shape):
        self.w = self.add_weight(shape=(1,), initializer="ones", name="w")

    def finalize_state(self):
        if self.fail:
            raise RuntimeError("finalize_state refused")

    def call(self, x):
        return x * self.w


def test_failing_finalize_state_puts_everything_back(tmp_path):
    def build():
        inp = keras.Input((4,))
        norm = keras.layers.Normalization(name="norm")
        norm.adapt(np.arange(32, dtype="float32").reshape(8, 4))
        return keras.Model(inp, _FinalizeFails(name="late")(norm(inp)))

    src = build()
    src.get_layer("late").w.assign([3.0])
    src.get_layer("norm").adapt_mean.assign(np.full(4, 7.0, "float32"))
    src.get_layer("norm").finalize_state()
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = build()
    x = np.ones((2, 4), "float32")
    before, mean_before = to_np(dst(x)), to_np(dst.get_layer("norm").mean)
    dst.get_layer("late").fail = True
    with pytest.raises(RuntimeError, match="finalize_state refused"):
        kss.restore_training_state(tmp_path / "s.h5", dst)
    np.testing.assert_array_equal(to_np(dst.get_layer("late").w), [1.0])
    np.testing.assert_array_equal(to_np(dst.get_layer("norm").mean), mean_before)
    np.testing.assert_array_equal(to_np(dst(x)), before)


# -- fault 4: vocabularies -----------------------------------------------------------
class _Tokens(keras.Model):
    """Holds a lookup layer (applied to the data, as in a tf.data pipeline) and an embedding."""

    def __init__(self, lookup, **kwargs):
        super().__init__(**kwargs)
        self.lookup = lookup
        self.embed = keras.layers.Embedding(16, 3)
        self.embed.build((None,))

    def call(self, ids):
        return self.embed(ids)


def _tokens(lookup, data):
    model = _Tokens(lookup)
    lookup.adapt(data)
    model(lookup(data))
    return model


_KINDS = {
    "string": (
        lambda: keras.layers.StringLookup(),
        np.array([["a"], ["b"], ["b"], ["c"], ["c"], ["c"]]),
        np.array([["c"], ["x"], ["x"], ["y"], ["a"], ["a"], ["a"]]),
    ),
    "integer": (
        lambda: keras.layers.IntegerLookup(),
        np.array([[7], [8], [8], [9], [9], [9]], "int64"),
        np.array([[9], [3], [3], [4], [7], [7], [7]], "int64"),
    ),
    "text": (
        lambda: keras.layers.TextVectorization(output_sequence_length=4),
        np.array(["a b b", "c c c"]),
        np.array(["c x x", "y a a a"]),
    ),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
@NEEDS_TF_LAYERS
def test_vocabulary_restored_into_a_model_readapted_on_other_data(tmp_path, kind):
    make, data, other = _KINDS[kind]
    src = _tokens(make(), data)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = _tokens(make(), other)
    assert dst.lookup.get_vocabulary() != src.lookup.get_vocabulary()
    report = kss.restore_training_state(tmp_path / "s.h5", dst, strict=True)
    assert dst.lookup.get_vocabulary() == src.lookup.get_vocabulary()
    assert "layer:lookup" in report.restored_state
    probe = np.concatenate([data, other])
    np.testing.assert_array_equal(to_np(dst.lookup(probe)), to_np(src.lookup(probe)))
    np.testing.assert_array_equal(to_np(dst(dst.lookup(probe))), to_np(src(src.lookup(probe))))


@NEEDS_TF_LAYERS
def test_tf_idf_weights_restored(tmp_path):
    def make():
        return keras.layers.StringLookup(output_mode="tf_idf", max_tokens=6, pad_to_max_tokens=True)

    data = np.array([["a", "b"], ["b", "c"], ["c", "c"]])
    src = make()
    src.adapt(data)
    kss.save_training_state(tmp_path / "s.h5", _held(src))
    dst = make()
    dst.adapt(np.array([["x", "y"], ["y", "y"]]))
    kss.restore_training_state(tmp_path / "s.h5", _held(dst))
    assert dst.get_vocabulary() == src.get_vocabulary()
    np.testing.assert_array_equal(to_np(dst(data)), to_np(src(data)))


class _Holder(keras.Model):
    """A model holding one preprocessing layer next to a Dense (so it has variables)."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.pre = layer
        self.head = keras.layers.Dense(1)

    def build(self, input_shape):
        self.head.build(input_shape)

    def call(self, x):
        return self.head(x)


def _held(layer):
    model = _Holder(layer)
    model(np.zeros((1, 1), "float32"))
    return model


@NEEDS_TF_LAYERS
def test_discretization_bin_boundaries_restored(tmp_path):
    data = np.linspace(0, 10, 50, dtype="float32").reshape(-1, 1)
    src = keras.layers.Discretization(num_bins=4)
    src.adapt(data)
    kss.save_training_state(tmp_path / "s.h5", _held(src))
    dst = keras.layers.Discretization(num_bins=4)
    dst.adapt(data * 3 + 100)
    kss.restore_training_state(tmp_path / "s.h5", _held(dst))
    assert dst.bin_boundaries == src.bin_boundaries
    np.testing.assert_array_equal(to_np(dst(data)), to_np(src(data)))


@NEEDS_TF_LAYERS
def test_vocabulary_from_a_file_is_saved_by_content(tmp_path):
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("x\ny\nz\n")
    src = _held(keras.layers.StringLookup(vocabulary=str(vocab_file)))
    kss.save_training_state(tmp_path / "s.h5", src)
    vocab_file.unlink()
    lookup = keras.layers.StringLookup()
    lookup.adapt(np.array(["q", "r"]))
    kss.restore_training_state(tmp_path / "s.h5", _held(lookup))
    assert lookup.get_vocabulary() == ["[UNK]", "x", "y", "z"]


@NEEDS_TF_LAYERS
def test_other_lookup_options_refused_before_anything_is_assigned(tmp_path):
    make, data, other = _KINDS["string"]
    src = _tokens(make(), data)
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = _tokens(keras.layers.StringLookup(num_oov_indices=2), other)
    vocab, rows = dst.lookup.get_vocabulary(), to_np(dst.embed.embeddings)
    with pytest.raises(kss.BindingError, match=r"layer 'lookup'.*num_oov_indices \(saved 1, live 2\)"):
        kss.restore_training_state(tmp_path / "s.h5", dst)
    assert dst.lookup.get_vocabulary() == vocab
    np.testing.assert_array_equal(to_np(dst.embed.embeddings), rows)


@NEEDS_TF_LAYERS
def test_lookup_without_saved_vocabulary_refused_under_strict(tmp_path):
    class _Plain(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embed = keras.layers.Embedding(16, 3)
            self.embed.build((None,))

        def call(self, ids):
            return self.embed(ids)

    plain = _Plain()
    plain(np.zeros((1,), "int32"))
    kss.save_training_state(tmp_path / "s.h5", plain)
    make, data, _ = _KINDS["string"]
    dst = _tokens(make(), data)
    with pytest.raises(kss.BindingError, match=r"no saved vocabulary .* for layers \['lookup'\]"):
        kss.restore_training_state(tmp_path / "s.h5", dst)
    report = kss.restore_training_state(tmp_path / "s.h5", dst, strict=False)
    assert "layer:lookup" in report.left_fresh


@NEEDS_TF_LAYERS
def test_failure_after_the_vocabulary_was_set_puts_the_old_vocabulary_back(tmp_path):
    make, data, other = _KINDS["string"]

    class _Late(_Tokens):
        def __init__(self, lookup, **kwargs):
            super().__init__(lookup, **kwargs)
            self.late = _FinalizeFails(name="late")
            self.late.build((None, 3))

    src = _Late(make())
    src.lookup.adapt(data)
    src(src.lookup(data))
    kss.save_training_state(tmp_path / "s.h5", src)
    dst = _Late(make())
    dst.lookup.adapt(other)
    dst(dst.lookup(other))
    vocab = dst.lookup.get_vocabulary()
    ids = to_np(dst.lookup(other))
    dst.late.fail = True
    with pytest.raises(RuntimeError, match="finalize_state refused"):
        kss.restore_training_state(tmp_path / "s.h5", dst)
    assert dst.lookup.get_vocabulary() == vocab
    np.testing.assert_array_equal(to_np(dst.lookup(other)), ids)


@NEEDS_TF_LAYERS
def test_non_utf8_token_refused_at_save_naming_the_layer(tmp_path):
    lookup = keras.layers.StringLookup()
    lookup.adapt(np.array([b"\xff\xfe", b"ok"], dtype=object))
    with pytest.raises(kss.StateError, match=r"vocabulary of layer 'pre'.*not UTF-8"):
        kss.save_training_state(tmp_path / "s.h5", _held(lookup))
    assert not (tmp_path / "s.h5").exists()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="Keras models take string inputs only on TensorFlow")
def test_functional_model_with_string_input(tmp_path):
    import tensorflow as tf

    def build(data):
        lookup = keras.layers.StringLookup(name="words")
        lookup.adapt(data)
        inp = keras.Input((1,), dtype="string")
        return keras.Model(inp, keras.layers.Embedding(16, 3, name="embed")(lookup(inp)))

    data = tf.constant([["a"], ["b"], ["b"], ["c"]])
    src = build(data)
    kss.save_training_state(tmp_path / "s.keras", src)
    dst = build(tf.constant([["c"], ["z"], ["z"]]))
    kss.restore_training_state(tmp_path / "s.keras", dst)
    np.testing.assert_array_equal(to_np(dst(data)), to_np(src(data)))


@NEEDS_TF_LAYERS
def test_vocabulary_follows_the_prefix_into_a_wrapping_model(tmp_path):
    make, data, other = _KINDS["string"]
    src = _tokens(make(), data)
    kss.save_training_state(tmp_path / "s.h5", src)

    class _Wrapper(keras.Model):
        def __init__(self, base, **kwargs):
            super().__init__(**kwargs)
            self.base = base

        def call(self, ids):
            return self.base(ids)

    wrapper = _Wrapper(_tokens(make(), other))
    wrapper(wrapper.base.lookup(other))
    report = kss.restore_training_state(tmp_path / "s.h5", wrapper, prefix="base")
    assert "layer:base/lookup" in report.restored_state
    assert wrapper.base.lookup.get_vocabulary() == src.lookup.get_vocabulary()
    np.testing.assert_array_equal(to_np(wrapper(wrapper.base.lookup(data))), to_np(src(src.lookup(data))))
