"""Stable keys: independent of auto-name counters and attribute creation order."""

import keras
import numpy as np
import pytest

import keras_stable_state as kss
from keras_stable_state._identity.registry import VariableKey, VariableRegistry


def _seq():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.Dense(4, name="user_named"),
            keras.layers.Dense(1),
        ]
    )


def _keys(model, variables=None):
    return [str(k) for k in VariableRegistry.from_model(model, variables).keys()]


def test_same_code_twice_and_after_other_models_gives_same_keys():
    first = _keys(_seq())
    for _ in range(3):  # shift every auto-name counter
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(2)])
    second = _seq()
    assert [v.path for v in second.trainable_variables][0] != "sequential/dense/kernel"
    assert _keys(second) == first
    assert first == [
        "path:layers/dense/kernel",
        "path:layers/dense/bias",
        "path:layers/user_named/kernel",
        "path:layers/user_named/bias",
        "path:layers/dense_1/kernel",
        "path:layers/dense_1/bias",
    ]


class _Branches(keras.Model):
    def __init__(self, order="ab", **kw):
        super().__init__(**kw)
        for name in order:
            setattr(self, f"branch_{name}", keras.layers.Dense(4))
        self.blocks = [keras.layers.Dense(4), keras.layers.Dense(4, name="mid")]

    def call(self, x):
        h = self.branch_a(x) * 0.3 + self.branch_b(x) * 1.7
        for block in self.blocks:
            h = block(h)
        return h


def test_subclassed_model_keys_follow_attributes_not_creation_order():
    a, b = _Branches("ab"), _Branches("ba")
    x = np.ones((1, 3), "float32")
    a(x), b(x)
    ka = dict(zip(_keys(a), [id(v) for v in a.variables], strict=True))
    kb = dict(zip(_keys(b), [id(v) for v in b.variables], strict=True))
    assert set(ka) == set(kb)
    assert (
        "path:branch_a/kernel" in ka and "path:blocks/mid/kernel" in ka and "path:blocks/dense/kernel" in ka
    )
    # registration order differs, but each key names the same attribute's variable
    assert a.trainable_variables[0] is a.branch_a.kernel and b.trainable_variables[0] is b.branch_b.kernel
    reg = VariableRegistry.from_model(b)
    assert reg.variable_of(VariableKey.parse("path:branch_a/kernel")) is b.branch_a.kernel


def test_tied_variable_keyed_once():
    inp = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    model = keras.Model(inp, shared(shared(inp)))
    assert _keys(model) == ["path:layers/shared/kernel", "path:layers/shared/bias"]
    contract = kss.TrainableContract.capture(model)
    assert [k for k, _, _ in contract.entries] == ["path:layers/shared/kernel", "path:layers/shared/bias"]


def test_unreached_variables_get_ordered_keys():
    v = keras.Variable(np.zeros((2,)), name="loose")
    reg = VariableRegistry.from_model(None, [v])
    assert reg.keys() == [VariableKey("order", "0")]


@pytest.mark.parametrize(
    "bad", ["", "path:", "order:-1", "order:01", "slot:x", "path:/a", "path:a//b", 7, "order:x"]
)
def test_malformed_keys_raise(bad):
    with pytest.raises(kss.KeyFormatError, match="Malformed variable key"):
        VariableKey.parse(bad)


def test_key_round_trip():
    for text in ["path:layers/dense/kernel", "order:0", "order:12"]:
        assert str(VariableKey.parse(text)) == text


def _var(shape, dtype="float32"):
    return keras.Variable(np.zeros(shape, dtype=dtype))


def test_order_bind_checks_shape_and_dtype():
    reg = VariableRegistry.from_model(None, [_var((2, 2)), _var((3,))])
    bound, unmatched = reg.bind([(VariableKey.parse("order:1"), (3,), "float32")])
    assert bound[VariableKey.parse("order:1")][1] == "order" and not unmatched
    with pytest.raises(kss.BindingError, match="shape"):
        reg.bind([(VariableKey.parse("order:0"), (3,), "float32")])
    with pytest.raises(kss.BindingError, match="dtype float16"):
        reg.bind([(VariableKey.parse("order:1"), (3,), "float16")])
    with pytest.raises(kss.BindingError, match="registration index 5"):
        reg.bind([(VariableKey.parse("order:5"), (3,), "float32")])


def test_order_bind_never_claims_named_slot():
    model = _seq()
    reg = VariableRegistry.from_model(model)
    saved = [
        (VariableKey.parse("path:layers/dense/kernel"), (3, 4), "float32"),
        (VariableKey.parse("order:0"), (3, 4), "float32"),  # index 0 is that same variable
    ]
    with pytest.raises(kss.BindingError, match="never claims a named slot"):
        reg.bind(saved)


