"""``save_training_state`` and ``restore_training_state``: the two verbs users call."""

from __future__ import annotations

import contextvars
import dataclasses
import os
import re
import weakref

import keras
import numpy as np

from keras_stable_state import layer_state, storage
from keras_stable_state import state as state_mod
from keras_stable_state.contract import TrainableContract
from keras_stable_state.errors import (
    BindingError,
    CheckpointFormatError,
    CorruptCheckpointError,
    DtypeMismatchError,
    KeyFormatError,
    StateError,
)
from keras_stable_state.identity import EXTRA, VariableKey, VariableRegistry
from keras_stable_state.optimizer import MAIN as MAIN_OPTIMIZER
from keras_stable_state.optimizer import (
    StableOptimizer,
    _check_name,
    _tree,
    accumulation,
    optimizer_entries,
    parse_entry_key,
    routing,
    split_entry_name,
    stable_optimizer_in,
    tracked_optimizers,
)

__all__ = [
    "RestoreReport",
    "MalformedKeyError",
    "PendingRestore",
    "save_training_state",
    "restore_training_state",
]


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


def _check_callbacks(callbacks, verb) -> dict:
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
                    "(e.g. callbacks={'es': early_stopping}). " + _received(f"callbacks[{name!r}]", cb)
                )
        return dict(callbacks)
    if isinstance(callbacks, keras.callbacks.Callback) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"`callbacks` of {verb} must be a dict {{name: callback}} or a list of "
            "keras.callbacks.Callback instances (e.g. callbacks={'es': early_stopping}). "
            + _received("callbacks", callbacks)
        )
    bad = [(i, cb) for i, cb in enumerate(callbacks) if not isinstance(cb, keras.callbacks.Callback)]
    if bad:
        i, cb = bad[0]
        raise TypeError(
            f"`callbacks` of {verb} must be a list of keras.callbacks.Callback instances; item {i} is "
            f"not. " + _received(f"callbacks[{i}]", cb)
        )
    callbacks = list(callbacks)
    return {state_mod.callback_key(callbacks, cb): cb for cb in callbacks}


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


_EXTRA_NAME = re.compile(r"[^/#\s]+")


