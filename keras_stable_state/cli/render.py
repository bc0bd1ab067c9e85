"""Text rendering of what the commands found (the dataclasses of `results`
and `diff`), through a `Printer`.

Nothing here reads a file: every value comes from the result passed in.
"""

from __future__ import annotations

from keras_stable_state.cli.output import Printer, human, number, shape
from keras_stable_state.cli.results import RECORD_KIND

__all__ = ["render_diff", "render_inspection", "render_listing", "render_verification"]

_SECTION_TITLES = {"model": "Model variables", "optimizer": "Optimizer variables", "state": "Other arrays"}
_RESTORE_HINT = "restore from an earlier checkpoint"
_MODEL_STATES = {"all": "every model variable", "trainable": "trainable variables only", "none": "none"}


def _short(value, arrays, limit=160) -> str:
    """A one-line rendering of a JSON state value (arrays summarized from ``{key: ArrayInfo}``)."""

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"__array__"}:
                e = arrays.get(v["__array__"])
                return f"<array {shape(e.shape)} {e.dtype}>" if e else "<array>"
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


def _schedule_text(sched) -> str | None:
    if not sched:
        return None
    config = {k: v for k, v in (sched.get("config") or {}).items() if k != "name"}
    return f"{sched.get('class_name', '?')}({_short(config, {}, limit=400)})"


def _problems(r, out: Printer):
    if r.problems:
        out.heading("Problems (run `verify` for a full check)")
        out.fields([(p.where, p.problem) for p in r.problems])


def _record(r, out: Printer):
    m = r.metadata
    out.line(f"{r.file}: {r.describe}", style="bold")
    model_state = m.get("model_state")
    out.fields(
        [
            ("format version", m.get("format_version")),
            ("writer backend", m.get("backend")),
            ("Keras version", m.get("keras_version")),
            ("dtype policy", m.get("dtype_policy")),
            ("model class", m.get("model_class")),
            (
                "model state",
                f"{model_state} ({_MODEL_STATES.get(model_state, '?')})" if model_state else None,
            ),
            (
                "arrays",
                f"{r.counts['model']} model, {r.counts['optimizer']} optimizer, "
                f"{r.counts['state']} other; {human(r.bytes)}",
            ),
        ]
    )
    rows = []
    for v in r.variables:
        slot_text = ", ".join(
            name if e.shape == tuple(v.shape) else f"{name} {shape(e.shape)}" for name, e in v.slots.items()
        )
        rows.append(
            [
                v.key,
                shape(v.shape),
                v.dtype,
                {True: "yes", False: "no", None: "?"}[v.trainable],
                slot_text or "-",
                human(v.bytes) if v.stored else "not stored",
                human(sum(e.bytes for e in v.slots.values())) if v.slots else "-",
            ]
        )
    out.table(
        f"Variables ({len(r.variables)}; optimizer slots grouped by variable key)",
        ["key", "shape", "dtype", "trainable", "slots", "bytes", "slot bytes"],
        rows,
        right=("bytes", "slot bytes"),
    )
    if r.optimizer_globals:
        out.table(
            f"Optimizer's own variables ({len(r.optimizer_globals)})",
            ["key", "shape", "dtype", "bytes"],
            [[e.key, shape(e.shape), e.dtype, human(e.bytes)] for e in r.optimizer_globals],
            right=("bytes",),
        )
    if r.contract is None:
        out.heading("Contract: none saved (the restore cannot check the trainable variables)")
    else:
        out.table(
            f"Contract ({len(r.contract)} trainable variables, checked on restore)",
            ["key", "shape", "dtype"],
            [[k, shape(s), d] for k, s, d in r.contract],
        )
    arrays = {e.key: e for e in r.arrays}
    out.heading("Other state")
    lr = next((e for e in r.optimizer_globals if e.key.endswith("#learning_rate")), None)
    pos = r.position
    constant = f"none (constant learning rate, stored as {lr.key})" if lr else "none (constant learning rate)"
    out.fields(
        [
            ("schedule", _schedule_text(r.schedule) or constant),
            (
                "position",
                f"epoch {pos.get('epoch')}, step {pos.get('step')} of the epoch, "
                f"global step {pos.get('global_step')}"
                if pos
                else "not saved (StableCheckpoint saves it)",
            ),
            ("callbacks", f"{len(r.callbacks)} saved" if r.callbacks else "none saved"),
            *((f"  {key}", _short(value, arrays)) for key, value in r.callbacks.items()),
            *(
                (f"provider {name}", _short(value, arrays))
                for name, value in r.providers.items()
                if name != "position"
            ),
            ("random state", "saved" if r.rng_saved else "not saved"),
        ]
    )
    if r.arrays:
        out.table(
            f"Arrays of the other state ({len(r.arrays)})",
            ["key", "shape", "dtype", "bytes"],
            [[e.key, shape(e.shape), e.dtype, human(e.bytes)] for e in r.arrays],
            right=("bytes",),
        )
    if r.archive_members:
        out.heading("Archive members (keras.saving.load_model loads the model from Keras' own members)")
        out.fields([(mem.name, human(mem.bytes)) for mem in r.archive_members])
    _problems(r, out)


