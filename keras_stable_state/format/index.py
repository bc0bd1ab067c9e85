"""Format 3: listing the arrays of a record from its index, and the blobs that hold them.

The index row of an array is ``[key, dtype, shape, blob, offset, xxh3-64 hex]``.
Each section's blobs must hold exactly the listed arrays, in index order, at
the offsets the writer gives them (packed from 0, each start aligned to
`ALIGN`): no gap, overlap, stray byte or
unreferenced blob is accepted. In a ``.keras`` archive a model or optimizer row's
blob may instead name a dataset of Keras' ``model.weights.h5``
(``"model.weights.h5:/layers/..."``, ``"model.weights.h5:/optimizer/vars/1"``), whose
member's length and xxh3-128 the index records (`keras_stable_state.format.keras_archive`);
the index field ``shared_sections`` lists the sections that do so when the optimizer is one
of them (absent: the model alone). See ``docs/concepts/file-format.md``.

The functions take the `RecordListing`
being filled. This module imports no Keras.
"""

from __future__ import annotations

import math
import re
import zipfile

import h5py
import numpy as np
import xxhash

from keras_stable_state.errors import StateError, listed
from keras_stable_state.format import image, keras_archive, sandbox
from keras_stable_state.format.codec import DTYPES, aligned, stored_dtype
from keras_stable_state.format.probe import damaged, diagnose, newer_format
from keras_stable_state.format.record import (
    INDEX,
    MAX_NDIM,
    SECTIONS,
    SHARABLE,
    SHARED,
    SHARED_SECTIONS,
    Entry,
)
from keras_stable_state.format.schema import is_int

_HEX16 = re.compile(r"[0-9a-f]{16}")


def blob_keys(rec, where: str, rows=None) -> list:
    """The keys the index puts in blob ``where`` (``"model/0"``), to name them when the
    blob is refused; ``[]`` when the index itself cannot be read."""
    match = re.fullmatch(r"/?(model|optimizer|state)/([0-9]+)", where)
    if match is None:
        return []
    section, blob = match.group(1), int(match.group(2))
    if rows is None:
        h5 = rec.src.h5
        if h5 is None or INDEX not in h5:
            return []
        try:
            sandbox.check_dataset(h5[INDEX], rec.src.data_limit())
            rows = rec.read_json(INDEX)[section]
        except (StateError, sandbox.StructureError, KeyError, TypeError, OSError, ValueError):
            return []
    return [
        row[0]
        for row in rows
        if isinstance(row, list) and len(row) > 3 and isinstance(row[0], str) and row[3] == blob
    ]


def refuse_blob(rec, name: str, rows: list | None, what: str, **kw):
    """The refusal of blob ``name`` (``"model/0"``), naming the keys the index puts in it."""
    keys = blob_keys(rec, name, rows)
    named = ""
    if keys:
        plural = "s" if len(keys) > 1 else ""
        named = f" (it holds the array{plural} for key{plural} {listed(keys)[1:-1]})"
    return damaged(rec.where, f"{name}{named} {what}", key=keys[0] if keys else name, **kw)


def _blob_sizes(rec, section: str, datasets: dict, rows: list) -> list:
    """Sizes in bytes of the blobs ``section/0``, ``section/1``, ..."""
    sizes = []
    for name, ds in rec.numbered(section, datasets, "blobs"):
        if ds.dtype != np.uint8 or ds.ndim != 1 or len(ds.attrs):
            raise refuse_blob(
                rec,
                name,
                rows,
                f"is stored as {ds.dtype.str} {ds.shape} with attributes {listed(sorted(ds.attrs))}, not as the "
                "uint8 blob without attributes the index describes",
            )
        sizes.append(int(ds.shape[0]))
    return sizes


