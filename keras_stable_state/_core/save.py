"""``save_training_state``: the training state checked, collected into a record, and written.

A save goes down the layers once: the arguments are checked (``filepath`` resolved, an
object store connected: `object_store.target`; the engine picked:
`dispatch.save_engine`), `training_state_record` checks the rest and plans the record
(each variable taken as the engine takes it, mapped arrays encoded), and a `WriteRequest`
goes to the one engine that writes it: the file engine (a local ``.h5`` / ``.keras``
file written atomically, or an object uploaded whole), the background engine
(``blocking=False``) or the Orbax engine (``.orbax``). Nothing comes back up here from an
engine.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from keras_stable_state import _processes, _state, format
from keras_stable_state._core import boundary
from keras_stable_state._core.arguments import (
    MODEL_STATES,
    check_callbacks,
    check_filepath,
    check_flags,
    check_model,
    check_optimizers,
    check_providers,
    check_variables,
    extra_saved,
)
from keras_stable_state._core.guards import walking_once
from keras_stable_state._core.in_place import check_not_partial
from keras_stable_state._core.mappers import SECTION as MAPPED_SECTION
from keras_stable_state._core.mappers import check_mappers, encode_arrays
from keras_stable_state._core.report import writer_metadata
from keras_stable_state._engines import background, files, object_store
from keras_stable_state._engines.dispatch import save_engine
from keras_stable_state._engines.write_request import WriteRequest
from keras_stable_state._identity.contract import TrainableContract
from keras_stable_state._identity.keys import EXTRA, MAIN
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer import optimizer_classes, save_optimizers, torch_optim
from keras_stable_state._optimizer.tracking import check_bound_passed
from keras_stable_state._state import layers, metrics
from keras_stable_state.errors import CheckpointFormatError, StateError
from keras_stable_state.format import orbax_layout

if TYPE_CHECKING:
    import keras

    from keras_stable_state._core.mappers import StateMapper


__all__ = ["save_training_state", "training_state_record"]


def _host_array(variable: Any) -> Any:
    """``variable``'s value as a NumPy array, as the file engine takes it (`files.live_value`)."""
    return files.live_value(variable, to_numpy)


@overload
def save_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = ...,
    *,
    model_state: str = ...,
    callbacks: Sequence[keras.callbacks.Callback] = ...,
    state: Mapping[str, Any] | None = ...,
    include_rng: bool = ...,
    allow_order_keys: bool = ...,
    variables: Mapping[str, keras.Variable] | None = ...,
    mappers: Mapping[str, StateMapper] | None = ...,
    blocking: Literal[True] = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> str: ...


@overload
def save_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = ...,
    *,
    model_state: str = ...,
    callbacks: Sequence[keras.callbacks.Callback] = ...,
    state: Mapping[str, Any] | None = ...,
    include_rng: bool = ...,
    allow_order_keys: bool = ...,
    variables: Mapping[str, keras.Variable] | None = ...,
    mappers: Mapping[str, StateMapper] | None = ...,
    blocking: Literal[False],
    storage_options: Mapping[str, Any] | None = ...,
) -> background.SaveHandle: ...


@overload
def save_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = ...,
    *,
    model_state: str = ...,
    callbacks: Sequence[keras.callbacks.Callback] = ...,
    state: Mapping[str, Any] | None = ...,
    include_rng: bool = ...,
    allow_order_keys: bool = ...,
    variables: Mapping[str, keras.Variable] | None = ...,
    mappers: Mapping[str, StateMapper] | None = ...,
    blocking: bool = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> str | background.SaveHandle: ...


