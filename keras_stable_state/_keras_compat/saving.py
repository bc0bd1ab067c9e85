"""Keras' saving walk, its naming and its ``.keras`` archive writer (``keras/src/saving/saving_lib.py``)."""

from __future__ import annotations

import sys

import keras

__all__ = ["attribute_names", "obj_type", "save_keras_archive_to", "to_snake_case", "walk_saveable"]


def to_snake_case(name: str) -> str:
    """Keras' ``to_snake_case`` (the base of its auto-generated layer names)."""
    return keras.src.utils.naming.to_snake_case(name)


# Keras' own attribute skip sets by object type, computed once per process (by
# ``saving_lib.get_attr_skipset`` itself, on the first walk that meets the type): attributes
# added to Keras' base classes after that are not in them. ``get_attr_skipset`` caches
# under ``saving_attr_skipset_<type>`` but looks under ``saving_attr_skiplist_<type>``
# (Keras 3.15), so it builds a reference object (a ``Layer()``, an optimizer...: 0.1-0.5 ms
# measured) for every object walked.
_SKIPSETS: dict = {}


def walk_saveable(obj, classes: dict | None = None):
    """``(attribute, child)`` pairs Keras' saving walk visits under ``obj`` (none for
    objects Keras does not save).

    The same pairs in the same order as Keras' ``saving_lib._walk_saveable``: the
    ``layers`` of a Sequential or Functional model first, then every attribute in
    ``dir()`` order with private ones last, less those of a plain reference object
    of the same type (``saving_lib.get_attr_skipset``, computed once per type here).

    Args:
        obj: Any object (a layer, model, metric, optimizer, container...).
        classes: A dict the caller keeps for one walk (no class changes meanwhile),
            in which the class part of ``dir(obj)`` is listed once per class
            (`attribute_names`); ``None``: ``dir(obj)`` each call.
    """
    from keras.src.saving import keras_saveable, saving_lib

    if not isinstance(obj, keras_saveable.KerasSaveable):
        return
    kind = obj._obj_type()
    skip = _SKIPSETS.get(kind)
    if skip is None:
        skip = _SKIPSETS[kind] = frozenset(saving_lib.get_attr_skipset(kind))
    if kind in ("Sequential", "Functional"):
        yield "layers", obj.layers
    # Filtered before sorting (the same order: the filter does not depend on it), so only
    # the few attributes left are sorted, not all of ``dir()``. Keras sorts ``dir()``'s
    # alphabetical list stably by ``_name_key`` (``_a`` and ``~_a`` share one key: ``_a``
    # first); a set has no order, so the name itself breaks the tie.
    names = attribute_names(obj, skip, classes)
    for attr in sorted(names, key=lambda a: (saving_lib._name_key(a), a)):
        try:
            child = getattr(obj, attr)
        except Exception:  # noqa: BLE001 (Keras' walk skips attributes that raise, so must this one)
            continue
        yield attr, child


def _module_dir():
    torch = sys.modules.get("torch")  # (no Torch imported: no Torch module to walk)
    return None if torch is None else torch.nn.Module.__dir__


def attribute_names(obj, skip=frozenset(), classes: dict | None = None):
    """``{a for a in dir(obj) if a not in skip and a[:2] != "__"}``, the names Keras' walk
    looks at (a ``set``: ``Module.__dir__`` may list a name twice, one attribute), with
    the class part of ``dir`` taken from ``classes``.

    ``dir(obj)`` of an object whose type keeps ``object.__dir__`` is the keys of its
    ``__dict__`` and of every class ``__dict__`` of its type (CPython's
    ``object___dir___impl``); of a ``torch.nn.Module`` (Keras' layers on Torch) the
    same plus the names of its parameters, submodules and buffers, less names
    starting with a digit (``Module.__dir__``). Listing a class's names costs more than
    the rest (11-18 us for a Keras layer, per object), so ``classes`` (a dict the
    caller keeps for one walk, in which no class changes) keeps them, filtered, per
    class and ``skip``. With any other ``__dir__``, a ``__class__`` that is not the
    object's type, a ``__dict__`` that is not a dict, or no ``classes``: ``dir(obj)``
    itself.
    """
    cls = type(obj)
    own = cls.__dir__
    torch_module = own is not object.__dir__ and own is _module_dir()
    instance = getattr(obj, "__dict__", None)
    if (
        classes is None
        or (own is not object.__dir__ and not torch_module)
        or getattr(obj, "__class__", None) is not cls
        or not (instance is None or type(instance) is dict)
    ):
        return {a for a in dir(obj) if a not in skip and a[:2] != "__"}

    def keep(names):
        return {n for n in names if n[:2] != "__" and not (torch_module and n[:1].isdigit())}

    base = classes.get((cls, skip))
    if base is None:
        listed = dir(cls) if torch_module else type.__dir__(cls)
        base = classes[(cls, skip)] = frozenset(keep(set(listed) - skip))
    names = set(instance) if instance else set()
    if torch_module:
        names.update(obj._parameters, obj._modules, obj._buffers)
    return base.union(keep(names - skip))


def obj_type(obj) -> str:
    """Keras' ``_obj_type()`` (``"Sequential"``, ``"Functional"``, ``"Layer"``...)."""
    return obj._obj_type()


def save_keras_archive_to(model, fileobj) -> None:
    """Keras' own ``.keras`` archive of ``model`` (config and weights) into a binary file
    object, e.g. ``io.BytesIO`` (``model.save`` takes only paths).

    Keras' walk asks ``saving_lib.get_attr_skipset`` for every object it saves, which
    builds a reference object (a ``Layer()``, an ``Optimizer``...) and lists its
    ``dir()`` each time: it stores what it built under ``saving_attr_skipset_<type>``
    but looks under ``saving_attr_skiplist_<type>`` (Keras 3.15), about 0.1-0.5 ms per
    object. For this call, the skip sets `walk_saveable` computed already (from
    ``get_attr_skipset`` itself) are put where Keras looks (Keras' global state, local
    to this thread), and taken away after it: the same sets, the same archive (unless
    Keras' base classes gained attributes after the first walk in this process, which
    Keras' own sets, built anew, would skip too). A set already there is left as it is.
    """
    from keras.src.backend.common import global_state
    from keras.src.saving import saving_lib

    names = [(f"saving_attr_skiplist_{kind}", skip) for kind, skip in _SKIPSETS.items()]
    placed = [name for name, _ in names if global_state.get_global_attribute(name) is None]
    for name, skip in names:
        if name in placed:
            global_state.set_global_attribute(name, set(skip))
    try:
        saving_lib.save_model(model, fileobj)
    finally:
        for name in placed:
            global_state.set_global_attribute(name, None)
