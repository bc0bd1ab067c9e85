"""Editing format-3 training-state records in tests: the tools of a careful forger.

Each helper changes an open ``h5py.File`` (mode ``"r+"``) and fixes every
checksum inside the record, so that only the whole-file seal (or, once the
file is resealed with ``reseal``, the deeper checks of restore) can
notice. Layout: see ``docs/concepts/file-format.md``.
"""

import json

import numpy as np

from keras_stable_state.format import sandbox
from keras_stable_state.format.codec import stored_dtype


def index(f) -> dict:
    """The record's index: ``{section: [[key, dtype, shape, blob, offset, xxh3 hex], ...]}``."""
    return json.loads(f["index"][()].tobytes())


def write_json(f, name: str, value) -> None:
    """Replace JSON record ``name`` (``"metadata"``, ``"extra"``, ``"index"``...) by ``value``
    (or raw ``bytes``), with the xxh3-64 a reader expects."""
    text = value if isinstance(value, bytes) else json.dumps(value).encode()
    data = np.frombuffer(text, dtype=np.uint8)
    if f[name].shape == data.shape:  # in place: the file keeps its length
        ds = f[name]
        ds[...] = data
    else:
        del f[name]
        ds = f.create_dataset(name, data=data)
    ds.attrs["xxh3"] = np.uint64(sandbox.digest_v3(name, "json", data.shape, data))


def row_of(f, key: str):
    """``(section, row)`` of ``key`` in the index."""
    for section, rows in index(f).items():
        for row in rows:
            if row[0] == key:
                return section, row
    raise AssertionError(f"no array for {key!r} in the index")


def dataset_of(f, key: str) -> str:
    """The HDF5 path of the blob holding ``key`` (``"model/0"``)."""
    section, row = row_of(f, key)
    return f"{section}/{row[3]}"


def edit_array(f, key: str, fn) -> None:
    """Replace the array of ``key`` by ``fn(array)`` (same dtype and shape), fixing its
    xxh3-64 in the index."""
    idx = index(f)
    for section, rows in idx.items():
        for row in rows:
            if row[0] != key:
                continue
            name, dtype, shape, blob, offset, _ = row
            data = f[f"{section}/{blob}"][()]
            stored = stored_dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * stored.itemsize
            value = data[offset : offset + nbytes].view(stored).reshape(shape)
            new = np.ascontiguousarray(fn(value.copy()), dtype=stored)
            assert new.shape == value.shape
            data[offset : offset + nbytes] = new.reshape(-1).view(np.uint8)
            f[f"{section}/{blob}"][...] = data
            row[5] = f"{sandbox.digest_v3(name, dtype, shape, new.reshape(-1).view(np.uint8)):016x}"
            write_json(f, "index", idx)
            return
    raise AssertionError(f"no array for {key!r} in the index")


def drop_last(f, section: str) -> str:
    """Remove the last array of ``section`` from the index and its bytes from its blob
    (the blob itself when it held nothing else; only its row when it names a dataset of
    Keras' ``model.weights.h5``), keeping the layout a reader expects; returns the removed key."""
    idx = index(f)
    rows = idx[section]
    key, _, _, blob, offset, _ = rows.pop()
    if isinstance(blob, str):  # a .keras row naming a dataset of Keras' model.weights.h5: no blob
        write_json(f, "index", idx)
        return key
    left = [r for r in rows if r[3] == blob]
    name = f"{section}/{blob}"
    if left:
        last = left[-1]
        end = last[4] + int(np.prod(last[2], dtype=np.int64)) * stored_dtype(last[1]).itemsize
        data = f[name][()][:end]
        del f[name]
        f[section].create_dataset(str(blob), data=data)
    else:
        del f[name]
    write_json(f, "index", idx)
    return key


FIELDS = ["offset", "shape", "dtype", "blob", "digest", "key", "swap", "drop", "duplicate"]


def mutate_index(index, section, i, field, amount):
    """Change one row of ``index[section]`` (or the rows' order): ``field`` one of
    :data:`FIELDS`, ``i`` picks the row, ``amount`` (>= 1) the change."""
    rows = index[section]
    row = rows[i % len(rows)]
    other = rows[(i + 1) % len(rows)]
    if field == "offset":
        row[4] += amount
    elif field == "shape":
        row[2] = [*row[2], 1] if amount % 2 else ([row[2][0] + amount] + row[2][1:] if row[2] else [amount])
    elif field == "dtype":
        row[1] = {"float32": "int32", "int64": "float64"}.get(
            row[1], "float32" if row[1] != "float32" else "int32"
        )
    elif field == "blob":
        row[3] += amount
    elif field == "digest":
        row[5] = f"{int(row[5], 16) ^ amount:016x}"
    elif field == "key":
        if other is row:
            row[0] = row[0] + "x"
        else:
            row[0] = other[0]
    elif field == "swap":
        if other is row:
            row[4] += amount
        else:
            rows[i % len(rows)], rows[(i + 1) % len(rows)] = other, row
    elif field == "drop":
        rows.remove(row)
    else:
        rows.insert(i % len(rows), list(row))
