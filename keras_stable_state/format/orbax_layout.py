"""The layout of a ``.orbax`` training-state directory, without Orbax, Keras or a backend.

A path ending in ``.orbax`` is a directory holding ``state.h5`` (`RECORD`, our
sealed record; in ``metadata["orbax"]`` (`INDEX`) the index of the arrays) and
``arrays/`` (`ARRAYS`, an Orbax PyTree checkpoint of every model and optimizer
array). The engine that writes it, and reads its arrays for a restore, is
``keras_stable_state._engines.orbax``; this module holds what a reader needs without
Orbax: the names, the index (`index_entries`), the hashes (`region_hash`, and
`element_hash` of index version 1) and the TensorStore spec of a saved array
(`store_spec`), so that `keras_stable_state.format.orbax_file` (the ``.orbax``
layout behind `keras_stable_state.format.open_file`) lists ``.orbax`` states with
NumPy and reads their arrays with TensorStore (installed with the ``[orbax]`` extra).

The hash of index version 2: the array is cut into the blocks
of a grid, the shape of its shards when saved (``block``, in the index; the whole
array for an unsharded one); each block's bytes, in C order, are hashed with
xxh3-64 seeded by the xxh3-64 of the key, dtype, shape, block shape and the block's
first index, and the array's hash is the sum of its blocks' hashes modulo 2**64. A
process holding any union of whole blocks (a shard, several, the whole array)
hashes them at xxh3's speed without copying them (a block that is not contiguous in
what is held is copied first), and the partial sums of several processes add up.
Index version 1 hashed each element (`element_hash`); it is still read.
"""

from __future__ import annotations

import itertools
import json
import os
import zlib

import numpy as np
import xxhash

from keras_stable_state.errors import (
    CheckpointFormatError,
    CorruptCheckpointError,
    NewerFormatError,
    StateError,
)
from keras_stable_state.format.files import open_binary

__all__ = [
    "ARRAYS",
    "INDEX",
    "INDEX_VERSION",
    "READ_INDEX_VERSIONS",
    "RECORD",
    "SECTIONS",
    "SUFFIX",
    "aligned",
    "block_starts",
    "element_hash",
    "index_entries",
    "is_orbax_path",
    "region_hash",
    "store_spec",
]

SUFFIX = ".orbax"
RECORD = "state.h5"
ARRAYS = "arrays"
INDEX = "orbax"
INDEX_VERSION = 2
READ_INDEX_VERSIONS = (1, 2)
SECTIONS = ("model", "optimizer")
MASK = (1 << 64) - 1


def is_orbax_path(path) -> bool:
    """Whether ``path`` names a ``.orbax`` training-state directory."""
    return os.fsdecode(path).rstrip("/\\").endswith(SUFFIX)


# -- index version 2: xxh3-64 of the blocks of the saved shards' grid ------------------------
def aligned(start, stop, shape, block) -> bool:
    """Whether the box ``[start, stop)`` of an array of ``shape`` is a union of whole
    blocks of the grid ``block`` (each bound on a block edge or the array's end)."""
    return all(
        a % b == 0 and (z % b == 0 or z == n) for a, z, n, b in zip(start, stop, shape, block, strict=True)
    )


def block_starts(shape, block, start=None, stop=None):
    """The first indices of the blocks of grid ``block`` inside ``[start, stop)`` (default:
    the whole array), in C order."""
    start = (0,) * len(shape) if start is None else start
    stop = tuple(shape) if stop is None else stop
    return itertools.product(*(range(a, z, b) for a, z, b in zip(start, stop, block, strict=True)))


def _block_digest(data: np.ndarray, first, shape, block, key: str, dtype: str) -> int:
    seed = xxhash.xxh3_64_intdigest(f"{key}|{dtype}|{list(shape)}|{list(block)}|{list(first)}".encode())
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return xxhash.xxh3_64_intdigest(memoryview(data.reshape(-1).view(np.uint8)), seed)


def region_hash(region, start, shape, block, key: str, dtype: str) -> int:
    """The sum (modulo 2**64) of the hashes of the blocks of grid ``block`` in ``region``,
    the box of an array of ``shape`` that starts at index ``start``; the hash of the
    whole array when ``region`` is all of it.

    Args:
        region: NumPy array; must be a union of whole blocks (`aligned`).
        start: Tuple of ints, the region's first index in the whole array.
        shape, block: Tuples of ints, the whole array's shape and the grid's block shape
            (the shape itself for an array of no element).
        key, dtype: The array's key and dtype name, which seed the hash.

    Raises:
        StateError: naming ``key`` if ``region`` is not a union of whole blocks.
    """
    region = np.asarray(region)
    shape, block, start = tuple(shape), tuple(block), tuple(start)
    stop = tuple(a + n for a, n in zip(start, region.shape, strict=True))
    if 0 in shape:  # no element: one empty block, bound to the key, dtype and shape
        return _block_digest(np.zeros(0, np.uint8), (0,) * len(shape), shape, block, key, dtype)
    if not aligned(start, stop, shape, block):
        raise StateError(
            f"Array {key}: the box {list(start)}-{list(stop)} is not a union of whole blocks of "
            f"{list(block)}, so it cannot be hashed on its own. This is a bug in keras_stable_state.",
            key=key,
            expected=f"a union of blocks of {list(block)}",
            received=[list(start), list(stop)],
        )
    if stop == tuple(min(a + b, n) for a, b, n in zip(start, block, shape, strict=True)):  # one block
        return _block_digest(region, start, shape, block, key, dtype)
    total = 0
    for first in block_starts(shape, block, start, stop):
        part = tuple(slice(f - a, f - a + b) for f, a, b in zip(first, start, block, strict=True))
        total += _block_digest(region[part], first, shape, block, key, dtype)
    return total & MASK


