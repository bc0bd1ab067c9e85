"""Everything else a resumed run needs, each with a ``get_state()`` / ``set_state()`` surface.

* learning-rate schedule identity (:func:`schedule_state`, :func:`check_schedule`);
  the current learning rate value itself is an optimizer variable and is saved with them;
* stateful callbacks (:func:`callback_state`, :func:`set_callback_state`): Keras'
  ``ReduceLROnPlateau``, ``EarlyStopping`` (with ``best_weights``), ``ModelCheckpoint``,
  ``LearningRateScheduler``, ``SwapEMAWeights`` (whether the EMA weights are swapped into
  the model) and ``History``, and any callback defining
  ``get_state()`` / ``set_state(state)`` (the protocol: ``get_state`` returns a dict of
  JSON values and NumPy arrays, ``set_state`` takes it back);
* the random state that decides the run (:func:`rng_state`, :func:`set_rng_state`):
  NumPy's, Python's and (on the Torch backend) Torch's global generators (data
  shuffling) and Keras' global seed generator; per-layer seed generators are model variables and saved with them.

States are plain dicts of JSON values and NumPy arrays; :func:`split_arrays` and
:func:`join_arrays` separate the arrays for storage.

Restores are all-or-nothing: a saved state is checked in full before anything is
set (:func:`parse_callback_state`, :func:`check_provider_state`,
:func:`parse_rng_state`); a malformed one raises
:class:`~keras_stable_state.CorruptCheckpointError` naming its record
(``"rng/python"``, ``"callbacks/EarlyStopping/0"``, ``"providers/acc"``). A
provider may define ``validate_state(state)``, raising a ``StateError`` for a
state its ``set_state`` would not take; it is called before anything is set.
"""

from __future__ import annotations

import dataclasses
import math
import random

import keras
import numpy as np

from keras_stable_state import _keras_compat as compat
from keras_stable_state._numpy import numpy_copy
from keras_stable_state.errors import CorruptCheckpointError, StateError

