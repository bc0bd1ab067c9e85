"""The run a [`CheckpointManager`][keras_stable_state.CheckpointManager] directory holds: each
checkpoint's step from its sealed record (a file whose name names another step is no
checkpoint of that step), and its timeline: the save after a rollback moves the abandoned
checkpoints into `ABANDONED_DIR`; a save at or below the newest step by a manager that did
not restore from the directory is refused (see ``CheckpointManager.save``)."""

from __future__ import annotations

from typing import Any

from keras_stable_state import _keras_compat, _processes
from keras_stable_state._manager import directory, orbax_io, policy, shared
from keras_stable_state._manager.records import RECORD, check_named_step, record_of
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format.proven import close_files

# ``mgr`` below is a CheckpointManager (not imported: manager imports this module).
CheckpointManager = Any
ABANDONED_DIR = directory.ABANDONED_DIR
MISNAMED_KEY = f"providers/{RECORD}/step"
"""The ``key`` of the ``CheckpointFormatError`` of a misnamed checkpoint (`check_named_step`)."""


def summary(mgr: CheckpointManager, path: str) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """``(metadata, manager record, format version)`` of the checkpoint ``path`` of ``mgr``'s
    directory, read once per written file (cached by its `identity`)."""
    key = mgr.files.identity(path)
    cached = mgr._summaries.get(path)
    if cached is not None and key is not None and cached[0] == key:
        return cached[1]
    metadata, extra, version = mgr.files.read_summary(path)
    found = (metadata, record_of(extra), version)
    mgr._summaries[path] = (key, found)
    return found


def steps_by_path(mgr: CheckpointManager) -> dict[str, int]:
    """``{path: step}`` of the checkpoints of ``mgr``'s directory: each from its sealed
    record; a damaged one by its name; a misnamed one (its record names another step)
    left out."""
    steps = {}
    for path in mgr.checkpoints():
        try:
            steps[path] = check_named_step(path, summary(mgr, path)[1])
        except CheckpointFormatError as err:
            if err.key != MISNAMED_KEY:
                steps[path] = directory.step_of(path)  # damaged, unreadable: by its name
        except (CorruptCheckpointError, OSError):
            steps[path] = directory.step_of(path)  # damaged, unreadable: by its name
    return steps


def best_steps(mgr: CheckpointManager, paths: list[str], count: int) -> list[int]:
    """The ``count`` best steps of ``paths`` by ``mgr``'s monitor, from their sealed records
    (an unreadable, misnamed or removed one is never the best)."""
    scores = {}
    for path in paths:
        try:
            _, record, _ = summary(mgr, path)
            scores[check_named_step(path, record)] = policy.score(
                record.get("metrics"), mgr.monitor, mgr._direction
            )
        except (CorruptCheckpointError, CheckpointFormatError, OSError):
            continue
    return policy.best_steps(scores, count)


def prune(mgr: CheckpointManager, newest: str | None) -> list[str]:
    """`CheckpointManager.prune`: remove every checkpoint but the latest ``max_to_keep``
    (``newest``, a path, among them) and the best ``keep_best``; the paths removed."""
    if mgr.max_to_keep is None:
        return []
    # by the step of each record; a file whose record names another step is neither
    # counted nor removed (the next restore moves it aside)
    steps = steps_by_path(mgr)
    paths = sorted(steps, key=lambda path: steps[path], reverse=True)
    newest_step = None if newest is None else directory.step_of(newest)
    best = best_steps(mgr, paths, mgr.keep_best) if mgr.keep_best else []
    kept = policy.kept_steps([steps[p] for p in paths], newest_step, mgr.max_to_keep, best)
    removed = [p for p in paths if steps[p] not in kept]
    mgr.files.remove(removed)
    for path in removed:
        mgr._summaries.pop(path, None)
    return removed