# -- index version 1: a sum of per-element SplitMix64 hashes ---------------------------------
def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _seed(key: str, dtype: str, shape) -> int:
    return zlib.crc32(f"{key}|{dtype}|{list(shape)}".encode())


def element_hash(block, start, shape, key: str, dtype: str) -> int:
    """The hash of index version 1 of the elements of ``block``, which starts at index
    ``start`` of an array of ``shape``: the sum modulo 2**64 over elements of
    ``mix(mix(flat_index + seed) ^ bits)``, ``mix`` the SplitMix64 finalizer and
    ``seed`` the CRC-32 of the key, dtype and shape; the hashes of the blocks of any
    partition of the array add up to the hash of the whole array.

    Raises:
        StateError: naming ``key`` for elements of another width than 1, 2, 4 or 8 bytes.
    """
    block = np.asarray(block)
    if not block.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        block = block.copy(order="C")
    width = block.dtype.itemsize
    if width not in (1, 2, 4, 8):
        raise StateError(
            f"Array {key} has dtype {dtype} of {width} bytes per element; index version 1 of the "
            f"'{SUFFIX}' engine hashes elements of 1, 2, 4 or 8 bytes.",
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


# -- the index ---------------------------------------------------------------------------------
def index_entries(metadata, where: str) -> list:
    """The checked entries ``[section, key, name, shape, dtype, hash, block]`` of the Orbax
    array index in the writer ``metadata`` of a ``state.h5``; ``block`` is the hash's
    grid (index version 2), or ``None`` for index version 1 (`element_hash`).

    Raises:
        NewerFormatError: naming ``where`` for an index version above the newest this
            version reads (written by a newer keras_stable_state).
        CorruptCheckpointError: naming ``where`` if the record has no index (it was not
            written by the ``.orbax`` engine), its version is not one, or an entry is malformed.
    """
    index = metadata.get(INDEX) if isinstance(metadata, dict) else None
    if not (isinstance(index, dict) and isinstance(index.get("arrays"), list)):
        raise CorruptCheckpointError(
            f"{where}: {RECORD} has no Orbax array index; it was not written by the '{SUFFIX}' engine. "
            "Restore the '.h5' or '.keras' file it came from.",
            key=INDEX,
        )
    version = index.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > READ_INDEX_VERSIONS[-1]:
        raise NewerFormatError(
            f"{where}: its Orbax array index is version {version}, written by a newer "
            f"keras_stable_state; upgrade to read it (this version reads index versions "
            f"{READ_INDEX_VERSIONS[0]}-{READ_INDEX_VERSIONS[-1]}). The state is not damaged and is "
            "left as it is.",
            path=where,
            version=version,
            key=INDEX,
        )
    if version not in READ_INDEX_VERSIONS or isinstance(version, bool):
        raise CorruptCheckpointError(
            f"{where}: its Orbax array index has version {version!r}, not one of "
            f"{list(READ_INDEX_VERSIONS)}; {RECORD} is damaged. Restore from an earlier checkpoint.",
            key=INDEX,
        )
    width = 6 if version == 1 else 7
    entries = []
    for item in index["arrays"]:
        if not (
            isinstance(item, list)
            and len(item) == width
            and item[0] in SECTIONS
            and all(isinstance(x, str) for x in (item[1], item[2], item[4], item[5]))
            and _ints(item[3])
            and (version == 1 or (_ints(item[6]) and len(item[6]) == len(item[3])))
        ):
            fields = "[section, key, name, shape, dtype, hash" + ("]" if version == 1 else ", block]")
            raise CorruptCheckpointError(
                f"{where}: entry {str(item)[:120]} of the Orbax index (version {version}) is not {fields}.",
                key=INDEX,
            )
        entries.append(list(item) if version == 2 else [*item, None])
    return entries


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value)


def store_spec(directory: str, name: str, where: str) -> dict:
    """The TensorStore spec of the saved array ``name`` (``"<section>.<leaf>"``) in
    ``<directory>/arrays`` (zarr or zarr3, in OCDBT or not, as its ``_METADATA`` says).

    Raises:
        CorruptCheckpointError: naming ``where`` if ``arrays/_METADATA`` cannot be read.
    """
    try:
        with open_binary(os.path.join(directory, ARRAYS, "_METADATA"), what="Orbax metadata") as fh:
            info = json.loads(fh.read(1 << 24))
    except (OSError, ValueError, CheckpointFormatError) as err:
        raise CorruptCheckpointError(
            f"{where}: the Orbax metadata {ARRAYS}/_METADATA cannot be read ({err}); "
            "the folder is damaged or incomplete. Restore from an earlier checkpoint.",
            key=ARRAYS,
        ) from err
    info = info if isinstance(info, dict) else {}
    base = os.path.abspath(os.path.join(directory, ARRAYS))
    if info.get("use_ocdbt", True):
        kvstore = {"driver": "ocdbt", "base": f"file://{base}", "path": f"{name}/"}
    else:
        kvstore = {"driver": "file", "path": os.path.join(base, name) + "/"}
    return {"driver": "zarr3" if info.get("use_zarr3") else "zarr", "kvstore": kvstore}
