"""Schema checks of a record's JSON: metadata, contract, other state, RNG and mapper records.

Verify and restore refuse the same files: a record whose fields restore could
not use is refused here, when the file is opened, naming the record. See
``docs/concepts/file-format.md`` and ``docs/concepts/security.md``.

This module imports no Keras.
"""

from __future__ import annotations

from keras_stable_state.errors import listed
from keras_stable_state.format.codec import DTYPES
from keras_stable_state.format.probe import damaged
from keras_stable_state.format.record import JSON_MAX_DEPTH


def is_int(value) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_json_depth(value, where: str) -> None:
    """Refuse a JSON value nested deeper than `JSON_MAX_DEPTH`.

    Raises:
        CorruptCheckpointError: naming ``where``.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > JSON_MAX_DEPTH:
            raise damaged(where, f"a JSON record is nested deeper than {JSON_MAX_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _refs(value) -> list:
    """Every ``{"__array__": name}`` reference inside a JSON value."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if set(item) == {"__array__"}:
                found.append(item["__array__"])
                continue
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def check_key(where: str, section: str, key: str, parsed: dict | None = None) -> None:
    """Refuse a key that restore could not parse (verify and restore refuse the same files).
    ``parsed``: ``{text: VariableKey}`` of the variable keys parsed so far (a model key, the
    owner of a slot key), each text parsed once and kept there.

    Raises:
        MalformedKeyError: naming the key.
    """
    from keras_stable_state._identity import keys

    memo = None if parsed is None else keys.ParsedKeys(parsed)
    if section == "model":
        keys.parse_model_key(key, where, memo)
    elif section == "optimizer":
        keys.parse_optimizer_key(key, where, memo)


def check_schema(where: str, metadata, contract, extra, entries: list) -> None:
    """Field types of the metadata, the contract and the other-state record.

    Args:
        where: The file, as error messages name it.
        metadata, contract, extra: The records as read.
        entries: Every array of the file (`Entry`).

    Raises:
        CorruptCheckpointError: naming the record (``.key``) and the field.
    """
    m = metadata

    def bad(record, what):
        return damaged(where, f"record {record!r}: {what}", key=record)

    if not isinstance(m, dict):
        raise bad("metadata", f"is a {type(m).__name__}, not an object")
    for field in ("backend", "keras_version"):
        if not isinstance(m.get(field), str):
            raise bad("metadata", f"field {field!r} is {m.get(field)!r}, not text")
    if m.get("model_state", "all") not in ("all", "trainable", "none"):
        raise bad("metadata", f"model_state is {m.get('model_state')!r}")
    classes = m.get("optimizer_classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise bad("metadata", f"optimizer_classes is {classes!r}, not a list of names")
    if contract is not None:
        if not isinstance(contract, list):
            raise bad("contract", "is not a list")
        for item in contract:
            if not (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and isinstance(item[1], list)
                and all(is_int(n) and n >= 0 for n in item[1])
                and isinstance(item[2], str)
            ):
                raise bad("contract", f"entry {str(item)[:120]} is not [key, shape, dtype]")
    x = extra
    if not isinstance(x, dict):
        raise bad("extra", "is not an object")
    for field in ("callbacks", "providers"):
        if not isinstance(x.get(field, {}), dict):
            raise bad("extra", f"{field!r} is not an object")
    if not isinstance(x.get("schedule", {}), dict | None):
        raise bad("extra", "'schedule' is not an object")
    state = {e.key: e for e in entries if e.section == "state"}
    refs = _refs(x)
    for ref in refs:
        if not isinstance(ref, str) or ref not in state:
            raise bad("extra", f"refers to array {ref!r}, which the file does not hold")
    orphans = sorted(set(state) - set(refs))
    if orphans:
        raise bad(
            "extra",
            f"arrays {listed(orphans)} ({len(orphans):,}) of the other state are referred to by nothing",
        )
    if x.get("rng") is not None:
        _check_rng(x["rng"], state, bad)
    if "mappers" in x:
        _check_mappers(x["mappers"], entries, bad)


def _check_mappers(mappers, entries, bad):
    """``extra["mappers"]``: ``{key: {mapper: {class_name, config}, dtype, shape, params}}``
    for keys of the model and optimizer sections (see `keras_stable_state._core.mappers`)."""
    keys = {e.key for e in entries if e.section in ("model", "optimizer")}
    if not isinstance(mappers, dict):
        raise bad("extra", "'mappers' is not an object")
    for key, spec in mappers.items():
        mapper = spec.get("mapper") if isinstance(spec, dict) else None
        ok = (
            key in keys
            and set(spec) == {"mapper", "dtype", "shape", "params"}
            and isinstance(mapper, dict)
            and set(mapper) == {"class_name", "config"}
            and isinstance(mapper["class_name"], str)
            and isinstance(mapper["config"], dict)
            and spec["dtype"] in DTYPES
            and isinstance(spec["shape"], list)
            and all(is_int(n) and n >= 0 for n in spec["shape"])
            and isinstance(spec["params"], dict)
        )
        if not ok:
            raise bad("extra", f"mapper record for {key!r} is malformed: {str(spec)[:160]}")


def _check_rng(rng, state, bad):
    def array(value, name, dtype, shape=None):
        ref = value.get("__array__") if isinstance(value, dict) else None
        e = state.get(ref)
        if e is None or e.dtype != dtype or (shape is not None and e.shape != shape):
            raise bad(
                "extra",
                f"RNG record {name!r} is not a {dtype} array{'' if shape is None else f' of shape {shape}'}",
            )

    if not isinstance(rng, dict):
        raise bad("extra", "the RNG record is not an object")
    n, p = rng.get("numpy"), rng.get("python")
    if not (
        isinstance(n, dict)
        and n.get("name") == "MT19937"
        and is_int(n.get("pos"))
        and 0 <= n["pos"] <= 624
        and n.get("has_gauss") in (0, 1)
        and isinstance(n.get("cached"), float | int)
    ):
        raise bad("extra", "RNG record 'rng/numpy' is malformed")
    array(n.get("keys"), "rng/numpy/keys", "uint32", (624,))
    internal = p.get("internal") if isinstance(p, dict) else None
    if not (
        isinstance(p, dict)
        and is_int(p.get("version"))
        and isinstance(internal, list)
        and len(internal) == 625
        and all(is_int(v) and 0 <= v < 2**32 for v in internal)
        and internal[-1] <= 624
        and (p.get("gauss") is None or isinstance(p.get("gauss"), float))
    ):
        raise bad("extra", "RNG record 'rng/python' is malformed")
    if rng.get("keras_global_seed") is not None:
        ref = (
            rng["keras_global_seed"].get("__array__") if isinstance(rng["keras_global_seed"], dict) else None
        )
        if ref not in state:
            raise bad("extra", "RNG record 'rng/keras_global_seed' is not an array")
    if rng.get("torch") is not None:
        array(rng["torch"], "rng/torch", "uint8")
