"""What ``ls`` finds in a checkpoint directory (a ``StableCheckpoint`` or
``CheckpointManager`` folder); no printing here.

The directory is read with the manager's own readers (``_manager.directory``'s
``LocalDirectory``, or ``_manager.remote_directory``'s ``RemoteDirectory`` for an object
store: which files are checkpoints, their steps, the summary of each; ``_manager.policy``:
the best by a metric), which import no Keras. Which checkpoint ``fit`` (or
``CheckpointManager.restore(step="latest")``) would resume from follows the manager's
rule (``directory.restore_newest``): the newest checkpoint that reads whole with every
check; a damaged or unreadable one is skipped (the manager moves it to ``unreadable/``);
one of a newer format, in use by another process, or that cannot be opened stops the
resume with its error. Nothing in the directory is changed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from keras_stable_state import format
from keras_stable_state._manager import orbax_steps, policy, records
from keras_stable_state._manager.directory import (
    TEMP_PREFIX,
    UNREADABLE_DIR,
    LocalDirectory,
    read_summary,
    step_of,
)
from keras_stable_state._manager.protocols import CheckpointDirectory
from keras_stable_state._manager.records import RECORD
from keras_stable_state.cli.results import to_json
from keras_stable_state.errors import (
    CheckpointFormatError,
    CheckpointInUseError,
    CorruptCheckpointError,
    NewerFormatError,
)
from keras_stable_state.format import urls
from keras_stable_state.format.files import fs_path
from keras_stable_state.format.summary import read_summary_whole

__all__ = ["STATUSES", "CheckpointRow", "Listing", "list_directory"]

STATUSES = ("ok", "damaged", "unreadable", "misnamed", "newer_format", "in_use", "incomplete")
"""A checkpoint's ``status``: ``ok`` (reads with every check), ``damaged`` (bytes wrong: a
seal, checksum or structure fails, truncated), ``unreadable`` (not a checkpoint file: a
FIFO, a link to nothing, a file of another kind, permission denied), ``misnamed`` (its sealed
record names another step than its file name: copied or renamed; the manager moves it aside
and never restores it as the step of its name), ``newer_format``
(written by a newer keras_stable_state), ``in_use`` (locked by another process),
``incomplete`` (a ``.kss-*`` temporary file of a save that did not finish)."""
_SKIPPED = ("damaged", "unreadable", "misnamed")  # fit moves these aside and tries the one before


@dataclasses.dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint of a directory.

    Attributes:
        step: Its step, from its sealed record (for a ``misnamed`` one, the step its record
            names, ``None`` if none); from its name ``ckpt-<step>.h5`` where the record
            cannot be read; ``None`` for an incomplete save.
        file: Its path.
        status: One of `STATUSES`.
        reason: Why it is not ``ok`` (the error's message), else ``None``.
        size_bytes: Its size on disk, or ``None`` if it cannot be read.
        epoch, metrics, wall_time: What the manager recorded with it (``None``, ``{}``
            for a checkpoint that is not ``ok`` or was saved without them).
        backend: The Keras backend that wrote it, or ``None``.
        world_size: The number of processes that saved it (JAX processes, Torch ranks), or
            ``None`` (not ``ok``, or saved by an older version).
        format_version: Its format version, or ``None``.
        verified: Whether every array was read and checked (the one ``fit`` would resume
            always is; the others with ``--verify``).
        resume: Whether ``fit`` would resume from it.
        best: Whether it is the best by the monitor.
    """

    step: int | None
    file: str
    status: str
    reason: str | None
    size_bytes: int | None
    epoch: int | None
    metrics: dict[str, Any]
    wall_time: float | None
    backend: str | None
    world_size: int | None
    format_version: int | None
    verified: bool
    resume: bool
    best: bool


