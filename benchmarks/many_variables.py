"""Per-variable cost of ``save_training_state`` / ``restore_training_state`` for many small variables.

Usage::

    KERAS_BACKEND=jax python benchmarks/many_variables.py [--counts 1000,10000] [--rounds 3] [--threads 1]
        [--phases save,restore] [--profile restore.prof] [--json out.json]

A subclassed model holds ``n / 6`` ``Dense(4)`` layers (kernel 4x4, bias 4) in a
list, compiled with Adam and its optimizer built: about ``n`` small arrays in
all (weights and two Adam slots each). ``--counts 1000,10000,100000`` is the
full run. In one process, round by round in a rotating order:

* save: ``save_training_state(".h5")`` against plain h5py writing one dataset
  per array of the same shapes, then ``fsync`` (timed twice: A/A);
* restore: ``restore_training_state(".h5")`` (all or nothing, and with
  ``all_or_nothing=False``: no rollback copy) into the same model against h5py
  ``read_direct`` of the same datasets into preallocated arrays (twice: A/A), and
  against Keras' own ``variable.assign(host array)`` of every variable (what
  ``load_weights`` does per variable once it has read the arrays; the floor of any
  restore that goes through Keras' variables, printed in seconds too).

Printed: ratios per round (median, min, max), each round's A/A ratio, and
microseconds per array; a ratio whose median lies inside the A/A band of its
phase is marked ``~ (within A/A noise)``. ``--phases restore`` times the restore
only (the state is saved once, untimed); ``--profile FILE`` runs one more restore
under ``cProfile`` (largest count), writes its stats to ``FILE`` (``pstats``,
``snakeviz``) and prints the 25 costliest functions. Every contender runs with the same
threads (``--threads``, printed in the header).
Targets (issues 10, 17): <= 1.5x one raw h5py dataset per variable, growth
linear, restore of 100k variables < 5 s on every backend.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as c  # noqa: E402

c.configure_threads_env(c.threads_from_argv())

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402

TARGET = 1.5
RESTORE_SECONDS_100K = 5.0  # issue 17: the restore of 100k variables, in seconds


class ManyDense(keras.Model):
    """``k`` parallel ``Dense(4)`` layers summed (no deep chain: Keras recurses per layer)."""

    def __init__(self, k, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [keras.layers.Dense(4, name=f"d{i}") for i in range(k)]

    def call(self, x):
        out = x
        for block in self.blocks:
            out = out + block(x)
        return out


def build(n):
    keras.utils.set_random_seed(0)
    model = ManyDense(max(1, n // 6))
    model(np.zeros((1, 4), "float32"))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="1000,10000", help="array counts (full: 1000,10000,100000)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per count (default 3)")
    p.add_argument("--phases", default="save,restore", help="what to time: save, restore or both")
    p.add_argument("--profile", default=None, help="cProfile one more restore; its stats to this file")
    p.add_argument("--json", default=None, help="write the results here for benchmarks/report.py")
    c.add_threads_arg(p)
    return p.parse_args(argv)


def bench(n, rounds, folder, phases, profile=None):
    model = build(n)
    arrays = c.state_arrays(model)
    targets = [np.empty_like(a) for a in arrays]
    h5raw, h5raw2, ours = (os.path.join(folder, f) for f in ("raw.h5", "raw2.h5", "s.h5"))
    save_ops = {
        "raw": lambda: c.h5py_write_datasets(h5raw, arrays),
        "raw2": lambda: c.h5py_write_datasets(h5raw2, arrays),
        "h5": lambda: kss.save_training_state(ours, model),
    }
    for op in save_ops.values():
        op()
    rows, parts = [], []
    if "save" in phases:
        print(f"\n== {len(arrays)} arrays, save", flush=True)
        st = c.run_rounds(save_ops, rounds, log=c.round_logger("raw2", "raw", unit="s"))
        per = {k: c.summary(v)[0] / len(arrays) * 1e6 for k, v in st.items()}
        parts.append(f"per array, save {per['h5']:.0f} us vs raw h5py {per['raw']:.0f} us")
        band = c.summary(c.ratios(st, "raw2", "raw"))
        rows += [
            (
                "save_training_state .h5 / h5py datasets+fsync",
                c.summary(c.ratios(st, "h5", "raw")),
                TARGET,
                band,
            ),
            ("A/A h5py write / h5py write", band, None),
        ]
    if "restore" in phases:
        variables = model.variables + model.optimizer.variables
        # copies (assign may keep them), of each variable's shape (np.ascontiguousarray makes a scalar 1-d)
        values = [np.array(a).reshape(tuple(v.shape)) for a, v in zip(arrays, variables, strict=True)]

        def keras_assign():
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)

        restore_ops = {
            "rd": lambda: c.h5py_read_direct(h5raw, targets),
            "rd2": lambda: c.h5py_read_direct(h5raw, targets),
            "h5": lambda: kss.restore_training_state(ours, model),
            "h5_in_place": lambda: kss.restore_training_state(ours, model, all_or_nothing=False),
            "ka": keras_assign,
        }
        restore_ops["h5"]()
        print(f"== {len(arrays)} arrays, restore", flush=True)
        rt = c.run_rounds(restore_ops, rounds, log=c.round_logger("rd2", "rd", unit="s"))
        rper = {k: c.summary(v)[0] / len(arrays) * 1e6 for k, v in rt.items()}
        total = c.summary(rt["h5"])[0]
        goal = f" (target < {RESTORE_SECONDS_100K:.0f} s at 100k)" if len(arrays) >= 100_000 else ""
        parts.append(
            f"restore {rper['h5']:.0f} us (in place {rper['h5_in_place']:.0f} us) vs read_direct "
            f"{rper['rd']:.0f} us and Keras' assign "
            f"{rper['ka']:.0f} us; restore total {total:.2f} s{goal}, Keras' assign alone "
            f"{c.summary(rt['ka'])[0]:.2f} s"
        )
        band = c.summary(c.ratios(rt, "rd2", "rd"))
        rows += [
            (
                "restore_training_state .h5 / h5py read_direct",
                c.summary(c.ratios(rt, "h5", "rd")),
                TARGET,
                band,
            ),
            (
                "restore_training_state .h5 / Keras' assign of host arrays",
                c.summary(c.ratios(rt, "h5", "ka")),
                None,
                band,
            ),
            (
                "restore_training_state .h5 in place / Keras' assign of host arrays",
                c.summary(c.ratios(rt, "h5_in_place", "ka")),
                None,
                band,
            ),
            ("Keras' assign of host arrays / h5py read_direct", c.summary(c.ratios(rt, "ka", "rd")), None),
            ("A/A read_direct / read_direct", band, None),
        ]
    if profile:
        _profile_restore(ours, model, profile)
    title = f"{len(arrays)} small arrays ({keras.backend.backend()}): " + "; ".join(parts)
    return title, rows


def _profile_restore(path, model, out):
    """One restore of ``path`` under ``cProfile``: stats to ``out``, the costliest printed."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(kss.restore_training_state, path, model)
    profiler.dump_stats(out)
    print(f"\n== profile of one restore (written to {out}), by own time", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main(argv=None):
    args = parse_args(argv)
    threads = c.configure_threads(args.threads)
    counts = [int(s) for s in args.counts.split(",") if s]
    phases = {s for s in args.phases.split(",") if s}
    print(
        f"many_variables: {c.machine()}; {args.rounds} rounds; counts {counts}; threads: {threads} "
        "(every contender)",
        flush=True,
    )
    folder = tempfile.mkdtemp(prefix="kss-bench-")
    sections = []
    try:
        for n in counts:
            last = n == counts[-1]
            title, rows = bench(n, args.rounds, folder, phases, args.profile if last else None)
            c.print_rows(title, rows)
            sections.append({"title": title, "rows": rows})
            keras.backend.clear_session()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    c.dump_json(args.json, "many_variables", sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
