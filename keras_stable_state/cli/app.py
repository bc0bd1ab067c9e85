"""The ``keras-stable-state`` command line: ``inspect``, ``verify`` and ``diff`` checkpoints.

Also run as ``python -m keras_stable_state``. It reads training-state files
written by :func:`keras_stable_state.save_training_state` (``.keras`` archives
and ``.h5`` files) and stock Keras ``.keras`` / ``.weights.h5`` files. Arrays
are read one at a time, on demand: ``inspect`` reads none, ``verify`` and
``diff`` read each once.

Output is a rich table view on a terminal and plain, aligned text without
escape codes when piped; ``--json`` prints one JSON document instead.
Progress bars appear on stderr for large files, and only on a terminal.

Exit codes:

* ``0``: done (``verify``: every array is intact).
* ``1``: ``verify`` found damage: an array fails its checksum or cannot be
  read, an archive member fails its zip CRC, or the file is truncated.
* ``2``: usage error, missing file, or (``inspect``, ``diff``) a file that
  cannot be read.

Nothing here imports Keras or reads the format itself: files are opened with
:func:`keras_stable_state.format.storage.open_file` (``CheckpointFile`` and ``Entry``
are re-exported from there); this module only presents what it reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np

from keras_stable_state import format as storage
from keras_stable_state._identity.keys import GLOBAL, split_entry_key
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError
from keras_stable_state.format import CheckpointFile, Entry

__all__ = [
    "CheckpointFile",
    "Entry",
    "build_parser",
    "diff_files",
    "main",
    "max_abs_difference",
    "verify_file",
]

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_ERROR = 2

PROG = "keras-stable-state"
GLOBAL_OWNER = GLOBAL  # optimizer entry keys "optimizer#<name>" (see keys.py)
PROGRESS_MIN_BYTES = 32 * 2**20  # show a progress bar from this many array bytes on
_SECTION_TITLES = {"model": "Model variables", "optimizer": "Optimizer variables", "state": "Other arrays"}
_RESTORE_HINT = "restore from an earlier checkpoint"


class CliError(Exception):
    """A refusal of the command line: printed on stderr, returned as ``exit_code``.

    Attributes:
        exit_code: The process exit status to return.
    """

    def __init__(self, message, exit_code=EXIT_ERROR):
        super().__init__(message)
        self.exit_code = exit_code


# -- opening ------------------------------------------------------------------------------
def _open(path) -> CheckpointFile:
    """:func:`storage.open_file`, refusing a missing path or a folder as a usage error (exit code 2)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file. Check the path.")
    if os.path.isdir(path):
        raise CliError(
            f"{path} is a folder. Pass one .keras or .h5 file (StableCheckpoint keeps "
            "ckpt-<step>.h5 files in its folder)."
        )
    return storage.open_file(path)


def _describe(f: CheckpointFile) -> str:
    """One line: what the file is and who wrote it."""
    if f.kind == storage.FORMAT:
        m = f.metadata
        return (
            f"keras_stable_state training state ({f.container}), written by "
            f"{m.get('backend', '?')} / Keras {m.get('keras_version', '?')}"
        )
    version = f.metadata.get("keras_version")
    return f"stock Keras {f.container}" + (f", Keras {version}" if version else "")


