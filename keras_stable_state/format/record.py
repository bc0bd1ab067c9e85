"""The names and limits of the training-state format, and the records it holds in memory.

The layout these constants name is described once, in ``docs/concepts/file-format.md``.
This module imports no Keras.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Final, Literal

FORMAT = "keras_stable_state"
FORMAT_VERSION = 3
# Format versions the reader still reads (1 and 2: see docs/concepts/file-format.md).
READ_VERSIONS = (1, 2, 3)
MEMBER = "keras_stable_state.h5"
KERAS_WEIGHTS_MEMBER = "model.weights.h5"
USERBLOCK_SIZE = 512
SECTIONS = ("model", "optimizer", "state")
RECORDS = ("metadata", "contract", "extra")
INDEX = "index"
# Format 3 packing: arrays up to PACK_LIMIT bytes share blobs, a blob is written once it
# holds BLOB_TARGET bytes (so a save holds at most about BLOB_TARGET + PACK_LIMIT bytes of
# packed arrays), and each packed array starts at a multiple of ALIGN.
PACK_LIMIT = 1 << 16
BLOB_TARGET = 1 << 20
ALIGN = 16
# The data of every dataset of DATA_ALIGN_ABOVE bytes or more starts at a multiple of
# DATA_ALIGN bytes in the file (HDF5's H5Pset_alignment; the user block is a multiple of
# it too): a reader that reads the image whole into an aligned buffer hands such arrays to
# TensorFlow and JAX, which need 64-byte aligned host memory, as views without a copy.
DATA_ALIGN = 64
DATA_ALIGN_ABOVE = 1 << 12
# Index field of a .keras record naming Keras' weights member it shares arrays with.
SHARED = "shared"
# Index field listing the sections whose rows name datasets of that member, written when a
# section other than the model shares (the optimizer slots); absent, the model alone may
# (files written before the slots were shared). A reader that does not know the field refuses
# the file as written by a newer version instead of calling it damaged.
SHARED_SECTIONS = "shared_sections"
# The sections a .keras record may share with Keras' weights member, and the size in bytes
# an array must pass to be shared: every model array (as since sharing began); an optimizer
# array only when larger than PACK_LIMIT (smaller ones stay packed in the record's blobs: each
# would save at most PACK_LIMIT bytes, yet cost an HDF5 dataset read of its own to restore).
SHARE_ABOVE = {"model": 0, "optimizer": PACK_LIMIT}
SHARABLE = tuple(SHARE_ABOVE)
MAX_NDIM = 32
JSON_MAX_DEPTH = 100
# An archive member may unpack to at most this many times its stored size (plus the slack).
MAX_UNPACK_RATIO = 100
UNPACK_SLACK = 1 << 20
# How a layout's arrays are matched to the live variables (`keras_stable_state.format.layout`):
# by their keys (our record, a ``.orbax`` folder), or by the model's layer structure, the
# HDF5 paths of Keras' own weights (a stock Keras file, as ``load_weights`` matches them).
BY_KEY: Final = "key"
BY_STRUCTURE: Final = "structure"
MatchedBy = Literal["key", "structure"]


@dataclasses.dataclass
class StateRecord:
    """A training-state record held in memory.

    Attributes:
        metadata: Writer backend, Keras version, dtype policy, format version.
        contract: ``[key, shape, dtype]`` lists, or ``None``.
        model: Model variable arrays by key (insertion order = file order).
        optimizer: Optimizer variable arrays by entry key.
        extra: Other state (schedule, callbacks, RNG, position, providers) as
            JSON, with arrays replaced by references into ``arrays``.
        arrays: Arrays of the other state by name.
        parsed_keys: ``{text: VariableKey}``: the variable keys of ``model`` and of the
            owners of ``optimizer``'s slots, parsed when the file was read and its keys
            checked (a restore parses each one once); ``{}`` for a record not read from
            a file. Not compared.

    For writing (`keras_stable_state.format.writer.write_record`), a value in
    ``model``, ``optimizer`` or ``arrays`` may also be a zero-argument callable
    returning the array: it is called when that array is written, and the array
    dropped once it is on disk, so a save holds one host copy at a time
    (``save_training_state`` passes the variables' conversions so; an
    asynchronous writer may pass host copies made beforehand). Records read
    back always hold arrays.

    ``matched_by`` (a class attribute) is `BY_KEY`: its arrays are matched to the
    live variables by their keys.
    """

    matched_by: ClassVar[MatchedBy] = BY_KEY
    metadata: dict[str, Any]
    contract: list[list[Any]] | None
    model: dict[str, Any]
    optimizer: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: dict[str, Any] = dataclasses.field(default_factory=dict)
    parsed_keys: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass
class Entry:
    """One array of a file, described from the HDF5 metadata without reading its data.

    Attributes:
        section: ``"model"``, ``"optimizer"`` or ``"state"`` (other state's arrays;
            stock Keras files have only the first two).
        key: Its key (``"path:layers/dense/kernel"``, ``"path:layers/dense/kernel#momentums"``,
            ``"optimizer#iteration"``) or, in a stock Keras file, its HDF5 path
            (``"layers/dense/vars/0"``).
        dataset: The HDF5 path of the dataset holding it (format 3: its blob,
            ``"/model/0"``, shared with other arrays when small, or the dataset of
            Keras' ``model.weights.h5`` it shares, ``"model.weights.h5:/layers/dense/vars/0"``,
            ``"model.weights.h5:/optimizer/vars/2"``).
        shape: Its shape, a tuple of ints.
        dtype: Its dtype name (``"bfloat16"`` for arrays stored as their bits).
        nbytes: Size of its stored data in bytes.
        crc32: Formats 1-2 (still read): its stored CRC-32; else ``None`` (format 3
            carries ``xxh3``, stock Keras files carry no checksum).
        offset: Format 3: where its bytes start in its blob; else 0.
        xxh3: Format 3: its stored xxh3-64 (over key, dtype, shape and bytes), else ``None``.
    """

    section: str
    key: str
    dataset: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    crc32: int | None = None
    offset: int = 0
    xxh3: int | None = None

    @property
    def checksum(self) -> str:
        """The name of the checksum it carries: ``"xxh3-64"`` (format 3), ``"CRC-32"``
        (formats 1-2) or ``""`` (stock files)."""
        return "xxh3-64" if self.xxh3 is not None else "CRC-32" if self.crc32 is not None else ""
