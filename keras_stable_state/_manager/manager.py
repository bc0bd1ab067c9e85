"""``CheckpointManager``: a directory of checkpoints for any training loop."""

from __future__ import annotations

import atexit
import errno
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_stable_state import _core, _keras_compat, _processes, format
from keras_stable_state._engines import background
from keras_stable_state._manager import checkin, lock, orbax_io, policy, restoring, timeline
from keras_stable_state._manager.directory import path_of
from keras_stable_state._manager.holder import DirectoryHolder
from keras_stable_state._manager.opening import open_directory
from keras_stable_state._manager.preemption import DEFAULT_SIGNALS, PreemptionGuard, entered_guard
from keras_stable_state._manager.records import (
    RECORD,
    CheckpointMetadata,
    ManagerRecord,
    check_metrics,
    check_named_step,
    check_save_keywords,
    check_step,
    metadata_of,
    saved_message,
)

if TYPE_CHECKING:
    from keras_stable_state._core.report import RestoreReport
    from keras_stable_state._engines.background import SaveHandle


_REPR_NAMES = ("directory", "max_to_keep", "keep_best", "monitor", "mode", "save_on_background")
_CONFIG_NAMES = (*_REPR_NAMES, "verbose", "storage_options")
_Info = dict[str, Any]  # the manager's record of a save: step, epoch, metrics, wall time...
# A checkpoint's (metadata, manager record, format version), read once per written file.
_Summary = tuple[dict[str, Any], _Info, "int | None"]

_PENDING: weakref.WeakSet[CheckpointManager] = (
    weakref.WeakSet()
)  # managers with a background save not yet collected
_AT_EXIT: list[bool] = []  # [True] once `_finish_at_exit` is registered


def _finish_at_exit() -> None:
    """At a normal interpreter exit: complete every pending background save (its commit and
    the retention policy), as ``wait()`` does; an error is printed, naming the directory."""
    for manager in list(_PENDING):
        try:
            manager.wait()
        except Exception as err:  # noqa: BLE001 (no caller at exit: told on stderr)
            print(
                f"{manager.name}({manager.directory!r}): the background save pending at exit failed: {err!r}",
                file=sys.stderr,
            )


def _pending(manager: CheckpointManager) -> None:
    _PENDING.add(manager)
    if not _AT_EXIT:  # registered after the lock's finalizer: it runs first (atexit is LIFO)
        atexit.register(_finish_at_exit)
        _AT_EXIT.append(True)


