"""``restore_training_state``: its arguments checked, the file read, and the record restored
(by `restore_record`), now or, with ``defer=True``,
by a [`PendingRestore`][keras_stable_state.PendingRestore] once the model is built.

`restore_with` is the verb with its options grouped (`RestoreOptions`)
and the record optionally given already read: what a [`PendingRestore`][keras_stable_state.PendingRestore] and
[`restore_training_state_from_bytes`][keras_stable_state.restore_training_state_from_bytes] call.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_stable_state import format as storage
from keras_stable_state._core import mappers as mappers_mod
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
from keras_stable_state._core.guards import builds_undone_on_refusal, memory_refused, walking_once
from keras_stable_state._core.object_store import object_store_target
from keras_stable_state._core.plan import RestoreRequest, restore_record
from keras_stable_state._core.report import RestoreReport
from keras_stable_state._engines import background
from keras_stable_state._engines import orbax as orbax_engine
from keras_stable_state._identity.keys import file_label
from keras_stable_state.errors import StateError

__all__ = ["RestoreOptions", "PendingRestore", "restore_training_state", "restore_with"]


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """The options of [`restore_training_state`][keras_stable_state.restore_training_state] but ``defer``, as passed (unchecked:
    `restore_with` checks them); each field is documented there."""

    optimizer: object = None
    strict: object = True
    allow_cast: object = False
    callbacks: object = ()
    state: object = None
    include_rng: object = True
    check_schedule: object = True
    variables: object = None
    prefix: object = None
    rename: object = None
    keep_learning_rate: object = False
    storage_options: object = None

    @classmethod
    def from_keywords(cls, verb, /, **kwargs) -> RestoreOptions:
        """The options from keyword arguments named as [`restore_training_state`][keras_stable_state.restore_training_state]'s.

        Raises:
            TypeError: for a name that is not an option, as Python says it for ``verb``.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in names:
                raise TypeError(f"{verb}() got an unexpected keyword argument {name!r}")
        return cls(**kwargs)