__all__ = [
    "ScheduleMismatchError",
    "schedule_state",
    "check_schedule",
    "callback_key",
    "callback_state",
    "set_callback_state",
    "parse_callback_state",
    "check_provider_state",
    "rng_state",
    "ParsedRng",
    "parse_rng_state",
    "apply_rng_state",
    "set_rng_state",
    "split_arrays",
    "join_arrays",
    "copy_state",
    "same_state",
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
_PLAIN = frozenset({str, int, float, bool, type(None)})  # JSON scalars, kept as they are


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
            # Plain scalars (Python's random state: 625 ints) are kept without a path each.
            return [v if type(v) in _PLAIN else walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return value.item()
        return value

    return walk(obj, prefix), arrays


def join_arrays(obj, arrays: dict, where: str | None = None):
    """Inverse of :func:`split_arrays`.

    Raises:
        CorruptCheckpointError: if a reference names no array of ``arrays``
            (``where``: the file, for the message).
    """
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            ref = obj["__array__"]
            if not isinstance(ref, str) or ref not in arrays:
                raise malformed(str(ref), "it refers to an array the file does not hold", where)
            return arrays[ref]
        return {k: join_arrays(v, arrays, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_arrays(v, arrays, where) for v in obj]
    return obj


def _is_array(value) -> bool:
    return isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype"))


def copy_state(obj):
    """A deep copy of a state whose arrays are NumPy copies (never views of live
    variables, which an assignment would change)."""
    if _is_array(obj):
        return np.array(obj, copy=True)
    if isinstance(obj, dict):
        return {k: copy_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_state(v) for v in obj)
    return obj


def same_state(a, b) -> bool:
    """``True`` when two states hold the same values (arrays by shape, dtype and
    values, NaN equal to NaN)."""
    if _is_array(a) or _is_array(b):
        if not (_is_array(a) and _is_array(b)):
            return False
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind in "fc":
            return bool(np.array_equal(a, b, equal_nan=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


# -- checking saved states ------------------------------------------------------------
_FIX = (
    "The file is damaged or was not written by keras_stable_state; restore an earlier "
    "checkpoint (`keras-stable-state verify FILE` checks one)"
)


def malformed(record: str, what: str, where: str | None = None, **kw) -> CorruptCheckpointError:
    """The error for a malformed saved record (``record``: ``"rng/numpy"``,
    ``"callbacks/EarlyStopping/0"``...; ``where``: the file)."""
    head = f"{where}: " if where else ""
    return CorruptCheckpointError(f"{head}record {record!r} is malformed: {what}. {_FIX}.", key=record, **kw)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return _is_int(value) or (isinstance(value, (float, np.floating)))


def _show(value) -> str:
    text = repr(value) if not _is_array(value) else f"array of shape {tuple(np.shape(value))}"
    return text if len(text) <= 80 else text[:77] + "..."


def _fields(value, record, where, spec: dict) -> dict:
    """Check a saved dict against ``{field: (check, expected)}``; every field is
    required and no other is allowed."""
    if not isinstance(value, dict):
        raise malformed(record, f"expected an object, found {_show(value)}", where)
    optional = {f for f, check in spec.items() if len(check) > 2}
    missing = sorted(set(spec) - set(value) - optional)
    unknown = sorted(set(value) - set(spec), key=str)
    if missing or unknown:
        raise malformed(
            record,
            f"expected the fields {sorted(spec)}; "
            + ", ".join(p for p in (missing and f"missing {missing}", unknown and f"unknown {unknown}") if p),
            where,
        )
    for field, (check, expected, *_) in spec.items():
        if field in value and not check(value[field]):
            raise malformed(f"{record}/{field}", f"expected {expected}, found {_show(value[field])}", where)
    return value


# -- learning-rate schedule -------------------------------------------------------
def _schedule(optimizer):
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        return _schedule(inner)
    lr = compat.learning_rate_variable(optimizer)
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
        **compat.model_checkpoint_counters(cb),
    }


def _checkpoint_set(cb, state):
    cb.best = state["best"]
    compat.set_model_checkpoint_counters(cb, state)


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
        lambda cb: {"ema_weights_in_model": compat.ema_weights_in_model(cb)},
        lambda cb, s: compat.set_ema_weights_in_model(cb, s["ema_weights_in_model"]),
    ),
]


def _count(v):
    return _is_int(v) and v >= 0


def _best(v):
    return v is None or _is_number(v)


def _weights(v):
    return v is None or (isinstance(v, list) and all(_is_array(w) for w in v))


def _history(v):
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(vs, list) and all(_is_number(x) for x in vs) for k, vs in v.items()
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
    if _is_array(value):
        return "an array"
    if isinstance(value, (bool, np.bool_)):
        return "a boolean"
    if _is_number(value):
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
        raise malformed(record, f"expected {_kind(template)}, found {_show(value)}", where)
    if isinstance(template, dict):
        missing = sorted(set(template) - set(value), key=str)
        if missing:
            raise malformed(
                record,
                f"fields {missing} are missing (the live state has {sorted(template, key=str)})",
                where,
            )
        for k in template:
            if template[k] is not None and value[k] is not None and _kind(value[k]) != _kind(template[k]):
                raise malformed(
                    f"{record}/{k}", f"expected {_kind(template[k])}, found {_show(value[k])}", where
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
        ``value``, ready for :func:`set_callback_state`.

    Raises:
        CorruptCheckpointError: naming ``record`` (or its field) for a malformed state.
        StateError: if the callback keeps no state we can set.
    """
    handler = _handler(cb)
    if handler is None:
        raise StateError(
            f"Callback {type(cb).__name__} has no known state; define get_state()/set_state() on it.",
            key=type(cb).__name__,
        )
    if handler[0] is not getattr(type(cb), "get_state", None):
        for cls, spec in _SCHEMAS.items():
            if isinstance(cb, cls):
                return _fields(value, record, where, spec)
    _check_like(value, handler[0](cb), record, where)
    _validate_hook(cb, value, record, where)
    return value


def check_provider_state(provider, value, record: str, where: str | None = None):
    """Check a saved provider state before anything is set: the form of the
    provider's current ``get_state()``, and its ``validate_state`` if defined.

    Raises:
        CorruptCheckpointError: naming ``record`` for a malformed state.
    """
    _check_like(value, provider.get_state(), record, where)
    _validate_hook(provider, value, record, where)
    return value


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
    gen = compat.global_seed_generator()
    out = {
        "numpy": {
            "name": name,
            "keys": np.asarray(keys),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "keras_global_seed": None if gen is None else numpy_copy(gen.state),
        "torch": None,
    }
    if keras.backend.backend() == "torch":
        import torch  # the data loader's RandomSampler draws from torch's global generator

        out["torch"] = torch.get_rng_state().numpy()
    return out


@dataclasses.dataclass(frozen=True)
class ParsedRng:
    """A saved random state, checked and converted into what the generators take.

    Attributes:
        numpy: The tuple for ``np.random.set_state``.
        python: The tuple for ``random.setstate``.
        keras_global_seed: Keras' global seed generator state in this backend's
            seed dtype, or ``None``.
        torch: ``uint8`` array for ``torch.set_rng_state``, or ``None`` (always
            ``None`` off the Torch backend).
    """

    numpy: tuple
    python: tuple
    keras_global_seed: np.ndarray | None
    torch: np.ndarray | None


def _seed_dtype():
    gen = compat.global_seed_generator()
    return keras.backend.standardize_dtype(gen.state.dtype if gen is not None else compat.random_seed_dtype())


def _seed_array(value, record, where):
    """Keras' global seed state as this backend's seed dtype; seeds are uint32 values
    that int32 backends keep as the same bits (Keras' ``draw_seed``)."""
    if not _is_array(value) or np.asarray(value).dtype.kind not in "iu" or np.shape(value) != (2,):
        raise malformed(record, f"expected an integer array of shape (2,), found {_show(value)}", where)
    dtype = _seed_dtype()
    out = []
    for v in np.asarray(value).tolist():
        if dtype == "uint32" and -(2**31) <= v < 0:
            v &= 0xFFFFFFFF
        elif dtype == "int32" and 2**31 <= v < 2**32:
            v -= 2**32
        info = np.iinfo(dtype)
        if not info.min <= v <= info.max:
            raise malformed(record, f"value {v} does not fit this backend's {dtype} seed", where)
        out.append(v)
    return np.asarray(out, dtype=dtype)


def parse_rng_state(state, where: str | None = None) -> ParsedRng:
    """Check a state from :func:`rng_state` in full and convert it, setting nothing.

    Each part is tried on a scratch generator (NumPy, Python, Torch), so what
    passes here is what the global generators take.

    Args:
        state: The saved random state (arrays joined back).
        where: The file, for messages.

    Returns:
        A :class:`ParsedRng` for :func:`apply_rng_state`.

    Raises:
        CorruptCheckpointError: naming the record (``"rng/numpy"``,
            ``"rng/python"``, ``"rng/keras_global_seed"``, ``"rng/torch"``).
    """
    if not isinstance(state, dict):
        raise malformed("rng", f"expected an object, found {_show(state)}", where)
    missing = sorted({"numpy", "python"} - set(state))
    unknown = sorted(set(state) - {"numpy", "python", "keras_global_seed", "torch"}, key=str)
    if missing or unknown:
        raise malformed("rng", f"missing fields {missing}, unknown fields {unknown}", where)

    n = _fields(
        state["numpy"],
        "rng/numpy",
        where,
        {
            "name": (lambda v: v == "MT19937", "'MT19937'"),
            "keys": (
                lambda v: (
                    _is_array(v)
                    and np.shape(v) == (624,)
                    and np.asarray(v).dtype.kind in "iu"
                    and bool(np.all((np.asarray(v) >= 0) & (np.asarray(v) <= 0xFFFFFFFF)))
                ),
                "an array of 624 uint32 values",
            ),
            "pos": (lambda v: _is_int(v) and 0 <= v <= 624, "an integer in [0, 624]"),
            "has_gauss": (lambda v: _is_int(v) and v in (0, 1), "0 or 1"),
            "cached": (_is_number, "a number"),
        },
    )
    numpy_state = (
        "MT19937",
        np.asarray(n["keys"]).astype(np.uint32),
        int(n["pos"]),
        int(n["has_gauss"]),
        float(n["cached"]),
    )
    try:
        np.random.RandomState().set_state(numpy_state)
    except (ValueError, TypeError) as err:
        raise malformed("rng/numpy", f"NumPy refuses it ({err})", where) from err

    p = _fields(
        state["python"],
        "rng/python",
        where,
        {
            "version": (lambda v: _is_int(v) and v == 3, "3 (the version random.getstate() gives)"),
            "internal": (
                lambda v: (
                    isinstance(v, list)
                    and len(v) == 625
                    and all(_is_int(x) and 0 <= x <= 0xFFFFFFFF for x in v)
                    and 0 <= v[-1] <= 624
                ),
                "625 integers (624 uint32 words and a position in [0, 624])",
            ),
            "gauss": (lambda v: v is None or isinstance(v, float), "a float or null"),
        },
    )
    python_state = (int(p["version"]), tuple(int(x) for x in p["internal"]), p["gauss"])
    try:
        random.Random().setstate(python_state)
    except (ValueError, TypeError, OverflowError) as err:
        raise malformed("rng/python", f"Python's random refuses it ({err})", where) from err

    seed = state.get("keras_global_seed")
    seed = None if seed is None else _seed_array(seed, "rng/keras_global_seed", where)

    torch_state = state.get("torch")
    if torch_state is not None:
        if (
            not _is_array(torch_state)
            or np.asarray(torch_state).dtype != np.uint8
            or np.ndim(torch_state) != 1
        ):
            raise malformed("rng/torch", f"expected a 1-D uint8 array, found {_show(torch_state)}", where)
        torch_state = np.array(torch_state, copy=True)
        if keras.backend.backend() == "torch":
            import torch

            try:
                torch.Generator().set_state(torch.from_numpy(torch_state.copy()))
            except (RuntimeError, ValueError, TypeError) as err:
                raise malformed("rng/torch", f"Torch refuses it ({err})", where) from err
        else:
            torch_state = None
    return ParsedRng(numpy=numpy_state, python=python_state, keras_global_seed=seed, torch=torch_state)


def _rng_snapshot():
    """A callable that puts every global random state back as it is now."""

    numpy_state, python_state = np.random.get_state(), random.getstate()
    gen = compat.global_seed_generator()
    gen_value = None if gen is None else numpy_copy(gen.state)
    torch_state = None
    if keras.backend.backend() == "torch":
        import torch

        torch_state = torch.get_rng_state().clone()

    def put_back():
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        compat.set_global_seed_generator(gen)
        if gen is not None:
            gen.state.assign(gen_value)
        if torch_state is not None:
            import torch

            torch.set_rng_state(torch_state)

    return put_back


def apply_rng_state(parsed: ParsedRng) -> None:
    """Set the global generators from a :class:`ParsedRng`; if one refuses, put back
    every one already set and re-raise."""
    put_back = _rng_snapshot()
    try:
        # Keras' global seed generator draws its seed from Python's generator when it is
        # created: create (and set) it before Python's state is put back.
        if parsed.keras_global_seed is not None:
            compat.make_global_seed_generator().state.assign(parsed.keras_global_seed)
        np.random.set_state(parsed.numpy)
        random.setstate(parsed.python)
        if parsed.torch is not None:
            import torch

            torch.set_rng_state(torch.from_numpy(parsed.torch.copy()))
    except BaseException:
        put_back()
        raise


def set_rng_state(state: dict, where: str | None = None) -> None:
    """Put back the states from :func:`rng_state`: all of them, or (for a malformed
    record, or a generator that refuses) none.

    Raises:
        CorruptCheckpointError: naming the malformed record (see :func:`parse_rng_state`).
    """
    apply_rng_state(parse_rng_state(state, where))