class CheckpointManager(DirectoryHolder):
    """A directory of checkpoints for any training loop: steps, latest and best, pruning,
    the fallback over unreadable checkpoints, the directory lock, background saves.

    Each [`save`][keras_stable_state.CheckpointManager.save] writes one
    ``ckpt-<step:010d>.h5`` file (a ``ckpt-<step:010d>.orbax`` step directory in a
    directory named ``*.orbax``) with the step, epoch and metrics, then keeps the latest
    ``max_to_keep`` and the best ``keep_best`` by ``monitor``.
    [`restore`][keras_stable_state.CheckpointManager.restore] restores the newest readable
    one, moving unreadable ones into ``unreadable/`` as
    [`StableCheckpoint`][keras_stable_state.StableCheckpoint] does. The manager holds the
    directory's lock from its first save or restore (or ``with`` block) to
    [`close`][keras_stable_state.CheckpointManager.close]. Locks, object stores, several
    processes and preemption in full:
    [in detail](how-to/custom-loops-manager.md#checkpointmanager-in-detail).

    Several processes (JAX processes; Torch ranks): every process calls ``save`` and
    ``restore``; process 0 alone locks, writes and prunes; each save checks the processes in:
    [multi-process](how-to/multi-process.md#torch-ranks-torchdistributed).

    Examples:
        >>> with CheckpointManager("ckpts", max_to_keep=2, keep_best=1, monitor="loss") as mgr:
        ...     start = 0 if mgr.restore(model) is None else mgr.restored_step
        ...     for step in range(start, 5):
        ...         loss = model.train_on_batch(x, y)
        ...         _ = mgr.save(step + 1, model, metrics={"loss": loss})
        >>> len(mgr.all_steps()) <= 3
        True

    Args:
        directory: Folder of the checkpoints (created on the first lock): a path,
            ``file://`` or object-store URL. Nothing else should write into it.
        max_to_keep: How many latest checkpoints to keep (``>= 1``), or ``None``: all.
        keep_best: How many best checkpoints by ``monitor`` to keep beside the latest.
        monitor: The key of the ``metrics`` given to ``save`` that ranks checkpoints.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the name of ``monitor``).
        save_on_background: ``True`` writes each checkpoint in a background thread. A
            background save still pending at a normal interpreter exit is completed
            then (committed, and the retention policy applied), as ``close()`` would.
        verbose: ``1`` prints one line per save and restore.
        storage_options: fsspec options for an object-store URL, or ``None``.

    Attributes:
        restored_step (int | None): The step the last ``restore`` restored, or ``None``.
        abandoned_checkpoints (list[tuple[str, str]]): ``(path, new path)`` of each checkpoint of
            an abandoned timeline, moved into ``abandoned/`` by a save (see ``save``).
        skipped_checkpoints (list[tuple[str, str]]): ``(path, reason)`` of each unreadable checkpoint skipped.
        moved_checkpoints (list[tuple[str, str | None]]): ``(path, new path)`` of each, moved into
            ``unreadable/`` (``None`` where it could not be moved).
        removed_temporary_files (list[str]): Stale ``.kss-*`` files removed when the lock was taken.
        last_save (SaveHandle | None): The newest background save's [`SaveHandle`][keras_stable_state.SaveHandle], or ``None``.
        on_saved (Callable[[int, str, float, float | None], None] | None): ``None``, or
            ``(step, path, write_secs, blocked_secs)`` called per save.
        files (CheckpointDirectory): What reads and writes the directory (a local folder's,
            or an object store's).
        storage_options (dict | None): The fsspec options of an object-store directory.
        name (str): The writer's name in messages and lock files.

    Raises:
        ValueError: On construction, for an invalid argument (named in the message).
        StateError: On construction, for a ``*.orbax`` directory without orbax-checkpoint.
        TypeError: On construction, if ``directory`` is not a path or a flag not a bool.
        CheckpointFormatError: For ``storage_options`` with a local directory, or a
            ``file://`` URL on another host.
        StorageBackendError: For a URL whose fsspec package is not installed.
    """

    def __init__(
        self,
        directory: str | bytes | os.PathLike[str],
        max_to_keep: int | None = 3,
        *,
        keep_best: int = 0,
        monitor: str | None = None,
        mode: str = "auto",
        save_on_background: bool = False,
        verbose: int = 0,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory, self.files = open_directory(
            directory, storage_options, "CheckpointManager", keras.backend.backend()
        )
        self._direction = policy.check_options(max_to_keep, keep_best, monitor, mode)
        if not isinstance(save_on_background, bool):
            raise TypeError(
                f"`save_on_background` must be a bool. Received: save_on_background={save_on_background!r}"
            )
        orbax_io.check_options(self.directory, save_on_background)
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
        self.storage_options = self.files.storage_options
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.save_on_background = save_on_background
        self.verbose = int(verbose)
        self.name = "CheckpointManager"
        self.restored_step: int | None = None
        self.skipped_checkpoints: list[tuple[str, str]] = []
        self.moved_checkpoints: list[tuple[str, str | None]] = []
        self.removed_temporary_files = []
        self.last_save: SaveHandle | None = None
        self.on_saved: Callable[[int, str, float, float | None], None] | None = None
        self._token = lock.new_token()
        self._lock = None
        self._finalizer = None
        self._in_flight: tuple[SaveHandle, int, _Info] | None = None  # the save not yet collected
        self._summaries: dict[str, tuple[Any, _Summary]] = {}  # path -> (file identity, summary)
        self._guard: PreemptionGuard | None = None  # the PreemptionGuard of preemption_guard(), once made
        self.abandoned_checkpoints: list[tuple[str, str]] = []
        self._timeline_from: int | None = None  # the step restored, until the save after it (see save)
        self._last_saved: int | None = None  # the step this manager saved last

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={getattr(self, name)!r}" for name in _REPR_NAMES)
        return f"<{type(self).__name__} {options}>"

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments: ``{"directory", "max_to_keep", "keep_best", "monitor",
        "mode", "save_on_background", "verbose", "storage_options"}``."""
        return {name: getattr(self, name) for name in _CONFIG_NAMES}

    def _say(self, message: str) -> None:
        if self.verbose:
            _keras_compat.print_msg(f"{self.name}: {message}")

    def preemption_guard(self, signals: Sequence[int] = DEFAULT_SIGNALS) -> PreemptionGuard:
        """A ``PreemptionGuard`` of ``signals`` for a custom loop (see the class docstring)."""
        self._guard = PreemptionGuard(signals, owner=self.name, check_in=checkin.preemption_check(self))
        return self._guard

    def reached_preemption(self, step: int) -> bool:
        """The entered [`preemption_guard`][keras_stable_state.CheckpointManager.preemption_guard]'s ``reached_preemption(step)`` (see the class docstring)."""
        return entered_guard(self._guard, f"{self.name}({self.directory!r})", step).reached_preemption(step)

    # -- listing ----------------------------------------------------------------------------
    def checkpoints(self) -> list[str]:
        """Paths of the checkpoints in the directory (``ckpt-<10 digits>.h5``), newest first."""
        return self.files.checkpoints()

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints in the directory, oldest first, from their sealed records
        (a misnamed file left out, a damaged one by its name: see ``timeline.steps_by_path``)."""
        return sorted(timeline.steps_by_path(self).values())

    def latest_step(self) -> int | None:
        """The newest step in the directory, or ``None`` if it holds no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step of the best checkpoint by ``monitor``, or ``None`` if no checkpoint has a
        finite value of it (each checkpoint's metadata record is read once per file).

        Raises:
            ValueError: if the manager has no ``monitor``.
        """
        if self.monitor is None:
            raise ValueError(
                f"{self.name}({self.directory!r}) has no `monitor`: there is no best checkpoint. Pass "
                "monitor= (and metrics= to each save)."
            )
        best = timeline.best_steps(self, self.checkpoints(), 1)
        return best[0] if best else None  # a step whose record names it

    def metadata(self, step: int) -> CheckpointMetadata:
        """The [`CheckpointMetadata`][keras_stable_state.CheckpointMetadata] of the checkpoint of ``step``,
        read from its sealed record.

        Raises:
            FileNotFoundError: if there is no checkpoint of ``step``, naming the steps present.
            CorruptCheckpointError, CheckpointFormatError: if it is unreadable (see
                `keras_stable_state.format.open_file`), or its record names another step than
                its file name (copied or renamed), naming both.
        """
        path = self._path(check_step(step))
        summary = timeline.summary(self, path)
        check_named_step(path, summary[1])
        return metadata_of(step, path, summary, self.files.size_of(path))

    def _path(self, step: int) -> str:
        path = path_of(self.directory, step)
        if not self.files.exists(path):
            raise FileNotFoundError(
                errno.ENOENT,
                f"No checkpoint of step {step} in {self.directory!r}; its steps are {self.all_steps()}.",
                path,
            )
        return path

    # -- save -------------------------------------------------------------------------------
    @_processes.torch_ranks(collective=True)
    def save(
        self,
        step: int,
        model: keras.Model,
        *,
        optimizer: keras.optimizers.Optimizer | None = None,
        metrics: Mapping[str, float] | None = None,
        epoch: int | None = None,
        new_timeline: bool = False,
        **state: Any,
    ) -> str | SaveHandle:
        """Save the training state of ``model`` as the checkpoint of ``step``, then prune.

        A save at or below the newest step is never silent: after a ``restore``, the first
        save starts a new timeline (the checkpoints after the step restored, and any at or
        after ``step``, moved into ``abandoned/``, kept; a line says which); a manager that
        did not restore is refused, unless ``new_timeline=True`` (those at or after
        ``step`` moved aside); the step this manager saved last may be saved again
        (replaced). [Timelines](how-to/custom-loops-manager.md#steps-come-from-the-records-timelines).

        Args:
            step: An int (``0`` to ``10**10 - 1``): the file ``ckpt-<step:010d>.h5``.
            model: A built ``keras.Model``.
            optimizer: As for [`save_training_state`][keras_stable_state.save_training_state].
            metrics: ``{name: number}`` recorded in the checkpoint's metadata (the values
                ``monitor`` ranks by), or ``None``.
            epoch: An int recorded in the metadata, or ``None``.
            new_timeline: ``True`` starts a new timeline at ``step`` in a directory whose
                newest checkpoint is at or after it (see above).
            **state: The other keywords of [`save_training_state`][keras_stable_state.save_training_state]:
                ``model_state``, ``callbacks``, ``state``, ``include_rng``,
                ``allow_order_keys``, ``variables``, ``mappers``.

        Returns:
            The path written, or with ``save_on_background`` the
            [`SaveHandle`][keras_stable_state.SaveHandle] of the background write.

        Raises:
            TypeError: for another keyword (``blocking``: use ``save_on_background``),
                metrics that are not numbers, or an ``epoch`` that is not an int.
            ValueError: for an invalid ``step``, or a ``state`` provider named ``"checkpoint"``
                (the manager's own record).
            StateError: for a ``step`` at or below the newest in the directory, from a
                manager that did not restore from it, without ``new_timeline=True``; or a
                checkpoint of the abandoned timeline that cannot be moved aside; processes that differ.
            Exception: every error of [`save_training_state`][keras_stable_state.save_training_state] and of
                [`lock`][keras_stable_state.CheckpointManager.lock]; the error of the previous background save.
        """
        step = check_step(step)
        metrics = check_metrics(metrics)
        providers = check_save_keywords(state, epoch)
        if not isinstance(new_timeline, bool):
            raise TypeError(f"`new_timeline` must be a bool. Received: new_timeline={new_timeline!r}")
        checkin.begin_save(self, step, new_timeline, model, optimizer)
        path = path_of(self.directory, step)
        info: _Info = {"step": step, "epoch": epoch, "metrics": metrics, "wall_time": time.time()}
        info["world_size"] = _processes.process_count()  # JAX processes, Torch ranks: 1 for one
        if self.monitor is not None:  # read by `keras-stable-state ls` to name the best
            info.update(monitor=self.monitor, mode=self._direction)
        started = time.perf_counter()
        self.files.begin_save(path)
        result = _core.save_training_state(
            path,
            model,
            optimizer,
            state={**providers, RECORD: ManagerRecord(info)},
            blocking=not self.save_on_background,
            storage_options=self.files.storage_options,
            **state,
        )
        if not isinstance(result, str):  # save_on_background: the handle of the write
            self.last_save = result
            self._in_flight = (result, step, info)
            _pending(self)
            return result
        self._saved(step, path, info, time.perf_counter() - started, None)
        return path

    def check_for_errors(self) -> None:
        """If the background save in flight has ended: raise its error, or prune."""
        self._collect(wait=False)

    def wait(self) -> None:
        """Wait for the background save in flight, if any: raise its error, or prune."""
        self._collect(wait=True)

    def drop_in_flight(self) -> None:
        """Forget the background save in flight without waiting for it or raising its error
        (a ``StableCheckpoint`` starting a new ``fit``: the error belonged to the earlier one)."""
        self._in_flight = None

    def _collect(self, wait: bool) -> None:
        in_flight = self._in_flight
        if in_flight is None:
            return
        handle, step, info = in_flight
        if not wait and not handle.done():
            return
        self._in_flight = None
        _PENDING.discard(self)
        handle.wait()
        secs = handle.write_secs
        assert secs is not None  # set once the write succeeded (wait raised otherwise)
        self._saved(step, handle.path, info, secs, handle.blocked_secs)

    def _saved(self, step: int, path: str, info: _Info, secs: float, blocked_secs: float | None) -> None:
        self.files.commit(path, step, info)
        self._last_saved = step
        # What this manager just sealed into the file, known without reading it back; kept
        # while the file is the one written (its identity), read from the file otherwise.
        summary: _Summary = ({"backend": keras.backend.backend()}, dict(info), format.FORMAT_VERSION)
        self._summaries[path] = (self.files.identity(path), summary)
        with _processes.on_primary(self.directory, share=True) as turn:
            if turn.runs:  # on process 0
                self.prune(newest=path)
        if self.on_saved is not None:
            self.on_saved(step, path, secs, blocked_secs)
        elif self.verbose:
            self._say(saved_message(path, f"step {step}", self.files.size_of(path), secs, blocked_secs))

    def prune(self, newest: str | None = None) -> list[str]:
        """Remove every checkpoint but the latest ``max_to_keep`` (``newest``, a path, among
        them) and the best ``keep_best``; the paths removed."""
        return timeline.prune(self, newest)

    # -- restore ----------------------------------------------------------------------------
    def restore(
        self, model: keras.Model, step: int | str = "latest", **restore_options: Any
    ) -> RestoreReport | None:
        """Restore the checkpoint of ``step`` into ``model``.

        Args:
            model: The model (see [`restore_training_state`][keras_stable_state.restore_training_state]).
            step: ``"latest"``: the newest readable checkpoint, moving unreadable ones aside
                (see the class; read in place with ``all_or_nothing=False``); ``"best"``: [`best_step`][keras_stable_state.CheckpointManager.best_step]'s; or an int step.
            **restore_options: The keywords of
                [`restore_training_state`][keras_stable_state.restore_training_state] (``optimizer``,
                ``strict``, ``callbacks``, ``state``, ``variables``...), but ``defer``.

        Returns:
            The [`RestoreReport`][keras_stable_state.RestoreReport]; ``None`` for ``"latest"`` when
            no readable checkpoint is left (the model is untouched). ``restored_step``
            is set to the step restored (``None`` then).

        Raises:
            TypeError: for a keyword that is not an option of ``restore_training_state``.
            ValueError: for a ``step`` that is not ``"latest"``, ``"best"`` or a valid int;
                for ``"best"`` without ``monitor``.
            FileNotFoundError: for an int step that has no checkpoint, or ``"best"`` when no
                checkpoint has a finite value of ``monitor``, naming the steps present.
            CheckpointInUseError: if the directory is locked by another writer, or the
                newest checkpoint is locked by another process (it is not damaged: no
                fallback).
            StateError: if an unreadable checkpoint cannot be moved aside.
            CheckpointFormatError: for ``"best"`` and int steps, a file whose record names
                another step (copied, renamed), naming both; moved into ``unreadable/``.
            Exception: every other error of ``restore_training_state`` (a checkpoint that
                does not fit the model: nothing is moved aside); for ``"best"`` and int
                steps, an unreadable checkpoint's error (no fallback).
        """
        restore_options.setdefault("storage_options", self.files.storage_options)
        options = _core.RestoreOptions.from_keywords("CheckpointManager.restore", **restore_options)
        if isinstance(step, str) and step not in ("latest", "best"):
            raise ValueError(f"`step` must be 'latest', 'best' or an int. Received: step={step!r}")
        if not isinstance(step, str):
            step = check_step(step)
        self._ensure_locked()
        self._collect(wait=True)
        return restoring.restore(self, model, step, options)

    def restore_newest_with(
        self,
        restore: Callable[[str, Any], None],
        unreadable: Callable[[str, BaseException], None] | None = None,
        *,
        read_only: bool = False,
        in_place: bool = False,  # read for a restore in place (see timeline.read_checked)
    ) -> str | None:
        """Pass the record of the newest readable checkpoint to ``restore(path, record)``
        (which restores everything from that one read); each unreadable one is moved aside
        (recorded in ``skipped_checkpoints`` and ``moved_checkpoints``; ``unreadable(path,
        err)`` is called first, if given) and the next one tried. Takes the lock, and
        waits for the background save in flight. No warning is issued (the caller says
        where it fell back to: see [`restore`][keras_stable_state.CheckpointManager.restore]). ``read_only=True`` reads without the
        lock (a directory on a read-only file system, where nobody can write).

        Returns:
            The path restored, or ``None`` if no readable checkpoint is left.

        Raises:
            CheckpointInUseError: As [`restore`][keras_stable_state.CheckpointManager.restore]
                for ``"latest"``: the directory or the newest checkpoint is locked.
            StateError: If an unreadable checkpoint cannot be moved aside.
            Exception: Every other error of ``restore(path, record)`` (nothing is moved aside).
        """
        return restoring.restore_newest(self, restore, unreadable, read_only=read_only, in_place=in_place)


def wait_for_earlier_saves(directory: str) -> None:
    """Wait for a background save into ``directory`` begun by an earlier manager (its error
    belonged to that manager)."""
    background.wait_for_folder(background.folder_of(path_of(directory, 0)))