def restore_training_state(
    filepath,
    model,
    optimizer=None,
    strict=True,
    allow_cast=False,
    *,
    callbacks=(),
    state=None,
    include_rng=True,
    check_schedule=True,
    variables=None,
    prefix=None,
    rename=None,
    keep_learning_rate=False,
    defer=False,
    storage_options=None,
) -> RestoreReport | PendingRestore:
    """Restore a training state saved by [`save_training_state`][keras_stable_state.save_training_state] (or a stock Keras file).

    Everything is read, checksummed, checked and converted before the first
    value is assigned: model variables, slots, casts, callback and provider
    states and the random state. If an assignment still fails (a provider's
    ``set_state`` refuses, a backend refuses an array), every value already
    assigned is put back from a snapshot taken before the first, and the error
    is re-raised: the restore is all-or-nothing. Everything the assignments need
    (the converted values, the snapshot) is allocated before the first one, and
    putting values back allocates no new memory, so running out of memory leaves
    everything unchanged too. Model variables and slots are
    matched by key (named keys by stable path, ordered keys by registration
    order with shape and dtype checks); stock Keras files are matched by their
    layer structure and optimizer position, and the report says so. An
    optimizer that is not built yet (the documented recipe: compile, then
    restore) is built on ``model.trainable_variables`` first.

    Args:
        filepath: A ``.keras`` or ``.h5`` file written by
            [`save_training_state`][keras_stable_state.save_training_state], a ``.orbax`` directory it wrote
            (each array read onto the variable's current sharding, each JAX
            process reading only its own shards), or a stock Keras ``.keras`` /
            ``.weights.h5`` file. With several JAX processes every process
            must call this (it runs collectives). An object-store URL
            (``s3://bucket/run.h5``, ``gs://...``; needs the ``[cloud]``
            extra) is downloaded whole into memory, then read with every
            check a file gets (messages name the URL); a ``file://`` URL is
            the local path it names. A background save of this process into
            the same folder (``blocking=False``) ends before the file is read,
            so the state read is the last one saved (its error, if any, stays
            with its [`SaveHandle`][keras_stable_state.SaveHandle]).
        model: The built ``keras.Model`` to restore into, however it was built.
        optimizer: Default ``model.optimizer``; ``None`` with an uncompiled
            model restores model variables only.
        strict: If ``True`` (default), any difference between the saved
            contract and the model's trainable variables raises
            [`ContractError`][keras_stable_state.ContractError]. If ``False``, slots of variables no longer
            trained are dropped and variables newly trained start fresh; both
            are listed in the report.
        allow_cast: Cast floating-point arrays whose dtype differs from their
            variable's (e.g. float16 saved, float32 variable), listing each cast.
            Integer counters are always cast, with a range check.
        callbacks: Callbacks to put back in their saved state (matched by
            class name and index among callbacks of that class).
        state: ``{name: provider}`` to put back (``set_state``).
        include_rng: Put back NumPy's, Python's and Keras' global random state.
        check_schedule: Refuse a learning-rate schedule whose config differs
            from the saved one.
        variables: ``{name: keras.Variable}``: the variables outside the model
            passed by name to [`save_training_state`][keras_stable_state.save_training_state]; their values and
            slots (``var:<name>``) are restored too.
        prefix: Restore a state saved from a model that is now nested in
            ``model`` (transfer learning: ``Sequential([base, head])``): the
            nested model's stable path, e.g. ``"layers/base"``. Every saved
            ``path:<p>`` key (weights and slots alike) is restored as
            ``path:<prefix>/<p>``. The same as ``rename=[(r"^path:",
            "path:<prefix>/")]``.
        rename: ``[(pattern, replacement), ...]`` rules for saved variable keys
            (weights, the owners of slots, the contract), applied with
            ``re.sub(pattern, replacement, key, count=1)`` by the first rule
            whose pattern ``re.search`` finds; a saved key no rule matches is
            not restored (refused with ``strict``, else listed in
            ``report.dropped``). E.g. ``[(r"^path:layers/base/", "path:")]``
            restores the base of a saved wrapper into the bare base. Without
            rules, a state whose keys fit a nested model or a wrapper of
            ``model`` is refused: a layer is never bound to another one of a
            different scope that happens to share its path.
        keep_learning_rate: Keep the optimizer's compiled learning rate (the
            fine-tuning case: saved at 1e-3, compiled at 1e-4) instead of the
            saved one, and skip the schedule check. Either way every saved
            learning rate that differs from the compiled one is listed in
            ``report.learning_rates``; ``str(report)`` suggests this option only
            for a transfer restore (``prefix``, ``rename`` or ``strict=False``:
            ``report.transfer``), not for a resume, whose saved value is the run's.
        defer: Restore into a model that is not built yet: the file is read
            and every array checksummed now, and the returned
            [`PendingRestore`][keras_stable_state.PendingRestore] assigns them once the variables exist (as a
            ``model.fit`` callback, at ``on_train_begin``, after ``fit`` built
            the model and its optimizer on JAX and PyTorch; or by calling
            ``restore()`` once the model is built), with every check above
            made then. A model that is built already is restored at once.
        storage_options: For an object-store URL: a ``dict`` passed to the
            fsspec filesystem; fsspec's own configuration and the store's
            environment variables apply as well.

    Returns:
        A [`RestoreReport`][keras_stable_state.RestoreReport]; with ``defer=True`` a [`PendingRestore`][keras_stable_state.PendingRestore]
        (its ``report`` set once restored).

    Raises:
        TypeError: naming the argument, for a ``filepath`` that is not a path,
            a ``model`` that is not a ``keras.Model``, an ``optimizer`` that is
            not a ``keras.optimizers.Optimizer`` (a name such as ``"adam"``
            included), ``callbacks`` that are not a list of callbacks, a
            ``state`` provider without ``get_state()`` / ``set_state()``,
            ``variables`` that are not a dict of ``keras.Variable``, ``rename``
            that is not a list of string pairs, or a flag that is not a bool.
        ValueError: for a provider or variable name that is empty or holds
            ``/``, a ``variables`` entry that is a model variable or named
            twice, a ``prefix`` that is not a relative path, both ``prefix``
            and ``rename``, a rename pattern that is not a regular expression,
            a rule that makes a malformed key or maps two saved keys to one,
            and rules for a stock Keras file.
        FileNotFoundError: if there is no file (or no object at the URL).
        StorageBackendError: (a ``StateError`` and an ``ImportError``) for a URL
            whose fsspec implementation is not installed, naming the package
            and the ``[cloud]`` extra.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: if the file is truncated or damaged, an array
            fails its checksum (for ``.orbax``: its hash), or a record (RNG,
            callback, provider state) is malformed; the key or record is named.
        MalformedKeyError: (a ``CorruptCheckpointError`` and a
            ``KeyFormatError``) if a key in the file cannot be parsed: the file
            is damaged, the model is not to blame.
        CheckpointFormatError: for an unknown format version, a directory, a
            legacy Keras HDF5 file, a ``.orbax`` URL (not supported in object
            stores yet) or ``storage_options`` with a local path.
        ContractError: (``strict``) if the trainable variables differ from the contract.
        BindingError: if saved arrays cannot be matched to variables (keys,
            shapes, counts), naming the first or every key concerned; with
            ``strict``, also if a stock Keras file lacks a model variable, a
            ``var:<name>`` variable is saved but not passed or passed but not
            saved, or a saved key matches no rename rule. Also, whatever
            ``strict``: if the saved keys fit a nested model or a wrapper of
            ``model`` (naming the ``prefix`` / ``rename`` to pass), if the
            optimizer trains variables outside ``model`` and ``variables``
            (naming them), or if the optimizer is unbuilt and ``model`` is a
            layer of another model (it would be built on too few variables).
        DtypeMismatchError: for a floating-point dtype difference without
            ``allow_cast``, a difference between kinds (integer, boolean,
            float), or an integer out of the target's range.
        ScheduleMismatchError: (``check_schedule`` without
            ``keep_learning_rate``) if the schedule changed, naming the
            differing fields.
        StateError: if the model is not built, orbax-checkpoint is not
            installed (``.orbax``), a provider in ``state`` has no saved state,
            putting values back after a failed assignment failed too (naming
            them), or an array stored through a mapper cannot be decoded: the
            mapper is not registered in this process, refuses its stored config,
            or decodes to another shape or dtype (naming the key). Also if memory
            ran out (a ``MemoryError``, or the backend's out-of-memory error: XLA's
            ``RESOURCE_EXHAUSTED``, Torch's ``OutOfMemoryError``, TensorFlow's
            ``ResourceExhaustedError``) while reading, checking, converting or
            assigning: the message names the file and says so, and nothing is
            changed (the error is raised from the original one).

    Whatever is refused, the model, its optimizers and the other state are left
    as they were: an optimizer the restore built before the refusal is put back
    unbuilt.

    Example:
        >>> report = restore_training_state("run.keras", model)
        >>> print(report)
    """
    options = RestoreOptions(
        optimizer=optimizer,
        strict=strict,
        allow_cast=allow_cast,
        callbacks=callbacks,
        state=state,
        include_rng=include_rng,
        check_schedule=check_schedule,
        variables=variables,
        prefix=prefix,
        rename=rename,
        keep_learning_rate=keep_learning_rate,
        storage_options=storage_options,
    )
    return restore_with(filepath, model, options, defer=defer)


