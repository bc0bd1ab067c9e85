"""Decorators around the public verbs: the cyclic garbage collector paused for a call, and
optimizers a refused restore built put back unbuilt."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import keras

from keras_stable_state import _keras_compat
from keras_stable_state._identity.keys import file_label
from keras_stable_state._optimizer import tracked_optimizers
from keras_stable_state.format.memory import memory_refusal, out_of_memory

__all__ = ["cyclic_gc_paused", "gc_paused", "builds_undone_on_refusal", "memory_refused"]


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause Python's cyclic garbage collector for one save or restore.

    A call over ``n`` variables keeps ``O(n)`` container objects alive until it
    returns (the record, registries, plans, assignment steps). Each young-generation
    collection promotes them, and once the promoted objects reach a quarter of the
    oldest generation, Python runs a full collection over every object of the
    process: 0.4-0.9 s each, once or twice per restore of 10k variables, with Keras
    and its backends imported. Reference counting frees everything as usual meanwhile;
    only reference cycles wait, and the collector runs again once the call returns.
    A collector that was already paused (by the caller, or by an enclosing call) is
    left paused.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with the cyclic garbage collector paused (`cyclic_gc_paused`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cyclic_gc_paused():
            return fn(*args, **kwargs)

    return wrapper


def builds_undone_on_refusal(restore: Callable[_P, _R]) -> Callable[_P, _R]:
    """Whatever ``restore(filepath, model, options, ...)`` refuses, or fails at, after
    building an unbuilt optimizer (a slot that cannot be assigned, a provider without
    saved state, a failed assignment), the optimizer is put back unbuilt: a refused
    restore leaves the optimizers as they were, as it leaves every value.
    ``options.optimizer`` is the optimizer (or ``{name: optimizer}``) passed, ``None``
    for ``model``'s own."""

    @functools.wraps(restore)
    def guarded(filepath, model, options, *args, **kwargs):
        optimizer = options.optimizer
        if isinstance(optimizer, dict):
            touched = list(optimizer.values())
        elif optimizer is not None:
            touched = [optimizer]
        else:
            touched = list(tracked_optimizers(model).values()) if isinstance(model, keras.Model) else []
        undo = _keras_compat.snapshot_unbuilt(
            [o for o in touched if isinstance(o, keras.optimizers.Optimizer) and not o.built]
        )
        try:
            return restore(filepath, model, options, *args, **kwargs)
        except BaseException:
            undo()
            raise

    return guarded


def memory_refused(restore: Callable[_P, _R]) -> Callable[_P, _R]:
    """Running out of memory anywhere in ``restore(filepath, model, ...)`` (reading,
    checking, converting, or assigning, once every assigned value is put back) is a
    [`StateError`][keras_stable_state.StateError] naming the file and saying so
    (`memory_refusal`), not a raw
    ``MemoryError`` or backend error. A rollback that failed too is reported as such by
    `apply_steps` (a ``StateError`` already)."""

    @functools.wraps(restore)
    def guarded(filepath, *args, **kwargs):
        try:
            return restore(filepath, *args, **kwargs)
        except BaseException as err:
            if out_of_memory(err):
                raise memory_refusal(file_label(filepath), err) from err
            raise

    return guarded
