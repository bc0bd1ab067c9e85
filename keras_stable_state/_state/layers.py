"""Layer state that is not a variable: lookup vocabularies, bin boundaries, derived state.

Some layers hold state that decides what their variables mean but is not a
Keras variable, so restoring variables alone restores it silently wrong:

* **vocabularies** of ``StringLookup``, ``IntegerLookup`` and the lookup inside
  ``TextVectorization`` (a TensorFlow hash table; with ``output_mode="tf_idf"``
  also the IDF weights): a model re-adapted on other data maps each token to
  another embedding row;
* **bin boundaries** of an adapted ``Discretization`` (a Python list).

Both are saved per layer, keyed by the layer's stable path
(`stable_layer_paths`), checked in full
before anything is assigned, and set before the variables.

**Derived state** is recomputed instead: after the variables are assigned,
``finalize_state()`` runs on every layer that has it and owns variables (an
adapted ``Normalization`` derives the mean and variance it uses from its
``adapt_mean`` / ``adapt_variance`` variables), as Keras' own weight loaders do.
Layers without variables are not finalized: there is nothing restored to derive
from, and ``Discretization.finalize_state()`` would recompute the boundaries from
an empty summary.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state._state.buffers import BUFFERS, buffer_steps, buffers_state, torch_buffers
from keras_stable_state._state.tree import join_arrays, malformed, same_state
from keras_stable_state.errors import BindingError, StateError, listed

__all__ = ["SECTION", "collect_layer_state", "finalize_steps", "plan_layer_state"]

#: The member of the file's ``extra`` record holding ``{layer key: state}``.
SECTION = "layer_state"

VOCABULARY = "vocabulary"
BIN_BOUNDARIES = "bin_boundaries"

# Options of a lookup layer that decide what a saved vocabulary means.
_LOOKUP_OPTIONS = (
    "vocabulary_dtype",
    "mask_token",
    "oov_token",
    "num_oov_indices",
    "output_mode",
    "invert",
    "max_tokens",
    "pad_to_max_tokens",
)


@dataclasses.dataclass
class LayerStep:
    """One assignment of a restore (the shape ``_apply.apply_steps`` runs):
    ``snapshot()`` returns ``(undo, changed)``."""

    name: str
    apply: object
    snapshot: object


def _index_lookup_class():
    return _keras_compat.index_lookup_class()


def _lookup(layer):
    """The lookup layer holding ``layer``'s vocabulary (``TextVectorization`` keeps one inside)."""
    if isinstance(layer, keras.layers.TextVectorization):
        return _keras_compat.text_vectorization_lookup(layer)
    return layer


def _kind(layer):
    if isinstance(layer, (_index_lookup_class(), keras.layers.TextVectorization)):
        return VOCABULARY
    if isinstance(layer, keras.layers.Discretization):
        return BIN_BOUNDARIES
    if torch_buffers(layer):
        return BUFFERS
    return None


def layer_key(path: str) -> str:
    """The key of a layer in the file: its stable path (``"(model)"`` for the model)."""
    return path or "(model)"


def _stateful_layers(index: ModelIndex, buffers=True) -> list:
    """``(key, layer, kind)`` for every layer with non-variable state, in the walk order of
    ``index`` (a ``TextVectorization`` stands for the lookup layer inside it);
    ``buffers=False`` leaves out the wrapped Torch modules' buffers."""
    found, inner = [], set()
    for path, layer in index.layer_paths().values():
        kind = _kind(layer)
        if kind is not None and (buffers or kind != BUFFERS):
            found.append((layer_key(path), layer, kind))
            if _lookup(layer) is not layer:
                inner.add(id(_lookup(layer)))
    return [entry for entry in found if id(entry[1]) not in inner]