def test_duplicate_keys_refused():
    v, w = _var((1,)), _var((1,))
    with pytest.raises(kss.BindingError, match="Duplicate variable keys"):
        VariableRegistry([(VariableKey.parse("path:a"), v), (VariableKey.parse("path:a"), w)])


class _Proj(keras.Model):
    """Attributes that sort after `layers` and a dict of layers (regression: both were
    keyed by creation order, so swapping their creation swapped weights and slots)."""

    def __init__(self, swap=False, **kw):
        super().__init__(**kw)
        names = ("q_proj", "p_proj") if swap else ("p_proj", "q_proj")
        for name in names:
            setattr(self, name, keras.layers.Dense(4))
        self.heads = {k: keras.layers.Dense(4) for k in (("b", "a") if swap else ("a", "b"))}
        self.out_a = keras.layers.Dense(1)

    def call(self, x):
        h = self.p_proj(x) * 2.0 + self.q_proj(x)
        return self.out_a(self.heads["a"](h) * 2.0 + self.heads["b"](h))


def test_attributes_after_layers_and_dict_entries_keyed_by_name():
    x = np.ones((1, 3), "float32")
    a, b = _Proj(), _Proj(swap=True)
    a(x), b(x)
    ra, rb = VariableRegistry.from_model(a), VariableRegistry.from_model(b)
    for name, layer_a, layer_b in [
        ("p_proj", a.p_proj, b.p_proj),
        ("q_proj", a.q_proj, b.q_proj),
        ("heads/a", a.heads["a"], b.heads["a"]),
        ("out_a", a.out_a, b.out_a),
    ]:
        key = VariableKey.parse(f"path:{name}/kernel")
        assert ra.variable_of(key) is layer_a.kernel and rb.variable_of(key) is layer_b.kernel
    assert b.trainable_variables[0] is b.q_proj.kernel  # creation order really differs


def test_keras_paths_still_follow_keras_weight_files(tmp_path):
    import h5py

    from keras_stable_state._identity.paths import stable_variable_paths

    m = _Proj()
    m(np.ones((1, 3), "float32"))
    m.save_weights(tmp_path / "w.weights.h5")
    with h5py.File(tmp_path / "w.weights.h5") as f:
        for _, var, kpath in stable_variable_paths(m).values():
            np.testing.assert_array_equal(f[kpath][()], keras.ops.convert_to_numpy(var))


# -- one walk of the model per save and per restore ------------------------------------------
def _count_walks(monkeypatch):
    """Count the model walks (``_walk_once``, by style) and Keras' per-object saving walk."""
    from keras_stable_state import _keras_compat
    from keras_stable_state._identity import paths

    walks, kids = [], {}
    walk_once, walk_saveable = paths._walk_once, _keras_compat.walk_saveable

    def counted_walk(model, keras_style, cache):
        walks.append("keras" if keras_style else "stable")
        return walk_once(model, keras_style, cache)

    def counted_kids(obj, classes=None):
        kids[id(obj)] = kids.get(id(obj), 0) + 1
        return walk_saveable(obj, classes)

    monkeypatch.setattr(paths, "_walk_once", counted_walk)
    monkeypatch.setattr(_keras_compat, "walk_saveable", counted_kids)
    return walks, kids


def _compiled(optimizer_built=True):
    model = _Proj()
    model(np.ones((2, 3), "float32"))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    if optimizer_built:
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
def test_save_and_restore_walk_the_model_once(tmp_path, monkeypatch, suffix):
    src = _compiled()
    dst = _compiled(optimizer_built=False)  # the restore builds it: its registry is keyed anew
    path = tmp_path / f"state{suffix}"
    acc = kss.GradientAccumulator(src)
    extra = keras.Variable(np.ones((2,), "float32"), name="log_alpha")
    walks, kids = _count_walks(monkeypatch)
    kss.save_training_state(path, src, state={"acc": acc}, callbacks=[keras.callbacks.EarlyStopping()])
    assert walks == ["stable"] and max(kids.values()) == 1
    walks.clear(), kids.clear()
    report = kss.restore_training_state(path, dst)
    assert walks == ["stable"] and max(kids.values()) == 1
    assert report.built_optimizer and not report.order_keys
    assert all(how == "name" for how in report.matched.values())
    walks.clear(), kids.clear()
    kss.save_training_state(path, src, variables={"log_alpha": extra}, blocking=False).wait()
    assert walks == ["stable"]
    walks.clear()
    kss.restore_training_state(path, dst, variables={"log_alpha": extra})
    assert walks == ["stable"]


class NestedBlock(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.inner = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(4, name="mid")])
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(self.inner(x))


