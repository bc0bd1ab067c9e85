"""The variables layers, metrics and models keep, and the vocabulary of lookup layers."""

from __future__ import annotations

from typing import Any

import keras

__all__ = [
    "called_as_layer",
    "clear_vocabulary",
    "flatten_layers",
    "frozen_vocabulary_size",
    "index_lookup_class",
    "layer_own_variables",
    "lookup_token_start",
    "metric_own_variables",
    "seed_generator_states",
    "text_vectorization_lookup",
    "tf_plain_resource",
    "tf_read",
    "variable_storage",
]


def layer_own_variables(layer):
    """``(trainable, non_trainable)``: the variables a layer owns itself, in Keras' order."""
    return list(layer._trainable_variables), list(layer._non_trainable_variables)


def seed_generator_states(layer) -> list:
    """The state variables of a layer's own seed generators."""
    return [sg.state for sg in layer._seed_generators]


def variable_storage(variable):
    """What a ``keras.Variable`` holds (Keras' ``_value``): on Torch its ``torch.nn.Parameter``
    (never autocast, unlike ``variable.value``), on TensorFlow its ``tf.Variable``, on JAX
    its array."""
    return variable._value


_TF_TYPES: list = []  # [ResourceVariable, Keras' Variable.assign, in_stateless_scope], imported once
# TensorFlow's plain resource variables: Keras' variables, and optimizer slots made inside a
# tf.function (UnliftedInitializerVariable); a distribution strategy's variables are not.
_TF_PLAIN = frozenset({"ResourceVariable", "UninitializedVariable", "UnliftedInitializerVariable"})


def tf_plain_resource(variable):
    """On TensorFlow, the ``tf.Variable`` (a plain resource variable) behind ``variable``
    when reading and writing its resource directly is all that ``variable.assign`` and a
    read of ``variable.value`` do: eager execution, no stateless scope, no distribution
    strategy's variable, no ``assign`` of the variable's own or of a subclass. Else
    ``None``: go through Keras. Always ``None`` on the JAX and Torch backends, without
    importing TensorFlow (a JAX- or Torch-only install has none)."""
    if keras.backend.backend() != "tensorflow":
        return None
    if not _TF_TYPES:
        from keras.src.backend.common.stateless_scope import in_stateless_scope
        from keras.src.backend.common.variables import Variable
        from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

        _TF_TYPES.extend([BaseResourceVariable, Variable.assign, in_stateless_scope])
    resource_type, keras_assign, in_stateless_scope = _TF_TYPES
    resource = getattr(variable, "_value", None)
    if type(resource).__name__ not in _TF_PLAIN or not isinstance(resource, resource_type):
        return None
    if "assign" in vars(variable) or type(variable).assign is not keras_assign or in_stateless_scope():
        return None
    return None if resource._in_graph_mode else resource


def tf_read(variable: Any) -> Any:
    """On TensorFlow, one ``ReadVariableOp`` of a plain variable's resource
    (`tf_plain_resource`): a tensor sharing the variable's buffer (TensorFlow
    copies on write), read without the 40-100 us of Python of ``variable.value``; else
    ``None``."""
    resource = tf_plain_resource(variable)
    if resource is None:
        return None
    from tensorflow.python.ops import gen_resource_variable_ops

    return gen_resource_variable_ops.read_variable_op(resource.handle, resource.dtype)


# Keras' Torch ``Variable`` members that ``assign`` runs through: its own ``assign`` (dtype
# conversion, shape check, stateless scope) and ``shape``, Torch's ``_convert_to_tensor``,
# ``_direct_assign`` (a ``copy_`` into ``value``) and ``value``.
_TORCH_ASSIGN_MEMBERS = ("assign", "shape", "_convert_to_tensor", "_direct_assign", "value")
_TORCH_TYPES: list = []  # [{member: Keras' Torch Variable's own}, in_stateless_scope]


def torch_swap_is_assign(variable) -> bool:
    """On Torch, whether giving ``variable``'s parameter a value's storage
    (``Parameter.data = value``, with ``value`` of the variable's shape, dtype and
    device, then the parameter's version counter increased as ``copy_`` would) is all
    that ``variable.assign(value)`` would then do: Keras' own ``assign``, ``shape``,
    ``_convert_to_tensor``, ``_direct_assign`` (a ``copy_`` into the parameter, of
    memory it already holds) and ``value``, none of them replaced on the variable or a
    subclass, and no stateless scope (where ``assign`` records an update instead).
    Else ``False``: call ``assign``."""
    if not _TORCH_TYPES:
        from keras.src.backend.common.stateless_scope import in_stateless_scope
        from keras.src.backend.torch.core import Variable as TorchVariable

        own = {name: getattr(TorchVariable, name) for name in _TORCH_ASSIGN_MEMBERS}
        _TORCH_TYPES[:] = [own, in_stateless_scope]  # one assignment: no half-filled list
    members, in_stateless_scope = _TORCH_TYPES
    kind = type(variable)
    instance = vars(variable)
    return (
        all(getattr(kind, name, None) is member for name, member in members.items())
        and not any(name in instance for name in members)
        and not in_stateless_scope()
    )


def metric_own_variables(metric) -> list:
    return list(metric._variables)


def flatten_layers(model):
    """Every layer inside ``model`` (Keras' ``_flatten_layers``)."""
    return model._flatten_layers()


def called_as_layer(model) -> bool:
    """Whether ``model`` was called on another model's inputs (it is a layer of that model)."""
    return bool(getattr(model, "_inbound_nodes", None))


def index_lookup_class():
    """Keras' ``IndexLookup``, the base of ``StringLookup`` and ``IntegerLookup``."""
    from keras.src.layers.preprocessing.index_lookup import IndexLookup

    return IndexLookup


def text_vectorization_lookup(layer):
    """The lookup layer a ``TextVectorization`` keeps its vocabulary in."""
    return layer._lookup_layer


def lookup_token_start(lookup) -> int:
    """How many special tokens (mask, OOV) come before the first vocabulary token."""
    return lookup._token_start_index()


def frozen_vocabulary_size(lookup) -> int | None:
    """The vocabulary size a lookup layer's first call fixed its output width to (``None``
    while it has not been called, or in a Keras that does not record it)."""
    return getattr(lookup, "_frozen_vocab_size", None)


def clear_vocabulary(lookup) -> None:
    """Put a lookup layer back to an empty vocabulary (``set_vocabulary`` refuses one)."""
    lookup.lookup_table = lookup._uninitialized_lookup_table()
    lookup._record_vocabulary_size()