def _json_token(token, key):
    if isinstance(token, (bytes, np.bytes_)):
        try:
            return bytes(token).decode("utf-8")
        except UnicodeDecodeError as err:
            raise StateError(
                f"Cannot save the vocabulary of layer {key!r}: token {bytes(token)[:40]!r} is not "
                "UTF-8 text, and vocabularies are saved as text. Build the vocabulary from UTF-8 "
                "strings (or map the tokens to integers with IntegerLookup).",
                key=key,
                expected="UTF-8 tokens",
                received=bytes(token)[:40],
            ) from err
    if isinstance(token, (str, np.str_)):
        return str(token)
    if isinstance(token, (int, np.integer)) and not isinstance(token, (bool, np.bool_)):
        return int(token)
    if token is None:
        return None
    raise StateError(
        f"Cannot save the vocabulary of layer {key!r}: token {token!r} of type "
        f"{type(token).__name__} is neither text nor an integer.",
        key=key,
        expected="str or int tokens",
        received=type(token).__name__,
    )


def _json_option(value, key):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    return _json_token(value, key)


def _lookup_state(holder, key) -> dict:
    layer = _lookup(holder)
    options = {name: _json_option(getattr(layer, name, None), key) for name in _LOOKUP_OPTIONS}
    try:
        raw = layer.get_vocabulary(include_special_tokens=True)
    except UnicodeDecodeError as err:
        raise StateError(
            f"Cannot save the vocabulary of layer {key!r} ({type(holder).__name__}): a token is not "
            f"UTF-8 text ({err.object[err.start : err.end + 8]!r}...), and vocabularies are saved as "
            "text. Build the vocabulary from UTF-8 strings, or map the tokens to integers first "
            "(IntegerLookup).",
            key=key,
            expected="UTF-8 tokens",
            received=err.object[:40],
        ) from err
    vocabulary = [_json_token(t, key) for t in raw]
    idf = None
    if layer.output_mode == "tf_idf" and getattr(layer, "idf_weights_const", None) is not None:
        idf = np.array(keras.ops.convert_to_numpy(layer.idf_weights_const), copy=True)
    return {
        "kind": VOCABULARY,
        "class": type(holder).__name__,
        "options": options,
        "vocabulary": vocabulary,
        "idf_weights": idf,
    }


def _bins_state(layer) -> dict:
    bins = layer.bin_boundaries
    return {
        "kind": BIN_BOUNDARIES,
        "class": type(layer).__name__,
        "bin_boundaries": None if bins is None else np.asarray(bins, dtype="float64").reshape(-1),
    }


def _layer_state(layer, key, kind) -> dict:
    if kind == BUFFERS:
        return buffers_state(layer)
    return _lookup_state(layer, key) if kind == VOCABULARY else _bins_state(layer)


def collect_layer_state(index: ModelIndex, *, buffers: bool = True) -> dict:
    """The non-variable state of every layer that has some, by layer key.

    Args:
        index: The `ModelIndex` of a ``keras.Model`` (a save's: its layers from its walk).
        buffers: Include the buffers of the modules ``keras.layers.TorchModuleWrapper``
            layers wrap (Torch backend; BatchNorm statistics and any registered buffer).

    Returns:
        ``{layer key: state}``; a state is a JSON-ready ``dict`` whose arrays
        (IDF weights, bin boundaries, buffers) are NumPy arrays (split them with
        `keras_stable_state._state.tree.split_arrays`).

    Raises:
        StateError: naming the layer, if a vocabulary holds a token that cannot
            be saved (bytes that are not UTF-8, a token neither text nor integer).

    Examples:
        >>> collect_layer_state(ModelIndex(model))["layers/lookup"]["vocabulary"]
        ['[UNK]', 'the', 'a']
    """
    return {key: _layer_state(layer, key, kind) for key, layer, kind in _stateful_layers(index, buffers)}


# -- restoring ----------------------------------------------------------------------
def _record(key) -> str:
    return f"{SECTION}/{key}"


