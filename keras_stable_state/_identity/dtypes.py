"""Dtype rules: which saved dtype a variable takes, and how a saved array is made ready for it.

The contract's retyped variables (`float_cast`), the restore's model variables and the
optimizer's slots (`keras_stable_state._optimizer.matching`) and ``torch.optim`` state
(`keras_stable_state._core.torch_restore`) follow the same rules: integers are cast
within range, floating-point arrays only with ``allow_cast`` (exactly, or listed as
lossy, `EXACT_CASTS`), nothing between integers, booleans and floats.
"""

from __future__ import annotations

from typing import Any

import keras
import ml_dtypes
import numpy as np

from keras_stable_state.errors import BindingError, DtypeMismatchError

__all__ = ["EXACT_CASTS", "FLOATS", "coerce", "dtype_name", "float_cast", "floating", "unread"]

FLOATS = frozenset({"bfloat16", "float16", "float32", "float64"})
"""The floating-point dtypes a variable of the contract may be re-typed between."""

# Float casts that keep every value exactly (a wider mantissa and exponent range); any
# other float cast may round or overflow, and its key is listed as lossy.
EXACT_CASTS = frozenset(
    {
        ("float16", "float32"),
        ("float16", "float64"),
        ("bfloat16", "float32"),
        ("bfloat16", "float64"),
        ("float32", "float64"),
    }
)


def float_cast(saved: str, current: str) -> bool:
    """Whether ``saved`` and ``current`` are two different floating-point dtypes (a change
    ``allow_cast=True`` casts)."""
    return saved != current and str(saved) in FLOATS and str(current) in FLOATS


def floating(name: str) -> bool:
    """Whether dtype ``name`` is a floating-point one (``float*``, ``bfloat16``), which
    ``allow_cast=True`` casts to another."""
    return name.startswith(("float", "bfloat16"))


_DTYPE_NAMES: dict = {}  # np.dtype -> its name (NumPy computes ``dtype.name`` each time)


def dtype_name(array: Any) -> str:
    """The standard name of an array's dtype (``"bfloat16"`` for ml_dtypes arrays), memoised
    per dtype (once per restore, not per array)."""
    dtype = array.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = np.dtype(dtype).name
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dtype] = name
    return name


def _numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a Keras dtype name; those NumPy does not name (``bfloat16``,
    float8) are ml_dtypes'."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def unread(array: Any) -> bool:
    """Whether ``array`` is a saved array not read yet: a `FileArray` of a record proven
    whole (it reads itself, ``read_into``) or an ``.orbax`` state's array (``leaf`` and
    ``digest``); ``np.asarray`` reads either."""
    if isinstance(array, np.ndarray):
        return False
    return hasattr(array, "read_into") or (hasattr(array, "leaf") and hasattr(array, "digest"))


def coerce(key: str, array: Any, variable: Any, allow_cast: bool, notes: Any) -> Any:
    """Return ``array`` ready to assign to ``variable``, checking shape and dtype.

    An array not read yet (`unread`) of the variable's dtype and shape is returned
    unread; one to cast is read first. Integers are cast within range; floating-point
    arrays (``bfloat16``, ``float16``, ``float32``, ``float64``, any direction) with
    ``allow_cast``, each listed in ``notes.casts`` and, unless the cast keeps every value
    (`EXACT_CASTS`), in ``notes.lossy``.

    Args:
        key: The variable's key, for messages and notes.
        array: The saved array (NumPy, or not read yet).
        variable: The ``keras.Variable`` it is for.
        allow_cast: Cast floating-point arrays of another dtype.
        notes: Where casts are listed: an object with lists ``casts`` (``(key, saved
            dtype, variable dtype)``) and ``lossy`` (keys); a ``RestoreReport``, or the
            notes of `keras_stable_state._optimizer.matching.match_slots`.

    Raises:
        BindingError: the array's shape is not the variable's.
        DtypeMismatchError: a float cast without ``allow_cast``, a cast between kinds
            (integer, boolean, float), or an integer out of the variable's range.
    """
    dst = keras.backend.standardize_dtype(variable.dtype)
    if unread(array) and dtype_name(array) == dst and tuple(array.shape) == tuple(variable.shape):
        return array
    array = np.asarray(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if tuple(array.shape) != tuple(variable.shape):
        raise BindingError(
            f"Saved array for {key} has shape {tuple(array.shape)}, but its variable has shape "
            f"{tuple(variable.shape)}. The model was changed since the state was saved; rebuild it "
            "as it was, or restore with a model of that shape.",
            key=key,
            expected=tuple(variable.shape),
            received=tuple(array.shape),
        )
    src = dtype_name(array)
    if src == dst:
        return array
    if np.issubdtype(array.dtype, np.integer) and dst.startswith(("int", "uint")):
        info = np.iinfo(np.dtype(dst))
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise DtypeMismatchError(
                f"Saved {src} value of {key} ({array.min()}..{array.max()}) does not fit the "
                f"variable's {dst} range [{info.min}, {info.max}]; it would wrap around. Use a "
                "backend whose counter dtype holds it (TensorFlow keeps int64).",
                key=key,
                expected=dst,
                received=src,
            )
        notes.casts.append((key, src, dst))
        return array.astype(_numpy_dtype(dst))
    if not (floating(src) and floating(dst)):
        raise DtypeMismatchError(
            f"Saved array for {key} is {src}, but its variable is {dst}. Only floating-point arrays "
            "are cast (allow_cast=True) and integers within range; a cast between integers, booleans "
            "and floats would change what the values mean. The file does not belong to this model, or "
            "is damaged; restore a state saved from this model.",
            key=key,
            expected=dst,
            received=src,
        )
    if not allow_cast:
        raise DtypeMismatchError(
            f"Saved array for {key} is {src}, but its variable is {dst}. Casting could lose "
            "precision, so it is refused; pass allow_cast=True to cast and have each cast listed "
            "in report.casts (and those that lose precision in report.lossy), or build the variable "
            f"as {src}.",
            key=key,
            expected=dst,
            received=src,
        )
    notes.casts.append((key, src, dst))
    if (src, dst) not in EXACT_CASTS and key not in notes.lossy:
        notes.lossy.append(key)
    return array.astype(_numpy_dtype(dst))
