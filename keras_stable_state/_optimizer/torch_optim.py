"""``torch.optim`` optimizers over a Keras model's variables (the Torch backend), saved by key.

On the Torch backend a ``keras.Variable`` holds a ``torch.nn.Parameter`` (Keras'
``variable._value``, what ``model.parameters()`` yields), so a ``torch.optim.Optimizer``
built on ``model.parameters()`` trains the model's variables. Its ``state_dict()`` numbers
them by position across its param groups; `optimizer_state` keys its per-parameter
state (``exp_avg``, ``momentum_buffer``, ``step``, ...) and each group's parameters by
the variable's stable key instead (``path:layers/dense/kernel``, the keys of the Keras
optimizers' slots), so that a restore (`keras_stable_state._core.torch_restore`) puts
each state back on its variable whatever order the parameters come in.

`watch_steps` registers one global step hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``) that records, in a ``WeakSet``, the optimizers that
stepped; `check_all_passed` refuses a save that would leave out the state of one of
them that trains the model.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import keras

from keras_stable_state import _keras_compat
from keras_stable_state._identity.keys import EXTRA, MAIN, VariableKey, entry_prefix
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._state.state_dict import encode, qualified_name
from keras_stable_state.errors import BindingError, StateError, listed

__all__ = [
    "SECTION",
    "check_all_passed",
    "check_torch_backend",
    "is_torch_optimizer",
    "optimizer_state",
    "param_keys",
    "param_spec",
    "split_optimizers",
    "watch_steps",
]

SECTION = "torch_optimizers"
"""The record of ``extra`` holding ``{optimizer name: optimizer_state(...)}``."""

# Hyperparameter entries of a param group that are not hyperparameters: its parameters
# (saved as keys) and the names ``Optimizer(model.named_parameters())`` gives them.
_NOT_HYPER = ("params", "param_names")


def is_torch_optimizer(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.optim.Optimizer`` (``False`` when no Torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def check_torch_backend(name: str, optimizer: Any, verb: str) -> None:
    """Refuse a ``torch.optim`` optimizer on a backend other than Torch, where it cannot
    train Keras variables."""
    backend = keras.backend.backend()
    if backend != "torch":
        raise TypeError(
            f"`{name}` of {verb} is a torch.optim optimizer ({type(optimizer).__name__}), but Keras runs "
            f"the {backend!r} backend: its variables are no torch tensors, so a torch.optim optimizer "
            "cannot train them. Run with KERAS_BACKEND=torch, or pass a keras.optimizers.Optimizer."
        )


def split_optimizers(optimizers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({name: Keras optimizer}, {name: torch.optim optimizer})`` of ``optimizers``."""
    keras_opts = {n: o for n, o in optimizers.items() if not is_torch_optimizer(o)}
    torch_opts = {n: o for n, o in optimizers.items() if is_torch_optimizer(o)}
    return keras_opts, torch_opts


def param_keys(
    model: Any, extras: dict[str, Any] | None = None, index: ModelIndex | None = None
) -> dict[int, tuple[str, Any]]:
    """``{id(parameter): (key, keras.Variable)}`` for every variable of ``model`` (its stable
    key, from the walk of ``index``, the call's `ModelIndex`, when given) and of ``extras``
    (``var:<name>``): the ``torch.nn.Parameter`` each one holds."""
    found = {}
    for key, var in ModelIndex.of(model, index).registry().entries:
        found[id(_keras_compat.variable_storage(var))] = (str(key), var)
    for name, var in (extras or {}).items():
        found[id(_keras_compat.variable_storage(var))] = (str(VariableKey(EXTRA, name)), var)
    return found


def param_spec(param: Any) -> list[Any]:
    """``[shape, dtype]`` of a parameter, as saved: ``[[3, 4], "float32"]``."""
    return [list(param.shape), str(param.dtype).removeprefix("torch.")]


