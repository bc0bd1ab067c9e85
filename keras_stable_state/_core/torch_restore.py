"""Restoring ``torch.optim`` optimizers' state (saved by
`keras_stable_state._optimizer.torch_optim`): saved keys mapped to the live optimizer's
parameters by key, checked as a Keras optimizer's slots are, then put back with one
``optimizer.load_state_dict()`` per optimizer (a state dict numbered as the live
optimizer numbers its parameters), all or nothing with the rest of the restore.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_stable_state import _state
from keras_stable_state._core.apply import Step
from keras_stable_state._identity.dtypes import EXACT_CASTS, floating
from keras_stable_state._identity.keys import (
    MAIN,
    entry_prefix,
    split_entry_key,
    split_entry_name,
)
from keras_stable_state._optimizer.matching import NOT_IN_MODEL
from keras_stable_state._optimizer.torch_optim import SECTION, live_params, param_keys
from keras_stable_state._state.state_dict import decode, qualified_name
from keras_stable_state.errors import BindingError, DtypeMismatchError, listed
from keras_stable_state.format.record import BY_KEY

if TYPE_CHECKING:
    from keras_stable_state._core.requests import RestoreRequest

__all__ = ["plan_torch_optimizers"]

NOT_TRAINED = "not trained by the live torch.optim optimizer"
OTHER_CLASS = "saved from another torch.optim optimizer class"
NO_TORCH_OPTIMIZER = "no live torch.optim optimizer of that name (pass optimizer=)"


def _label(name: str) -> str:
    return "" if name == MAIN else f" {name!r}"


def _keras_names(record: Any) -> set[str]:
    """The names of the Keras optimizers whose slots ``record`` holds."""
    names = set()
    for key in record.optimizer if isinstance(record.optimizer, dict) else ():
        owner, slot = split_entry_key(key)
        names.add(split_entry_name(slot)[0] if owner is not None else MAIN)
    return names


def _saved(record: Any, where: str) -> dict[str, Any]:
    section = record.extra.get(SECTION)  # (a stock Keras file's extra is empty)
    if section is None:
        return {}
    form = isinstance(section, dict) and all(
        isinstance(s, dict)
        and isinstance(s.get("class"), str)
        and isinstance(s.get("param_groups"), list)
        and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and isinstance(g.get("hyper"), dict)
            for g in s["param_groups"]
        )
        and isinstance(s.get("params"), dict)
        and isinstance(s.get("state"), dict)
        and all(isinstance(v, dict) for v in s["state"].values())
        for s in section.values()
    )
    if not form:
        raise _state.malformed(SECTION, "it is not {name: {class, param_groups, params, state}}", where)
    return section


def plan_torch_optimizers(record, request: RestoreRequest, report):
    """The steps putting back the state of every ``torch.optim`` optimizer of ``request``.

    Args:
        record: The `StateRecord` (or stock weights: no torch state).
        request: The restore's `RestoreRequest`: its ``torch_optimizers`` (``{name:
            torch.optim.Optimizer}`` passed as ``optimizer=``), the model (its `ModelIndex`)
            whose variables they train, ``extras`` (``variables=``), and its flags: ``strict``
            refuses any difference (``False``: drop or leave fresh, and report it),
            ``allow_cast`` casts floating-point state of another dtype (listed in
            ``report.casts``), ``keep_learning_rate`` keeps each live param group's ``lr``
            (every difference is listed in ``report.learning_rates`` either way, as
            ``optimizer:<name>/param_groups/<i>/lr``).
        report: The `RestoreReport`.

    Returns:
        A list of `Step` (one per optimizer with saved state).

    Raises:
        BindingError: saved state of an optimizer not passed, of another class, of variables
            the live optimizer does not train (or the live one of variables without saved
            state), of another shape, or groups whose saved hyperparameters differ.
        DtypeMismatchError: a parameter of another dtype without ``allow_cast``.
        CorruptCheckpointError: a malformed ``torch_optimizers`` record.
    """
    torch_opts, strict, where = request.torch_optimizers, request.strict, request.where
    saved_all = _saved(record, where)
    absent = sorted(set(saved_all) - set(torch_opts))
    if absent and strict:
        raise BindingError(
            f"{where} holds the state of torch.optim optimizer(s) {listed(absent)} "
            f"({listed(saved_all[n]['class'].rsplit('.', 1)[-1] for n in absent)}), which this restore "
            "was not given: they would restart fresh. Pass them as saved: optimizer=opt (several: "
            "optimizer={'name': opt}), or pass strict=False to leave their state out.",
            key=absent[0],
            expected=absent,
            received=sorted(torch_opts),
        )
    for n in absent:
        report.drop(f"optimizer:{n}", NO_TORCH_OPTIMIZER)
    keras_saved = _keras_names(record) if record.matched_by == BY_KEY else set()
    steps = []
    for name, opt in torch_opts.items():
        if name not in saved_all:
            if strict:
                other = (
                    " It holds the slots of a Keras optimizer under that name: restore with the Keras "
                    "optimizer it was saved with."
                    if name in keras_saved
                    else ""
                )
                raise BindingError(
                    f"{where} has no state for torch.optim optimizer{_label(name)} ({type(opt).__name__}): "
                    f"it would restart fresh.{other} Restore a checkpoint saved with optimizer=, or pass "
                    "strict=False to leave it fresh (listed in report.left_fresh).",
                    key=name,
                    expected=name,
                    received=sorted(saved_all),
                )
            report.left_fresh.append(f"optimizer:{name}")
            continue
        step = _plan_one(name, opt, saved_all[name], record.arrays, request, report)
        if step is not None:
            steps.append(step)
    return steps


def _slot(key: str, head: str, entry: str) -> str:
    return f"{key}#{head}{entry}"


def _plan_one(name, opt, saved, arrays, request: RestoreRequest, report):
    """The step restoring one optimizer, or ``None`` when nothing of it is restored."""
    model, extras, strict, where = request.model, request.extras, request.strict, request.where
    head = entry_prefix(name)
    saved = _state.join_arrays(saved, arrays, where)
    saved_state = saved["state"]
    saved_keys = [k for g in saved["param_groups"] for k in g["params"]]
    saved_slots = [_slot(k, head, e) for k, entries in saved_state.items() for e in entries]
    live_class = qualified_name(opt)
    if saved["class"] != live_class:
        if strict:
            raise BindingError(
                f"The torch.optim optimizer{_label(name)} state in {where} was saved from "
                f"{saved['class']} but the live optimizer is {live_class}. State of another optimizer "
                "class would be applied with other update rules; build the optimizer as saved, or pass "
                "strict=False to leave it fresh.",
                key=name,
                expected=saved["class"],
                received=live_class,
            )
        for slot in saved_slots:
            report.drop(slot, OTHER_CLASS)
        report.left_fresh.append(f"optimizer:{name}")
        return None
    keys = param_keys(model, extras, request.index)
    groups = live_params(opt, name, keys, model, "restore_training_state")
    live = {key: (var, p) for group in groups for key, var, p in group}
    unexpected = [k for k in saved_keys if k not in live]
    missing = [k for k in live if k not in set(saved_keys)]
    if strict and (unexpected or missing):
        parts = []
        if unexpected:
            parts.append(f"saved for variables the live optimizer does not train: {listed(unexpected)}")
        if missing:
            parts.append(f"no saved state for variables the live optimizer trains: {listed(missing)}")
        raise BindingError(
            f"The torch.optim optimizer{_label(name)} state in {where} does not match the live "
            f"{type(opt).__name__}: {'; '.join(parts)}. Build the model and the optimizer's param groups "
            "over the variables saved, or pass strict=False to drop the saved state of the first and "
            "leave the second fresh (both listed in the report).",
            key=(unexpected or missing)[0],
            expected=sorted(saved_keys),
            received=sorted(live),
        )
    in_model = {key for key, _ in keys.values()}
    for key in unexpected:
        for entry in saved_state.get(key, {}):
            report.drop(_slot(key, head, entry), NOT_TRAINED if key in in_model else NOT_IN_MODEL)
    report.left_fresh.extend(_slot(k, head, "*") for k in missing)
    _check_specs(name, saved, live, head, request, report)
    hyper = _group_hyper(name, opt, saved, groups, where)
    state, position = {}, 0
    param_groups = []
    for i, (group, live_group, values) in enumerate(zip(opt.param_groups, groups, hyper, strict=True)):
        _learning_rate(
            f"optimizer:{name}/param_groups/{i}/lr", group, values, request.keep_learning_rate, report
        )
        positions = list(range(position, position + len(live_group)))
        for pos, (key, _, _) in zip(positions, live_group, strict=True):
            if key in saved_state:
                state[pos] = decode(saved_state[key])
                for entry in saved_state[key]:
                    report.matched[_slot(key, head, entry)] = "order" if key.startswith("order:") else "name"
        new_group = {**values, "params": positions}
        if "param_names" in group:
            new_group["param_names"] = list(group["param_names"])
        param_groups.append(new_group)
        position += len(live_group)
    report.order_keys.extend(s for s in saved_slots if s.startswith("order:") and s in report.matched)
    return _load_step(name, opt, {"state": state, "param_groups": param_groups})


def _check_specs(name, saved, live, head, request: RestoreRequest, report):
    """Refuse a variable of another shape (listing all), or of another dtype without the
    request's ``allow_cast``."""
    saved_state, allow_cast, where = saved["state"], request.allow_cast, request.where
    reshaped, retyped = [], []
    for key, (_, param) in live.items():
        spec = saved["params"].get(key)
        if not (isinstance(spec, list) and len(spec) == 2):
            continue
        shape, dtype = tuple(spec[0]), spec[1]
        if shape != tuple(param.shape):
            reshaped.append((key, shape, tuple(param.shape)))
            continue
        live_dtype = str(param.dtype).removeprefix("torch.")
        if dtype != live_dtype:
            retyped.append((key, dtype, live_dtype))
    if reshaped:
        raise BindingError(
            f"The torch.optim optimizer{_label(name)} state in {where} was saved for variables of another "
            f"shape: {listed(f'{k} {s} -> {t}' for k, s, t in reshaped)} (saved -> live). The model was "
            "changed since; rebuild it as it was saved.",
            key=reshaped[0][0],
            expected=reshaped[0][1],
            received=reshaped[0][2],
        )
    for key, src, dst in retyped:
        if not (allow_cast and floating(src) and floating(dst)):
            raise DtypeMismatchError(
                f"The torch.optim optimizer{_label(name)} state in {where} was saved for {src} variables "
                f"{listed(k for k, s, _ in retyped if s == src)}, but they are {dst} now: Torch would cast "
                "their floating-point state. Pass allow_cast=True to cast it (each cast listed in "
                f"report.casts), or build the variables as {src}.",
                key=key,
                expected=src,
                received=dst,
            )
        for entry, value in saved_state.get(key, {}).items():
            if (
                entry != "step"
                and isinstance(value, dict)
                and isinstance(value.get("__tensor__"), np.ndarray)
            ):
                slot = _slot(key, head, entry)
                report.casts.append((slot, str(value["__tensor__"].dtype), dst))
                if (src, dst) not in EXACT_CASTS:
                    report.lossy.append(slot)


