"""States as trees of JSON values and NumPy arrays: the codec and the checks of saved ones.

`split_arrays` and `join_arrays` separate the arrays of a state for
storage and put them back; `copy_state` and `same_state` copy and
compare states; `malformed` is the error for a malformed saved record, and
`check_fields` checks a saved object field by field.
"""

from __future__ import annotations

import math

import numpy as np

from keras_stable_state.errors import CorruptCheckpointError, listed

__all__ = [
    "split_arrays",
    "join_arrays",
    "is_array",
    "copy_state",
    "same_state",
    "malformed",
    "is_int",
    "is_number",
    "show",
    "check_fields",
]

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
    """Inverse of `split_arrays`.

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


def is_array(value) -> bool:
    """``True`` for a NumPy array or an array-like with ``shape`` and ``dtype`` (a backend tensor)."""
    return isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype"))


def copy_state(obj):
    """A deep copy of a state whose arrays are NumPy copies (never views of live
    variables, which an assignment would change)."""
    if is_array(obj):
        return np.array(obj, copy=True)
    if isinstance(obj, dict):
        return {k: copy_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_state(v) for v in obj)
    return obj


def same_state(a, b) -> bool:
    """``True`` when two states hold the same values (arrays by shape, dtype and
    values, NaN equal to NaN)."""
    if is_array(a) or is_array(b):
        if not (is_array(a) and is_array(b)):
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


def is_int(value) -> bool:
    """``True`` for a Python or NumPy integer that is not a boolean."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
    """``True`` for an integer (see `is_int`) or a Python or NumPy float."""
    return is_int(value) or (isinstance(value, (float, np.floating)))


def show(value) -> str:
    """``repr(value)`` for a message (an array as its shape), cut to 80 characters."""
    text = repr(value) if not is_array(value) else f"array of shape {tuple(np.shape(value))}"
    return text if len(text) <= 80 else text[:77] + "..."


def check_fields(value, record, where, spec: dict) -> dict:
    """Check a saved dict against ``{field: (check, expected)}``; every field is
    required and no other is allowed."""
    if not isinstance(value, dict):
        raise malformed(record, f"expected an object, found {show(value)}", where)
    optional = {f for f, check in spec.items() if len(check) > 2}
    missing = sorted(set(spec) - set(value) - optional)
    unknown = sorted(set(value) - set(spec), key=str)
    if missing or unknown:
        raise malformed(
            record,
            f"expected the fields {sorted(spec)}; "
            + ", ".join(
                p
                for p in (missing and f"missing {listed(missing)}", unknown and f"unknown {listed(unknown)}")
                if p
            ),
            where,
        )
    for field, (check, expected, *_) in spec.items():
        if field in value and not check(value[field]):
            raise malformed(f"{record}/{field}", f"expected {expected}, found {show(value[field])}", where)
    return value