# -- output -------------------------------------------------------------------------------
def _safe(text) -> str:
    """``text`` with control and other unprintable characters escaped (``\\x1b``, ``\\n``), so
    that a key read from a file cannot move the cursor, recolour or rewrite the terminal."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover


def _shape(shape) -> str:
    return str(tuple(shape))


def _number(value) -> str:
    if isinstance(value, str):
        return value
    return "0" if value == 0 else f"{value:.6g}"


class _Printer:
    """Rich tables on a terminal, plain aligned text (no escape codes) elsewhere."""

    def __init__(self, stream=None):
        self.stream = sys.stdout if stream is None else stream
        self.rich = _isatty(self.stream)
        self.console = None
        if self.rich:
            from rich.console import Console

            self.console = Console(file=self.stream, highlight=False)

    def line(self, text="", style=None):
        if self.rich:
            from rich.text import Text

            self.console.print(Text(_safe(text), style=style or ""))
        else:
            print(_safe(text), file=self.stream)

    def heading(self, text):
        self.line()
        self.line(text, style="bold")

    def fields(self, pairs):
        pairs = [(k, v) for k, v in pairs if v is not None]
        width = max((len(k) for k, _ in pairs), default=0)
        if self.rich:
            from rich.table import Table
            from rich.text import Text

            table = Table.grid(padding=(0, 2))
            table.add_column(style="bold")
            table.add_column()
            for k, v in pairs:
                table.add_row(Text(_safe(k)), Text(_safe(v)))
            self.console.print(table)
        else:
            for k, v in pairs:
                print(f"  {_safe(k).ljust(width)}  {_safe(v)}", file=self.stream)

    def table(self, title, columns, rows, right=()):
        """``columns``: header names; ``rows``: lists of cells; ``right``: right-aligned columns."""
        rows = [[_safe(c) for c in row] for row in rows]
        if self.rich:
            from rich import box
            from rich.table import Table
            from rich.text import Text

            self.console.print()
            table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
            for name in columns:
                table.add_column(name, justify="right" if name in right else "left", overflow="fold")
            for row in rows:
                table.add_row(*(Text(c) for c in row))
            self.console.print(table)
            return
        self.line()
        self.line(title)
        widths = [max([len(name)] + [len(r[i]) for r in rows]) for i, name in enumerate(columns)]

        def fmt(cells):
            out = [
                c.rjust(w) if name in right else c.ljust(w)
                for c, w, name in zip(cells, widths, columns, strict=True)
            ]
            return ("  " + "  ".join(out)).rstrip()

        self.line(fmt(list(columns)))
        for row in rows:
            self.line(fmt(row))


@contextlib.contextmanager
def _progress(total_bytes, label):
    """Yield ``advance(nbytes)``; shows a bar on stderr for large files on a terminal only."""
    if total_bytes < PROGRESS_MIN_BYTES or not _isatty(sys.stderr):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(label, total=total_bytes)
        yield lambda n: bar.advance(task, n)


def _to_json(value):
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def _print_json(doc):
    print(json.dumps(_to_json(doc), indent=2), file=sys.stdout)


# -- inspect ------------------------------------------------------------------------------
def _entry_json(e: Entry) -> dict:
    return {"key": e.key, "shape": list(e.shape), "dtype": e.dtype, "bytes": e.nbytes}


def _variables(f: CheckpointFile):
    """Group a record's arrays by variable: ``(variables, optimizer globals)``.

    ``variables`` is a list of dicts ``{key, shape, dtype, entry, slots: {slot: Entry}, trainable}``.
    """
    contract = {k: (tuple(s), d) for k, s, d in (f.contract or [])}
    rows = {}
    for e in f.section("model"):
        rows[e.key] = {"key": e.key, "entry": e, "slots": {}}
    globals_ = []
    for e in f.section("optimizer"):
        owner, slot = split_entry_key(e.key)
        if not owner or owner == GLOBAL_OWNER or owner.startswith(f"{GLOBAL_OWNER}/"):
            globals_.append(e)
            continue
        rows.setdefault(owner, {"key": owner, "entry": None, "slots": {}})["slots"][slot] = e
    for row in rows.values():
        entry, slots = row["entry"], list(row["slots"].values())
        if entry is not None:
            row["shape"], row["dtype"] = entry.shape, entry.dtype
        elif row["key"] in contract:
            row["shape"], row["dtype"] = contract[row["key"]]
        else:
            row["shape"], row["dtype"] = slots[0].shape, slots[0].dtype
        row["trainable"] = None if f.contract is None else row["key"] in contract
    return list(rows.values()), globals_


def _short(value, arrays, limit=160) -> str:
    """A one-line rendering of a JSON state value (arrays summarized)."""

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"__array__"}:
                e = arrays.get(v["__array__"])
                return f"<array {_shape(e.shape)} {e.dtype}>" if e else "<array>"
            return "{" + ", ".join(f"{k}={walk(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            if len(v) > 6:
                return f"[{len(v)} items]"
            return "[" + ", ".join(walk(x) for x in v) + "]"
        if isinstance(v, float):
            return f"{v:.6g}"
        return repr(v) if isinstance(v, str) else str(v)

    text = walk(value)
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _schedule_text(extra) -> str | None:
    sched = (extra.get("schedule") or {}).get("schedule")
    if not sched:
        return None
    config = {k: v for k, v in (sched.get("config") or {}).items() if k != "name"}
    return f"{sched.get('class_name', '?')}({_short(config, {}, limit=400)})"


_POSITION_FIELDS = ("epoch", "step", "global_step")


def _position(extra) -> dict | None:
    pos = (extra.get("providers") or {}).get("position")
    if not isinstance(pos, dict):
        return None
    out = {k: pos[k] for k in _POSITION_FIELDS if k in pos}
    if "epoch_rng" in pos:
        out["epoch_rng_saved"] = pos["epoch_rng"] is not None
    return out


def _record_json(f: CheckpointFile) -> dict:
    variables, globals_ = _variables(f)
    arrays = {e.key: e for e in f.section("state")}
    providers = {
        name: (_position(f.extra) if name == "position" else value)
        for name, value in (f.extra.get("providers") or {}).items()
    }
    return {
        "file": f.path,
        "kind": f.kind,
        "container": f.container,
        "format_version": int(f.metadata.get("format_version", storage.FORMAT_VERSION)),
        "metadata": f.metadata,
        "counts": {s: len(f.section(s)) for s in storage.SECTIONS},
        "bytes": f.total_bytes,
        "variables": [
            {
                "key": row["key"],
                "shape": list(row["shape"]),
                "dtype": row["dtype"],
                "stored": row["entry"] is not None,
                "bytes": row["entry"].nbytes if row["entry"] else 0,
                "trainable": row["trainable"],
                "slots": {name: _entry_json(e) for name, e in row["slots"].items()},
            }
            for row in variables
        ],
        "optimizer_globals": [_entry_json(e) for e in globals_],
        "contract": f.contract,
        "schedule": (f.extra.get("schedule") or {}).get("schedule"),
        "callbacks": f.extra.get("callbacks") or {},
        "position": _position(f.extra),
        "providers": providers,
        "rng_saved": f.extra.get("rng") is not None,
        "arrays": [_entry_json(e) for e in arrays.values()],
        "archive_members": [{"name": n, "bytes": s} for n, s in f.members],
        "problems": [{"where": w, "problem": p} for w, p in f.problems],
    }


def _positional_note(f: CheckpointFile, count: int) -> str:
    if f.optimizer_keys:
        return (
            f"Optimizer state is KEYED: the optimizer was a StableOptimizer, which stored the entry key "
            f"of each of its {count} variables beside them; keras.saving.load_model and restore_training_state "
            "match them by key."
        )
    if not count:
        return "The file holds no optimizer state."
    return (
        f"Optimizer state is POSITIONAL: its {count} variables are stored as '0'..'{count - 1}' in "
        "optimizer.variables order, with no keys. Keras restores them by registration order and checks "
        "only their count, so a model whose trainable variables come out in another order gets slots "
        "silently swapped between same-shape variables. restore_training_state matches them by order "
        "with shape checks and reports each as matched 'by order'; save with "
        "keras_stable_state.save_training_state to store them by key."
    )


def _stock_json(f: CheckpointFile) -> dict:
    model, opt = f.section("model"), f.section("optimizer")
    return {
        "file": f.path,
        "kind": f.kind,
        "container": f.container,
        "keras_metadata": f.metadata or None,
        "model_class": f.model_class,
        "counts": {"model": len(model), "optimizer": len(opt)},
        "bytes": f.total_bytes,
        "model": [{**_entry_json(e), "path": e.key} for e in model],
        "optimizer": {
            "count": len(opt),
            "positional": not f.optimizer_keys,
            "variables": [
                {**_entry_json(e), "index": i, "path": e.key, "entry_key": f.optimizer_keys.get(e.key)}
                for i, e in enumerate(opt)
            ],
        },
        "note": _positional_note(f, len(opt)),
        "archive_members": [{"name": n, "bytes": s} for n, s in f.members],
        "problems": [{"where": w, "problem": p} for w, p in f.problems],
    }


def _inspect_record(f: CheckpointFile, out: _Printer):
    m = f.metadata
    variables, globals_ = _variables(f)
    state_arrays = f.section("state")
    out.line(f"{f.path}: {_describe(f)}", style="bold")
    model_state = m.get("model_state")
    states = {"all": "every model variable", "trainable": "trainable variables only", "none": "none"}
    out.fields(
        [
            ("format version", m.get("format_version")),
            ("writer backend", m.get("backend")),
            ("Keras version", m.get("keras_version")),
            ("dtype policy", m.get("dtype_policy")),
            ("model class", m.get("model_class")),
            ("model state", f"{model_state} ({states.get(model_state, '?')})" if model_state else None),
            (
                "arrays",
                f"{len(f.section('model'))} model, {len(f.section('optimizer'))} optimizer, "
                f"{len(state_arrays)} other; {_human(f.total_bytes)}",
            ),
        ]
    )
    rows = []
    for row in variables:
        slot_text = ", ".join(
            name if e.shape == tuple(row["shape"]) else f"{name} {_shape(e.shape)}"
            for name, e in row["slots"].items()
        )
        trainable = {True: "yes", False: "no", None: "?"}[row["trainable"]]
        rows.append(
            [
                row["key"],
                _shape(row["shape"]),
                row["dtype"],
                trainable,
                slot_text or "-",
                _human(row["entry"].nbytes) if row["entry"] else "not stored",
                _human(sum(e.nbytes for e in row["slots"].values())) if row["slots"] else "-",
            ]
        )
    out.table(
        f"Variables ({len(variables)}; optimizer slots grouped by variable key)",
        ["key", "shape", "dtype", "trainable", "slots", "bytes", "slot bytes"],
        rows,
        right=("bytes", "slot bytes"),
    )
    if globals_:
        out.table(
            f"Optimizer's own variables ({len(globals_)})",
            ["key", "shape", "dtype", "bytes"],
            [[e.key, _shape(e.shape), e.dtype, _human(e.nbytes)] for e in globals_],
            right=("bytes",),
        )
    if f.contract is None:
        out.heading("Contract: none saved (the restore cannot check the trainable variables)")
    else:
        out.table(
            f"Contract ({len(f.contract)} trainable variables, checked on restore)",
            ["key", "shape", "dtype"],
            [[k, _shape(s), d] for k, s, d in f.contract],
        )
    arrays = {e.key: e for e in state_arrays}
    out.heading("Other state")
    schedule = _schedule_text(f.extra)
    lr = next((e for e in globals_ if e.key.endswith("#learning_rate")), None)
    pos = _position(f.extra)
    callbacks = f.extra.get("callbacks") or {}
    providers = {k: v for k, v in (f.extra.get("providers") or {}).items() if k != "position"}
    out.fields(
        [
            (
                "schedule",
                schedule
                or (
                    f"none (constant learning rate, stored as {lr.key})"
                    if lr
                    else "none (constant learning rate)"
                ),
            ),
            (
                "position",
                f"epoch {pos.get('epoch')}, step {pos.get('step')} of the epoch, "
                f"global step {pos.get('global_step')}"
                if pos
                else "not saved (StableCheckpoint saves it)",
            ),
            ("callbacks", f"{len(callbacks)} saved" if callbacks else "none saved"),
            *((f"  {key}", _short(value, arrays)) for key, value in callbacks.items()),
            *((f"provider {name}", _short(value, arrays)) for name, value in providers.items()),
            ("random state", "saved" if f.extra.get("rng") is not None else "not saved"),
        ]
    )
    if state_arrays:
        out.table(
            f"Arrays of the other state ({len(state_arrays)})",
            ["key", "shape", "dtype", "bytes"],
            [[e.key, _shape(e.shape), e.dtype, _human(e.nbytes)] for e in state_arrays],
            right=("bytes",),
        )
    if f.members:
        out.heading("Archive members (keras.saving.load_model loads the model from Keras' own members)")
        out.fields([(name, _human(size)) for name, size in f.members])
    _print_problems(f, out)


def _inspect_stock(f: CheckpointFile, out: _Printer):
    model, opt = f.section("model"), f.section("optimizer")
    out.line(f"{f.path}: {_describe(f)} (not written by keras_stable_state)", style="bold")
    out.fields(
        [
            ("model class", f.model_class),
            ("Keras version", f.metadata.get("keras_version")),
            ("model weights", f"{len(model)} arrays, {_human(sum(e.nbytes for e in model))}"),
            ("optimizer", f"{len(opt)} variables, {_human(sum(e.nbytes for e in opt))}"),
        ]
    )
    out.table(
        f"Model weights ({len(model)}, by HDF5 path; no stable keys)",
        ["path", "shape", "dtype", "bytes"],
        [[e.key, _shape(e.shape), e.dtype, _human(e.nbytes)] for e in model],
        right=("bytes",),
    )
    if opt:
        title = "keyed by StableOptimizer" if f.optimizer_keys else "positional"
        columns = ["#", "path", "shape", "dtype", "bytes"] + (["entry key"] if f.optimizer_keys else [])
        out.table(
            f"Optimizer variables ({len(opt)}, {title})",
            columns,
            [
                [str(i), e.key, _shape(e.shape), e.dtype, _human(e.nbytes)]
                + ([f.optimizer_keys.get(e.key, "-")] if f.optimizer_keys else [])
                for i, e in enumerate(opt)
            ],
            right=("#", "bytes"),
        )
    out.line()
    out.line(_positional_note(f, len(opt)), style="yellow" if not f.optimizer_keys and opt else None)
    _print_problems(f, out)


def _print_problems(f: CheckpointFile, out: _Printer):
    items = list(f.problems) + [(m, f"zip CRC-32 fails ({r})") for m, r in f.damaged_members]
    if items:
        out.heading("Problems (run `verify` for a full check)")
        out.fields(items)


def _cmd_inspect(args) -> int:
    with _open(args.file) as f:
        if args.json:
            _print_json(_record_json(f) if f.kind == storage.FORMAT else _stock_json(f))
        elif f.kind == storage.FORMAT:
            _inspect_record(f, _Printer())
        else:
            _inspect_stock(f, _Printer())
    return EXIT_OK


# -- verify -------------------------------------------------------------------------------
def verify_file(f: CheckpointFile, progress=None) -> list:
    """Read every array of ``f`` (and every archive member) and check it.

    Args:
        f: An open :class:`CheckpointFile`.
        progress: Optional callable given the bytes read after each array.

    Returns:
        ``[(key or member, reason)]`` for everything damaged; empty when intact.
    """
    return f.check(progress)


def _cmd_verify(args) -> int:
    try:
        f = _open(args.file)
    except (CorruptCheckpointError, CheckpointFormatError) as err:
        # Opening runs the whole-file checks (seal, structure, records): the file is refused as a whole.
        damaged = [{"key": err.key if err.key is not None else os.fspath(args.file), "reason": str(err)}]
        if args.json:
            _print_json({"file": os.fspath(args.file), "ok": False, "damaged": damaged, "error": str(err)})
        else:
            _Printer().line(f"DAMAGED {os.fspath(args.file)}: {err}", style="bold red")
        print(f"{PROG} verify: DAMAGED: {_safe(str(err))}", file=sys.stderr)
        return EXIT_DAMAGED
    with f:
        members = sum(size for name, size in f.members if name != f.member)
        with _progress(f.total_bytes + members, f"verifying {os.path.basename(f.path)}") as advance:
            damaged = verify_file(f, advance)
        counts = {s: len(f.section(s)) for s in storage.SECTIONS}
        if args.json:
            _print_json(
                {
                    "file": f.path,
                    "kind": f.kind,
                    "ok": not damaged,
                    "arrays_checked": len(f.entries),
                    "checksums": f.kind == storage.FORMAT,
                    "bytes": f.total_bytes,
                    "damaged": [{"key": k, "reason": r} for k, r in damaged],
                }
            )
            return EXIT_DAMAGED if damaged else EXIT_OK
        out = _Printer()
        if damaged:
            out.line(
                f"DAMAGED {f.path}: {len(damaged)} problem(s) in {len(f.entries)} arrays. Do not restore "
                f"from this file; {_RESTORE_HINT}.",
                style="bold red",
            )
            out.table("Damaged", ["key", "reason"], damaged)
            return EXIT_DAMAGED
        zipped = f" and {len(f.members)} archive members pass their zip CRC-32" if f.members else ""
        if f.kind == storage.FORMAT:
            what = f"{counts['model']} model, {counts['optimizer']} optimizer, {counts['state']} other"
            out.line(
                f"OK {f.path}: all {len(f.entries)} arrays ({what}) match their "
                f"{f.entries[0].checksum if f.entries else 'xxh3-64'} checksums"
                f"{zipped}; {_human(f.total_bytes)} read.",
                style="bold green",
            )
        else:
            out.line(
                f"OK {f.path}: all {len(f.entries)} arrays of this stock Keras file can be read"
                f"{zipped}; {_human(f.total_bytes)} read. Stock Keras files carry no per-array "
                "checksums, so changed values inside an array cannot be detected here.",
                style="bold green",
            )
    return EXIT_OK


# -- diff ---------------------------------------------------------------------------------
def max_abs_difference(a, b):
    """Largest ``|a - b|`` over all elements, computed in float64 (``bfloat16`` via ml_dtypes).

    Equal values (also equal infinities, and NaN against NaN) count as 0.

    Returns:
        A float (``nan`` or ``inf`` where only one side is), or ``None`` for
        non-numeric arrays, which are compared for equality only (``0.0`` if equal).
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 0:
        return 0.0
    kind = "c" if np.iscomplexobj(a) or np.iscomplexobj(b) else "f"
    try:
        a64 = a.astype(np.complex128 if kind == "c" else np.float64)
        b64 = b.astype(np.complex128 if kind == "c" else np.float64)
    except (TypeError, ValueError):
        return 0.0 if np.array_equal(a, b) else None
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a64 - b64)
        same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    return float(np.max(np.where(same, 0.0, d)))


