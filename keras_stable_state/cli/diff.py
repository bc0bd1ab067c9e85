"""What ``diff`` finds between two files, as dataclasses; no printing here.

`diff_files` pairs the arrays of two files (by key; between a stock
Keras file and a training state, by layer structure and position), compares
shapes, dtypes, contracts, writer metadata and other state, and reads each
paired array once to compute the largest absolute difference in float64.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keras_stable_state import format
from keras_stable_state._manager.records import RECORD as SAVE_RECORD
from keras_stable_state.cli.data import max_abs_difference, open_checkpoint
from keras_stable_state.cli.results import DamagedArray, describe, to_json
from keras_stable_state.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from keras_stable_state.format import Entry
    from keras_stable_state.format.layout import Layout

    _File = Layout
    _Paired = tuple[str, list[tuple[Entry, Entry]], list[Entry], list[Entry]]

__all__ = [
    "ABSENT",
    "ContractDiff",
    "DamagedArray",
    "Diff",
    "FileSummary",
    "Difference",
    "SectionDiff",
    "diff_files",
    "equal_within",
]


ABSENT = "<absent>"  # the value of a state path one file lacks (a metadata field it lacks: None)


@dataclasses.dataclass(frozen=True)
class FileSummary:
    """One side of a diff: ``file`` (path), ``kind``, ``container`` and ``describe`` (one line)."""

    file: str
    kind: str
    container: str
    describe: str


@dataclasses.dataclass(frozen=True)
class Difference:
    """A value that differs: ``what`` (a key, metadata field or state path), ``a`` and ``b``.

    In JSON, ``what`` is named ``key`` (shapes, dtypes), ``field`` (metadata) or
    ``path`` (other state); see `Diff.to_json`.
    """

    what: str
    a: object
    b: object


@dataclasses.dataclass(frozen=True)
class ContractDiff:
    """How two contracts differ.

    Attributes:
        only_in_a, only_in_b: Keys listed by one contract only.
        shape, dtype: `Difference` per key whose shape (list of ints) or dtype differs.
        size: ``(len(A's contract), len(B's contract))``.
    """

    only_in_a: list[str]
    only_in_b: list[str]
    shape: list[Difference]
    dtype: list[Difference]
    size: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class SectionDiff:
    """One section (``model``, ``optimizer``, ``state``) compared.

    Attributes:
        compared_by: How arrays were paired: ``"key"``, ``"layer structure"`` or ``"position"``.
        only_in_a, only_in_b: Keys without a partner.
        shape, dtype: `Difference` per pair (keyed by A's key) whose shape or dtype differs.
        shared: Number of pairs.
        max_abs_diff: ``{key in A: largest |A - B| (float, or None when not numeric and different)}``
            for each pair of equal shape whose arrays could be read.
        pairs: ``{key in A: key in B}`` when paired other than by key, else ``None``.
    """

    compared_by: str
    only_in_a: list[str]
    only_in_b: list[str]
    shape: list[Difference]
    dtype: list[Difference]
    shared: int
    max_abs_diff: dict[str, float | None]
    pairs: dict[str, str] | None


@dataclasses.dataclass(frozen=True)
class Diff:
    """What ``diff`` found.

    Attributes:
        a, b: `FileSummary` of the two files.
        notes: Sentences on how the files were compared.
        metadata: `Difference` per writer metadata field that differs (training states only).
        contract: `ContractDiff`, or ``None`` unless both files have a contract.
        sections: ``{section: SectionDiff}`` for the sections either file has.
        state: `Difference` per path of the other state that differs (random state excluded).
        damaged: `DamagedArray` per array that could not be read.
    """

    a: FileSummary
    b: FileSummary
    notes: list[str]
    metadata: list[Difference]
    contract: ContractDiff | None
    sections: dict[str, SectionDiff]
    state: list[Difference]
    damaged: list[DamagedArray]

    def differs(self, atol: float = 0.0) -> bool:
        """Whether the states differ: a key in one file only, a shape or dtype that differs, a
        contract or other state that differs, or an array whose largest ``|A - B|`` exceeds
        ``atol`` (a float >= 0; ``nan`` against a number, and non-numeric arrays that are not
        equal, always differ). The writer's metadata (backend, Keras version) and the record a
        ``CheckpointManager`` keeps of each save (``providers.checkpoint``: its step, wall time,
        metrics) are shown but not compared."""
        if any(not d.what.startswith(f"providers.{SAVE_RECORD}") for d in self.state):
            return True
        c = self.contract
        if c is not None and (c.only_in_a or c.only_in_b or c.shape or c.dtype):
            return True
        for r in self.sections.values():
            if r.only_in_a or r.only_in_b or r.shape or r.dtype:
                return True
            if any(not equal_within(v, atol) for v in r.max_abs_diff.values()):
                return True
        return False

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document: `to_json` of this
        dataclass, each `Difference`'s ``what`` named ``field`` (metadata), ``path``
        (other state) or ``key`` (contract and sections)."""
        doc: dict[str, Any] = to_json(self)

        def rename(items: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
            return [{name: d["what"], "a": d["a"], "b": d["b"]} for d in items]

        doc["metadata"] = rename(doc["metadata"], "field")
        doc["state"] = rename(doc["state"], "path")
        for part in [doc["contract"] or {}, *doc["sections"].values()]:
            for name in ("shape", "dtype"):
                if name in part:
                    part[name] = rename(part[name], "key")
        return doc


def equal_within(value: float | None, atol: float) -> bool:
    """Whether a largest difference ``value`` (a float, or ``None``: not numeric, different) is within ``atol``."""
    return value is not None and value == value and value <= atol


def _layer_groups(entries: list[Entry], stock: bool) -> dict[str | None, list[Entry]]:
    """``{layer path: [entries in variable order]}``; entries without one go under ``None``."""
    groups: dict[str | None, list[Entry]] = {}
    for e in entries:
        if stock:
            head, sep, index = e.key.rpartition("/vars/")
            layer = head if sep and index.isdigit() else None
        else:
            kind, _, path = e.key.partition(":")
            layer = path.rpartition("/")[0] if kind == "path" and "/" in path else None
        groups.setdefault(layer, []).append(e)
    return groups


def _match_layers(
    ours: list[Entry], theirs: list[Entry]
) -> tuple[list[tuple[Entry, Entry]], list[Entry], list[Entry]]:
    """Pair our model entries with a stock file's by layer structure.

    A layer of ours pairs with a stock layer of the same HDF5 path, else with
    the only stock layer whose variables have the same shapes and dtypes in
    order; variables then pair by their order inside the layer (Keras stores a
    layer's variables in that order). Returns ``(pairs, unmatched ours, unmatched theirs)``.
    """
    a, b = _layer_groups(ours, stock=False), _layer_groups(theirs, stock=True)
    unmatched_a, unmatched_b = a.pop(None, []), b.pop(None, [])

    def sig(group: list[Entry]) -> tuple[tuple[tuple[int, ...], str], ...]:
        return tuple((e.shape, e.dtype) for e in group)

    pairs: list[tuple[Entry, Entry]] = []
    for layer in [k for k in a if k in b]:
        if sig(a[layer]) == sig(b[layer]):
            pairs += list(zip(a.pop(layer), b.pop(layer), strict=True))
    by_sig_a: dict[tuple[tuple[tuple[int, ...], str], ...], list[str | None]] = {}
    by_sig_b: dict[tuple[tuple[tuple[int, ...], str], ...], list[str | None]] = {}
    for layer, group in a.items():
        by_sig_a.setdefault(sig(group), []).append(layer)
    for layer, group in b.items():
        by_sig_b.setdefault(sig(group), []).append(layer)
    for s, layers in by_sig_a.items():
        if len(layers) == 1 and len(by_sig_b.get(s, [])) == 1:
            pairs += list(zip(a.pop(layers[0]), b.pop(by_sig_b[s][0]), strict=True))
    unmatched_a += [e for group in a.values() for e in group]
    unmatched_b += [e for group in b.values() for e in group]
    return pairs, unmatched_a, unmatched_b


def _pair_sections(fa: _File, fb: _File) -> tuple[dict[str, _Paired], list[str]]:
    """``{section: (how, pairs, only in A, only in B)}`` and notes on how files were compared."""
    notes: list[str] = []
    out: dict[str, _Paired] = {}
    if fa.kind == fb.kind:
        for section in format.SECTIONS:
            ea, eb = fa.section(section), fb.section(section)
            if not ea and not eb:
                continue
            kb = {e.key: e for e in eb}
            ka = {e.key for e in ea}
            out[section] = (
                "key",
                [(e, kb[e.key]) for e in ea if e.key in kb],
                [e for e in ea if e.key not in kb],
                [e for e in eb if e.key not in ka],
            )
        return out, notes
    flip = fa.kind == "stock"
    ours, stock = (fb, fa) if flip else (fa, fb)
    notes.append(
        "Keys differ in kind: the stock Keras file addresses model weights by HDF5 path "
        "('layers/dense/vars/0') and optimizer variables by position; keras_stable_state files by "
        "stable key ('path:layers/dense/kernel'). Model weights are paired by layer structure "
        "(same layer path, else the only layer with the same variable shapes), optimizer variables by "
        "key where the stock file has StableOptimizer keys, else by position. Check the pairs listed."
    )

    def orient(
        how: str, pairs: list[tuple[Entry, Entry]], only_ours: list[Entry], only_stock: list[Entry]
    ) -> _Paired:
        if flip:
            return how, [(b, a) for a, b in pairs], only_stock, only_ours
        return how, pairs, only_ours, only_stock

    pairs, ua, ub = _match_layers(ours.section("model"), stock.section("model"))
    out["model"] = orient("layer structure", pairs, ua, ub)
    eo, es = ours.section("optimizer"), stock.section("optimizer")
    if stock.optimizer_keys:
        by_key = {stock.optimizer_keys.get(e.key): e for e in es}
        keys = {e.key for e in eo}
        out["optimizer"] = orient(
            "key",
            [(e, by_key[e.key]) for e in eo if e.key in by_key],
            [e for e in eo if e.key not in by_key],
            [e for e in es if stock.optimizer_keys.get(e.key) not in keys],
        )
    else:
        positional = [e for e in es if e.key.startswith("optimizer/vars/")]
        if len(positional) == len(eo):
            out["optimizer"] = orient("position", list(zip(eo, positional, strict=True)), [], [])
        else:
            notes.append(
                f"Optimizer variables not compared: {len(eo)} keyed in one file, {len(positional)} "
                "positional in the other; without keys only equal counts can be paired by position "
                "(another optimizer or another set of trainable variables)."
            )
            out["optimizer"] = orient("position", [], eo, es)
    if ours.section("state"):
        notes.append(
            "The other state of the keras_stable_state file (random state, callbacks, position) has no "
            "counterpart in a stock Keras file and is not compared."
        )
    return out, notes


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and set(value) != {"__array__"}:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and len(value) <= 16:
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: value}
    return {prefix: value}


def _differing(
    da: dict[str, Any], db: dict[str, Any], missing: object, skip: Callable[[str], bool] = lambda name: False
) -> list[Difference]:
    """`Difference` per name whose values differ, sorted; ``missing`` stands for an absent one."""
    names = sorted(set(da) | set(db))
    return [
        Difference(n, da.get(n, missing), db.get(n, missing))
        for n in names
        if not skip(n) and da.get(n, missing) != db.get(n, missing)
    ]


def _contract_diff(contract_a: list[list[Any]], contract_b: list[list[Any]]) -> ContractDiff:
    ca = {k: (list(s), d) for k, s, d in contract_a}
    cb = {k: (list(s), d) for k, s, d in contract_b}
    both = [k for k in ca if k in cb]
    return ContractDiff(
        only_in_a=[k for k in ca if k not in cb],
        only_in_b=[k for k in cb if k not in ca],
        shape=[Difference(k, ca[k][0], cb[k][0]) for k in both if ca[k][0] != cb[k][0]],
        dtype=[Difference(k, ca[k][1], cb[k][1]) for k in both if ca[k][1] != cb[k][1]],
        size=(len(ca), len(cb)),
    )


def _section_diff(
    fa: _File,
    fb: _File,
    how: str,
    pairs: list[tuple[Entry, Entry]],
    only_a: list[Entry],
    only_b: list[Entry],
    damaged: list[DamagedArray],
    progress: Callable[[int], object] | None,
) -> SectionDiff:
    shape: list[Difference] = []
    dtype: list[Difference] = []
    values: dict[str, float | None] = {}
    for ea, eb in pairs:
        if ea.shape != eb.shape:
            shape.append(Difference(ea.key, list(ea.shape), list(eb.shape)))
        if ea.dtype != eb.dtype:
            dtype.append(Difference(ea.key, ea.dtype, eb.dtype))
        if ea.shape == eb.shape:
            arrays = []
            for f, e in ((fa, ea), (fb, eb)):
                try:
                    arrays.append(f.read(e))
                except CorruptCheckpointError as err:
                    damaged.append(DamagedArray(f.path, e.key, str(err)))
            if len(arrays) == 2:
                values[ea.key] = max_abs_difference(*arrays)
        if progress is not None:
            progress(ea.nbytes + eb.nbytes)
    return SectionDiff(
        compared_by=how,
        only_in_a=[e.key for e in only_a],
        only_in_b=[e.key for e in only_b],
        shape=shape,
        dtype=dtype,
        shared=len(pairs),
        max_abs_diff=values,
        pairs=None if how == "key" else {ea.key: eb.key for ea, eb in pairs},
    )


def _summary(f: _File) -> FileSummary:
    return FileSummary(f.path, f.kind, f.container, describe(f.kind, f.container, f.metadata))


def diff_files(
    file_a: str | os.PathLike[str] | _File,
    file_b: str | os.PathLike[str] | _File,
    progress: Callable[[int], object] | None = None,
) -> Diff:
    """Compare two files: keys, shapes, dtypes, contracts, other state and values.

    Args:
        file_a, file_b: Paths, or `Layout` objects that
            `keras_stable_state.format.open_file` opened (left open).
        progress: Optional callable given the bytes of each pair of arrays compared
            (they add up to at most both files' ``total_bytes``).

    Returns:
        A `Diff`. Arrays that cannot be read are listed in ``damaged``, not raised.

    Raises:
        The errors of `open_checkpoint` for a path.
    """
    files: list[_File] = []
    opened: list[_File] = []
    try:
        for f in (file_a, file_b):
            if isinstance(f, str | bytes | os.PathLike):  # else a layout open_file opened
                f = open_checkpoint(f)
                opened.append(f)
            files.append(f)
        fa, fb = files
        return _diff(fa, fb, progress)
    finally:
        for f in opened:
            f.close()


def _diff(fa: _File, fb: _File, progress: Callable[[int], object] | None) -> Diff:
    sections, notes = _pair_sections(fa, fb)
    metadata: list[Difference] = []
    state: list[Difference] = []
    contract: ContractDiff | None = None
    damaged: list[DamagedArray] = []
    if fa.kind == fb.kind == format.FORMAT:
        metadata = _differing(fa.metadata, fb.metadata, None)
        state = _differing(
            _flatten(fa.extra), _flatten(fb.extra), ABSENT, skip=lambda p: p == "rng" or p.startswith("rng.")
        )
    if fa.contract is not None and fb.contract is not None:
        contract = _contract_diff(fa.contract, fb.contract)
    elif fa.contract is not None or fb.contract is not None:
        notes.append(
            f"Only {'A' if fa.contract is not None else 'B'} has a contract (stock Keras files carry none)."
        )
    results = {
        section: _section_diff(fa, fb, *paired, damaged, progress) for section, paired in sections.items()
    }
    return Diff(_summary(fa), _summary(fb), notes, metadata, contract, results, state, damaged)