class NestedModel(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.encoder = NestedBlock()
        self.blocks = [NestedBlock(), NestedBlock()]
        self.head = keras.layers.Dense(2)

    def call(self, x):
        h = self.encoder(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _count_parses(monkeypatch):
    """Count each key text parsed (`VariableKey._parse`, under every memo)."""
    import collections

    from keras_stable_state._identity import keys

    parses = collections.Counter()
    real = keys.VariableKey._parse.__func__

    def counted(cls, text):
        parses[text] += 1
        return real(cls, text)

    monkeypatch.setattr(keys.VariableKey, "_parse", classmethod(counted))
    return parses


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
def test_nested_model_is_walked_once_and_each_key_parsed_once_per_save_and_restore(
    tmp_path, monkeypatch, suffix
):
    x = np.ones((2, 3), "float32")
    src, dst = NestedModel(), NestedModel()
    for m in (src, dst):
        m(x)
        m.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    src.fit(x, np.ones((2, 2), "float32"), verbose=0)  # Adam's slots hold values
    acc = kss.GradientAccumulator(src)
    path = tmp_path / f"state{suffix}"
    walks, kids = _count_walks(monkeypatch)
    parses = _count_parses(monkeypatch)
    kss.save_training_state(path, src, state={"acc": acc})
    assert walks == ["stable"] and max(kids.values()) == 1
    assert max(parses.values(), default=1) == 1
    walks.clear(), kids.clear(), parses.clear()
    report = kss.restore_training_state(path, dst, state={"acc": kss.GradientAccumulator(dst)})
    assert walks == ["stable"] and max(kids.values()) == 1
    # every model key, slot owner and contract key of the file, each parsed once
    assert len(parses) == len(src.variables) and set(parses.values()) == {1}
    assert len(report.matched) > len(src.variables) and set(report.matched.values()) == {"name"}
    for a, b in zip(src.weights, dst.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_stock_weights_restore_adds_only_keras_addressing(tmp_path, monkeypatch):
    src, dst = _compiled(), _compiled()
    src.save_weights(tmp_path / "stock.weights.h5")
    walks, kids = _count_walks(monkeypatch)
    report = kss.restore_training_state(tmp_path / "stock.weights.h5", dst, strict=False)
    # Keras' own addressing is a second pass over the same objects: Keras' walk runs once per object.
    assert walks == ["stable", "keras"] and max(kids.values()) == 1
    assert report.matched
    for a, b in zip(src.weights, dst.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_walk_reused_in_a_call_is_redone_when_the_model_gains_variables():
    from keras_stable_state._identity.registry import ModelIndex

    class Lazy(keras.Model):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.first = keras.layers.Dense(2)
            self.later = keras.layers.Dense(2)

        def build(self, input_shape):
            self.first.build(input_shape)

        def call(self, x):
            return self.first(x)

    model = Lazy()
    model(np.ones((1, 3), "float32"))
    index = ModelIndex(model)  # what one save or restore carries in its request
    before = index.registry()
    assert before is index.registry()  # one registry per call
    model.later.build((None, 3))  # built inside the call: new variables
    after = index.registry()
    assert [str(k) for k in before.keys()] == ["path:first/kernel", "path:first/bias"]
    assert [str(k) for k in after.keys()] == [
        "path:first/kernel",
        "path:first/bias",
        "path:later/kernel",
        "path:later/bias",
    ]


# -- each key text parsed once per call ---------------------------------------------------------
def test_parsed_keys_give_the_key_parsed_outside_them_and_refuse_the_same_texts():
    from conftest import hypothesis_examples
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from keras_stable_state._identity import keys
    from keras_stable_state.errors import KeyFormatError

    texts = st.one_of(
        st.builds(lambda p: f"path:{p}", st.from_regex(r"[a-z_/0-9]{1,12}", fullmatch=True)),
        st.builds(lambda i: f"order:{i}", st.integers(0, 10**6)),
        st.builds(lambda n: f"var:{n}", st.text(min_size=1, max_size=6)),
        st.text(max_size=12),
    )

    def parsed(parse, text):
        try:
            return parse(text)
        except KeyFormatError as err:
            return ("refused", str(err))

    @settings(max_examples=hypothesis_examples(200), deadline=None)
    @given(st.lists(texts, min_size=1, max_size=8))
    def check(batch):
        outside = [parsed(keys.VariableKey.parse, t) for t in batch]
        memo = keys.ParsedKeys()  # one call's (a ModelIndex holds it)
        first = [parsed(memo.parse, t) for t in batch]
        again = [parsed(memo.parse, t) for t in batch]
        assert first == outside and again == outside
        for a, b in zip(first, again, strict=True):
            if isinstance(a, keys.VariableKey):
                assert a is b  # the same key, not parsed again
        # a refused text is not kept
        assert set(memo.known) == {
            t for t, a in zip(batch, first, strict=True) if isinstance(a, keys.VariableKey)
        }

    check()
