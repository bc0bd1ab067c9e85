"""``save_training_state`` and ``restore_training_state``: the two verbs users call.

This module orchestrates; the parts live in their own modules: argument checks
(``_arguments``), the key grammar (``keys``), slot matching (``slots``), key
scopes (``_scope``), checking and assigning all or nothing (``_apply``) and the
report (``report``). Names used from here before the split are re-exported.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import io
import time

import keras
import numpy as np

from keras_stable_state import _keras_compat as compat
from keras_stable_state._core import mappers as mappers_mod
from keras_stable_state._core.apply import (
    apply_steps,
    coerce,
    dtype_name,
    rng_step,
    state_step,
    to_numpy,
    variable_step,
)
from keras_stable_state._core.arguments import (
    MODEL_STATES,
    check_callbacks,
    check_filepath,
    check_flags,
    check_model,
    check_optimizers,
    check_providers,
    check_rename,
    check_variables,
)
from keras_stable_state._core.report import RestoreReport, writer_metadata
from keras_stable_state._core.scope import check_scope, renamed_record
from keras_stable_state._engines import background as _async
from keras_stable_state._engines import multiprocess as _multiprocess
from keras_stable_state._engines import orbax as _orbax_engine
from keras_stable_state._identity.contract import TrainableContract
from keras_stable_state._identity.keys import EXTRA, MAIN, VariableKey, file_label, parse_model_key
from keras_stable_state._identity.paths import one_walk
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state._optimizer import (
    drop_reason,
    keyed_optimizer_entries,
    optimizer_classes,
    plan_optimizers,
    save_optimizers,
    tracked_optimizers,
)
from keras_stable_state._optimizer import plan_optimizer_arrays as plan_optimizer_arrays
from keras_stable_state._optimizer import restore_optimizer_arrays as restore_optimizer_arrays
from keras_stable_state._state import layers as layer_state
from keras_stable_state._state import state as state_mod
from keras_stable_state.errors import BindingError, CheckpointFormatError, MalformedKeyError, StateError
from keras_stable_state.format import storage

__all__ = [
    "RestoreReport",
    "MalformedKeyError",
    "PendingRestore",
    "save_training_state",
    "restore_training_state",
]

# Re-exported under the names they had here before the split (callbacks.py, tests).
_check_callbacks = check_callbacks
_keyed_optimizer_entries = keyed_optimizer_entries


# Layers whose continued training differs across backends even from identical state.
_DRIFTING = (keras.layers.Embedding, keras.layers.BatchNormalization, keras.layers.LayerNormalization)


def _model_registry(model, extras):
    """The model's variables by stable path, then ``extras`` as ``var:<name>``."""
    registry = VariableRegistry.from_model(model)
    if not extras:
        return registry
    return registry.rekeyed(registry.entries + [(VariableKey(EXTRA, n), v) for n, v in extras.items()])


