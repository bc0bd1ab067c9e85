"""``save_training_state`` and ``restore_training_state``: the two verbs users call."""

from __future__ import annotations

import dataclasses
import os

import keras
import numpy as np

from keras_stable_state import state as state_mod
from keras_stable_state import storage
from keras_stable_state.contract import TrainableContract
from keras_stable_state.errors import (
    BindingError,
    CheckpointFormatError,
    CorruptCheckpointError,
    DtypeMismatchError,
    KeyFormatError,
    StateError,
)
from keras_stable_state.identity import VariableKey, VariableRegistry
from keras_stable_state.optimizer import StableOptimizer, optimizer_entries, parse_entry_key

__all__ = ["RestoreReport", "MalformedKeyError", "save_training_state", "restore_training_state"]


class MalformedKeyError(CorruptCheckpointError, KeyFormatError):
    """A key in a file cannot be parsed: the file is damaged (or was written by
    something else), not a model that differs. Both a
    :class:`~keras_stable_state.CorruptCheckpointError` and a
    :class:`~keras_stable_state.KeyFormatError`.

    Example:
        >>> kss.restore_training_state("damaged.h5", model)
        MalformedKeyError: damaged.h5: model variable key 'layers/hidden/kernel' is malformed ...
    """


def _where(filepath) -> str:
    return repr(os.fsdecode(filepath)) if filepath is not None else "the file"


def _malformed_key(where, section, key, err) -> MalformedKeyError:
    reason = str(err).split(". ")[0]
    return MalformedKeyError(
        f"{where}: {section} key {key!r} is malformed ({reason}). Keys are 'path:<stable path>', "
        "'order:<index>' and, for optimizer variables, '<variable key>#<slot>' or "
        "'optimizer#<name>'. The file is damaged or was not written by keras_stable_state; it says "
        "nothing about your model, so do not pass strict=False for it: restore an earlier checkpoint "
        "(`keras-stable-state verify FILE` checks one).",
        key=key,
        expected="path:<path> | order:<int> [#<slot>]",
        received=key,
    )


def _parse_model_key(key, where):
    try:
        return VariableKey.parse(key)
    except KeyFormatError as err:
        raise _malformed_key(where, "model variable", key, err) from err


def _parse_optimizer_key(key, where):
    try:
        return parse_entry_key(key) if isinstance(key, str) else parse_entry_key(str(key))
    except (KeyFormatError, BindingError) as err:
        raise _malformed_key(where, "optimizer variable", key, err) from err


# -- argument checks ------------------------------------------------------------------
def _received(name, value) -> str:
    text = repr(value)
    if len(text) > 100:
        text = text[:97] + "..."
    return f"Received: {name}={text} (of type {type(value).__name__})"


def _check_filepath(filepath, verb):
    if isinstance(filepath, bytes):
        return os.fsdecode(filepath)
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(
            f"`filepath` of {verb} must be a path (str or os.PathLike) to a '.keras' or '.h5' file. "
            + _received("filepath", filepath)
        )
    return os.fsdecode(os.fspath(filepath))


