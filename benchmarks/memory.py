"""Extra peak memory of saving and restoring a training state, per byte of state.

Usage::

    KERAS_BACKEND=jax python benchmarks/memory.py [--sizes 120,1000] [--rounds 2] [--json out.json]

Each operation runs in a fresh process: it builds the 8 x Dense MLP with Adam
(``--size`` MB of weights and slots, float32), lets the garbage collector run,
reads its resident memory, resets the kernel's peak-RSS mark (``5`` written to
``/proc/self/clear_refs``, Linux), runs the one operation and reads the peak
(``VmHWM``). Printed: (peak - resident before) / state bytes, median with min and
max over rounds, operations interleaved across rounds. The files restored from
are written beforehand by another process, so no freed save buffer is reused.

Operations: ``save_training_state`` ``.h5`` / ``.keras``, ``restore_training_state``
``.h5`` / ``.keras`` (in place), stock ``save_weights`` / ``load_weights`` (the load twice:
an A/A row), and the floors: plain h5py datasets written from host arrays already made, and
h5py ``read_direct`` into preallocated arrays (run twice: the A/A rows).
With orbax-checkpoint installed, also a ``.orbax`` state restored in place (the package loaded
first) and Orbax's own restore + ``assign`` of the same arrays (`_common.OrbaxBaseline`), twice
(its A/A row); Orbax is imported before the mark for both. Each size in ``--sizes`` is
measured in turn, with its own files and sections.
Targets: save <= 0.1 (issue 10); restore <= 0.25 (issue 17, which relaxed issue 10's 0.1).

The same processes time their one operation (``time.perf_counter`` around it): the second
section gives, per round, each restore's seconds over stock ``load_weights``' of the same
round, each in a fresh process that has just built its model (the resume a user does after
a restart, the files in the page cache as a previous process left them), beside the A/A row
of stock against stock (issue 32's "in a fresh process" row); the ``.orbax`` restore's over
Orbax's restore + assign of the same round, beside that one's A/A row. The child imports
``keras_stable_state`` before Keras, so the package's names load on the operation's first use
of them, inside the timed call and the memory mark, as a script that imports the package first
pays them at its first save or restore; stock Keras' saving code is loaded with Keras, before
the mark. A ``_loaded`` operation is the same restore with the package loaded first, untimed
(as in a script that imports Keras first, or has used the package before its resume): the two
rows apart are the package's first load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 0.1
RESTORE_TARGET = 0.25  # issue 17
OPS = [
    "save_h5",
    "save_keras",
    "restore_h5",
    "restore_h5_loaded",
    "restore_keras",
    "restore_h5_in_place",
    "restore_h5_in_place_loaded",
    "restore_keras_in_place_loaded",
    "stock_save",
    "stock_load",
    "stock_load_again",
    "h5py_write",
    "read_direct",
    "read_direct_again",
]
# With orbax-checkpoint installed: a .orbax state restored in place, beside Orbax's own
# restore + assign of the same arrays (`_common.OrbaxBaseline`), twice (its A/A row).
ORBAX_OPS = ["restore_orbax_in_place_loaded", "orbax_restore", "orbax_restore_again"]
LABELS = {
    "save_h5": ("save_training_state .h5", TARGET),
    "save_keras": ("save_training_state .keras", TARGET),
    "restore_h5": ("restore_training_state .h5", RESTORE_TARGET),
    "restore_h5_loaded": ("the same, the package loaded before the mark", None),
    "restore_keras": ("restore_training_state .keras", RESTORE_TARGET),
    "restore_h5_in_place": ("restore_training_state .h5, all_or_nothing=False", None),
    "restore_h5_in_place_loaded": ("the same, the package loaded before the mark", None),
    "restore_keras_in_place_loaded": (
        "restore_training_state .keras, all_or_nothing=False, package loaded",
        None,
    ),
    "stock_save": ("stock save_weights", None),
    "stock_load": ("stock load_weights", None),
    "stock_load_again": ("A/A: stock load_weights in another process", None),
    "h5py_write": ("h5py datasets from host arrays (floor)", None),
    "read_direct": ("h5py read_direct into preallocated arrays (floor)", None),
    "read_direct_again": ("A/A: read_direct in another process", None),
    "restore_orbax_in_place_loaded": (
        "restore_training_state .orbax, all_or_nothing=False, package loaded",
        None,
    ),
    "orbax_restore": ("Orbax restore + assign", None),
    "orbax_restore_again": ("A/A: Orbax restore + assign in another process", None),
}


def _status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def child(op, size_mb, folder):
    """Run one operation in this (fresh) process; print a JSON line."""
    sys.path.insert(0, HERE)
    import _common as c

    c.configure_threads_env()
    import numpy as np

    import keras_stable_state as kss

    model = c.mlp_for_bytes(size_mb * 10**6)
    names = ("s.h5", "s.keras", "s.orbax", "own.orbax", "w.weights.h5", "raw.h5", "out.h5")
    p = {n: os.path.join(folder, n) for n in names}
    orbax = c.OrbaxBaseline(model) if "orbax" in op or (op == "prepare" and c.has_orbax()) else None
    if op == "prepare":
        kss.save_training_state(p["s.h5"], model)
        kss.save_training_state(p["s.keras"], model)
        model.save_weights(p["w.weights.h5"])
        c.h5py_write_datasets(p["raw.h5"], c.state_arrays(model))
        if orbax is not None:
            kss.save_training_state(p["s.orbax"], model)
            orbax.save(p["own.orbax"])
        return
    arrays = c.state_arrays(model) if op == "h5py_write" else None
    targets = [np.empty_like(a) for a in c.state_arrays(model)] if op.startswith("read_direct") else None
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.variables + model.optimizer.variables)
    if targets is not None:
        for t in targets:
            t.fill(0)  # touched: resident before the mark is reset
    run = {
        "save_h5": lambda: kss.save_training_state(p["out.h5"], model),
        "save_keras": lambda: kss.save_training_state(p["out.h5"][:-3] + ".keras", model),
        "restore_h5": lambda: kss.restore_training_state(p["s.h5"], model),
        "restore_h5_loaded": lambda: kss.restore_training_state(p["s.h5"], model),
        "restore_keras": lambda: kss.restore_training_state(p["s.keras"], model),
        "restore_h5_in_place": lambda: kss.restore_training_state(p["s.h5"], model, all_or_nothing=False),
        "restore_h5_in_place_loaded": lambda: kss.restore_training_state(
            p["s.h5"], model, all_or_nothing=False
        ),
        "restore_keras_in_place_loaded": lambda: kss.restore_training_state(
            p["s.keras"], model, all_or_nothing=False
        ),
        "stock_save": lambda: model.save_weights(p["out.h5"][:-3] + ".weights.h5"),
        "stock_load": lambda: model.load_weights(p["w.weights.h5"]),
        "stock_load_again": lambda: model.load_weights(p["w.weights.h5"]),
        "h5py_write": lambda: c.h5py_write_datasets(p["out.h5"], arrays),
        "read_direct": lambda: c.h5py_read_direct(p["raw.h5"], targets),
        "read_direct_again": lambda: c.h5py_read_direct(p["raw.h5"], targets),
        "restore_orbax_in_place_loaded": lambda: kss.restore_training_state(
            p["s.orbax"], model, all_or_nothing=False
        ),
        "orbax_restore": lambda: orbax.restore(p["own.orbax"]),
        "orbax_restore_again": lambda: orbax.restore(p["own.orbax"]),
    }[op]
    if op.endswith("_loaded"):
        kss.restore_training_state  # noqa: B018 - the package's first use (every module it loads), untimed
    if orbax is not None:  # Orbax loaded before the mark for both (OrbaxBaseline imported it)
        import keras_stable_state._engines.orbax  # noqa: F401
    gc.collect()
    before = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = _status()["VmHWM"]
    result = {"op": op, "extra": peak - before, "state": nbytes, "seconds": seconds}
    print("RESULT " + json.dumps(result), flush=True)


def spawn(op, size_mb, folder):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", op, "--size", str(size_mb), "--dir", folder],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{out.stderr[-3000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--size", "--sizes", default="120", help="state sizes in MB, comma separated (default 120)"
    )
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per operation (default 2)")
    p.add_argument(
        "--ops",
        default=None,
        help="operations, comma separated (default: all; the .orbax ones where orbax-checkpoint is installed)",
    )
    p.add_argument("--json", default=None, help="write the results here for benchmarks/report.py")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        child(args.child, int(args.size), args.dir)
        return 0
    sys.path.insert(0, HERE)
    import _common as c

    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    ops = [o for o in args.ops.split(",") if o] if args.ops else OPS + (ORBAX_OPS if c.has_orbax() else [])
    sections = []
    for size in [int(n) for n in args.size.split(",") if n]:
        sections += measure(size, args.rounds, ops, backend, c)
    c.dump_json(args.json, "memory", sections)
    return 0


def measure(size: int, rounds: int, ops: list, backend: str, c) -> list:
    """The memory section and the fresh-process time section of one state size."""
    print(f"memory: backend {backend}, {size} MB state, {rounds} rounds, ops {ops}", flush=True)
    folder = tempfile.mkdtemp(prefix="kss-bench-")
    got = {op: [] for op in ops}
    seconds = {op: [] for op in ops}
    try:
        spawn("prepare", size, folder)
        for r in range(rounds):
            order = ops[r % len(ops) :] + ops[: r % len(ops)]
            for op in order:
                res = spawn(op, size, folder)
                got[op].append(res["extra"] / res["state"])
                seconds[op].append(res["seconds"])
                print(
                    f"  round {r + 1}: {op:<18} +{res['extra'] / 1e6:8.1f} MB  {got[op][-1]:.3f}x  "
                    f"{res['seconds'] * 1e3:8.1f} ms",
                    flush=True,
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = [(LABELS[op][0], c.summary(got[op]), LABELS[op][1]) for op in ops]
    title = f"{size} MB state ({backend}): extra peak RSS / state bytes, fresh process per operation"
    c.print_rows(title, rows)
    sections = [{"title": title, "rows": rows}]
    timed = _fresh_process_times(seconds, c)
    if timed:
        timed_title = f"{size} MB state ({backend}): seconds / stock load_weights', a fresh process each"
        c.print_rows(timed_title, timed)
        sections.append({"title": timed_title, "rows": timed})
    return sections


def _fresh_process_times(seconds, c) -> list:
    """Rows: each restore's seconds over stock ``load_weights``' of the same round (issue 32:
    <= 1.0), beside the A/A row, and the ``.orbax`` one over Orbax's own restore + assign,
    beside its A/A row; empty unless both stock loads ran."""
    if not (seconds.get("stock_load") and seconds.get("stock_load_again")):
        return []
    band = c.summary(c.ratios(seconds, "stock_load_again", "stock_load"))
    rows = [
        (
            f"{LABELS[op][0].replace('_training_state', '')} / stock load_weights, fresh",
            c.summary(c.ratios(seconds, op, "stock_load")),
            1.0,
            band,
        )
        for op in (
            "restore_h5",
            "restore_h5_loaded",
            "restore_h5_in_place",
            "restore_h5_in_place_loaded",
            "restore_keras_in_place_loaded",
            "restore_keras",
        )
        if seconds.get(op)
    ]
    rows.append(("A/A stock load_weights / stock load_weights, fresh", band, None))
    if seconds.get("orbax_restore") and seconds.get("orbax_restore_again"):
        orbax_band = c.summary(c.ratios(seconds, "orbax_restore_again", "orbax_restore"))
        if seconds.get("restore_orbax_in_place_loaded"):
            rows.append(
                (
                    ".orbax in place, package loaded / Orbax restore + assign, fresh",
                    c.summary(c.ratios(seconds, "restore_orbax_in_place_loaded", "orbax_restore")),
                    1.0,
                    orbax_band,
                )
            )
        rows.append(("A/A Orbax restore + assign / Orbax restore + assign, fresh", orbax_band, None))
    return rows


if __name__ == "__main__":
    sys.exit(main())
