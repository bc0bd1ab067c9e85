"""What ``inspect`` and ``verify`` find in a file; no printing here.

`inspect_file` returns a `RecordInspection`
(a keras_stable_state training state) or a
`StockInspection` (a stock Keras file), and
`verify_file` a `Verification`. Each has
``to_json()``, the document ``--json`` prints: ``dataclasses.asdict`` with tuples as
lists, NumPy scalars as Python numbers and non-finite floats as strings (``"nan"``).

Files are read through `keras_stable_state.format` (h5py and NumPy,
never Keras); ``inspect`` reads no array data, ``verify`` reads each array once.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_stable_state import format
from keras_stable_state._identity.keys import GLOBAL, split_entry_key
from keras_stable_state.cli.results import (
    ArrayInfo,
    Damage,
    DamagedArray,
    Member,
    Problem,
    RecordInspection,
    StockInspection,
    StockOptimizer,
    StockOptimizerVariable,
    StockWeight,
    VariableInfo,
    Verification,
)
from keras_stable_state.errors import CorruptCheckpointError
from keras_stable_state.format import orbax_layout, urls
from keras_stable_state.format.files import fs_path
from keras_stable_state.format.layout import Layout

__all__ = [
    "Verification",
    "bytes_to_verify",
    "damaged_array",
    "inspect_file",
    "max_abs_difference",
    "open_checkpoint",
    "open_checkpoint_or_damage",
    "position",
    "positional_note",
    "refused",
    "verify_file",
]

_POSITION_FIELDS = ("epoch", "step", "global_step")


def open_checkpoint(path: str | os.PathLike[str]) -> Layout:
    """`keras_stable_state.format.open_file`, refusing a missing path or a folder first;
    a ``.orbax`` training-state folder opens as an
    `OrbaxFile` (its arrays read with TensorStore).

    An object-store URL (``s3://bucket/run.h5``) is downloaded whole through fsspec (its
    configuration and the store's environment variables, e.g. ``AWS_ENDPOINT_URL``,
    apply); a ``file://`` URL is the local path it names.

    Raises:
        FileNotFoundError: if ``path`` does not exist (or no object is at the URL).
        IsADirectoryError: if ``path`` is a folder (but a ``*.orbax`` one).
        StorageBackendError: for a URL whose fsspec implementation is not installed.
        The errors of `keras_stable_state.format.open_file` otherwise.
    """
    path = fs_path(path, "path", urls=True)
    if urls.is_remote(path):
        return format.open_file(path)
    path = fs_path(path, "path")
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"{path}: no such file. Check the path.", path)
    if os.path.isdir(path) and not orbax_layout.is_orbax_path(path):
        raise IsADirectoryError(
            errno.EISDIR,
            f"{path} is a folder. Pass one .keras or .h5 file or a .orbax folder (`keras-stable-state "
            "ls` lists a checkpoint directory: StableCheckpoint keeps ckpt-<step>.h5 files in its folder).",
            path,
        )
    return format.open_file(path)


def open_checkpoint_or_damage(path: str | os.PathLike[str]) -> Layout | Verification:
    """`open_checkpoint`, or the `Verification` of a file refused on opening as
    damaged (a ``CorruptCheckpointError``: truncated, failing its seal or structure checks).

    Raises:
        The other errors of `open_checkpoint` (the path cannot be read or is not a
        checkpoint file: not damage).
    """
    try:
        return open_checkpoint(path)
    except CorruptCheckpointError as err:
        return refused(path, err)


def damaged_array(found: DamagedArray) -> CorruptCheckpointError:
    """The error of an array ``diff`` could not read (a `DamagedArray`)."""
    return CorruptCheckpointError(found.reason, key=found.key)


def _members(f: Layout) -> list[Member]:
    return [Member(n, s) for n, s in f.members]


def _problems(f: Layout) -> list[Problem]:
    return [Problem(w, p) for w, p in f.problems] + [
        Problem(m, f"zip CRC-32 fails ({r})") for m, r in f.damaged_members
    ]


def position(extra: dict[str, Any]) -> dict[str, Any] | None:
    """The saved training position of a record's other state, or ``None``.

    Returns:
        ``{epoch, step, global_step}`` as far as saved, plus ``epoch_rng_saved`` (bool) when
        the epoch's shuffle RNG field exists.
    """
    pos = (extra.get("providers") or {}).get("position")
    if not isinstance(pos, dict):
        return None
    out = {k: pos[k] for k in _POSITION_FIELDS if k in pos}
    if "epoch_rng" in pos:
        out["epoch_rng_saved"] = pos["epoch_rng"] is not None
    return out


def _variables(f: Layout) -> tuple[list[VariableInfo], list[ArrayInfo]]:
    """Group a record's arrays by variable: ``([VariableInfo], [ArrayInfo of optimizer globals])``."""
    contract = {k: (tuple(s), d) for k, s, d in (f.contract or [])}
    rows: dict[str, dict[str, Any]] = {}
    for e in f.section("model"):
        rows[e.key] = {"entry": e, "slots": {}}
    globals_: list[ArrayInfo] = []
    for e in f.section("optimizer"):
        owner, slot = split_entry_key(e.key)
        if not owner or owner == GLOBAL or owner.startswith(f"{GLOBAL}/"):
            globals_.append(ArrayInfo.of(e))
            continue
        rows.setdefault(owner, {"entry": None, "slots": {}})["slots"][slot] = ArrayInfo.of(e)
    variables: list[VariableInfo] = []
    for key, row in rows.items():
        entry, slots = row["entry"], row["slots"]
        if entry is not None:
            shape, dtype = tuple(entry.shape), entry.dtype
        elif key in contract:
            shape, dtype = contract[key]
        else:
            first = next(iter(slots.values()))
            shape, dtype = first.shape, first.dtype
        variables.append(
            VariableInfo(
                key=key,
                shape=shape,
                dtype=dtype,
                stored=entry is not None,
                bytes=entry.nbytes if entry is not None else 0,
                trainable=None if f.contract is None else key in contract,
                slots=slots,
            )
        )
    return variables, globals_