@dataclasses.dataclass(frozen=True)
class Listing:
    """What ``ls`` found.

    Attributes:
        directory: The directory.
        checkpoints: `CheckpointRow` per checkpoint, newest first (incomplete saves last).
        resume_step: The step ``fit`` would resume from, or ``None``.
        resume: One sentence: what ``fit`` would do (resume from a step, start fresh, or stop
            with an error, naming the checkpoint).
        monitor: The metric that ranks checkpoints (``--monitor``, else the one the manager
            recorded), or ``None``.
        mode: ``"min"`` or ``"max"`` (the direction of ``monitor``), or ``None``.
        best_step: The best step by ``monitor`` among the readable checkpoints, or ``None``.
        notes: Sentences on what else was found (files moved to ``unreadable/``, no monitor).
    """

    directory: str
    checkpoints: list[CheckpointRow]
    resume_step: int | None
    resume: str
    monitor: str | None
    mode: str | None
    best_step: int | None
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document: `to_json` of this dataclass."""
        doc: dict[str, Any] = to_json(self)
        return doc


def _status(err: BaseException) -> str:
    if isinstance(err, NewerFormatError):
        return "newer_format"
    if isinstance(err, CheckpointInUseError):
        return "in_use"
    if isinstance(err, CorruptCheckpointError):
        return "damaged"
    return "unreadable"


_Summary = tuple[dict[str, Any], dict[str, Any], int | None]


def _summary(
    path: str, full: bool, reader: CheckpointDirectory
) -> tuple[str, str | None, _Summary | None] | None:
    """``(status, reason, summary or None)`` of ``path``; ``None`` if it was removed meanwhile.
    ``reader``: the directory's (a ``LocalDirectory``, or a ``RemoteDirectory`` for an object store)."""
    summary: _Summary | None
    try:
        if not reader.local:  # an object store: the marker's summary; the object read whole
            summary = reader.read_summary(path)
            if full:
                format.read_file(path, storage_options=reader.storage_options)
        elif full:  # what the manager's restore reads: every array, every check (one open)
            summary = read_summary_whole(path) if not orbax_steps.is_step(path) else None
            if summary is None:
                format.read_file(path)
                summary = read_summary(path)
        else:
            summary = read_summary(path)
    except FileNotFoundError as err:
        if urls.is_remote(path):
            return None
        if os.path.islink(path):
            return "unreadable", str(err), None  # a link to nothing: the manager moves it aside
        if os.path.lexists(path):
            return "unreadable", str(err), None
        return None
    except (CorruptCheckpointError, CheckpointFormatError, CheckpointInUseError, OSError) as err:
        return _status(err), str(err), None
    return "ok", None, summary


def _row(
    step: int | None,
    path: str,
    status: str,
    reason: str | None,
    summary: _Summary | None,
    verified: bool,
    size: int | None,
    reader: CheckpointDirectory,
) -> dict[str, Any]:
    metadata, extra, version = summary if summary is not None else ({}, {}, None)
    record = (extra.get("providers") or {}).get(RECORD)
    record = record if isinstance(record, dict) else {}
    epoch = record.get("epoch")
    wall = record.get("wall_time")
    world = record.get("world_size")
    world = world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None
    if size is None:
        try:
            size = reader.size_of(path)
        except OSError:
            size = None
    return {
        "step": step,
        "file": path,
        "status": status,
        "reason": reason,
        "size_bytes": size,
        "epoch": epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        "metrics": dict(record.get("metrics") or {}) if isinstance(record.get("metrics"), dict) else {},
        "wall_time": float(wall) if isinstance(wall, int | float) and not isinstance(wall, bool) else None,
        "backend": metadata.get("backend"),
        "world_size": world,
        "format_version": version,
        "verified": verified,
        "monitor": record.get("monitor"),
        "mode": record.get("mode"),
    }


def _resume(rows: list[dict[str, Any]]) -> tuple[str | None, int | None, str]:
    """``(resume file or None, its step, sentence)``: the manager's rule over ``rows`` (newest
    first)."""
    skipped: list[int | None] = []
    for row in rows:
        if row["status"] == "incomplete":
            continue
        if row["status"] == "ok":
            after = f" (after skipping {len(skipped)} unreadable: {skipped})" if skipped else ""
            return row["file"], row["step"], f"fit resumes from step {row['step']} ({row['file']}){after}."
        if row["status"] in _SKIPPED:
            skipped.append(step_of(row["file"]))  # by name: what the user sees in the folder
            continue
        return (
            None,
            None,
            (
                f"fit stops at step {row['step']} ({row['file']}, {row['status'].replace('_', ' ')}): it does not "
                f"fall back past it. {row['reason']}"
            ),
        )
    if skipped:
        return (
            None,
            None,
            f"fit starts fresh: no readable checkpoint (unreadable: {skipped}; fit moves them aside).",
        )
    return None, None, "fit starts fresh: the directory holds no checkpoint."


def _direction(monitor: str | None, mode: str | None, notes: list[str]) -> str | None:
    if monitor is None:
        return None
    if mode in ("min", "max"):
        return mode
    try:
        return policy.direction_of(monitor)
    except ValueError as err:
        notes.append(f"No best: {err}")
        return None


def list_directory(
    directory: str | os.PathLike[str],
    *,
    verify: bool = False,
    monitor: str | None = None,
    mode: str | None = None,
) -> Listing:
    """List the checkpoints of a ``StableCheckpoint`` / ``CheckpointManager`` directory.

    Args:
        directory: The folder (``ckpt-<step>.h5`` files).
        verify: Read and check every array of every checkpoint (by default only of the
            one ``fit`` would resume; the others are opened, their seal checked).
        monitor: The metric ranking checkpoints for the best; default the ``monitor`` the
            manager recorded with the newest readable checkpoint.
        mode: ``"min"``, ``"max"``, or ``None`` / ``"auto"`` (as the manager infers it).

    Returns:
        A `Listing`.

    Raises:
        FileNotFoundError: if ``directory`` does not exist (no object under the URL).
        NotADirectoryError: if it is not a folder (an object).
        StorageError: if the object store fails, naming the URL.
        StorageBackendError: for a URL whose fsspec implementation is not installed.
    """
    path = urls.resolve(fs_path(directory, "directory", urls=True), "directory")
    if urls.is_remote(path):
        return _list_remote(path, verify, monitor, mode)
    path = fs_path(path, "directory")
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"{path}: no such directory. Check the path.", path)
    if not os.path.isdir(path):
        raise NotADirectoryError(
            20, f"{path} is a file, not a checkpoint directory; `inspect` and `verify` read one file.", path
        )
    local = LocalDirectory(path)
    rows = _rows(local.checkpoints(), verify, local)
    with os.scandir(path) as entries:
        temporary = sorted(e.path for e in entries if e.name.startswith(TEMP_PREFIX))
    moved = os.path.join(path, UNREADABLE_DIR)
    aside = sorted(os.listdir(moved)) if os.path.isdir(moved) and not os.path.islink(moved) else []
    return _listing(path, rows, temporary, moved, aside, monitor, mode, local)