def save_training_state(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = None,
    *,
    model_state: str = "all",
    callbacks: Sequence[keras.callbacks.Callback] = (),
    state: Mapping[str, Any] | None = None,
    include_rng: bool = True,
    allow_order_keys: bool = False,
    variables: Mapping[str, keras.Variable] | None = None,
    mappers: Mapping[str, StateMapper] | None = None,
    blocking: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> str | background.SaveHandle:
    """Save the whole training state by key: variables, optimizer, contract and the rest.

    The file holds the model's variables (per ``model_state``; with ``"all"`` also the
    buffers of wrapped Torch modules, e.g. BatchNorm statistics), every optimizer variable
    (slots, iteration count, learning rate), the trainable-variable contract, the
    learning-rate schedule's config, the model's metric variables (compiled metrics and
    its own ``keras.metrics.Metric`` trackers), the state of ``callbacks`` and ``state``
    providers and the global random state. From another thread while ``model.fit`` runs, the save
    waits for the step boundary (with a [`StableCheckpoint`][keras_stable_state.StableCheckpoint]
    in that ``fit``; without one it is refused). In full:
    [in detail](how-to/custom-loops.md#save_training_state-in-detail).

    Examples:
        >>> save_training_state("run.keras", model)
        >>> handle = save_training_state("run.h5", model, blocking=False)
        >>> handle.wait()

    Args:
        filepath: A path or ``file://``/object-store URL ending in ``.keras`` (a Keras
            archive ``load_model`` loads), ``.h5`` (the training state alone) or
            ``.orbax`` (a directory written with Orbax; the ``[orbax]`` extra).
        model: A built ``keras.Model``.
        optimizer: The optimizer to save; default ``model.optimizer`` (built first if
            unbuilt); ``None`` with an uncompiled model saves no optimizer state. On the
            Torch backend also a ``torch.optim.Optimizer``, saved by each variable's key.
        model_state: ``"all"``, ``"trainable"`` (LoRA, adapters) or ``"none"``.
        callbacks: Callbacks whose state to save (others are skipped).
        state: ``{name: provider}`` of other objects with ``get_state()``/``set_state()``
            or ``state_dict()``/``load_state_dict()`` (a ``torch.optim.lr_scheduler``).
        include_rng: Save NumPy's, Python's and Keras' global random state.
        variables: ``{name: keras.Variable}`` outside the model that the optimizer trains.
        mappers: ``{pattern: StateMapper}``: store the arrays whose key matches through it.
        blocking: ``False`` writes the file in a background thread and returns at once.
        storage_options: fsspec options for an object-store URL.

    Returns:
        ``filepath`` (``str``) with ``blocking=True``; a
        [`SaveHandle`][keras_stable_state.SaveHandle] with ``blocking=False``.

    Raises:
        TypeError: For an argument of the wrong type, naming it; for a callback's or
            provider's ``get_state()`` holding a value that is neither JSON nor an array.
        ValueError: For an unknown ``model_state``, an invalid name or ``mappers`` pattern.
        DtypeMismatchError: For a ``mappers`` pattern matching a non-float array.
        BindingError: If the optimizer trains a variable (a ``torch.optim`` one: a parameter)
            outside ``model`` and ``variables``.
        StorageBackendError: For a URL whose fsspec package is not installed.
        CheckpointFormatError: For another extension, a directory, or a ``.keras`` path
            for a model Keras cannot serialize.
        StateError: If the model is not built, a provider or mapper refuses, a ``fit``
            without ``StableCheckpoint`` runs in another thread, or a ``torch.optim``
            optimizer that stepped and trains the model, or a Keras optimizer that stepped
            and trains it (a ``StableOptimizer`` bound to it; with no optimizer saved at
            all, any built on its variables), is not passed (its state lost).
        OSError: When the write or upload fails, naming the path (the previous file is
            intact); with ``blocking=False`` raised by the handle's ``wait()``.
    """
    started = time.perf_counter()
    out = _save(
        filepath,
        model,
        optimizer,
        model_state=model_state,
        callbacks=callbacks,
        state=state,
        include_rng=include_rng,
        allow_order_keys=allow_order_keys,
        variables=variables,
        mappers=mappers,
        blocking=blocking,
        storage_options=storage_options,
        started=started,
    )
    # A background write starts once the call has left the model (step boundary, walk cache,
    # paused collector): from then on its thread competes for the GIL, and nothing is left here.
    return out() if callable(out) else out


@walking_once
def _save(
    filepath: str | os.PathLike[str],
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None,
    *,
    model_state: str,
    callbacks: Sequence[keras.callbacks.Callback],
    state: Mapping[str, Any] | None,
    include_rng: bool,
    allow_order_keys: bool,
    variables: Mapping[str, keras.Variable] | None,
    mappers: Mapping[str, StateMapper] | None,
    blocking: bool,
    storage_options: Mapping[str, Any] | None,
    started: float,
) -> str | Callable[[], background.SaveHandle]:
    """[`save_training_state`][keras_stable_state.save_training_state], returning for ``blocking=False`` the zero-argument callable
    that submits the background write (and returns its [`SaveHandle`][keras_stable_state.SaveHandle])."""
    verb = "save_training_state"
    # 1. the arguments: the path (an object store connected), the flags, the engine
    filepath = check_filepath(filepath, verb)
    filepath, store = object_store.target(filepath, storage_options, verb)
    check_flags(verb, blocking=blocking)
    _check_processes(filepath)
    engine = save_engine(filepath, blocking=blocking)  # the one engine that writes it

    # Read at a step boundary when another thread's fit trains the model (see _core.boundary);
    # with blocking=True the variables are read as the file is written, so all of it is inside.
    with boundary.saving(model, verb):

        def convert(variable: Any) -> Any:
            # as the engine takes it: the Orbax engine keeps sharded JAX arrays as they are (no
            # gather), the background engine JAX arrays and TensorFlow reads (copied or
            # converted as background.host_record says); mapped arrays are encoded by the call:
            # host copies, in the background too
            if mappers and not blocking:
                return _host_array(variable)
            return engine.live_value(variable, to_numpy)

        # 2. the rest checked, and the record planned
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
            before_copy=None if blocking else functools.partial(background.prepare, filepath, store),
        )
        # 3. the request, written through its one engine (a background write is submitted by
        # save_training_state once the call has left the model)
        archive = None
        if filepath.endswith(".keras"):
            archive = files.keras_archive(model, filepath, now=not blocking)
        request = WriteRequest(filepath, record, store=store, keras_archive=archive, started=started)
        return cast("str | Callable[[], background.SaveHandle]", engine.write(request))