def _inspect_record(f: Layout) -> RecordInspection:
    variables, globals_ = _variables(f)
    return RecordInspection(
        file=f.path,
        kind=f.kind,
        container=f.container,
        format_version=int(f.metadata.get("format_version", format.FORMAT_VERSION)),
        metadata=f.metadata,
        counts={s: len(f.section(s)) for s in format.SECTIONS},
        bytes=f.total_bytes,
        variables=variables,
        optimizer_globals=globals_,
        contract=f.contract,
        schedule=(f.extra.get("schedule") or {}).get("schedule"),
        callbacks=f.extra.get("callbacks") or {},
        position=position(f.extra),
        providers={
            name: (position(f.extra) if name == "position" else value)
            for name, value in (f.extra.get("providers") or {}).items()
        },
        rng_saved=f.extra.get("rng") is not None,
        arrays=[ArrayInfo.of(e) for e in f.section("state")],
        archive_members=_members(f),
        problems=_problems(f),
    )


def positional_note(keyed: bool, count: int) -> str:
    """What restoring ``count`` optimizer variables of a stock file means (``keyed``: by StableOptimizer keys)."""
    if keyed:
        return (
            f"Optimizer state is KEYED: the optimizer was a StableOptimizer, which stored the entry key "
            f"of each of its {count} variables beside them; keras.saving.load_model and restore_training_state "
            "match them by key."
        )
    if not count:
        return "The file holds no optimizer state."
    return (
        f"Optimizer state is POSITIONAL: its {count} variables are stored as '0'..'{count - 1}' in "
        "optimizer.variables order, with no keys. Keras restores them by registration order and checks "
        "only their count, so a model whose trainable variables come out in another order gets slots "
        "silently swapped between same-shape variables. restore_training_state matches them by order "
        "with shape checks and reports each as matched 'by order'; save with "
        "keras_stable_state.save_training_state to store them by key."
    )


def _inspect_stock(f: Layout) -> StockInspection:
    model, opt = f.section("model"), f.section("optimizer")
    keys = f.optimizer_keys
    return StockInspection(
        file=f.path,
        kind=f.kind,
        container=f.container,
        keras_metadata=f.metadata or None,
        model_class=f.model_class,
        counts={"model": len(model), "optimizer": len(opt)},
        bytes=f.total_bytes,
        model=[StockWeight(e.key, tuple(e.shape), e.dtype, e.nbytes, e.key) for e in model],
        optimizer=StockOptimizer(
            count=len(opt),
            positional=not keys,
            variables=[
                StockOptimizerVariable(e.key, tuple(e.shape), e.dtype, e.nbytes, i, e.key, keys.get(e.key))
                for i, e in enumerate(opt)
            ],
        ),
        note=positional_note(bool(keys), len(opt)),
        archive_members=_members(f),
        problems=_problems(f),
    )


