"""The results of ``inspect`` and ``verify``, as dataclasses (see `keras_stable_state.cli.data`).

Each top-level result has ``to_json()``, the document ``--json`` prints:
`to_json` of ``dataclasses.asdict``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_stable_state import format

if TYPE_CHECKING:
    from keras_stable_state.format import Entry

__all__ = [
    "DamagedArray",
    "ArrayInfo",
    "Damage",
    "Member",
    "Problem",
    "RecordInspection",
    "StockInspection",
    "StockOptimizer",
    "StockOptimizerVariable",
    "StockWeight",
    "VariableInfo",
    "Verification",
    "describe",
    "to_json",
]

RECORD_KIND = format.FORMAT  # CheckpointFile.kind of a training state: "keras_stable_state"


def to_json(value: Any) -> Any:
    """``value`` (a dataclass, or dicts/lists/tuples of them) as a ``json.dumps``-ready tree.

    Tuples become lists, NumPy scalars Python numbers, non-finite floats their
    ``str`` (``"nan"``, ``"inf"``) and dict keys strings.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


class _Json:
    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document: `to_json` of this dataclass."""
        doc: dict[str, Any] = to_json(self)
        return doc


@dataclasses.dataclass(frozen=True)
class DamagedArray:
    """An array that could not be read: ``file``, ``key`` and ``reason``."""

    file: str
    key: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """One stored array, from the file's metadata (its data is not read).

    Attributes:
        key: Its entry key (``"path:layers/dense/kernel#momentums"``, ``"optimizer#iteration"``).
        shape: Its shape, a tuple of ints.
        dtype: Its dtype name (``"float32"``, ``"bfloat16"``).
        bytes: Size of its stored data in bytes.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    @classmethod
    def of(cls, entry: Entry) -> ArrayInfo:
        return cls(entry.key, tuple(entry.shape), entry.dtype, entry.nbytes)


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """A variable of a training state with its optimizer slots.

    Attributes:
        key: Its entry key.
        shape, dtype: Its shape (tuple of ints) and dtype name; from the contract or
            its first slot when the variable itself is not stored.
        stored: Whether the file holds its value (``model_state`` may leave it out).
        bytes: Bytes of its value (0 when not stored).
        trainable: Whether the contract lists it; ``None`` without a contract.
        slots: ``{slot name: ArrayInfo}`` (``"momentums"``, ``"velocities"``), in file order.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    stored: bool
    bytes: int
    trainable: bool | None
    slots: dict[str, ArrayInfo]


@dataclasses.dataclass(frozen=True)
class Member:
    """An archive member: ``name`` and its size in ``bytes`` (uncompressed)."""

    name: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something found wrong while listing the file: ``where`` (key or member) and ``problem``."""

    where: str
    problem: str


@dataclasses.dataclass(frozen=True)
class RecordInspection(_Json):
    """What a keras_stable_state training-state file holds (``inspect``).

    Attributes:
        file: The path. kind: ``"keras_stable_state"``.
        container: ``".keras archive"`` or ``".h5 file"``.
        format_version: The record's format version (int).
        metadata: The writer's metadata (``backend``, ``keras_version``, ``dtype_policy``, ...).
        counts: ``{section: number of arrays}`` for ``model``, ``optimizer``, ``state``.
        bytes: Bytes of array data.
        variables: `VariableInfo` per variable, slots grouped under it.
        optimizer_globals: The optimizer's own variables (``optimizer#iteration``), as `ArrayInfo`.
        contract: ``[key, shape, dtype]`` lists, or ``None``.
        schedule: The saved learning-rate schedule config, or ``None``.
        callbacks: ``{callback key: its state}``.
        position: ``{epoch, step, global_step, epoch_rng_saved}`` as far as saved, or ``None``.
        providers: ``{provider name: state}``; ``position`` summarized as above.
        rng_saved: Whether the random state was saved.
        arrays: The other state's arrays, as `ArrayInfo`.
        archive_members: `Member` per archive member (``[]`` for ``.h5``).
        problems: `Problem` per problem found (archive members failing their CRC-32).
    """

    file: str
    kind: str
    container: str
    format_version: int
    metadata: dict[str, Any]
    counts: dict[str, int]
    bytes: int
    variables: list[VariableInfo]
    optimizer_globals: list[ArrayInfo]
    contract: list[list[Any]] | None
    schedule: dict[str, Any] | None
    callbacks: dict[str, Any]
    position: dict[str, Any] | None
    providers: dict[str, Any]
    rng_saved: bool
    arrays: list[ArrayInfo]
    archive_members: list[Member]
    problems: list[Problem]

    @property
    def describe(self) -> str:
        """One line: what the file is and who wrote it."""
        return describe(self.kind, self.container, self.metadata)