def _layer_groups(entries, stock):
    """``{layer path: [entries in variable order]}``; entries without one go under ``None``."""
    groups = {}
    for e in entries:
        if stock:
            head, sep, index = e.key.rpartition("/vars/")
            layer = head if sep and index.isdigit() else None
        else:
            kind, _, path = e.key.partition(":")
            layer = path.rpartition("/")[0] if kind == "path" and "/" in path else None
        groups.setdefault(layer, []).append(e)
    return groups


def _match_layers(ours, theirs):
    """Pair our model entries with a stock file's by layer structure.

    A layer of ours pairs with a stock layer of the same HDF5 path, else with
    the only stock layer whose variables have the same shapes and dtypes in
    order; variables then pair by their order inside the layer (Keras stores a
    layer's variables in that order). Returns ``(pairs, unmatched ours, unmatched theirs)``.
    """
    a, b = _layer_groups(ours, stock=False), _layer_groups(theirs, stock=True)
    unmatched_a, unmatched_b = a.pop(None, []), b.pop(None, [])

    def sig(group):
        return tuple((e.shape, e.dtype) for e in group)

    pairs = []
    for layer in [k for k in a if k in b]:
        if sig(a[layer]) == sig(b[layer]):
            pairs += list(zip(a.pop(layer), b.pop(layer), strict=True))
    by_sig_a, by_sig_b = {}, {}
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