def _learning_rate(key, group, values, keep, report) -> None:
    """List a param group's ``lr`` that the saved one would replace in
    ``report.learning_rates``; with ``keep``, keep the live one."""
    if "lr" not in group or "lr" not in values:
        return
    live, saved = float(group["lr"]), float(values["lr"])
    if live == saved:
        return
    report.learning_rates.append((key, live, saved, "kept" if keep else "replaced"))
    if keep:
        values["lr"] = group["lr"]


def _group_hyper(name, opt, saved, groups, where) -> list[dict[str, Any]]:
    """The hyperparameters of each live param group: those of the saved group(s) its
    variables were in (refused when those differ), or its own for a group of new ones."""
    group_of = {}
    for g in saved["param_groups"]:
        for k in g["params"]:
            group_of[k] = g["hyper"]
    out = []
    for i, (group, live_group) in enumerate(zip(opt.param_groups, groups, strict=True)):
        found = {}
        for key, _, _ in live_group:
            if key in group_of:
                found.setdefault(json.dumps(group_of[key], sort_keys=True, default=repr), []).append(key)
        if len(found) > 1:
            sets = [group_of[keys[0]] for keys in found.values()]
            fields = sorted({k for h in sets for k in h if any(h.get(k) != o.get(k) for o in sets)})
            shown = [
                f"{keys[0]} ({', '.join(f'{k}={group_of[keys[0]].get(k)!r}' for k in fields)})"
                for keys in found.values()
            ]
            raise BindingError(
                f"Param group {i} of the live torch.optim optimizer{_label(name)} ({type(opt).__name__}) "
                f"holds variables that were saved in param groups with other hyperparameters in {where}: "
                f"{listed(shown, quote=False)}. One group has one set of hyperparameters; split the "
                "param groups as the hyperparameters were (one group per saved set).",
                key=next(iter(found.values()))[0],
            )
        if found:
            out.append(decode(group_of[next(iter(found.values()))[0]]))
        else:
            out.append({k: v for k, v in group.items() if k not in ("params", "param_names")})
    return out


def _load_step(name, opt, state_dict):
    """The `Step` calling ``opt.load_state_dict(state_dict)``; its undo loads the state the
    optimizer had (kept by reference: ``load_state_dict`` replaces the state's tensors and
    dicts, it never writes into them)."""

    def snapshot():
        old, state, groups = opt.state_dict(), opt.state, opt.param_groups
        # load_state_dict sets new state and param_groups objects last: the same ones, unchanged
        return (lambda: opt.load_state_dict(old)), (
            lambda: opt.state is not state or opt.param_groups is not groups
        )

    return Step(f"{SECTION}/{name}", lambda: opt.load_state_dict(state_dict), snapshot)
