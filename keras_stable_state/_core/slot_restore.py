"""Slot matching on restore: saved optimizer arrays to live optimizer variables, by key.

For every optimizer a model tracks, saved arrays are matched, checked and
planned (`plan_optimizers`, `plan_optimizer_arrays`), including the
checks of parameter-group routing (``MultiOptimizer``) and accumulation windows
(``gradient_accumulation_steps``). ``StableOptimizer.load_own_variables``
restores through `restore_optimizer_arrays` (registered with
`keras_stable_state._optimizer.wrapper` when this module is imported, with
the package; the wrapper does not import this module, which imports it).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_stable_state import _keras_compat as compat
from keras_stable_state._core.apply import apply_steps, coerce, variable_step
from keras_stable_state._core.report import RestoreReport
from keras_stable_state._identity.keys import (
    EXTRA,
    MAIN,
    file_label,
    parse_optimizer_key,
    split_entry_name,
)
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer.entries import (
    optimizer_classes,
    optimizer_entries,
    optimizer_registry,
    optimizer_tree,
    unwrap,
)
from keras_stable_state._optimizer.groups import check_windows_and_groups, refuse_regrouped
from keras_stable_state._optimizer.slots import build_for, check_inside
from keras_stable_state._optimizer.tracking import stable_optimizer_in
from keras_stable_state._optimizer.wrapper import bind_unchecked, register_keyed_restore
from keras_stable_state.errors import BindingError, listed

__all__ = [
    "COUNTER_MARGIN",
    "drop_reason",
    "plan_optimizer_arrays",
    "plan_optimizers",
    "restore_optimizer_arrays",
]


def _learning_rate_ids(optimizer) -> set:
    """``id`` of every learning-rate variable of the optimizer and the ones it wraps."""
    return {
        id(compat.learning_rate_variable(opt))
        for _, opt in optimizer_tree(optimizer)
        if isinstance(compat.learning_rate_variable(opt), keras.Variable)
    }


def _iteration_ids(optimizer) -> set:
    """``id`` of every ``iterations`` counter of the optimizer and the ones it wraps."""
    return {
        id(compat.iterations_variable(opt))
        for _, opt in optimizer_tree(optimizer)
        if isinstance(compat.iterations_variable(opt), keras.Variable)
    }


COUNTER_MARGIN = 0.01
"""How close (a fraction of its dtype's maximum) a restored ``iterations`` counter must be
to its dtype's maximum to be listed in ``RestoreReport.counters_near_limit``."""


def _note_counter(report, key, variable, value, iteration_ids) -> None:
    """List an ``iterations`` counter restored within `COUNTER_MARGIN` of its
    dtype's maximum (Keras' ``int32`` counter on JAX and Torch wraps to negative there)."""
    if id(variable) not in iteration_ids:
        return
    dtype = np.dtype(keras.backend.standardize_dtype(variable.dtype))
    if dtype.kind not in "iu":
        return
    limit = int(np.iinfo(dtype).max)
    count = int(np.asarray(value).reshape(()))
    if count >= limit - int(limit * COUNTER_MARGIN):
        report.counters_near_limit.append((key, count, limit, dtype.name))


NOT_IN_MODEL = "not in the model (renamed or removed)"


NOT_PASSED = "extra variable not passed in `variables=`"


KEPT_LR = "kept the compiled learning rate (keep_learning_rate=True)"


NO_OPTIMIZER = "no optimizer to restore into (compile the model or pass optimizer=)"


def drop_reason(vkey, frozen) -> str:
    """Why the slots of saved variable ``vkey`` are dropped; ``frozen``: keys of model
    variables that are no longer trained."""
    if str(vkey) in frozen:
        return "no longer trained"
    return NOT_PASSED if vkey.kind == EXTRA else NOT_IN_MODEL


def plan_optimizer_arrays(
    optimizer,
    model,
    arrays,
    *,
    keyed,
    strict,
    allow_cast,
    report,
    dropped_keys=(),
    where=None,
    name=None,
    extras=None,
    keep_learning_rate=False,
    parsed_keys=None,
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
        name: The optimizer's name among the model's optimizers (its keys'
            ``@<name>/`` prefix); ``None`` for ``model.optimizer``.
        extras: ``{name: variable}`` outside the model, keyed ``var:<name>``.
        keep_learning_rate: Leave learning-rate variables at their live value;
            every difference is listed in ``report.learning_rates`` either way.
        parsed_keys: ``{entry key: parse_optimizer_key(entry key)}`` already parsed
            by the caller (`plan_optimizers`); the others are parsed here.

    Returns:
        A list of ``(variable, array)`` to assign.

    Raises:
        MalformedKeyError: a saved entry key cannot be parsed (a damaged file).
        BindingError: count, shape or key mismatches (named in the message).
        DtypeMismatchError: dtype differences without ``allow_cast``, between
            kinds (integer, boolean, float), or an integer out of range.
    """
    registry = optimizer_registry(optimizer, model, extras)
    # Live keys only match saved ones: an order key here binds nothing a saved named key owns.
    live = optimizer_entries(optimizer, registry, name=name, allow_order_keys=True)
    lr_ids = _learning_rate_ids(optimizer)
    iteration_ids = _iteration_ids(optimizer)
    plan = []
    if not keyed:
        if len(arrays) != len(live):
            first = live[min(len(arrays), len(live) - 1)].key if live else "(none)"
            raise BindingError(
                f"The file holds {len(arrays)} optimizer variables in positional order, but "
                f"{type(unwrap(optimizer)).__name__} has {len(live)}; the first that differs is "
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
            value = coerce(entry.key, array, entry.variable, allow_cast, report)
            _note_counter(report, entry.key, entry.variable, value, iteration_ids)
            plan.append((entry.variable, value))
            report.matched[f"optimizer[{i}] -> {entry.key}"] = "order"
        return plan

    live_by_key = {e.key: e for e in live}
    parsed_keys = parsed_keys or {}
    label = file_label(where)
    parsed = {k: parsed_keys[k] if k in parsed_keys else parse_optimizer_key(k, label) for k in arrays}
    owners = {}
    for vkey, _ in parsed.values():
        if vkey is not None:
            owners.setdefault(vkey, (vkey, None, None))
    bound, unmatched = registry.bind(owners.values())
    dropped_keys = set(dropped_keys)
    unmatched = [k for k in unmatched if str(k) not in dropped_keys]
    if unmatched and strict:
        extra = sorted(k.value for k in unmatched if k.kind == EXTRA)
        hint = (
            f" Slots of {['var:' + n for n in extra]} belong to variables passed by name when saving; "
            f"pass variables={{{', '.join(repr(n) + ': ...' for n in extra)}}} to restore them."
            if extra
            else ""
        )
        raise BindingError(
            f"Saved optimizer slots belong to variables the model does not have: "
            f"{listed(sorted(map(str, unmatched)))}. The model differs from the one saved; rebuild it as "
            f"it was, or pass strict=False to drop these slots.{hint}",
            key=str(unmatched[0]),
        )
    used, frozen = set(), None
    report.order_keys.extend(k for k, (vkey, _) in parsed.items() if vkey is not None and not vkey.named)
    for key, array in arrays.items():
        vkey, slot = parsed[key]
        if vkey is None:
            live_key, how = key, "name"
        elif vkey in bound:
            var, how = bound[vkey]
            live_key = f"{registry.key_of(var)}#{slot}"
        else:
            if frozen is None:
                in_model = {str(k) for k in VariableRegistry.from_model(model).keys()} if model else set()
                frozen = dropped_keys & in_model
            report.drop(key, drop_reason(vkey, frozen))
            continue
        entry = live_by_key.get(live_key)
        if (
            entry is None
            and keep_learning_rate
            and vkey is None
            and slot.rsplit("/", 1)[-1] == "learning_rate"
        ):
            report.drop(key, KEPT_LR)
            continue
        if entry is None and vkey is not None and strict:
            refuse_regrouped(key, live_key, live_by_key, optimizer, where)
        if entry is None:
            if strict:
                raise BindingError(
                    f"Saved optimizer variable {key} has no live counterpart {live_key} in "
                    f"{type(unwrap(optimizer)).__name__}. The optimizer differs from the one saved "
                    "(another class or options); build the same optimizer, or pass strict=False.",
                    key=key,
                )
            report.drop(key, "no such variable in the live optimizer")
            continue
        used.add(live_key)
        value = coerce(live_key, array, entry.variable, allow_cast, report)
        _note_counter(report, live_key, entry.variable, value, iteration_ids)
        if id(entry.variable) in lr_ids:
            compiled, saved = float(to_numpy(entry.variable)), float(value)
            if compiled != saved:
                action = "kept" if keep_learning_rate else "replaced"
                report.learning_rates.append((live_key, compiled, saved, action))
            if keep_learning_rate:
                continue
        plan.append((entry.variable, value))
        report.matched[live_key] = how
    fresh = [
        e.key for e in live if e.key not in used and not (keep_learning_rate and id(e.variable) in lr_ids)
    ]
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
    apply_steps([variable_step(var, array) for var, array in plan])
    return report


def plan_optimizers(
    record,
    optimizers,
    model,
    strict,
    allow_cast,
    report,
    dropped_keys,
    filepath,
    *,
    extras=None,
    keep_learning_rate=False,
):
    """Plan every optimizer's arrays: saved names matched to live names."""
    where = file_label(filepath)
    saved_opt = record.optimizer
    meta_all = record.metadata.get("optimizers")  # (a stock Keras file's metadata is empty)
    meta_all = meta_all if isinstance(meta_all, dict) else {}
    parsed_keys = {}  # parsed once here, reused by plan_optimizer_arrays
    if isinstance(saved_opt, dict):
        groups = {}
        for key, array in saved_opt.items():
            parsed_keys[key] = parse_optimizer_key(key, where)
            groups.setdefault(split_entry_name(parsed_keys[key][1])[0], {})[key] = array
    else:
        groups = {MAIN: saved_opt} if len(saved_opt) else {}
    if not optimizers:
        for saved in groups.values():
            for key in saved if isinstance(saved, dict) else range(len(saved)):
                report.drop(key if isinstance(key, str) else f"optimizer[{key}]", NO_OPTIMIZER)
        return []
    absent = sorted(set(groups) - set(optimizers))
    if absent and strict:
        raise BindingError(
            f"{where} holds the state of optimizers {absent}, which the model does not track (it has "
            f"{listed(sorted(optimizers))}). Set them on the model as attributes named as saved, pass them as "
            "optimizer={name: optimizer}, or pass strict=False to leave their state out.",
            key=absent[0],
            expected=absent,
            received=sorted(optimizers),
        )
    for n in absent:
        report.drop(f"optimizer:{n}", "no live optimizer of that name")
    if not groups:
        return []  # the file holds no optimizer state (saved without an optimizer)
    unsaved = sorted(
        n
        for n, o in optimizers.items()
        if n not in groups and o.built and (meta_all.get(n) or {}).get("built", True)
    )
    if unsaved and strict:
        raise BindingError(
            f"{where} has no state for optimizers {listed(unsaved)} of the model (it holds {listed(sorted(groups))}): "
            "they would keep fresh slots. Restore a checkpoint saved with them, or pass strict=False.",
            key=unsaved[0],
        )
    report.left_fresh.extend(f"optimizer:{n}" for n in unsaved)
    plan = []
    for name, saved in groups.items():
        opt = optimizers.get(name)
        if opt is None:
            continue
        meta = meta_all.get(name) or {}
        if name == MAIN and not meta:
            classes = getattr(record, "metadata", {}).get("optimizer_classes")
            meta = {"classes": classes} if meta_all == {} else {}
        saved_classes = meta.get("classes")
        live_classes = optimizer_classes(opt)
        if strict and saved_classes is not None and saved_classes != live_classes:
            label = "" if name == MAIN else f" {name!r}"
            raise BindingError(
                f"The optimizer{label} state in {where} was saved from {saved_classes} but the live "
                f"optimizer is {live_classes}. Slots of another optimizer class would be applied with other "
                "update rules; build the optimizer as saved, or pass strict=False to restore what matches.",
                key=name,
                expected=saved_classes,
                received=live_classes,
            )
        build_for(name, opt, model, meta, report, where, extras)
        if stable_optimizer_in(opt) is not None:
            bind_unchecked(stable_optimizer_in(opt), model)  # bound to the model given
        check_inside(opt, model, extras or {}, "restore_training_state")
        check_windows_and_groups(name, opt, model, meta, where)
        plan += plan_optimizer_arrays(
            opt,
            model,
            saved,
            keyed=isinstance(saved, dict),
            strict=strict,
            allow_cast=allow_cast,
            report=report,
            dropped_keys=dropped_keys,
            where=filepath,
            name=name,
            extras=extras,
            keep_learning_rate=keep_learning_rate,
            parsed_keys=parsed_keys,
        )
    return plan


register_keyed_restore(restore_optimizer_arrays)