@memory_refused
@builds_undone_on_refusal
@walking_once
def restore_with(
    filepath, model, options: RestoreOptions, *, defer=False, record=None, take=False
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

    Returns:
        As [`restore_training_state`][keras_stable_state.restore_training_state].

    Raises:
        Every error of [`restore_training_state`][keras_stable_state.restore_training_state].
    """
    verb = "restore_training_state"
    filepath = check_filepath(filepath, verb)
    filepath, _ = object_store_target(filepath, options.storage_options, verb, write=False)
    check_model(model, verb)
    optimizers = check_optimizers(options.optimizer, verb, model)
    callbacks = check_callbacks(options.callbacks, verb)
    providers = check_providers(options.state, verb)
    check_flags(
        verb,
        strict=options.strict,
        allow_cast=options.allow_cast,
        include_rng=options.include_rng,
        check_schedule=options.check_schedule,
        keep_learning_rate=options.keep_learning_rate,
    )
    extras = check_variables(options.variables, verb, model)
    rules = check_rename(options.prefix, options.rename, verb)
    check_flags(verb, defer=defer)
    owned = take or record is None
    if record is None:
        # a background save of this process into the file's folder ends first (as Orbax's
        # AsyncCheckpointer.restore waits): the file read is the last one saved, not a race
        background.wait_for_folder(background.folder_of(filepath))
        record = (
            orbax_engine.read(filepath)
            if orbax_engine.is_orbax_path(filepath)
            else storage.read_file(
                filepath, storage_options=options.storage_options, unaligned_views=takes_unaligned()
            )
        )
    if defer:
        mappers_mod.decode_record(record, file_label(filepath))  # an unknown mapper is refused now
        pending = PendingRestore(
            filepath, record, model, dataclasses.replace(options, callbacks=callbacks), take=owned
        )
        if model.built and model.variables:
            pending.restore()
        return pending
    request = RestoreRequest(
        filepath=filepath,
        model=model,
        optimizers=optimizers,
        callbacks=callbacks,
        providers=providers,
        extras=extras,
        rules=rules,
        strict=options.strict,
        allow_cast=options.allow_cast,
        include_rng=options.include_rng,
        check_schedule=options.check_schedule,
        keep_learning_rate=options.keep_learning_rate,
        owned=owned,
    )
    return restore_record(record, request)


class PendingRestore(keras.callbacks.Callback):
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
        filepath: The file the state was read from.
        report: The [`RestoreReport`][keras_stable_state.RestoreReport] once restored, else ``None``.

    Example:
        >>> model = build_model()                      # not built: no input shape yet
        >>> model.compile(optimizer="adam", loss="mse")
        >>> pending = kss.restore_training_state("run.h5", model, defer=True)
        >>> model.fit(x, y, callbacks=[pending])       # restored before the first batch
        >>> print(pending.report)
    """

    def __init__(self, filepath, record, target, options: RestoreOptions, *, take=False) -> None:
        """Made by `restore_with` (``filepath``: the file read; ``record``: what it
        held; ``target``: the model to restore into; ``options``: the restore's; ``take``:
        the record is this object's alone, see `restore_with`)."""
        super().__init__()
        self._take = take
        self.filepath = filepath
        self.report = None
        self._record = record
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
        if self.report is not None:
            raise StateError(
                f"The state of {file_label(self.filepath)} was already restored into {self._target.name!r} "
                "by this PendingRestore; call restore_training_state again to restore it twice."
            )
        report = restore_with(
            self.filepath, self._target, self._options, record=self._record, take=self._take
        )
        self.report, self._record = report, None
        return report

    def on_train_begin(self, logs=None):
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
