"""``CheckpointManager``: a directory of checkpoints for any training loop."""

from __future__ import annotations

import errno
import time

from keras_stable_state import _core as checkpoint
from keras_stable_state import _keras_compat as compat
from keras_stable_state import _processes as processes
from keras_stable_state._engines import background
from keras_stable_state._manager import directory as files
from keras_stable_state._manager import orbax_io, policy, shared
from keras_stable_state._manager.holder import DirectoryHolder
from keras_stable_state._manager.preemption import DEFAULT_SIGNALS, PreemptionGuard, entered_guard
from keras_stable_state._manager.records import (
    RECORD,
    CheckpointMetadata,
    ManagerRecord,
    check_metrics,
    check_save_keywords,
    check_step,
    metadata_of,
    saved_message,
)
from keras_stable_state._manager.remote_directory import open_directory
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError

_CONFIG_NAMES = ("directory", "max_to_keep", "keep_best", "monitor", "mode", "save_on_background", "verbose")
_CONFIG_NAMES += ("storage_options",)


class CheckpointManager(DirectoryHolder):
    """A directory of checkpoints for any training loop: steps, latest and best, pruning,
    the fallback over unreadable checkpoints, the directory lock, background saves.

    Each [`save`][keras_stable_state.CheckpointManager.save] writes one ``ckpt-<step:010d>.h5`` file (see
    [`keras_stable_state.save_training_state`][keras_stable_state.save_training_state]; atomically, through a ``.kss-*``
    temporary file) whose records also hold the step, the epoch, the metrics given and
    the wall time (record ``providers/checkpoint``; [`metadata`][keras_stable_state.CheckpointManager.metadata] reads them without
    the arrays). After each save, the checkpoints kept are the latest ``max_to_keep`` (the
    one just written always among them) and the best ``keep_best`` by ``monitor`` among
    all present; the others are removed. Only files named ``ckpt-<10 digits>.h5`` count;
    a checkpoint without a finite value of ``monitor`` (or unreadable) is never the best;
    of equal values the earlier step is the better. The metrics travel in the checkpoints,
    so a manager of a resumed run keeps the same notion of best.

    The directory belongs to one writer at a time: the manager takes the same exclusive
    ``flock`` on ``<directory>/.stable-checkpoint.lock`` as a
    [`StableCheckpoint`][keras_stable_state.StableCheckpoint] (so a manager and a ``StableCheckpoint``
    on one directory exclude each other, in one process or several) on entering its
    ``with`` block, or on its first [`save`][keras_stable_state.CheckpointManager.save] or [`restore`][keras_stable_state.CheckpointManager.restore], and holds it until
    [`close`][keras_stable_state.CheckpointManager.close] (or the end of the ``with`` block, or garbage collection, or the end of
    the process). Taking it, it removes the ``.kss-*`` temporary files a killed save left
    (``removed_temporary_files``). Listing ([`all_steps`][keras_stable_state.CheckpointManager.all_steps], [`latest_step`][keras_stable_state.CheckpointManager.latest_step],
    [`best_step`][keras_stable_state.CheckpointManager.best_step], [`metadata`][keras_stable_state.CheckpointManager.metadata]) takes no lock.

    ``restore(model)`` (``step="latest"``) restores the newest readable checkpoint: an
    unreadable one (truncated, failing a checksum, of an unknown format, not a regular
    file) is moved into ``<directory>/unreadable/`` and the one before is tried, with an
    [`UnreadableCheckpointWarning`][keras_stable_state.UnreadableCheckpointWarning] naming each moved file,
    exactly as ``StableCheckpoint`` does on train begin.

    Preemption, for a custom loop: ``with mgr.preemption_guard(signals=(signal.SIGTERM,)) as
    guard:`` installs a handler for each of ``signals`` (e.g. ``(signal.SIGTERM,
    signal.SIGUSR1)`` under SLURM's ``--signal=USR1@90``) that only notes the signal; leaving
    the block (also by an exception) puts the previous handlers back. At each step boundary
    the loop asks ``mgr.reached_preemption(step)`` (or ``guard.reached_preemption(step)``):
    ``True`` once a signal came; then [`save`][keras_stable_state.CheckpointManager.save] the step, [`wait`][keras_stable_state.CheckpointManager.wait] for a background
    save, and leave the loop. ``guard.signal_received`` is the first signal that came, or
    ``None``. With several JAX processes ``reached_preemption`` is a collective (one small
    ``process_allgather``) that every process calls at every step with the same step: if any
    process got a signal, all answer ``True`` at the same step (as Orbax's
    ``CheckpointManager.reached_preemption``). ``preemption_guard`` raises ``TypeError`` /
    ``ValueError`` for ``signals`` that are not signal numbers, none, or ``SIGKILL`` /
    ``SIGSTOP``; entering it raises ``StateError`` off the main thread (only the main thread
    may install signal handlers) or if it is entered already; ``reached_preemption`` raises
    ``StateError`` outside an entered guard of this manager (no signal is handled there) and
    if the processes asked at different steps. See ``docs/how-to/preemption.md``.

    In an object store (``directory`` an ``s3://``, ``gs://``, ``memory://``... URL, through
    fsspec: see ``docs/how-to/cloud-storage.md``) each checkpoint is uploaded whole, then
    its commit marker ``ckpt-<step:010d>.h5.commit``; the listing (and so "latest") takes only
    checkpoints whose marker is there and names the object as it is, pruning removes the
    marker first, unreadable checkpoints are copied into ``unreadable/`` then removed, and
    left-overs of a killed writer are cleaned up when the lock is taken. The lock is the
    object ``.stable-checkpoint.lock``, created with an exclusive write; a stale one is taken
    over only if its holder ran on this host and has died.

    A ``directory`` named ``*.orbax`` holds ``.orbax`` step directories
    ``ckpt-<step:010d>.orbax`` instead (the ``.orbax`` engine of ``save_training_state``:
    every JAX process writes its own shards; a step is committed by renaming its
    ``.ckpt-<step>.orbax.kss-partial`` folder, so the newest is never an incomplete one).
    With several JAX processes every process calls [`save`][keras_stable_state.CheckpointManager.save], [`restore`][keras_stable_state.CheckpointManager.restore] and
    [`lock`][keras_stable_state.CheckpointManager.lock] (collectives): process 0 alone takes the lock, prunes after each save and
    moves unreadable checkpoints aside, the others wait for it, and all restore the
    checkpoints process 0 lists.

    Args:
        directory: Folder of the checkpoints (created on the first lock): a ``str``,
            ``bytes`` or ``os.PathLike``, a ``file://`` URL (the local path it names) or an
            object-store URL. Nothing else should write into it.
        max_to_keep: How many latest checkpoints to keep (``>= 1``), or ``None`` to keep
            every one. With ``save_on_background`` a file is pruned only once the new one
            is written.
        keep_best: How many best checkpoints by ``monitor`` to keep beside the latest
            (``>= 0``; needs ``monitor``).
        monitor: The name of the metric (a key of the ``metrics`` given to [`save`][keras_stable_state.CheckpointManager.save])
            that ranks checkpoints for ``keep_best`` and [`best_step`][keras_stable_state.CheckpointManager.best_step], or ``None``.
        mode: ``"min"``, ``"max"`` or ``"auto"``: lower is better for a name holding
            ``loss`` or ``error``, higher for one holding ``acc``, ``auc``, ``precision``,
            ``recall`` or ``f1``.
        save_on_background: ``True`` writes each checkpoint in a background thread
            ([`save_training_state`][keras_stable_state.save_training_state] with ``blocking=False``):
            [`save`][keras_stable_state.CheckpointManager.save] returns once the state is held apart from training (see its
            ``blocking`` argument). A save first
            waits for the previous one; the error of a failed background write is raised
            by the next [`save`][keras_stable_state.CheckpointManager.save], [`check_for_errors`][keras_stable_state.CheckpointManager.check_for_errors], [`wait`][keras_stable_state.CheckpointManager.wait] or
            [`close`][keras_stable_state.CheckpointManager.close].
        verbose: ``1`` prints one line per save and restore (Keras' ``print_msg``).
        storage_options: For an object-store URL: a ``dict`` passed to its fsspec filesystem
            (every save, restore and listing), or ``None``; fsspec's configuration and the
            store's environment variables apply as fsspec applies them.

    Attributes:
        files: What reads and writes the directory: the module
            ``keras_stable_state._manager.directory`` for a local folder, a
            ``RemoteDirectory`` (``_manager.remote_directory``) for an object store; both
            have ``size_of(path)``, ``checkpoints(directory)``... (internal, may change).
        storage_options: The ``storage_options`` of an object-store directory, or ``None``.
        name: What messages, warnings and the lock file call this writer
            (``"CheckpointManager"``; the manager of a ``StableCheckpoint``:
            ``"StableCheckpoint"``).
        restored_step: The step of the checkpoint the last [`restore`][keras_stable_state.CheckpointManager.restore] restored, or
            ``None``.
        skipped_checkpoints: ``(path, reason)`` of each unreadable checkpoint the last
            restore of the latest skipped, newest first.
        moved_checkpoints: ``(path, new path)`` of each of them, moved into
            ``<directory>/unreadable/`` (``None``: removed meanwhile).
        removed_temporary_files: The stale ``.kss-*`` files removed when the lock was taken.
        last_save: The [`SaveHandle`][keras_stable_state.SaveHandle] of the newest background
            save, or ``None``.
        on_saved: ``None``, or a callable ``(step, path, write_secs, blocked_secs)`` called
            once a save is written and the directory pruned (``blocked_secs`` is ``None``
            for a blocking save).

    Raises:
        ValueError: on construction, for an invalid ``max_to_keep``, ``keep_best``,
            ``monitor``, ``mode`` or ``verbose``, ``keep_best`` without ``monitor``, or
            ``save_on_background=True`` for a ``directory`` ending in ``.orbax``.
        StateError: on construction, for a ``directory`` ending in ``.orbax`` when
            orbax-checkpoint (the ``[orbax]`` extra) is not installed.
        TypeError: on construction, if ``directory`` is not a path or
            ``save_on_background`` not a bool.
        CheckpointFormatError: on construction, for ``storage_options`` with a local
            directory, or a ``file://`` URL on another host.
        StorageBackendError: on construction, for a URL whose fsspec implementation is not
            installed, naming the package (nothing is written anywhere).

    Example:
        >>> with CheckpointManager("ckpts", max_to_keep=2, keep_best=1, monitor="loss") as mgr:
        ...     start = 0 if mgr.restore(model) is None else mgr.restored_step
        ...     for step in range(start, 5):
        ...         loss = model.train_on_batch(x, y)
        ...         _ = mgr.save(step + 1, model, metrics={"loss": loss})
        >>> len(mgr.all_steps()) <= 3
        True
    """

    def __init__(
        self,
        directory,
        max_to_keep=3,
        *,
        keep_best=0,
        monitor=None,
        mode="auto",
        save_on_background=False,
        verbose=0,
        storage_options=None,
    ) -> None:
        self.directory, self.files = open_directory(directory, storage_options, "CheckpointManager")
        self._direction = policy.check_options(max_to_keep, keep_best, monitor, mode)
        if not isinstance(save_on_background, bool):
            raise TypeError(
                f"`save_on_background` must be a bool. Received: save_on_background={save_on_background!r}"
            )
        orbax_io.check_options(self.directory, save_on_background)
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
        self.storage_options = self.files.STORAGE_OPTIONS
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.save_on_background = save_on_background
        self.verbose = int(verbose)
        self.name = "CheckpointManager"
        self.restored_step = None
        self.skipped_checkpoints = []
        self.moved_checkpoints = []
        self.removed_temporary_files = []
        self.last_save = None
        self.on_saved = None
        self._token = files.new_token()
        self._lock = None
        self._finalizer = None
        self._in_flight = None  # (handle, step, info) of the background save not yet collected
        self._summaries = {}  # path -> (file identity, (metadata, record, version))
        self._guard = None  # the PreemptionGuard of preemption_guard(), once made
        self._read = shared.agreed(orbax_io.read if self.files is files else self.files.read)

    def get_config(self) -> dict:
        """The constructor arguments: ``{"directory", "max_to_keep", "keep_best", "monitor",
        "mode", "save_on_background", "verbose", "storage_options"}``."""
        return {name: getattr(self, name) for name in _CONFIG_NAMES}

    def _say(self, message) -> None:
        if self.verbose:
            compat.print_msg(f"{self.name}: {message}")

    def preemption_guard(self, signals=DEFAULT_SIGNALS) -> PreemptionGuard:
        """A ``PreemptionGuard`` of ``signals`` for a custom loop (see the class docstring)."""
        self._guard = PreemptionGuard(signals, owner=self.name)
        return self._guard

    def reached_preemption(self, step) -> bool:
        """The entered [`preemption_guard`][keras_stable_state.CheckpointManager.preemption_guard]'s ``reached_preemption(step)`` (see the class docstring)."""
        return entered_guard(self._guard, f"{self.name}({self.directory!r})", step).reached_preemption(step)

    # -- listing ----------------------------------------------------------------------------
    def checkpoints(self) -> list:
        """Paths of the checkpoints in the directory (``ckpt-<10 digits>.h5``), newest first."""
        return self.files.checkpoints(self.directory)

    def all_steps(self) -> list:
        """The steps of the checkpoints in the directory, oldest first (unreadable ones too)."""
        return sorted(files.step_of(p) for p in self.checkpoints())

    def latest_step(self) -> int | None:
        """The newest step in the directory, or ``None`` if it holds no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _summary(self, path):
        """``(metadata, record, version)`` of ``path``, read once per written file."""
        key = self.files.identity(path)
        cached = self._summaries.get(path)
        if cached is not None and key is not None and cached[0] == key:
            return cached[1]
        metadata, extra, version = self.files.read_summary(path)
        record = (extra.get("providers") or {}).get(RECORD)
        summary = (metadata, record if isinstance(record, dict) else {}, version)
        self._summaries[path] = (key, summary)
        return summary

    def _score(self, path):
        try:
            _, record, _ = self._summary(path)
        except (CorruptCheckpointError, CheckpointFormatError, FileNotFoundError):
            return None  # unreadable or gone: never the best
        return policy.score(record.get("metrics"), self.monitor, self._direction)

    def _best_steps(self, paths, count):
        scores = {files.step_of(p): self._score(p) for p in paths}
        return policy.best_steps(scores, count)

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
        best = self._best_steps(self.checkpoints(), 1)
        return best[0] if best else None

    def metadata(self, step) -> CheckpointMetadata:
        """The [`CheckpointMetadata`][keras_stable_state.CheckpointMetadata] of the checkpoint of ``step``.

        Raises:
            FileNotFoundError: if there is no checkpoint of ``step``, naming the steps present.
            CorruptCheckpointError, CheckpointFormatError: if it is unreadable (see
                `keras_stable_state.format.open_file`).
        """
        path = self._path(check_step(step))
        return metadata_of(step, path, self._summary(path), self.files.size_of(path))

    def _path(self, step):
        path = files.path_of(self.directory, step)
        if not self.files.exists(path):
            raise FileNotFoundError(
                errno.ENOENT,
                f"No checkpoint of step {step} in {self.directory!r}; its steps are {self.all_steps()}.",
                path,
            )
        return path

    # -- save -------------------------------------------------------------------------------
    def save(self, step, model, *, optimizer=None, metrics=None, epoch=None, **state):
        """Save the training state of ``model`` as the checkpoint of ``step``, then prune.

        Args:
            step: An int (``0`` to ``10**10 - 1``): the file ``ckpt-<step:010d>.h5``. A
                checkpoint of the same step is replaced (atomically).
            model: A built ``keras.Model``.
            optimizer: As for [`save_training_state`][keras_stable_state.save_training_state].
            metrics: ``{name: number}`` recorded in the checkpoint's metadata (the values
                ``monitor`` ranks by), or ``None``.
            epoch: An int recorded in the metadata, or ``None``.
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
            Exception: every error of [`save_training_state`][keras_stable_state.save_training_state] and of
                [`lock`][keras_stable_state.CheckpointManager.lock]; the error of the previous background save.
        """
        step = check_step(step)
        metrics = check_metrics(metrics)
        providers = check_save_keywords(state, epoch)
        self._ensure_locked()
        self._collect(wait=True)
        path = files.path_of(self.directory, step)
        info = {"step": step, "epoch": epoch, "metrics": metrics, "wall_time": time.time()}
        if self.monitor is not None:  # read by `keras-stable-state ls` to name the best
            info.update(monitor=self.monitor, mode=self._direction)
        started = time.perf_counter()
        self.files.begin_save(path)
        result = checkpoint.save_training_state(
            path,
            model,
            optimizer,
            state={**providers, RECORD: ManagerRecord(info)},
            blocking=not self.save_on_background,
            storage_options=self.files.STORAGE_OPTIONS,
            **state,
        )
        if self.save_on_background:
            self.last_save = result
            self._in_flight = (result, step, info)
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

    def _collect(self, wait) -> None:
        in_flight = self._in_flight
        if in_flight is None:
            return
        handle, step, info = in_flight
        if not wait and not handle.done():
            return
        self._in_flight = None
        handle.wait()
        self._saved(step, handle.path, info, handle.write_secs, handle.blocked_secs)

    def _saved(self, step, path, info, secs, blocked_secs) -> None:
        self.files.commit(path, step, info)
        self._summaries.pop(path, None)
        processes.share_from_primary(self.directory, lambda: self.prune(newest=path))  # JAX: process 0
        if self.on_saved is not None:
            self.on_saved(step, path, secs, blocked_secs)
        elif self.verbose:
            self._say(saved_message(path, f"step {step}", self.files.size_of(path), secs, blocked_secs))

    def prune(self, newest=None) -> list:
        """Remove every checkpoint but the latest ``max_to_keep`` (``newest``, a path, among
        them) and the best ``keep_best``; the paths removed."""
        paths = self.checkpoints()
        if self.max_to_keep is None:
            return []
        newest_step = None if newest is None else files.step_of(newest)
        best = self._best_steps(paths, self.keep_best) if self.keep_best else []
        kept = policy.kept_steps([files.step_of(p) for p in paths], newest_step, self.max_to_keep, best)
        removed = [p for p in paths if files.step_of(p) not in kept]
        self.files.remove(removed)
        for path in removed:
            self._summaries.pop(path, None)
        return removed

    # -- restore ----------------------------------------------------------------------------
    def restore(self, model, step="latest", **restore_options):
        """Restore the checkpoint of ``step`` into ``model``.

        Args:
            model: The model (see [`restore_training_state`][keras_stable_state.restore_training_state]).
            step: ``"latest"``: the newest readable checkpoint, moving unreadable ones aside
                (see the class); ``"best"``: [`best_step`][keras_stable_state.CheckpointManager.best_step]'s; or an int step.
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
            Exception: every other error of ``restore_training_state`` (a checkpoint that
                does not fit the model: nothing is moved aside); for ``"best"`` and int
                steps, an unreadable checkpoint's error (no fallback).
        """
        restore_options.setdefault("storage_options", self.files.STORAGE_OPTIONS)
        options = checkpoint.RestoreOptions.from_keywords("CheckpointManager.restore", **restore_options)
        if isinstance(step, str) and step not in ("latest", "best"):
            raise ValueError(f"`step` must be 'latest', 'best' or an int. Received: step={step!r}")
        if not isinstance(step, str):
            step = check_step(step)
        self._ensure_locked()
        self._collect(wait=True)
        self.restored_step = None
        if step == "latest":
            restored = {}

            def restore(path, record) -> None:
                # the record was read for this restore alone: its arrays may become the variables'
                restored["report"] = checkpoint.restore_with(path, model, options, record=record, take=True)

            path = self.restore_newest_with(restore)
            if self.skipped_checkpoints:
                where = "none" if path is None else f"step {files.step_of(path)}"
                files.warn_unreadable(
                    self.directory, self.skipped_checkpoints, self.moved_checkpoints, path, where, self.name
                )
            if path is None:
                self._say(f"no readable checkpoint in {self.directory}")
                return None
            report = restored["report"]
        else:
            if step == "best":
                step = self.best_step()
                if step is None:
                    raise FileNotFoundError(
                        errno.ENOENT,
                        f"No checkpoint in {self.directory!r} has a finite {self.monitor!r} metric (its "
                        f"steps are {self.all_steps()}): there is no best to restore.",
                        self.directory,
                    )
            path = self._path(step)
            report = checkpoint.restore_with(path, model, options)
        self.restored_step = files.step_of(path)
        self._say(f"restored {path} (step {self.restored_step})")
        return report

    def restore_newest_with(self, restore, unreadable=None, *, read_only=False):
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
        if not read_only:
            self._ensure_locked()
        self._collect(wait=True)
        self.skipped_checkpoints, self.moved_checkpoints = [], []

        def moved(path, err) -> None:
            if unreadable is not None:
                unreadable(path, err)
            self.skipped_checkpoints.append((path, str(err)))
            self.moved_checkpoints.append(
                (path, shared.move_aside(self.files, self.directory, path, self.name))
            )
            self._summaries.pop(path, None)

        # JAX: the checkpoints process 0 lists, each read by every process alike
        paths = shared.checkpoints(self.files, self.directory)
        return self.files.restore_newest(
            paths, self.directory, restore, moved, self.name, read_with=self._read
        )


def wait_for_earlier_saves(directory) -> None:
    """Wait for a background save into ``directory`` begun by an earlier manager (its error
    belonged to that manager)."""
    background.wait_for_folder(background.folder_of(files.path_of(directory, 0)))
