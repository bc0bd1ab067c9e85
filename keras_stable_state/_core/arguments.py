"""Argument checks of the public verbs: each names the argument, what it must be and what it received."""

from __future__ import annotations

import os
import re
from typing import Any

import keras
import numpy as np

from keras_stable_state import _state
from keras_stable_state._identity.keys import MAIN, check_name
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._optimizer import tracked_optimizers
from keras_stable_state._optimizer.torch_optim import check_torch_backend, is_torch_optimizer
from keras_stable_state._state.state_dict import StateDictProvider, has_state_dict


# -- argument checks ------------------------------------------------------------------
def received(name, value) -> str:
    text = repr(value)
    if len(text) > 100:
        text = text[:97] + "..."
    return f"Received: {name}={text} (of type {type(value).__name__})"


def check_filepath(filepath: object, verb: str) -> str:
    if isinstance(filepath, bytes):
        return os.fsdecode(filepath)
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(
            f"`filepath` of {verb} must be a path (str or os.PathLike) to a '.keras' or '.h5' file. "
            + received("filepath", filepath)
        )
    return os.fsdecode(os.fspath(filepath))


def check_model(model: object, verb: str) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` of {verb} must be a keras.Model (built: called on a batch, or `model.build(...)`). "
            + received("model", model)
        )


def check_optimizer(optimizer, verb, model):
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"{verb} takes the optimizer from `model.optimizer`, which is not a "
                "keras.optimizers.Optimizer; compile the model with one or pass `optimizer=`. "
                + received("model.optimizer", optimizer)
            )
        return optimizer
    if is_torch_optimizer(optimizer):
        check_torch_backend("optimizer", optimizer, verb)
        return optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        hint = (
            " A name such as 'adam' is not an optimizer instance: compile the model with it and leave "
            "`optimizer` out (model.optimizer is used), or pass keras.optimizers.Adam(...)."
            if isinstance(optimizer, str)
            else ""
        )
        raise TypeError(
            f"`optimizer` of {verb} must be a torch.optim.Optimizer (Torch backend) or "
            "keras.optimizers.Optimizer instance or None "
            f"(None: model.optimizer).{hint} " + received("optimizer", optimizer)
        )
    return optimizer


def check_callbacks(callbacks, verb) -> dict:
    """``{key: callback}``: a dict's names as given, a list's ``"<ClassName>/<i>"`` keys."""
    if callbacks is None:
        return {}
    if isinstance(callbacks, dict):
        for name, cb in callbacks.items():
            if not isinstance(name, str) or not name.strip() or name != name.strip() or "#" in name:
                raise ValueError(
                    f"`callbacks` names of {verb} must be non-empty strings without '#' or surrounding "
                    f"whitespace; they key the callback's state in the file. Received: {name!r}"
                )
            if not isinstance(cb, keras.callbacks.Callback):
                raise TypeError(
                    f"`callbacks[{name!r}]` of {verb} must be a keras.callbacks.Callback instance "
                    "(e.g. callbacks={'es': early_stopping}). " + received(f"callbacks[{name!r}]", cb)
                )
        return dict(callbacks)
    if isinstance(callbacks, keras.callbacks.Callback) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"`callbacks` of {verb} must be a dict {{name: callback}} or a list of "
            "keras.callbacks.Callback instances (e.g. callbacks={'es': early_stopping}). "
            + received("callbacks", callbacks)
        )
    bad = [(i, cb) for i, cb in enumerate(callbacks) if not isinstance(cb, keras.callbacks.Callback)]
    if bad:
        i, cb = bad[0]
        raise TypeError(
            f"`callbacks` of {verb} must be a list of keras.callbacks.Callback instances; item {i} is "
            f"not. " + received(f"callbacks[{i}]", cb)
        )
    callbacks = list(callbacks)
    return {_state.callback_key(callbacks, cb): cb for cb in callbacks}


def check_providers(state: object, verb: str) -> dict[str, Any]:
    """``{name: provider}``: each with ``get_state()``/``set_state()``; an object with Torch's
    ``state_dict()``/``load_state_dict()`` instead (a ``torch.optim.lr_scheduler``) wrapped in a
    `StateDictProvider`."""
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise TypeError(
            f"`state` of {verb} must be a dict {{name: provider}} of objects with get_state() and "
            "set_state() (e.g. state={'accumulator': acc}). " + received("state", state)
        )
    for name, provider in state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"`state` names of {verb} must be non-empty strings without '/', they become keys in "
                f"the file. Received: a provider named {name!r}"
            )
        if is_torch_optimizer(provider):
            raise TypeError(
                f"`state[{name!r}]` of {verb} is a torch.optim optimizer ({type(provider).__name__}): its "
                "state_dict() numbers the parameters by position, so a model whose parameters come in "
                f"another order would get each state on another variable. Pass it as `optimizer=` "
                f"({verb}(..., optimizer=opt)): its state is then saved by each variable's key."
            )
        if not (
            callable(getattr(provider, "get_state", None)) and callable(getattr(provider, "set_state", None))
        ) and not has_state_dict(provider):
            raise TypeError(
                f"`state[{name!r}]` of {verb} must be a provider with get_state() and set_state(state) "
                "methods (e.g. a keras_stable_state.GradientAccumulator), or an object with "
                "state_dict() and load_state_dict() (e.g. a torch.optim.lr_scheduler); to save a plain "
                "value, wrap it in an object with those two methods. "
                + received(f"state[{name!r}]", provider)
            )
    return {
        name: provider
        if callable(getattr(provider, "get_state", None)) and callable(getattr(provider, "set_state", None))
        else StateDictProvider(provider, name)
        for name, provider in state.items()
    }


def check_flags(verb: str, **flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"`{name}` of {verb} must be True or False. " + received(name, value))


_EXTRA_NAME = re.compile(r"[^/#\s]+")


def check_variables(variables, verb, index: ModelIndex) -> dict:
    """``{name: keras.Variable}`` of variables outside the model of ``index`` (keys
    ``var:<name>``; the model's own variables told by the index's walk)."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise TypeError(
            f"`variables` of {verb} must be a dict {{name: keras.Variable}} of variables outside the "
            "model that the optimizer trains (e.g. variables={'log_alpha': log_alpha}). "
            + received("variables", variables)
        )
    in_model = {id(v): str(k) for k, v in index.registry().entries}
    seen = {}
    for name, var in variables.items():
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
            raise ValueError(
                f"`variables` names of {verb} must be non-empty strings without '/', '#' or "
                f"whitespace; they become keys 'var:<name>' in the file. Received: a variable named {name!r}"
            )
        if not isinstance(var, keras.Variable):
            raise TypeError(
                f"`variables[{name!r}]` of {verb} must be a keras.Variable (a variable outside the "
                "model, trained by the same optimizer). " + received(f"variables[{name!r}]", var)
            )
        if id(var) in in_model:
            raise ValueError(
                f"`variables[{name!r}]` of {verb} is the model's own variable {in_model[id(var)]}, which "
                "is saved and restored with the model already; pass only variables outside the model."
            )
        if id(var) in seen:
            raise ValueError(
                f"`variables` of {verb} names one variable twice, as both {seen[id(var)]!r} and "
                f"{name!r}; give each variable one name."
            )
        seen[id(var)] = name
    return dict(variables)


def check_rename(prefix: object, rename: object, verb: str) -> list[tuple[re.Pattern[str], str]] | None:
    """The key rename rules: ``[(compiled pattern, replacement)]``, or ``None``."""
    if prefix is not None and rename is not None:
        raise ValueError(
            f"Pass either `prefix` or `rename` to {verb}, not both: prefix='P' is the rule "
            "(r'^path:', 'path:P/'); add it to `rename` instead. "
            + received("prefix", prefix)
            + "; "
            + received("rename", rename)
        )
    if prefix is not None:
        if not isinstance(prefix, str) or not prefix or prefix != prefix.strip("/") or "//" in prefix:
            raise ValueError(
                f"`prefix` of {verb} must be the stable path of the nested model inside `model`, such "
                "as 'layers/base' (no leading or trailing '/'): a saved key 'path:<p>' is restored as "
                "'path:<prefix>/<p>'. " + received("prefix", prefix)
            )
        return [(re.compile(r"^path:"), "path:" + prefix.replace("\\", "\\\\") + "/")]
    if rename is None:
        return None
    pairs = isinstance(rename, (list, tuple)) and all(
        isinstance(rule, (list, tuple)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)
        for rule in rename
    )
    if not pairs:
        raise TypeError(
            f"`rename` of {verb} must be a list of (pattern, replacement) string pairs, e.g. "
            "rename=[(r'^path:layers/base/', 'path:')]. " + received("rename", rename)
        )
    rules = []
    for pattern, replacement in rename:
        try:
            rules.append((re.compile(pattern), replacement))
        except re.error as err:
            raise ValueError(
                f"rename rule ({pattern!r}, {replacement!r}) of {verb}: {pattern!r} is not a valid "
                f"regular expression ({err})."
            ) from err
    return rules


# -- several optimizers (a GAN's d_optimizer / g_optimizer), groups and windows -------------
def check_optimizers(optimizer, verb, model) -> dict:
    """``{name: optimizer}``: ``optimizer`` as given (one, or a dict by name), else every
    optimizer the model tracks (``model.optimizer`` and optimizer attributes)."""
    if isinstance(optimizer, dict):
        for name, opt in optimizer.items():
            check_name(name, "optimizer name")
            if is_torch_optimizer(opt):
                check_torch_backend(f"optimizer[{name!r}]", opt, verb)
            elif not isinstance(opt, keras.optimizers.Optimizer):
                raise TypeError(
                    f"`optimizer[{name!r}]` of {verb} must be a keras.optimizers.Optimizer instance "
                    "or a torch.optim.Optimizer (e.g. optimizer={'d': d_optimizer, 'g': g_optimizer}). "
                    + received(f"optimizer[{name!r}]", opt)
                )
        return dict(optimizer)
    if optimizer is not None:
        return {MAIN: check_optimizer(optimizer, verb, model)}
    check_optimizer(None, verb, model)
    return tracked_optimizers(model)


MODEL_STATES = ("all", "trainable", "none")


def extra_saved(variable, model_state) -> bool:
    """Whether ``model_state`` saves the value of an extra variable (as for model variables)."""
    return model_state == "all" or (model_state == "trainable" and variable.trainable)
