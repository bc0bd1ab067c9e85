"""Stable paths for the variables and layers of a model, from one walk of its structure.

The stable path of a variable follows Keras' own ``.keras`` weight addressing
(``keras/src/saving/saving_lib.py``): attribute names for layers held in
attributes, and for layers held in lists (``Sequential`` and functional
``layers``, user lists) the layer's own name when the user chose it, otherwise
its snake-case class name made unique inside the list (``dense``, ``dense_1``).
Nothing in a path depends on Keras' process-global auto-naming counters, so
building the same model twice, or after other models, gives the same paths.
A layer's own variable is named by its variable name, or, when Keras named it
with its global counter (``add_weight(shape=...)`` without ``name`` gives
``variable_3``), by the layer attribute holding it, else ``variable@<i>``.
[`VariableRegistry`][keras_stable_state.VariableRegistry] keys variables
by these paths.
"""

from __future__ import annotations

import functools
import re

import keras

from keras_stable_state import _keras_compat

__all__ = ["stable_layer_paths", "stable_paths", "stable_variable_paths", "walk"]


@functools.lru_cache(maxsize=1024)
def _snake(name: str) -> str:
    return _keras_compat.to_snake_case(name)


@functools.lru_cache(maxsize=1024)
def _auto_name(prefix: str):
    """``<prefix>`` or ``<prefix>_<n>``: a name Keras' counters give (compiled once per prefix)."""
    return re.compile(re.escape(prefix) + r"(_[0-9]+)?")


def _looks_auto_named(obj) -> bool:
    """True when ``obj.name`` is what Keras' ``auto_name`` would have produced."""
    name = getattr(obj, "name", None)
    if not isinstance(name, str):
        return True
    return _auto_name(_snake(type(obj).__name__)).fullmatch(name) is not None


def _unique(name: str, used: dict) -> str:
    if name in used:
        used[name] += 1
        return f"{name}_{used[name]}"
    used[name] = 0
    return name


def _is_unnamed(variable) -> bool:
    """True when Keras named ``variable`` with its process-global counter
    (``add_weight(shape=...)`` without ``name`` gives ``variable``, ``variable_3``)."""
    name = str(variable.name).rsplit("/", 1)[-1]
    return (
        _auto_name("variable").fullmatch(name) is not None
        or _auto_name(_snake(type(variable).__name__)).fullmatch(name) is not None
    )


def _own_names(obj, own: list) -> list:
    """A stable name for each of ``own`` (the variables ``obj`` owns, in Keras' order).

    A named variable keeps its name. An unnamed one (named by Keras' global
    counter) is named by the attribute of ``obj`` holding it (``self.gamma =
    self.add_weight(shape=...)`` gives ``gamma``, the first such attribute in
    sorted order; leading underscores dropped), else ``variable@<i>``, ``i`` its
    index among ``obj``'s own unnamed variables that no attribute holds. Names are
    made unique inside ``obj``.
    """
    unnamed = [_is_unnamed(v) for v in own]
    attrs = {}
    if any(unnamed):  # the attributes are only looked at for unnamed variables
        for attr, value in vars(obj).items():
            if isinstance(value, keras.Variable) and (id(value) not in attrs or attr < attrs[id(value)]):
                attrs[id(value)] = attr
    names, used, index = [], {}, 0
    for v, no_name in zip(own, unnamed, strict=True):
        if not no_name:
            base = str(v.name).rsplit("/", 1)[-1]
        elif id(v) in attrs:
            base = attrs[id(v)].lstrip("_") or attrs[id(v)]
        else:
            base = f"variable@{index}"
            index += 1
        names.append(_unique(base, used))
    return names


def _own_variables(obj) -> list:
    """Variables an object owns itself (not through children), in Keras' order."""
    if isinstance(obj, keras.layers.Layer):
        trainable, non_trainable = _keras_compat.layer_own_variables(obj)
        return trainable + non_trainable + _keras_compat.seed_generator_states(obj)
    if isinstance(obj, keras.metrics.Metric):
        return _keras_compat.metric_own_variables(obj)
    return []


def _model_variable_ids(model) -> frozenset:
    variables = getattr(model, "variables", None)
    return frozenset(map(id, variables)) if isinstance(variables, (list, tuple)) else frozenset()