def _collect_state(model, optimizer, callbacks, state, include_rng):
    """The JSON part and the arrays of everything that is not a variable."""
    extra = {"schedule": state_mod.schedule_state(optimizer), "callbacks": {}, "providers": {}, "rng": None}
    arrays = {}

    def put(section, name, value):
        json_value, found = state_mod.split_arrays(value, f"{section}/{name}")
        extra[section][name] = json_value
        arrays.update(found)

    for key, cb in callbacks.items():
        value = state_mod.callback_state(cb)
        if value is not None:
            put("callbacks", key, value)
    for name, provider in state.items():
        put("providers", name, provider.get_state())
    if include_rng:
        extra["rng"], found = state_mod.split_arrays(state_mod.rng_state(), "rng")
        arrays.update(found)
    return extra, arrays


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector for one save or restore.

    A call over ``n`` variables keeps ``O(n)`` container objects alive until it
    returns (the record, registries, plans, assignment steps). Each young-generation
    collection promotes them, and once the promoted objects reach a quarter of the
    oldest generation, Python runs a full collection over every object of the
    process: 0.4-0.9 s each, once or twice per restore of 10k variables, with Keras
    and its backends imported. Reference counting frees everything as usual meanwhile;
    only reference cycles wait, and the collector runs again once the call returns.
    A collector that was already paused (by the caller, or by an enclosing call) is
    left paused.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _walking_once(fn):
    """Run ``fn`` inside :func:`~keras_stable_state._identity.registry.one_walk` (every registry it
    builds reuses one walk of the model), with the cyclic garbage collector paused."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cyclic_gc_paused(), one_walk():
            return fn(*args, **kwargs)

    return wrapper


@_walking_once
def save_training_state(
    filepath,
    model,
    optimizer=None,
    *,
    model_state="all",
    callbacks=(),
    state=None,
    include_rng=True,
    allow_order_keys=False,
    variables=None,
    mappers=None,
    blocking=True,
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
            extra member), ``.h5`` (the training state alone) or ``.orbax``
            (a directory: model and optimizer arrays stored with Orbax, each
            JAX process writing only its own shards; needs the ``[orbax]``
            extra). With several JAX processes every process must call this
            (it runs collectives); for ``.h5`` process 0 alone writes.
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
        variables: ``{name: keras.Variable}``: variables outside the model that
            the optimizer trains (a temperature ``log_alpha`` passed to
            ``optimizer.apply`` next to ``model.trainable_variables``). Their
            values and slots are saved under ``var:<name>``; pass the same
            names to :func:`restore_training_state`.
        mappers: ``{pattern: StateMapper}``: store each model or optimizer
            array whose key ``re.search(pattern, key)`` finds through the mapper
            (e.g. ``{r"^path:.*kernel$": CastMapper("bfloat16")}``); the file
            records each mapper so the restore decodes without it being passed
            again, and the report lists the keys (docs: smaller checkpoints).
        blocking: ``True``: return once the file is written. ``False``: return a
            :class:`~keras_stable_state.SaveHandle` once every value is copied to
            host memory, and write the file in a background thread (see
            "Asynchronous saves" in the docs). The call first waits for the
            previous background write into the same folder. For ``.keras`` paths,
            Keras' own archive (config and weights) is also built in memory
            before the call returns, since it reads the live model.

    Returns:
        ``filepath`` (``str``) with ``blocking=True``; a
        :class:`~keras_stable_state.SaveHandle` with ``blocking=False``, whose
        ``wait()`` raises the ``OSError`` or other error of the background write.

    Raises:
        TypeError: naming the argument, for a ``filepath`` that is not a path, a
            ``model`` that is not a ``keras.Model``, an ``optimizer`` that is not
            a ``keras.optimizers.Optimizer`` (a name such as ``"adam"`` included),
            ``callbacks`` that are not a list of ``keras.callbacks.Callback``, a
            ``state`` provider without ``get_state()`` / ``set_state()``,
            ``variables`` that are not a dict of ``keras.Variable``, or a flag
            that is not a bool.
        ValueError: for an unknown ``model_state``, a provider or variable name
            that is empty or holds ``/``, a ``variables`` entry that is a
            model variable or named twice, or a ``mappers`` pattern that is not
            a regular expression, matches no saved key, or shares a key with
            another pattern.
        DtypeMismatchError: for a ``mappers`` pattern matching an array that is
            not floating-point (``optimizer#iteration``), naming the key.
        BindingError: if the optimizer trains a variable that is neither in the
            model nor in ``variables`` (naming its path and the fix), or is
            unbuilt while ``model`` is a layer of another model.
        CheckpointFormatError: (raised by the call, also with ``blocking=False``)
            for another extension, a directory, or a
            ``.keras`` path for a model Keras cannot serialize (a subclassed
            model without ``get_config()``): save to ``.h5`` instead; with
            several JAX processes, for a ``.keras`` path.
        StateError: if the model is not built, a provider refuses
            (e.g. pending gradients for a variable that is no longer trainable),
            or a mapper refuses a value (a float16 overflow, NaN for int8),
            naming the key; for ``.orbax`` if orbax-checkpoint is not installed;
            with several JAX processes, on the others, if process 0 failed to write.
        OSError: naming the path when the write fails (disk full); the
            previous file is left intact. With ``blocking=False`` it is raised
            by the handle's ``wait()``, not by the call.

    Example:
        >>> save_training_state("run.keras", model)
        >>> handle = save_training_state("run.h5", model, blocking=False)
        >>> handle.wait()
    """
    started = time.perf_counter()
    verb = "save_training_state"
    filepath = check_filepath(filepath, verb)
    check_flags(verb, blocking=blocking)
    _check_processes(filepath)
    orbax = _orbax_engine.is_orbax_path(filepath)
    if orbax:
        _orbax_engine.check_installed()
        if not blocking:
            raise CheckpointFormatError(
                f"Cannot save {filepath!r} with blocking=False: the '.orbax' engine writes in the calling "
                "thread. Pass blocking=True, or save to a '.h5' / '.keras' path in the background.",
                expected="blocking=True for a '.orbax' path",
                received="blocking=False",
            )
    if not blocking and _multiprocess.process_count() > 1:
        raise StateError(
            f"Cannot save {filepath!r} with blocking=False with {_multiprocess.process_count()} JAX "
            "processes: the save runs collectives on the calling thread. Pass blocking=True."
        )

    def convert(variable):  # the Orbax engine keeps sharded JAX arrays as they are (no gather)
        return _orbax_engine.live_value(variable, to_numpy) if orbax else to_numpy(variable)

    record = training_state_record(
        model,
        optimizer,
        verb=verb,
        convert=convert,
        model_state=model_state,
        callbacks=callbacks,
        state=state,
        include_rng=include_rng,
        allow_order_keys=allow_order_keys,
        variables=variables,
        mappers=mappers,
        before_copy=None if blocking else lambda: _wait_before_copy(filepath),
    )
    if orbax:  # each process writes its own shards; process 0 the sealed record
        return _orbax_engine.write(filepath, record)
    if not blocking:
        return _save_in_background(filepath, model, record, started)
    # With several JAX processes every process gathered the same arrays; process 0 alone writes.
    _multiprocess.run_on_primary(
        filepath,
        lambda: storage.write_record(
            filepath, record, keras_archive_writer=lambda tmp: _save_keras_archive(model, tmp, filepath)
        ),
    )
    return filepath


