"""Keras' saving walk, its naming and its ``.keras`` archive writer (``keras/src/saving/saving_lib.py``)."""

from __future__ import annotations

import keras

__all__ = ["obj_type", "save_keras_archive_to", "to_snake_case", "walk_saveable"]


def to_snake_case(name: str) -> str:
    """Keras' ``to_snake_case`` (the base of its auto-generated layer names)."""
    return keras.src.utils.naming.to_snake_case(name)


# Keras' own attribute skip sets by object type. ``saving_lib.get_attr_skipset`` caches
# under ``saving_attr_skipset_<type>`` but looks under ``saving_attr_skiplist_<type>``
# (Keras 3.15), so it builds a reference ``Layer()`` (about 1 ms) for every object walked.
_SKIPSETS: dict = {}


def walk_saveable(obj):
    """``(attribute, child)`` pairs Keras' saving walk visits under ``obj`` (none for
    objects Keras does not save).

    The same pairs in the same order as Keras' ``saving_lib._walk_saveable``: the
    ``layers`` of a Sequential or Functional model first, then every attribute in
    ``dir()`` order with private ones last, less those of a plain reference object
    of the same type (``saving_lib.get_attr_skipset``, computed once per type here).
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
    # the few attributes left are sorted, not all of ``dir()``.
    names = [a for a in dir(obj) if a not in skip and a[:2] != "__"]
    for attr in sorted(names, key=saving_lib._name_key):
        try:
            child = getattr(obj, attr)
        except Exception:  # noqa: BLE001 (Keras' walk skips attributes that raise, so must this one)
            continue
        yield attr, child


def obj_type(obj) -> str:
    """Keras' ``_obj_type()`` (``"Sequential"``, ``"Functional"``, ``"Layer"``...)."""
    return obj._obj_type()


def save_keras_archive_to(model, fileobj) -> None:
    """Keras' own ``.keras`` archive of ``model`` (config and weights) into a binary file
    object, e.g. ``io.BytesIO`` (``model.save`` takes only paths)."""
    from keras.src.saving import saving_lib

    saving_lib.save_model(model, fileobj)
