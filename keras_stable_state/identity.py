"""Stable keys for model variables.

A key says how it was made, so a registry can be rebuilt from a file's keys
alone:

* ``path:<stable path>``: a *named* key. The stable path follows Keras' own
  ``.keras`` weight addressing (``keras/src/saving/saving_lib.py``): attribute
  names for layers held in attributes, and for layers held in lists (``Sequential``
  and functional ``layers``, user lists) the layer's own name when the user chose
  it, otherwise its snake-case class name made unique inside the list
  (``dense``, ``dense_1``). Nothing in a path depends on Keras' process-global
  auto-naming counters, so building the same model twice, or after other
  models, gives the same keys.
  A layer's own variable is named by its variable name, or, when Keras named it
  with its global counter (``add_weight(shape=...)`` without ``name`` gives
  ``variable_3``), by the layer attribute holding it, else ``variable@<i>``.
* ``order:<i>``: an *ordered* key, the variable's registration index in the
  list the registry was built over. It is the fallback for variables the walk
  does not reach, and for files that carry no names (stock Keras files).

Binding saved keys to live variables (:meth:`VariableRegistry.bind`) matches
named keys first; ordered keys then bind by index, never claim a variable that
a named key owns, and must agree in shape and dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import keras

from keras_stable_state import _keras_compat as compat
from keras_stable_state.errors import BindingError
from keras_stable_state.keys import NAMED, ORDERED, VariableKey

# VariableKey lives in keys.py (the key grammar, no Keras); it stays importable from here.
__all__ = ["VariableKey", "VariableRegistry", "stable_layer_paths", "stable_variable_paths"]


def _snake(name: str) -> str:
    return compat.to_snake_case(name)


def _looks_auto_named(obj) -> bool:
    """True when ``obj.name`` is what Keras' ``auto_name`` would have produced."""
    name = getattr(obj, "name", None)
    if not isinstance(name, str):
        return True
    return re.fullmatch(re.escape(_snake(type(obj).__name__)) + r"(_[0-9]+)?", name) is not None


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
    prefixes = {"variable", _snake(type(variable).__name__)}
    return any(re.fullmatch(re.escape(p) + r"(_[0-9]+)?", name) for p in prefixes)


def _own_names(obj, own: list) -> list:
    """A stable name for each of ``own`` (the variables ``obj`` owns, in Keras' order).

    A named variable keeps its name. An unnamed one (named by Keras' global
    counter) is named by the attribute of ``obj`` holding it (``self.gamma =
    self.add_weight(shape=...)`` gives ``gamma``; leading underscores dropped),
    else ``variable@<i>``, ``i`` its index among ``obj``'s own unnamed variables
    that no attribute holds. Names are made unique inside ``obj``.
    """
    attrs = {}
    for attr, value in sorted(vars(obj).items()):
        if isinstance(value, keras.Variable) and id(value) not in attrs:
            attrs[id(value)] = attr.lstrip("_") or attr
    names, used, index = [], {}, 0
    for v in own:
        if not _is_unnamed(v):
            base = str(v.name).rsplit("/", 1)[-1]
        elif id(v) in attrs:
            base = attrs[id(v)]
        else:
            base = f"variable@{index}"
            index += 1
        names.append(_unique(base, used))
    return names


def _own_variables(obj) -> list:
    """Variables an object owns itself (not through children), in Keras' order."""
    if isinstance(obj, keras.layers.Layer):
        trainable, non_trainable = compat.layer_own_variables(obj)
        return trainable + non_trainable + compat.seed_generator_states(obj)
    if isinstance(obj, keras.metrics.Metric):
        return compat.metric_own_variables(obj)
    return []


# Inside ``one_walk()``: what Keras' saving walk yields per object, and each finished
# walk, so one save or restore walks the model once however many registries it builds.
_WALKS = contextvars.ContextVar("keras_stable_state_walks", default=None)


@contextlib.contextmanager
def one_walk():
    """Within this context the model's structure is walked once and reused.

    ``save_training_state`` and ``restore_training_state`` build several registries
    (model, contract, each optimizer, layer state) from one unchanged model; each
    used to walk it again (Keras' ``dir()`` walk costs about 1 ms per layer). Inside
    the context the children Keras' walk yields for each object and each complete
    walk are kept and reused; on leaving, they are dropped. Nested contexts share
    the outer one. Do not add or remove layers or variables inside it.
    """
    if _WALKS.get() is not None:
        yield
        return
    token = _WALKS.set({})
    try:
        yield
    finally:
        _WALKS.reset(token)