def _stock(r, out: Printer):
    opt = r.optimizer
    out.line(f"{r.file}: {r.describe} (not written by keras_stable_state)", style="bold")
    out.fields(
        [
            ("model class", r.model_class),
            ("Keras version", (r.keras_metadata or {}).get("keras_version")),
            ("model weights", f"{len(r.model)} arrays, {human(sum(e.bytes for e in r.model))}"),
            ("optimizer", f"{opt.count} variables, {human(sum(e.bytes for e in opt.variables))}"),
        ]
    )
    out.table(
        f"Model weights ({len(r.model)}, by HDF5 path; no stable keys)",
        ["path", "shape", "dtype", "bytes"],
        [[e.path, shape(e.shape), e.dtype, human(e.bytes)] for e in r.model],
        right=("bytes",),
    )
    keyed = not opt.positional
    if opt.variables:
        columns = ["#", "path", "shape", "dtype", "bytes"] + (["entry key"] if keyed else [])
        out.table(
            f"Optimizer variables ({opt.count}, {'keyed by StableOptimizer' if keyed else 'positional'})",
            columns,
            [
                [str(v.index), v.path, shape(v.shape), v.dtype, human(v.bytes)]
                + ([v.entry_key or "-"] if keyed else [])
                for v in opt.variables
            ],
            right=("#", "bytes"),
        )
    out.line()
    out.line(r.note, style="yellow" if not keyed and opt.count else None)
    _problems(r, out)


def render_inspection(r, out: Printer | None = None):
    """Print a `RecordInspection` or `StockInspection` as tables."""
    out = out or Printer()
    (_record if r.kind == RECORD_KIND else _stock)(r, out)


def render_verification(v, out: Printer | None = None):
    """Print a `Verification`: one ``OK`` or ``DAMAGED`` line, and the damaged keys."""
    out = out or Printer()
    if v.error is not None:  # (the command line prints this one line on stderr)
        out.line(f"DAMAGED {v.file}: {v.error}", style="bold red")
        return
    if not v.ok:
        out.line(
            f"DAMAGED {v.file}: {len(v.damaged)} problem(s) in {v.arrays_checked} arrays. Do not restore "
            f"from this file; {_RESTORE_HINT}.",
            style="bold red",
        )
        out.table("Damaged", ["key", "reason"], [[d.key, d.reason] for d in v.damaged])
        return
    zipped = f" and {v.archive_members} archive members pass their zip CRC-32" if v.archive_members else ""
    if v.kind == RECORD_KIND:
        c = v.counts
        out.line(
            f"OK {v.file}: all {v.arrays_checked} arrays ({c['model']} model, {c['optimizer']} optimizer, "
            f"{c['state']} other) match their {v.checksum or 'xxh3-64'} checksums"
            f"{zipped}; {human(v.bytes)} read.",
            style="bold green",
        )
    else:
        out.line(
            f"OK {v.file}: all {v.arrays_checked} arrays of this stock Keras file can be read"
            f"{zipped}; {human(v.bytes)} read. Stock Keras files carry no per-array "
            "checksums, so changed values inside an array cannot be detected here.",
            style="bold green",
        )


def _contract(c, out: Printer):
    if not (c.only_in_a or c.only_in_b or c.shape or c.dtype):
        out.heading(f"Contract: identical ({c.size[0]} trainable variables)")
        return
    rows = [[k, "only in A", ""] for k in c.only_in_a]
    rows += [[k, "only in B", ""] for k in c.only_in_b]
    rows += [[d.what, f"shape {shape(d.a)}", f"shape {shape(d.b)}"] for d in c.shape]
    rows += [[d.what, f"dtype {d.a}", f"dtype {d.b}"] for d in c.dtype]
    out.table(
        f"Contract differs ({c.size[0]} trainable variables in A, {c.size[1]} in B)", ["key", "A", "B"], rows
    )


