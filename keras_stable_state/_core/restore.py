"""``restore_training_state``: its arguments checked, the file read, and the record restored
(by `restore_record`), now or, with ``defer=True``,
by a [`PendingRestore`][keras_stable_state.PendingRestore] once the model is built.

`restore_with` is the verb with its options grouped (`RestoreOptions`)
and the record optionally given already read: what a [`PendingRestore`][keras_stable_state.PendingRestore] and
[`restore_training_state_from_bytes`][keras_stable_state.restore_training_state_from_bytes] call.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast, overload

import keras

from keras_stable_state import format
from keras_stable_state._core import host_rollback, mappers
from keras_stable_state._core.apply import takes_unaligned
from keras_stable_state._core.arguments import (
    check_callbacks,
    check_filepath,
    check_flags,
    check_model,
    check_optimizers,
    check_providers,
    check_rename,
    check_variables,
)
from keras_stable_state._core.guards import builds_undone_on_refusal, gc_paused, memory_refused
from keras_stable_state._core.plan import restore_record
from keras_stable_state._core.report import RestoreReport
from keras_stable_state._core.requests import RestoreOptions, RestoreRequest
from keras_stable_state._engines import dispatch, object_store
from keras_stable_state._identity.keys import file_label
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._optimizer.torch_optim import split_optimizers
from keras_stable_state.errors import StateError
from keras_stable_state.format.proven import close_files
from keras_stable_state.format.record import BY_KEY

__all__ = ["PendingRestore", "restore_training_state", "restore_with"]


@overload
def restore_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = ...,
    strict: bool = ...,
    allow_cast: bool = ...,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = ...,
    state: Mapping[str, Any] | None = ...,
    include_rng: bool = ...,
    include_metrics: bool = ...,
    check_schedule: bool = ...,
    variables: Mapping[str, keras.Variable] | None = ...,
    prefix: str | None = ...,
    rename: Sequence[tuple[str, str]] | None = ...,
    keep_learning_rate: bool = ...,
    all_or_nothing: bool = ...,
    defer: Literal[True],
    storage_options: Mapping[str, Any] | None = ...,
) -> PendingRestore: ...


@overload
def restore_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = ...,
    strict: bool = ...,
    allow_cast: bool = ...,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = ...,
    state: Mapping[str, Any] | None = ...,
    include_rng: bool = ...,
    include_metrics: bool = ...,
    check_schedule: bool = ...,
    variables: Mapping[str, keras.Variable] | None = ...,
    prefix: str | None = ...,
    rename: Sequence[tuple[str, str]] | None = ...,
    keep_learning_rate: bool = ...,
    all_or_nothing: bool = ...,
    defer: Literal[False] = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> RestoreReport: ...


@overload
def restore_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = ...,
    strict: bool = ...,
    allow_cast: bool = ...,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = ...,
    state: Mapping[str, Any] | None = ...,
    include_rng: bool = ...,
    include_metrics: bool = ...,
    check_schedule: bool = ...,
    variables: Mapping[str, keras.Variable] | None = ...,
    prefix: str | None = ...,
    rename: Sequence[tuple[str, str]] | None = ...,
    keep_learning_rate: bool = ...,
    all_or_nothing: bool = ...,
    defer: bool = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> RestoreReport | PendingRestore: ...


def restore_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = None,
    strict: bool = True,
    allow_cast: bool = False,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    state: Mapping[str, Any] | None = None,
    include_rng: bool = True,
    include_metrics: bool = True,
    check_schedule: bool = True,
    variables: Mapping[str, keras.Variable] | None = None,
    prefix: str | None = None,
    rename: Sequence[tuple[str, str]] | None = None,
    keep_learning_rate: bool = False,
    all_or_nothing: bool = True,
    defer: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> RestoreReport | PendingRestore:
    """Restore a training state saved by [`save_training_state`][keras_stable_state.save_training_state] (or a stock Keras file).

    All-or-nothing: everything is read, checksummed, checked and converted before the
    first value is assigned, and a failed assignment puts every value back (with
    ``all_or_nothing=False``, in place instead: see that argument). Model
    variables and optimizer slots are matched by key; an unbuilt optimizer is built on
    ``model.trainable_variables`` first. Whatever is refused leaves the model, its
    optimizers and the other state as they were. In full (every option and error):
    [in detail](how-to/custom-loops.md#restore_training_state-in-detail).

    Examples:
        >>> report = restore_training_state("run.keras", model)
        >>> print(report)

    Args:
        filepath: A ``.keras``/``.h5`` file or ``.orbax`` directory written by
            [`save_training_state`][keras_stable_state.save_training_state], a stock Keras
            ``.keras``/``.weights.h5`` file, or a ``file://`` or object-store URL.
        model: The built ``keras.Model`` to restore into.
        optimizer: Default ``model.optimizer``; ``None`` restores model variables only. On
            the Torch backend also the ``torch.optim.Optimizer`` saved (matched by key).
        strict: Refuse any difference between the saved contract and the model's
            trainable variables (``False``: drop or start fresh, and report it).
        allow_cast: Cast floating-point arrays of another dtype (each cast is listed).
        callbacks: Callbacks to put back in their saved state (by class name and index).
        state: ``{name: provider}`` to put back (``set_state``; ``load_state_dict`` for an
            object with ``state_dict()``, e.g. a ``torch.optim.lr_scheduler``).
        include_rng: Put back NumPy's, Python's and Keras' global random state.
        include_metrics: Put back the model's metric variables (compiled metrics, the loss
            tracker, its own ``keras.metrics.Metric`` trackers), matched by path; those
            without a saved value are listed in ``report.left_fresh`` as ``metric:<path>``.
        check_schedule: Refuse a learning-rate schedule whose config differs.
        variables: ``{name: keras.Variable}`` outside the model, saved by name.
        prefix: The stable path of the saved model now nested in ``model`` (``"layers/base"``).
        rename: ``[(pattern, replacement), ...]`` ``re.sub`` rules for saved keys.
        keep_learning_rate: Keep the compiled learning rate and skip the schedule check.
        all_or_nothing: ``False``: for a model whose values are worth nothing if the restore
            fails (just built): a local ``.h5`` or ``.keras`` is proven whole, then read into the
            variables with no copy of the old values; a failure after the proof marks the
            model ([in detail](how-to/custom-loops.md#arguments-of-restore_training_state-in-full)).
        defer: For an unbuilt model: read and check now, assign once it is built.
        storage_options: fsspec options for an object-store URL.

    Returns:
        A [`RestoreReport`][keras_stable_state.RestoreReport]; with ``defer=True`` a
        [`PendingRestore`][keras_stable_state.PendingRestore] (its ``report`` set once restored).

    Raises:
        TypeError: For an argument of the wrong type, naming it.
        ValueError: For an invalid name, ``prefix`` or ``rename`` rule.
        FileNotFoundError: If there is no file (or no object at the URL).
        StorageBackendError: For a URL whose fsspec package is not installed.
        CheckpointInUseError: If another process holds the file locked for writing.
        CorruptCheckpointError: If the file is truncated or damaged (the key or record named);
            with ``all_or_nothing=False`` also if an array read after the proof fails its
            checksum or cannot be read (the model is then marked).
        MalformedKeyError: If a key in the file cannot be parsed (the file is damaged).
        CheckpointFormatError: For an unknown format version or a file that is no checkpoint.
        ContractError: With ``strict``, if the trainable variables differ from the contract.
        BindingError: If saved arrays (or ``torch.optim`` state) cannot be matched to
            variables, naming the keys.
        DtypeMismatchError: For a dtype difference without ``allow_cast``, or out of range.
        ScheduleMismatchError: If the learning-rate schedule changed (``check_schedule``).
        StateError: If the model is not built, memory ran out, a mapper cannot decode,
            putting values back failed, or (``all_or_nothing=False``) an assignment failed
            after the file was proven whole.
    """
    options = RestoreOptions(
        optimizer=optimizer,
        strict=strict,
        allow_cast=allow_cast,
        callbacks=callbacks,
        state=state,
        include_rng=include_rng,
        include_metrics=include_metrics,
        check_schedule=check_schedule,
        variables=variables,
        prefix=prefix,
        rename=rename,
        keep_learning_rate=keep_learning_rate,
        storage_options=storage_options,
        all_or_nothing=all_or_nothing,
    )
    return restore_with(filepath, model, options, defer=defer)


@memory_refused
@builds_undone_on_refusal
@gc_paused
def restore_with(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    options: RestoreOptions,
    *,
    defer: bool = False,
    record: format.StateRecord | format.StockWeights | None = None,
    take: bool = False,
    index: ModelIndex | None = None,
) -> RestoreReport | PendingRestore:
    """[`restore_training_state`][keras_stable_state.restore_training_state] with its options grouped.

    Args:
        filepath: As for [`restore_training_state`][keras_stable_state.restore_training_state] (``"<bytes>"`` with ``record``).
        model: As for [`restore_training_state`][keras_stable_state.restore_training_state].
        options: The other arguments but ``defer``.
        defer: As for [`restore_training_state`][keras_stable_state.restore_training_state].
        record: The record of ``filepath`` read already (by a [`PendingRestore`][keras_stable_state.PendingRestore],
            or from bytes); ``None``: read the file now.
        take: The arrays of ``record`` are the caller's to give away: nothing reads its
            model and optimizer arrays after this call, so the variables may keep their
            memory instead of a copy. Always so for a record read here.
        index: The `ModelIndex` of ``model`` made already in this call (a deferred
            restore run at once reuses its walk); ``None``: a new one.

    Returns:
        As [`restore_training_state`][keras_stable_state.restore_training_state].

    Raises:
        Every error of [`restore_training_state`][keras_stable_state.restore_training_state].
    """
    verb = "restore_training_state"
    filepath = check_filepath(filepath, verb)
    filepath, store = object_store.target(filepath, options.storage_options, verb, write=False)
    check_model(model, verb)
    optimizers, torch_optimizers = split_optimizers(check_optimizers(options.optimizer, verb, model))
    callbacks = check_callbacks(options.callbacks, verb)
    providers = check_providers(options.state, verb)
    check_flags(
        verb,
        strict=options.strict,
        allow_cast=options.allow_cast,
        include_rng=options.include_rng,
        include_metrics=options.include_metrics,
        check_schedule=options.check_schedule,
        keep_learning_rate=options.keep_learning_rate,
        all_or_nothing=options.all_or_nothing,
    )
    index = ModelIndex.of(model, index)  # the restore's one walk of the model, its registries and keys
    extras = check_variables(options.variables, verb, index)
    rules = check_rename(options.prefix, options.rename, verb)
    check_flags(verb, defer=defer)
    in_place = not options.all_or_nothing
    if in_place and defer:
        raise ValueError(
            f"{verb}: all_or_nothing=False restores in place at once, and defer=True restores later; "
            "pass one of them (a deferred restore keeps the file's arrays read until the model is built)."
        )
    owned = take or record is None
    # all or nothing on an accelerator: read as in place, each replaced value copied to the host
    on_device = not in_place and not defer and host_rollback.on_accelerator(model)
    if record is None:
        # one door for every layout and place (an object fetched whole, a '.orbax' folder's
        # arrays read on demand by the Orbax engine), once a background save into its folder ended
        record = dispatch.read(
            filepath, store, in_place=in_place or on_device, unaligned_views=takes_unaligned()
        )
    if defer:
        mappers.decode_record(record, file_label(filepath))  # an unknown mapper is refused now
        pending = PendingRestore(
            filepath, record, model, dataclasses.replace(options, callbacks=callbacks), take=owned
        )
        if model.built and model.variables:
            pending._restore(index)
        return pending
    if record.matched_by == BY_KEY:  # a record of ours: its keys, parsed as the file was read
        index.keys.update(cast(format.StateRecord, record).parsed_keys)
    request = RestoreRequest(
        filepath=filepath,
        index=index,
        optimizers=optimizers,
        torch_optimizers=torch_optimizers,
        callbacks=callbacks,
        providers=providers,
        extras=extras,
        rules=rules,
        # check_flags refused anything but True or False (a bool or NumPy bool)
        strict=cast(bool, options.strict),
        allow_cast=cast(bool, options.allow_cast),
        include_rng=cast(bool, options.include_rng),
        include_metrics=cast(bool, options.include_metrics),
        check_schedule=cast(bool, options.check_schedule),
        keep_learning_rate=cast(bool, options.keep_learning_rate),
        owned=owned,
        in_place=in_place or on_device,
        rollback_on_host=on_device,
    )
    try:
        return restore_record(record, request)
    finally:
        if owned:
            close_files(record)


class PendingRestore(keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped (Any)
    """A restore waiting for the model's variables: ``restore_training_state(..., defer=True)``.

    The file was read and every array checksummed when it was made; nothing is
    assigned until the model is built. Then [`restore`][keras_stable_state.PendingRestore.restore] matches, checks and
    assigns everything exactly as [`restore_training_state`][keras_stable_state.restore_training_state] does (all or
    nothing). Passed to ``model.fit`` as a callback it restores at
    ``on_train_begin``, when ``fit`` has built the model and its optimizer
    (Keras' ``BackupAndRestore`` restores there too) on the JAX and PyTorch
    backends; TensorFlow builds the model inside the first training step, so
    there build it first and call [`restore`][keras_stable_state.PendingRestore.restore] before ``fit`` (the callback
    raises a ``StateError`` saying so rather than train unrestored).

    Attributes:
        filepath (str): The file the state was read from.
        report: The [`RestoreReport`][keras_stable_state.RestoreReport] once restored, else ``None``.

    Examples:
        >>> model = build_model()                      # not built: no input shape yet
        >>> model.compile(optimizer="adam", loss="mse")
        >>> pending = kss.restore_training_state("run.h5", model, defer=True)
        >>> model.fit(x, y, callbacks=[pending])       # restored before the first batch
        >>> print(pending.report)
    """

    def __init__(
        self,
        filepath: str,
        record: format.StateRecord | format.StockWeights,
        target: keras.Model,
        options: RestoreOptions,
        *,
        take: bool = False,
    ) -> None:
        """Made by `restore_with` (``filepath``: the file read; ``record``: what it
        held; ``target``: the model to restore into; ``options``: the restore's; ``take``:
        the record is this object's alone, see `restore_with`)."""
        super().__init__()
        self._take = take
        self.filepath = filepath
        self.report: RestoreReport | None = None
        self._record: format.StateRecord | format.StockWeights | None = record
        self._target = target
        self._options = options

    @property
    def done(self) -> bool:
        """``True`` once the state is restored."""
        return self.report is not None

    def restore(self) -> RestoreReport:
        """Restore now (the model must be built).

        Returns:
            The [`RestoreReport`][keras_stable_state.RestoreReport], also kept as ``self.report``.

        Raises:
            StateError: if it was restored already or the model is still not
                built, and every error of [`restore_training_state`][keras_stable_state.restore_training_state].
        """
        return self._restore(None)

    def _restore(self, index: ModelIndex | None) -> RestoreReport:
        """`restore`, reusing ``index`` (the `ModelIndex` of the call that made this object,
        when it restores at once)."""
        if self.report is not None:
            raise StateError(
                f"The state of {file_label(self.filepath)} was already restored into {self._target.name!r} "
                "by this PendingRestore; call restore_training_state again to restore it twice."
            )
        report = cast(  # without defer, restore_with restores now: a RestoreReport
            RestoreReport,
            restore_with(
                self.filepath, self._target, self._options, record=self._record, take=self._take, index=index
            ),
        )
        self.report, self._record = report, None
        return report

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.model is not None and self.model is not self._target:
            raise StateError(
                f"This PendingRestore restores into model {self._target.name!r}, but it was passed to "
                f"fit of model {self.model.name!r}; pass it to the fit of the model it restores into.",
                expected=self._target.name,
                received=self.model.name,
            )
        if self.report is None:
            if not (self._target.built and self._target.variables):
                raise StateError(
                    f"fit has not built model {self._target.name!r} by on_train_begin (the TensorFlow "
                    "backend builds it inside the first training step, after the callbacks' "
                    "on_train_begin), so the pending restore of "
                    f"{file_label(self.filepath)} cannot run before training starts. Build the model first "
                    "(`model.build(input_shape)` or call it on a batch), then call `pending.restore()` "
                    "before fit.",
                    expected="a built model",
                    received=self._target.name,
                )
            self.restore()