def _wait_before_copy(filepath):
    """Before a background save copies anything: the target is writable, and the previous
    write into its folder has ended (at most one host copy waiting)."""
    storage.check_target(filepath)
    _async.wait_for_folder(_async.folder_of(filepath))


def training_state_record(
    model,
    optimizer=None,
    *,
    verb,
    model_state="all",
    callbacks=(),
    state=None,
    include_rng=True,
    allow_order_keys=False,
    variables=None,
    mappers=None,
    convert=to_numpy,
    before_copy=None,
):
    """The :class:`~keras_stable_state.format.storage.StateRecord` that :func:`save_training_state`
    writes, with every argument checked as it says (``verb`` names the caller in messages;
    ``convert`` turns a variable into the value stored; ``before_copy`` runs once the
    arguments are checked, before any value is read)."""
    check_model(model, verb)
    if model_state not in MODEL_STATES:
        raise ValueError(
            f"`model_state` must be one of {MODEL_STATES}. Received: model_state={model_state!r}"
        )
    optimizers = check_optimizers(optimizer, verb, model)
    optimizer = optimizers.get(MAIN)
    callbacks = check_callbacks(callbacks, verb)
    state = check_providers(state, verb)
    check_flags(verb, include_rng=include_rng, allow_order_keys=allow_order_keys)
    if not model.built:
        raise StateError(f"Model {model.name!r} is not built; build it before saving its training state.")
    extras = check_variables(variables, verb, model)
    mapper_rules = mappers_mod.check_mappers(mappers, verb)
    if before_copy is not None:
        before_copy()
    saved_vars = {"all": model.variables, "trainable": model.trainable_variables, "none": []}[model_state]
    registry = VariableRegistry.from_model(model)
    # Converted to host arrays one at a time as the file is written (storage.StateRecord).
    model_arrays = {str(registry.key_of(v)): functools.partial(convert, v) for v in saved_vars}
    model_arrays.update(
        (f"{EXTRA}:{n}", functools.partial(convert, v))
        for n, v in extras.items()
        if _extra_saved(v, model_state)
    )
    opt_arrays, opt_meta = save_optimizers(optimizers, model, allow_order_keys, extras, convert=convert)
    extra, arrays = _collect_state(model, optimizer, callbacks, state, include_rng)
    extra[layer_state.SECTION], found = state_mod.split_arrays(
        layer_state.collect_layer_state(model), layer_state.SECTION
    )
    arrays.update(found)
    if mapper_rules:
        model_arrays, opt_arrays, extra[mappers_mod.SECTION], found = mappers_mod.encode_arrays(
            mapper_rules, model_arrays, opt_arrays
        )
        arrays.update(found)
    return storage.StateRecord(
        metadata={
            **writer_metadata(model),
            "model_state": model_state,
            "optimizer_classes": None if optimizer is None else optimizer_classes(optimizer),
            "optimizers": opt_meta,
        },
        contract=TrainableContract.capture(model).to_json(),
        model=model_arrays,
        optimizer=opt_arrays,
        extra=extra,
        arrays=arrays,
    )