def _check_variables(variables, verb, model) -> dict:
    """``{name: keras.Variable}`` of variables outside ``model`` (keys ``var:<name>``)."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise TypeError(
            f"`variables` of {verb} must be a dict {{name: keras.Variable}} of variables outside the "
            "model that the optimizer trains (e.g. variables={'log_alpha': log_alpha}). "
            + _received("variables", variables)
        )
    in_model = {id(v): str(k) for k, v in VariableRegistry.from_model(model).entries}
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
                "model, trained by the same optimizer). " + _received(f"variables[{name!r}]", var)
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


def _check_rename(prefix, rename, verb):
    """The key rename rules: ``[(compiled pattern, replacement)]``, or ``None``."""
    if prefix is not None and rename is not None:
        raise ValueError(
            f"Pass either `prefix` or `rename` to {verb}, not both: prefix='P' is the rule "
            "(r'^path:', 'path:P/'); add it to `rename` instead. "
            + _received("prefix", prefix)
            + "; "
            + _received("rename", rename)
        )
    if prefix is not None:
        if not isinstance(prefix, str) or not prefix or prefix != prefix.strip("/") or "//" in prefix:
            raise ValueError(
                f"`prefix` of {verb} must be the stable path of the nested model inside `model`, such "
                "as 'layers/base' (no leading or trailing '/'): a saved key 'path:<p>' is restored as "
                "'path:<prefix>/<p>'. " + _received("prefix", prefix)
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
            "rename=[(r'^path:layers/base/', 'path:')]. " + _received("rename", rename)
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


@dataclasses.dataclass
class RestoreReport:
    """What :func:`restore_training_state` did.

    Attributes:
        matched: ``{key: "name" | "order"}`` for every restored model variable
            and optimizer variable: how its saved array was matched.
        left_fresh: Keys of live variables the file had no value for (they
            keep their current values).
        dropped: Saved keys that were not restored; ``dropped_reasons`` says why.
        dropped_reasons: ``{saved key: reason}`` for every key in ``dropped``:
            ``"no longer trained"`` (frozen since, ``strict=False``),
            ``"not in the model (renamed or removed)"``, ``"no such variable in
            the live optimizer"``, ``"extra variable not passed in `variables=`"``,
            ``"no rename rule matches"``, ``"no optimizer to restore into
            (compile the model or pass optimizer=)"``, ``"kept the compiled
            learning rate (keep_learning_rate=True)"``.
        renamed: ``(saved key, key restored as)`` for every key a ``prefix`` or
            ``rename`` rule changed.
        learning_rates: ``(key, compiled value, saved value, "replaced" | "kept")``
            for every learning-rate variable whose saved value differs from the
            compiled one (``"kept"`` with ``keep_learning_rate=True``).
        casts: ``(key, saved dtype, variable dtype)`` for every array cast.
        restored_state: Other state put back (``"callback:EarlyStopping/0"``,
            ``"state:<provider>"``, ``"rng"``).
        built_optimizer: ``True`` when the optimizer was built by the restore.
        order_keys: Saved keys that are registration-order keys
            (``order:<i>#<slot>``): the state was saved with
            ``allow_order_keys=True`` and these were matched by position.
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
    dropped_reasons: dict = dataclasses.field(default_factory=dict)
    renamed: list = dataclasses.field(default_factory=list)
    learning_rates: list = dataclasses.field(default_factory=list)
    casts: list = dataclasses.field(default_factory=list)
    restored_state: list = dataclasses.field(default_factory=list)
    built_optimizer: bool = False
    order_keys: list = dataclasses.field(default_factory=list)
    transfer_note: bool = False
    source: str = storage.FORMAT
    writer: dict = dataclasses.field(default_factory=dict)

    def drop(self, key, reason) -> None:
        """List ``key`` in ``dropped`` with its ``reason``."""
        self.dropped.append(key)
        self.dropped_reasons[key] = reason

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
        if self.order_keys:
            lines.append(
                "  keyed by registration order (saved with allow_order_keys=True), matched by position: "
                f"{self.order_keys}"
            )
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
        if self.renamed:
            old, new = self.renamed[0]
            lines.append(f"  renamed {len(self.renamed)} saved keys (e.g. {old} -> {new})")
        by_reason = {}
        for key in self.dropped:
            by_reason.setdefault(self.dropped_reasons.get(key, "not restored"), []).append(key)
        for reason, keys in by_reason.items():
            lines.append(f"  dropped ({reason}): {keys}")
        for key, live, saved, action in self.learning_rates:
            if action == "kept":
                lines.append(f"  learning rate {key}: compiled {live:.6g} kept (saved {saved:.6g})")
            else:
                lines.append(
                    f"  learning rate {key}: compiled {live:.6g} replaced by saved {saved:.6g} "
                    "(pass keep_learning_rate=True to keep the compiled value)"
                )
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


def _optimizer_registry(optimizer, model, extras=None):
    """Keys for the variables the optimizer was built with: the model's stable paths,
    ``var:<name>`` for the caller's ``extras``, registration order for the rest."""
    registry = VariableRegistry.from_model(model, _top(optimizer)._trainable_variables)
    if not extras:
        return registry
    names = {id(v): VariableKey(EXTRA, name) for name, v in extras.items()}
    keyed = VariableRegistry([(names.get(id(v), key), v) for key, v in registry.entries])
    keyed.keras_paths = registry.keras_paths
    return keyed


def _keyed_optimizer_entries(optimizer, model, extras=None, **kwargs) -> list:
    """:func:`optimizer_entries` keyed by ``model``'s paths and ``extras``' names."""
    return optimizer_entries(optimizer, _optimizer_registry(optimizer, model, extras), **kwargs)


def _model_registry(model, extras):
    """The model's variables by stable path, then ``extras`` as ``var:<name>``."""
    registry = VariableRegistry.from_model(model)
    if not extras:
        return registry
    keyed = VariableRegistry(registry.entries + [(VariableKey(EXTRA, n), v) for n, v in extras.items()])
    keyed.keras_paths = registry.keras_paths
    return keyed


def _check_inside(optimizer, model, extras, verb):
    """Refuse an optimizer that trains variables neither in ``model`` nor in ``extras``."""
    inside = {id(v) for v in model.variables} | {id(v) for v in extras.values()}
    outside = [v for v in _top(optimizer)._trainable_variables if id(v) not in inside]
    if not outside:
        return
    paths = [str(getattr(v, "path", v.name)) for v in outside]
    names = [re.sub(r"[/#\s]", "_", str(v.name).rsplit("/", 1)[-1]) or "name" for v in outside]
    hint = ", ".join(f"'{n}': {n}" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    raise BindingError(
        f"Optimizer {optimizer.name!r} trains {len(outside)} variable(s) outside model {model.name!r}: "
        f"{paths}. Their values would not be saved with the model and their slots could only be "
        "keyed by registration order, so they are refused. Variables of no model (a temperature, "
        f"a loss weight): pass them by name, {verb}(..., variables={{{hint}}}), and the same "
        "`variables=` to both save_training_state and restore_training_state. Variables of an "
        f"outer model that contains {model.name!r}: use that model, with prefix='layers/<name>' "
        f"to restore a state saved from {model.name!r} alone.",
        key=paths[0],
        expected=f"variables of model {model.name!r} or in `variables`",
        received=paths,
    )


def _learning_rate_ids(optimizer) -> set:
    """``id`` of every learning-rate variable of the optimizer and the ones it wraps."""
    from keras_stable_state.optimizer import _tree

    return {
        id(opt._learning_rate)
        for _, opt in _tree(optimizer)
        if isinstance(getattr(opt, "_learning_rate", None), keras.Variable)
    }


_NOT_IN_MODEL = "not in the model (renamed or removed)"
_NOT_PASSED = "extra variable not passed in `variables=`"
_KEPT_LR = "kept the compiled learning rate (keep_learning_rate=True)"
_NO_OPTIMIZER = "no optimizer to restore into (compile the model or pass optimizer=)"


def _drop_reason(vkey, frozen) -> str:
    """Why the slots of saved variable ``vkey`` are dropped; ``frozen``: keys of model
    variables that are no longer trained."""
    if str(vkey) in frozen:
        return "no longer trained"
    return _NOT_PASSED if vkey.kind == EXTRA else _NOT_IN_MODEL


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

    Returns:
        A list of ``(variable, array)`` to assign.

    Raises:
        MalformedKeyError: a saved entry key cannot be parsed (a damaged file).
        BindingError: count, shape or key mismatches (named in the message).
        DtypeMismatchError: dtype differences without ``allow_cast``, between
            kinds (integer, boolean, float), or an integer out of range.
    """
    registry = _optimizer_registry(optimizer, model, extras)
    # Live keys only match saved ones: an order key here binds nothing a saved named key owns.
    live = optimizer_entries(optimizer, registry, name=name, allow_order_keys=True)
    lr_ids = _learning_rate_ids(optimizer)
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
        extra = sorted(k.value for k in unmatched if k.kind == EXTRA)
        hint = (
            f" Slots of {['var:' + n for n in extra]} belong to variables passed by name when saving; "
            f"pass variables={{{', '.join(repr(n) + ': ...' for n in extra)}}} to restore them."
            if extra
            else ""
        )
        raise BindingError(
            f"Saved optimizer slots belong to variables the model does not have: "
            f"{sorted(map(str, unmatched))}. The model differs from the one saved; rebuild it as "
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
            report.drop(key, _drop_reason(vkey, frozen))
            continue
        entry = live_by_key.get(live_key)
        if (
            entry is None
            and keep_learning_rate
            and vkey is None
            and slot.rsplit("/", 1)[-1] == "learning_rate"
        ):
            report.drop(key, _KEPT_LR)
            continue
        if entry is None and vkey is not None and strict:
            _refuse_regrouped(key, live_key, live_by_key, optimizer, where)
        if entry is None:
            if strict:
                raise BindingError(
                    f"Saved optimizer variable {key} has no live counterpart {live_key} in "
                    f"{type(_top(optimizer)).__name__}. The optimizer differs from the one saved "
                    "(another class or options); build the same optimizer, or pass strict=False.",
                    key=key,
                )
            report.drop(key, "no such variable in the live optimizer")
            continue
        used.add(live_key)
        value = _coerce(live_key, array, entry.variable, allow_cast, report)
        if id(entry.variable) in lr_ids:
            compiled, saved = float(_np(entry.variable)), float(value)
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


def _refuse_regrouped(key, live_key, live_by_key, optimizer, where):
    """A saved slot of group ``optimizers/<i>/`` whose variable the live MultiOptimizer has
    in another group: refuse naming the routing change."""
    pattern = re.compile(r"optimizers/[0-9]+/")
    if not pattern.search(live_key):
        return
    shape = pattern.sub("optimizers/*/", live_key)
    elsewhere = [k for k in live_by_key if pattern.sub("optimizers/*/", k) == shape]
    if not elsewhere:
        return
    saved_group = pattern.search(live_key).group(0)
    live_group = pattern.search(elsewhere[0]).group(0)
    var = live_by_key[elsewhere[0]].reference
    raise BindingError(
        f"Parameter groups differ: {key} in {_where(where)} was saved in group {saved_group.rstrip('/')}, "
        f"but the live MultiOptimizer routes its variable to group {live_group.rstrip('/')} ({elsewhere[0]}); "
        f"its pattern sees variable.path {str(getattr(var, 'path', '?'))!r}. Each group's slots, learning "
        "rate and clipping would be applied to other variables. MultiOptimizer routes by `variable.path`, "
        "which holds Keras' auto-generated layer names: name the layers your patterns match (see docs: "
        "parameter groups), or restore with kss.restore_training_state into an optimizer that is not "
        "built yet (it then routes every variable to its saved group).",
        key=key,
        expected=saved_group.rstrip("/"),
        received=live_group.rstrip("/"),
    )


def restore_optimizer_arrays(optimizer, model, arrays, *, keyed, strict=True, allow_cast=False):
    """Plan, check and assign optimizer arrays (used by ``StableOptimizer.load_own_variables``);
    all or nothing."""
    report = RestoreReport()
    plan = plan_optimizer_arrays(
        optimizer, model, arrays, keyed=keyed, strict=strict, allow_cast=allow_cast, report=report
    )
    _apply([_variable_step(var, array) for var, array in plan])
    return report


# -- several optimizers (a GAN's d_optimizer / g_optimizer), groups and windows -------------
def _check_optimizers(optimizer, verb, model) -> dict:
    """``{name: optimizer}``: ``optimizer`` as given (one, or a dict by name), else every
    optimizer the model tracks (``model.optimizer`` and optimizer attributes)."""
    if isinstance(optimizer, dict):
        for name, opt in optimizer.items():
            _check_name(name, "optimizer name")
            if not isinstance(opt, keras.optimizers.Optimizer):
                raise TypeError(
                    f"`optimizer[{name!r}]` of {verb} must be a keras.optimizers.Optimizer instance "
                    "(e.g. optimizer={'d': d_optimizer, 'g': g_optimizer}). "
                    + _received(f"optimizer[{name!r}]", opt)
                )
        return dict(optimizer)
    if optimizer is not None:
        return {MAIN_OPTIMIZER: _check_optimizer(optimizer, verb, model)}
    _check_optimizer(None, verb, model)
    return tracked_optimizers(model)


def _build_for(name, opt, model, meta, report, where, extras=None):
    """Build an unbuilt optimizer: ``model.optimizer`` on the model's trainable variables,
    any other on the variables it was saved with; a ``MultiOptimizer`` routed as saved."""
    if opt.built:
        return
    if name == MAIN_OPTIMIZER:
        # Never fewer variables than the model trains (not the nested model of a wrapper).
        _check_not_nested(opt, model)
        variables = [*model.trainable_variables, *(v for v in (extras or {}).values() if v.trainable)]
    else:
        saved = (meta or {}).get("variables")
        if not isinstance(saved, list):
            raise BindingError(
                f"Optimizer {name!r} is not built and {where} does not say which variables it trains; "
                f"build it on them (`model.{name}.build(model.<part>.trainable_variables)`) before "
                "restoring.",
                key=name,
            )
        by_key = {str(k): v for k, v in VariableRegistry.from_model(model).entries}
        absent = [k for k in saved if k not in by_key]
        if absent:
            raise BindingError(
                f"Optimizer {name!r} is not built, and the variables it was saved with in {where} are "
                f"not all in the model (missing: {absent}); build it on the variables it trains "
                f"(`model.{name}.build(...)`) before restoring.",
                key=absent[0],
            )
        variables = [by_key[k] for k in saved]
    saved_routing = (meta or {}).get("routing") or {}
    registry = VariableRegistry.from_model(model, variables)
    for prefix, multi in _tree(opt):
        if isinstance(multi, keras.optimizers.MultiOptimizer) and not multi.built and prefix in saved_routing:
            _build_routed(multi, variables, registry, saved_routing[prefix])
    opt.build(variables)
    if report is not None:
        report.built_optimizer = True


def _build_routed(multi, variables, registry, groups):
    """Build a ``MultiOptimizer`` routing each variable to the group it was saved in
    (its pattern decides only for variables the file has no group for)."""
    n = len(multi._inner_optimizers)
    if not n or any(not isinstance(g, int) or not 0 <= g < n for g in groups.values()):
        return  # a callable selector adds its groups while building: route by it, compare later
    multi._var_to_optimizer_idx = {}
    multi._trainable_variables_indices = {}
    per_group = [[] for _ in range(n)]
    for i, var in enumerate(variables):
        idx = groups.get(str(registry.key_of(var)))
        if idx is None:
            idx = multi._inner_optimizers.index(multi._optimizer_map(var))
        multi._var_to_optimizer_idx[multi._var_key(var)] = idx
        multi._trainable_variables_indices[multi._var_key(var)] = i
        per_group[idx].append(var)
    for sub, group in zip(multi._inner_optimizers, per_group, strict=True):
        if group:
            sub.build(group)
    super(keras.optimizers.MultiOptimizer, multi).build(variables)


def _check_windows_and_groups(name, opt, model, meta, where):
    """Refuse a changed accumulation window or parameter-group routing, naming it."""
    label = "model.optimizer" if name == MAIN_OPTIMIZER else f"optimizer {name!r}"
    saved_acc = meta.get("accumulation") or {}
    live_acc = accumulation(opt)
    for prefix in sorted(set(saved_acc) | set(live_acc)):
        saved_k = (saved_acc.get(prefix) or {}).get("steps")
        live_k = (live_acc.get(prefix) or {}).get("steps")
        if saved_k != live_k:
            position = (saved_acc.get(prefix) or {}).get("position", 0)
            window = (
                f"The checkpoint was taken {position} micro-step(s) into an accumulation window of "
                f"{saved_k}: those accumulated gradients belong to a window of {saved_k}. "
                if position
                else ""
            )
            raise BindingError(
                f"{label}{' (' + prefix.rstrip('/') + ')' if prefix else ''} in {where} was saved with "
                f"gradient_accumulation_steps={saved_k}, the live one has gradient_accumulation_steps="
                f"{live_k}. {window}The iteration counter counts micro-steps, so the update count, the "
                "learning-rate schedule and the bias corrections would change too. Build the optimizer "
                f"with gradient_accumulation_steps={saved_k} to resume this checkpoint.",
                key="gradient_accumulation_steps",
                expected=saved_k,
                received=live_k,
            )
    saved_routing = meta.get("routing") or {}
    if not saved_routing:
        return
    registry = _optimizer_registry(opt, model)
    live_routing = routing(opt, registry)
    moved = []
    for prefix, groups in sorted(saved_routing.items()):
        live = live_routing.get(prefix, {})
        multi = dict(_tree(opt)).get(prefix)
        subs = list(getattr(multi, "_inner_optimizers", []) or [])
        for key, group in sorted(groups.items()):
            now = live.get(key)
            if now is not None and now != group:
                var = registry.variable_of(VariableKey.parse(key))
                sub = type(subs[now]).__name__ if now < len(subs) else "?"
                moved.append(
                    f"{key}: saved in group {group}, the live MultiOptimizer routes it to group {now} "
                    f"({sub}; its pattern sees variable.path {str(getattr(var, 'path', '?'))!r})"
                )
    if moved:
        raise BindingError(
            f"The parameter groups of {label} differ from the ones saved in {where}: "
            + "; ".join(moved)
            + ". Each group's slots (and its learning rate and clipping) would be applied to other "
            "variables. MultiOptimizer routes by `variable.path`, which holds Keras' auto-generated layer "
            "names: name the layers your patterns match (see docs: parameter groups), or restore into an "
            "optimizer that is not built yet (the restore then routes every variable to its saved group).",
            key=moved[0].split(":")[0] + ":" + moved[0].split(":")[1],
            expected=saved_routing,
            received=live_routing,
        )


def _save_optimizers(optimizers, model, allow_order_keys, extras=None):
    """The keyed arrays of every optimizer, and per optimizer: classes, variables, groups, windows."""
    arrays, meta = {}, {}
    for name, opt in optimizers.items():
        if not opt.built and name != MAIN_OPTIMIZER:
            meta[name] = {"classes": _optimizer_classes(opt), "built": False}
            continue
        _ensure_built(opt, model, extras=extras)
        if stable_optimizer_in(opt) is not None:
            stable_optimizer_in(opt)._model_ref = weakref.ref(model)  # bound to the model given
        allow = allow_order_keys or getattr(opt, "allow_order_keys", False)
        if not allow:
            _check_inside(opt, model, extras or {}, "save_training_state")
        registry = _optimizer_registry(opt, model, extras)
        for entry in optimizer_entries(opt, registry, name=name, allow_order_keys=allow):
            arrays[entry.key] = _np(entry.variable)
        meta[name] = {
            "classes": _optimizer_classes(opt),
            "variables": [str(registry.key_of(v)) for v in _top(opt)._trainable_variables if v in registry],
            "routing": routing(opt, registry),
            "accumulation": accumulation(opt),
        }
    return arrays, meta


def _plan_optimizers(
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
    where = _where(filepath)
    saved_opt = record.optimizer
    meta_all = record.metadata.get("optimizers") if isinstance(record, storage.StateRecord) else None
    meta_all = meta_all if isinstance(meta_all, dict) else {}
    if isinstance(saved_opt, dict):
        groups = {}
        for key, array in saved_opt.items():
            _, slot = _parse_optimizer_key(key, where)
            groups.setdefault(split_entry_name(slot)[0], {})[key] = array
    else:
        groups = {MAIN_OPTIMIZER: saved_opt} if len(saved_opt) else {}
    if not optimizers:
        for saved in groups.values():
            for key in saved if isinstance(saved, dict) else range(len(saved)):
                report.drop(key if isinstance(key, str) else f"optimizer[{key}]", _NO_OPTIMIZER)
        return []
    absent = sorted(set(groups) - set(optimizers))
    if absent and strict:
        raise BindingError(
            f"{where} holds the state of optimizers {absent}, which the model does not track (it has "
            f"{sorted(optimizers)}). Set them on the model as attributes named as saved, pass them as "
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
            f"{where} has no state for optimizers {unsaved} of the model (it holds {sorted(groups)}): "
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
        if name == MAIN_OPTIMIZER and not meta:
            classes = getattr(record, "metadata", {}).get("optimizer_classes")
            meta = {"classes": classes} if meta_all == {} else {}
        saved_classes = meta.get("classes")
        live_classes = _optimizer_classes(opt)
        if strict and saved_classes is not None and saved_classes != live_classes:
            label = "" if name == MAIN_OPTIMIZER else f" {name!r}"
            raise BindingError(
                f"The optimizer{label} state in {where} was saved from {saved_classes} but the live "
                f"optimizer is {live_classes}. Slots of another optimizer class would be applied with other "
                "update rules; build the optimizer as saved, or pass strict=False to restore what matches.",
                key=name,
                expected=saved_classes,
                received=live_classes,
            )
        _build_for(name, opt, model, meta, report, where, extras)
        if stable_optimizer_in(opt) is not None:
            stable_optimizer_in(opt)._model_ref = weakref.ref(model)  # bound to the model given
        _check_inside(opt, model, extras or {}, "restore_training_state")
        _check_windows_and_groups(name, opt, model, meta, where)
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
        )
    return plan


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


def _ensure_built(optimizer, model, report=None, extras=None):
    if optimizer.built:
        return
    if not model.built:
        raise StateError(
            f"Optimizer {optimizer.name!r} is not built and model {model.name!r} is not built either, "
            "so there are no variables to attach slots to. Build the model first (call it on a batch "
            "or `model.build(input_shape)`).",
        )
    _check_not_nested(optimizer, model)
    optimizer.build([*model.trainable_variables, *(v for v in (extras or {}).values() if v.trainable)])
    if report is not None:
        report.built_optimizer = True


def _check_not_nested(optimizer, model):
    """Refuse to build ``optimizer`` on a model that is a layer of another model."""
    if optimizer is not getattr(model, "optimizer", None) and getattr(model, "_inbound_nodes", None):
        raise BindingError(
            f"Optimizer {optimizer.name!r} is not built, and model {model.name!r} is used as a layer "
            "inside another model (it was called on that model's inputs). Building the optimizer here "
            f"would build it on the {len(model.trainable_variables)} trainable variables of "
            f"{model.name!r} only, and the outer model's next fit would fail on its other variables. "
            "Restore into the outer model, which trains every variable: "
            f"restore_training_state(path, outer_model, prefix='layers/{model.name}') for a state "
            f"saved from {model.name!r} alone; or build the optimizer on the outer model first "
            "(optimizer.build(outer_model.trainable_variables)).",
            key=None,
            expected="an optimizer built on the outer model, or the outer model",
            received=model.name,
        )


_MODEL_STATES = ("all", "trainable", "none")


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
        variables: ``{name: keras.Variable}``: variables outside the model that
            the optimizer trains (a temperature ``log_alpha`` passed to
            ``optimizer.apply`` next to ``model.trainable_variables``). Their
            values and slots are saved under ``var:<name>``; pass the same
            names to :func:`restore_training_state`.

    Raises:
        TypeError: naming the argument, for a ``filepath`` that is not a path, a
            ``model`` that is not a ``keras.Model``, an ``optimizer`` that is not
            a ``keras.optimizers.Optimizer`` (a name such as ``"adam"`` included),
            ``callbacks`` that are not a list of ``keras.callbacks.Callback``, a
            ``state`` provider without ``get_state()`` / ``set_state()``,
            ``variables`` that are not a dict of ``keras.Variable``, or a flag
            that is not a bool.
        ValueError: for an unknown ``model_state``, a provider or variable name
            that is empty or holds ``/``, or a ``variables`` entry that is a
            model variable or named twice.
        BindingError: if the optimizer trains a variable that is neither in the
            model nor in ``variables`` (naming its path and the fix), or is
            unbuilt while ``model`` is a layer of another model.
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
    optimizers = _check_optimizers(optimizer, verb, model)
    optimizer = optimizers.get(MAIN_OPTIMIZER)
    callbacks = _check_callbacks(callbacks, verb)
    state = _check_providers(state, verb)
    _check_flags(verb, include_rng=include_rng, allow_order_keys=allow_order_keys)
    if not model.built:
        raise StateError(f"Model {model.name!r} is not built; build it before saving its training state.")
    extras = _check_variables(variables, verb, model)
    saved_vars = {"all": model.variables, "trainable": model.trainable_variables, "none": []}[model_state]
    registry = VariableRegistry.from_model(model)
    model_arrays = {str(registry.key_of(v)): _np(v) for v in saved_vars}
    model_arrays.update((f"{EXTRA}:{n}", _np(v)) for n, v in extras.items() if _extra_saved(v, model_state))
    opt_arrays, opt_meta = _save_optimizers(optimizers, model, allow_order_keys, extras)
    extra, arrays = _collect_state(model, optimizer, callbacks, state, include_rng)
    extra[layer_state.SECTION], found = state_mod.split_arrays(
        layer_state.collect_layer_state(model), layer_state.SECTION
    )
    arrays.update(found)
    record = storage.StateRecord(
        metadata={
            **_writer_metadata(model),
            "model_state": model_state,
            "optimizer_classes": None if optimizer is None else _optimizer_classes(optimizer),
            "optimizers": opt_meta,
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


def _renamed_record(record, rules, strict, report, where):
    """``record`` with every variable key renamed by the first rule that matches it.

    Model keys, the owners of slot keys and contract keys are renamed alike; a
    key no rule matches is refused (``strict``) or dropped.
    """
    if not isinstance(record, storage.StateRecord):
        raise ValueError(
            f"`prefix` and `rename` rename the keys of a keras_stable_state file; {where} is a "
            f"{record.source}, matched by position and layer structure, with no keys to rename."
        )
    cache = {}

    def rename(key):
        if key not in cache:
            _parse_model_key(key, where)
            new = None
            for pattern, replacement in rules:
                if pattern.search(key):
                    new = pattern.sub(replacement, key, count=1)
                    try:
                        VariableKey.parse(new)
                    except KeyFormatError as err:
                        raise ValueError(
                            f"rename rule ({pattern.pattern!r}, {replacement!r}) turns {key!r} into "
                            f"{new!r}, which is not a key ('path:<stable path>', 'order:<int>' or "
                            "'var:<name>'); fix the replacement."
                        ) from err
                    break
            cache[key] = new
        return cache[key]

    outside, model, optimizer, sources = [], {}, {}, {}

    def put(section, old, new, array):
        if new in sources:
            raise ValueError(
                f"The rename rules map both {sources[new]!r} and {old!r} in {where} to {new!r}; "
                "each saved key must land on its own key. Make the rules more specific."
            )
        sources[new] = old
        section[new] = array
        if new != old:
            report.renamed.append((old, new))

    for key, array in record.model.items():
        new = rename(key)
        if new is None:
            outside.append(key)
        else:
            put(model, key, new, array)
    for key, array in record.optimizer.items():
        owner, sep, slot = key.rpartition("#")
        if not sep or owner == "optimizer":
            optimizer[key] = array
            continue
        new = rename(owner)
        if new is None:
            outside.append(key)
        else:
            put(optimizer, key, f"{new}#{slot}", array)
    contract = record.contract
    if contract is not None:
        contract = [[rename(k), s, d] for k, s, d in contract if rename(k) is not None]
    if outside:
        if strict:
            raise BindingError(
                f"In {where}, no rename rule matches the saved keys {outside[:8]}"
                f"{'...' if len(outside) > 8 else ''}, so they would not be restored; with strict=True "
                "every saved key must be. Add a rule for them, or pass strict=False to leave them out "
                "(listed in report.dropped).",
                key=outside[0],
                expected="a rule matching every saved key",
                received=outside,
            )
        for key in outside:
            report.drop(key, "no rename rule matches")
    return dataclasses.replace(record, model=model, optimizer=optimizer, contract=contract)


def _nesting_prefix(inner, outer):
    """The shortest path ``P`` with ``P/k`` in ``outer`` for every ``k`` in ``inner``, or ``None``."""
    counts = {}
    for key in outer:
        parts = key.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[i:]) in inner:
                prefix = "/".join(parts[:i])
                counts[prefix] = counts.get(prefix, 0) + 1
    full = [p for p, n in counts.items() if n >= len(inner)]
    return min(full, key=len) if full else None


def _check_scope(record, registry, model, where):
    """Refuse a state whose keys belong to another scope: a model now nested in ``model``,
    or a wrapper around it. Binding those keys as they are would put one layer's values
    on another that happens to share its path (a bind across scopes)."""
    owners = [*record.model, *(k for k, *_ in record.contract or ())]
    owners += [k.rpartition("#")[0] for k in record.optimizer if isinstance(k, str)]
    saved = {k[len("path:") :] for k in owners if k.startswith("path:")}
    live = {k.value for k in registry.keys() if k.kind == "path"}
    if not saved or not live:
        return
    direct = saved & live
    prefix = _nesting_prefix(saved, live) if len(direct) < len(saved) else None
    if prefix is not None:
        example = sorted(saved)[0]
        raise BindingError(
            f"The training state in {where} was saved from a model that is now nested in "
            f"{model.name!r} at {prefix!r}: every one of its {len(saved)} saved keys is there (e.g. "
            f"'path:{example}' is 'path:{prefix}/{example}'), while only {len(direct)} of them name "
            "variables of the outer model by the same path. A bind across scopes is never made. Pass "
            f"prefix={prefix!r} to restore into the nested model (strict=False leaves the outer "
            "model's other variables fresh, listed in report.left_fresh).",
            key=f"path:{example}",
            expected=f"path:{prefix}/{example}",
            received=f"path:{example}",
        )
    prefix = _nesting_prefix(live, saved) if len(direct) < len(live) else None
    if prefix is not None:
        raise BindingError(
            f"The training state in {where} was saved from a model that contains this model at "
            f"{prefix!r}: every variable of {model.name!r} is saved as 'path:{prefix}/...', and the "
            "other saved keys belong to the outer model; they are never bound here. Pass "
            f"rename=[(r'^path:{prefix}/', 'path:')] to restore the nested part (with strict=False "
            "the outer model's keys are dropped and listed in report.dropped).",
            key=f"path:{prefix}",
            expected=f"path:{prefix}/...",
            received=sorted(live)[:4],
        )


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
            report.drop(str(k), _drop_reason(k, ()))
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
            ``report.learning_rates``.
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
    given_optimizer = optimizer
    optimizers = _check_optimizers(optimizer, verb, model)
    optimizer = optimizers.get(MAIN_OPTIMIZER)
    callbacks = _check_callbacks(callbacks, verb)
    providers = _check_providers(state, verb)
    _check_flags(
        verb,
        strict=strict,
        allow_cast=allow_cast,
        include_rng=include_rng,
        check_schedule=check_schedule,
        keep_learning_rate=keep_learning_rate,
    )
    extras = _check_variables(variables, verb, model)
    rules = _check_rename(prefix, rename, verb)
    _check_flags(verb, defer=defer)
    preloaded = _PRELOADED.get()
    record = preloaded[1] if preloaded and preloaded[0] == filepath else storage.read_file(filepath)
    if defer:
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
    registry = _model_registry(model, extras)
    if rules is not None:
        record = _renamed_record(record, rules, strict, report, where)
    elif isinstance(record, storage.StateRecord):
        _check_scope(record, registry, model, where)
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
    plan += _plan_optimizers(
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
    steps += [_variable_step(var, array) for var, array in plan]
    steps += layer_state.finalize_steps(model)
    _apply(steps, filepath)
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
                f"The state of {_where(self.filepath)} was already restored into {self._target.name!r} "
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
                    f"{_where(self.filepath)} cannot run before training starts. Build the model first "
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
        record: A :class:`~keras_stable_state.storage.StateRecord`.
        callbacks: The live callbacks: a dict ``{name: callback}`` or a list.
        report: The :class:`RestoreReport` to add to.
        where: The file, for messages.

    Returns:
        ``[]``, or a list of one callable that sets every callback state.

    Raises:
        CorruptCheckpointError: naming the record (``"callbacks/EarlyStopping/0"``)
            of a malformed saved state.
    """
    callbacks = _check_callbacks(callbacks, "StableCheckpoint")
    steps = _callback_steps(record, callbacks, report, None if where is None else _where(where))
    return [lambda: _apply(steps, where)] if steps else []


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
