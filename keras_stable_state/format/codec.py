"""How arrays and JSON records are encoded as bytes in a training state.

Arrays keep their dtype, stored little-endian; dtypes NumPy does not know
natively (``bfloat16``, float8 from ``ml_dtypes``) are stored as unsigned
integers of the same width, their dtype named in the index, so their bits are
kept exactly. JSON records are UTF-8 bytes in ``uint8`` datasets. The digests
(xxh3-64 of format 3, and the CRC-32 of formats 1-2, still read) live in
`keras_stable_state.format.sandbox`, which the probe process runs
without this package. See ``docs/concepts/file-format.md``.

This module imports no Keras.
"""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np

from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format.record import ALIGN

# Dtypes stored as the bits of an unsigned integer of the same width.
EXOTIC = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
# Every dtype name a training state may hold.
DTYPES = frozenset(
    {
        "bool",
        *(f"int{n}" for n in (8, 16, 32, 64)),
        *(f"uint{n}" for n in (8, 16, 32, 64)),
        "float16",
        "float32",
        "float64",
        *EXOTIC,
    }
)


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype for a Keras dtype name (ml_dtypes for ``bfloat16`` and float8)."""
    dtype: np.dtype[Any] = np.dtype(EXOTIC.get(name, name))
    return dtype


def dtype_name(array: Any) -> str:
    """Standard name of an array's dtype (``"bfloat16"`` for ml_dtypes arrays)."""
    name: str = np.dtype(array.dtype).name
    return name


def stored_dtype(name: str) -> np.dtype:
    """The little-endian dtype an array of dtype ``name`` is stored as (``bfloat16``:
    ``<u2``; float8: ``|u1``; others: the dtype itself, little-endian)."""
    if name in EXOTIC:
        return np.dtype(f"<u{np.dtype(EXOTIC[name]).itemsize}")
    return np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1 else np.dtype(name)


def encode_array(array: Any) -> tuple[np.ndarray, str]:
    """``(stored, dtype name)``: ``array`` as it is stored, C-contiguous, of its shape
    and of dtype `stored_dtype` (a view, not a copy, where it can be).

    Raises:
        CheckpointFormatError: for a dtype outside `DTYPES` (``.received``: its name).
    """
    # C order without a copy when it already is (the value is written, then dropped).
    array = np.asarray(array, order="C")
    name = dtype_name(array)
    if name not in DTYPES:
        raise CheckpointFormatError(
            f"Arrays of dtype {name} cannot be stored (only bool, int, uint, float, bfloat16 and float8).",
            received=name,
        )
    # np.asarray(..., order="C") above made it C-contiguous; the view and astype keep the shape (0-d too).
    stored = (
        array.view(stored_dtype(name)) if name in EXOTIC else array.astype(stored_dtype(name), copy=False)
    )
    return stored, name


def decode_array(stored: np.ndarray, name: str) -> np.ndarray:
    """``stored`` viewed as dtype ``name`` when it is stored as its bits (`EXOTIC`), else as is."""
    return stored.view(np.dtype(EXOTIC[name])) if name in EXOTIC else stored


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of `ALIGN`."""
    return n + (-n) % ALIGN


def json_array(value: Any) -> np.ndarray:
    """``value`` as JSON in UTF-8, a 1-d ``uint8`` array (a JSON record's dataset)."""
    return np.frombuffer(json.dumps(value).encode("utf-8"), dtype=np.uint8)