def _pair_sections(fa: CheckpointFile, fb: CheckpointFile):
    """``{section: (how, pairs, only in A, only in B)}`` and notes on how files were compared."""
    notes, out = [], {}
    if fa.kind == fb.kind:
        for section in storage.SECTIONS:
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

    def orient(how, pairs, only_ours, only_stock):
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


def _flatten(value, prefix=""):
    if isinstance(value, dict) and set(value) != {"__array__"}:
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and len(value) <= 16:
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: value}
    return {prefix: value}


def diff_files(fa: CheckpointFile, fb: CheckpointFile, progress=None) -> dict:
    """Compare two files: keys, shapes, dtypes, contracts, other state and values.

    Returns:
        A JSON-ready dict: ``a``/``b`` (the files), ``notes``, ``metadata``
        (differing writer fields), ``contract`` (``None`` unless both files
        have one), ``sections`` (per section: ``compared_by``, ``only_in_a``,
        ``only_in_b``, ``shape``, ``dtype``, ``max_abs_diff`` ``{key in A: value}``,
        ``pairs`` ``{key in A: key in B}`` where keys differ), ``state``
        (differing paths of the other state) and ``damaged`` (arrays that could not be read).
    """
    sections, notes = _pair_sections(fa, fb)
    doc = {
        "a": {"file": fa.path, "kind": fa.kind, "container": fa.container, "describe": _describe(fa)},
        "b": {"file": fb.path, "kind": fb.kind, "container": fb.container, "describe": _describe(fb)},
        "notes": notes,
        "metadata": [],
        "contract": None,
        "sections": {},
        "state": [],
        "damaged": [],
    }
    if fa.kind == fb.kind == storage.FORMAT:
        for field in sorted(set(fa.metadata) | set(fb.metadata)):
            if fa.metadata.get(field) != fb.metadata.get(field):
                doc["metadata"].append(
                    {"field": field, "a": fa.metadata.get(field), "b": fb.metadata.get(field)}
                )
        sa, sb = _flatten(fa.extra), _flatten(fb.extra)
        for path in sorted(set(sa) | set(sb)):
            if path.startswith("rng.") or path == "rng":
                continue
            if sa.get(path, "<absent>") != sb.get(path, "<absent>"):
                doc["state"].append(
                    {"path": path, "a": sa.get(path, "<absent>"), "b": sb.get(path, "<absent>")}
                )
    if fa.contract is not None and fb.contract is not None:
        ca = {k: (list(s), d) for k, s, d in fa.contract}
        cb = {k: (list(s), d) for k, s, d in fb.contract}
        doc["contract"] = {
            "only_in_a": [k for k in ca if k not in cb],
            "only_in_b": [k for k in cb if k not in ca],
            "shape": [
                {"key": k, "a": ca[k][0], "b": cb[k][0]} for k in ca if k in cb and ca[k][0] != cb[k][0]
            ],
            "dtype": [
                {"key": k, "a": ca[k][1], "b": cb[k][1]} for k in ca if k in cb and ca[k][1] != cb[k][1]
            ],
            "size": [len(ca), len(cb)],
        }
    elif fa.contract is not None or fb.contract is not None:
        doc["notes"].append(
            f"Only {'A' if fa.contract is not None else 'B'} has a contract (stock Keras files carry none)."
        )
    for section, (how, pairs, only_a, only_b) in sections.items():
        result = {
            "compared_by": how,
            "only_in_a": [e.key for e in only_a],
            "only_in_b": [e.key for e in only_b],
            "shape": [],
            "dtype": [],
            "shared": len(pairs),
            "max_abs_diff": {},
        }
        if how != "key":
            result["pairs"] = {ea.key: eb.key for ea, eb in pairs}
        for ea, eb in pairs:
            if ea.shape != eb.shape:
                result["shape"].append({"key": ea.key, "a": list(ea.shape), "b": list(eb.shape)})
            if ea.dtype != eb.dtype:
                result["dtype"].append({"key": ea.key, "a": ea.dtype, "b": eb.dtype})
            if ea.shape == eb.shape:
                arrays = []
                for f, e in ((fa, ea), (fb, eb)):
                    try:
                        arrays.append(f.read(e))
                    except CorruptCheckpointError as err:
                        doc["damaged"].append({"file": f.path, "key": e.key, "reason": str(err)})
                if len(arrays) == 2:
                    result["max_abs_diff"][ea.key] = max_abs_difference(*arrays)
            if progress is not None:
                progress(ea.nbytes + eb.nbytes)
        doc["sections"][section] = result
    return doc