def _check_saved(saved, layer, key, kind, where) -> dict:
    """Check a saved state against the live layer; the state ready to set.

    Raises:
        CorruptCheckpointError: if the record is malformed.
        BindingError: if it cannot belong to the live layer (another kind or
            class, other lookup options, a size the layer's output cannot take).
    """
    name = _record(key)
    if not isinstance(saved, dict) or saved.get("kind") not in (VOCABULARY, BIN_BOUNDARIES, BUFFERS):
        raise malformed(name, "it is not a layer state record", where)
    if saved["kind"] != kind or saved.get("class") != type(layer).__name__:
        raise BindingError(
            f"{where}: the saved state of layer {key!r} is the {saved['kind']} of a "
            f"{saved.get('class')}, but the live layer at {key!r} is a {type(layer).__name__}. "
            "The model differs from the one saved; build it as it was saved.",
            key=key,
            expected=saved.get("class"),
            received=type(layer).__name__,
        )
    if kind == BUFFERS:
        found = saved.get("buffers")
        if not isinstance(found, dict) or not all(isinstance(a, np.ndarray) for a in found.values()):
            raise malformed(name, "its buffers are not a mapping of names to arrays", where)
        return saved
    if kind == BIN_BOUNDARIES:
        bins = saved.get("bin_boundaries")
        if bins is not None and not (
            isinstance(bins, np.ndarray) and bins.ndim == 1 and bins.dtype.kind == "f"
        ):
            raise malformed(name, "its bin boundaries are not a 1-D float array", where)
        return {**saved, "bin_boundaries": None if bins is None else np.array(bins, copy=True)}
    return _check_vocabulary(saved, layer, key, name, where)


def _check_vocabulary(saved, layer, key, name, where) -> dict:
    options, vocabulary, idf = saved.get("options"), saved.get("vocabulary"), saved.get("idf_weights")
    if not isinstance(options, dict) or set(options) != set(_LOOKUP_OPTIONS):
        raise malformed(name, f"its options are not {list(_LOOKUP_OPTIONS)}", where)
    live = _lookup_state(layer, key)
    differ = [
        (o, options[o], live["options"][o]) for o in _LOOKUP_OPTIONS if options[o] != live["options"][o]
    ]
    if differ:
        listed = ", ".join(f"{o} (saved {s!r}, live {v!r})" for o, s, v in differ)
        raise BindingError(
            f"{where}: the vocabulary of layer {key!r} was saved with other options: {listed}. "
            "The saved vocabulary would mean other tokens or another output; build the layer with "
            "the options it was saved with.",
            key=key,
            expected={o: s for o, s, _ in differ},
            received={o: v for o, _, v in differ},
        )
    token_type = str if options["vocabulary_dtype"] == "string" else int
    if not isinstance(vocabulary, list) or not all(
        type(t) is token_type
        for t in vocabulary  # noqa: E721 - bool is not a token
    ):
        raise malformed(name, f"its vocabulary is not a list of {token_type.__name__} tokens", where)
    start = _keras_compat.lookup_token_start(_lookup(layer))
    special = live["vocabulary"][:start]
    tokens = vocabulary[start:]
    if vocabulary[:start] != special or len(set(tokens)) != len(tokens):
        raise malformed(
            name, f"its vocabulary does not start with the special tokens {special} or repeats a token", where
        )
    if options["max_tokens"] is not None and len(vocabulary) > options["max_tokens"]:
        raise malformed(
            name,
            f"its vocabulary has {len(vocabulary)} entries, over max_tokens={options['max_tokens']}",
            where,
        )
    frozen = _keras_compat.frozen_vocabulary_size(_lookup(layer))
    if (
        options["output_mode"] != "int"
        and not options["pad_to_max_tokens"]
        and frozen is not None
        and frozen != len(vocabulary)
        and live["vocabulary"] != vocabulary
    ):
        raise BindingError(
            f"{where}: layer {key!r} ({type(layer).__name__}, output_mode={options['output_mode']!r}) "
            f"was saved with a vocabulary of {len(vocabulary)} entries, but the live layer was "
            f"already called with {frozen}, which fixed its output width. Restore into a model "
            "whose lookup layer has not been adapted or called yet, or adapt it on the data it was "
            "saved with.",
            key=key,
            expected=len(vocabulary),
            received=frozen,
        )
    if options["output_mode"] == "tf_idf":
        sizes = {len(vocabulary)} | ({options["max_tokens"]} if options["pad_to_max_tokens"] else set())
        if tokens and not (
            isinstance(idf, np.ndarray) and idf.ndim == 1 and idf.dtype.kind == "f" and len(idf) in sizes
        ):
            raise malformed(
                name, f"its IDF weights are not a 1-D float array of length {sorted(sizes)}", where
            )
    elif idf is not None:
        raise malformed(name, "it holds IDF weights for a layer without output_mode='tf_idf'", where)
    return {**saved, "idf_weights": None if idf is None else np.array(idf, copy=True)}