def list_index(rec, datasets: dict, index) -> None:
    """Append the arrays of the record's ``index`` to ``rec.entries``, checking that each
    section's blobs hold exactly the listed arrays, in order, at the writer's offsets.

    Raises:
        CorruptCheckpointError: naming the key, blob or record concerned.
    """
    where = rec.where
    fields = {SHARED, SHARED_SECTIONS, *SECTIONS}
    if isinstance(index, dict) and set(SECTIONS) <= set(index) and set(index) - fields:
        raise newer_format(where, rec.version, [f"index field {k}" for k in sorted(set(index) - fields)])
    if not isinstance(index, dict) or set(index) - {SHARED, SHARED_SECTIONS} != set(SECTIONS):
        raise damaged(
            where, f"record 'index' is not an object with exactly the sections {list(SECTIONS)}", key=INDEX
        )
    sharing = _sharing(rec, index)
    if SHARED in index:
        rows = [row for s in sharing if isinstance(index[s], list) for row in index[s]]
        _open_shared(rec, index[SHARED], rows)
    for section in SECTIONS:
        rows = index[section]
        if not isinstance(rows, list):
            raise damaged(where, f"record 'index': section {section!r} is not a list", key=INDEX)
        sizes = _blob_sizes(rec, section, datasets, rows)
        ends = [None] * len(sizes)
        seen = set()
        for row in rows:
            rec.add_entry(_index_entry(rec, section, row, sizes, ends, sharing), seen)
        for i, (end, size) in enumerate(zip(ends, sizes, strict=True)):
            if end is None:
                raise damaged(
                    where,
                    f"blob {section}/{i} ({size} bytes) holds no array of the index",
                    key=f"{section}/{i}",
                )
            if end != size:
                raise refuse_blob(
                    rec,
                    f"{section}/{i}",
                    rows,
                    f"is {size} bytes long, but the arrays the index puts in it end at byte {end}",
                    expected=end,
                    received=size,
                )


def _sharing(rec, index: dict) -> tuple:
    """The sections whose rows may name datasets of Keras' weights member: those the field
    `SHARED_SECTIONS` lists (only with `SHARED`), else the model alone."""
    if SHARED_SECTIONS not in index:
        return ("model",)
    listed_ = index[SHARED_SECTIONS]
    ok = (
        SHARED in index
        and isinstance(listed_, list)
        and listed_
        and all(isinstance(s, str) and s in SHARABLE for s in listed_)
        and len(set(listed_)) == len(listed_)
    )
    if not ok:
        raise damaged(
            rec.where,
            f"record 'index': field {SHARED_SECTIONS!r} is {str(listed_)[:160]}, not a list of distinct "
            f"sections out of {list(SHARABLE)} beside the field {SHARED!r}",
            key=INDEX,
        )
    return tuple(listed_)


def _index_entry(rec, section: str, row, sizes: list, ends: list, sharing=("model",)) -> Entry:
    where = rec.where
    ok = (
        isinstance(row, list)
        and len(row) == 6
        and isinstance(row[0], str)
        and row[0]
        and isinstance(row[1], str)
        and isinstance(row[2], list)
        and len(row[2]) <= MAX_NDIM
        and all(is_int(n) and 0 <= n < 2**62 for n in row[2])
        and (is_int(row[3]) or isinstance(row[3], str))
        and is_int(row[4])
        and isinstance(row[5], str)
        and _HEX16.fullmatch(row[5]) is not None
    )
    if not ok:
        key = row[0] if isinstance(row, list) and row and isinstance(row[0], str) and row[0] else INDEX
        raise damaged(
            where,
            f"record 'index': row {str(row)[:160]} of {section!r} is not [key, dtype, shape, blob, offset, xxh3-64 hex]",
            key=key,
        )
    key, dtype, shape, blob, offset, digest = row
    if dtype not in DTYPES:
        raise damaged(
            where, f"array for key {key!r} says dtype {dtype!r}, not one this library writes", key=key
        )
    if isinstance(blob, str):
        return _shared_entry(rec, section, row, sharing)
    if not 0 <= blob < len(sizes):
        raise damaged(
            where,
            f"array for key {key!r} is in blob {blob}, but {section!r} has blobs 0..{len(sizes) - 1}",
            key=key,
        )
    nbytes = math.prod(shape) * stored_dtype(dtype).itemsize
    start = aligned(ends[blob] or 0)
    if offset != start:
        raise damaged(
            where,
            f"array for key {key!r} starts at byte {offset} of blob {section}/{blob}, where the arrays "
            f"before it put the next start at byte {start}",
            key=key,
            expected=start,
            received=offset,
        )
    if offset + nbytes > sizes[blob]:
        raise damaged(
            where,
            f"array for key {key!r} ({dtype} {tuple(shape)}: {nbytes} bytes at byte {offset}) runs past "
            f"the end of blob {section}/{blob} ({sizes[blob]} bytes)",
            key=key,
        )
    ends[blob] = offset + nbytes
    return Entry(
        section=section,
        key=key,
        dataset=f"/{section}/{blob}",
        shape=tuple(shape),
        dtype=dtype,
        nbytes=nbytes,
        offset=offset,
        xxh3=int(digest, 16),
    )