def training_state_record(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = None,
    *,
    verb: str,
    model_state: str = "all",
    callbacks: Sequence[keras.callbacks.Callback] = (),
    state: Mapping[str, Any] | None = None,
    include_rng: bool = True,
    allow_order_keys: bool = False,
    variables: Mapping[str, keras.Variable] | None = None,
    mappers: Mapping[str, StateMapper] | None = None,
    convert: Callable[[Any], Any] = _host_array,
    before_copy: Callable[[], None] | None = None,
) -> format.StateRecord:
    """The `StateRecord` that [`save_training_state`][keras_stable_state.save_training_state]
    writes, with every argument checked as it says (``verb`` names the caller in messages;
    ``convert`` turns a variable into the value stored; ``before_copy`` runs once the
    arguments are checked, before any value is read)."""
    check_model(model, verb)
    check_not_partial(model, verb)
    if model_state not in MODEL_STATES:
        raise ValueError(
            f"`model_state` must be one of {MODEL_STATES}. Received: model_state={model_state!r}"
        )
    optimizers, torch_opts = torch_optim.split_optimizers(check_optimizers(optimizer, verb, model))
    optimizer = optimizers.get(MAIN)
    callbacks_by_key = check_callbacks(callbacks, verb)
    providers = check_providers(state, verb)
    if metrics.NAME not in providers and model.metrics_variables:
        # the model's metric variables (its own trackers too), as StableCheckpoint saves them
        providers = {**providers, metrics.NAME: metrics.Metrics(model)}
    check_flags(verb, include_rng=include_rng, allow_order_keys=allow_order_keys)
    if not model.built:
        raise StateError(f"Model {model.name!r} is not built; build it before saving its training state.")
    extras = check_variables(variables, verb, model)
    torch_optim.check_all_passed(model, list(torch_opts.values()), providers, extras, verb)
    check_bound_passed(model, optimizers.values(), verb)
    mapper_rules = check_mappers(mappers, verb)
    if before_copy is not None:
        before_copy()
    saved_vars = {"all": model.variables, "trainable": model.trainable_variables, "none": []}[model_state]
    registry = VariableRegistry.from_model(model)
    # Converted to host arrays one at a time as the file is written (storage.StateRecord).
    model_arrays = {str(registry.key_of(v)): functools.partial(convert, v) for v in saved_vars}
    model_arrays.update(
        (f"{EXTRA}:{n}", functools.partial(convert, v))
        for n, v in extras.items()
        if extra_saved(v, model_state)
    )
    opt_arrays, opt_meta = save_optimizers(optimizers, model, allow_order_keys, extras, convert=convert)
    extra, arrays = _collect_state(model, optimizer, callbacks_by_key, providers, include_rng)
    extra[layers.SECTION], found = _state.split_arrays(
        layers.collect_layer_state(model, buffers=model_state == "all"), layers.SECTION
    )
    arrays.update(found)
    if torch_opts:  # torch.optim optimizers: their state by the keys of the variables they train
        torch_state = {
            name: torch_optim.optimizer_state(
                opt, name, model, extras, allow_order_keys=allow_order_keys, verb=verb
            )
            for name, opt in torch_opts.items()
        }
        extra[torch_optim.SECTION], found = _state.split_arrays(torch_state, torch_optim.SECTION)
        _check_json(extra[torch_optim.SECTION], torch_optim.SECTION, "")
        arrays.update(found)
    if mapper_rules:
        model_arrays, opt_arrays, extra[MAPPED_SECTION], found = encode_arrays(
            mapper_rules, model_arrays, opt_arrays
        )
        arrays.update(found)
    return format.StateRecord(
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


def _check_processes(filepath: str) -> None:
    """Refuse a ``.keras`` archive with several JAX processes (Keras' own ``model.save`` cannot
    read arrays whose shards live on other processes), and a ``.orbax`` one with several Torch
    ranks (the engine's collectives are JAX's)."""
    kind = _processes.runtime()
    if kind == "torch" and orbax_layout.is_orbax_path(filepath):
        raise CheckpointFormatError(
            f"Cannot save {filepath!r} with {_processes.process_count()} torch.distributed ranks: the "
            "'.orbax' engine runs JAX's collectives. Save to '.h5' paths (a CheckpointManager directory "
            "not named '*.orbax'): rank 0 writes, the others wait.",
            key=None,
            expected="a '.h5' path",
            received=filepath,
        )
    if filepath.endswith(".keras") and kind == "jax":
        raise CheckpointFormatError(
            f"Cannot save {filepath!r} with {_processes.process_count()} JAX processes: a '.keras' "
            "archive holds Keras' own weights, and keras' model.save cannot read the shards held by other "
            "processes. Save to a '.h5' path (every process gathers, process 0 writes) or to a '.orbax' "
            "directory (each process writes its own shards).",
            key=None,
            expected="a '.h5' or '.orbax' path",
            received=filepath,
        )


def _check_json(value: Any, record: str, path: str) -> None:
    """Refuse a state value (arrays split out) that JSON cannot hold, naming the record
    (``"callbacks/MyCallback/0"``) and the place in it."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json(v, record, f"{path}/{k}")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, record, f"{path}/{i}")
        return
    raise TypeError(
        f"The state saved as {record!r} holds a {type(value).__name__} at {path or '/'!r}, which is "
        "neither a JSON value nor a NumPy array. get_state() must return a dict of JSON values (str, "
        "int, float, bool, None, lists, dicts) and NumPy arrays; convert it there, or return {} for a "
        "callback whose state need not be saved."
    )


def _collect_state(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None,
    callbacks: dict[str, keras.callbacks.Callback],
    state: dict[str, Any],
    include_rng: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON part and the arrays of everything that is not a variable."""
    extra: dict[str, Any] = {
        "schedule": _state.schedule_state(optimizer),
        "callbacks": {},
        "providers": {},
        "rng": None,
    }
    arrays: dict[str, Any] = {}

    def put(section: str, name: str, value: Any) -> None:
        json_value, found = _state.split_arrays(value, f"{section}/{name}")
        _check_json(json_value, f"{section}/{name}", "")
        extra[section][name] = json_value
        arrays.update(found)

    for key, cb in callbacks.items():
        value = _state.callback_state(cb)
        if value is not None:
            put("callbacks", key, value)
    for name, provider in state.items():
        put("providers", name, provider.get_state())
    if include_rng:
        extra["rng"], found = _state.split_arrays(_state.rng_state(), "rng")
        arrays.update(found)
    return extra, arrays