def _set_state(layer, key, kind, value):
    """Set a checked state, then verify that the layer reports exactly that state.

    Raises:
        StateError: if the layer's state after setting differs from ``value``.
    """
    current = _layer_state(layer, key, kind)
    if same_state(current, value):
        return
    if kind == BIN_BOUNDARIES:
        bins = value["bin_boundaries"]
        layer.bin_boundaries = None if bins is None else bins.tolist()
    else:
        lookup = _lookup(layer)
        vocabulary, idf = value["vocabulary"], value["idf_weights"]
        if len(vocabulary) > _keras_compat.lookup_token_start(lookup):
            weights = None if idf is None else idf[: len(vocabulary)]
            lookup.set_vocabulary(vocabulary, idf_weights=weights)
        else:  # no tokens: back to an empty vocabulary (set_vocabulary refuses one)
            _keras_compat.clear_vocabulary(lookup)
    after = _layer_state(layer, key, kind)
    if not same_state(after, value):
        raise StateError(
            f"Layer {key!r} ({type(layer).__name__}) reports another {kind} after restoring the saved "
            "one. The layer does not keep the state it is given; report this with the layer's class.",
            key=key,
        )


def _snapshot_step(name, layer, apply) -> LayerStep:
    """A step whose undo puts every attribute of ``layer`` back as it was (setting
    a vocabulary, bin boundaries or finalizing replaces attributes, it does not
    change them in place)."""

    def snapshot():
        old = dict(vars(layer))

        def undo():
            vars(layer).clear()
            vars(layer).update(old)

        return undo, (lambda: True)

    return LayerStep(name, apply, snapshot)


def _renamed(saved: dict, rules, strict, report, where) -> dict:
    """``saved`` with each layer key renamed by the first rule matching ``path:<key>``
    (the rules of ``restore_training_state(prefix=..., rename=...)``)."""
    out, outside = {}, []
    for key, value in saved.items():
        new = None
        for pattern, replacement in rules:
            if pattern.search(f"path:{key}"):
                new = pattern.sub(replacement, f"path:{key}", count=1)
                break
        if new is None or not new.startswith("path:") or not new[5:]:
            outside.append(key)
            continue
        if new[5:] in out:
            raise ValueError(
                f"The rename rules map two saved layer states in {where} to layer {new[5:]!r}; each "
                "must land on its own layer. Make the rules more specific."
            )
        out[new[5:]] = value
        if new[5:] != key:
            report.renamed.append((_record(key), _record(new[5:])))
    if outside and strict:
        raise BindingError(
            f"In {where}, no rename rule turns the saved layer states {outside} into a layer path "
            "('path:<stable path>'), so their vocabularies or bin boundaries would not be restored. "
            "Add a rule for them, or pass strict=False to leave them out (listed in report.dropped).",
            key=outside[0],
            expected="a rule matching every saved key",
            received=outside,
        )
    for key in outside:
        report.drop(f"layer:{key}", "no rename rule matches")
    return out


