"""The state of stateful callbacks and state providers, each with a ``get_state()`` / ``set_state()`` surface.

`callback_state` and `set_callback_state` handle Keras'
``ReduceLROnPlateau``, ``EarlyStopping`` (with ``best_weights``), ``ModelCheckpoint``,
``LearningRateScheduler``, ``SwapEMAWeights`` (whether the EMA weights are swapped into
the model) and ``History``, and any callback defining ``get_state()`` /
``set_state(state)`` (the protocol: ``get_state`` returns a dict of JSON values and
NumPy arrays, ``set_state`` takes it back).

Restores are all-or-nothing: a saved state is checked in full before anything is
set (`parse_callback_state`, `check_provider_state`); a malformed one
raises [`CorruptCheckpointError`][keras_stable_state.CorruptCheckpointError] naming its record
(``"callbacks/EarlyStopping/0"``, ``"providers/acc"``). A provider may define
``validate_state(state)``, raising a ``StateError`` for a state its ``set_state``
would not take; it is called before anything is set.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._state.tree import check_fields, is_array, is_int, is_number, malformed, show
from keras_stable_state.errors import StateError, listed

__all__ = [
    "callback_key",
    "callback_state",
    "has_known_state",
    "set_callback_state",
    "parse_callback_state",
    "check_provider_state",
    "rename_history_keys",
]


def _monitor_best(cb):
    best = getattr(cb, "best", None)
    return None if best is None else float(best)


def _early_stopping_get(cb):
    # A callback that never ran on_train_begin has no best_epoch yet (Keras sets it there).
    weights = getattr(cb, "best_weights", None)
    return {
        "wait": int(getattr(cb, "wait", 0)),
        "stopped_epoch": int(getattr(cb, "stopped_epoch", 0)),
        "best": _monitor_best(cb),
        "best_epoch": int(getattr(cb, "best_epoch", 0)),
        "best_weights": None if weights is None else [np.asarray(w) for w in weights],
    }


def _early_stopping_set(cb, state):
    cb.wait = state["wait"]
    cb.stopped_epoch = state["stopped_epoch"]
    cb.best = state["best"]
    cb.best_epoch = state["best_epoch"]
    cb.best_weights = state["best_weights"]


def _plateau_get(cb):
    return {
        "wait": int(getattr(cb, "wait", 0)),
        "cooldown_counter": int(getattr(cb, "cooldown_counter", 0)),
        "best": _monitor_best(cb),
    }


def _plateau_set(cb, state):
    cb.wait = state["wait"]
    cb.cooldown_counter = state["cooldown_counter"]
    cb.best = state["best"]


def _checkpoint_get(cb):
    return {
        "best": _monitor_best(cb),
        **_keras_compat.model_checkpoint_counters(cb),
    }


def _checkpoint_set(cb, state):
    cb.best = state["best"]
    _keras_compat.set_model_checkpoint_counters(cb, state)


def _output_names(cb):
    names = getattr(getattr(cb, "model", None), "output_names", None)
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else None


def _history_get(cb):
    return {
        "epoch": list(getattr(cb, "epoch", [])),
        "history": {k: [float(v) for v in vs] for k, vs in getattr(cb, "history", {}).items()},
        # History keys embed the output names (``dense_4_loss``), which may be auto-generated.
        "output_names": _output_names(cb),
    }


def rename_history_keys(history: dict, saved_names, live_names) -> dict:
    """``history`` with each key of a saved output name (``<name>_loss``,
    ``val_<name>_<metric>``) renamed to the live model's output name at the same
    position; unchanged when the names are unknown, equal or of another count."""
    if not saved_names or not live_names or len(saved_names) != len(live_names):
        return dict(history)
    if list(saved_names) == list(live_names):
        return dict(history)
    to_live = dict(zip(saved_names, live_names, strict=True))
    longest_first = sorted(to_live, key=len, reverse=True)
    out = {}
    for key, values in history.items():
        prefix = "val_" if key.startswith("val_") else ""
        rest = key[len(prefix) :]
        for name in longest_first:
            if rest.startswith(name + "_"):
                key = prefix + to_live[name] + rest[len(name) :]
                break
        out[key] = values
    return out


def _history_set(cb, state):
    cb.epoch = list(state["epoch"])
    history = {k: list(v) for k, v in state["history"].items()}
    cb.history = rename_history_keys(history, state.get("output_names"), _output_names(cb))


_HANDLERS = [
    (keras.callbacks.EarlyStopping, _early_stopping_get, _early_stopping_set),
    (keras.callbacks.ReduceLROnPlateau, _plateau_get, _plateau_set),
    (keras.callbacks.ModelCheckpoint, _checkpoint_get, _checkpoint_set),
    # The schedule is a function of the epoch and the learning rate, both saved.
    (keras.callbacks.LearningRateScheduler, lambda cb: {}, lambda cb, s: None),
    (keras.callbacks.History, _history_get, _history_set),
    # swap_on_epoch=True leaves the EMA weights in the model from an epoch's end to the next
    # epoch's begin, where an epoch-boundary checkpoint is taken: the flag says to swap back.
    (
        keras.callbacks.SwapEMAWeights,
        lambda cb: {"ema_weights_in_model": _keras_compat.ema_weights_in_model(cb)},
        lambda cb, s: _keras_compat.set_ema_weights_in_model(cb, s["ema_weights_in_model"]),
    ),
]


def _count(v):
    return is_int(v) and v >= 0


def _best(v):
    return v is None or is_number(v)


def _weights(v):
    return v is None or (isinstance(v, list) and all(is_array(w) for w in v))


def _history(v):
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(vs, list) and all(is_number(x) for x in vs) for k, vs in v.items()
    )


_COUNT, _BEST = (_count, "a non-negative integer"), (_best, "a number or null")
_SCHEMAS = {
    keras.callbacks.EarlyStopping: {
        "wait": _COUNT,
        "stopped_epoch": _COUNT,
        "best": _BEST,
        "best_epoch": _COUNT,
        "best_weights": (_weights, "null or a list of arrays"),
    },
    keras.callbacks.ReduceLROnPlateau: {"wait": _COUNT, "cooldown_counter": _COUNT, "best": _BEST},
    keras.callbacks.ModelCheckpoint: {
        "best": _BEST,
        "batches_seen_since_last_saving": _COUNT,
        "last_batch_seen": (lambda v: v is None or _count(v), "a non-negative integer or null"),
        "current_epoch": _COUNT,
    },
    keras.callbacks.LearningRateScheduler: {},
    keras.callbacks.SwapEMAWeights: {
        "ema_weights_in_model": (lambda v: isinstance(v, bool), "true or false"),
    },
    keras.callbacks.History: {
        "epoch": (lambda v: isinstance(v, list) and all(_count(e) for e in v), "a list of epoch numbers"),
        "history": (_history, "an object of metric name -> list of numbers"),
        "output_names": (
            lambda v: v is None or (isinstance(v, list) and all(isinstance(n, str) for n in v)),
            "null or a list of output names",
            "optional",  # checkpoints written before it was saved have none
        ),
    },
}


def _kind(value) -> str | None:
    if value is None:
        return None
    if is_array(value):
        return "an array"
    if isinstance(value, (bool, np.bool_)):
        return "a boolean"
    if is_number(value):
        return "a number"
    for types, name in ((str, "text"), (dict, "an object"), ((list, tuple), "a list")):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _check_like(value, template, record, where):
    """A saved state must have the live state's form: an object with at least its
    fields, each of the same kind (``None`` on either side matches anything)."""
    if template is None or value is None:
        return
    if _kind(value) != _kind(template) and not (_kind(template) == "a list" and _kind(value) == "a list"):
        raise malformed(record, f"expected {_kind(template)}, found {show(value)}", where)
    if isinstance(template, dict):
        missing = sorted(set(template) - set(value), key=str)
        if missing:
            raise malformed(
                record,
                f"fields {listed(missing)} are missing (the live state has {listed(sorted(template, key=str))})",
                where,
            )
        for k in template:
            if template[k] is not None and value[k] is not None and _kind(value[k]) != _kind(template[k]):
                raise malformed(
                    f"{record}/{k}", f"expected {_kind(template[k])}, found {show(value[k])}", where
                )


def _validate_hook(obj, value, record, where):
    check = getattr(obj, "validate_state", None)
    if not callable(check):
        return
    try:
        check(value)
    except StateError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise malformed(record, f"{type(obj).__name__}.validate_state refused it ({err!r})", where) from err


def parse_callback_state(cb, value, record: str, where: str | None = None):
    """Check a saved callback state before anything is set.

    Keras' stateful callbacks are checked field by field; a callback with its own
    ``get_state()`` / ``set_state()`` must give a state of the form its current
    ``get_state()`` has (and pass its ``validate_state`` if it defines one).

    Args:
        cb: The live callback.
        value: The saved state (arrays joined back).
        record: Its name in the file, ``"callbacks/<Class>/<i>"``.
        where: The file, for messages.

    Returns:
        ``value``, ready for `set_callback_state`.

    Raises:
        CorruptCheckpointError: naming ``record`` (or its field) for a malformed state.
        StateError: if the callback keeps no state we can set.
    """
    handler = _known_handler(cb)
    if handler[0] is not getattr(type(cb), "get_state", None):
        for cls, spec in _SCHEMAS.items():
            if isinstance(cb, cls):
                return check_fields(value, record, where, spec)
    _check_like(value, handler[0](cb), record, where)
    _validate_hook(cb, value, record, where)
    return value


def check_provider_state(provider, value, record: str, where: str | None = None, current=None):
    """Check a saved provider state before anything is set: the form of the
    provider's current state (``current`` when given, else its ``get_state()``), and its
    ``validate_state`` if defined.

    Raises:
        CorruptCheckpointError: naming ``record`` for a malformed state.
    """
    _check_like(value, provider.get_state() if current is None else current, record, where)
    _validate_hook(provider, value, record, where)
    return value


def _handler(cb):
    if callable(getattr(cb, "get_state", None)) and callable(getattr(cb, "set_state", None)):
        return type(cb).get_state, type(cb).set_state
    for cls, get, put in _HANDLERS:
        if isinstance(cb, cls):
            return get, put
    return None


def _known_handler(cb):
    """`_handler`, refusing a callback whose state nothing here knows."""
    handler = _handler(cb)
    if handler is None:
        raise StateError(
            f"Callback {type(cb).__name__} has no known state; define get_state()/set_state() on it.",
            key=type(cb).__name__,
        )
    return handler


def callback_key(callbacks, cb) -> str:
    """``"<ClassName>/<i>"``: the class name and the index among callbacks of that class."""
    same = [c for c in callbacks if type(c) is type(cb)]
    return f"{type(cb).__name__}/{next(i for i, c in enumerate(same) if c is cb)}"


def has_known_state(cb: Any) -> bool:
    """Whether `callback_state` can read ``cb``'s state (a Keras callback of a kind listed
    above, or one defining ``get_state()``/``set_state()``), without reading it."""
    return _handler(cb) is not None


def callback_state(cb: Any) -> Any:
    """The state of a stateful callback, or ``None`` for a callback that keeps none we know of."""
    handler = _handler(cb)
    return None if handler is None else handler[0](cb)


def set_callback_state(cb, state) -> None:
    """Put back a state from `callback_state`.

    Raises:
        StateError: if the callback keeps no state we can set.
    """
    handler = _known_handler(cb)
    handler[1](cb, state)
