"""The restore side of a resumed ``model.fit``: what the record of the checkpoint
restored at train begin (by the [`CheckpointManager`][keras_stable_state.CheckpointManager] under a
[`StableCheckpoint`][keras_stable_state.StableCheckpoint]) puts back at the first epoch begin, once every callback has run
``on_train_begin`` (the callback states, the random states, the metric values, the
``fit`` input's own state and the epoch's data order)."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras

from keras_stable_state import _core, _keras_compat, _state
from keras_stable_state._fit import inexact
from keras_stable_state._fit.loss_units import loss_units
from keras_stable_state._fit.position import Metrics, Position
from keras_stable_state._manager import directory
from keras_stable_state.errors import InexactResumeWarning, StateError

if TYPE_CHECKING:
    from keras_stable_state._core.report import RestoreReport
    from keras_stable_state._fit.input import EpochOrder
    from keras_stable_state._fit.loader import LoaderState
    from keras_stable_state._fit.prefetch import PrefetchedBatches


def restore_newest(ckpt, mode: tuple[bool, bool]) -> None:
    """Restore at train begin the newest readable checkpoint of the ``StableCheckpoint``
    ``ckpt`` into its model (``mode``: in place, and read in place), falling back past
    unreadable ones (`restore_found`, `forget_unreadable`), and say what it found
    (`report_newest`).

    Raises:
        The errors of ``CheckpointManager.restore_newest_with`` and
        ``restore_training_state`` (a checkpoint that does not fit the model).
    """
    in_place, reads = mode
    restored = ckpt.manager.restore_newest_with(
        functools.partial(restore_found, ckpt, in_place),
        functools.partial(forget_unreadable, ckpt),
        read_only=ckpt._read_only is not None,
        in_place=reads,
    )
    ckpt.skipped_checkpoints = list(ckpt.manager.skipped_checkpoints)
    ckpt.moved_checkpoints = list(ckpt.manager.moved_checkpoints)
    pos = ckpt._position
    if restored is not None and ckpt._pending_restore is not None:  # before report_newest resets pos.stopped
        inexact.warn_resumed_callbacks(ckpt, ckpt._pending_restore, os.path.basename(restored), pos)
    epochs = (ckpt.params or {}).get("epochs")
    ckpt.run_complete = report_newest(ckpt, restored, pos, epochs, ckpt._say)
    ckpt.run_stopped = ckpt.run_complete and pos.stopped is not None
    if ckpt.run_stopped and isinstance(epochs, int):  # fit trains no epoch: range(epochs, epochs)
        _keras_compat.set_initial_epoch(ckpt.model, max(epochs, pos.epoch))
    # an in-place restore failed part way and none after it succeeded: fit made its
    _core.check_not_partial(ckpt.model, "StableCheckpoint")  # train function already


def forget_unreadable(ckpt, path: str, err: BaseException) -> None:
    """Forget what a checkpoint found unreadable put into ``ckpt`` (the manager moves on)."""
    ckpt._position = Position(ckpt._spe)
    ckpt._pending_restore = None
    ckpt.restore_report = None


def restore_found(ckpt, in_place: bool, path: str, record: Any) -> None:
    """Restore the checkpoint ``path`` (its ``record`` read and checked once) into ``ckpt``'s
    model: variables, optimizer, schedule check and position now; callbacks, metrics and the
    epoch-start random state at the first epoch begin (`apply_pending`), once every callback
    has run ``on_train_begin``. All of it from ``record``: the file is never read twice."""
    options = _core.RestoreOptions(state={"position": ckpt._position}, include_rng=False)
    options = dataclasses.replace(options, include_metrics=False, all_or_nothing=not in_place)
    # take: only its state records are read after this; the variables may keep its arrays.
    # Without defer, restore_with restores now: a RestoreReport.
    report = _core.restore_with(path, ckpt.model, options, record=record, take=True)
    ckpt.restore_report = report
    pos = ckpt._position
    ckpt._pending_restore = record
    writer = (report.writer or {}).get("backend")
    inexact.warn_inexact_resume(ckpt, record, pos, ckpt._order, writer)
    _keras_compat.set_initial_epoch(ckpt.model, pos.epoch)
    ckpt._say(
        f"restored {os.path.basename(path)}: epoch {pos.epoch}, step {pos.step} of the epoch, "
        f"global step {pos.global_step}"
    )


def report_newest(ckpt, restored, pos, epochs, say) -> bool:
    """Say what the restore at train begin of the ``StableCheckpoint`` ``ckpt`` found
    (``say``: its verbose printer): the [`UnreadableCheckpointWarning`][keras_stable_state.UnreadableCheckpointWarning] for the checkpoints it moved
    aside, or (verbose) that it starts fresh, or that the run is complete. Whether the run
    is complete: the checkpoint ``restored`` (a path, or ``None``) is at or past ``epochs``
    (``pos``: its position), or its run was stopped by a callback (`stopped_run`)."""
    if ckpt.skipped_checkpoints:
        where = f"epoch {pos.epoch}, step {pos.step} of the epoch, global step {pos.global_step}"
        directory.warn_unreadable(
            ckpt.directory, ckpt.skipped_checkpoints, ckpt.moved_checkpoints, restored, where, stacklevel=2
        )
    elif restored is None:
        say(f"no checkpoint in {ckpt.directory}; starting fresh")
    complete = restored is not None and epochs is not None and pos.epoch >= epochs
    if restored is not None and not complete and stopped_run(ckpt, pos, epochs):
        return True
    pos.stopped = None  # trained on: the next checkpoints are of a running run
    if complete:
        say(
            f"the run in {ckpt.directory} is complete (epoch {pos.epoch} of {epochs}, global step "
            f"{pos.global_step}): fit trains no epoch and returns the restored History; pass a "
            "larger `epochs` to train on"
        )
    return complete


def stopped_run(ckpt, pos, epochs) -> bool:
    """Whether the restored run (position ``pos``) was stopped by a callback and this ``fit``
    (of ``epochs``) trains nothing, as for a run that finished its epochs: unless ``ckpt``
    has ``resume_stopped=True`` or ``epochs`` is more than the stopped fit's. Says so once,
    printed whatever ``verbose`` (a run that trains nothing is never silent)."""
    stopped = pos.stopped
    if stopped is None or ckpt.resume_stopped or epochs is None or epochs > stopped["epochs"]:
        return False
    _keras_compat.print_msg(
        f"StableCheckpoint: the run in {ckpt.directory} was stopped by a callback (EarlyStopping, or "
        f"model.stop_training set) at epoch {stopped['epoch']} of {stopped['epochs']} (global step "
        f"{pos.global_step}): it counts as finished, so fit trains no epoch and returns the restored "
        f"History. To train on, pass a larger `epochs` (more than {stopped['epochs']}), or "
        "StableCheckpoint(..., resume_stopped=True) to continue it to this fit's epochs."
    )
    return True


def apply_pending(
    record: Any,
    report: RestoreReport | None,
    callbacks: dict[str, Any],
    model: keras.Model,
    position: Position,
    order: EpochOrder,
    fit_input: Any,
    skip_batches: Callable[[int], None],
    fit_loader: LoaderState | None = None,
    prefetched: PrefetchedBatches | None = None,
) -> tuple[Any, Any]:
    """Put back what the restore at train begin left for the first epoch begin.

    Everything is checked first (callback states, both random states, metric values (their
    per-output loss means converted where counted in another unit, `loss_units`), the
    batches a PyDataset's workers carried into the epoch,
    the input state, the data order), then set: nothing is set if a check fails.

    Args:
        record: The restored checkpoint's record.
        report: Its [`RestoreReport`][keras_stable_state.RestoreReport] (``"state:input"`` is
            appended to ``restored_state`` when the input's state is set).
        callbacks: ``{name: callback}`` whose saved state is put back.
        model: The ``fit`` model (its metric variables).
        position: The restored `Position`.
        order: The fit's `EpochOrder`.
        fit_input: The ``PyDataset`` whose own state is saved, or ``None``.
        skip_batches: Called with the number of batches to draw and skip (mid-epoch).
        fit_loader: The `LoaderState` of a ``DataLoader`` input, or ``None``: its
            generators are set to the epoch begin's.
        prefetched: The `PrefetchedBatches` of a ``PyDataset`` read by workers, or
            ``None``: the saved batches its enqueuer carried into the epoch are put back.

    Returns:
        ``(data, rng)``: the checked ``providers/data`` record of an epoch-boundary
        resume (else ``None``), and the random state at the save, to set once the
        skipped batches are drawn (a mid-epoch resume; else ``None``).

    Raises:
        StateError, CorruptCheckpointError: from the checks (see ``StableCheckpoint``).
    """
    setters = _core.plan_callbacks(record, callbacks, report)
    extra, arrays = record.extra, record.arrays
    pos = position
    saved_rng = _state.join_arrays(extra.get("rng"), arrays)
    parsed_saved = _state.parse_rng_state(saved_rng)
    metrics, values = Metrics(model), None
    saved_input = input_state(fit_input, extra, arrays)
    saved_loader = loader_state(fit_loader, extra, arrays, record)
    saved_prefetched = extra.get("providers", {}).get("prefetched")
    if saved_prefetched is not None and prefetched is not None:
        saved_prefetched = prefetched.check(
            _state.join_arrays(saved_prefetched, arrays), getattr(record, "path", None)
        )
    saved_data = extra.get("providers", {}).get("data")
    if saved_data is not None:
        saved_data = order.check(_state.join_arrays(saved_data, arrays), mid_epoch=pos.step > 0)
    if pos.step > 0:
        parsed_epoch = _state.parse_rng_state(pos.epoch_rng)
        values = _state.join_arrays(extra.get("providers", {}).get("metrics"), arrays)
        metrics.validate_state(values)
        units = loss_units(model, values, pos.step)
        if units is not None and units.convertible:  # per-output means counted in the other unit
            values = {**values, "values": units.convert(values["values"])}
    for setter in setters:
        setter()
    if saved_input is not None:
        # Before the epoch's iterator exists, so before any worker prefetches a batch.
        fit_input.set_state(saved_input)
        report.restored_state.append("state:input")
    if saved_loader is not None:
        # Before Keras makes the epoch's iterator, which draws the order and worker seeds.
        fit_loader.resume(saved_loader)
        report.restored_state.append("state:loader")
    if saved_prefetched is not None and prefetched is not None:
        # Before the epoch's workers start, which serve these first.
        prefetched.resume(saved_prefetched)
        report.restored_state.append("state:prefetched")
    if pos.step > 0:
        # Replay the epoch's data order from the random state it was drawn with, skip
        # the batches already applied, then continue from the random state at the save
        # (e.g. Torch's unseeded dropout draws from the global generator every step).
        _state.apply_rng_state(parsed_epoch)
        metrics.set_state(values)
        order.begin_epoch(saved_data, mid_epoch=True)
        skip_batches(pos.step)
        if saved_rng.get("torch") is not None and keras.backend.backend() != "torch":
            # Off the Torch backend only the data pipeline draws from Torch's generator (a
            # DataLoader's sampler, its dataset), which the skipped batches replay; its state
            # at the save is not set after them: TensorFlow's from_generator may have drawn
            # batches ahead of the step saved, a timing-dependent state.
            saved_rng = {**saved_rng, "torch": None}
        return None, saved_rng
    _state.apply_rng_state(parsed_saved)
    return saved_data, None


def apply_callback_states(record: Any, report: RestoreReport | None, callbacks: dict[str, Any]) -> None:
    """Put back the saved states of ``callbacks`` (``{name: callback}``) from ``record``, all
    checked before any is set: a resumed ``fit`` with no epoch left to train (its run was
    complete) runs no epoch begin, so `apply_pending` never runs; its ``History``
    (``model.history``, returned by ``fit``) then holds the restored history.

    Raises:
        StateError, CorruptCheckpointError: from the checks (see ``plan_callbacks``).
    """
    for setter in _core.plan_callbacks(record, callbacks, report):
        setter()


def loader_state(fit_loader, extra, arrays, record):
    """The checked saved state of a ``DataLoader`` input (record ``providers/loader``),
    or ``None``: none saved, or none to set. A checkpoint written without it (by an
    older version) was warned about at train begin (``inexact.warn_inexact_resume``).

    Raises:
        StateError: if the checkpoint holds a ``DataLoader``'s generator states and this
            fit's input has none (another kind of input, or a loader without generators),
            or other ones (`LoaderState.check`).
        CorruptCheckpointError: if the saved state is malformed.
    """
    saved = extra.get("providers", {}).get("loader")
    if saved is None:
        return None
    gens = saved.get("epoch", {}).get("generators") if isinstance(saved.get("epoch"), dict) else None
    if not fit_loader and not gens and not saved.get("epoch", {}).get("samplers"):
        return None  # (Torch backend) a loader of the global generator only: nothing of its own to set
    if not fit_loader:
        raise StateError(
            "The checkpoint holds the generator states of its fit input (a torch DataLoader with a "
            "generator= or a sampler holding one), but this fit's input has none: its order cannot be "
            "put back. Pass the same kind of input, made the same way, as when it was saved.",
            key="providers/loader",
        )
    return fit_loader.check(_state.join_arrays(saved, arrays), getattr(record, "path", None))


def input_state(fit_input, extra, arrays):
    """The checked saved state of the ``fit`` input, or ``None`` when neither the
    checkpoint nor the input has one.

    Raises:
        StateError: if only one of the checkpoint (record ``providers/input``) and
            ``fit_input`` has an input state.
        CorruptCheckpointError: if the saved state is malformed (``state.check_provider_state``).
    """
    saved = extra.get("providers", {}).get("input")
    name = None if fit_input is None else getattr(fit_input, "input_name", type(fit_input).__name__)
    if saved is None and fit_input is None:
        return None
    if saved is None and getattr(fit_input, "optional_state", False):
        if not getattr(fit_input, "hooked", False):
            return None  # nothing but its seeds would have been saved
        warnings.warn(
            f"StableCheckpoint: the checkpoint holds no state of the fit input {name} (it was "
            "written by a version that did not save a tf.data pipeline's random state): the "
            "resumed epoch replays another order from a fresh iterator. Let the epoch finish "
            "before an interruption, or accept the difference.",
            InexactResumeWarning,
            stacklevel=_keras_compat.outside_stacklevel(),
        )
        return None
    if saved is None:
        raise StateError(
            f"The fit input {name} defines get_state()/set_state(), but the checkpoint holds no "
            "input state (it was saved from an input without them): its order cannot be put "
            "back. Resume with the input the checkpoint was saved with, or start a new run in "
            "another directory.",
            key="providers/input",
        )
    if fit_input is None:
        raise StateError(
            "The checkpoint holds the state of its fit input (a keras.utils.PyDataset with "
            "get_state()/set_state(), or a tf.data pipeline that reshuffles), but this fit's "
            "input has none: its order cannot be put back. Pass the same kind of input as "
            "when it was saved.",
            key="providers/input",
        )
    value = _state.join_arrays(saved, arrays)
    return _state.check_provider_state(fit_input, value, "providers/input")