def plan_layer_state(record, index: ModelIndex, *, strict, report, where, rules=None) -> list:
    """Check the saved layer states against the model; the steps that set them.

    Every saved state is checked before anything is set. A live layer with
    such state and no saved value is refused under ``strict`` (else listed in
    ``report.left_fresh`` as ``"layer:<key>"``); a saved state without a live
    layer is refused under ``strict`` (else listed in ``report.dropped``).

    Args:
        record: A `StateRecord`, or a stock
            Keras file's record (which holds no layer state).
        index: The restore's `ModelIndex` of the model being restored (its layers from its walk).
        strict: Refuse layers without a saved state and saved states without a layer.
        report: The [`RestoreReport`][keras_stable_state.RestoreReport] to add to.
        where: The file, for messages.
        rules: ``[(compiled pattern, replacement)]`` rename rules of
            ``restore_training_state(prefix=..., rename=...)``, applied to
            ``"path:<layer key>"``; ``None`` for none.

    Returns:
        A list of steps (``name``, ``apply``, ``snapshot``) to run before the
        variables are assigned.

    Raises:
        CorruptCheckpointError: naming the record (``"layer_state/layers/lookup"``)
            of a malformed saved state.
        BindingError: naming the layers, for a state saved from another kind of
            layer or with other options, a vocabulary the live layer's output
            width cannot take, or (``strict``) a layer without a saved state or a
            saved state without a layer; (``strict``, ``rules``) a saved state
            no rule renames.
        ValueError: if ``rules`` rename two saved layer states to one layer.
    """
    extra = getattr(record, "extra", None)
    has_section = isinstance(extra, dict) and SECTION in extra
    saved = extra[SECTION] if has_section else {}
    if not isinstance(saved, dict):
        raise malformed(SECTION, "it is not an object", where)
    if rules is not None:
        saved = _renamed(saved, rules, strict, report, where)
    live = _stateful_layers(index)
    live_keys = {key for key, _, _ in live}
    # A file without a module's buffers (written before they were saved, or with
    # model_state other than "all") restores: they are left fresh, each one listed.
    missing = [key for key, _, kind in live if key not in saved and kind != BUFFERS]
    unexpected = sorted(set(saved) - live_keys)
    if strict and (missing or unexpected):
        why = (
            "the file was written before layer state was saved, or is a stock Keras file"
            if not has_section
            else "the model differs from the one saved"
        )
        raise BindingError(
            f"{where} holds no saved vocabulary or bin boundaries for layers {listed(missing)} of the model"
            + (
                f", and holds them for layers {listed(unexpected)} the model does not have"
                if unexpected
                else ""
            )
            + f" ({why}). Restored variables would meet another vocabulary (tokens mapped to other "
            "embedding rows). Restore into the model that saved the file, or pass strict=False to keep "
            "the live layer state (listed in report.left_fresh).",
            key=(missing or unexpected)[0],
            expected=sorted(saved),
            received=sorted(live_keys),
        )
    steps = []
    for key, layer, kind in live:
        if key not in saved and kind == BUFFERS:
            report.left_fresh.extend(f"buffer:{key}/{n}" for n in torch_buffers(layer))
            continue
        if key not in saved:
            report.left_fresh.append(f"layer:{key}")
            continue
        if kind == BUFFERS:
            value = _check_saved(
                join_arrays(saved[key], getattr(record, "arrays", {}), where), layer, key, kind, where
            )
            steps += buffer_steps(value["buffers"], layer, key, strict=strict, report=report, where=where)
            continue
        value = _check_saved(
            join_arrays(saved[key], getattr(record, "arrays", {}), where), layer, key, kind, where
        )
        steps.append(
            _snapshot_step(
                _record(key),
                _lookup(layer) if kind == VOCABULARY else layer,
                lambda layer=layer, key=key, kind=kind, v=value: _set_state(layer, key, kind, v),
            )
        )
        report.restored_state.append(f"layer:{key}")
    for key in unexpected:
        report.drop(f"layer:{key}", "no such layer in the model")
    return steps


def finalize_steps(index: ModelIndex) -> list:
    """Steps that run ``finalize_state()`` on every layer that has it and owns
    variables, to run after the variables are assigned (Keras' loaders do the
    same: an adapted ``Normalization`` recomputes the mean and variance it uses).

    Args:
        index: The restore's `ModelIndex` of the model being restored (its layers from its walk).

    Returns:
        A list of steps (``name``, ``apply``, ``snapshot``).
    """
    steps = []
    for path, layer in index.layer_paths().values():
        finalize = getattr(layer, "finalize_state", None)
        if callable(finalize) and any(_keras_compat.layer_own_variables(layer)):
            steps.append(_snapshot_step(f"finalize_state:{layer_key(path)}", layer, finalize))
    return steps