def _rows(ckpts: list[str], verify: bool, reader: CheckpointDirectory) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    decided = False
    for ckpt in ckpts:
        # until the one fit would resume is found, each is read whole, as the manager does
        # (one open); the others' records only (seal and records checked)
        verified = verify or not decided
        found = _summary(ckpt, full=verified, reader=reader)
        if found is None:
            continue  # removed since it was listed
        status, reason, summary = found
        step = step_of(ckpt)
        if summary is not None:
            record = records.record_of(summary[1])
            step = records.recorded_step(record)
            try:
                records.check_named_step(ckpt, record)
            except CheckpointFormatError as err:
                status, reason = "misnamed", str(err)
        if status not in _SKIPPED:
            decided = True
        rows.append(_row(step, ckpt, status, reason, summary, verified, None, reader))
    return rows


def _list_remote(url: str, verify: bool, monitor: str | None, mode: str | None) -> Listing:
    """`list_directory` of a directory in an object store: its committed checkpoints (those
    whose commit marker names them), read as the manager reads them; objects without a
    marker (an interrupted save) as incomplete, checkpoints whose marker does not match as
    damaged."""
    from keras_stable_state._manager.remote_directory import RemoteDirectory, survey

    reader = RemoteDirectory(url)
    if reader.folder.path and reader.folder.is_object():
        raise NotADirectoryError(
            20,
            f"{url} is an object, not a checkpoint directory; `inspect` and `verify` read one object.",
            url,
        )
    found = survey(reader)
    if not found.sizes:
        raise FileNotFoundError(2, f"{url}: no objects under this URL. Check the URL.", url)
    rows = _rows(found.committed, verify, reader)
    for ckpt, reason in found.damaged:
        rows.append(_row(step_of(ckpt), ckpt, "damaged", reason, None, False, found.sizes[ckpt], reader))
    rows.sort(key=lambda r: -(r["step"] or 0))
    aside = reader.folder.child(UNREADABLE_DIR)
    return _listing(
        url, rows, found.incomplete, aside.url, aside.list(), monitor, mode, reader, sizes=found.sizes
    )


def _listing(
    path: str,
    rows: list[dict[str, Any]],
    temporary: list[str],
    moved: str,
    aside: list[str],
    monitor: str | None,
    mode: str | None,
    reader: CheckpointDirectory,
    sizes: dict[str, int] | None = None,
) -> Listing:
    for tmp in temporary:
        rows.append(
            _row(
                None,
                tmp,
                "incomplete",
                "a save that did not finish (removed by the next writer)",
                None,
                False,
                None if sizes is None else sizes[tmp],
                reader,
            )
        )
    resume_file, resume_step, resume = _resume(rows)
    notes: list[str] = []
    recorded = next((r for r in rows if r["status"] == "ok" and r["monitor"]), None)
    if monitor is None and recorded is not None:
        monitor, mode = recorded["monitor"], mode or recorded["mode"]
    direction = _direction(monitor, mode, notes)
    best_step = None
    if direction is not None and monitor is not None:  # a direction implies a monitor
        scores = {
            r["step"]: policy.score(r["metrics"], monitor, direction) for r in rows if r["status"] == "ok"
        }
        best = policy.best_steps(scores, 1)
        best_step = best[0] if best else None
        if best_step is None:
            notes.append(f"No checkpoint has a finite {monitor!r} metric: there is no best.")
    elif monitor is None:
        notes.append("No monitor recorded: pass --monitor NAME (e.g. val_loss) to name the best.")
    if aside:
        notes.append(f"{len(aside)} unreadable checkpoint(s) moved aside earlier in {moved}: {aside}")
    checkpoints = [
        CheckpointRow(
            **{k: v for k, v in r.items() if k not in ("monitor", "mode")},
            resume=r["file"] == resume_file,
            best=r["status"] == "ok" and r["step"] is not None and r["step"] == best_step,
        )
        for r in rows
    ]
    return Listing(path, checkpoints, resume_step, resume, monitor, direction, best_step, notes)