def _cached_walk(model, keras_style: bool, cache: dict):
    """``(model, out, layers, variable ids)``: `_walk_once` walked once per ``cache`` (a
    `ModelIndex`'s), and the ids of the model's variables when it was walked."""
    hit = cache.get(("walk", id(model), keras_style))
    if hit is None or hit[0] is not model:
        out, found = _walk_once(model, keras_style, cache)
        # The model's variables when walked: tells a variable the walk does not reach
        # from one created since (see stable_paths).
        hit = cache[("walk", id(model), keras_style)] = (model, out, found, _model_variable_ids(model))
    return hit


def walk(model, keras_style: bool, layers: dict | None = None, cache: dict | None = None) -> dict:
    """``id(variable) -> (path, variable)`` for one walk of ``model`` (``keras_style``: see
    `_walk_once`); with ``cache`` (the walk cache of a `ModelIndex`, one save or restore)
    the walk is made once and reused. Every layer reached is added to ``layers``
    (``id(layer) -> (path, layer)``) when given."""
    if cache is None:
        out, found = _walk_once(model, keras_style, None)
    else:
        _, out, found, _ = _cached_walk(model, keras_style, cache)
    if layers is not None:
        for k, v in found.items():
            layers.setdefault(k, v)
    return out


def stable_paths(model, variables, cache: dict | None = None) -> dict:
    """``id(variable) -> (path, variable)`` from the stable walk, for keying ``variables``.

    With ``cache`` (a `ModelIndex`'s) the walk is reused, unless one of ``variables`` is
    not reached by it and is a variable the model did not have when it was walked: then
    the model changed since (a layer built), and everything cached is dropped and the
    model walked again.
    """
    if cache is None:
        return _walk_once(model, False, None)[0]
    _, out, _, walked = _cached_walk(model, False, cache)
    new = [v for v in variables if id(v) not in out and id(v) not in walked]
    if new and not {id(v) for v in new}.isdisjoint(_model_variable_ids(model)):
        cache.clear()
        _, out, _, _ = _cached_walk(model, False, cache)
    return out


def _walk_once(model, keras_style: bool, cache: dict | None):
    """``(id(variable) -> (path, variable), id(layer) -> (path, layer))`` for one walk
    over the model; every layer reached is listed (the model itself at ``""``).
    ``cache`` (a `ModelIndex`'s, or ``None``) keeps what Keras' walk yields per object.

    ``keras_style=True`` reproduces Keras' own ``.weights.h5`` addressing
    (``_walk_saveable`` order, class-name container entries, ``vars/<i>``).
    ``keras_style=False`` gives stable paths: attribute-held layers are named by
    their attribute even when the attribute sorts after ``layers`` (Keras would
    reach them through the ``layers`` list first and number them by creation
    order), list entries by their user-chosen name, dict entries by their key,
    and a layer's own variables by name, never by Keras' global counter
    (`_own_names`).
    """
    walker = _Walker(keras_style, cache)
    walker.visit(model, "")
    return walker.out, walker.layers


_FOLLOWED = (list, tuple, dict, keras.layers.Layer, keras.metrics.Metric)


def _join(path, name):
    return f"{path}/{name}" if path else name