def _check_model(model, verb):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` of {verb} must be a keras.Model (built: called on a batch, or `model.build(...)`). "
            + _received("model", model)
        )


def _check_optimizer(optimizer, verb, model):
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"{verb} takes the optimizer from `model.optimizer`, which is not a "
                "keras.optimizers.Optimizer; compile the model with one or pass `optimizer=`. "
                + _received("model.optimizer", optimizer)
            )
        return optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        hint = (
            " A name such as 'adam' is not an optimizer instance: compile the model with it and leave "
            "`optimizer` out (model.optimizer is used), or pass keras.optimizers.Adam(...)."
            if isinstance(optimizer, str)
            else ""
        )
        raise TypeError(
            f"`optimizer` of {verb} must be a keras.optimizers.Optimizer instance or None "
            f"(None: model.optimizer).{hint} " + _received("optimizer", optimizer)
        )
    return optimizer


def _check_callbacks(callbacks, verb):
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"`callbacks` of {verb} must be a list of keras.callbacks.Callback instances "
            "(e.g. callbacks=[early_stopping]). " + _received("callbacks", callbacks)
        )
    bad = [(i, cb) for i, cb in enumerate(callbacks) if not isinstance(cb, keras.callbacks.Callback)]
    if bad:
        i, cb = bad[0]
        raise TypeError(
            f"`callbacks` of {verb} must be a list of keras.callbacks.Callback instances; item {i} is "
            f"not. " + _received(f"callbacks[{i}]", cb)
        )
    return list(callbacks)


def _check_providers(state, verb):
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise TypeError(
            f"`state` of {verb} must be a dict {{name: provider}} of objects with get_state() and "
            "set_state() (e.g. state={'accumulator': acc}). " + _received("state", state)
        )
    for name, provider in state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"`state` names of {verb} must be non-empty strings without '/', they become keys in "
                f"the file. Received: a provider named {name!r}"
            )
        if not (
            callable(getattr(provider, "get_state", None)) and callable(getattr(provider, "set_state", None))
        ):
            raise TypeError(
                f"`state[{name!r}]` of {verb} must be a provider with get_state() and set_state(state) "
                "methods (e.g. a keras_stable_state.GradientAccumulator); to save a plain value, wrap it "
                "in an object with those two methods. " + _received(f"state[{name!r}]", provider)
            )
    return dict(state)


def _check_flags(verb, **flags):
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"`{name}` of {verb} must be True or False. " + _received(name, value))


@dataclasses.dataclass
class RestoreReport:
    """What :func:`restore_training_state` did.

    Attributes:
        matched: ``{key: "name" | "order"}`` for every restored model variable
            and optimizer variable: how its saved array was matched.
        left_fresh: Keys of live variables the file had no value for (they
            keep their current values).
        dropped: Saved keys that were not restored (``strict=False`` only:
            slots of variables that are no longer trained).
        casts: ``(key, saved dtype, variable dtype)`` for every array cast.
        restored_state: Other state put back (``"callback:EarlyStopping/0"``,
            ``"state:<provider>"``, ``"rng"``).
        built_optimizer: ``True`` when the optimizer was built by the restore.
        transfer_note: ``True`` when another backend wrote the file and the model
            has layers whose continuation differs across backends (Embedding,
            normalizations); ``str(report)`` then explains it.
        source: ``"keras_stable_state"`` or the kind of stock Keras file.
        writer: Metadata of the writer (backend, Keras version, format version);
            empty for stock files.

    Example:
        >>> report = kss.restore_training_state("run.keras", model)
        >>> report.by_order           # [] when every array was matched by name
        >>> report.casts              # [("optimizer#iteration", "int64", "int32")] from TensorFlow to JAX
        >>> print(report)
    """

    matched: dict = dataclasses.field(default_factory=dict)
    left_fresh: list = dataclasses.field(default_factory=list)
    dropped: list = dataclasses.field(default_factory=list)
    casts: list = dataclasses.field(default_factory=list)
    restored_state: list = dataclasses.field(default_factory=list)
    built_optimizer: bool = False
    transfer_note: bool = False
    source: str = storage.FORMAT
    writer: dict = dataclasses.field(default_factory=dict)

    @property
    def by_name(self) -> list:
        return [k for k, how in self.matched.items() if how == "name"]

    @property
    def by_order(self) -> list:
        return [k for k, how in self.matched.items() if how == "order"]

    @property
    def writer_differs(self) -> list:
        """``(field, writer's value, reader's value)`` where the writing backend,
        Keras version or dtype policy differs from this process's."""
        reader = _writer_metadata(None)
        return [
            (f, self.writer[f], reader[f])
            for f in ("backend", "keras_version", "dtype_policy")
            if f in self.writer and self.writer[f] != reader[f]
        ]

    def __str__(self) -> str:
        lines = [
            f"Restored {len(self.matched)} arrays from {self.source}"
            + (
                f" (written by {self.writer.get('backend')} / Keras {self.writer.get('keras_version')})"
                if self.writer
                else ""
            ),
            f"  matched by name: {len(self.by_name)}, by registration order: {len(self.by_order)}",
        ]
        for field, theirs, ours in self.writer_differs:
            lines.append(f"  written with {field} {theirs}, read with {ours}")
        if self.transfer_note:
            lines.append(
                "  note: the state above is restored exactly; continued training matches the writer's "
                "within float rounding for Dense, Conv and normalization layers, but backends update "
                "Embedding rows (and biases feeding straight into a normalization) differently, so "
                "those drift apart by about 1e-2 over tens of steps. That is the backends' arithmetic, "
                "not lost state (see docs: cross-backend transfer)."
            )
        if self.built_optimizer:
            lines.append("  the optimizer was not built; the restore built it")
        if self.left_fresh:
            lines.append(f"  left fresh (no saved value): {self.left_fresh}")
        if self.dropped:
            lines.append(f"  dropped (no longer trained): {self.dropped}")
        for key, src, dst in self.casts:
            lines.append(f"  cast {key}: {src} -> {dst}")
        return "\n".join(lines)


# Layers whose continued training differs across backends even from identical state.
_DRIFTING = (keras.layers.Embedding, keras.layers.BatchNormalization, keras.layers.LayerNormalization)


def _np(variable):
    return keras.ops.convert_to_numpy(variable.value)


def _dtype(variable) -> str:
    return keras.backend.standardize_dtype(variable.dtype)


def _coerce(key, array, variable, allow_cast, report):
    """Return ``array`` ready to assign to ``variable``, checking shape and dtype."""
    array = np.asarray(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if tuple(array.shape) != tuple(variable.shape):
        raise BindingError(
            f"Saved array for {key} has shape {tuple(array.shape)}, but its variable has shape "
            f"{tuple(variable.shape)}. The model was changed since the state was saved; rebuild it "
            "as it was, or restore with a model of that shape.",
            key=key,
            expected=tuple(variable.shape),
            received=tuple(array.shape),
        )
    src, dst = storage.dtype_name(array), _dtype(variable)
    if src == dst:
        return array
    if np.issubdtype(array.dtype, np.integer) and dst.startswith(("int", "uint")):
        info = np.iinfo(np.dtype(dst))
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise DtypeMismatchError(
                f"Saved {src} value of {key} ({array.min()}..{array.max()}) does not fit the "
                f"variable's {dst} range [{info.min}, {info.max}]; it would wrap around. Use a "
                "backend whose counter dtype holds it (TensorFlow keeps int64).",
                key=key,
                expected=dst,
                received=src,
            )
        report.casts.append((key, src, dst))
        return array.astype(storage.numpy_dtype(dst))
    floats = ("float", "bfloat16")
    if not (src.startswith(floats) and dst.startswith(floats)):
        raise DtypeMismatchError(
            f"Saved array for {key} is {src}, but its variable is {dst}. Only floating-point arrays "
            "are cast (allow_cast=True) and integers within range; a cast between integers, booleans "
            "and floats would change what the values mean. The file does not belong to this model, or "
            "is damaged; restore a state saved from this model.",
            key=key,
            expected=dst,
            received=src,
        )
    if not allow_cast:
        raise DtypeMismatchError(
            f"Saved array for {key} is {src}, but its variable is {dst}. Casting could lose "
            "precision, so it is refused; pass allow_cast=True to cast and have each cast listed "
            "in the report.",
            key=key,
            expected=dst,
            received=src,
        )
    report.casts.append((key, src, dst))
    return array.astype(storage.numpy_dtype(dst))


def _optimizer_classes(optimizer) -> list:
    """``["AdamW"]``, ``["LossScaleOptimizer", "inner_optimizer/Adam"]``: the classes that
    decide how slots are used (a ``StableOptimizer`` wrapper is transparent)."""
    from keras_stable_state.optimizer import _tree

    return [f"{prefix}{type(opt).__name__}" for prefix, opt in _tree(optimizer)]


def _top(optimizer):
    return optimizer.inner_optimizer if isinstance(optimizer, StableOptimizer) else optimizer


def _optimizer_registry(optimizer, model):
    return VariableRegistry.from_model(model, _top(optimizer)._trainable_variables)


def plan_optimizer_arrays(
    optimizer, model, arrays, *, keyed, strict, allow_cast, report, dropped_keys=(), where=None
):
    """Match saved optimizer arrays to live optimizer variables.

    Args:
        optimizer: A built optimizer.
        model: The model keying its variables (``None``: registration order).
        arrays: ``{entry key: array}`` when ``keyed``, else a list in
            ``optimizer.variables`` order (stock Keras files).
        strict: Refuse saved slots without a live slot and live variables
            without a saved value.
        dropped_keys: Variable keys whose slots are dropped on purpose
            (``strict=False`` contract differences).
        where: The file, for messages.

    Returns:
        A list of ``(variable, array)`` to assign.

    Raises:
        MalformedKeyError: a saved entry key cannot be parsed (a damaged file).
        BindingError: count, shape or key mismatches (named in the message).
        DtypeMismatchError: dtype differences without ``allow_cast``, between
            kinds (integer, boolean, float), or an integer out of range.
    """
    registry = _optimizer_registry(optimizer, model)
    live = optimizer_entries(optimizer, registry)
    plan = []
    if not keyed:
        if len(arrays) != len(live):
            first = live[min(len(arrays), len(live) - 1)].key if live else "(none)"
            raise BindingError(
                f"The file holds {len(arrays)} optimizer variables in positional order, but "
                f"{type(_top(optimizer)).__name__} has {len(live)}; the first that differs is "
                f"#{min(len(arrays), len(live))} ({first}). The optimizer or the model's trainable "
                "variables differ from the ones saved; build the same optimizer on the same model.",
                key=first,
                expected=len(live),
                received=len(arrays),
            )
        for i, (entry, array) in enumerate(zip(live, arrays, strict=True)):
            if tuple(np.shape(array)) != tuple(entry.variable.shape):
                raise BindingError(
                    f"Positional optimizer variable #{i} in the file has shape {tuple(np.shape(array))}, "
                    f"but the live slot at that position, {entry.key}, has shape "
                    f"{tuple(entry.variable.shape)}. Stock Keras saves optimizer state by position; "
                    "the model's trainable variables are not in the order they were saved in.",
                    key=entry.key,
                    expected=tuple(entry.variable.shape),
                    received=tuple(np.shape(array)),
                )
            plan.append((entry.variable, _coerce(entry.key, array, entry.variable, allow_cast, report)))
            report.matched[f"optimizer[{i}] -> {entry.key}"] = "order"
        return plan

    live_by_key = {e.key: e for e in live}
    parsed = {k: _parse_optimizer_key(k, _where(where)) for k in arrays}
    owners = {}
    for vkey, _ in parsed.values():
        if vkey is not None:
            owners.setdefault(vkey, (vkey, None, None))
    bound, unmatched = registry.bind(owners.values())
    dropped_keys = set(dropped_keys)
    unmatched = [k for k in unmatched if str(k) not in dropped_keys]
    if unmatched and strict:
        raise BindingError(
            f"Saved optimizer slots belong to variables the model does not have: "
            f"{sorted(map(str, unmatched))}. The model differs from the one saved; rebuild it as "
            "it was, or pass strict=False to drop these slots.",
            key=str(unmatched[0]),
        )
    used = set()
    for key, array in arrays.items():
        vkey, slot = parsed[key]
        if vkey is None:
            live_key, how = key, "name"
        elif vkey in bound:
            var, how = bound[vkey]
            live_key = f"{registry.key_of(var)}#{slot}"
        else:
            report.dropped.append(key)
            continue
        entry = live_by_key.get(live_key)
        if entry is None:
            if strict:
                raise BindingError(
                    f"Saved optimizer variable {key} has no live counterpart {live_key} in "
                    f"{type(_top(optimizer)).__name__}. The optimizer differs from the one saved "
                    "(another class or options); build the same optimizer, or pass strict=False.",
                    key=key,
                )
            report.dropped.append(key)
            continue
        used.add(live_key)
        plan.append((entry.variable, _coerce(live_key, array, entry.variable, allow_cast, report)))
        report.matched[live_key] = how
    fresh = [e.key for e in live if e.key not in used]
    if fresh and strict:
        raise BindingError(
            f"The file has no saved value for optimizer variables {fresh}. The optimizer differs "
            "from the one saved, or variables became trainable since; pass strict=False to leave "
            "them fresh.",
            key=fresh[0],
        )
    report.left_fresh.extend(fresh)
    return plan


def restore_optimizer_arrays(optimizer, model, arrays, *, keyed, strict=True, allow_cast=False):
    """Plan, check and assign optimizer arrays (used by ``StableOptimizer.load_own_variables``);
    all or nothing."""
    report = RestoreReport()
    plan = plan_optimizer_arrays(
        optimizer, model, arrays, keyed=keyed, strict=strict, allow_cast=allow_cast, report=report
    )
    _apply([_variable_step(var, array) for var, array in plan])
    return report


# -- assigning: all or nothing ----------------------------------------------------------
@dataclasses.dataclass
class _Step:
    """One assignment of a restore. ``snapshot()`` (called before the first step of
    the restore is applied) returns ``(undo, changed)``: a callable putting the
    current value back, and one telling whether the value differs from it now."""

    name: str
    apply: object
    snapshot: object


def _variable_step(var, array, name=None):
    def snapshot():
        old = np.array(_np(var), copy=True)
        return (lambda: var.assign(old)), (lambda: not state_mod.same_state(np.asarray(_np(var)), old))

    return _Step(name or getattr(var, "path", var.name), lambda: var.assign(array), snapshot)


def _state_step(name, get, put, value):
    def snapshot():
        old = state_mod.copy_state(get())
        return (lambda: put(state_mod.copy_state(old))), (lambda: not state_mod.same_state(get(), old))

    return _Step(name, lambda: put(value), snapshot)


def _rng_step(parsed):
    def snapshot():
        undo = state_mod._rng_snapshot()
        return undo, (lambda: True)

    return _Step("rng", lambda: state_mod.apply_rng_state(parsed), snapshot)


def _apply(steps, where=None):
    """Apply ``steps`` in order. If one raises, put back every step already applied
    (and the failing one, if it changed anything) from snapshots taken before the
    first, then re-raise.

    Raises:
        The error of the failing step (a ``KeyFormatError`` from a provider as
        :class:`MalformedKeyError`), or :class:`StateError` naming what could
        not be put back when the rollback itself fails.
    """
    snapshots = [step.snapshot() for step in steps]
    done = []
    for step, (undo, changed) in zip(steps, snapshots, strict=True):
        try:
            step.apply()
        except BaseException as err:
            failed = _roll_back([*reversed(done), (step, undo, changed, True)])
            if failed:
                raise StateError(
                    f"Restoring {_where(where)} failed at {step.name} ({type(err).__name__}: {err}), and "
                    f"putting back the values from before the restore failed for {failed}: the model "
                    "and training state are now partly restored. Restore a checkpoint again (or rebuild "
                    "the model) before training.",
                    key=step.name,
                ) from err
            if isinstance(err, KeyFormatError) and not isinstance(err, MalformedKeyError):
                raise _malformed_key(_where(where), step.name, err.key, err) from err
            raise
        done.append((step, undo, changed, False))


def _roll_back(applied) -> list:
    """Undo ``(step, undo, changed, failing)`` in order; the names that could not be undone."""
    failed = []
    for step, undo, changed, failing in applied:
        try:
            if failing and not changed():
                continue
            undo()
        except Exception as err:  # noqa: BLE001 - every failure is reported by name to the caller
            failed.append(f"{step.name} ({type(err).__name__}: {err})")
    return failed


def _writer_metadata(model) -> dict:
    return {
        "backend": keras.backend.backend(),
        "keras_version": keras.__version__,
        "format_version": storage.FORMAT_VERSION,
        "dtype_policy": keras.config.dtype_policy().name,
        "model_class": None if model is None else type(model).__name__,
    }


def _ensure_built(optimizer, model, report=None):
    if optimizer.built:
        return
    if not model.built:
        raise StateError(
            f"Optimizer {optimizer.name!r} is not built and model {model.name!r} is not built either, "
            "so there are no variables to attach slots to. Build the model first (call it on a batch "
            "or `model.build(input_shape)`).",
        )
    optimizer.build(model.trainable_variables)
    if report is not None:
        report.built_optimizer = True


_MODEL_STATES = ("all", "trainable", "none")


def _collect_state(model, optimizer, callbacks, state, include_rng):
    """The JSON part and the arrays of everything that is not a variable."""
    extra = {"schedule": state_mod.schedule_state(optimizer), "callbacks": {}, "providers": {}, "rng": None}
    arrays = {}

    def put(section, name, value):
        json_value, found = state_mod.split_arrays(value, f"{section}/{name}")
        extra[section][name] = json_value
        arrays.update(found)

    for cb in callbacks:
        value = state_mod.callback_state(cb)
        if value is not None:
            put("callbacks", state_mod.callback_key(callbacks, cb), value)
    for name, provider in state.items():
        put("providers", name, provider.get_state())
    if include_rng:
        extra["rng"], found = state_mod.split_arrays(state_mod.rng_state(), "rng")
        arrays.update(found)
    return extra, arrays


def save_training_state(
    filepath, model, optimizer=None, *, model_state="all", callbacks=(), state=None, include_rng=True
):
    """Save the whole training state by key: variables, optimizer, contract and the rest.

    The file holds the model's variables (per ``model_state``), every optimizer
    variable (slots, iteration count, learning rate, the optimizer's own
    gradient-accumulation sums), the trainable-variable contract, the
    learning-rate schedule's config, the state of stateful ``callbacks``, each
    provider in ``state`` and the global random state.

    Args:
        filepath: ``str`` or path ending in ``.keras`` (a Keras archive that
            ``keras.saving.load_model`` loads, with the training state as an
            extra member) or ``.h5`` (the training state alone).
        model: A built ``keras.Model``.
        optimizer: The optimizer to save; default ``model.optimizer``. An
            unbuilt optimizer is built on ``model.trainable_variables`` first.
            ``None`` with an uncompiled model saves no optimizer state.
        model_state: ``"all"`` (every model variable), ``"trainable"`` (only
            trainable variables: the adapter-only / LoRA case, where the caller
            brings the frozen base back) or ``"none"``. ``.keras`` archives
            always also hold Keras' own full weights.
        callbacks: Callbacks whose state to save (``EarlyStopping``,
            ``ReduceLROnPlateau``, ``ModelCheckpoint``, ``History``, or any
            with ``get_state()`` / ``set_state()``); others are skipped.
        state: ``{name: provider}`` for other objects with ``get_state()`` /
            ``set_state()`` (e.g. a :class:`~keras_stable_state.GradientAccumulator`).
        include_rng: Save NumPy's, Python's and Keras' global random state.

    Raises:
        TypeError: naming the argument, for a ``filepath`` that is not a path, a
            ``model`` that is not a ``keras.Model``, an ``optimizer`` that is not
            a ``keras.optimizers.Optimizer`` (a name such as ``"adam"`` included),
            ``callbacks`` that are not a list of ``keras.callbacks.Callback``, a
            ``state`` provider without ``get_state()`` / ``set_state()``, or a
            flag that is not a bool.
        ValueError: for an unknown ``model_state``, or a provider name that is
            empty or holds ``/``.
        CheckpointFormatError: for another extension, a directory, or a
            ``.keras`` path for a model Keras cannot serialize (a subclassed
            model without ``get_config()``): save to ``.h5`` instead.
        StateError: if the model is not built, or a provider refuses
            (e.g. pending gradients for a variable that is no longer trainable).
        OSError: naming the path when the write fails (disk full); the
            previous file is left intact.

    Example:
        >>> save_training_state("run.keras", model)
    """
    verb = "save_training_state"
    filepath = _check_filepath(filepath, verb)
    _check_model(model, verb)
    if model_state not in _MODEL_STATES:
        raise ValueError(
            f"`model_state` must be one of {_MODEL_STATES}. Received: model_state={model_state!r}"
        )
    optimizer = _check_optimizer(optimizer, verb, model)
    callbacks = _check_callbacks(callbacks, verb)
    state = _check_providers(state, verb)
    _check_flags(verb, include_rng=include_rng)
    if not model.built:
        raise StateError(f"Model {model.name!r} is not built; build it before saving its training state.")
    variables = {"all": model.variables, "trainable": model.trainable_variables, "none": []}[model_state]
    registry = VariableRegistry.from_model(model)
    model_arrays = {str(registry.key_of(v)): _np(v) for v in variables}
    opt_arrays = {}
    if optimizer is not None:
        _ensure_built(optimizer, model)
        if isinstance(optimizer, StableOptimizer):
            optimizer.bind(model)
        for entry in optimizer_entries(optimizer, _optimizer_registry(optimizer, model)):
            opt_arrays[entry.key] = _np(entry.variable)
    extra, arrays = _collect_state(model, optimizer, callbacks, state, include_rng)
    record = storage.StateRecord(
        metadata={
            **_writer_metadata(model),
            "model_state": model_state,
            "optimizer_classes": None if optimizer is None else _optimizer_classes(optimizer),
        },
        contract=TrainableContract.capture(model).to_json(),
        model=model_arrays,
        optimizer=opt_arrays,
        extra=extra,
        arrays=arrays,
    )
    storage.write_record(
        filepath, record, keras_archive_writer=lambda tmp: _save_keras_archive(model, tmp, filepath)
    )
    return filepath


def _save_keras_archive(model, tmp, filepath):
    try:
        model.save(tmp)
    except NotImplementedError as err:
        if "get_config" not in str(err):
            raise
        raise CheckpointFormatError(
            f"Cannot save {filepath!r}: a '.keras' archive holds the model's config, and Keras cannot "
            f"serialize {type(model).__name__} ({str(err).strip().splitlines()[0]} ...). Implement "
            "`get_config()` on the model (and register it with "
            "@keras.saving.register_keras_serializable()), or save to a '.h5' path: a '.h5' file holds "
            "the same training state without the model config, and restore_training_state restores it "
            "into a model you build in code.",
            key=None,
            expected="a serializable model (get_config)",
            received=type(model).__name__,
        ) from err


def _plan_model(record, model, registry, strict, allow_cast, report, where):
    plan = []
    if isinstance(record, storage.StockWeights):
        absent, plan = [], []
        for key, var in registry.entries:
            kpath = registry.keras_paths.get(id(var))
            if kpath is None:  # state stock Keras does not save (seed generators)
                report.left_fresh.append(str(key))
            elif kpath not in record.arrays:
                absent.append((str(key), kpath))
            else:
                plan.append((var, _coerce(str(key), record.arrays[kpath], var, allow_cast, report)))
                report.matched[str(key)] = "order"
        if not plan and registry.entries:
            raise BindingError(
                f"None of the model's variables is in the stock Keras file {where} ({record.source}); "
                "it was written for another model. Restore it into the model that saved it.",
                key=str(registry.entries[0][0]),
            )
        if absent and strict:
            listed = ", ".join(f"{k} (at {p!r})" for k, p in absent)
            raise BindingError(
                f"The stock Keras file {where} has no value for model variables {listed}; with "
                "strict=True every variable must be restored. The model has layers or variables the "
                "saving model did not have. Restore into the model that saved it, or pass strict=False "
                "to leave these variables fresh (listed in report.left_fresh).",
                key=absent[0][0],
                expected=[p for _, p in absent],
                received=None,
            )
        report.left_fresh.extend(k for k, _ in absent)
        return plan
    keys = {k: _parse_model_key(k, where) for k in record.model}
    saved = [(keys[k], np.shape(a), storage.dtype_name(a)) for k, a in record.model.items()]
    bound, unmatched = registry.bind(saved)
    if not bound and saved:
        raise BindingError(
            f"No saved model variable in {where} matches this model: the file has "
            f"{sorted(str(k) for k, _, _ in saved)[:8]}{'...' if len(saved) > 8 else ''}, the model has "
            f"{sorted(map(str, registry.keys()))[:8]}. It was written for another model; restore it "
            "into that model.",
            key=str(saved[0][0]),
        )
    if unmatched:
        if strict:
            raise BindingError(
                f"Saved model variables {sorted(map(str, unmatched))} in {where} are not in the model. "
                "Rebuild the model as it was saved, or pass strict=False to skip them.",
                key=str(unmatched[0]),
            )
        report.dropped.extend(str(k) for k in unmatched)
    for key, array in record.model.items():
        vkey = keys[key]
        if vkey in bound:
            var, how = bound[vkey]
            plan.append((var, _coerce(key, array, var, allow_cast, report)))
            report.matched[key] = how
    restored = {id(v) for v, _ in plan}
    report.left_fresh.extend(str(k) for k, v in registry.entries if id(v) not in restored)
    return plan


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
) -> RestoreReport:
    """Restore a training state saved by :func:`save_training_state` (or a stock Keras file).

    Everything is read, checksummed, checked and converted before the first
    value is assigned: model variables, slots, casts, callback and provider
    states and the random state. If an assignment still fails (a provider's
    ``set_state`` refuses, a backend refuses an array), every value already
    assigned is put back from a snapshot taken before the first, and the error
    is re-raised: the restore is all-or-nothing. Model variables and slots are
    matched by key (named keys by stable path, ordered keys by registration
    order with shape and dtype checks); stock Keras files are matched by their
    layer structure and optimizer position, and the report says so. An
    optimizer that is not built yet (the documented recipe: compile, then
    restore) is built on ``model.trainable_variables`` first.

    Args:
        filepath: A ``.keras`` or ``.h5`` file written by
            :func:`save_training_state`, or a stock Keras ``.keras`` /
            ``.weights.h5`` file.
        model: The built ``keras.Model`` to restore into, however it was built.
        optimizer: Default ``model.optimizer``; ``None`` with an uncompiled
            model restores model variables only.
        strict: If ``True`` (default), any difference between the saved
            contract and the model's trainable variables raises
            :class:`ContractError`. If ``False``, slots of variables no longer
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

    Returns:
        A :class:`RestoreReport`.

    Raises:
        TypeError: naming the argument, for a ``filepath`` that is not a path,
            a ``model`` that is not a ``keras.Model``, an ``optimizer`` that is
            not a ``keras.optimizers.Optimizer`` (a name such as ``"adam"``
            included), ``callbacks`` that are not a list of callbacks, a
            ``state`` provider without ``get_state()`` / ``set_state()``, or a
            flag that is not a bool.
        ValueError: for a provider name that is empty or holds ``/``.
        FileNotFoundError: if there is no file.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: if the file is truncated or damaged, an array
            fails its checksum, or a record (RNG, callback, provider state) is
            malformed; the key or record is named.
        MalformedKeyError: (a ``CorruptCheckpointError`` and a
            ``KeyFormatError``) if a key in the file cannot be parsed: the file
            is damaged, the model is not to blame.
        CheckpointFormatError: for an unknown format version, a directory or a
            legacy Keras HDF5 file.
        ContractError: (``strict``) if the trainable variables differ from the contract.
        BindingError: if saved arrays cannot be matched to variables (keys,
            shapes, counts), naming the first or every key concerned; with
            ``strict``, also if a stock Keras file lacks a model variable.
        DtypeMismatchError: for a floating-point dtype difference without
            ``allow_cast``, a difference between kinds (integer, boolean,
            float), or an integer out of the target's range.
        ScheduleMismatchError: (``check_schedule``) if the schedule changed,
            naming the differing fields.
        StateError: if the model is not built, a provider in ``state`` has no
            saved state, or putting values back after a failed assignment
            failed too (naming them).

    Example:
        >>> report = restore_training_state("run.keras", model)
        >>> print(report)
    """
    verb = "restore_training_state"
    filepath = _check_filepath(filepath, verb)
    _check_model(model, verb)
    optimizer = _check_optimizer(optimizer, verb, model)
    callbacks = _check_callbacks(callbacks, verb)
    providers = _check_providers(state, verb)
    _check_flags(
        verb, strict=strict, allow_cast=allow_cast, include_rng=include_rng, check_schedule=check_schedule
    )
    record = storage.read_file(filepath)
    where = _where(filepath)
    if not model.built or not model.variables:
        raise StateError(
            f"Model {model.name!r} has no variables yet; call it on a batch (a subclassed model's "
            "`build(input_shape)` may create none) before restoring its training state."
        )
    report = RestoreReport()
    if isinstance(record, storage.StockWeights):
        report.source = record.source
    else:
        report.writer = dict(record.metadata)
        report.transfer_note = any(f == "backend" for f, _, _ in report.writer_differs) and any(
            isinstance(layer, _DRIFTING) for layer in model._flatten_layers()
        )
    # 1. Check and convert everything; nothing is assigned before step 2.
    dropped_keys = []
    if isinstance(record, storage.StateRecord) and record.contract is not None:
        contract = TrainableContract.from_json(record.contract)
        if strict:
            contract.validate(model)
        else:
            missing, _, reshaped, retyped = contract.diff(model)
            if reshaped or retyped:
                contract.validate(model)
            dropped_keys = missing
    if isinstance(record, storage.StateRecord) and optimizer is not None:
        if check_schedule and "schedule" in record.extra:
            state_mod.check_schedule(record.extra["schedule"], optimizer)
        saved_classes = record.metadata.get("optimizer_classes")
        live_classes = _optimizer_classes(optimizer)
        if strict and saved_classes is not None and record.optimizer and saved_classes != live_classes:
            raise BindingError(
                f"The optimizer state in {where} was saved from {saved_classes} but the live optimizer "
                f"is {live_classes}. Slots of another optimizer class would be applied with other update "
                "rules; build the optimizer as saved, or pass strict=False to restore what matches.",
                expected=saved_classes,
                received=live_classes,
            )
    registry = VariableRegistry.from_model(model)
    plan = _plan_model(record, model, registry, strict, allow_cast, report, where)
    saved_opt = record.optimizer
    if optimizer is not None and len(saved_opt):
        _ensure_built(optimizer, model, report)
        if isinstance(optimizer, StableOptimizer):
            optimizer.bind(model)
        plan += plan_optimizer_arrays(
            optimizer,
            model,
            saved_opt,
            keyed=isinstance(saved_opt, dict),
            strict=strict,
            allow_cast=allow_cast,
            report=report,
            dropped_keys=dropped_keys,
            where=filepath,
        )
    elif len(saved_opt) and optimizer is None:
        report.dropped.append("optimizer (the model has no optimizer; compile it to restore optimizer state)")
    steps = []
    if isinstance(record, storage.StateRecord):
        steps = _plan_state(record, callbacks, providers, include_rng, report, where)
    elif providers:
        raise StateError(
            f"{where} is a {record.source}, which holds no provider state; the providers "
            f"{sorted(providers)} in `state` cannot be restored from it. Save them with "
            "save_training_state(..., state={name: provider}).",
            key=sorted(providers)[0],
        )
    # 2. Assign: every planned value, or (if an assignment fails) none.
    steps += [_variable_step(var, array) for var, array in plan]
    _apply(steps, filepath)
    return report


def plan_callbacks(record, callbacks, report, where=None):
    """Check the saved callback states and return the call that puts them back.

    Callbacks are matched by class name and index among callbacks of that class;
    every saved state is checked before anything is set, and the returned call
    sets all of them or (if one refuses) none. A stateful callback without a
    saved state is listed in ``report.left_fresh``.

    Args:
        record: A :class:`~keras_stable_state.storage.StateRecord`.
        callbacks: The live callbacks.
        report: The :class:`RestoreReport` to add to.
        where: The file, for messages.

    Returns:
        ``[]``, or a list of one callable that sets every callback state.

    Raises:
        CorruptCheckpointError: naming the record (``"callbacks/EarlyStopping/0"``)
            of a malformed saved state.
    """
    steps = _callback_steps(record, list(callbacks or ()), report, None if where is None else _where(where))
    return [lambda: _apply(steps, where)] if steps else []


def _callback_steps(record, callbacks, report, where):
    extra, arrays = record.extra, record.arrays
    steps = []
    saved_cbs = extra.get("callbacks", {})
    for cb in callbacks:
        if state_mod.callback_state(cb) is None:
            continue
        key = state_mod.callback_key(callbacks, cb)
        if key not in saved_cbs:
            report.left_fresh.append(f"callback:{key}")
            continue
        name = f"callbacks/{key}"
        value = state_mod.join_arrays(saved_cbs[key], arrays, where)
        value = state_mod.parse_callback_state(cb, value, name, where)
        steps.append(
            _state_step(
                name,
                lambda cb=cb: state_mod.callback_state(cb),
                lambda v, cb=cb: state_mod.set_callback_state(cb, v),
                value,
            )
        )
        report.restored_state.append(f"callback:{key}")
    return steps


def _plan_state(record, callbacks, providers, include_rng, report, where):
    """Check the non-variable state in full; the steps that put it back."""
    extra, arrays = record.extra, record.arrays
    saved = extra.get("providers", {})
    steps = []
    for name, provider in providers.items():
        if name not in saved:
            raise StateError(
                f"{where} has no state for provider {name!r} (it has {sorted(saved)}). "
                "Save it with save_training_state(..., state={name: provider}), or leave it out of "
                "`state`.",
                key=name,
                expected=name,
                received=sorted(saved),
            )
        record_name = f"providers/{name}"
        value = state_mod.join_arrays(saved[name], arrays, where)
        value = state_mod.check_provider_state(provider, value, record_name, where)
        steps.append(_state_step(record_name, provider.get_state, provider.set_state, value))
        report.restored_state.append(f"state:{name}")
    steps += _callback_steps(record, callbacks, report, where)
    if extra.get("rng") is not None:
        # Checked even with include_rng=False: a malformed record means a damaged file.
        parsed = state_mod.parse_rng_state(state_mod.join_arrays(extra["rng"], arrays, where), where)
        if include_rng:
            steps.append(_rng_step(parsed))
            report.restored_state.append("rng")
    return steps