def _print_diff(doc, out: _Printer, show_all=False):
    out.fields(
        [
            ("A", f"{doc['a']['file']}  {doc['a']['describe']}"),
            ("B", f"{doc['b']['file']}  {doc['b']['describe']}"),
        ]
    )
    for note in doc["notes"]:
        out.line()
        out.line(note, style="yellow")
    if doc["a"]["kind"] == doc["b"]["kind"] == storage.FORMAT:
        if doc["metadata"]:
            out.table(
                "Writer metadata differs",
                ["field", "A", "B"],
                [[d["field"], d["a"], d["b"]] for d in doc["metadata"]],
            )
        else:
            out.heading("Writer metadata: identical")
    c = doc["contract"]
    if c is not None:
        if not (c["only_in_a"] or c["only_in_b"] or c["shape"] or c["dtype"]):
            out.heading(f"Contract: identical ({c['size'][0]} trainable variables)")
        else:
            rows = [[k, "only in A", ""] for k in c["only_in_a"]]
            rows += [[k, "only in B", ""] for k in c["only_in_b"]]
            rows += [[d["key"], f"shape {_shape(d['a'])}", f"shape {_shape(d['b'])}"] for d in c["shape"]]
            rows += [[d["key"], f"dtype {d['a']}", f"dtype {d['b']}"] for d in c["dtype"]]
            out.table(
                f"Contract differs ({c['size'][0]} trainable variables in A, {c['size'][1]} in B)",
                ["key", "A", "B"],
                rows,
            )
    for section, r in doc["sections"].items():
        title = _SECTION_TITLES[section]
        changed = {k: v for k, v in r["max_abs_diff"].items() if v != 0}
        out.heading(
            f"{title}: {r['shared']} in both (paired by {r['compared_by']}), {len(changed)} with different "
            f"values, {len(r['only_in_a'])} only in A, {len(r['only_in_b'])} only in B"
        )
        if r["only_in_a"]:
            out.table(f"{title} only in A", ["key"], [[k] for k in r["only_in_a"]])
        if r["only_in_b"]:
            out.table(f"{title} only in B", ["key"], [[k] for k in r["only_in_b"]])
        diffs = [[d["key"], _shape(d["a"]), _shape(d["b"])] for d in r["shape"]]
        if diffs:
            out.table(f"{title}: shapes differ (values not compared)", ["key", "A", "B"], diffs)
        if r["dtype"]:
            out.table(
                f"{title}: dtypes differ (values compared in float64)",
                ["key", "A", "B"],
                [[d["key"], d["a"], d["b"]] for d in r["dtype"]],
            )
        shown = r["max_abs_diff"] if show_all else changed
        if shown:
            pairs = r.get("pairs")
            columns = ["key in A", "key in B", "max |A-B|"] if pairs else ["key", "max |A-B|"]
            rows = [
                ([k, pairs[k]] if pairs else [k]) + ["not numeric, differs" if v is None else _number(v)]
                for k, v in shown.items()
            ]
            same = len(r["max_abs_diff"]) - len(changed)
            note = "" if show_all or not same else f"; {same} more identical (--all lists them)"
            out.table(
                f"{title}: largest absolute difference per key{note}", columns, rows, right=("max |A-B|",)
            )
    if doc["state"]:
        out.table(
            "Other state differs (schedule, callbacks, position, providers)",
            ["path", "A", "B"],
            [[d["path"], _short(d["a"], {}, 60), _short(d["b"], {}, 60)] for d in doc["state"]],
        )
    elif doc["a"]["kind"] == doc["b"]["kind"] == storage.FORMAT:
        out.heading("Other state (schedule, callbacks, position, providers): identical")
    if doc["damaged"]:
        out.table(
            "Damaged arrays (not compared; run `verify`)",
            ["file", "key", "reason"],
            [[d["file"], d["key"], d["reason"]] for d in doc["damaged"]],
        )


