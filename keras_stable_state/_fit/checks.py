"""Checks of a resumed ``model.fit`` that [`StableCheckpoint`][keras_stable_state.StableCheckpoint]
makes on construction and train begin: the directory kind, the callbacks that Keras
runs ``on_epoch_begin`` of again for a resumed epoch, and the data size saved vs live.

On a mid-epoch resume Keras calls every callback's ``on_epoch_begin`` again for the
interrupted epoch: `EpochBeginGuard` puts the saved learning rate back once
they have run (so ``LearningRateScheduler`` is not applied twice) and warns about the
other callbacks whose ``on_epoch_begin`` may change training.
"""

from __future__ import annotations

import errno
import warnings
from typing import TYPE_CHECKING, Any, TypeVar

import keras

from keras_stable_state import _keras_compat, _state
from keras_stable_state._manager import orbax_io
from keras_stable_state._numpy import to_numpy
from keras_stable_state.errors import InexactResumeWarning, StateError

if TYPE_CHECKING:
    from keras_stable_state._core.report import RestoreReport
    from keras_stable_state._fit.position import Position

_T = TypeVar("_T")

ON_DATA_CHANGE = ("raise", "restart_epoch")
# StableCheckpoint.get_config's keys: its constructor arguments but ``callbacks`` and the aliases.
CONFIG_NAMES = ("directory", "save_freq", "max_to_keep", "verbose", "save_on_background", "on_data_change")
CONFIG_NAMES += ("monitor", "mode", "keep_best", "storage_options", "resume_stopped")

REPEATABLE_ATTR = "repeatable_epoch_begin"
"""A callback (class or instance) with this attribute ``True`` declares that its
``on_epoch_begin`` may run twice for one epoch without changing training."""

# on_epoch_begin changes nothing training uses (display, timing, a counter it resets),
# or only the learning rate (put back by EpochBeginGuard).
_HARMLESS = (
    keras.callbacks.ProgbarLogger,
    keras.callbacks.History,
    keras.callbacks.TensorBoard,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.CSVLogger,
    keras.callbacks.TerminateOnNaN,
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.RemoteMonitor,
    # swaps back only when its saved flag says the EMA weights are in the model
    keras.callbacks.SwapEMAWeights,
)
_LR_ONLY = (keras.callbacks.LearningRateScheduler,)


def with_history(given: dict, model) -> dict:
    """The callbacks ``given`` (``{name: callback}``), and the ``History`` of the ``fit`` call
    (``model.history``, which Keras sets for every fit) as ``"History/0"`` unless one is
    given, so that a resumed run's history is whole."""
    found = dict(given)
    history = getattr(model, "history", None) if model is not None else None
    listed = [cb for cb in found.values() if isinstance(cb, keras.callbacks.History)]
    if isinstance(history, keras.callbacks.History) and not listed:
        found.setdefault("History/0", history)
    return found


def fit_keyed(given: dict, fit_callbacks: list, ckpt: Any, model) -> dict:
    """The callbacks whose state ``ckpt`` saves and restores, ``{key: callback}``: those
    ``given`` (``{name: callback}``, keyed by their names), then every other callback of
    ``fit_callbacks`` (the ``fit``'s, in its order) whose state is known or self-described
    (``state.has_known_state``), keyed ``"<ClassName>/<i>"`` with ``i`` its position among
    those callbacks of its class name (0 for the first; the next free index where a given
    name takes that key), as a list given to ``StableCheckpoint(callbacks=[...])`` keys
    them; and the ``fit``'s ``History`` (`with_history`). ``ckpt`` itself is never one.
    A callback given and also in the ``fit`` is keyed once, by its given name."""
    found = dict(given)
    named = {id(cb) for cb in given.values()}
    counts: dict[str, int] = {}
    for cb in fit_callbacks:
        if cb is ckpt or id(cb) in named or not _state.has_known_state(cb):
            continue
        named.add(id(cb))  # a callback listed twice in the fit is keyed once
        name = type(cb).__name__
        i = counts.get(name, 0)
        while f"{name}/{i}" in found:
            i += 1
        counts[name] = i + 1
        found[f"{name}/{i}"] = cb
    return with_history(found, model)


