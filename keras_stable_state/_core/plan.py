"""Restoring a record that is read: every check and conversion first (the planners), then
every assignment, all or nothing.

`restore_record` is the body of [`restore_training_state`][keras_stable_state.restore_training_state]
once its arguments are checked (`RestoreRequest`, with the `ModelIndex` of its model) and
the file is read: it
plans the model variables, the optimizers
(`plan_optimizers`), the callbacks,
providers and random state, and the layer state, then runs every step with
`apply_steps`. `plan_callbacks` plans the
callback states alone (``StableCheckpoint`` puts them back at train begin).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_stable_state import _keras_compat, _state
from keras_stable_state._core import mappers
from keras_stable_state._core.apply import apply_steps, rng_step, state_step, variable_step
from keras_stable_state._core.arguments import check_callbacks, extra_saved
from keras_stable_state._core.host_rollback import HostRollback
from keras_stable_state._core.in_place import assign_in_place, clear_partial, mark_partial, put_back_or_mark
from keras_stable_state._core.report import RestoreReport
from keras_stable_state._core.requests import RestoreRequest
from keras_stable_state._core.scope import check_scope, renamed_record
from keras_stable_state._core.slot_restore import plan_optimizers
from keras_stable_state._core.torch_restore import plan_torch_optimizers
from keras_stable_state._identity.contract import check_contract, contract_diff, read_contract
from keras_stable_state._identity.dtypes import coerce, dtype_name, float_cast
from keras_stable_state._identity.keys import EXTRA, VariableKey, file_label
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer import provider_calls
from keras_stable_state._optimizer.matching import drop_reason
from keras_stable_state._state import layers, metrics
from keras_stable_state.errors import NAMES_SHOWN, BindingError, StateError, listed, shown
from keras_stable_state.format import orbax_file
from keras_stable_state.format.proven import FileArray
from keras_stable_state.format.record import BY_KEY, BY_STRUCTURE

__all__ = ["restore_record", "plan_callbacks"]


# Layers whose continued training differs across backends even from identical state.
_DRIFTING = (keras.layers.Embedding, keras.layers.BatchNormalization, keras.layers.LayerNormalization)


def restore_record(record, request: RestoreRequest) -> RestoreReport:
    """Check and convert everything ``record`` holds for ``request.model``, then assign it
    all, or (if an assignment fails) put back every value already assigned and re-raise.

    Args:
        record: A `StateRecord` or
            `StockWeights`, read and checksummed.
        request: The checked arguments.

    Returns:
        The [`RestoreReport`][keras_stable_state.RestoreReport].

    Raises:
        Every error of [`restore_training_state`][keras_stable_state.restore_training_state] but those
        about its arguments and reading the file.
    """
    model, strict, rules, where = request.model, request.strict, request.rules, request.where
    index = request.index
    if not model.built or not model.variables:
        raise StateError(
            f"Model {model.name!r} has no variables yet; call it on a batch (a subclassed model's "
            "`build(input_shape)` may create none) before restoring its training state."
        )
    read = record  # its arrays, as read, stay alive (ids below) until the restore ends
    owned = _read_arrays(record) if request.owned else set()
    record, mapped = mappers.decode_record(record, where)
    report = RestoreReport()
    report.transfer = rules is not None or not strict
    report.mapped = {k: repr(m) for k, m in mapped.items()}
    report.lossy = [k for k, m in mapped.items() if m.lossy]
    if record.matched_by == BY_STRUCTURE:  # a stock Keras file
        report.source = record.source
    else:
        report.writer = dict(record.metadata)
        report.transfer_note = any(f == "backend" for f, _, _ in report.writer_differs) and any(
            isinstance(layer, _DRIFTING) for layer in _keras_compat.flatten_layers(model)
        )
    # 1. Check and convert everything; nothing is assigned before step 2.
    registry = _model_registry(request)
    if rules is not None:
        record = renamed_record(record, rules, strict, report, where, index.keys)
    elif record.matched_by == BY_KEY:
        check_scope(record, registry, model, where)
    dropped_keys = []
    if record.contract is not None:
        contract = read_contract(record.contract, index.keys)
        if strict:
            check_contract(contract, index, allow_cast=request.allow_cast)
        else:
            missing, _, reshaped, retyped = contract_diff(contract, index)
            if request.allow_cast:  # a float variable re-typed since is cast (coerce lists it)
                retyped = [t for t in retyped if not float_cast(t[1], t[2])]
            if reshaped or retyped:  # neither can be dropped nor left fresh: refused, listed in full
                check_contract(contract, index, allow_cast=request.allow_cast)
            dropped_keys = missing
    optimizer = request.optimizer
    if optimizer is not None:
        if request.check_schedule and not request.keep_learning_rate and "schedule" in record.extra:
            _state.check_schedule(record.extra["schedule"], optimizer)
    plan = _plan_model(record, registry, request, report)
    _check_extras_saved(record, request)
    plan += plan_optimizers(record, request, report, dropped_keys)
    steps = []
    providers = request.providers
    if record.matched_by == BY_KEY:
        steps = _plan_state(record, request, report)
    elif providers:
        raise StateError(
            f"{where} is a {record.source}, which holds no provider state; the providers "
            f"{listed(sorted(providers))} in `state` cannot be restored from it. Save them with "
            "save_training_state(..., state={name: provider}).",
            key=sorted(providers)[0],
        )
    steps += plan_torch_optimizers(record, request, report)
    # Vocabularies and bin boundaries: checked now, set before the variables.
    steps += layers.plan_layer_state(record, index, strict=strict, report=report, where=where, rules=rules)
    # 2. Assign: every planned value, or (if an assignment fails) none; then derived layer state.
    plan, fresh = orbax_file.materialize(plan)  # '.orbax': read (and hash-check) the planned arrays now
    owned |= fresh
    plan, in_place = _in_file(plan, request.in_place, owned)
    owned -= _sparse_views(plan, owned)
    taken = set()  # an array is handed to one variable at most
    for var, array in plan:
        mine = id(array) in owned and id(array) not in taken
        if mine:
            taken.add(id(array))
        steps.append(variable_step(var, array, owned=mine))
    steps += layers.finalize_steps(index)
    rollback = HostRollback() if request.rollback_on_host and in_place else None
    if in_place:
        assign_in_place(in_place, model, where, rollback)
    try:
        apply_steps(steps, request.filepath)
    except BaseException as err:
        if rollback is not None:  # the arrays read in place are put back from their host copies
            put_back_or_mark(rollback, model, where, err)
            raise
        if in_place:  # the variables read in place keep their new values: the model is not whole
            reason = (
                f"restoring {where} in place assigned {len(in_place)} variable(s), then failed at the rest "
                f"({type(err).__name__}: {err}), which was put back"
            )
            mark_partial(model, reason)
            raise StateError(
                f"Model {model.name!r}: {reason}. The model is marked: fit and "
                "save_training_state refuse it until a restore into it succeeds."
            ) from err
        raise
    clear_partial(model)
    del read
    return report


def _in_file(plan, in_place: bool, owned: set) -> tuple[list, list]:
    """``(plan, in place)``: the ``(variable, array)`` pairs of ``plan`` whose array is still in
    the file (`FileArray`) go to ``in place`` when ``in_place``; otherwise each is read now
    into new memory (checked), which the restore owns (added to ``owned``)."""
    if not any(isinstance(array, FileArray) for _, array in plan):
        return plan, []
    rest, deferred = [], []
    for var, array in plan:
        if not isinstance(array, FileArray):
            rest.append((var, array))
        elif in_place:
            deferred.append((var, array))
        else:
            value = np.asarray(array)
            owned.add(id(value))
            rest.append((var, value))
    return rest, deferred


def _read_arrays(record) -> set:
    """The ids of the host arrays of ``record``'s model and optimizer sections, as read
    (a mapper's decoded or a cast array is not among them)."""
    if record.matched_by == BY_STRUCTURE:  # a stock Keras file: model arrays by path
        optimizer = record.optimizer
        groups = (record.arrays.values(), optimizer.values() if isinstance(optimizer, dict) else optimizer)
    else:
        groups = (record.model.values(), record.optimizer.values())
    return {id(a) for group in groups for a in group if type(a) is np.ndarray}


def _root(array):
    """The array whose memory ``array`` views (itself if it owns its memory)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _sparse_views(plan, owned: set) -> set:
    """The ids of owned arrays that are views of a buffer (a file image read whole,
    `image`) of which the variables would take less than
    half: a variable keeping such a view keeps the whole buffer alive, so those are
    copied instead (a restore of part of a file holds no more than about twice what it
    restored)."""
    taken, views = {}, {}
    for _, array in plan:
        if id(array) not in owned or type(array) is not np.ndarray or array.base is None:
            continue
        root = _root(array)
        views.setdefault(id(root), (root, set()))[1].add(id(array))
        taken[id(root)] = taken.get(id(root), 0) + array.nbytes
    sparse = set()
    for key, (root, ids) in views.items():
        if 2 * taken[key] < root.nbytes:
            sparse |= ids
    return sparse


def _model_registry(request: RestoreRequest):
    """The model's variables by stable path (from the request's walk), then its extras as
    ``var:<name>``."""
    registry, extras = request.index.registry(), request.extras
    if not extras:
        return registry
    return registry.rekeyed(registry.entries + [(VariableKey(EXTRA, n), v) for n, v in extras.items()])


def _plan_model(record, registry, request, report):
    """The ``(variable, array)`` assignments of the model variables; every difference
    the request does not allow refused, the others listed in ``report``."""
    strict, allow_cast, where = request.strict, request.allow_cast, request.where
    plan = []
    if record.matched_by == BY_STRUCTURE:  # a stock Keras file: by the layers' paths
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
            absent_text = listed((f"{k} (at {shown(p)})" for k, p in absent), quote=False)[1:-1]
            raise BindingError(
                f"The stock Keras file {where} has no value for model variables {absent_text}; with "
                "strict=True every variable must be restored. The model has layers or variables the "
                "saving model did not have. Restore into the model that saved it, or pass strict=False "
                "to leave these variables fresh (listed in report.left_fresh).",
                key=absent[0][0],
                expected=[p for _, p in absent],
                received=None,
            )
        report.left_fresh.extend(k for k, _ in absent)
        return plan
    keys = {k: request.index.keys.model_key(k, where) for k in record.model}
    saved = [(keys[k], np.shape(a), dtype_name(a)) for k, a in record.model.items()]
    bound, unmatched = registry.bind(saved)
    if not bound and saved:
        raise BindingError(
            f"No saved model variable in {where} matches this model: the file has "
            f"{listed(sorted(str(k) for k, _, _ in saved))}, the model has "
            f"{listed(sorted(map(str, registry.keys())))}. It was written for another model; restore it "
            "into that model.",
            key=str(saved[0][0]),
        )
    if unmatched:
        extra = sorted(k.value for k in unmatched if k.kind == EXTRA)
        if strict and extra:
            raise BindingError(
                f"{where} holds variables saved by name outside the model, {listed(f'{EXTRA}:{n}' for n in extra)}"
                f", which `variables` does not name; pass them to restore them: restore_training_state"
                f"(..., variables={{{', '.join(f'{shown(n)}: ...' for n in extra[:NAMES_SHOWN])}"
                f"{', ...' if len(extra) > NAMES_SHOWN else ''}}}), or pass strict=False "
                "to skip them.",
                key=f"{EXTRA}:{extra[0]}",
                expected=[f"{EXTRA}:{n}" for n in extra],
                received=None,
            )
        if strict:
            raise BindingError(
                f"Saved model variables {listed(sorted(map(str, unmatched)))} ({len(unmatched):,}) in {where} "
                "are not in the model. "
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


def _check_extras_saved(record, request):
    """With ``strict``, refuse an extra variable the file has no value for."""
    extras, strict, where = request.extras, request.strict, request.where
    if not strict or not extras or record.matched_by != BY_KEY:
        return
    model_state = record.metadata.get("model_state", "all")
    absent = [
        f"{EXTRA}:{n}"
        for n, v in extras.items()
        if extra_saved(v, model_state) and f"{EXTRA}:{n}" not in record.model
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


def plan_callbacks(record, callbacks, report, where=None):
    """Check the saved callback states and return the call that puts them back.

    Callbacks are matched by key: the names of a dict (``{"es": cb}``), or for a
    list the class name and index among callbacks of that class; every saved state is checked before anything is set, and the returned call
    sets all of them or (if one refuses) none. A stateful callback without a
    saved state is listed in ``report.left_fresh``; a saved state (but ``{}``) that no
    callback takes, in ``report.dropped`` (``"callback:<key>"``, reason ``"no callback of this fit
    takes it"``).

    Args:
        record: A `StateRecord`.
        callbacks: The live callbacks: a dict ``{name: callback}`` or a list.
        report: The [`RestoreReport`][keras_stable_state.RestoreReport] to add to.
        where: The file, for messages.

    Returns:
        ``[]``, or a list of one callable that sets every callback state.

    Raises:
        CorruptCheckpointError: naming the record (``"callbacks/EarlyStopping/0"``)
            of a malformed saved state.
    """
    callbacks = check_callbacks(callbacks, "StableCheckpoint")
    steps = _callback_steps(record, callbacks, report, None if where is None else file_label(where))
    for key, value in record.extra.get("callbacks", {}).items():
        if key not in callbacks and value not in ({}, [], None):  # {}: a stateless one
            report.drop(f"callback:{key}", "no callback of this fit takes it")
    return [lambda: apply_steps(steps, where)] if steps else []


def _callback_steps(record, callbacks, report, where):
    extra, arrays = record.extra, record.arrays
    steps = []
    saved_cbs = extra.get("callbacks", {})
    for key, cb in callbacks.items():
        if _state.callback_state(cb) is None:
            continue
        if key not in saved_cbs:
            report.left_fresh.append(f"callback:{key}")
            continue
        name = f"callbacks/{key}"
        value = _state.join_arrays(saved_cbs[key], arrays, where)
        value = _state.parse_callback_state(cb, value, name, where)
        steps.append(
            state_step(
                name,
                lambda cb=cb: _state.callback_state(cb),
                lambda v, cb=cb: _state.set_callback_state(cb, v),
                value,
            )
        )
        report.restored_state.append(f"callback:{key}")
    return steps


def _plan_state(record, request, report):
    """Check the non-variable state in full; the steps that put it back."""
    providers, where = request.providers, request.where
    extra, arrays = record.extra, record.arrays
    saved = extra.get("providers", {})
    steps = []
    for name, provider in providers.items():
        if name not in saved:
            raise StateError(
                f"{where} has no state for provider {name!r} (it has {listed(sorted(saved))}). "
                "Save it with save_training_state(..., state={name: provider}), or leave it out of "
                "`state`.",
                key=name,
                expected=name,
                received=sorted(saved),
            )
        record_name = f"providers/{name}"
        value = _state.join_arrays(saved[name], arrays, where)
        get_state, set_state = provider_calls(provider, request.index)
        value = _state.check_provider_state(provider, value, record_name, where, current=get_state())
        steps.append(state_step(record_name, get_state, set_state, value))
        report.restored_state.append(f"state:{name}")
    if request.include_metrics and metrics.NAME not in providers:
        steps += _metrics_steps(record, request.model, report, where)
    steps += _callback_steps(record, request.callbacks, report, where)
    if extra.get("rng") is not None:
        # Checked even with include_rng=False: a malformed record means a damaged file.
        parsed = _state.parse_rng_state(_state.join_arrays(extra["rng"], arrays, where), where)
        if request.include_rng:
            steps.append(rng_step(parsed))
            report.restored_state.append("rng")
    return steps


def _metrics_steps(record, model, report, where):
    """The step putting back the model's metric variables saved by ``save_training_state``
    (`metrics_state.plan_metrics`: by path); each live one without a saved value is listed
    in ``report.left_fresh`` as ``metric:<path>``, each saved one of another shape in
    ``report.dropped``. A file without them (written before they were saved, or by an
    older ``StableCheckpoint``, whose record names no paths) leaves them all fresh."""
    saved = record.extra.get("providers", {}).get(metrics.NAME)
    live = model.metrics_variables
    if saved is None or not metrics.keyed(saved):
        report.left_fresh.extend(f"metric:{v.path}" for v in live)
        return []
    value = _state.join_arrays(saved, record.arrays, where)
    pairs, fresh, dropped = metrics.plan_metrics(model, value, where)
    report.left_fresh.extend(f"metric:{p}" for p in fresh)
    for path, reason in dropped:
        report.drop(f"metric:{path}", reason)
    if not pairs:
        return []
    variables = [v for v, _ in pairs]
    arrays = [np.array(a, copy=True) for _, a in pairs]

    def put(values):
        for v, a in zip(variables, values, strict=True):
            v.assign(a)

    report.restored_state.append("metrics")
    return [state_step(f"providers/{metrics.NAME}", lambda: [to_numpy(v) for v in variables], put, arrays)]