def _open_shared(rec, spec, rows):
    """Keras' weights member a ``.keras`` record shares arrays with (``rows``: the index rows
    of the sections that share, to name a damaged one): its length
    and xxh3-128 are checked against ``spec`` (from the sealed index) before HDF5
    parses it, then its structure, as for a record; its datasets go to ``rec.shared``."""
    src = rec.src
    where = f"{src.path}:{keras_archive.MEMBER}"
    ok = (
        isinstance(spec, dict)
        and set(spec) == {"member", "bytes", "xxh3-128"}
        and spec["member"] == keras_archive.MEMBER
        and is_int(spec["bytes"])
        and isinstance(spec["xxh3-128"], str)
        and re.fullmatch(r"[0-9a-f]{32}", spec["xxh3-128"]) is not None
    )
    if not ok:
        raise damaged(
            rec.where, f"record 'index': field {SHARED!r} is malformed: {str(spec)[:160]}", key=INDEX
        )
    if src.zip is None:
        raise damaged(
            rec.where,
            f"record 'index' shares arrays with Keras' {keras_archive.MEMBER}, but this is not a .keras archive",
            key=INDEX,
        )
    try:
        info = src.zip.getinfo(keras_archive.MEMBER)
    except KeyError:
        raise damaged(
            src.path,
            f"the record shares arrays with {keras_archive.MEMBER}, which the archive lacks",
            key=keras_archive.MEMBER,
        ) from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise damaged(
            where,
            "the member is compressed, but the record reads its arrays in place (Keras and this "
            "library write it stored); it was rewritten by another tool",
            key=keras_archive.MEMBER,
        )
    start, size = keras_archive.member_span(src.fh, info)
    member_image = None
    if size != spec["bytes"]:
        digest = None
    elif src.whole and src.unaligned_views:  # read once, whole (format.image): arrays are views of it
        h = xxhash.xxh3_128()
        window = keras_archive.Window(src.fh, start, size)
        member_image = image.read_hashed(window, size, h, where, key=keras_archive.MEMBER)
        digest = h.hexdigest()
    else:
        digest = keras_archive.hash_span(src.fh, start, size)[0]
    if digest != spec["xxh3-128"]:
        what = (
            f"the member ({size} bytes) is not the one the training state was written with "
            f"({spec['bytes']} bytes, xxh3-128 {spec['xxh3-128']}); the arrays shared with it cannot be trusted"
        )
        expect = (
            [
                [r[0], r[1], r[2], r[3][len(keras_archive.PREFIX) :], r[5]]
                for r in rows
                if isinstance(r, list) and len(r) == 6 and isinstance(r[3], str)
            ]
            if isinstance(rows, list)
            else None
        )
        with src.on_disk() as path:
            raise diagnose(
                where, path, keras_archive.MEMBER, what, default_key=keras_archive.MEMBER, expect=expect
            )
    src.hashed_members.add(keras_archive.MEMBER)  # its xxh3-128 holds: no zip CRC-32 read after
    src.shared_image = member_image
    src.shared_start = start if member_image is None else None
    src.shared_h5 = h5py.File(
        keras_archive.Window(src.fh, start, size) if member_image is None else image.ImageFile(member_image),
        "r",
    )
    spans = {}
    try:
        found = sandbox.walk(src.shared_h5, size, spans=spans)
    except sandbox.StructureError as err:
        raise damaged(where, f"HDF5 object {err}", key=keras_archive.MEMBER) from err
    rec.shared = {f"{keras_archive.PREFIX}/{path}": ds for path, ds in found}
    rec.shared_spans = {f"{keras_archive.PREFIX}/{path}": offset for path, offset in spans.items()}


def _shared_entry(rec, section: str, row, sharing: tuple) -> Entry:
    key, dtype, shape, ref, offset, digest = row
    if section not in sharing:
        raise damaged(
            rec.where,
            f"array for key {key!r} in section {section!r} refers to {ref!r}, but the index shares "
            f"only the sections {list(sharing)} with Keras' {keras_archive.MEMBER}",
            key=key,
        )
    ds = rec.shared.get(ref) if offset == 0 else None
    stored = stored_dtype(dtype)
    if ds is None or ds.dtype != stored or tuple(ds.shape) != tuple(shape):
        found = "no such dataset" if ds is None else f"{ds.dtype.str} {tuple(ds.shape)}"
        raise damaged(
            rec.where,
            f"array for key {key!r} refers to {ref!r} at offset {offset} in section {section!r}, but "
            f"that is {found}, not the {section} array {stored.str} {tuple(shape)} the index says",
            key=key,
        )
    return Entry(
        section=section,
        key=key,
        dataset=ref,
        shape=tuple(shape),
        dtype=dtype,
        nbytes=math.prod(shape) * stored.itemsize,
        offset=0,
        xxh3=int(digest, 16),
    )