def _check_processes(filepath):
    """Refuse a ``.keras`` archive with several JAX processes: Keras' own ``model.save`` cannot
    read arrays whose shards live on other processes."""
    if filepath.endswith(".keras") and _multiprocess.process_count() > 1:
        raise CheckpointFormatError(
            f"Cannot save {filepath!r} with {_multiprocess.process_count()} JAX processes: a '.keras' "
            "archive holds Keras' own weights, and keras' model.save cannot read the shards held by other "
            "processes. Save to a '.h5' path (every process gathers, process 0 writes) or to a '.orbax' "
            "directory (each process writes its own shards).",
            key=None,
            expected="a '.h5' or '.orbax' path",
            received=filepath,
        )


def _save_in_background(filepath, model, record, started):
    """Copy what is still shared with live objects, then write in a background thread."""
    record = _async.host_record(record)
    archive_writer = None
    if filepath.endswith(".keras"):
        buffer = io.BytesIO()
        _save_keras_archive(model, buffer, filepath)
        archive = buffer.getvalue()
        del buffer

        def archive_writer(tmp):
            with open(tmp, "wb") as fh:
                fh.write(archive)

    return _async.submit(
        filepath,
        lambda: storage.write_record(filepath, record, keras_archive_writer=archive_writer),
        started,
    )


def _check_extras_saved(record, extras, strict, report, where):
    """With ``strict``, refuse an extra variable the file has no value for."""
    if not strict or not extras or not isinstance(record, storage.StateRecord):
        return
    model_state = record.metadata.get("model_state", "all")
    absent = [
        f"{EXTRA}:{n}"
        for n, v in extras.items()
        if _extra_saved(v, model_state) and f"{EXTRA}:{n}" not in record.model
    ]
    if absent:
        raise BindingError(
            f"{where} has no saved value for {absent}, named in `variables`: the state was saved "
            "without them (save_training_state(..., variables={...})). Leave them out of `variables`, "
            "or pass strict=False to leave them fresh (listed in report.left_fresh).",
            key=absent[0],
            expected=absent,
            received=sorted(k for k in record.model if k.startswith(f"{EXTRA}:")),
        )


def _extra_saved(variable, model_state) -> bool:
    """Whether ``model_state`` saves the value of an extra variable (as for model variables)."""
    return model_state == "all" or (model_state == "trainable" and variable.trainable)


