"""The layout of a ``.orbax`` training-state directory, without Orbax, Keras or a backend.

A path ending in ``.orbax`` is a directory holding ``state.h5`` (:data:`RECORD`, our
sealed record; in ``metadata["orbax"]`` (:data:`INDEX`) the index of the arrays) and
``arrays/`` (:data:`ARRAYS`, an Orbax PyTree checkpoint of every model and optimizer
array). The engine that writes and restores it is ``keras_stable_state._engines.orbax``
(see its docstring for the hash); this module holds what a reader needs without Orbax:
the names, the index (:func:`index_entries`) and the hash (:func:`block_hash`), so that
the command line inspects and verifies ``.orbax`` states with NumPy (and TensorStore,
installed with the ``[orbax]`` extra, to read the arrays).
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from keras_stable_state.errors import CorruptCheckpointError, StateError

__all__ = [
    "ARRAYS",
    "INDEX",
    "INDEX_VERSION",
    "RECORD",
    "SECTIONS",
    "SUFFIX",
    "block_hash",
    "index_entries",
    "is_orbax_path",
]

SUFFIX = ".orbax"
RECORD = "state.h5"
ARRAYS = "arrays"
INDEX = "orbax"
INDEX_VERSION = 1
SECTIONS = ("model", "optimizer")


def is_orbax_path(path) -> bool:
    """Whether ``path`` names a ``.orbax`` training-state directory."""
    return os.fsdecode(path).rstrip("/\\").endswith(SUFFIX)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _seed(key: str, dtype: str, shape) -> int:
    return zlib.crc32(f"{key}|{dtype}|{list(shape)}".encode())


def block_hash(block, start, shape, key: str, dtype: str) -> int:
    """The hash of the elements of ``block``, which starts at index ``start`` of an array of ``shape``.

    Args:
        block: NumPy array, a block of the whole array.
        start: Tuple of ints, the block's first index in the whole array.
        shape: Tuple of ints, the whole array's shape.
        key, dtype: The array's key and dtype name, which seed the hash.

    Returns:
        An int in ``[0, 2**64)``; the hashes of the blocks of a partition of
        the array add up (modulo ``2**64``) to the hash of the whole array.

    Raises:
        StateError: naming ``key`` for elements of another width than 1, 2, 4 or 8 bytes.
    """
    block = np.asarray(block)
    if not block.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        block = block.copy(order="C")
    width = block.dtype.itemsize
    if width not in (1, 2, 4, 8):
        raise StateError(
            f"Array {key} has dtype {dtype} of {width} bytes per element; the '{SUFFIX}' engine hashes "
            "elements of 1, 2, 4 or 8 bytes. Save it to a '.h5' path.",
            key=key,
            expected="1, 2, 4 or 8 bytes per element",
            received=width,
        )
    bits = block.reshape(-1).view(f"u{width}").astype(np.uint64)
    if bits.size == 0:
        return 0
    grids = np.indices(block.shape if block.ndim else (1,)).reshape(max(block.ndim, 1), -1)
    if block.ndim:
        flat = np.ravel_multi_index(tuple(g + s for g, s in zip(grids, start, strict=True)), shape)
    else:
        flat = np.zeros(1, dtype=np.int64)
    index = flat.astype(np.uint64) + np.uint64(_seed(key, dtype, shape))
    return int(_mix(_mix(index) ^ bits).sum(dtype=np.uint64))


def index_entries(metadata, where: str) -> list:
    """The checked entries ``[section, key, name, shape, dtype, hash]`` of the Orbax array
    index in the writer ``metadata`` of a ``state.h5``.

    Raises:
        CorruptCheckpointError: naming ``where`` if the record has no index (it was not
            written by the ``.orbax`` engine) or an entry is malformed.
    """
    index = metadata.get(INDEX) if isinstance(metadata, dict) else None
    if not (isinstance(index, dict) and isinstance(index.get("arrays"), list)):
        raise CorruptCheckpointError(
            f"{where}: {RECORD} has no Orbax array index; it was not written by the '{SUFFIX}' engine. "
            "Restore the '.h5' or '.keras' file it came from.",
            key=INDEX,
        )
    for item in index["arrays"]:
        if not (
            isinstance(item, list)
            and len(item) == 6
            and item[0] in SECTIONS
            and all(isinstance(x, str) for x in (item[1], item[2], item[4], item[5]))
            and isinstance(item[3], list)
        ):
            raise CorruptCheckpointError(
                f"{where}: entry {str(item)[:120]} of the Orbax index is not "
                "[section, key, name, shape, dtype, hash].",
                key=INDEX,
            )
    return index["arrays"]