def _outside_message(
    optimizer: Any, name: str, outside: list[tuple[int, int, Any]], model: Any, verb: str
) -> str:
    where = [
        f"param_groups[{g}]['params'][{i}] ({tuple(p.shape)}, {param_spec(p)[1]})" for g, i, p in outside
    ]
    label = "" if name == MAIN else f" {name!r}"
    return (
        f"torch.optim optimizer{label} ({type(optimizer).__name__}) trains {len(outside)} parameter(s) "
        f"that are no variable of model {model.name!r}: {listed(where, quote=False)}. Their state could "
        "only be keyed by position, and their values would not be saved, so they are refused. The value "
        "of a keras.Variable outside the model (a temperature, a loss weight): pass that variable by "
        f"name, {verb}(..., variables={{'name': variable}}), and the same `variables=` to the restore; a "
        "plain torch.nn.Parameter: make it a variable of the model (`self.add_weight(...)` in a layer), "
        "or build the optimizer on `model.parameters()` alone."
    )


def live_params(
    optimizer: Any, name: str, keys: dict[int, tuple[str, Any]], model: Any, verb: str
) -> list[list[tuple[str, Any, Any]]]:
    """``[[(key, keras.Variable, parameter), ...] per param group]`` of ``optimizer``.

    Raises:
        BindingError: for a parameter that is no variable of the model nor of ``extras``.
    """
    outside = [
        (g, i, p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in keys
    ]
    if outside:
        raise BindingError(
            _outside_message(optimizer, name, outside, model, verb),
            key=f"param_groups[{outside[0][0]}]['params'][{outside[0][1]}]",
            expected=f"parameters of model {model.name!r} or of `variables`",
            received=len(outside),
        )
    return [[(*keys[id(p)], p) for p in group["params"]] for group in optimizer.param_groups]


def optimizer_state(
    optimizer: Any,
    name: str,
    model: Any,
    extras: dict[str, Any] | None,
    *,
    allow_order_keys: bool = False,
    verb: str = "save_training_state",
    index: ModelIndex | None = None,
) -> dict[str, Any]:
    """The state of a ``torch.optim`` optimizer, keyed by the variables it trains.

    Returns:
        ``{"class": "torch.optim.adam.Adam", "param_groups": [{"params": [key, ...],
        "hyper": {...}}, ...], "params": {key: [shape, dtype]}, "state": {key: {name: value}}}``
        with tensors as ``{"__tensor__": array}`` (their dtype kept) and tuples tagged
        (`encode`); ``state`` holds the parameters that have state (Torch creates it at
        a parameter's first step). The variables are keyed from ``index`` (the save's
        `ModelIndex` of ``model``) when given.

    Raises:
        BindingError: for a parameter that is no variable of ``model`` nor of ``extras``
            (naming its group and position, and the ``variables=`` fix); for a variable
            without a stable path unless ``allow_order_keys``.
    """
    keys = param_keys(model, extras, index)
    groups = live_params(optimizer, name, keys, model, verb)
    flat = [entry for group in groups for entry in group]
    ordered = [key for key, _, _ in flat if key.startswith("order:")]
    if ordered and not allow_order_keys:
        raise BindingError(
            f"torch.optim optimizer {type(optimizer).__name__} trains variables {listed(ordered)} that have "
            "no stable path in the model, so their state would be keyed by registration order (a "
            "restore would put it on whatever variable sits at that position). Make them reachable "
            "from the model's layers, or pass allow_order_keys=True.",
            key=ordered[0],
        )
    saved = optimizer.state_dict()
    head = entry_prefix(name)
    state = {}
    for position, value in saved["state"].items():
        key = flat[position][0]
        state[key] = {str(k): encode(v) for k, v in value.items()}
    param_groups = []
    for group, live in zip(saved["param_groups"], groups, strict=True):
        hyper = {str(k): encode(v) for k, v in group.items() if k not in _NOT_HYPER}
        param_groups.append({"params": [key for key, _, _ in live], "hyper": hyper})
    return {
        "class": qualified_name(optimizer),
        "prefix": head,
        "param_groups": param_groups,
        "params": {key: param_spec(p) for key, _, p in flat},
        "state": state,
    }


# -- optimizers that stepped ------------------------------------------------------------------
_STEPPED: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOK: list[Any] = []  # the handle of the registered hook, once


def _stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPPED.add(optimizer)


def watch_steps() -> None:
    """On the Torch backend, register once a global ``torch.optim`` step post-hook that
    records each optimizer that stepped (a ``WeakSet``: nothing is kept alive), so that
    `check_all_passed` can name one a save would leave out. Elsewhere nothing."""
    if _HOOK or keras.backend.backend() != "torch":
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _HOOK.append(register_optimizer_step_post_hook(_stepped))


# On the Torch backend: record the torch.optim optimizers that step from the import of this
# module on (the package imports it with the restore core), so that a save leaving out one
# that trains the model is refused. Registered here, into this module and torch only: importing
# the core changes no other module.
watch_steps()


def _holds_state(optimizer: Any, ids: set[int]) -> bool:
    """Whether ``optimizer`` holds state a fresh one would not have: per-parameter state
    for a parameter in ``ids``, or a learning-rate scheduler attached (``initial_lr``)."""
    if any(id(p) in ids and value for p, value in optimizer.state.items()):
        return True
    return any("initial_lr" in group for group in optimizer.param_groups)


def _held_by(provider: Any, optimizer: Any) -> bool:
    """Whether a ``state`` provider is ``optimizer`` or holds it as an attribute (a user's own
    adapter around ``state_dict()``)."""
    if provider is optimizer:
        return True
    fields = getattr(provider, "__dict__", None)
    return isinstance(fields, dict) and any(v is optimizer for v in fields.values())


def _unpassed(
    model: Any, passed: list[Any], providers: dict[str, Any], extras: dict[str, Any], index: ModelIndex
) -> list[Any]:
    ids = set(param_keys(model, extras, index))
    return [
        opt
        for opt in list(_STEPPED)
        if not any(opt is p for p in passed)
        and not any(_held_by(p, opt) for p in providers.values())
        and any(id(p) in ids for group in opt.param_groups for p in group["params"])
        and _holds_state(opt, ids)
    ]


def check_all_passed(
    model: Any,
    passed: list[Any],
    providers: dict[str, Any],
    extras: dict[str, Any] | None,
    verb: str,
    index: ModelIndex | None = None,
) -> None:
    """Refuse a save that leaves out a ``torch.optim`` optimizer that stepped in this process,
    trains variables of ``model`` and holds state (per-parameter state, or a scheduler's
    learning rate): its state would be lost (``index``: the save's `ModelIndex` of ``model``).

    Raises:
        StateError: naming the optimizer's class and the fix, ``optimizer=``.
    """
    if not _STEPPED:
        return
    extras = extras or {}
    index = ModelIndex.of(model, index)
    if not _unpassed(model, passed, providers, extras, index):
        return
    gc.collect()  # an optimizer no longer referenced is not one the loop still trains
    found = _unpassed(model, passed, providers, extras, index)
    if not found:
        return
    names = [type(opt).__name__ for opt in found]
    keys = param_keys(model, extras, index)
    trained = sorted({keys[id(p)][0] for g in found[0].param_groups for p in g["params"] if id(p) in keys})
    raise StateError(
        f"torch.optim optimizer(s) {listed(names)} stepped in this process and train variables of model "
        f"{model.name!r} ({listed(trained)}), but {verb} was not given them: their state (moments, "
        "step counts, the learning rate a scheduler set) would not be saved, and a resume would restart "
        f"them fresh. Pass the optimizer: {verb}(..., optimizer=opt) (a CheckpointManager: mgr.save(step, "
        "model, optimizer=opt); several: optimizer={'name': opt, ...}), and the same optimizer= to the "
        "restore; its scheduler goes in state={'scheduler': scheduler}.",
        key=names[0],
        expected="optimizer=<the torch.optim optimizer>",
        received=None,
    )