class _Walker:
    """One walk of `_walk_once` (methods, not nested closures: closures that call
    each other form a reference cycle, which would keep every visited container and
    the call's cache alive until the next full garbage collection)."""

    _GENERIC = ("layers", "_layers")

    def __init__(self, keras_style, cache):
        self.keras_style = keras_style
        self.cache = cache
        self.out: dict = {}
        self.layers: dict = {}
        self.visited: set = set()
        self.classes: dict = {}  # the class part of dir(), per class, for this walk
        # Containers such as ``Sequential.layers`` are built anew on each access: hold on to
        # every visited one so that a later list cannot reuse its id() and be skipped.
        self.alive: list = []

    def children(self, obj):
        cache = self.cache
        hit = None if cache is None else cache.get(("kids", id(obj)))
        if hit is not None and hit[0] is obj:
            kids = hit[1]
        else:
            # Only what a walk follows: containers, layers and metrics (kept for the call).
            kids = [
                (a, c) for a, c in _keras_compat.walk_saveable(obj, self.classes) if isinstance(c, _FOLLOWED)
            ]
            if cache is not None:
                cache[("kids", id(obj))] = (obj, kids)
        if self.keras_style or _keras_compat.obj_type(obj) in ("Sequential", "Functional"):
            return kids
        generic = self._GENERIC
        return [k for k in kids if k[0] not in generic] + [k for k in kids if k[0] in generic]

    def visit(self, obj, path):
        if id(obj) in self.visited or isinstance(obj, keras.optimizers.Optimizer):
            return
        self.visited.add(id(obj))
        own = _own_variables(obj)
        if self.keras_style:
            n_saved = (
                sum(map(len, _keras_compat.layer_own_variables(obj)))
                if isinstance(obj, keras.layers.Layer)
                else 0
            )
            names = [f"vars/{i}" for i in range(n_saved)]
        else:
            names = _own_names(obj, own)
        out = self.out
        for v, name in zip(own, names, strict=False):
            out.setdefault(id(v), (_join(path, name), v))
        if isinstance(obj, keras.layers.Layer):
            self.layers.setdefault(id(obj), (path, obj))
        for attr, child in self.children(obj):
            if isinstance(child, (list, tuple, dict)):
                self.visit_container(child, _join(path, attr))
            elif isinstance(child, (keras.layers.Layer, keras.metrics.Metric)):
                self.visit(child, _join(path, attr))

    def visit_container(self, container, path):
        if id(container) in self.visited:
            return
        self.visited.add(id(container))
        self.alive.append(container)
        # Nothing left to reach (a model's ``layers`` after its attributes, lists of
        # variables): no entry needs its name.
        visited = self.visited
        values = container.values() if isinstance(container, dict) else container
        if not any(isinstance(v, _FOLLOWED) and id(v) not in visited for v in values):
            return
        keras_style = self.keras_style
        if isinstance(container, dict):
            items = [(None if keras_style else str(k), v) for k, v in container.items()]
        else:
            items = ((None, v) for v in container)
        used: dict = {}
        for key, item in items:
            if isinstance(item, (keras.layers.Layer, keras.metrics.Metric)):
                if key is not None:
                    base = key
                elif keras_style or _looks_auto_named(item):
                    base = _snake(type(item).__name__)
                else:
                    base = item.name
                self.visit(item, f"{path}/{_unique(base, used)}")
            elif isinstance(item, (list, tuple, dict)):
                self.visit_container(item, f"{path}/{_unique(key or 'container', used)}")


def stable_variable_paths(model) -> dict:
    """Map ``id(variable)`` to its stable path for every variable the walk reaches.

    The walk follows ``keras.saving`` (``_walk_saveable``) with three changes
    that make paths stable: a layer held in an attribute is named by the
    attribute (also when the attribute sorts after ``layers``), a layer in a
    list by the name its user gave it (else its snake-case class name, made
    unique in the list), a layer in a dict by its key. A variable reached twice
    (a tied or shared layer) keeps its first path. Optimizers are not walked.

    Args:
        model: A ``keras.Model`` or ``keras.layers.Layer``.

    Returns:
        ``dict`` from ``id(variable)`` to ``(path, variable, keras_path)``, where
        ``keras_path`` is where stock Keras ``.weights.h5`` files keep the
        variable (``"layers/dense/vars/0"``), or ``None`` for state stock Keras
        does not save (seed generators).
    """
    ours = walk(model, keras_style=False)
    theirs = walk(model, keras_style=True)
    return {i: (path, v, theirs.get(i, (None,))[0]) for i, (path, v) in ours.items()}


def stable_layer_paths(model) -> dict:
    """Map ``id(layer)`` to ``(path, layer)`` for every layer the walk reaches.

    Paths are the ones `stable_variable_paths` builds variable paths
    from (``"layers/lookup"``, ``"encoder/norm"``), so they never depend on
    Keras' global naming counters; the model itself is at ``""``. A layer
    reached twice keeps its first path.

    Args:
        model: A ``keras.Model`` or ``keras.layers.Layer``.

    Returns:
        ``dict`` from ``id(layer)`` to ``(path, layer)``, in walk order.

    Examples:
        >>> [path for path, _ in stable_layer_paths(model).values()]
        ['', 'layers/lookup', 'layers/embedding']
    """
    layers: dict = {}
    walk(model, keras_style=False, layers=layers)
    return layers
