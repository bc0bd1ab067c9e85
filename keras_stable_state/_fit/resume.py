"""The restore side of a resumed ``model.fit``: the newest readable checkpoint of a
:class:`~keras_stable_state.StableCheckpoint`'s directory found at train begin, and
what its record puts back at the first epoch begin, once every callback has run
``on_train_begin`` (the callback states, the random states, the metric values, the
``fit`` input's own state and the epoch's data order)."""

from __future__ import annotations

import os

from keras_stable_state import _core as checkpoint
from keras_stable_state import _state as state
from keras_stable_state import format as storage
from keras_stable_state._fit.position import Metrics
from keras_stable_state.errors import (
    CheckpointFormatError,
    CheckpointInUseError,
    CorruptCheckpointError,
    NewerFormatError,
    StateError,
)


def restore_newest(paths, directory, restore, unreadable):
    """Read the checkpoints ``paths`` of ``directory`` (newest first) until one restores.

    Each file is read once (one open handle, every check made on the bytes read through
    it), and its record goes to ``restore(path, record)``, which restores everything
    from that record: a file replaced between the check and the restore cannot mix
    two files' state. A file that is unreadable
    (``CorruptCheckpointError``, ``CheckpointFormatError``, raised by the read or by
    ``restore``; a FIFO, device or other non-regular file; a symbolic link to nothing)
    goes to ``unreadable(path, err)`` and the next one is tried; a file removed since it
    was listed is skipped.

    Returns:
        The path restored, or ``None`` if none was left.

    Raises:
        CheckpointInUseError: if a checkpoint is locked by another process (it is not
            damaged, so there is no fallback), naming it and its holder.
        NewerFormatError: if a checkpoint was written by a newer keras_stable_state (it
            is not damaged: it is left in place, and there is no fallback).
        FileNotFoundError: if a file that still exists cannot be opened as such.
        Exception: any other error of ``restore`` (a checkpoint that does not fit the model).
    """
    for path in paths:
        try:
            record = storage.read_file(path)
            restore(path, record)
        except CheckpointInUseError as err:
            holder = f" ({err.holder})" if err.holder else ""
            raise CheckpointInUseError(
                f"Checkpoint {path!r}, the newest one left in {directory!r}, is in use by "
                f"another process{holder}: {err} It is not damaged, so StableCheckpoint does not fall "
                "back to an older checkpoint. Wait for that process to close it, or stop it, then fit "
                "again.",
                path=path,
                holder=err.holder,
            ) from err
        except FileNotFoundError as err:
            if os.path.islink(path):  # a symbolic link to nothing: unreadable, moved aside
                unreadable(path, err)
                continue
            if os.path.lexists(path):
                raise
            continue  # removed since it was listed: the next one is the newest
        except NewerFormatError as err:
            raise NewerFormatError(
                f"Checkpoint {path!r} in {directory!r} cannot be resumed from: {err} StableCheckpoint leaves "
                "it in place and does not fall back to an older checkpoint (that would train again what "
                "this one holds). Upgrade keras_stable_state, or move the file away yourself to resume "
                "from the one before it.",
                path=path,
                version=err.version,
                unknown=err.unknown,
            ) from err
        except (CorruptCheckpointError, CheckpointFormatError) as err:
            unreadable(path, err)
            continue
        return path
    return None


def apply_pending(record, report, callbacks, model, position, order, fit_input, skip_batches):
    """Put back what the restore at train begin left for the first epoch begin.

    Everything is checked first (callback states, both random states, metric values,
    the input state, the data order), then set: nothing is set if a check fails.

    Args:
        record: The restored checkpoint's record.
        report: Its :class:`~keras_stable_state.RestoreReport` (``"state:input"`` is
            appended to ``restored_state`` when the input's state is set).
        callbacks: ``{name: callback}`` whose saved state is put back.
        model: The ``fit`` model (its metric variables).
        position: The restored :class:`~keras_stable_state._fit.position.Position`.
        order: The fit's :class:`~keras_stable_state._fit.input.EpochOrder`.
        fit_input: The ``PyDataset`` whose own state is saved, or ``None``.
        skip_batches: Called with the number of batches to draw and skip (mid-epoch).

    Returns:
        ``(data, rng)``: the checked ``providers/data`` record of an epoch-boundary
        resume (else ``None``), and the random state at the save, to set once the
        skipped batches are drawn (a mid-epoch resume; else ``None``).

    Raises:
        StateError, CorruptCheckpointError: from the checks (see ``StableCheckpoint``).
    """
    setters = checkpoint.plan_callbacks(record, callbacks, report)
    extra, arrays = record.extra, record.arrays
    pos = position
    saved_rng = state.join_arrays(extra.get("rng"), arrays)
    parsed_saved = state.parse_rng_state(saved_rng)
    metrics, values = Metrics(model), None
    saved_input = input_state(fit_input, extra, arrays)
    saved_data = extra.get("providers", {}).get("data")
    if saved_data is not None:
        saved_data = order.check(state.join_arrays(saved_data, arrays), mid_epoch=pos.step > 0)
    if pos.step > 0:
        parsed_epoch = state.parse_rng_state(pos.epoch_rng)
        values = state.join_arrays(extra.get("providers", {}).get("metrics"), arrays)
        metrics.validate_state(values)
    for setter in setters:
        setter()
    if saved_input is not None:
        # Before the epoch's iterator exists, so before any worker prefetches a batch.
        fit_input.set_state(saved_input)
        report.restored_state.append("state:input")
    if pos.step > 0:
        # Replay the epoch's data order from the random state it was drawn with, skip
        # the batches already applied, then continue from the random state at the save
        # (e.g. Torch's unseeded dropout draws from the global generator every step).
        state.apply_rng_state(parsed_epoch)
        metrics.set_state(values)
        order.begin_epoch(saved_data, mid_epoch=True)
        skip_batches(pos.step)
        return None, saved_rng
    state.apply_rng_state(parsed_saved)
    return saved_data, None


def input_state(fit_input, extra, arrays):
    """The checked saved state of the ``fit`` input, or ``None`` when neither the
    checkpoint nor the input has one.

    Raises:
        StateError: if only one of the checkpoint (record ``providers/input``) and
            ``fit_input`` has an input state.
        CorruptCheckpointError: if the saved state is malformed (``state.check_provider_state``).
    """
    saved = extra.get("providers", {}).get("input")
    name = None if fit_input is None else type(fit_input).__name__
    if saved is None and fit_input is None:
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
            "get_state()/set_state()), but this fit's input has none: its order cannot be put "
            "back. Pass the same kind of input as when it was saved.",
            key="providers/input",
        )
    value = state.join_arrays(saved, arrays)
    return state.check_provider_state(fit_input, value, "providers/input")
