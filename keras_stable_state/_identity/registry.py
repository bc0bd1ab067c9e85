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
import functools
import re

import keras

from keras_stable_state import _keras_compat as compat
from keras_stable_state._identity.keys import NAMED, ORDERED, VariableKey
from keras_stable_state.errors import BindingError

# VariableKey lives in keys.py (the key grammar, no Keras); it stays importable from here.
__all__ = ["VariableKey", "VariableRegistry", "stable_layer_paths", "stable_variable_paths"]


@functools.lru_cache(maxsize=1024)
def _snake(name: str) -> str:
    return compat.to_snake_case(name)


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
        trainable, non_trainable = compat.layer_own_variables(obj)
        return trainable + non_trainable + compat.seed_generator_states(obj)
    if isinstance(obj, keras.metrics.Metric):
        return compat.metric_own_variables(obj)
    return []


# Inside ``one_walk()``: what Keras' saving walk yields per object, each finished walk
# and each registry built, so one save or restore walks the model once however many
# registries it builds (model, contract, each optimizer, arguments, layer state).
_WALKS = contextvars.ContextVar("keras_stable_state_walks", default=None)


@contextlib.contextmanager
def one_walk():
    """Within this context the model's structure is walked once and reused.

    ``save_training_state`` and ``restore_training_state`` build several registries
    (model, contract, each optimizer, layer state) from one unchanged model; each
    used to walk it again (Keras' ``dir()`` walk costs about 0.3 ms per layer). Inside
    the context the children Keras' walk yields for each object, each complete walk
    and each registry (by model and variable list) are kept and reused; on leaving,
    they are dropped. Nested contexts share the outer one.

    A registry asked for variables the walk did not reach, which the model has
    gained since it was walked (a layer built inside the context), walks the
    model again; building an optimizer changes no walk (optimizers are not
    walked) and a registry over its variables is keyed by those variables. Do not
    otherwise add, remove or rename layers inside the context.
    """
    if _WALKS.get() is not None:
        yield
        return
    token = _WALKS.set({})
    try:
        yield
    finally:
        _WALKS.reset(token)


def _model_variable_ids(model) -> frozenset:
    variables = getattr(model, "variables", None)
    return frozenset(map(id, variables)) if isinstance(variables, (list, tuple)) else frozenset()


def _cached_walk(model, keras_style: bool, cache: dict):
    """``(model, out, layers, variable ids)``: :func:`_walk_once` walked once per
    ``one_walk()`` context, and the ids of the model's variables when it was walked."""
    hit = cache.get(("walk", id(model), keras_style))
    if hit is None or hit[0] is not model:
        out, found = _walk_once(model, keras_style, cache)
        # The model's variables when walked: tells a variable the walk does not reach
        # from one created since (see _stable_paths).
        hit = cache[("walk", id(model), keras_style)] = (model, out, found, _model_variable_ids(model))
    return hit


def _walk(model, keras_style: bool, layers: dict | None = None) -> dict:
    cache = _WALKS.get()
    if cache is None:
        out, found = _walk_once(model, keras_style, None)
    else:
        _, out, found, _ = _cached_walk(model, keras_style, cache)
    if layers is not None:
        for k, v in found.items():
            layers.setdefault(k, v)
    return out


def _stable_paths(model, variables) -> dict:
    """``id(variable) -> (path, variable)`` from the stable walk, for keying ``variables``.

    Inside :func:`one_walk` the walk of the call is reused, unless one of
    ``variables`` is not reached by it and is a variable the model did not have
    when it was walked: then the model changed inside the context (a layer
    built), and everything cached is dropped and the model walked again.
    """
    cache = _WALKS.get()
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
    walker = _Walker(keras_style, cache)
    walker.visit(model, "")
    return walker.out, walker.layers


_FOLLOWED = (list, tuple, dict, keras.layers.Layer, keras.metrics.Metric)


def _join(path, name):
    return f"{path}/{name}" if path else name


class _Walker:
    """One walk of :func:`_walk_once` (methods, not nested closures: closures that call
    each other form a reference cycle, which would keep every visited container and
    the call's cache alive until the next full garbage collection)."""

    _GENERIC = ("layers", "_layers")

    def __init__(self, keras_style, cache):
        self.keras_style = keras_style
        self.cache = cache
        self.out: dict = {}
        self.layers: dict = {}
        self.visited: set = set()
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
            kids = [(a, c) for a, c in compat.walk_saveable(obj) if isinstance(c, _FOLLOWED)]
            if cache is not None:
                cache[("kids", id(obj))] = (obj, kids)
        if self.keras_style or compat.obj_type(obj) in ("Sequential", "Functional"):
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
                sum(map(len, compat.layer_own_variables(obj))) if isinstance(obj, keras.layers.Layer) else 0
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

    def __init__(self, entries, *, model=None):
        self.entries = list(entries)
        # Where stock Keras keeps each variable: computed from ``model`` on first use.
        self._model = model
        self._keras_paths = None if model is not None else {}
        self._keras_source = None
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
        A tied variable appearing twice in ``variables`` is keyed once. Inside
        :func:`one_walk` (every save and restore) the registry of one model and
        variable list is built once and shared: treat it as read-only.
        """
        variables = list(model.variables if variables is None else variables)
        cache = _WALKS.get() if model is not None else None
        if cache is not None:
            cache_key = ("registry", id(model), tuple(map(id, variables)))
            hit = cache.get(cache_key)
            if hit is not None and hit[0] is model:
                return hit[1]
        paths = _stable_paths(model, variables) if model is not None else {}
        entries, seen = [], set()
        for i, v in enumerate(variables):
            if id(v) in seen:
                continue
            seen.add(id(v))
            hit = paths.get(id(v))
            entries.append((VariableKey(NAMED, hit[0]) if hit else VariableKey(ORDERED, str(i)), v))
        registry = cls(entries, model=model)
        if cache is not None:
            cache[cache_key] = (model, registry)
        return registry

    def rekeyed(self, entries) -> VariableRegistry:
        """A registry over ``entries`` whose :attr:`keras_paths` are this one's (the same model)."""
        registry = VariableRegistry(entries, model=self._model)
        registry._keras_paths = self._keras_paths
        registry._keras_source = self
        return registry

    @property
    def keras_paths(self) -> dict:
        """``id(variable) -> path`` where stock Keras ``.weights.h5`` files keep each
        variable the model's walk reaches (``"layers/dense/vars/0"``).

        Only restores of stock Keras files need it, so it is computed on first use
        (a walk in Keras' own order: inside :func:`one_walk`, once per call).
        """
        if self._keras_paths is None:
            if self._keras_source is not None:
                self._keras_paths = self._keras_source.keras_paths
            else:
                ours = _walk(self._model, keras_style=False)
                theirs = _walk(self._model, keras_style=True)
                self._keras_paths = {
                    id(v): theirs[id(v)][0] for _, v in self.entries if id(v) in ours and id(v) in theirs
                }
        return self._keras_paths

    @keras_paths.setter
    def keras_paths(self, value) -> None:
        self._keras_paths = value

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