@dataclasses.dataclass(frozen=True)
class StockWeight:
    """A model weight of a stock Keras file; ``key`` and ``path`` are its HDF5 path."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    path: str


@dataclasses.dataclass(frozen=True)
class StockOptimizerVariable:
    """An optimizer variable of a stock Keras file.

    Attributes:
        key, path: Its HDF5 path (``"optimizer/vars/3"``).
        shape, dtype, bytes: As in `ArrayInfo`.
        index: Its position in ``optimizer.variables``.
        entry_key: The key a ``StableOptimizer`` stored beside it, or ``None``.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    index: int
    path: str
    entry_key: str | None


@dataclasses.dataclass(frozen=True)
class StockOptimizer:
    """``count`` variables; ``positional`` unless a ``StableOptimizer`` stored their keys."""

    count: int
    positional: bool
    variables: list[StockOptimizerVariable]


@dataclasses.dataclass(frozen=True)
class StockInspection(_Json):
    """What a stock Keras ``.keras`` / ``.weights.h5`` file holds (``inspect``).

    Attributes:
        file: The path. kind: ``"stock"``.
        container: ``".keras archive"``, ``".h5 file"`` or ``".weights.h5 file"``.
        keras_metadata: Keras' ``metadata.json`` (archives), else ``None``.
        model_class: The model's class name from ``config.json``, or ``None``.
        counts: ``{"model": n, "optimizer": n}``.
        bytes: Bytes of array data.
        model: `StockWeight` per model weight, by HDF5 path.
        optimizer: `StockOptimizer`.
        note: What restoring its optimizer state means (positional or keyed).
        archive_members, problems: As in `RecordInspection`.
    """

    file: str
    kind: str
    container: str
    keras_metadata: dict[str, Any] | None
    model_class: str | None
    counts: dict[str, int]
    bytes: int
    model: list[StockWeight]
    optimizer: StockOptimizer
    note: str
    archive_members: list[Member]
    problems: list[Problem]

    @property
    def describe(self) -> str:
        """One line: what the file is and who wrote it."""
        return describe(self.kind, self.container, self.keras_metadata or {})


@dataclasses.dataclass(frozen=True)
class Damage:
    """A damaged array or member: ``key`` (or member name, or the file) and ``reason``."""

    key: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Verification(_Json):
    """What ``verify`` found.

    Attributes:
        file: The path.
        kind: ``"keras_stable_state"`` or ``"stock"``; ``None`` when the file was refused on opening.
        ok: ``True`` when every array and archive member is intact.
        arrays_checked: Number of arrays read.
        checksums: Whether the arrays carry checksums (training states do, stock files do not);
            ``None`` when refused.
        bytes: Bytes of array data read; ``None`` when refused.
        damaged: `Damage` per damaged array, member or (when refused) the whole file.
        error: Why the file was refused on opening (seal, truncation, structure), else ``None``.
        counts: ``{section: number of arrays}``; ``None`` when refused.
        checksum: The checksum the arrays carry (``"xxh3-64"``, ``"CRC-32"``), else ``None``.
        archive_members: Number of archive members (0 for HDF5 files); ``None`` when refused.
    """

    file: str
    kind: str | None
    ok: bool
    arrays_checked: int
    checksums: bool | None
    bytes: int | None
    damaged: list[Damage]
    error: str | None = None
    counts: dict[str, int] | None = None
    checksum: str | None = None
    archive_members: int | None = None


def describe(kind: str, container: str, metadata: dict[str, Any]) -> str:
    """One line: what a file is and who wrote it (``"stock Keras .keras archive, Keras 3.15.1"``)."""
    if kind == RECORD_KIND:
        return (
            f"keras_stable_state training state ({container}), written by "
            f"{metadata.get('backend', '?')} / Keras {metadata.get('keras_version', '?')}"
        )
    version = metadata.get("keras_version")
    return f"stock Keras {container}" + (f", Keras {version}" if version else "")
