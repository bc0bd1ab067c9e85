"""Slot matching: saved optimizer arrays to live optimizer variables, by key.

`match_slots` binds every saved key to the live variable it names (by name, or by
registration order for ``order:`` keys), checks shapes and dtypes (`coerce`) and returns
the plan of assignments with `SlotNotes` saying how each key was matched, dropped or
left fresh. Nothing is assigned here: ``StableOptimizer.load_own_variables`` assigns the
plan itself, and ``restore_training_state`` (`keras_stable_state._core.slot_restore`)
assigns it with the rest of a restore and copies the notes into its ``RestoreReport``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._identity.dtypes import coerce
from keras_stable_state._identity.keys import EXTRA, file_label, parse_optimizer_key
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer.entries import (
    optimizer_entries,
    optimizer_registry,
    optimizer_tree,
    unwrap,
)
from keras_stable_state._optimizer.groups import refuse_regrouped
from keras_stable_state.errors import BindingError, listed

__all__ = [
    "COUNTER_MARGIN",
    "KEPT_LR",
    "NOT_IN_MODEL",
    "NOT_PASSED",
    "SlotNotes",
    "drop_reason",
    "match_slots",
]

COUNTER_MARGIN = 0.01
"""How close (a fraction of its dtype's maximum) a restored ``iterations`` counter must be
to its dtype's maximum to be listed in ``SlotNotes.counters_near_limit``."""

NOT_IN_MODEL = "not in the model (renamed or removed)"

NOT_PASSED = "extra variable not passed in `variables=`"

KEPT_LR = "kept the compiled learning rate (keep_learning_rate=True)"

NO_LIVE_SLOT = "no such variable in the live optimizer"


@dataclasses.dataclass
class SlotNotes:
    """What `match_slots` found, in the terms of ``RestoreReport`` (whose attributes of
    the same names they go to).

    Attributes:
        matched: ``{live key: "name" | "order"}`` for every slot planned.
        dropped: ``{saved key: reason}`` for every saved array left out.
        left_fresh: Live keys without a saved value (``strict=False``).
        order_keys: Saved registration-order keys (``order:<i>#<slot>``).
        casts: ``(key, saved dtype, variable dtype)`` for every array cast.
        lossy: Keys whose cast can round or overflow.
        learning_rates: ``(key, compiled value, saved value, "replaced" | "kept")``
            for every learning-rate variable whose saved value differs.
        counters_near_limit: ``(key, value, dtype maximum, dtype)`` for every
            ``iterations`` counter within `COUNTER_MARGIN` of its dtype's maximum.
    """

    matched: dict[str, str] = dataclasses.field(default_factory=dict)
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    left_fresh: list[str] = dataclasses.field(default_factory=list)
    order_keys: list[str] = dataclasses.field(default_factory=list)
    casts: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    lossy: list[str] = dataclasses.field(default_factory=list)
    learning_rates: list[tuple[str, float, float, str]] = dataclasses.field(default_factory=list)
    counters_near_limit: list[tuple[str, int, int, str]] = dataclasses.field(default_factory=list)


def _learning_rate_ids(optimizer) -> set:
    """``id`` of every learning-rate variable of the optimizer and the ones it wraps."""
    return {
        id(_keras_compat.learning_rate_variable(opt))
        for _, opt in optimizer_tree(optimizer)
        if isinstance(_keras_compat.learning_rate_variable(opt), keras.Variable)
    }


def _iteration_ids(optimizer) -> set:
    """``id`` of every ``iterations`` counter of the optimizer and the ones it wraps."""
    return {
        id(_keras_compat.iterations_variable(opt))
        for _, opt in optimizer_tree(optimizer)
        if isinstance(_keras_compat.iterations_variable(opt), keras.Variable)
    }


def _note_counter(notes, key, variable, value, iteration_ids) -> None:
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
        notes.counters_near_limit.append((key, count, limit, dtype.name))


def drop_reason(vkey, frozen) -> str:
    """Why the slots of saved variable ``vkey`` are dropped; ``frozen``: keys of model
    variables that are no longer trained."""
    if str(vkey) in frozen:
        return "no longer trained"
    return NOT_PASSED if vkey.kind == EXTRA else NOT_IN_MODEL


def _match_by_position(optimizer, live, arrays, allow_cast, notes, iteration_ids) -> list:
    """The plan for a list of arrays in ``optimizer.variables`` order (stock Keras files)."""
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
    plan = []
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
        value = coerce(entry.key, array, entry.variable, allow_cast, notes)
        _note_counter(notes, entry.key, entry.variable, value, iteration_ids)
        plan.append((entry.variable, value))
        notes.matched[f"optimizer[{i}] -> {entry.key}"] = "order"
    return plan


def match_slots(
    optimizer: Any,
    model: Any,
    arrays: dict[str, Any] | list[Any],
    *,
    keyed: bool,
    strict: bool,
    allow_cast: bool = False,
    dropped_keys: Iterable[str] = (),
    where: Any = None,
    name: str | None = None,
    extras: dict[str, Any] | None = None,
    keep_learning_rate: bool = False,
    parsed_keys: dict[str, Any] | None = None,
    index: ModelIndex | None = None,
) -> tuple[list[tuple[Any, Any]], SlotNotes]:
    """Match saved optimizer arrays to live optimizer variables; assign nothing.

    Args:
        optimizer: A built optimizer.
        model: The model keying its variables (``None``: registration order).
        arrays: ``{entry key: array}`` when ``keyed``, else a list in
            ``optimizer.variables`` order (stock Keras files).
        strict: Refuse saved slots without a live slot and live variables
            without a saved value.
        allow_cast: Cast floating-point arrays of another dtype (`coerce`).
        dropped_keys: Variable keys whose slots are dropped on purpose
            (``strict=False`` contract differences).
        where: The file, for messages.
        name: The optimizer's name among the model's optimizers (its keys'
            ``@<name>/`` prefix); ``None`` for ``model.optimizer``.
        extras: ``{name: variable}`` outside the model, keyed ``var:<name>``.
        keep_learning_rate: Leave learning-rate variables at their live value;
            every difference is listed in ``notes.learning_rates`` either way.
        parsed_keys: ``{entry key: parse_optimizer_key(entry key)}`` already parsed
            by the caller; the others are parsed here.
        index: The restore's `ModelIndex` of ``model`` (its walk keys the variables, its
            `ParsedKeys` parse the keys); ``None``: a new one.

    Returns:
        ``(plan, notes)``: the list of ``(variable, array)`` to assign, and `SlotNotes`.

    Raises:
        MalformedKeyError: a saved entry key cannot be parsed (a damaged file).
        BindingError: count, shape or key mismatches (named in the message).
        DtypeMismatchError: dtype differences without ``allow_cast``, between
            kinds (integer, boolean, float), or an integer out of range.
    """
    notes = SlotNotes()
    index = ModelIndex.of(model, index)
    registry = optimizer_registry(optimizer, model, extras, index)
    # Live keys only match saved ones: an order key here binds nothing a saved named key owns.
    live = optimizer_entries(optimizer, registry, name=name, allow_order_keys=True)
    lr_ids = _learning_rate_ids(optimizer)
    iteration_ids = _iteration_ids(optimizer)
    if not keyed:
        return _match_by_position(optimizer, live, arrays, allow_cast, notes, iteration_ids), notes

    live_by_key = {e.key: e for e in live}
    parsed_keys = parsed_keys or {}
    label = file_label(where)
    parsed = {
        k: parsed_keys[k] if k in parsed_keys else parse_optimizer_key(k, label, index.keys) for k in arrays
    }
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
    plan, used, frozen = [], set(), None
    notes.order_keys.extend(k for k, (vkey, _) in parsed.items() if vkey is not None and not vkey.named)
    for key, array in arrays.items():
        vkey, slot = parsed[key]
        if vkey is None:
            live_key, how = key, "name"
        elif vkey in bound:
            var, how = bound[vkey]
            live_key = f"{registry.key_of(var)}#{slot}"
        else:
            if frozen is None:
                in_model = {str(k) for k in index.registry().keys()} if model else set()
                frozen = dropped_keys & in_model
            notes.dropped[key] = drop_reason(vkey, frozen)
            continue
        entry = live_by_key.get(live_key)
        if (
            entry is None
            and keep_learning_rate
            and vkey is None
            and slot.rsplit("/", 1)[-1] == "learning_rate"
        ):
            notes.dropped[key] = KEPT_LR
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
            notes.dropped[key] = NO_LIVE_SLOT
            continue
        used.add(live_key)
        value = coerce(live_key, array, entry.variable, allow_cast, notes)
        _note_counter(notes, live_key, entry.variable, value, iteration_ids)
        if id(entry.variable) in lr_ids:
            compiled, saved = float(to_numpy(entry.variable)), float(value)
            if compiled != saved:
                action = "kept" if keep_learning_rate else "replaced"
                notes.learning_rates.append((live_key, compiled, saved, action))
            if keep_learning_rate:
                continue
        plan.append((entry.variable, value))
        notes.matched[live_key] = how
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
    notes.left_fresh.extend(fresh)
    return plan, notes
