"""How long a save blocks training: ``save_training_state(blocking=False)`` vs a blocking save.

Usage::

    KERAS_BACKEND=jax python benchmarks/async_save.py [--mb 12] [--rounds 9] [--format h5|keras] [--threads 1]

The state is an 8 x Dense MLP (width chosen so that weights + Adam slots are about
``--mb`` megabytes), trained with ``train_on_batch``. Each round saves it three
ways, in a rotating order (``S A S2``, ``A S2 S``, ``S2 S A``), into a fresh file:

* ``S``: ``save_training_state(path, model)``             (blocking)
* ``A``: ``save_training_state(path, model, blocking=False)``; training steps run
  while the background write goes on, then ``handle.wait()``
* ``S2``: a blocking save again (the A/A control)
* ``C``: only one host copy of every model and optimizer variable (``to_numpy``, then a
  copy of arrays that share memory): the floor of ``A`` on TensorFlow and Torch, whose
  next step updates the variables in place (JAX's ``blocking=False`` copies on the
  device, asynchronously, and waits only for the dispatch)

"Blocked" is the time the calling thread spends in the call, i.e. how long the
training step that saves waits. For ``A`` it includes waiting for the previous write
(none here: each round waits for it), collecting the state and the host copy;
the write itself (HDF5 record, xxh3-128 seal, ``fsync``, rename) runs in the background.
Per round it forms ``A/S`` (A/B), ``A/C`` (against the floor), ``C/S`` and ``S2/S``
(A/A) and reports the median of the per-round ratios with min and max (see the
project's PERF_NOTES.md). It also reports, for ``A``, the background write time, the
first training step after the call (a copy dispatched by the call but run by the
device is waited for there: it is part of what the save costs the training thread)
and the steps that ran during the write, each against the round's baseline step (the
two threads share the CPUs: on a 2-core machine this is the real cost of overlapping).
Threads are set once for every contender (``--threads``, ``_common.configure_threads``).
The calling thread's CPU time in ``A`` and ``C`` is printed too: on a machine loaded by
other processes the wall time of a short call stretches with the load, its CPU time not.

Exit code (the targets of issue 17): 0 when, on JAX, the median ``A/S <= 0.1``, and on
TensorFlow and Torch the median ``A/C <= 1`` (the call blocks no longer than one host
copy of the state); else 1. A median ratio inside the A/A band is marked ``~``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

c.configure_threads_env(c.threads_from_argv())

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402
from keras_stable_state._core.apply import to_numpy  # noqa: E402
from keras_stable_state._engines.background import _owned  # noqa: E402

TARGET = 0.1
LAYERS = 8
BATCH = 32
BASELINE_STEPS = 5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Time a save blocks training: async / blocking, with A/A.")
    parser.add_argument("--mb", type=float, default=12.0, help="state size in MB (default 12)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--format", choices=("h5", "keras"), default="h5", help="file format (default h5)")
    c.add_threads_arg(parser)
    return parser.parse_args(argv)


def build_model(mb):
    # weights + 2 Adam slots, float32: about 3 * 4 * LAYERS * width**2 bytes
    width = max(8, int((mb * 1e6 / (12 * LAYERS)) ** 0.5))
    keras.utils.set_random_seed(0)
    layers = [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(LAYERS)]
    model = keras.Sequential(layers)
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-4)), loss="mse")
    return model, width


def state_bytes(model):
    return sum(int(np.prod(v.shape)) * 4 for v in [*model.variables, *model.optimizer.variables])


def timed_step(model, x, y):
    t = time.perf_counter()
    model.train_on_batch(x, y)
    return time.perf_counter() - t


def host_copy(model):
    return [_owned(to_numpy(v), False) for v in [*model.variables, *model.optimizer.variables]]


def summary(values):
    return statistics.median(values), min(values), max(values)


def main(argv=None):
    args = parse_args(argv)
    threads = c.configure_threads(args.threads)
    backend = keras.backend.backend()
    model, width = build_model(args.mb)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, width)).astype("float32")
    y = rng.normal(size=(BATCH, width)).astype("float32")
    for _ in range(3):
        model.train_on_batch(x, y)  # compile, build the optimizer
    nbytes = state_bytes(model)
    print(
        f"async_save: backend={backend}, Keras {keras.__version__}, {LAYERS} x Dense({width}) + Adam, state "
        f"{nbytes / 1e6:.1f} MB, .{args.format}; {args.rounds} interleaved rounds; {os.cpu_count()} CPUs; "
        f"threads: {threads}",
        flush=True,
    )
    folder = tempfile.mkdtemp(prefix="kss-bench-async-")
    names = ("S", "A", "S2", "C")
    orders = [names[i:] + names[:i] for i in range(len(names))]
    blocked = {name: [] for name in names}
    cpu = {name: [] for name in names}  # CPU time of the calling thread in the call
    ratio_ab, ratio_aa, ratio_floor, ratio_af, writes, overlap, slowdowns = [], [], [], [], [], [], []
    after = {"A": [], "S": []}  # the first training step after the call / the round's baseline step
    t_start = time.perf_counter()
    try:
        kss.save_training_state(os.path.join(folder, f"warm.{args.format}"), model)  # first-save costs
        print("\nRounds (ms blocked in the call; A: background write ms, steps during it)")
        for r in range(args.rounds):
            baseline = statistics.median(timed_step(model, x, y) for _ in range(BASELINE_STEPS))
            got = {}
            for name in orders[r % len(orders)]:
                path = os.path.join(folder, f"{name}-{r}.{args.format}")
                t, t_cpu = time.perf_counter(), time.thread_time()
                if name == "C":
                    copies = host_copy(model)
                else:
                    handle = kss.save_training_state(path, model, blocking=name != "A")
                got[name] = time.perf_counter() - t
                cpu[name].append(time.thread_time() - t_cpu)
                blocked[name].append(got[name])
                if name == "C":
                    del copies
                    continue
                if name in after:
                    after[name].append(timed_step(model, x, y) / baseline)
                if name == "A":
                    during = []
                    while not handle.done():
                        during.append(timed_step(model, x, y))
                    handle.wait()
                    writes.append(handle.write_secs)
                    overlap.append(len(during) + 1)
                    if during:
                        slowdowns.append(statistics.median(during) / baseline)
                os.remove(path)
            ratio_ab.append(got["A"] / got["S"])
            ratio_aa.append(got["S2"] / got["S"])
            ratio_floor.append(got["C"] / got["S"])
            ratio_af.append(got["A"] / got["C"])
            print(
                f"  round {r + 1:>2} ({' '.join(orders[r % len(orders)]):<10}): S {got['S'] * 1e3:8.1f}  "
                f"A {got['A'] * 1e3:7.1f}  S2 {got['S2'] * 1e3:8.1f}  C {got['C'] * 1e3:6.1f}   "
                f"A/S {ratio_ab[-1]:.3f}  A/C {ratio_af[-1]:.2f}  "
                f"S2/S {ratio_aa[-1]:.3f}   write {writes[-1] * 1e3:7.1f}, {overlap[-1]} steps "
                f"(baseline step {baseline * 1e3:.1f})",
                flush=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    elapsed = time.perf_counter() - t_start

    print(f"\nResults ({backend}, {args.rounds} interleaved rounds, median [min, max])")
    print(f"  {'':<44} {'median':>8} {'min':>8} {'max':>8}")
    for name, label in (
        ("S", "S  blocking save, ms blocked"),
        ("A", "A  blocking=False, ms blocked"),
        ("S2", "S2 blocking save, ms blocked"),
        ("C", "C  host copy of the variables alone, ms"),
    ):
        med, lo, hi = summary(blocked[name])
        print(f"  {label:<44} {med * 1e3:8.1f} {lo * 1e3:8.1f} {hi * 1e3:8.1f}")
    for name in ("A", "C"):
        med, lo, hi = summary(cpu[name])
        label = f"{name}  CPU time of the calling thread, ms"
        print(f"  {label:<44} {med * 1e3:8.1f} {lo * 1e3:8.1f} {hi * 1e3:8.1f}")
    med, lo, hi = summary(writes)
    print(f"  {'A  background write, ms':<44} {med * 1e3:8.1f} {lo * 1e3:8.1f} {hi * 1e3:8.1f}")
    for name in ("A", "S"):
        med, lo, hi = summary(after[name])
        print(f"  {name + '  first step after the call / baseline':<44} {med:8.3f} {lo:8.3f} {hi:8.3f}")
    if slowdowns:
        med, lo, hi = summary(slowdowns)
        print(f"  {'A  later steps during the write / baseline':<44} {med:8.3f} {lo:8.3f} {hi:8.3f}")
    ab, aa, af = summary(ratio_ab), summary(ratio_aa), summary(ratio_af)
    noise = lambda r: "   ~ (within A/A noise)" if aa[1] <= r[0] <= aa[2] else ""  # noqa: E731
    print(f"  {'A/B  A/S  (async / blocking, blocked time)':<44} {ab[0]:8.3f} {ab[1]:8.3f} {ab[2]:8.3f}")
    print(f"  {'A/A  S2/S (blocking / blocking)':<44} {aa[0]:8.3f} {aa[1]:8.3f} {aa[2]:8.3f}")
    fl = summary(ratio_floor)
    print(f"  {'C/S  (floor: one host copy / blocking)':<44} {fl[0]:8.3f} {fl[1]:8.3f} {fl[2]:8.3f}")
    print(
        f"  {'A/C  (async blocked / the host-copy floor)':<44} {af[0]:8.3f} {af[1]:8.3f} {af[2]:8.3f}{noise(af)}"
    )
    if backend == "jax":
        ok = ab[0] <= TARGET
        verdict = f"median A/S {ab[0]:.3f} {'<=' if ok else '>'} {TARGET}"
    else:
        ok = af[0] <= 1.0
        verdict = f"median A/C {af[0]:.3f} {'<=' if ok else '>'} 1; A/S {ab[0]:.3f}"
    print(f"\nVERDICT: {'PASS' if ok else 'FAIL'} - {verdict} ({elapsed:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
