"""The optimizer state of a checkpoint record, planned for every optimizer a model tracks.

`plan_optimizers` splits the record's optimizer arrays by optimizer, checks each
optimizer's class, builds it where the record says it was built, checks parameter-group
routing (``MultiOptimizer``) and accumulation windows (``gradient_accumulation_steps``),
then matches its slots (`keras_stable_state._optimizer.matching.match_slots`) and lists
what the matching noted in the ``RestoreReport``. The plan is assigned with the rest of
the restore (`keras_stable_state._core.plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keras_stable_state._identity.keys import MAIN, split_entry_name
from keras_stable_state._optimizer.entries import optimizer_classes
from keras_stable_state._optimizer.groups import check_windows_and_groups
from keras_stable_state._optimizer.matching import SlotNotes, match_slots
from keras_stable_state._optimizer.slots import build_for, check_inside
from keras_stable_state._optimizer.tracking import stable_optimizer_in
from keras_stable_state._optimizer.wrapper import bind_unchecked
from keras_stable_state.errors import BindingError, listed

if TYPE_CHECKING:
    from keras_stable_state._core.requests import RestoreRequest

__all__ = ["NO_OPTIMIZER", "plan_optimizers"]


NO_OPTIMIZER = "no optimizer to restore into (compile the model or pass optimizer=)"


def _report(report, notes: SlotNotes) -> None:
    """List in ``report`` (a ``RestoreReport``) what `match_slots` noted for one optimizer."""
    report.matched.update(notes.matched)
    for key, reason in notes.dropped.items():
        report.drop(key, reason)
    report.left_fresh.extend(notes.left_fresh)
    report.order_keys.extend(notes.order_keys)
    report.casts.extend(notes.casts)
    report.lossy.extend(k for k in notes.lossy if k not in report.lossy)
    report.learning_rates.extend(notes.learning_rates)
    report.counters_near_limit.extend(notes.counters_near_limit)


def plan_optimizers(record, request: RestoreRequest, report, dropped_keys):
    """Plan every optimizer's arrays of ``record`` for ``request`` (its optimizers, flags and
    `ModelIndex`): saved names matched to live names; ``dropped_keys``: the variable keys
    whose slots are dropped on purpose (``strict=False`` contract differences)."""
    optimizers, model, strict, extras = request.optimizers, request.model, request.strict, request.extras
    index, where = request.index, request.where
    saved_opt = record.optimizer
    meta_all = record.metadata.get("optimizers")  # (a stock Keras file's metadata is empty)
    meta_all = meta_all if isinstance(meta_all, dict) else {}
    parsed_keys = {}  # parsed once here, reused by match_slots
    if isinstance(saved_opt, dict):
        groups = {}
        for key, array in saved_opt.items():
            parsed_keys[key] = index.keys.optimizer_key(key, where)
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
        build_for(name, opt, model, meta, report, where, extras, index)
        if stable_optimizer_in(opt) is not None:
            bind_unchecked(stable_optimizer_in(opt), model)  # bound to the model given
        check_inside(opt, model, extras or {}, "restore_training_state")
        check_windows_and_groups(name, opt, model, meta, where, index)
        planned, notes = match_slots(
            opt,
            model,
            saved,
            keyed=isinstance(saved, dict),
            strict=strict,
            allow_cast=request.allow_cast,
            dropped_keys=dropped_keys,
            where=request.filepath,
            name=name,
            extras=extras,
            keep_learning_rate=request.keep_learning_rate,
            parsed_keys=parsed_keys,
            index=index,
        )
        _report(report, notes)
        plan += planned
    return plan
