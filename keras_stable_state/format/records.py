"""Listing the arrays of a keras_stable_state record from its HDF5 metadata alone.

`RecordListing` checks the root attributes and the format version,
reads and checksums the JSON records (format 3: an ``xxh3`` attribute, the
xxh3-64 of the record's name and bytes), and lists every array as an
`Entry`: format 3 from the index
(`keras_stable_state.format.index`); formats 1-2, still read, from one
dataset per array with ``key``/``dtype``/``crc32`` attributes. No array's data
is read here. The layout is described in ``docs/concepts/file-format.md``.

This module imports no Keras.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from keras_stable_state.errors import CheckpointFormatError, listed, shown
from keras_stable_state.format import index, sandbox
from keras_stable_state.format.codec import DTYPES, stored_dtype
from keras_stable_state.format.probe import damaged, newer_format
from keras_stable_state.format.record import FORMAT_VERSION, INDEX, READ_VERSIONS, RECORDS, SECTIONS, Entry
from keras_stable_state.format.schema import check_json_depth, check_key, check_schema

if TYPE_CHECKING:
    from keras_stable_state.format.source import Source


class Listing:
    """What every listing of an opened file shares: the HDF5 walk, naming keys in errors.

    Attributes:
        src: The opened `Source`.
        where: The file as error messages name it.
        version: The record's format version once read, else ``None``.
        entries: The arrays listed so far, in file order.
        spans: The byte offset in the image of every contiguous, non-empty dataset's
            data, by its path (``"/model/0"``), once walked.
    """

    def __init__(self, src: Source) -> None:
        self.src = src
        self.where: str = src.where
        self.version: int | None = None
        self.entries: list[Entry] = []
        self.spans: dict[str, int] = {}

    def walk(self, strings: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
        """Every dataset as ``(path, dataset)`` (`keras_stable_state.format.sandbox.walk`).

        Raises:
            CorruptCheckpointError: naming the key stored there (format 3: the keys
                of the blob), for any object `walk` refuses.
        """
        spans = {}
        try:
            found = sandbox.walk(self.src.h5, self.src.data_limit(), strings=strings, spans=spans)
        except sandbox.StructureError as err:
            key = self._key_of(err.where)
            named = f"array for key {key!r}: " if key != err.where else ""
            if self.version is not None and self.version >= 3 and key != err.where:
                raise index.refuse_blob(
                    self, err.where.lstrip("/"), None, f"is refused: HDF5 object {err}"
                ) from err
            raise damaged(self.where, f"{named}HDF5 object {err}", key=key) from err
        self.spans = {f"/{path}": offset for path, offset in spans.items()}
        return found

    def _key_of(self, where: str) -> str:
        """The ``key`` attribute of the object at ``where`` when it is plain text (format 3:
        the first key the index puts in that blob), else ``where``."""
        if self.version is not None and self.version >= 3:
            keys = index.blob_keys(self, where)
            return keys[0] if keys else where
        try:
            key = self.src.h5[where].attrs.get("key")
        except (KeyError, OSError, ValueError, TypeError, RuntimeError):
            return where
        return key if isinstance(key, str) and key else where


class RecordListing(Listing):
    """The records and arrays of a keras_stable_state record (`list`).

    Attributes:
        metadata, contract, extra: The JSON records, once read.
        shared: Format 3 in a ``.keras`` archive: the datasets of Keras' weights
            member the record shares, by ``"model.weights.h5:/path"``; else ``{}``.
        shared_spans: The data offsets of those datasets in that member, by the same names.
        datasets: Every dataset the walk checked, by its path (``"/model/0"``), opened
            (an array is read through it, not looked up again).
        parsed_keys: ``{text: VariableKey}`` of every variable key checked (`add_entry`).
    """

    def __init__(self, src: Source) -> None:
        super().__init__(src)
        self.metadata: dict[str, Any] = {}
        self.contract: list[list[Any]] | None = None
        self.extra: dict[str, Any] = {}
        self.shared: dict[str, Any] = {}
        self.shared_spans: dict[str, int] = {}
        self.datasets: dict[str, Any] = {}
        self.parsed_keys: dict[str, Any] = {}

    def list(self) -> None:
        """Read the records, list every array and check the records' schema.

        Raises:
            NewerFormatError: for a format version above the newest this version reads,
                or records or root attributes it does not know in a sealed record.
            CheckpointFormatError: for another format version this version does not read.
            CorruptCheckpointError: for everything else that is not as written.
        """
        self._root_attrs()
        f = self.src.h5
        expected = {*RECORDS, *SECTIONS, *((INDEX,) if self.version >= 3 else ())}
        unknown = sorted(set(f) - expected)
        if unknown and self.version >= 2:  # the seal checks: records a newer writer added
            raise newer_format(self.where, self.version, unknown)
        if unknown:
            raise damaged(self.where, f"unexpected objects {listed(unknown)} at the root", key=unknown[0])
        datasets = dict(self.walk(RECORDS if self.version == 1 else ()))
        self.datasets = {f"/{path}": ds for path, ds in datasets.items()}
        self.metadata, self.contract, self.extra = (self.read_json(name) for name in RECORDS)
        if self.version >= 3:
            index.list_index(self, datasets, self.read_json(INDEX))
        else:
            for section in SECTIONS:
                seen = set()
                for name, ds in self.numbered(section, datasets, "datasets", optional=section == "state"):
                    self.add_entry(self._dataset_entry(section, name, ds), seen)
        check_schema(self.where, self.metadata, self.contract, self.extra, self.entries)

    def _root_attrs(self):
        f = self.src.h5
        unknown = sorted(set(f.attrs) - {"format", "format_version"})
        version = f.attrs.get("format_version")
        if not isinstance(version, int | np.integer) or isinstance(version, bool):
            raise damaged(self.where, f"its format_version attribute is {shown(version)}, not an integer")
        version = int(version)
        if version > READ_VERSIONS[-1]:
            raise newer_format(self.where, version)
        if unknown and self.src.sealed and version >= 2:  # the seal checks: a newer writer's attributes
            raise newer_format(self.where, version, unknown)
        if unknown:
            raise damaged(self.where, f"unexpected root attributes {listed(unknown)}")
        if version not in READ_VERSIONS:
            raise CheckpointFormatError(
                f"{self.where}: format version {version} is not one this version reads "
                f"({', '.join(map(str, READ_VERSIONS))}). Upgrade keras_stable_state.",
                expected=FORMAT_VERSION,
                received=version,
            )
        if version >= 2 and not self.src.sealed:
            raise damaged(self.where, f"a format-{version} record without its seal")
        if version >= 2 and version != self.src.seal_version:
            raise damaged(
                self.where, f"a format-{version} record under a format-{self.src.seal_version} seal"
            )
        self.version = version

    def read_json(self, name: str) -> Any:
        """The JSON record ``name``, its checksum checked (format 3: xxh3-64; format 2:
        CRC-32; format 1, a scalar string, has none).

        Raises:
            CorruptCheckpointError: naming the record.
        """
        f = self.src.h5
        if name not in f or not isinstance(f[name], h5py.Dataset):
            raise damaged(self.where, f"record {name!r} is missing", key=name)
        ds = f[name]
        try:
            if self.version == 1:
                text = ds[()]
                text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            else:
                text = self._checked_json_bytes(name, ds)
            value = json.loads(text)
        except (ValueError, RecursionError, UnicodeError, OSError) as err:
            raise damaged(self.where, f"record {name!r} is not valid JSON ({err})", key=name) from err
        check_json_depth(value, self.where)
        return value

    def _checked_json_bytes(self, name: str, ds) -> str:
        if ds.dtype != np.uint8 or ds.ndim != 1:
            raise damaged(self.where, f"record {name!r} is {ds.dtype} {ds.shape}, not UTF-8 bytes", key=name)
        attr = "crc32" if self.version == 2 else "xxh3"
        if set(ds.attrs) != {attr}:
            raise damaged(self.where, f"record {name!r} has attributes {listed(sorted(ds.attrs))}", key=name)
        raw = sandbox.read_dataset(ds)
        stored = ds.attrs[attr]
        if self.version == 2:
            ok = isinstance(stored, int | np.integer) and int(stored) == sandbox.crc_v2(
                name, "json", raw.shape, raw.tobytes()
            )
        else:
            ok = isinstance(stored, np.unsignedinteger) and int(stored) == sandbox.digest_v3(
                name, "json", raw.shape, raw
            )
        if not ok:
            what = "CRC-32" if self.version == 2 else "xxh3-64"
            raise damaged(self.where, f"record {name!r} fails its {what} checksum", key=name)
        return raw.tobytes().decode("utf-8")

    def add_entry(self, entry: Entry, seen: set) -> None:
        """Append ``entry`` after checking its key parses (its variable key parsed once and
        kept in ``parsed_keys``) and is new in its section (``seen``)."""
        check_key(self.where, entry.section, entry.key, self.parsed_keys)
        if entry.key in seen:
            raise damaged(self.where, f"key {entry.key!r} appears twice in {entry.section!r}", key=entry.key)
        seen.add(entry.key)
        self.entries.append(entry)

    def numbered(self, section: str, datasets: dict, what: str, optional=False) -> list:
        """``[(path, dataset)]`` of ``section/0``, ``section/1``, ... in order, refusing a
        missing group (unless ``optional``), other names or objects that are not datasets."""
        h5 = self.src.h5
        if section not in h5:
            if optional:
                return []
            raise damaged(self.where, f"group {section!r} is missing", key=section)
        group = h5[section]
        if not isinstance(group, h5py.Group):
            raise damaged(self.where, f"{section!r} is not a group", key=section)
        names = set(group)
        if names != {str(i) for i in range(len(names))}:
            odd = sorted(names - {str(i) for i in range(len(names))})
            raise damaged(
                self.where,
                f"group {section!r} holds {odd}, not only {what} numbered 0..{len(names) - 1}",
                key=section,
            )
        found = []
        for i in range(len(names)):
            name = f"{section}/{i}"
            if datasets.get(name) is None:
                raise damaged(self.where, f"{name} is not a dataset", key=name)
            found.append((name, datasets[name]))
        return found

    def _dataset_entry(self, section: str, name: str, ds) -> Entry:
        """Formats 1-2: the entry of one dataset with ``key``/``dtype``/``crc32`` attributes."""
        attrs = set(ds.attrs)
        if attrs != {"key", "dtype", "crc32"}:
            raise damaged(
                self.where,
                f"dataset {name} has attributes {listed(sorted(attrs))}, not key, dtype, crc32",
                key=name,
            )
        key, dtype, crc = ds.attrs["key"], ds.attrs["dtype"], ds.attrs["crc32"]
        if not isinstance(key, str) or not key or not isinstance(dtype, str):
            raise damaged(
                self.where, f"dataset {name} has a key or dtype attribute that is not text", key=name
            )
        if not isinstance(crc, int | np.integer) or isinstance(crc, bool) or not 0 <= int(crc) <= 0xFFFFFFFF:
            raise damaged(self.where, f"array for key {key!r} has a malformed crc32 attribute", key=key)
        if dtype not in DTYPES:
            raise damaged(
                self.where,
                f"array for key {key!r} says dtype {dtype!r}, not one this library writes",
                key=key,
            )
        stored = stored_dtype(dtype)
        if ds.dtype != stored:
            raise damaged(
                self.where,
                f"array for key {key!r} is stored as {ds.dtype.str} but its dtype attribute {dtype!r} "
                f"means {stored.str}",
                key=key,
                expected=stored.str,
                received=ds.dtype.str,
            )
        return Entry(
            section=section,
            key=key,
            dataset=ds.name,
            shape=tuple(int(n) for n in ds.shape),
            dtype=dtype,
            nbytes=int(ds.size) * ds.dtype.itemsize,
            crc32=int(crc),
        )