def check_on_data_change(value) -> str:
    """``value`` if it is one of `ON_DATA_CHANGE`, else ``ValueError``."""
    if value not in ON_DATA_CHANGE:
        raise ValueError(
            f"`on_data_change` must be one of {list(ON_DATA_CHANGE)}. Received: on_data_change={value!r}"
        )
    return value


UNSET = object()
"""The default of a deprecated alias argument: not passed."""


def resolve_alias(
    new_name: str, new_value: _T, default: object, old_name: str, old_value: Any, stacklevel: int
) -> _T:
    """The value of the argument ``new_name``, given as ``new_value`` or through its deprecated
    alias ``old_name`` (``old_value``, `UNSET` when not passed), with a
    ``DeprecationWarning`` attributed to the ``stacklevel``-th caller for the alias.

    Raises:
        ValueError: if both the alias and the new name are passed.
    """
    if old_value is UNSET:
        return new_value
    if new_value is not default and new_value != default:
        raise ValueError(
            f"StableCheckpoint got both `{old_name}` and `{new_name}`: `{old_name}` is the deprecated "
            f"name of `{new_name}`. Pass only {new_name}=. Received: {old_name}={old_value!r}, "
            f"{new_name}={new_value!r}"
        )
    warnings.warn(
        f"StableCheckpoint(`{old_name}`=...) is deprecated and will be removed in the next release: "
        f"use `{new_name}`= (the name Keras' OrbaxCheckpoint and Orbax's CheckpointManager use).",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return old_value


def check_arguments(save_freq, max_to_keep, verbose, save_on_background, directory=None) -> None:
    """Refuse invalid ``StableCheckpoint`` arguments.

    Raises:
        StateError: for a ``directory`` named ``*.orbax`` when orbax-checkpoint is not installed.
        ValueError: if ``save_freq`` is not ``"epoch"`` or an int >= 1, ``max_to_keep`` not
            ``None`` or an int >= 1 (``True`` is refused for both), ``verbose`` not 0 or 1, or
            ``save_on_background`` is ``True`` for a ``directory`` named ``*.orbax``.
        TypeError: if ``save_on_background`` is not a bool.
    """
    # bool is an int in Python: save_freq=True or max_to_keep=True would silently mean 1.
    if save_freq != "epoch" and not (
        isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq >= 1
    ):
        raise ValueError(
            f"`save_freq` must be 'epoch' or an int >= 1 (a number of batches; not a bool). "
            f"Received: save_freq={save_freq!r} (of type {type(save_freq).__name__})"
        )
    if max_to_keep is not None and not (
        isinstance(max_to_keep, int) and not isinstance(max_to_keep, bool) and max_to_keep >= 1
    ):
        raise ValueError(
            "`max_to_keep` must be None or an int >= 1 (how many newest checkpoints to keep; "
            f"formerly `keep`; not a bool). Received: max_to_keep={max_to_keep!r} (of type "
            f"{type(max_to_keep).__name__})"
        )
    if verbose not in (0, 1) or isinstance(verbose, float):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    if not isinstance(save_on_background, bool):
        raise TypeError(
            "`save_on_background` (formerly `async_save`) must be True or False. Received: "
            f"save_on_background={save_on_background!r} (of type {type(save_on_background).__name__})"
        )
    if directory is not None:  # a '*.orbax' directory: Orbax installed, no background saves
        orbax_io.check_options(directory, save_on_background, "StableCheckpoint")


def refuse_read_only(directory, read_only, epochs, epoch, restored_epoch) -> None:
    """On a read-only file system (``read_only``: the ``OSError`` of the lock, else ``None``),
    refuse a ``fit`` that has epochs left to train (it could not save them): ``epoch`` is the
    position's, ``restored_epoch`` the restored checkpoint's (``None``: none restored).

    Raises:
        OSError: with ``errno.EROFS``, naming ``directory``.
    """
    if read_only is None or (epochs is not None and epoch >= epochs):
        return
    restored = (
        f"the model holds the restored checkpoint (epoch {restored_epoch})"
        if restored_epoch is not None
        else "no checkpoint was restored"
    )
    raise OSError(
        errno.EROFS,
        f"StableCheckpoint's directory {directory!r} is on a read-only file system: this fit "
        f"has epochs left to train (up to {epochs}) and could save none of them; {restored}. "
        "Give StableCheckpoint a writable folder (copy the checkpoints there to continue from them); "
        "a fit with no epoch left to train (epochs reached) resumes from a read-only folder.",
        directory,
    ) from read_only


def steps_per_execution(model, save_freq) -> int:
    """The ``steps_per_execution`` of a model about to ``fit`` (1 where unset).

    Raises:
        StateError: if the model is not built, or an int ``save_freq`` is not a multiple
            of it (such a save would fall inside an execution).
    """
    if not model.built:
        raise StateError(
            f"StableCheckpoint needs a built model to restore into; model {model.name!r} is not built. "
            "Call it on a batch or `model.build(input_shape)` before fit()."
        )
    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    if save_freq != "epoch" and save_freq % spe:
        raise StateError(
            f"StableCheckpoint(save_freq={save_freq}) asks for saves inside an execution: the "
            f"model was compiled with steps_per_execution={spe}, so callbacks see only every "
            f"{spe}th batch and a save after {save_freq} batches cannot be taken. Use a "
            f"save_freq that is a multiple of {spe} (e.g. {spe * max(1, round(save_freq / spe))}), "
            "or save_freq='epoch', or compile with a steps_per_execution that divides it.",
            key="save_freq",
            expected=f"a multiple of steps_per_execution={spe}",
            received=save_freq,
        )
    return spe


def _overrides_epoch_begin(cb) -> bool:
    if "on_epoch_begin" in vars(cb):  # LambdaCallback(on_epoch_begin=...) sets it on the instance
        return True
    return type(cb).on_epoch_begin is not keras.callbacks.Callback.on_epoch_begin


def _learning_rate(model):
    """The optimizer's learning rate as a float, or ``None`` (no optimizer, or a schedule)."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return None
    inner = opt
    while getattr(inner, "inner_optimizer", None) is not None:  # StableOptimizer, LossScaleOptimizer
        inner = inner.inner_optimizer
    variable = _keras_compat.learning_rate_variable(inner)
    if variable is None or isinstance(variable, keras.optimizers.schedules.LearningRateSchedule):
        return None
    return float(to_numpy(variable))


class EpochBeginGuard:
    """Undo what ``on_epoch_begin`` callbacks change when Keras runs them again for an
    epoch the checkpoint was saved inside.

    ``start`` (train begin, after the restore) remembers the restored learning rate and
    warns about the other callbacks; ``after_epoch_begin`` (the first batch begin the
    checkpoint callback sees, when every callback's ``on_epoch_begin`` has run) assigns it
    back if a callback changed it.
    """

    def __init__(self, model, learning_rate):
        self.model = model
        self.learning_rate = learning_rate

    @classmethod
    def start(cls, ckpt: Any, position: Position) -> EpochBeginGuard | None:
        """The guard for a resume inside epoch ``position.epoch`` (``None`` when the
        checkpoint was saved at an epoch boundary or none was restored); issues an
        [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] per callback of the fit whose
        ``on_epoch_begin`` may change training when run twice."""
        if ckpt.restore_report is None:
            return None
        callbacks = _keras_compat.fit_callbacks()
        if position.step == 0:
            _warn_listed_before(ckpt, callbacks, position.epoch)
            return None
        for cb in callbacks:
            if cb is ckpt or not _overrides_epoch_begin(cb) or isinstance(cb, _HARMLESS + _LR_ONLY):
                continue
            if getattr(cb, REPEATABLE_ATTR, False) is True:
                continue
            _warn(cb, position.epoch, position.step)
        return cls(ckpt.model, _learning_rate(ckpt.model))

    def after_epoch_begin(self) -> None:
        if self.learning_rate is None:
            return
        now = _learning_rate(self.model)
        if now is not None and now != self.learning_rate:
            self.model.optimizer.learning_rate = self.learning_rate  # as LearningRateScheduler sets it


def _warn(cb, epoch, step):
    name = type(cb).__name__
    warnings.warn(
        f"StableCheckpoint: the callback {name} of this fit overrides on_epoch_begin, and the "
        f"checkpoint was saved inside epoch {epoch} (after batch {step}), whose on_epoch_begin already "
        "ran before the save: Keras runs it again for that epoch when fit resumes. StableCheckpoint "
        "puts the saved learning rate back after it; any other change it makes there (weights, data, "
        "other state) is applied a second time, and the resume is not exact. Make it act only once "
        f"per epoch and set `{REPEATABLE_ATTR} = True` on it, or save at epoch ends "
        "(save_freq='epoch').",
        InexactResumeWarning,
        stacklevel=4,
    )


def _warn_listed_before(ckpt, callbacks, epoch):
    """At an epoch-boundary resume, the epoch-end save is written in the next epoch's
    ``on_epoch_begin``: callbacks listed before StableCheckpoint had already run it."""
    if ckpt not in callbacks:
        return
    for cb in callbacks[: callbacks.index(ckpt)]:
        if not _overrides_epoch_begin(cb) or isinstance(cb, _HARMLESS):
            continue
        if not isinstance(cb, _LR_ONLY) and getattr(cb, REPEATABLE_ATTR, False) is True:
            continue
        name = type(cb).__name__
        warnings.warn(
            f"StableCheckpoint: the callback {name} is listed before StableCheckpoint and overrides "
            f"on_epoch_begin. The checkpoint of the end of epoch {epoch - 1} was written when epoch "
            f"{epoch} began, after {name}'s on_epoch_begin for epoch {epoch} had run (e.g. a "
            "learning rate already scheduled for it), and Keras runs it again for that epoch when fit "
            "resumes, so its change is applied twice. List StableCheckpoint before it in "
            "fit(callbacks=[...]) to resume exactly.",
            InexactResumeWarning,
            stacklevel=4,
        )


# -- the size of the data -------------------------------------------------------------------
_DATA_FIELDS = ("batch_size", "num_samples", "steps")


def check_resume(
    ckpt: Any, pos: Position, report: RestoreReport | None, read_only: OSError | None
) -> EpochBeginGuard | None:
    """The train-begin checks of ``ckpt`` after its restore (``report``: the restore's, or
    ``None``): the data size (``pos.step = 0`` for ``on_data_change="restart_epoch"``) and a
    read-only directory (``read_only``: its error, or ``None``); the number of
    ``tf.distribute`` replicas (`warn_replicas`); the guard of the
    ``on_epoch_begin`` callbacks Keras runs again for a resumed epoch."""
    guard = EpochBeginGuard.start(ckpt, pos)
    live = live_data(ckpt.params)
    replicas = _keras_compat.replica_count(ckpt.model)
    if replicas is not None:  # recorded on TensorFlow only; older checkpoints have none
        live["replicas"] = replicas
        if report is not None:
            warn_replicas(ckpt.model, pos.saved_data, replicas)
    if report is not None and check_data(pos.saved_data, live, pos, ckpt.on_data_change):
        pos.step = 0  # on_data_change="restart_epoch": the interrupted epoch from its first batch
    pos.data = live
    restored = None if report is None else pos.epoch
    refuse_read_only(ckpt.directory, read_only, (ckpt.params or {}).get("epochs"), pos.epoch, restored)
    return guard


def warn_replicas(model, saved, live: int) -> None:
    """Warn when the checkpoint was saved on another number of ``tf.distribute`` replicas
    (``saved``: its data facts, whose ``"replicas"`` older checkpoints lack) than ``live``
    and ``model`` has layers whose results depend on it: ``BatchNormalization`` (statistics
    of each replica's share of the batch; with ``synchronized=True`` reduced across the
    replicas by another computation: 4e-4 off after 8 steps, measured) and layers that draw
    random numbers (each replica draws its own dropout masks and noise)."""
    count = saved.get("replicas") if isinstance(saved, dict) else None
    if _count(count) is None or count == live:
        return
    layers = sorted(
        layer.name
        for layer in _keras_compat.flatten_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization) or _keras_compat.seed_generator_states(layer)
    )
    if not layers:
        return  # the results differ by the order of the reductions only
    warnings.warn(
        f"StableCheckpoint: the checkpoint was saved on {count} tf.distribute replicas and "
        f"training resumes on {live}: the layers {layers} compute per replica (BatchNormalization "
        "normalizes each replica's share of the batch, or with synchronized=True reduces its "
        "statistics across the replicas by another computation; Dropout and other random layers "
        "draw per replica), so the resumed run trains like an uninterrupted one only up to that. "
        f"Resume on {count} replicas for an exact continuation.",
        InexactResumeWarning,
        stacklevel=4,
    )


def live_data(params) -> dict:
    """``{"batch_size", "num_samples", "steps"}`` of this fit (``None`` where unknown):
    the data adapter's batch size and sample count, and the steps per epoch Keras runs
    (`check_resume` adds ``"replicas"`` on TensorFlow, see `warn_replicas`)."""
    adapter = _keras_compat.fit_data_adapter()
    batch_size = num_samples = None
    if adapter is not None:
        batch_size = _count(_property(adapter, "batch_size"))
        batches = _count(_property(adapter, "num_batches"))
        partial = _count(_property(adapter, "partial_batch_size")) or 0
        if batch_size and batches and _property(adapter, "has_partial_batch") is not None:
            num_samples = (batches - 1) * batch_size + partial if partial else batches * batch_size
    return {
        "batch_size": batch_size,
        "num_samples": num_samples,
        "steps": _count((params or {}).get("steps")),
    }


def _property(adapter, name):
    """A ``DataAdapter`` property, or ``None`` where the adapter does not define it (the
    base class raises ``NotImplementedError``, e.g. ``PyDatasetAdapter.partial_batch_size``)."""
    try:
        return getattr(adapter, name, None)
    except NotImplementedError:
        return None


def _count(value):
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _differences(saved, live) -> list:
    if not isinstance(saved, dict):
        return []  # a checkpoint written before these facts were saved
    return [
        (field, saved.get(field), live[field])
        for field in _DATA_FIELDS
        if _count(saved.get(field)) is not None
        and live[field] is not None
        and saved.get(field) != live[field]
    ]


def check_data(saved, live, position, on_data_change) -> bool:
    """Compare the data facts saved in the position record with this fit's.

    Returns ``True`` when the interrupted epoch is to restart from its first batch
    (``on_data_change="restart_epoch"`` and a mid-epoch checkpoint whose data differ).

    Raises:
        StateError: for a mid-epoch checkpoint whose batch size, number of samples or
            steps per epoch differ and ``on_data_change="raise"``.

    Warns:
        InexactResumeWarning: for an epoch-boundary checkpoint whose data differ, and
            for a restarted epoch.
    """
    diffs = _differences(saved, live)
    if not diffs:
        return False
    shown = ", ".join(f"{f} saved {s}, now {n}" for f, s, n in diffs)
    if position.step == 0:
        warnings.warn(
            f"StableCheckpoint: the data of this fit differ from those the checkpoint (end of epoch "
            f"{position.epoch - 1}) was saved with ({shown}): training continues at epoch "
            f"{position.epoch} with the new data, so it does not end like an uninterrupted run. If "
            "this is on purpose, ignore this warning; otherwise pass the same data and batch_size.",
            InexactResumeWarning,
            stacklevel=3,
        )
        return False
    if on_data_change == "raise":
        raise StateError(
            f"The checkpoint was saved after batch {position.step} of epoch {position.epoch} with other "
            f"data than this fit's ({shown}): skipping {position.step} batches of these data would "
            "not skip the samples already trained on. Pass the same data and batch_size, or "
            'StableCheckpoint(..., on_data_change="restart_epoch") to train epoch '
            f"{position.epoch} again from its first batch with these data.",
            key="providers/position/data",
            expected={f: s for f, s, _ in diffs},
            received={f: n for f, _, n in diffs},
        )
    warnings.warn(
        f"StableCheckpoint: the data of this fit differ from those the checkpoint was saved with "
        f"({shown}); on_data_change='restart_epoch': epoch {position.epoch} is trained again from its "
        f"first batch with these data, on top of the {position.step} batches of it already applied.",
        InexactResumeWarning,
        stacklevel=3,
    )
    return True
