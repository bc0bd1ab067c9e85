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

Binding saved keys to live variables ([`VariableRegistry.bind`][keras_stable_state.VariableRegistry.bind]) matches
named keys first; ordered keys then bind by index, never claim a variable that
a named key owns, and must agree in shape and dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from keras_stable_state._identity.keys import NAMED, ORDERED, ParsedKeys, VariableKey
from keras_stable_state._identity.paths import stable_paths, walk
from keras_stable_state.errors import BindingError, listed

if TYPE_CHECKING:
    import keras


# VariableKey lives in keys.py (the key grammar, no Keras); it stays importable from here.
__all__ = ["ModelIndex", "VariableKey", "VariableRegistry"]


class VariableRegistry:
    """Durable keys for a list of variables.

    Args:
        entries: ``(VariableKey, variable)`` pairs, in registration order.

    Raises:
        BindingError: if two entries share a key (the duplicates are listed).

    Examples:
        >>> registry = VariableRegistry.from_model(model)
        >>> str(registry.keys()[0])
        'path:layers/dense/kernel'
        >>> registry.variable_of(VariableKey.parse("path:layers/dense/kernel")) is model.layers[0].kernel
        True
    """

    def __init__(
        self, entries: Iterable[tuple[VariableKey, keras.Variable]], *, model: keras.Model | None = None
    ) -> None:
        self.entries = list(entries)
        # Where stock Keras keeps each variable: computed from ``model`` on first use.
        self._model = model
        self._keras_paths: dict[int, str] | None = None if model is not None else {}
        self._keras_source: VariableRegistry | None = None
        # The ModelIndex that built it (weakly: the index holds its registries), whose walk
        # cache `keras_paths` reuses.
        self._index: weakref.ref[ModelIndex] | None = None
        self._by_key: dict[VariableKey, keras.Variable] = {}
        self._by_id: dict[int, VariableKey] = {}
        dup = []
        for key, var in self.entries:
            if key in self._by_key:
                dup.append(str(key))
            self._by_key[key] = var
            self._by_id[id(var)] = key
        if dup:
            raise BindingError(
                f"Duplicate variable keys {listed(sorted(set(dup)))}: two variables resolve to the same "
                "stable path. Give the layers distinct names.",
                key=dup[0],
            )

    @classmethod
    def from_model(
        cls, model: keras.Model, variables: Sequence[keras.Variable] | None = None
    ) -> VariableRegistry:
        """Key ``variables`` (default: ``model.variables``) by the model's stable paths.

        A variable the walk does not reach gets ``order:<its index in variables>``.
        A tied variable appearing twice in ``variables`` is keyed once. Each call walks
        the model; a save or restore builds its registries from one walk instead
        (`ModelIndex.registry`).
        """
        variables = list(model.variables if variables is None else variables)
        return cls._from_paths(model, variables, stable_paths(model, variables) if model is not None else {})

    @classmethod
    def _from_paths(
        cls,
        model: keras.Model | None,
        variables: Sequence[keras.Variable],
        paths: dict[int, tuple[str, Any]],
        index: ModelIndex | None = None,
    ) -> VariableRegistry:
        """Key ``variables`` by ``paths`` (``id(variable) -> (path, variable)``, from the stable
        walk of ``model``); ``index``: the `ModelIndex` whose walk gave the paths, reused for
        [`keras_paths`][keras_stable_state.VariableRegistry.keras_paths]."""
        entries, seen = [], set()
        for i, v in enumerate(variables):
            if id(v) in seen:
                continue
            seen.add(id(v))
            hit = paths.get(id(v))
            entries.append((VariableKey(NAMED, hit[0]) if hit else VariableKey(ORDERED, str(i)), v))
        registry = cls(entries, model=model)
        registry._index = None if index is None else weakref.ref(index)
        return registry

    def rekeyed(self, entries: Iterable[tuple[VariableKey, keras.Variable]]) -> VariableRegistry:
        """A registry over ``entries`` whose [`keras_paths`][keras_stable_state.VariableRegistry.keras_paths] are this one's (the same model)."""
        registry = VariableRegistry(entries, model=self._model)
        registry._keras_paths = self._keras_paths
        registry._keras_source = self
        registry._index = self._index
        return registry

    @property
    def keras_paths(self) -> dict[int, str]:
        """``id(variable) -> path`` where stock Keras ``.weights.h5`` files keep each
        variable the model's walk reaches (``"layers/dense/vars/0"``).

        Only restores of stock Keras files need it, so it is computed on first use
        (a walk in Keras' own order; for a registry of a `ModelIndex`, once per save or
        restore, over the objects the index's walk already listed).
        """
        if self._keras_paths is None:
            if self._keras_source is not None:
                self._keras_paths = self._keras_source.keras_paths
            else:
                index = None if self._index is None else self._index()
                cache = None if index is None else index._walks
                ours = walk(self._model, keras_style=False, cache=cache)
                theirs = walk(self._model, keras_style=True, cache=cache)
                self._keras_paths = {
                    id(v): theirs[id(v)][0] for _, v in self.entries if id(v) in ours and id(v) in theirs
                }
        return self._keras_paths

    @keras_paths.setter
    def keras_paths(self, value: dict[int, str]) -> None:
        self._keras_paths = value

    def key_of(self, variable: keras.Variable) -> VariableKey:
        """The key of a registered variable.

        Raises:
            KeyError: if the variable is not in this registry.
        """
        return self._by_id[id(variable)]

    def __contains__(self, variable: object) -> bool:
        return id(variable) in self._by_id

    def keys(self) -> list[VariableKey]:
        return [k for k, _ in self.entries]

    def variable_of(self, key: VariableKey) -> keras.Variable | None:
        return self._by_key.get(key)

    def bind(
        self, saved: Iterable[tuple[VariableKey, tuple[int, ...] | None, str | None]]
    ) -> tuple[dict[VariableKey, tuple[keras.Variable, str]], list[VariableKey]]:
        """Bind saved entries to live variables.

        Args:
            saved: iterable of ``(VariableKey, shape tuple, dtype str)`` as read
                from a file; shape ``None``: an ordered key's shape and dtype are not checked.

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


class ModelIndex:
    """What one save or restore knows of its model: one walk of it, the registries built
    from that walk, its layers' paths and the keys parsed.

    A save or restore builds several registries (model, contract, each optimizer,
    arguments, layer state) from one unchanged model; made once per call and carried
    in its request (``SaveRequest``, ``RestoreRequest``), the index walks the model once
    for all of them (each walk costs 35-40 us per small layer, docs/performance.md) and
    parses each key text once (`ParsedKeys`). It is dropped with the request when
    the call returns. Code outside a save or restore makes a fresh one, or walks the
    model itself (`VariableRegistry.from_model`).

    A registry asked for variables the walk did not reach, which the model has gained
    since it was walked (a layer built since), walks the model again; building an
    optimizer changes no walk (optimizers are not walked) and a registry over its
    variables is keyed by those variables. A layer added, removed or renamed after the
    walk is not seen: an index serves one call.

    Args:
        model: The ``keras.Model`` (or layer) indexed.

    Attributes:
        model: The model indexed.
        keys: The `ParsedKeys` of the call (a restore adds those its file's reader parsed).
    """

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.keys = ParsedKeys()
        # What Keras' walk yields per object, each finished walk and each registry (by its
        # variables): `paths.walk` keeps the first two here; a walk redone drops all.
        self._walks: dict[Any, Any] = {}

    @classmethod
    def of(cls, model: keras.Model, index: ModelIndex | None) -> ModelIndex:
        """``index`` when it indexes ``model``, else a new index of ``model`` (for code that
        runs both inside a save or restore and outside one)."""
        return index if index is not None and index.model is model else cls(model)

    def registry(self, variables: Sequence[keras.Variable] | None = None) -> VariableRegistry:
        """[`VariableRegistry.from_model`][keras_stable_state.VariableRegistry.from_model] of
        the model, built once per list of variables and shared: treat it as read-only."""
        model = self.model
        variables = list(model.variables if variables is None else variables)
        cache_key = ("registry", tuple(map(id, variables)))
        hit = self._walks.get(cache_key)
        if hit is not None:
            cached: VariableRegistry = hit
            return cached
        paths = stable_paths(model, variables, self._walks) if model is not None else {}
        registry = VariableRegistry._from_paths(model, variables, paths, self)
        self._walks[cache_key] = registry
        return registry

    def layer_paths(self) -> dict[int, tuple[str, Any]]:
        """``id(layer) -> (path, layer)`` for every layer the walk reaches, in walk order (as
        `stable_layer_paths` gives them), from the call's walk."""
        layers: dict[int, tuple[str, Any]] = {}
        walk(self.model, keras_style=False, layers=layers, cache=self._walks)
        return layers