def before_save(mgr: CheckpointManager, step: int, new_timeline: bool) -> None:
    """Before ``mgr`` saves ``step``: start a new timeline (the abandoned checkpoints moved
    into ``abandoned/``, said in a line), or refuse (see ``CheckpointManager.save``).

    Raises:
        StateError: for a step at or below the newest, from a manager that did not restore,
            without ``new_timeline``; naming the steps present and the choices.
    """
    start, last = mgr._timeline_from, mgr._last_saved

    def plan() -> dict[str, Any]:  # on process 0, which alone moves files; its answer goes to all
        steps = steps_by_path(mgr)
        latest = max(steps.values(), default=None)
        if latest is None or step > latest or (step == latest == last and start is None):
            return {"moved": []}
        if start is None and not new_timeline:
            return {"refuse": sorted(steps.values())}
        cut = step if new_timeline else min(start + 1, step)
        moved = []
        for path, found in sorted(steps.items(), key=lambda item: item[1]):
            if found >= cut:
                target = mgr.files.move_aside(path, mgr.name, folder=ABANDONED_DIR)
                mgr._summaries.pop(path, None)
                moved.append([path, target, found])
        return {"moved": moved}

    with _processes.on_primary(mgr.directory, share=True) as turn:
        if turn.runs:
            turn.result = plan()
    found = turn.result
    if "refuse" in found:
        present = found["refuse"]
        raise StateError(
            f"{mgr.name}({mgr.directory!r}) refuses to save step {step}: the directory already holds "
            f"steps {present} (the newest {present[-1]}), and this manager did not restore from it (they "
            f"are another run's, or an earlier part of this one). Saved among them, step {step} would not "
            f"be the latest, and the next resume would load step {present[-1]}. Do one of: restore first "
            "(mgr.restore(model), or restore(model, step=N) to roll back to step N) and save on from "
            "there; save into another directory; or pass save(..., new_timeline=True) to start a new "
            f"timeline at step {step}: the checkpoints at or after it are moved into "
            f"{ABANDONED_DIR}/ (kept, never deleted).",
            key=None,
            expected=f"a step after {present[-1]}",
            received=step,
        )
    mgr._timeline_from = None
    moved = found["moved"]
    if moved:
        mgr.abandoned_checkpoints.extend((path, target) for path, target, _ in moved)
        why = "new_timeline=True" if new_timeline else f"step {start} was restored"
        _keras_compat.print_msg(
            f"{mgr.name}: step {step} starts a new timeline in {mgr.directory} ({why}): the "
            f"checkpoints of the abandoned one, steps {[s for _, _, s in moved]}, were moved into "
            f"{ABANDONED_DIR}/ (kept: {[t for _, t, _ in moved]}). Move them back (and these away) "
            "to go on with that timeline."
        )


def read_checked(mgr: CheckpointManager, path: str, *, in_place: bool = False) -> Any:
    """The record of ``path``, once its name and record agree on its step (else the
    ``CheckpointFormatError`` of `check_named_step`: the fallback moves it aside, and the file
    a record read in place holds open is closed). ``in_place``: a local checkpoint is read for
    a restore in place (`orbax_io.read_from`: its large arrays left in the open file)."""
    record = shared.read_agreed(path, lambda p: orbax_io.read_from(mgr.files, p, in_place=in_place))
    try:
        check_named_step(path, record_of(record.extra))
    except BaseException:
        close_files(record)
        raise
    return record


def read_named(mgr: CheckpointManager, path: str) -> Any:
    """`read_checked`, moving a misnamed checkpoint into ``unreadable/`` before its error
    (a restore of an int step or ``"best"``: no fallback)."""
    try:
        return read_checked(mgr, path)
    except CheckpointFormatError as err:
        if err.key != MISNAMED_KEY:
            raise
        target = shared.move_aside(mgr.files, path, mgr.name)
        mgr._summaries.pop(path, None)
        mgr.moved_checkpoints = [(path, target)]
        mgr.skipped_checkpoints = [(path, str(err))]
        raise CheckpointFormatError(
            f"{err} {mgr.name} moved it to {target!r}.",
            key=err.key,
            expected=err.expected,
            received=err.received,
        ) from None