def _cmd_diff(args) -> int:
    files = []
    try:
        for path in (args.file_a, args.file_b):
            files.append(_open(path))
        fa, fb = files
        with _progress(fa.total_bytes + fb.total_bytes, "comparing") as advance:
            doc = diff_files(fa, fb, advance)
    finally:
        for f in files:
            f.close()
    if args.json:
        _print_json(doc)
    else:
        _print_diff(doc, _Printer(), show_all=args.all)
    return EXIT_ERROR if doc["damaged"] else EXIT_OK


# -- entry point --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``argparse`` parser of the ``keras-stable-state`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Inspect, verify and compare training-state files written by keras_stable_state "
            "(.keras, .h5) and stock Keras .keras / .weights.h5 files."
        ),
        epilog=(
            "Exit codes: 0 done (verify: intact); 1 verify found damage; 2 usage error, missing "
            "file, or a file inspect/diff cannot read."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "inspect",
        help="show what a file holds: writer, keys, shapes, slots, contract, other state",
        description="Show what a file holds without reading its array data.",
    )
    p.add_argument("file", metavar="FILE", help=".keras or .h5 file")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_inspect)
    p = sub.add_parser(
        "verify",
        help="read every array and check its checksum; exit 1 naming damaged keys",
        description="Read every array and check its checksum (stock Keras files: that it can be read).",
    )
    p.add_argument("file", metavar="FILE", help=".keras or .h5 file")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_verify)
    p = sub.add_parser(
        "diff",
        help="compare two files: keys, shapes, dtypes, contract, largest difference per key",
        description="Compare two files key by key; values are compared in float64.",
    )
    p.add_argument("file_a", metavar="FILE_A", help=".keras or .h5 file")
    p.add_argument("file_b", metavar="FILE_B", help=".keras or .h5 file")
    p.add_argument("--all", action="store_true", help="list identical arrays too (text output)")
    p.add_argument("--json", action="store_true", help="print one JSON document (always every key)")
    p.set_defaults(run=_cmd_diff)
    return parser


def main(argv=None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit code (see the module docstring); the console script exits with it.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else EXIT_ERROR
    try:
        return args.run(args)
    except CliError as err:
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:
        # The reader went away (`| head`); say nothing more.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (StateError, OSError) as err:
        print(f"{PROG} {args.command}: error: {_safe(err)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as err:  # noqa: BLE001 (the command line never prints a traceback)
        print(
            f"{PROG} {args.command}: internal error: {type(err).__name__}: {_safe(err)}. Please report it "
            "with the file that caused it.",
            file=sys.stderr,
        )
        return EXIT_ERROR
