"""``StableCheckpoint``: exact resume for ``model.fit``."""

from __future__ import annotations

import errno
import os
import weakref

import keras

from keras_stable_state import _core as checkpoint
from keras_stable_state import _keras_compat as compat
from keras_stable_state import _state as state
from keras_stable_state._fit import checks as _fit_checks
from keras_stable_state._fit import inexact, resume
from keras_stable_state._fit import input as _fit_input
from keras_stable_state._fit.position import Metrics, Position, numeric_logs
from keras_stable_state._manager import CheckpointManager, preemption, wait_for_earlier_saves
from keras_stable_state._manager.records import saved_message
from keras_stable_state._manager.remote_directory import open_directory
from keras_stable_state._optimizer import stable_optimizer_in, tracked_optimizers
from keras_stable_state.errors import (
    InexactResumeWarning,
    UnreadableCheckpointWarning,
)

__all__ = ["StableCheckpoint", "UnreadableCheckpointWarning", "InexactResumeWarning"]


class StableCheckpoint(keras.callbacks.Callback):
    """Checkpoints the whole training state during ``model.fit`` and resumes it exactly.

    On train begin it restores the newest readable checkpoint in ``directory``
    (model and optimizer variables by key, the learning-rate schedule check,
    the state of the callbacks given as ``callbacks=``, the global random
    state, metric accumulators and the position) and starts ``fit`` at the saved
    epoch. A checkpoint taken mid-epoch resumes at the next unseen batch: the
    batches already applied are drawn from the data and skipped, not trained on
    again. For NumPy array inputs with ``fit(shuffle=True)`` (or ``"batch"``)
    the callback takes the shuffle over from Keras' data adapter, whose order each
    backend draws with its own generator: at each epoch begin it draws the epoch's
    permutation with NumPy's global generator and hands the adapter the arrays
    gathered in that order (a copy of the arrays per epoch); the permutation is
    saved (record ``providers/data``), so the rest of an interrupted epoch is the
    same samples on any backend, whatever the resuming process was seeded with. A
    ``keras.utils.PyDataset``'s order is decided by the saved global NumPy/Python
    random state, also with ``workers > 1`` threads. With ``steps_per_epoch``,
    Keras keeps one iterator across epochs (a ``tf.data`` pipeline with
    ``repeat()``): the number of batches drawn from it before the epoch began is
    saved too, and a resumed run draws them from a fresh iterator first. Shuffled
    arrays whose order cannot be taken over (with ``steps_per_epoch``, or not NumPy
    arrays, on TensorFlow) get an [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] on train begin, as
    does a resume on another backend than the writer's of a model with random
    layers (each backend draws its own dropout masks). A ``PyDataset`` that defines ``get_state()``
    (a dict of JSON values and NumPy arrays) and ``set_state(state)`` has that
    state saved (record ``providers/input``) and put back before the resumed
    epoch's iterator starts, so one that shuffles in ``on_epoch_end`` resumes
    exactly; one that overrides ``on_epoch_end`` without them, and a ``tf.data``
    pipeline that shuffles with ``reshuffle_each_iteration=True``, get an
    [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] on train begin. The input is found through
    ``fit``'s call frame (Keras gives callbacks no handle on it); the batches a
    ``PyDataset``'s workers prefetched while ``fit`` built the model are dropped,
    so each epoch reads its own order. For other ``tf.data`` datasets and
    generators the skipped batches are drawn from a fresh iterator, so the
    resume is exact only if their order is deterministic.

    Each save is one ``ckpt-<global step>.h5`` file (in a directory named ``*.orbax``, a
    ``ckpt-<global step>.orbax`` step directory of the ``.orbax`` engine: every JAX
    process writes its own shards, see [`CheckpointManager`][keras_stable_state.CheckpointManager])
    (see [`keras_stable_state.save_training_state`][keras_stable_state.save_training_state]), written atomically through a
    ``.kss-*`` temporary file; the newest ``max_to_keep`` files are kept, and with
    ``monitor`` and ``keep_best`` the best ``keep_best`` by that metric beside them (only
    files named ``ckpt-<10 digits>.h5`` count, and a file that vanished meanwhile is
    skipped): the directory is that of a [`CheckpointManager`][keras_stable_state.CheckpointManager]
    (``manager``). A checkpoint's metrics are the ``logs`` of the batch or epoch end before
    it: an epoch-end save has the epoch's ``val_*`` metrics, a mid-epoch one only the
    running training metrics (so it is never the best by ``val_loss``).
    The resume reads the newest checkpoint once and restores everything (variables,
    position, callback states, random state) from what it read. While the ``fit``
    runs, a [`save_training_state`][keras_stable_state.save_training_state] of the model from
    another thread waits for the end of the current step, the training thread
    waiting in ``on_train_batch_end`` until that save has read the model: the file
    holds one step.

    The directory belongs to one writer at a time: on train begin the callback takes
    an exclusive ``flock`` on ``<directory>/.stable-checkpoint.lock`` (a regular file
    opened without following links, which names its pid and host) and releases it, removing the file, on train end. A second
    ``fit`` with a ``StableCheckpoint`` on the same directory, in another process or
    in another thread, is refused. The operating system releases the lock of a
    process that dies. If ``fit`` raises, Keras skips ``on_train_end``: the lock is
    then released when the callback is garbage collected, when the process exits,
    or when a ``StableCheckpoint`` on the same directory begins training again in
    the same thread. Holding the lock, it removes the ``.kss-*`` temporary files
    that a killed save left behind (``removed_temporary_files`` lists them).

    An unreadable checkpoint (truncated, failing a checksum, or not a training
    state) is moved into ``<directory>/unreadable/`` (``ckpt-<step>.h5``, or
    ``ckpt-<step>.h5.<n>`` if that name is taken) and the one before is restored,
    with an [`UnreadableCheckpointWarning`][keras_stable_state.UnreadableCheckpointWarning] naming each moved file. If none is
    readable, training starts fresh, with that warning. ``skipped_checkpoints``
    lists ``(path, reason)`` and ``moved_checkpoints`` ``(path, new path)`` of each.
    A checkpoint that is locked by another process is not damaged: the callback
    raises [`CheckpointInUseError`][keras_stable_state.CheckpointInUseError] and never falls back.
    Nor is one written by a newer keras_stable_state: the callback raises
    [`NewerFormatError`][keras_stable_state.NewerFormatError], leaves the file in place and
    never falls back.

    With ``steps_per_execution=k`` (TensorFlow and JAX; Keras refuses ``k > 1`` on
    Torch) Keras calls the batch callbacks once per execution of ``k`` batches, so
    saves happen at execution boundaries: an int ``save_freq`` must be a multiple
    of ``k`` and a save is taken at the first execution boundary at or after each
    multiple of ``save_freq`` batches (an epoch's last execution may hold fewer
    than ``k`` batches). A mid-epoch resume draws and skips whole executions.

    Saves happen after every callback has seen the epoch or batch end (a save
    requested at a batch end is written when the next batch or epoch begins),
    so the state of callbacks listed after this one, e.g. a learning rate that
    ``ReduceLROnPlateau`` just reduced, is in the checkpoint.

    The state of other callbacks (``EarlyStopping``, ``ReduceLROnPlateau``,
    ``ModelCheckpoint``...) is saved for the callbacks given as ``callbacks=``,
    by the name you give them: ``StableCheckpoint(d, callbacks={"es": es})``,
    then ``fit(..., callbacks=[ckpt, es])``. Keras gives a callback no public
    way to see the other callbacks of a ``fit`` call, so none are guessed: a
    callback not given here restarts with a fresh state on resume, as with
    Keras' ``BackupAndRestore``. Callbacks that count batches themselves see
    the skipped batches' begin and end events (with empty logs). On a resume,
    each callback of the ``fit`` whose state the library cannot see (one of your
    own classes, or a ``LambdaCallback``, without ``get_state()``/``set_state()``)
    gets an [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning]: its attributes start fresh in the new
    process. A ``get_state()`` that returns ``{}`` declares a callback stateless.

    On a mid-epoch resume Keras runs every callback's ``on_epoch_begin`` again for
    the interrupted epoch: the saved learning rate is put back once they have run
    (at the first batch begin this callback sees), so ``LearningRateScheduler`` is
    applied once per epoch. Every other callback of the ``fit`` that overrides
    ``on_epoch_begin`` (Keras' display, logging and saving callbacks aside) gets an
    [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] on train begin, unless it has an attribute
    ``repeatable_epoch_begin = True``. At an epoch-boundary resume, such a callback
    listed before this one (its ``on_epoch_begin`` ran before the epoch-end save was
    written) gets that warning.

    With ``save_on_preemption`` (default), a ``preemption_signals`` signal (``SIGTERM``) during
    ``fit`` is only noted; at the next batch end the checkpoint of that step is written
    (at an epoch's last batch: the epoch-end one, at train end), waited for, and
    ``model.stop_training`` set: Keras stops as for ``EarlyStopping`` (the epoch's validation
    and ``on_epoch_end`` run, its row is in the returned ``History``) and
    ``reached_preemption`` is ``True``. With several JAX processes all save the same step
    (a small collective per batch end). The previous handlers are put back at train end
    (after a ``fit`` that raised: at the next train begin, or at the next signal, which goes
    to them). Only the main thread can install handlers: a ``fit`` in another thread trains
    without (``preemption.handled``). See ``docs/how-to/preemption.md``.

    Each checkpoint records the ``fit``'s batch size, number of samples and steps per
    epoch (where Keras knows them); on train begin they are compared with the resumed
    ``fit``'s. A mid-epoch checkpoint whose data differ is refused (``StateError``) or,
    with ``on_data_change="restart_epoch"``, its epoch is trained again from the first
    batch; an epoch-boundary one resumes with the new data. Both of the latter issue
    an [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] naming each field, saved and now.

    On train begin every ``StableOptimizer`` the model tracks
    (``model.optimizer`` and optimizer attributes such as a GAN's
    ``d_optimizer``) is bound to the ``fit`` model (see
    [`bind`][keras_stable_state.StableOptimizer.bind]), and every optimizer the
    model tracks is saved and restored, each under its attribute name.

    Args:
        directory: Folder of the checkpoints (created if needed): a ``str``, ``bytes`` (decoded
            with ``os.fsdecode``), ``os.PathLike``, ``file://`` URL or object-store URL (``s3://``
            ...: see [`CheckpointManager`][keras_stable_state.CheckpointManager]). Give each run its own
            folder; nothing else should write into it (see ``docs/concepts/security.md``).
        storage_options: ``dict`` for an object-store directory's fsspec filesystem, or ``None``.
        save_freq: ``"epoch"`` or an ``int``: save every that many batches (a
            multiple of the model's ``steps_per_execution``).
        max_to_keep: How many newest checkpoints to keep (``>= 1``; ``None``: all).
            Only fully written files count: with ``save_on_background`` the older
            files are removed once the new one is written. (``keep=``, its former
            name, still works for one release, with a ``DeprecationWarning``.)
        verbose: ``1`` prints one line per restore, and per save its file
            name, size (MB) and time (ms): with ``save_on_background``, the time of the
            background write and the time training was blocked, printed once
            the write has ended (at a later batch, the next save or train end).
            Lines go through Keras' ``print_msg`` (stdout, or absl logging
            when Keras is set to log).
        callbacks: Callbacks whose state to save and restore: a dict
            ``{name: callback}`` (the names key their state in the checkpoint)
            or a list (keyed by class name and index among callbacks of that
            class). Default: none. The ``History`` of the ``fit`` call
            (``model.history``) is always included, as ``"History/0"``.
        save_on_background: ``True`` writes each checkpoint in a background thread
            ([`save_training_state`][keras_stable_state.save_training_state] with ``blocking=False``): the training
            step waits only while the state is held apart from training (a host copy on Torch, none
            on TensorFlow and JAX). A save first waits for the previous one; a failed background
            write raises its error (an ``OSError`` naming the file, or what the write raised) at the
            next batch, save or train end, whichever comes first; ``on_train_end`` waits for the
            last write and raises its failure (none is swallowed). A process killed during a write
            leaves a ``.kss-*`` temporary file, removed on the next train begin, and the checkpoints
            written before it. (``async_save=``, its former name, still works for one release, with
            a ``DeprecationWarning``.)
        on_data_change: What a mid-epoch resume does when the batch size, number of
            samples or steps per epoch differ from the checkpoint's: ``"raise"``
            (default, ``StateError``) or ``"restart_epoch"``: train the interrupted
            epoch again from its first batch with the new data (the updates of its
            batches applied before the save stay in the weights and optimizer; its
            metrics start afresh, its order is drawn from the random state at the save
            and the global step continues), with an [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning].
        monitor: The metric (a key of ``fit``'s logs, e.g. ``"val_loss"``) that ranks
            checkpoints for ``keep_best``, or ``None``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see
            [`CheckpointManager`][keras_stable_state.CheckpointManager]).
        keep_best: How many best checkpoints by ``monitor`` to keep beside the
            ``max_to_keep`` latest (``>= 0``; needs ``monitor``).
        save_on_preemption: ``True`` (default): save and stop on a preemption signal (see
            above); ``False``: no signal handler.
        preemption_signals: The signals that mean preemption: ``(signal.SIGTERM,)`` by
            default; e.g. ``(signal.SIGTERM, signal.SIGUSR1)`` for SLURM's ``--signal=USR1@90``.
        keep: Deprecated alias of ``max_to_keep`` (keyword only).
        async_save: Deprecated alias of ``save_on_background`` (keyword only).

    Attributes:
        manager: The [`CheckpointManager`][keras_stable_state.CheckpointManager] of ``directory``
            (``manager.best_step()``, ``manager.metadata(step)``, ``manager.restore(model,
            step="best")``).
        run_complete: ``True`` once train begin restored a checkpoint at or past ``fit``'s
            ``epochs``: the run is complete, ``fit`` trains no epoch and returns the
            restored ``History`` (its ``history`` and ``epoch`` as saved; the states of the
            callbacks given are put back at train end); ``verbose=1`` says so.
        restore_report: The [`RestoreReport`][keras_stable_state.RestoreReport] of the
            checkpoint restored on train begin, or ``None`` (fresh start).
        skipped_checkpoints: ``(path, reason)`` of each unreadable checkpoint skipped on train begin.
        moved_checkpoints: ``(path, new path)`` of each of them, moved into
            ``<directory>/unreadable/``.
        removed_temporary_files: Stale ``.kss-*`` temporary files removed on train begin.
        reached_preemption: ``True`` once the last ``fit`` saved and stopped for a signal;
            ``preemption.step`` is then the checkpoint's global step, and
            ``preemption.handled`` whether that ``fit`` had the handlers (main thread).
        last_save: The [`SaveHandle`][keras_stable_state.SaveHandle] of the newest
            background save (``save_on_background=True``), or ``None``.

    Raises:
        ValueError: for an invalid ``save_freq``, ``max_to_keep``, ``verbose``, ``on_data_change``,
            ``monitor``, ``mode`` or ``keep_best`` (``keep_best`` without ``monitor``), both a
            deprecated alias and its new name, ``preemption_signals`` empty or holding
            ``SIGKILL``/``SIGSTOP``,
            a callback name that is empty or holds ``/``, ``#``, ``@`` or whitespace, or
            ``save_on_background=True`` with a ``*.orbax`` directory (on construction).
        TypeError: if ``directory`` is not a path, ``callbacks`` is not a dict or list
            of callbacks, ``save_on_background`` or ``save_on_preemption`` is not a bool, or
            ``preemption_signals`` not signal numbers (on construction).
        StorageBackendError: (on construction) for an object-store URL whose fsspec
            implementation is not installed, naming it: nothing is written anywhere.
        StateError: (on construction) for a ``*.orbax`` directory without orbax-checkpoint
            (the ``[orbax]`` extra).
        OSError: with ``save_on_background``, at a later batch, the next save or train
            end: the error of a background write that failed (disk full, folder
            removed), naming the file; the checkpoints written before it are intact.
        BindingError: on train begin, if a ``StableOptimizer`` of the model is
            built on variables the model does not hold, or its state loaded by
            ``load_model`` does not fit the model.
        StateError: on train begin, if the checkpoint holds input state and the
            ``fit`` input defines no ``get_state()``/``set_state()``, or the other
            way round; if the model is not built; if an int
            ``save_freq`` is not a multiple of the model's ``steps_per_execution``
            (such a save would fall inside an execution); if the checkpoint to
            resume was saved at a batch inside an execution of the current
            ``steps_per_execution`` (saved with another one); or if an unreadable
            checkpoint cannot be moved aside (it would count in ``max_to_keep`` and be
            found again); if a mid-epoch checkpoint was saved with another batch size,
            number of samples or steps per epoch and ``on_data_change="raise"``; at the
            first epoch begin of a mid-epoch resume, if the checkpoint's epoch order
            (``providers/data``) is of shuffled NumPy arrays and this fit's input is not,
            or the other way round.
        CorruptCheckpointError: at the first epoch begin of a resume, if the
            checkpoint's ``providers/data`` record is not a permutation of the samples
            and a stream offset (the file is damaged).
        CheckpointInUseError: on train begin, if another ``StableCheckpoint``
            writer (another process, or another thread of this one) holds the
            directory, naming its pid and host; or if the newest checkpoint is
            locked by another process (for example open for writing): it is not
            damaged, so there is no fallback. Wait for the other process or use
            another directory.
        NewerFormatError: on train begin, if the newest checkpoint (or, past damaged
            ones, the next) was written by a newer keras_stable_state: it is left in
            place and there is no fallback. Upgrade keras_stable_state.
        NotADirectoryError: on train begin, if ``directory`` is a file.
        OSError: on train begin, if the directory or its lock file cannot be created or
            locked (permissions, a file system without ``flock``), naming it; on a read-only
            file system (``errno.EROFS``), if the ``fit`` has epochs left to train (a
            ``fit`` whose epochs are all done resumes from a read-only directory).
        StateError: on train begin, if the lock file is a symbolic link, a hard link of
            another file or not a regular file (it is never written through), if
            ``unreadable/`` is a symbolic link, or on a platform without ``flock``
            (Windows): StableCheckpoint does not run with its directory unlocked.
        ContractError, BindingError, DtypeMismatchError, ScheduleMismatchError:
            and any other error of [`keras_stable_state.restore_training_state`][keras_stable_state.restore_training_state]
            for a readable checkpoint that does not fit the model (the model or
            its compile arguments changed): fix the model; nothing is moved aside.

    Example:
        >>> model.fit(x, y, epochs=10, callbacks=[StableCheckpoint("ckpts", save_freq=50), EarlyStopping()])
    """

    def __init__(
        self,
        directory,
        save_freq="epoch",
        max_to_keep=3,
        verbose=0,
        callbacks=None,
        save_on_background=False,
        on_data_change="raise",
        *,
        monitor=None,
        mode="auto",
        keep_best=0,
        save_on_preemption=True,
        preemption_signals=preemption.DEFAULT_SIGNALS,
        storage_options=None,
        keep=_fit_checks.UNSET,
        async_save=_fit_checks.UNSET,
    ) -> None:
        super().__init__()
        directory = open_directory(directory, storage_options, "StableCheckpoint")[0]
        self.on_data_change = _fit_checks.check_on_data_change(on_data_change)
        max_to_keep = _fit_checks.resolve_alias("max_to_keep", max_to_keep, 3, "keep", keep, 2)
        save_on_background = _fit_checks.resolve_alias("save_on_background", save_on_background, False, "async_save", async_save, 2)  # fmt: skip
        _fit_checks.check_arguments(save_freq, max_to_keep, verbose, save_on_background, directory)
        self.preemption = preemption.FitPreemption(save_on_preemption, preemption_signals)
        opts = {"keep_best": keep_best, "monitor": monitor, "mode": mode, "verbose": verbose}
        opts.update(save_on_background=save_on_background, storage_options=storage_options)
        self.manager = CheckpointManager(directory, max_to_keep, **opts)
        self.manager.name = "StableCheckpoint"
        ref = weakref.ref(self)  # the manager holds no reference to the callback: no cycle
        self.manager.on_saved = lambda *args: ref()._saved(*args)
        self.directory = directory
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.verbose = int(verbose)
        self.save_on_background, self.storage_options = save_on_background, self.manager.storage_options
        self.run_complete = False
        self._metrics = {}  # the numeric logs of the last batch or epoch end: the next save's metrics
        self._where = {}  # step -> where in the fit its save was taken (for the verbose line)
        self._gated = None  # the model whose step boundaries this fit opens (_core.boundary)
        self._given_callbacks = checkpoint.check_callbacks(callbacks, "StableCheckpoint")
        self._reset(1)
        self._epoch_guard = None
        self._input = None
        self._order = _fit_input.EpochOrder()
        self.removed_temporary_files = []
        self._read_only = None

    @property
    def reached_preemption(self) -> bool:
        """Whether the last ``fit`` saved and stopped for a preemption signal."""
        return self.preemption.step is not None

    @property
    def last_save(self):
        """The [`SaveHandle`][keras_stable_state.SaveHandle] of the newest background save, or ``None``."""
        return self.manager.last_save

    def get_config(self):
        """The constructor arguments but ``callbacks`` (live objects: pass them again).

        Returns:
            ``{"directory", "save_freq", "max_to_keep", "verbose", "save_on_background",
            "on_data_change", "monitor", "mode", "keep_best", "storage_options",
            "save_on_preemption", "preemption_signals"}`` (the signals as ints).
        """
        config = {name: getattr(self, name) for name in _fit_checks.CONFIG_NAMES}
        return {**config, **self.preemption.config()}

    @classmethod
    def from_config(cls, config):
        """A ``StableCheckpoint`` from [`get_config`][keras_stable_state.StableCheckpoint.get_config]'s dict (plus ``callbacks=`` if given)."""
        return cls(**config)

    # -- discovery ------------------------------------------------------------------
    @property
    def _callbacks(self):
        """The callbacks given, and the ``History`` of the ``fit`` call (see ``checks.with_history``)."""
        return _fit_checks.with_history(self._given_callbacks, self.model)

    def _say(self, message) -> None:
        if self.verbose:
            compat.print_msg(f"StableCheckpoint: {message}")

    # -- files ------------------------------------------------------------------------
    def checkpoints(self) -> list:
        """Paths of the checkpoints in ``directory``, newest first."""
        return self.manager.checkpoints()

    def _providers(self):
        found = {"position": self._position, "metrics": Metrics(self.model), "data": self._order}
        if self._input is not None:
            found["input"] = self._input
        return found

    def _take_directory(self):
        """Create, lock, clean ``directory``; a read-only one is read unlocked (``_read_only``)."""
        self._read_only = None
        try:  # reclaimable: by another StableCheckpoint of this thread (this one's fit may have raised)
            self.removed_temporary_files = self.manager.lock(reclaimable=True)
        except OSError as err:
            if err.errno != errno.EROFS:
                raise
            self._read_only = err

    # -- restore ----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        spe = _fit_checks.steps_per_execution(model, self.save_freq)
        for opt in tracked_optimizers(model).values():
            stable = stable_optimizer_in(opt)
            if stable is not None:
                stable.bind(model)  # model.optimizer is opt (or an optimizer attribute): its owner
        # TensorFlow builds compiled metrics at the first trace: build them now, so that a
        # mid-epoch resume can put their saved values back (a no-op where fit built them).
        compat.build_compile_state(model)
        self._reset(spe)
        # A background save of an earlier fit (one that raised) is written before the
        # directory is read; its error belonged to that fit.
        wait_for_earlier_saves(self.directory)
        self._input = inexact.inspect_input()
        self._order = _fit_input.EpochOrder(compat.fit_epoch_iterator())
        inexact.warn_unsaved_callbacks(self, self._callbacks)
        try:
            self._take_directory()
            self._restore_newest()
            guard = _fit_checks.check_resume(self, self._position, self.restore_report, self._read_only)
            self._epoch_guard = guard
            self.preemption.begin(compat.fit_frame(), self._say)
        except BaseException:
            self.manager.release()  # fit stops here; Keras will not call on_train_end
            self.preemption.end()
            raise
        # From here, saves from other threads wait for a step boundary (on_train_batch_end).
        self._gated = model  # held as is: ``self.model`` would sync JAX's state at every step
        checkpoint.training_begins(model)

    def _reset(self, spe) -> None:
        """The state of a fit before its restore (``spe``: its ``steps_per_execution``);
        a background save in flight is dropped (its error belonged to an earlier fit)."""
        self._spe = spe
        self._position = Position(spe)
        self._pending_restore, self._rng_after_skip = None, None
        self._save_requested, self._skip_until, self._execution_begin = False, 0, 0
        self.restore_report = None
        self.skipped_checkpoints = []
        self.moved_checkpoints = []
        self.manager.drop_in_flight()

    def _restore_newest(self) -> None:
        restored = self.manager.restore_newest_with(
            self._restore, self._unreadable, read_only=self._read_only is not None
        )
        self.skipped_checkpoints = list(self.manager.skipped_checkpoints)
        self.moved_checkpoints = list(self.manager.moved_checkpoints)
        self.run_complete = resume.report_newest(
            self, restored, self._position, (self.params or {}).get("epochs"), self._say
        )

    def _unreadable(self, path, err) -> None:
        self._position = Position(self._spe)
        self._pending_restore = None
        self.restore_report = None

    def _restore(self, path, record) -> None:
        # Variables, optimizer, schedule check and position now; callbacks, metrics and
        # the epoch-start random state once every callback has run on_train_begin. All of
        # it from ``record``, the one read (and check) of the file: never read twice.
        options = checkpoint.RestoreOptions(state={"position": self._position}, include_rng=False)
        # take: only its state records are read after this; the variables may keep its arrays
        self.restore_report = checkpoint.restore_with(path, self.model, options, record=record, take=True)
        pos = self._position
        self._pending_restore = record
        writer = (self.restore_report.writer or {}).get("backend")
        inexact.warn_inexact_resume(self, record, pos, self._order.shuffle, writer)
        compat.set_initial_epoch(self.model, pos.epoch)
        self._say(
            f"restored {os.path.basename(path)}: epoch {pos.epoch}, step {pos.step} of the epoch, "
            f"global step {pos.global_step}"
        )

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.manager.check_for_errors()
        record, self._pending_restore = self._pending_restore, None
        saved_data = None
        if record is not None:
            args = (record, self.restore_report, self._callbacks, self.model, self._position, self._order)
            saved_data, self._rng_after_skip = resume.apply_pending(*args, self._input, self._skip_batches)
        elif self._save_requested:
            self._position.step = 0
            self._save()
        self._position.epoch = epoch
        if self._position.step == 0:
            # The random state before this epoch's data order is drawn, then the order.
            self._position.epoch_rng = state.rng_state()
            self._order.begin_epoch(saved_data)

    def _skip_batches(self, count) -> None:
        """Draw ``count`` batches (whole executions of ``steps_per_execution`` batches) from
        the data without training on them."""
        self._skip_until = count
        compat.skip_batches(self.model, count // self._spe, per_call=self._spe)

    # -- save -------------------------------------------------------------------------
    def on_train_batch_begin(self, batch, logs=None) -> None:
        self.manager.check_for_errors()
        guard, self._epoch_guard = self._epoch_guard, None
        if guard is not None:  # every callback's on_epoch_begin has run for the resumed epoch
            guard.after_epoch_begin()
        # With steps_per_execution=k, Keras calls this once per execution, with the
        # execution's first batch, and on_train_batch_end with its last.
        self._execution_begin = batch
        if batch < self._skip_until:
            return
        if self._rng_after_skip is not None:
            state.set_rng_state(self._rng_after_skip)
            self._rng_after_skip = None
        self._position.step = batch
        if self._save_requested:
            self._save()

    def on_train_batch_end(self, batch, logs=None) -> None:
        # A step boundary: a save waiting in another thread reads the model now (JAX: the
        # model property attaches the training state to the variables first).
        if self._gated is not None:
            checkpoint.step_boundary(self._gated, lambda: self.model)
        if batch < self._skip_until:  # a batch applied before the checkpoint, drawn and skipped
            return
        self._metrics = numeric_logs(logs)
        pos = self._position
        before = pos.global_step
        pos.end_execution(self._execution_begin, batch, (self.params or {}).get("steps"))
        if self.save_freq != "epoch" and pos.global_step // self.save_freq > before // self.save_freq:
            self._save_requested = True
        if self.preemption.reached(pos.global_step):
            self._preempt(pos)

    def on_epoch_end(self, epoch, logs=None) -> None:
        stop = self.preemption.at_epoch_end
        if self.preemption.step is not None and not stop:
            return  # stopped mid-epoch: the checkpoint, taken at that batch end, is the position
        self._metrics = numeric_logs(logs)
        self._skip_until = 0
        self._position.epoch = epoch + 1
        self._position.step = 0
        if self.save_freq == "epoch" or stop:  # a preemption's: written at train end, after every callback
            self._save_requested = True
        self.model.stop_training = self.model.stop_training or stop

    def on_train_end(self, logs=None) -> None:
        try:
            if self._save_requested:
                self._save()
            self.manager.wait()  # the last background save: waited for, and its failure raised
            record, self._pending_restore = self._pending_restore, None
            if record is not None:  # no epoch ran (the run was complete): the callbacks' states now
                resume.apply_callback_states(record, self.restore_report, self._callbacks)
        finally:
            if self._gated is not None:
                checkpoint.training_ends(self._gated)
                self._gated = None
            compat.set_initial_epoch(self.model, None)
            self.manager.release()
            self.preemption.end()

    def _preempt(self, pos) -> None:
        """A signal came (to any process): save this step, wait until it is written, stop."""
        steps = (self.params or {}).get("steps")
        last_batch = bool(steps) and pos.step >= steps  # then the epoch-end checkpoint, at train end
        received = self.preemption.stop(pos.global_step, last_batch)
        if not last_batch:
            self._save()
            self.manager.wait()
            self.model.stop_training = True
        self._say(f"{received} (preemption): checkpoint of global step {pos.global_step}; training stops")

    def _save(self) -> None:
        self._save_requested = False
        self.manager.wait()  # the previous background save ends first; its failure is raised
        pos = self._position
        if pos.step == 0:
            pos.epoch_rng = state.rng_state()
            self._order.stream_offset = compat.stream_position(self._order.epoch_iterator)
        self._where[pos.global_step] = f"epoch {pos.epoch}, step {pos.step}, global step {pos.global_step}"
        found = {"callbacks": self._callbacks, "state": self._providers()}
        self.manager.save(pos.global_step, self.model, metrics=self._metrics, epoch=pos.epoch, **found)

    def _saved(self, step, path, secs, blocked_secs) -> None:
        where = self._where.pop(step, f"global step {step}")
        if self.verbose:  # the size is read only for the line
            size = self.manager.files.size_of(path)
            self._say(saved_message(os.path.basename(path), where, size, secs, blocked_secs))
