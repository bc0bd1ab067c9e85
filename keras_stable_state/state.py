"""Everything else a resumed run needs, each with a ``get_state()`` / ``set_state()`` surface.

* learning-rate schedule identity (:func:`schedule_state`, :func:`check_schedule`);
  the current learning rate value itself is an optimizer variable and is saved with them;
* stateful callbacks (:func:`callback_state`, :func:`set_callback_state`): Keras'
  ``ReduceLROnPlateau``, ``EarlyStopping`` (with ``best_weights``), ``ModelCheckpoint``,
  ``LearningRateScheduler`` and ``History``, and any callback defining
  ``get_state()`` / ``set_state(state)`` (the protocol: ``get_state`` returns a dict of
  JSON values and NumPy arrays, ``set_state`` takes it back);
* the random state that decides the run (:func:`rng_state`, :func:`set_rng_state`):
  NumPy's, Python's and (on the Torch backend) Torch's global generators (data
  shuffling) and Keras' global seed generator; per-layer seed generators are model variables and saved with them.

States are plain dicts of JSON values and NumPy arrays; :func:`split_arrays` and
:func:`join_arrays` separate the arrays for storage.
"""

from __future__ import annotations

import random

import keras
import numpy as np

from keras_stable_state.errors import StateError

__all__ = [
    "ScheduleMismatchError",
    "schedule_state",
    "check_schedule",
    "callback_key",
    "callback_state",
    "set_callback_state",
    "rng_state",
    "set_rng_state",
    "split_arrays",
    "join_arrays",
]


class ScheduleMismatchError(StateError, ValueError):
    """The learning-rate schedule differs from the one saved.

    Attributes:
        fields: ``(field, saved value, current value)`` for each difference.

    Example:
        >>> kss.restore_training_state("run.h5", model_with_decay_steps_20)
        ScheduleMismatchError: The learning-rate schedule differs from the one saved
        (config.decay_steps: saved 10, now 20). ...
    """

    def __init__(self, message, *, fields=()):
        super().__init__(message)
        self.fields = list(fields)


# -- arrays inside JSON states ---------------------------------------------------
def split_arrays(obj, prefix: str):
    """Replace every NumPy array in ``obj`` by ``{"__array__": name}``.

    Returns:
        ``(json_obj, {name: array})`` with names ``prefix/<path in obj>``.
    """
    arrays = {}

    def walk(value, path):
        if isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype")):
            arrays[path] = np.asarray(value)
            return {"__array__": path}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return value.item()
        return value

    return walk(obj, prefix), arrays


def join_arrays(obj, arrays: dict):
    """Inverse of :func:`split_arrays`."""
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            return arrays[obj["__array__"]]
        return {k: join_arrays(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_arrays(v, arrays) for v in obj]
    return obj


# -- learning-rate schedule -------------------------------------------------------
def _schedule(optimizer):
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        return _schedule(inner)
    lr = getattr(optimizer, "_learning_rate", None)
    return lr if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) else None


def schedule_state(optimizer) -> dict:
    """``{"schedule": <Keras serialization of the schedule> | None}``."""
    sched = None if optimizer is None else _schedule(optimizer)
    return {"schedule": None if sched is None else keras.saving.serialize_keras_object(sched)}


def _diff(saved, current, path=""):
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current)):
            out += _diff(saved.get(k), current.get(k), k if path == "schedule" else f"{path}.{k}")
        return out
    return [] if saved == current else [(path, saved, current)]


def check_schedule(saved: dict, optimizer) -> None:
    """Raise if ``optimizer``'s learning-rate schedule differs from ``saved``.

    Raises:
        ScheduleMismatchError: naming every differing field (class, initial
            learning rate, decay steps...).
    """
    current = schedule_state(optimizer)["schedule"]
    fields = _diff(saved.get("schedule"), current, "schedule")
    if fields:
        listed = "; ".join(f"{f}: saved {s!r}, now {c!r}" for f, s, c in fields)
        raise ScheduleMismatchError(
            f"The learning-rate schedule differs from the one saved ({listed}). A resumed run with "
            "another schedule does not continue the saved one. Build the optimizer with the saved "
            "schedule, or pass check_schedule=False to continue with the new one.",
            fields=fields,
        )


# -- callbacks ----------------------------------------------------------------------
def _monitor_best(cb):
    best = getattr(cb, "best", None)
    return None if best is None else float(best)