def _section(name, r, out: Printer, show_all):
    title = _SECTION_TITLES[name]
    changed = {k: v for k, v in r.max_abs_diff.items() if v != 0}
    out.heading(
        f"{title}: {r.shared} in both (paired by {r.compared_by}), {len(changed)} with different "
        f"values, {len(r.only_in_a)} only in A, {len(r.only_in_b)} only in B"
    )
    if r.only_in_a:
        out.table(f"{title} only in A", ["key"], [[k] for k in r.only_in_a])
    if r.only_in_b:
        out.table(f"{title} only in B", ["key"], [[k] for k in r.only_in_b])
    if r.shape:
        rows = [[d.what, shape(d.a), shape(d.b)] for d in r.shape]
        out.table(f"{title}: shapes differ (values not compared)", ["key", "A", "B"], rows)
    if r.dtype:
        rows = [[d.what, d.a, d.b] for d in r.dtype]
        out.table(f"{title}: dtypes differ (values compared in float64)", ["key", "A", "B"], rows)
    shown = r.max_abs_diff if show_all else changed
    if shown:
        pairs = r.pairs
        columns = ["key in A", "key in B", "max |A-B|"] if pairs else ["key", "max |A-B|"]
        rows = [
            ([k, pairs[k]] if pairs else [k]) + ["not numeric, differs" if v is None else number(v)]
            for k, v in shown.items()
        ]
        same = len(r.max_abs_diff) - len(changed)
        note = "" if show_all or not same else f"; {same} more identical (--all lists them)"
        out.table(f"{title}: largest absolute difference per key{note}", columns, rows, right=("max |A-B|",))


def render_diff(d, out: Printer | None = None, show_all=False, atol=0.0):
    """Print a `Diff`, ending with whether the states
    differ (``atol``: see `differs`); ``show_all``
    lists identical arrays too."""
    out = out or Printer()
    _diff_body(d, out, show_all)
    within = f" within --atol {atol:g}" if atol else ""
    out.line()
    if d.differs(atol):
        out.line(f"DIFFERENT: the states differ{within}.", style="bold yellow")
    else:
        out.line(f"EQUAL: the states are the same{within}.", style="bold green")


def _diff_body(d, out: Printer, show_all):
    out.fields([("A", f"{d.a.file}  {d.a.describe}"), ("B", f"{d.b.file}  {d.b.describe}")])
    for note in d.notes:
        out.line()
        out.line(note, style="yellow")
    both_records = d.a.kind == d.b.kind == RECORD_KIND
    if both_records:
        if d.metadata:
            rows = [[m.what, m.a, m.b] for m in d.metadata]
            out.table("Writer metadata differs", ["field", "A", "B"], rows)
        else:
            out.heading("Writer metadata: identical")
    if d.contract is not None:
        _contract(d.contract, out)
    for name, r in d.sections.items():
        _section(name, r, out, show_all)
    if d.state:
        out.table(
            "Other state differs (schedule, callbacks, position, providers)",
            ["path", "A", "B"],
            [[s.what, _short(s.a, {}, 60), _short(s.b, {}, 60)] for s in d.state],
        )
    elif both_records:
        out.heading("Other state (schedule, callbacks, position, providers): identical")
    if d.damaged:
        out.table(
            "Damaged arrays (not compared; run `verify`)",
            ["file", "key", "reason"],
            [[x.file, x.key, x.reason] for x in d.damaged],
        )


_STATUS_TEXT = {
    "ok": "OK",
    "damaged": "damaged",
    "unreadable": "unreadable",
    "misnamed": "misnamed",
    "newer_format": "newer format",
    "in_use": "in use",
    "incomplete": "incomplete",
}


def _when(seconds):
    if seconds is None:
        return "-"
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def render_listing(listing, out: Printer | None = None):
    """Print a `Listing`: one row per checkpoint, newest
    first, then which one ``fit`` resumes from and the best."""
    out = out or Printer()
    names = sorted({name for r in listing.checkpoints for name in r.metrics})
    rows = []
    for r in listing.checkpoints:
        marks = ", ".join(m for m, on in (("resume", r.resume), ("best", r.best)) if on)
        rows.append(
            [
                "-" if r.step is None else str(r.step),
                "-" if r.epoch is None else str(r.epoch),
                "-" if r.size_bytes is None else human(r.size_bytes),
                _STATUS_TEXT.get(r.status, r.status),
                *(number(r.metrics[n]) if n in r.metrics else "-" for n in names),
                _when(r.wall_time),
                marks or "-",
                r.file if r.status == "ok" else f"{r.file}: {r.reason}",
            ]
        )
    out.table(
        f"{listing.directory}: {sum(r.step is not None for r in listing.checkpoints)} checkpoint(s), newest first",
        ["step", "epoch", "size", "status", *names, "saved", "", "file"],
        rows,
        right=("step", "epoch", "size", *names),
    )
    out.line()
    out.line(listing.resume, style="bold")
    if listing.monitor is not None:
        best = "none" if listing.best_step is None else f"step {listing.best_step}"
        out.line(f"best by {listing.monitor} ({listing.mode}): {best}")
    for note in listing.notes:
        out.line(note, style="yellow")