def _save_keras_archive(model, tmp, filepath):
    try:
        if isinstance(tmp, io.IOBase):
            compat.save_keras_archive_to(model, tmp)
        else:
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
                plan.append((var, coerce(str(key), record.arrays[kpath], var, allow_cast, report)))
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
    keys = {k: parse_model_key(k, where) for k in record.model}
    saved = [(keys[k], np.shape(a), dtype_name(a)) for k, a in record.model.items()]
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
        extra = sorted(k.value for k in unmatched if k.kind == EXTRA)
        if strict and extra:
            raise BindingError(
                f"{where} holds variables saved by name outside the model, {[f'{EXTRA}:{n}' for n in extra]}"
                f", which `variables` does not name; pass them to restore them: restore_training_state"
                f"(..., variables={{{', '.join(f'{n!r}: ...' for n in extra)}}}), or pass strict=False "
                "to skip them.",
                key=f"{EXTRA}:{extra[0]}",
                expected=[f"{EXTRA}:{n}" for n in extra],
                received=None,
            )
        if strict:
            raise BindingError(
                f"Saved model variables {sorted(map(str, unmatched))} in {where} are not in the model. "
                "Rebuild the model as it was saved, or pass strict=False to skip them.",
                key=str(unmatched[0]),
            )
        for k in unmatched:
            report.drop(str(k), drop_reason(k, ()))
    for key, array in record.model.items():
        vkey = keys[key]
        if vkey in bound:
            var, how = bound[vkey]
            plan.append((var, coerce(key, array, var, allow_cast, report)))
            report.matched[key] = how
    restored = {id(v) for v, _ in plan}
    report.left_fresh.extend(str(k) for k, v in registry.entries if id(v) not in restored)
    return plan


def _builds_undone_on_refusal(restore):
    """Whatever ``restore`` refuses, or fails at, after building an unbuilt optimizer
    (a slot that cannot be assigned, a provider without saved state, a failed
    assignment), the optimizer is put back unbuilt: a refused restore leaves
    the optimizers as they were, as it leaves every value."""

    @functools.wraps(restore)
    def guarded(filepath, model, optimizer=None, *args, **kwargs):
        if isinstance(optimizer, dict):
            touched = list(optimizer.values())
        elif optimizer is not None:
            touched = [optimizer]
        else:
            touched = list(tracked_optimizers(model).values()) if isinstance(model, keras.Model) else []
        undo = compat.snapshot_unbuilt(
            [o for o in touched if isinstance(o, keras.optimizers.Optimizer) and not o.built]
        )
        try:
            return restore(filepath, model, optimizer, *args, **kwargs)
        except BaseException:
            undo()
            raise

    return guarded