def _early_stopping_get(cb):
    weights = cb.best_weights
    return {
        "wait": int(cb.wait),
        "stopped_epoch": int(cb.stopped_epoch),
        "best": _monitor_best(cb),
        "best_epoch": int(cb.best_epoch),
        "best_weights": None if weights is None else [np.asarray(w) for w in weights],
    }


def _early_stopping_set(cb, state):
    cb.wait = state["wait"]
    cb.stopped_epoch = state["stopped_epoch"]
    cb.best = state["best"]
    cb.best_epoch = state["best_epoch"]
    cb.best_weights = state["best_weights"]


def _plateau_get(cb):
    return {"wait": int(cb.wait), "cooldown_counter": int(cb.cooldown_counter), "best": _monitor_best(cb)}


def _plateau_set(cb, state):
    cb.wait = state["wait"]
    cb.cooldown_counter = state["cooldown_counter"]
    cb.best = state["best"]


def _checkpoint_get(cb):
    return {
        "best": _monitor_best(cb),
        "batches_seen_since_last_saving": int(cb._batches_seen_since_last_saving),
        "last_batch_seen": cb._last_batch_seen,
        "current_epoch": int(getattr(cb, "_current_epoch", 0)),
    }


def _checkpoint_set(cb, state):
    cb.best = state["best"]
    cb._batches_seen_since_last_saving = state["batches_seen_since_last_saving"]
    cb._last_batch_seen = state["last_batch_seen"]
    cb._current_epoch = state["current_epoch"]


def _history_get(cb):
    return {"epoch": list(cb.epoch), "history": {k: [float(v) for v in vs] for k, vs in cb.history.items()}}


def _history_set(cb, state):
    cb.epoch = list(state["epoch"])
    cb.history = {k: list(v) for k, v in state["history"].items()}


_HANDLERS = [
    (keras.callbacks.EarlyStopping, _early_stopping_get, _early_stopping_set),
    (keras.callbacks.ReduceLROnPlateau, _plateau_get, _plateau_set),
    (keras.callbacks.ModelCheckpoint, _checkpoint_get, _checkpoint_set),
    # The schedule is a function of the epoch and the learning rate, both saved.
    (keras.callbacks.LearningRateScheduler, lambda cb: {}, lambda cb, s: None),
    (keras.callbacks.History, _history_get, _history_set),
]


def _handler(cb):
    if callable(getattr(cb, "get_state", None)) and callable(getattr(cb, "set_state", None)):
        return type(cb).get_state, type(cb).set_state
    for cls, get, put in _HANDLERS:
        if isinstance(cb, cls):
            return get, put
    return None


def callback_key(callbacks, cb) -> str:
    """``"<ClassName>/<i>"``: the class name and the index among callbacks of that class."""
    same = [c for c in callbacks if type(c) is type(cb)]
    return f"{type(cb).__name__}/{next(i for i, c in enumerate(same) if c is cb)}"


def callback_state(cb):
    """The state of a stateful callback, or ``None`` for a callback that keeps none we know of."""
    handler = _handler(cb)
    return None if handler is None else handler[0](cb)


def set_callback_state(cb, state) -> None:
    """Put back a state from :func:`callback_state`.

    Raises:
        StateError: if the callback keeps no state we can set.
    """
    handler = _handler(cb)
    if handler is None:
        raise StateError(
            f"Callback {type(cb).__name__} has no known state; define get_state()/set_state() on it.",
            key=type(cb).__name__,
        )
    handler[1](cb, state)


# -- random state ---------------------------------------------------------------------
def rng_state() -> dict:
    """NumPy's, Python's and Torch's (Torch backend) global generator states and Keras' global seed generator."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    from keras.src.random import seed_generator

    gen = keras.src.backend.common.global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    out = {
        "numpy": {
            "name": name,
            "keys": np.asarray(keys),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "keras_global_seed": None if gen is None else keras.ops.convert_to_numpy(gen.state.value),
        "torch": None,
    }
    if keras.backend.backend() == "torch":
        import torch  # the data loader's RandomSampler draws from torch's global generator

        out["torch"] = torch.get_rng_state().numpy()
    return out


def set_rng_state(state: dict) -> None:
    """Put back the states from :func:`rng_state`."""
    n = state["numpy"]
    np.random.set_state(
        (n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if state.get("keras_global_seed") is not None:
        from keras.src.random import seed_generator

        seed_generator.global_seed_generator().state.assign(np.asarray(state["keras_global_seed"]))
    if state.get("torch") is not None and keras.backend.backend() == "torch":
        import torch

        torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8).copy()))