def _walk(model, keras_style: bool, layers: dict | None = None) -> dict:
    cache = _WALKS.get()
    if cache is None:
        out, found = _walk_once(model, keras_style, None)
    else:
        hit = cache.get(("walk", id(model), keras_style))
        if hit is None or hit[0] is not model:
            hit = cache[("walk", id(model), keras_style)] = (model, *_walk_once(model, keras_style, cache))
        _, out, found = hit
    if layers is not None:
        for k, v in found.items():
            layers.setdefault(k, v)
    return out


def _walk_once(model, keras_style: bool, cache: dict | None):
    """``(id(variable) -> (path, variable), id(layer) -> (path, layer))`` for one walk
    over the model; every layer reached is listed (the model itself at ``""``).
    ``cache`` (from :func:`one_walk`) keeps what Keras' walk yields per object.

    ``keras_style=True`` reproduces Keras' own ``.weights.h5`` addressing
    (``_walk_saveable`` order, class-name container entries, ``vars/<i>``).
    ``keras_style=False`` gives stable paths: attribute-held layers are named by
    their attribute even when the attribute sorts after ``layers`` (Keras would
    reach them through the ``layers`` list first and number them by creation
    order), list entries by their user-chosen name, dict entries by their key,
    and a layer's own variables by name, never by Keras' global counter
    (:func:`_own_names`).
    """
    out: dict = {}
    layers: dict = {}
    visited: set = set()
    # Containers such as ``Sequential.layers`` are built anew on each access: hold on to
    # every visited one so that a later list cannot reuse its id() and be skipped.
    alive: list = []

    def join(path, name):
        return f"{path}/{name}" if path else name

    def children(obj):
        hit = None if cache is None else cache.get(("kids", id(obj)))
        if hit is not None and hit[0] is obj:
            kids = hit[1]
        else:
            kids = list(compat.walk_saveable(obj))
            if cache is not None:
                cache[("kids", id(obj))] = (obj, kids)
        if keras_style or compat.obj_type(obj) in ("Sequential", "Functional"):
            return kids
        generic = ("layers", "_layers")
        return [k for k in kids if k[0] not in generic] + [k for k in kids if k[0] in generic]

    def visit(obj, path):
        if id(obj) in visited or isinstance(obj, keras.optimizers.Optimizer):
            return
        visited.add(id(obj))
        n_saved = sum(map(len, compat.layer_own_variables(obj))) if isinstance(obj, keras.layers.Layer) else 0
        own = _own_variables(obj)
        names = [f"vars/{i}" for i in range(n_saved)] if keras_style else _own_names(obj, own)
        for v, name in zip(own, names, strict=False):
            out.setdefault(id(v), (join(path, name), v))
        if isinstance(obj, keras.layers.Layer):
            layers.setdefault(id(obj), (path, obj))
        for attr, child in children(obj):
            if isinstance(child, (list, tuple, dict)):
                visit_container(child, join(path, attr))
            elif isinstance(child, (keras.layers.Layer, keras.metrics.Metric)):
                visit(child, join(path, attr))

    def visit_container(container, path):
        if id(container) in visited:
            return
        visited.add(id(container))
        alive.append(container)
        if isinstance(container, dict):
            items = [(None if keras_style else str(k), v) for k, v in container.items()]
        else:
            items = [(None, v) for v in container]
        used: dict = {}
        for key, item in items:
            if isinstance(item, (keras.layers.Layer, keras.metrics.Metric)):
                if key is not None:
                    base = key
                elif keras_style or _looks_auto_named(item):
                    base = _snake(type(item).__name__)
                else:
                    base = item.name
                visit(item, f"{path}/{_unique(base, used)}")
            elif isinstance(item, (list, tuple, dict)):
                visit_container(item, f"{path}/{_unique(key or 'container', used)}")

    visit(model, "")
    return out, layers


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
    ours = _walk(model, keras_style=False)
    theirs = _walk(model, keras_style=True)
    return {i: (path, v, theirs.get(i, (None,))[0]) for i, (path, v) in ours.items()}


def stable_layer_paths(model) -> dict:
    """Map ``id(layer)`` to ``(path, layer)`` for every layer the walk reaches.

    Paths are the ones :func:`stable_variable_paths` builds variable paths
    from (``"layers/lookup"``, ``"encoder/norm"``), so they never depend on
    Keras' global naming counters; the model itself is at ``""``. A layer
    reached twice keeps its first path.

    Args:
        model: A ``keras.Model`` or ``keras.layers.Layer``.

    Returns:
        ``dict`` from ``id(layer)`` to ``(path, layer)``, in walk order.

    Example:
        >>> [path for path, _ in stable_layer_paths(model).values()]
        ['', 'layers/lookup', 'layers/embedding']
    """
    layers: dict = {}
    _walk(model, keras_style=False, layers=layers)
    return layers


