"""How a [`CheckpointManager`][keras_stable_state.CheckpointManager] restores (the work of its
``restore`` and ``restore_newest_with``): the newest readable checkpoint, each unreadable
one moved aside and the one before tried (`restore_newest`), or the checkpoint of a step or
the best (`restore`); each checkpoint read once, and restored from that read."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import keras

from keras_stable_state import _core
from keras_stable_state._manager import checkin, directory, shared, timeline

if TYPE_CHECKING:
    from keras_stable_state._core.report import RestoreReport

# ``mgr`` below is a CheckpointManager (not imported: manager imports this module).
CheckpointManager = Any


def restore(
    mgr: CheckpointManager, model: keras.Model, step: int | str, options: _core.RestoreOptions
) -> RestoreReport | None:
    """`CheckpointManager.restore` once its arguments are checked, the lock taken and the
    background save collected: restore ``step`` (``"latest"``, ``"best"`` or an int) into
    ``model``; set ``restored_step``; ``None`` where no readable checkpoint is left."""
    mgr.restored_step = None
    if step == "latest":
        restored: dict[str, RestoreReport] = {}

        def restore_record(path: str, record: Any) -> None:
            # the record was read for this restore alone: its arrays may become the variables'
            restored["report"] = _restore_now(path, model, options, record)

        path = restore_newest(mgr, restore_record, in_place=_reads_in_place(options, model))
        if mgr.skipped_checkpoints:
            where = "none" if path is None else f"step {directory.step_of(path)}"
            directory.warn_unreadable(
                mgr.directory, mgr.skipped_checkpoints, mgr.moved_checkpoints, path, where, mgr.name, 3
            )  # attributed to the caller of CheckpointManager.restore
        if path is None:
            mgr._say(f"no readable checkpoint in {mgr.directory}")
            return None
        report = restored["report"]
    else:
        number = step if isinstance(step, int) else mgr.best_step()  # an int, or "best"
        if number is None:
            raise _no_best(mgr)
        path = mgr._path(number)
        report = _restore_now(path, model, options, timeline.read_named(mgr, path))
    mgr.restored_step = directory.step_of(path)
    mgr._timeline_from, mgr._last_saved = mgr.restored_step, None
    checkin.restored(mgr, path, options.state)  # says so; warns for another world size
    return report


def restore_newest(
    mgr: CheckpointManager,
    restore: Callable[[str, Any], None],
    unreadable: Callable[[str, BaseException], None] | None = None,
    *,
    read_only: bool = False,
    in_place: bool = False,
) -> str | None:
    """`CheckpointManager.restore_newest_with` (see its docstring): the path restored, or
    ``None`` if no readable checkpoint is left."""
    if not read_only:
        mgr._ensure_locked()
    mgr._collect(wait=True)
    mgr.skipped_checkpoints, mgr.moved_checkpoints = [], []

    def moved(path: str, err: BaseException) -> None:
        if unreadable is not None:
            unreadable(path, err)
        mgr.skipped_checkpoints.append((path, str(err)))
        mgr.moved_checkpoints.append((path, shared.move_aside(mgr.files, path, mgr.name)))
        mgr._summaries.pop(path, None)

    paths = shared.checkpoints(mgr.files, mgr.directory)  # JAX: process 0's list; Torch: each rank's
    path = directory.restore_newest(
        paths,
        mgr.directory,
        restore,
        moved,
        mgr.name,
        read_with=lambda path: timeline.read_checked(mgr, path, in_place=in_place),
    )
    # the save after it continues its timeline (see CheckpointManager.save)
    mgr._timeline_from = None if path is None else directory.step_of(path)
    mgr._last_saved = None
    return cast("str | None", path)


def _reads_in_place(options: _core.RestoreOptions, model: keras.Model) -> bool:
    """Whether the newest checkpoint is read as for a restore in place: ``all_or_nothing=False``,
    or (all or nothing, the rollback copy on the host) a model on an accelerator."""
    return not options.all_or_nothing or _core.host_rollback.on_accelerator(model)


def _restore_now(path: str, model: keras.Model, options: _core.RestoreOptions, record: Any) -> RestoreReport:
    """Restore ``record`` (read from ``path`` for this restore alone: its arrays may become the
    variables') into ``model``."""
    return cast(  # without defer, restore_with restores now: a RestoreReport
        "RestoreReport", _core.restore_with(path, model, options, record=record, take=True)
    )


def _no_best(mgr: CheckpointManager) -> FileNotFoundError:
    """The error of ``restore(step="best")`` where no checkpoint has a finite ``monitor`` value."""
    return FileNotFoundError(
        errno.ENOENT,
        f"No checkpoint in {mgr.directory!r} has a finite {mgr.monitor!r} metric (its "
        f"steps are {mgr.all_steps()}): there is no best to restore.",
        mgr.directory,
    )
