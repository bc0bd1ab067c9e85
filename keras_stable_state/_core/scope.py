"""Key scopes: renaming saved keys (``prefix`` / ``rename``) and refusing a bind across
scopes (a state saved from a model now nested in the live one, or from a wrapper of it)."""

from __future__ import annotations

import dataclasses

from keras_stable_state._identity.keys import ParsedKeys, parse_model_key
from keras_stable_state.errors import BindingError, KeyFormatError
from keras_stable_state.format.record import BY_KEY


def renamed_record(record, rules, strict, report, where, keys: ParsedKeys):
    """``record`` with every variable key renamed by the first rule that matches it.

    Model keys, the owners of slot keys and contract keys are renamed alike; a
    key no rule matches is refused (``strict``) or dropped. Keys are parsed through
    ``keys`` (the restore's, once per text).
    """
    if record.matched_by != BY_KEY:
        raise ValueError(
            f"`prefix` and `rename` rename the keys of a keras_stable_state file; {where} is a "
            f"{record.source}, matched by position and layer structure, with no keys to rename."
        )
    cache = {}

    def rename(key):
        if key not in cache:
            parse_model_key(key, where, keys)
            new = None
            for pattern, replacement in rules:
                if pattern.search(key):
                    new = pattern.sub(replacement, key, count=1)
                    try:
                        keys.parse(new)
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


def check_scope(record, registry, model, where):
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