class VariableRegistry:
    """Durable keys for a list of variables.

    Args:
        entries: ``(VariableKey, variable)`` pairs, in registration order.

    Raises:
        BindingError: if two entries share a key (the duplicates are listed).

    Example:
        >>> registry = VariableRegistry.from_model(model)
        >>> str(registry.keys()[0])
        'path:layers/dense/kernel'
        >>> registry.variable_of(VariableKey.parse("path:layers/dense/kernel")) is model.layers[0].kernel
        True
    """

    def __init__(self, entries):
        self.entries = list(entries)
        self.keras_paths = {}
        self._by_key = {}
        self._by_id = {}
        dup = []
        for key, var in self.entries:
            if key in self._by_key:
                dup.append(str(key))
            self._by_key[key] = var
            self._by_id[id(var)] = key
        if dup:
            raise BindingError(
                f"Duplicate variable keys {sorted(set(dup))}: two variables resolve to the same "
                "stable path. Give the layers distinct names.",
                key=dup[0],
            )

    @classmethod
    def from_model(cls, model, variables=None) -> VariableRegistry:
        """Key ``variables`` (default: ``model.variables``) by the model's stable paths.

        A variable the walk does not reach gets ``order:<its index in variables>``.
        A tied variable appearing twice in ``variables`` is keyed once.
        """
        variables = list(model.variables if variables is None else variables)
        paths = stable_variable_paths(model) if model is not None else {}
        entries, seen = [], set()
        keras_paths = {}
        for i, v in enumerate(variables):
            if id(v) in seen:
                continue
            seen.add(id(v))
            hit = paths.get(id(v))
            entries.append((VariableKey(NAMED, hit[0]) if hit else VariableKey(ORDERED, str(i)), v))
            if hit and hit[2]:
                keras_paths[id(v)] = hit[2]
        registry = cls(entries)
        registry.keras_paths = keras_paths
        return registry

    def key_of(self, variable) -> VariableKey:
        """The key of a registered variable.

        Raises:
            KeyError: if the variable is not in this registry.
        """
        return self._by_id[id(variable)]

    def __contains__(self, variable) -> bool:
        return id(variable) in self._by_id

    def keys(self) -> list:
        return [k for k, _ in self.entries]

    def variable_of(self, key: VariableKey):
        return self._by_key.get(key)

    def bind(self, saved):
        """Bind saved entries to live variables.

        Args:
            saved: iterable of ``(VariableKey, shape tuple, dtype str)`` as read
                from a file.

        Returns:
            ``(bound, unmatched)``: ``bound`` maps each saved key to
            ``(variable, "name" | "order")``; ``unmatched`` lists saved named
            keys with no live variable (the caller decides whether that is an
            error).

        Raises:
            BindingError: if an ordered key points past the registry, at a
                variable a named key owns, or at a variable of another shape or
                dtype.
        """
        saved = list(saved)
        bound, unmatched, claimed = {}, [], set()
        for key, _, _ in saved:
            if key.named:
                var = self._by_key.get(key)
                if var is None:
                    unmatched.append(key)
                else:
                    bound[key] = (var, "name")
                    claimed.add(id(var))
        by_index = {i: v for i, (_, v) in enumerate(self.entries)}
        for key, shape, dtype in saved:
            if key.named:
                continue
            var = by_index.get(key.index)
            if var is None:
                raise BindingError(
                    f"Ordered key {key} points at registration index {key.index}, but the model "
                    f"has {len(self.entries)} variables. The file was written for another model.",
                    key=str(key),
                    expected=f"index < {len(self.entries)}",
                    received=key.index,
                )
            if id(var) in claimed:
                raise BindingError(
                    f"Ordered key {key} would claim variable {self.key_of(var)}, which a named key "
                    "in the same file already restores. An order bind never claims a named slot; "
                    "the file mixes keys from two different models.",
                    key=str(key),
                )
            if shape is not None and (tuple(var.shape) != tuple(shape) or str(var.dtype) != str(dtype)):
                raise BindingError(
                    f"Ordered key {key} binds by registration order to {self.key_of(var)}, which has "
                    f"shape {tuple(var.shape)} and dtype {var.dtype}, but the saved array has shape "
                    f"{tuple(shape)} and dtype {dtype}. The model's variables are not in the order "
                    "they were saved in; save with keras_stable_state so slots carry named keys.",
                    key=str(key),
                    expected=(tuple(shape), str(dtype)),
                    received=(tuple(var.shape), str(var.dtype)),
                )
            bound[key] = (var, "order")
            claimed.add(id(var))
        return bound, unmatched