@_builds_undone_on_refusal
@_walking_once
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
) -> RestoreReport | PendingRestore:
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
            :func:`save_training_state`, a ``.orbax`` directory it wrote
            (each array read onto the variable's current sharding, each JAX
            process reading only its own shards), or a stock Keras ``.keras`` /
            ``.weights.h5`` file. With several JAX processes every process
            must call this (it runs collectives).
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
        variables: ``{name: keras.Variable}``: the variables outside the model
            passed by name to :func:`save_training_state`; their values and
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
            :class:`PendingRestore` assigns them once the variables exist (as a
            ``model.fit`` callback, at ``on_train_begin``, after ``fit`` built
            the model and its optimizer on JAX and PyTorch; or by calling
            ``restore()`` once the model is built), with every check above
            made then. A model that is built already is restored at once.

    Returns:
        A :class:`RestoreReport`; with ``defer=True`` a :class:`PendingRestore`
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
        FileNotFoundError: if there is no file.
        CheckpointInUseError: if another process holds the file locked for writing.
        CorruptCheckpointError: if the file is truncated or damaged, an array
            fails its checksum (for ``.orbax``: its hash), or a record (RNG,
            callback, provider state) is malformed; the key or record is named.
        MalformedKeyError: (a ``CorruptCheckpointError`` and a
            ``KeyFormatError``) if a key in the file cannot be parsed: the file
            is damaged, the model is not to blame.
        CheckpointFormatError: for an unknown format version, a directory or a
            legacy Keras HDF5 file.
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
            or decodes to another shape or dtype (naming the key).

    Whatever is refused, the model, its optimizers and the other state are left
    as they were: an optimizer the restore built before the refusal is put back
    unbuilt.

    Example:
        >>> report = restore_training_state("run.keras", model)
        >>> print(report)
    """
    verb = "restore_training_state"
    filepath = check_filepath(filepath, verb)
    check_model(model, verb)
    given_optimizer = optimizer
    optimizers = check_optimizers(optimizer, verb, model)
    optimizer = optimizers.get(MAIN)
    callbacks = check_callbacks(callbacks, verb)
    providers = check_providers(state, verb)
    check_flags(
        verb,
        strict=strict,
        allow_cast=allow_cast,
        include_rng=include_rng,
        check_schedule=check_schedule,
        keep_learning_rate=keep_learning_rate,
    )
    extras = check_variables(variables, verb, model)
    rules = check_rename(prefix, rename, verb)
    check_flags(verb, defer=defer)
    preloaded = _PRELOADED.get()
    if preloaded and preloaded[0] == filepath:
        record = preloaded[1]
    elif _orbax_engine.is_orbax_path(filepath):
        record = _orbax_engine.read(filepath)
    else:
        record = storage.read_file(filepath)
    if defer:
        mappers_mod.decode_record(record, file_label(filepath))  # an unknown mapper is refused now
        options = {
            "optimizer": given_optimizer,
            "strict": strict,
            "allow_cast": allow_cast,
            "callbacks": callbacks,
            "state": state,
            "include_rng": include_rng,
            "check_schedule": check_schedule,
            "variables": variables,
            "prefix": prefix,
            "rename": rename,
            "keep_learning_rate": keep_learning_rate,
        }
        pending = PendingRestore(filepath, record, model, options)
        if model.built and model.variables:
            pending.restore()
        return pending
    where = file_label(filepath)
    if not model.built or not model.variables:
        raise StateError(
            f"Model {model.name!r} has no variables yet; call it on a batch (a subclassed model's "
            "`build(input_shape)` may create none) before restoring its training state."
        )
    record, mapped = mappers_mod.decode_record(record, where)
    report = RestoreReport()
    report.transfer = rules is not None or not strict
    report.mapped = {k: repr(m) for k, m in mapped.items()}
    report.lossy = [k for k, m in mapped.items() if m.lossy]
    if isinstance(record, storage.StockWeights):
        report.source = record.source
    else:
        report.writer = dict(record.metadata)
        report.transfer_note = any(f == "backend" for f, _, _ in report.writer_differs) and any(
            isinstance(layer, _DRIFTING) for layer in compat.flatten_layers(model)
        )
    # 1. Check and convert everything; nothing is assigned before step 2.
    registry = _model_registry(model, extras)
    if rules is not None:
        record = renamed_record(record, rules, strict, report, where)
    elif isinstance(record, storage.StateRecord):
        check_scope(record, registry, model, where)
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
        if check_schedule and not keep_learning_rate and "schedule" in record.extra:
            state_mod.check_schedule(record.extra["schedule"], optimizer)
    plan = _plan_model(record, model, registry, strict, allow_cast, report, where)
    _check_extras_saved(record, extras, strict, report, where)
    plan += plan_optimizers(
        record,
        optimizers,
        model,
        strict,
        allow_cast,
        report,
        dropped_keys,
        filepath,
        extras=extras,
        keep_learning_rate=keep_learning_rate,
    )
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
    # Vocabularies and bin boundaries: checked now, set before the variables.
    steps += layer_state.plan_layer_state(
        record, model, strict=strict, report=report, where=where, rules=rules
    )
    # 2. Assign: every planned value, or (if an assignment fails) none; then derived layer state.
    plan = _orbax_engine.materialize(plan)  # '.orbax': read (and hash-check) the planned arrays now
    steps += [variable_step(var, array) for var, array in plan]
    steps += layer_state.finalize_steps(model)
    apply_steps(steps, filepath)
    return report


# The record a PendingRestore read when it was made: its restore uses it, not the file now.
_PRELOADED = contextvars.ContextVar("keras_stable_state_preloaded_record", default=None)


class PendingRestore(keras.callbacks.Callback):
    """A restore waiting for the model's variables: ``restore_training_state(..., defer=True)``.

    The file was read and every array checksummed when it was made; nothing is
    assigned until the model is built. Then :meth:`restore` matches, checks and
    assigns everything exactly as :func:`restore_training_state` does (all or
    nothing). Passed to ``model.fit`` as a callback it restores at
    ``on_train_begin``, when ``fit`` has built the model and its optimizer
    (Keras' ``BackupAndRestore`` restores there too) on the JAX and PyTorch
    backends; TensorFlow builds the model inside the first training step, so
    there build it first and call :meth:`restore` before ``fit`` (the callback
    raises a ``StateError`` saying so rather than train unrestored).

    Attributes:
        filepath: The file the state was read from.
        report: The :class:`RestoreReport` once restored, else ``None``.

    Example:
        >>> model = build_model()                      # not built: no input shape yet
        >>> model.compile(optimizer="adam", loss="mse")
        >>> pending = kss.restore_training_state("run.h5", model, defer=True)
        >>> model.fit(x, y, callbacks=[pending])       # restored before the first batch
        >>> print(pending.report)
    """

    def __init__(self, filepath, record, target, options):
        super().__init__()
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
            The :class:`RestoreReport`, also kept as ``self.report``.

        Raises:
            StateError: if it was restored already or the model is still not
                built, and every error of :func:`restore_training_state`.
        """
        if self.report is not None:
            raise StateError(
                f"The state of {file_label(self.filepath)} was already restored into {self._target.name!r} "
                "by this PendingRestore; call restore_training_state again to restore it twice."
            )
        token = _PRELOADED.set((self.filepath, self._record))
        try:
            report = restore_training_state(self.filepath, self._target, **self._options)
        finally:
            _PRELOADED.reset(token)
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


def plan_callbacks(record, callbacks, report, where=None):
    """Check the saved callback states and return the call that puts them back.

    Callbacks are matched by key: the names of a dict (``{"es": cb}``), or for a
    list the class name and index among callbacks of that class; every saved state is checked before anything is set, and the returned call
    sets all of them or (if one refuses) none. A stateful callback without a
    saved state is listed in ``report.left_fresh``.

    Args:
        record: A :class:`~keras_stable_state.format.storage.StateRecord`.
        callbacks: The live callbacks: a dict ``{name: callback}`` or a list.
        report: The :class:`RestoreReport` to add to.
        where: The file, for messages.

    Returns:
        ``[]``, or a list of one callable that sets every callback state.

    Raises:
        CorruptCheckpointError: naming the record (``"callbacks/EarlyStopping/0"``)
            of a malformed saved state.
    """
    callbacks = check_callbacks(callbacks, "StableCheckpoint")
    steps = _callback_steps(record, callbacks, report, None if where is None else file_label(where))
    return [lambda: apply_steps(steps, where)] if steps else []


def _callback_steps(record, callbacks, report, where):
    extra, arrays = record.extra, record.arrays
    steps = []
    saved_cbs = extra.get("callbacks", {})
    for key, cb in callbacks.items():
        if state_mod.callback_state(cb) is None:
            continue
        if key not in saved_cbs:
            report.left_fresh.append(f"callback:{key}")
            continue
        name = f"callbacks/{key}"
        value = state_mod.join_arrays(saved_cbs[key], arrays, where)
        value = state_mod.parse_callback_state(cb, value, name, where)
        steps.append(
            state_step(
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
        steps.append(state_step(record_name, provider.get_state, provider.set_state, value))
        report.restored_state.append(f"state:{name}")
    steps += _callback_steps(record, callbacks, report, where)
    if extra.get("rng") is not None:
        # Checked even with include_rng=False: a malformed record means a damaged file.
        parsed = state_mod.parse_rng_state(state_mod.join_arrays(extra["rng"], arrays, where), where)
        if include_rng:
            steps.append(rng_step(parsed))
            report.restored_state.append("rng")
    return steps