def inspect_file(
    file: str | os.PathLike[str] | Layout,
) -> RecordInspection | StockInspection:
    """List what a file holds without reading its array data.

    Args:
        file: A path (``str`` or ``os.PathLike``) to a ``.keras`` or ``.h5`` file or a
            ``.orbax`` folder, or a `Layout` that
            `keras_stable_state.format.open_file` opened (left open).

    Returns:
        A `RecordInspection` for a keras_stable_state training state, a
        `StockInspection` for a stock Keras file.

    Raises:
        The errors of `open_checkpoint` when ``file`` is a path.
    """
    if isinstance(file, str | bytes | os.PathLike):  # else a layout open_file opened
        with open_checkpoint(file) as f:
            return inspect_file(f)
    return _inspect_record(file) if file.kind == format.FORMAT else _inspect_stock(file)


def bytes_to_verify(f: Layout) -> int:
    """Bytes `verify_file` reads from an open file: its arrays and the other archive members."""
    return f.total_bytes + sum(size for name, size in f.members if name != f.member)


def refused(path: str | os.PathLike[str], err: BaseException) -> Verification:
    """The `Verification` of a file refused on opening as damaged with ``err`` (a
    ``CorruptCheckpointError``: seal, truncation, structure)."""
    path = fs_path(path, "path", urls=True)
    key = getattr(err, "key", None)
    return Verification(
        file=path,
        kind=None,
        ok=False,
        arrays_checked=0,
        checksums=None,
        bytes=None,
        damaged=[Damage(key if key is not None else path, str(err))],
        error=str(err),
    )


def verify_file(
    file: str | os.PathLike[str] | Layout,
    progress: Callable[[int], object] | None = None,
) -> Verification:
    """Read every array of a file (and every archive member) and check it.

    Args:
        file: A path (a ``.keras`` or ``.h5`` file, a ``.orbax`` folder), or a
            `Layout` that
            `keras_stable_state.format.open_file` opened (left open).
        progress: Optional callable given the bytes read after each array or member chunk
            (they add up to `bytes_to_verify`).

    Returns:
        A `Verification`; ``ok`` is ``False`` when anything is damaged, also when the
        file is refused on opening as damaged (truncated, failing its seal: ``error`` says why).

    Raises:
        FileNotFoundError, IsADirectoryError: for a missing path or a folder.
        CheckpointFormatError: if the path is not a checkpoint file (a FIFO, a device, a
            legacy Keras HDF5 file...): it cannot be read, which is not damage.
        NewerFormatError: (a ``CheckpointFormatError``) for a file of a newer keras_stable_state.
        CheckpointInUseError: if a writer holds the file locked.
        StateError: for a ``.orbax`` folder without TensorStore (the ``[orbax]`` extra).
    """
    if isinstance(file, str | bytes | os.PathLike):  # else a layout open_file opened
        try:
            f = open_checkpoint(file)
        except CorruptCheckpointError as err:
            # Opening runs the whole-file checks (seal, structure, records): the file is refused as a whole.
            return refused(file, err)
        with f:
            return verify_file(f, progress)
    f = file
    damaged = f.check(progress)
    return Verification(
        file=f.path,
        kind=f.kind,
        ok=not damaged,
        arrays_checked=len(f.entries),
        checksums=f.kind == format.FORMAT,
        bytes=f.total_bytes,
        damaged=[Damage(str(k), r) for k, r in damaged],
        counts={s: len(f.section(s)) for s in format.SECTIONS},
        checksum=f.checksum,
        archive_members=len(f.members),
    )


def max_abs_difference(a: Any, b: Any) -> float | None:
    """Largest ``|a - b|`` over all elements, computed in float64 (``bfloat16`` via ml_dtypes).

    Equal values (also equal infinities, and NaN against NaN) count as 0.

    Args:
        a, b: Arrays (or array-likes) of the same shape.

    Returns:
        A float (``nan`` or ``inf`` where only one side is), or ``None`` for
        non-numeric arrays, which are compared for equality only (``0.0`` if equal).
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 0:
        return 0.0
    kind = "c" if np.iscomplexobj(a) or np.iscomplexobj(b) else "f"
    try:
        a64 = a.astype(np.complex128 if kind == "c" else np.float64)
        b64 = b.astype(np.complex128 if kind == "c" else np.float64)
    except (TypeError, ValueError):
        return 0.0 if np.array_equal(a, b) else None
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a64 - b64)
        same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    return float(np.max(np.where(same, 0.0, d)))
