"""``StableCheckpoint``: exact resume for ``model.fit``."""

from __future__ import annotations

import errno
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_stable_state import _core, _keras_compat, _state
from keras_stable_state._fit import checks, inexact, input, resume
from keras_stable_state._fit.position import Metrics, Position, numeric_logs
from keras_stable_state._manager import preemption
from keras_stable_state._manager.manager import CheckpointManager, wait_for_earlier_saves
from keras_stable_state._manager.opening import open_directory
from keras_stable_state._manager.records import saved_message
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer import stable_optimizer_in, tracked_optimizers
from keras_stable_state.errors import (
    InexactResumeWarning,
    UnreadableCheckpointWarning,
)

if TYPE_CHECKING:
    from keras_stable_state._core.report import RestoreReport
    from keras_stable_state._engines.background import SaveHandle
    from keras_stable_state._fit.checks import EpochBeginGuard


__all__ = ["StableCheckpoint", "UnreadableCheckpointWarning", "InexactResumeWarning"]


class StableCheckpoint(keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped (Any)
    """Checkpoints the whole training state during ``model.fit`` and resumes it exactly.

    On train begin it restores the newest readable checkpoint in ``directory`` and ``fit``
    continues at the next unseen batch; during ``fit`` it saves a ``ckpt-<global step>.h5``
    file every ``save_freq``, keeps the newest ``max_to_keep`` (and ``keep_best`` by ``monitor``),
    moves unreadable ones aside with an [`UnreadableCheckpointWarning`][keras_stable_state.UnreadableCheckpointWarning], locks
    the directory, and saves and stops on a preemption signal. In full (data order,
    callbacks, locks, ``*.orbax`` directories): [in detail](how-to/resume-fit.md#stablecheckpoint-in-detail),
    [Preemption](how-to/preemption.md).

    Examples:
        >>> ckpt = StableCheckpoint("ckpts", save_freq="epoch", max_to_keep=3)
        >>> history = model.fit(x, y, epochs=2, callbacks=[ckpt], verbose=0)  # resumes from ckpts/ if it holds a checkpoint

    Args:
        directory: Folder of the checkpoints (created; one per run): a path, ``file://``
            or object-store URL (``s3://``, ``gs://``).
        storage_options: fsspec options of an object-store directory, or ``None``.
        save_freq: ``"epoch"``, or save every that many batches (an ``int``, a multiple of
            the model's ``steps_per_execution``).
        max_to_keep: How many newest checkpoints to keep (``>= 1``; ``None``: all).
        verbose: ``1`` prints a line per restore and per save (file, size in MB, time in ms).
        callbacks: Callbacks to name, or outside the ``fit``: ``{name: callback}`` or a list; every
            other callback of the ``fit`` whose state is known (or has ``get_state()``) is saved too.
        save_on_background: ``True`` writes each checkpoint in a background thread; a
            failed write raises at the next batch, save or train end.
        on_data_change: ``"raise"`` (default) or ``"restart_epoch"``: what a mid-epoch
            resume does when batch size, sample count or steps per epoch changed.
        monitor: The ``fit`` log key (e.g. ``"val_loss"``) that ranks ``keep_best``, or ``None``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` for ``monitor``.
        keep_best: How many best checkpoints by ``monitor`` to keep beside the newest.
        resume_stopped: ``True`` trains on a run its callbacks stopped (``EarlyStopping``); by
            default such a run counts as finished (a preemption's stop is never one).
        save_on_preemption: Save and stop on a preemption signal (default ``True``).
        preemption_signals: The signals meaning preemption (default ``(signal.SIGTERM,)``).
        keep: Deprecated alias of ``max_to_keep``.
        async_save: Deprecated alias of ``save_on_background``.

    Attributes:
        manager (CheckpointManager): The [`CheckpointManager`][keras_stable_state.CheckpointManager] of ``directory``.
        run_complete (bool): ``True`` if the restored checkpoint is at or past ``fit``'s ``epochs``,
            or its run was stopped by a callback (see ``resume_stopped``): ``fit`` trains nothing.
        run_stopped (bool): ``True`` if ``run_complete`` because the run was stopped by a callback.
        restore_report (RestoreReport | None): The train-begin [`RestoreReport`][keras_stable_state.RestoreReport], or ``None``.
        skipped_checkpoints (list[tuple[str, str]]): ``(path, reason)`` of each unreadable checkpoint skipped.
        moved_checkpoints (list[tuple[str, str | None]]): ``(path, new path or None)`` of each, moved into ``unreadable/``.
        removed_temporary_files (list[str]): Stale ``.kss-*`` files removed on train begin.
        reached_preemption (bool): ``True`` once the last ``fit`` saved and stopped for a signal.
        last_save (SaveHandle | None): The newest background save's [`SaveHandle`][keras_stable_state.SaveHandle], or ``None``.

    Every argument, attribute and error in full: [in detail](how-to/resume-fit.md#arguments-of-stablecheckpoint-in-full).

    Raises:
        ValueError: On construction, for an invalid argument (named in the message).
        TypeError: On construction, for an argument of the wrong type.
        StorageBackendError: On construction, for a URL whose fsspec package is missing.
        StateError: A ``*.orbax`` directory without orbax-checkpoint; on train begin, a lock
            file that is a link, data that do not fit a mid-epoch checkpoint.
        CheckpointInUseError: On train begin, if another writer holds the directory.
        NewerFormatError: On train begin, for a checkpoint of a newer keras_stable_state.
        CorruptCheckpointError: On resume, for a damaged ``providers/`` record.
        OSError: A directory that cannot be created or locked (``NotADirectoryError``: a
            file); a failed background write.
        ContractError: Or another error of [`restore_training_state`][keras_stable_state.restore_training_state]
            (``BindingError``...) for a checkpoint that does not fit the model.
    """

    def __init__(
        self,
        directory: str | bytes | os.PathLike[str],
        save_freq: int | str = "epoch",
        max_to_keep: int | None = 3,
        verbose: int = 0,
        callbacks: Mapping[str, keras.callbacks.Callback] | Sequence[keras.callbacks.Callback] | None = None,
        save_on_background: bool = False,
        on_data_change: str = "raise",
        *,
        monitor: str | None = None,
        mode: str = "auto",
        keep_best: int = 0,
        save_on_preemption: bool = True,
        preemption_signals: Sequence[int] = preemption.DEFAULT_SIGNALS,
        storage_options: Mapping[str, Any] | None = None,
        resume_stopped: bool = False,
        keep: Any = checks.UNSET,
        async_save: Any = checks.UNSET,
    ) -> None:
        super().__init__()
        directory = open_directory(directory, storage_options, "StableCheckpoint")[0]
        self.on_data_change = checks.check_on_data_change(on_data_change)
        max_to_keep = checks.resolve_alias("max_to_keep", max_to_keep, 3, "keep", keep, 2)
        save_on_background = checks.resolve_alias("save_on_background", save_on_background, False, "async_save", async_save, 2)  # fmt: skip
        checks.check_arguments(save_freq, max_to_keep, verbose, save_on_background, directory)
        self.preemption = preemption.FitPreemption(save_on_preemption, preemption_signals)
        if not isinstance(resume_stopped, bool):
            raise TypeError(f"`resume_stopped` must be a bool. Received: resume_stopped={resume_stopped!r}")
        self.resume_stopped = resume_stopped
        opts: dict[str, Any] = {"keep_best": keep_best, "monitor": monitor, "mode": mode, "verbose": verbose}
        opts.update(save_on_background=save_on_background, storage_options=storage_options)
        self.manager = CheckpointManager(directory, max_to_keep, **opts)
        self.manager.name = "StableCheckpoint"
        ref = weakref.ref(self)  # the manager holds no reference to the callback: no cycle

        def on_saved(step: int, path: str, secs: float, blocked_secs: float | None) -> None:
            ckpt = ref()
            if ckpt is not None:
                ckpt._saved(step, path, secs, blocked_secs)

        self.manager.on_saved = on_saved
        self.directory = directory
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.verbose = int(verbose)
        self.save_on_background, self.storage_options = save_on_background, self.manager.storage_options
        self.run_complete = False
        self.run_stopped = False
        # the numeric logs of the last batch or epoch end: the next save's metrics
        self._metrics: dict[str, float] = {}
        self._where: dict[int, str] = {}  # step -> where in the fit its save was taken (for the verbose line)
        # the model whose step boundaries this fit opens (_core.boundary)
        self._gated: keras.Model | None = None
        self._given_callbacks = _core.check_callbacks(callbacks, "StableCheckpoint")
        self._keyed: dict[str, Any] | None = None  # the callbacks saved, from train begin to end
        self._reset(1)
        self._epoch_guard: EpochBeginGuard | None = None
        self._input: Any = None  # the fit's PyDataset (or tf.data TFDataState) whose state is saved, or None
        self._loader: Any = None  # the LoaderState of the fit's torch DataLoader, or None
        self._prefetched: Any = None  # the PrefetchedBatches of a PyDataset read by workers, or None
        self._order = input.EpochOrder()
        self.removed_temporary_files: list[str] = []
        self._read_only: OSError | None = None

    @property
    def reached_preemption(self) -> bool:
        """Whether the last ``fit`` saved and stopped for a preemption signal."""
        return self.preemption.step is not None

    @property
    def last_save(self) -> SaveHandle | None:
        """The [`SaveHandle`][keras_stable_state.SaveHandle] of the newest background save, or ``None``."""
        return self.manager.last_save

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments but ``callbacks`` (live objects: pass them again).

        Returns:
            The dict ``{"directory", "save_freq", "max_to_keep", "verbose", "save_on_background",
                "on_data_change", "monitor", "mode", "keep_best", "storage_options",
                "save_on_preemption", "preemption_signals"}`` (the signals as ints).
        """
        config = {name: getattr(self, name) for name in checks.CONFIG_NAMES}
        return {**config, **self.preemption.config()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> StableCheckpoint:
        """A ``StableCheckpoint`` from [`get_config`][keras_stable_state.StableCheckpoint.get_config]'s dict (plus ``callbacks=`` if given)."""
        return cls(**config)

    # -- discovery ------------------------------------------------------------------
    @property
    def _callbacks(self) -> dict[str, Any]:
        """``{key: callback}`` whose state is saved: during a ``fit``, the callbacks given and
        every callback of the ``fit`` whose state is known (``checks.fit_keyed``, found at
        train begin); else the callbacks given and ``model.history`` (``checks.with_history``)."""
        if self._keyed is not None:
            return self._keyed
        return checks.with_history(self._given_callbacks, self.model)

    def _say(self, message: str) -> None:
        if self.verbose:
            _keras_compat.print_msg(f"StableCheckpoint: {message}")

    # -- files ------------------------------------------------------------------------
    def checkpoints(self) -> list[str]:
        """Paths of the checkpoints in ``directory``, newest first."""
        return self.manager.checkpoints()

    def _providers(self) -> dict[str, Any]:
        found = {"position": self._position, "metrics": Metrics(self.model), "data": self._order}
        found.update(input=self._input, loader=self._loader or None, prefetched=self._prefetched)
        return {name: provider for name, provider in found.items() if provider is not None}

    def _take_directory(self) -> None:
        """Create, lock, clean ``directory``; a read-only one is read unlocked (``_read_only``)."""
        self._read_only = None
        try:  # reclaimable: by another StableCheckpoint of this thread (this one's fit may have raised)
            self.removed_temporary_files = self.manager.lock(reclaimable=True)
        except OSError as err:
            if err.errno != errno.EROFS:
                raise
            self._read_only = err

    # -- restore ----------------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        spe = checks.steps_per_execution(model, self.save_freq)
        for opt in tracked_optimizers(model).values():
            stable = stable_optimizer_in(opt)
            if stable is not None:
                stable.bind(model)  # model.optimizer is opt (or an optimizer attribute): its owner
        # TensorFlow builds compiled metrics at the first trace: build them now, so that a
        # mid-epoch resume can put their saved values back (a no-op where fit built them).
        _keras_compat.build_compile_state(model)
        self._reset(spe)
        # A background save of an earlier fit (one that raised) is written before the
        # directory is read; its error belonged to that fit.
        wait_for_earlier_saves(self.directory)
        self._input = inexact.inspect_input()
        self._loader = inexact.inspect_loader()
        self._prefetched = inexact.inspect_prefetched()
        self._order = input.EpochOrder(_keras_compat.fit_epoch_iterator())
        self._keyed = checks.fit_keyed(self._given_callbacks, _keras_compat.fit_callbacks(), self, model)
        try:
            self._take_directory()
            resume.restore_newest(self, _resume_mode(self.model))
            inexact.warn_counter_limit(model, self._position, self.params)
            guard = checks.check_resume(self, self._position, self.restore_report, self._read_only)
            self._epoch_guard = guard
            self.preemption.begin(_keras_compat.fit_frame(), self._say)
        except BaseException:
            self.manager.release()  # fit stops here; Keras will not call on_train_end
            self.preemption.end()
            self._keyed = None
            raise
        # From here, saves from other threads wait for a step boundary (on_train_batch_end).
        self._gated = model  # held as is: ``self.model`` would sync JAX's state at every step
        _core.training_begins(model)

    def _reset(self, spe: int) -> None:
        """The state of a fit before its restore (``spe``: its ``steps_per_execution``);
        a background save in flight is dropped (its error belonged to an earlier fit)."""
        self._spe = spe
        self._position = Position(spe)
        self._pending_restore: Any = None  # the record restored, until its epoch begins
        self._rng_after_skip: Any = None
        self._save_requested, self._skip_until, self._execution_begin = False, 0, 0
        self._last_mid_save: tuple[int, int] | None = None  # (epoch, global step) of the last mid-epoch save
        self.restore_report: RestoreReport | None = None
        self.skipped_checkpoints: list[tuple[str, str]] = []
        self.moved_checkpoints: list[tuple[str, str | None]] = []
        self.manager.drop_in_flight()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.manager.check_for_errors()
        record, self._pending_restore = self._pending_restore, None
        saved_data = None
        if record is not None:
            args = (record, self.restore_report, self._callbacks, self.model, self._position, self._order)
            saved_data, self._rng_after_skip = resume.apply_pending(
                *args, self._input, self._skip_batches, self._loader, self._prefetched
            )
        elif self._save_requested:
            self._position.step = 0
            self._save()
        self._position.epoch = epoch
        if self._position.step == 0:
            _begin_epoch(self)  # the random state before this epoch's data order is drawn, then the order
            self._order.begin_epoch(saved_data, epoch_rng=self._position.epoch_rng)

    def _skip_batches(self, count: int) -> None:
        """Draw ``count`` batches (whole executions of ``steps_per_execution`` batches) from
        the data without training on them."""
        self._skip_until = count
        _keras_compat.skip_batches(self.model, count // self._spe, per_call=self._spe)

    # -- save -------------------------------------------------------------------------
    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.manager.check_for_errors()
        guard, self._epoch_guard = self._epoch_guard, None
        if guard is not None:  # every callback's on_epoch_begin has run for the resumed epoch
            guard.after_epoch_begin()
        # With steps_per_execution=k, Keras calls this once per execution, with the
        # execution's first batch, and on_train_batch_end with its last.
        self._execution_begin = batch
        if batch < self._skip_until:
            return
        if self._loader:
            self._loader.note_draw(batch)
        if self._rng_after_skip is not None:
            _state.set_rng_state(self._rng_after_skip)
            self._rng_after_skip = None
        self._position.step = batch
        if self._save_requested:
            self._save()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # A step boundary: a save waiting in another thread reads the model now (JAX: the
        # model property attaches the training state to the variables first).
        if self._gated is not None:
            _core.step_boundary(self._gated, lambda: self.model)
        if batch < self._skip_until:  # a batch applied before the checkpoint, drawn and skipped
            if self._loader:
                self._loader.replay_draw(batch + 1)
            return
        if self._loader:
            self._loader.note_step(batch)
        self._metrics = numeric_logs(logs)
        pos = self._position
        before = pos.global_step
        pos.end_execution(self._execution_begin, batch, (self.params or {}).get("steps"))
        freq = self.save_freq  # "epoch" or an int (checks.check_arguments)
        if isinstance(freq, int) and pos.global_step // freq > before // freq:
            self._save_requested = True
        if self.preemption.reached(pos.global_step):
            self._preempt(pos)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        stop = self.preemption.at_epoch_end
        if self.preemption.step is not None and not stop:
            return  # stopped mid-epoch: the checkpoint, taken at that batch end, is the position
        self._metrics = numeric_logs(logs)
        self._skip_until = 0
        pos = self._position
        # An input of unknown length (a generator, grain, tf.data of unknown cardinality) makes
        # Keras begin one more batch before it finds the epoch's end: a save requested by the
        # epoch's last batch was taken there, mid-epoch, before the History and other
        # callbacks saw the epoch end. It is taken again at the boundary (the same step, replaced).
        redo = self._last_mid_save == (epoch, pos.global_step)
        pos.epoch = epoch + 1
        pos.step = 0
        # a preemption's (stop): written at train end, after every callback
        if self.save_freq == "epoch" or stop or redo:
            self._save_requested = True
        self.model.stop_training = self.model.stop_training or stop

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        try:
            if self._stopped_by_callbacks():
                pos = self._position
                epochs = (self.params or {}).get("epochs")
                pos.stopped = {"epoch": pos.epoch, "epochs": epochs, "global_step": pos.global_step}
                self._save_requested = True  # this position, recorded as stopped (replacing its save, if any)
            if self._save_requested:
                self._save()
            self.manager.wait()  # the last background save: waited for, and its failure raised
            record, self._pending_restore = self._pending_restore, None
            if record is not None:  # no epoch ran (the run was complete): the callbacks' states now
                resume.apply_callback_states(record, self.restore_report, self._callbacks)
        finally:
            if self._gated is not None:
                _core.training_ends(self._gated)
                self._gated = None
            _keras_compat.set_initial_epoch(self.model, None)
            self.manager.release()
            self.preemption.end()
            self._keyed = None  # the fit's callbacks are not held past it

    def _stopped_by_callbacks(self) -> bool:
        """Whether this ``fit`` trained and was stopped before its ``epochs`` by a callback
        (``model.stop_training``), not by a preemption signal (whose run resumes)."""
        epochs = (self.params or {}).get("epochs")
        return (
            self._pending_restore is None  # an epoch ran
            and bool(getattr(self._gated, "stop_training", False))
            and self.preemption.step is None
            and isinstance(epochs, int)
            and self._position.epoch < epochs
        )

    def _preempt(self, pos: Position) -> None:
        """A signal came (to any process): save this step, wait until it is written, stop."""
        steps: int | None = (self.params or {}).get("steps")
        # the last batch: then the epoch-end checkpoint, at train end
        last_batch = steps is not None and 0 < steps <= pos.step
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
            _begin_epoch(self)
            self._order.end_epoch()
            self._order.stream_offset = _keras_compat.stream_position(self._order.epoch_iterator)
        self._last_mid_save = (pos.epoch, pos.global_step) if pos.step else None
        note = getattr(self._input, "note_position", None)  # a tf.data input's TFDataState
        if note is not None:  # at an epoch end, the next batch comes from an iterator not made yet
            note(pos.step == 0 and not self._order.stream_offset)
        self._where[pos.global_step] = f"epoch {pos.epoch}, step {pos.step}, global step {pos.global_step}"
        found: dict[str, Any] = {"callbacks": self._callbacks, "state": self._providers()}
        self.manager.save(pos.global_step, self.model, metrics=self._metrics, epoch=pos.epoch, **found)

    def _saved(self, step: int, path: str, secs: float, blocked_secs: float | None) -> None:
        where = self._where.pop(step, f"global step {step}")
        if self.verbose:  # the size is read only for the line
            size = self.manager.files.size_of(path)
            self._say(saved_message(os.path.basename(path), where, size, secs, blocked_secs))


def _begin_epoch(ckpt: StableCheckpoint) -> None:
    """An epoch begins for ``ckpt``'s position (the random state before the epoch's data
    order is drawn), its torch ``DataLoader`` and its ``PyDataset`` workers' batches."""
    ckpt._position.epoch_rng = _state.rng_state()
    if ckpt._loader:
        ckpt._loader.begin_epoch()
    if ckpt._prefetched is not None:
        ckpt._prefetched.begin_epoch()


def _resume_mode(model: keras.Model) -> tuple[bool, bool]:
    """``(in place, read in place)`` of the resume into ``model``: in place (no copy of the old
    values kept) into a model whose values are worth nothing (`_never_trained`); the newest
    checkpoint read as for a restore in place then, or (all or nothing, the rollback copy on
    the host) into a model on an accelerator."""
    in_place = _never_trained(model)
    return in_place, in_place or _core.host_rollback.on_accelerator(model)


def _never_trained(model: keras.Model) -> bool:
    """Whether no optimizer ``model`` tracks has taken a step (every ``iterations`` is 0, or
    it has none yet): its values are initial ones, or ones the caller set before ``fit``."""
    for opt in tracked_optimizers(model).values():
        counter = getattr(opt, "iterations", None)  # Keras' step counter (a variable)
        if counter is not None and int(to_numpy(counter)) != 0:
            return False
    return True
