"""The walk's ``dir()`` with the class part listed once per class per walk
(``_keras_compat.attribute_names``) names exactly what ``dir()`` names, and the walk of
one object yields what Keras' own ``saving_lib._walk_saveable`` yields, for Keras'
layers, models, optimizers and metrics and for generated layers with attributes of
every kind (instance and class attributes, names with digits and underscores, Torch
parameters and buffers, a custom ``__dir__``, a property that raises)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import hypothesis_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from keras.src.saving import saving_lib

from keras_stable_state import _keras_compat


def _skip(obj):
    return frozenset(saving_lib.get_attr_skipset(obj._obj_type()))


def _dir_names(obj, skip):
    return {a for a in dir(obj) if a not in skip and a[:2] != "__"}


def _child(child):
    """A layer, metric or optimizer by identity, a list by its items' (``Sequential.layers``
    is built anew on each access), a dict by its keys (properties may build one), anything
    else (a bound method is new on each access) by its type."""
    if isinstance(child, list):
        return ("list", tuple(map(id, child)))
    if isinstance(child, dict):
        return ("dict", tuple(child))
    if isinstance(child, (keras.layers.Layer, keras.metrics.Metric, keras.optimizers.Optimizer)):
        return id(child)
    return type(child).__name__


def _keras_pairs(obj):
    """Keras' own walk, an attribute ``dir()`` lists twice in a row once
    (``Module.__dir__`` may list a name twice: one attribute)."""
    out = []
    for attr, child in saving_lib._walk_saveable(obj):
        if not out or out[-1][0] != attr:
            out.append((attr, _child(child)))
    return out


def _ours(obj, classes):
    return [(attr, _child(child)) for attr, child in _keras_compat.walk_saveable(obj, classes)]


def _stock_objects():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, name="hidden")(inputs)
    functional = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    sequential = keras.Sequential(
        [
            keras.Input((4, 4, 1)),
            keras.layers.Conv2D(2, 3),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(3),
        ]
    )
    sequential.compile(optimizer="adam", loss="mse", metrics=["mae"])
    sequential.fit(np.zeros((4, 4, 4, 1)), np.zeros((4, 3)), verbose=0)
    lstm = keras.layers.LSTM(3)
    lstm.build((None, 2, 4))
    embedding = keras.layers.Embedding(10, 3)
    embedding.build((None, 2))
    attention = keras.layers.MultiHeadAttention(2, 4)
    attention.build((None, 3, 8), (None, 3, 8))
    return [
        functional,
        *functional.layers,
        sequential,
        *sequential.layers,
        sequential.optimizer,
        *sequential.metrics,
        lstm,
        lstm.cell,
        embedding,
        attention,
        keras.metrics.AUC(),
        keras.optimizers.SGD(momentum=0.9),
    ]


def test_stock_objects_list_what_dir_lists():
    classes: dict = {}
    objects = _stock_objects()
    for _ in range(2):  # the second pass takes every class part from ``classes``
        for obj in objects:
            skip = _skip(obj)
            assert _keras_compat.attribute_names(obj, skip, classes) == _dir_names(obj, skip), type(obj)
            assert _ours(obj, classes) == _keras_pairs(obj), type(obj)
    assert classes, "no class part was kept: the walk would list every class each time"


# ``~`` first: Keras' walk gives ``_a`` and ``~_a`` one sort key (private names last)
_NAME = st.from_regex(r"~?_{0,2}[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda n: not n.endswith("__"))
_VALUE = st.sampled_from(["int", "layer", "list", "dict", "str"])


def _value(kind, i):
    if kind == "int":
        return i
    if kind == "str":
        return f"v{i}"
    if kind == "layer":
        return keras.layers.Dense(2, name=f"g{i}")
    if kind == "list":
        return [keras.layers.Dense(2, name=f"l{i}"), i]
    return {"a": keras.layers.Dense(2, name=f"d{i}")}


@settings(max_examples=hypothesis_examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    own=st.dictionaries(_NAME, _VALUE, max_size=6),
    shared=st.dictionaries(_NAME, _VALUE, max_size=3),
    later=st.dictionaries(_NAME, _VALUE, max_size=3),
    raising=st.booleans(),
    hidden=st.booleans(),
)
def test_generated_layers_list_what_dir_lists(own, shared, later, raising, hidden):
    """Two instances of one generated class (the second read from ``classes``), with
    instance attributes set before and after the first walk, class attributes, a
    property that raises, and (``hidden``) a ``__dir__`` of its own that hides names."""
    body = {  # new names only: Keras' own class attributes stay as they are
        name: _value(kind, i)
        for i, (name, kind) in enumerate(shared.items())
        if not hasattr(keras.layers.Layer, name)
    }
    if raising:
        body["broken"] = property(lambda self: 1 / 0)
    if hidden:
        body["__dir__"] = lambda self: [n for n in object.__dir__(self) if not n.startswith("_")]
    cls = type("Generated", (keras.layers.Layer,), body)
    first, second = cls(), cls()
    for obj in (first, second):
        for i, (name, kind) in enumerate(own.items()):
            if not hasattr(obj, name):  # new names only: Keras' own attributes stay as they are
                setattr(obj, name, _value(kind, i))
    classes: dict = {}
    for obj in (first, second, first):
        skip = _skip(obj)
        assert _keras_compat.attribute_names(obj, skip, classes) == set(_dir_names(obj, skip))
        assert _ours(obj, classes) == _keras_pairs(obj)
        for i, (name, kind) in enumerate(later.items()):  # new attributes set between walks
            if not hasattr(obj, name):
                setattr(obj, name, _value(kind, 100 + i))


def test_names_sharing_a_sort_key_come_in_keras_order():
    """``_aN`` and ``~_aN`` share Keras' sort key (``~_aN``); Keras' stable sort of the
    alphabetical ``dir()`` puts ``_aN`` first. Sixteen such pairs: an order left to a
    set's iteration (it changes with ``PYTHONHASHSEED``) would put at least one pair
    the other way round in all but about one process in 65,000."""
    layer = keras.layers.Dense(2)
    for i in range(16):
        setattr(layer, f"_a{i}", i)
        setattr(layer, f"~_a{i}", -i)
    ours = [attr for attr, _ in _keras_compat.walk_saveable(layer, {})]
    assert ours == [attr for attr, _ in saving_lib._walk_saveable(layer)]
    assert ours.index("_a3") + 1 == ours.index("~_a3")


def test_torch_parameters_buffers_and_digit_names():
    if keras.backend.backend() != "torch":
        pytest.skip("torch.nn.Module.__dir__ (parameters, submodules, buffers) exists on Torch alone")
    import torch

    layer = keras.layers.Dense(3)
    layer.extra = torch.nn.Linear(2, 2)  # (a layer takes new sub-layers before it is built)
    layer.build((None, 2))
    layer.register_buffer("scale", torch.ones(2))
    layer._modules["0digit"] = torch.nn.Linear(1, 1)  # Module.__dir__ drops names starting with a digit
    classes: dict = {}
    for _ in range(2):
        skip = _skip(layer)
        names = _keras_compat.attribute_names(layer, skip, classes)
        assert names == _dir_names(layer, skip)
        assert {"scale", "extra"} <= names and "0digit" not in names
        assert _ours(layer, classes) == _keras_pairs(layer)
