"""Shared parts of the save/restore benchmarks: interleaved rounds, summaries, baselines.

Every benchmark here follows /work/shared/PERF_NOTES.md: the operations it compares
run alternately in the same process, round by round (the order rotates), each
ratio is formed inside one round, and the median of the per-round ratios is
reported with its min and max beside an A/A row (the baseline timed against
itself), whose band is the noise floor.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import h5py
import numpy as np


def summary(values):
    """``(median, min, max)`` of a list of numbers."""
    return statistics.median(values), min(values), max(values)


def run_rounds(ops: dict, rounds: int, log=None) -> dict:
    """Time each zero-argument callable in ``ops`` once per round, in a rotating order.

    Returns ``{name: [seconds per round]}``.
    """
    names = list(ops)
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            ops[name]()
            times[name].append(time.perf_counter() - t0)
        if log is not None:
            log(r, {n: times[n][-1] for n in names})
    return times


def ratios(times: dict, num: str, den: str) -> list:
    """Per-round ratios ``times[num][r] / times[den][r]``."""
    return [a / b for a, b in zip(times[num], times[den], strict=True)]


def fsync_path(path: str) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def durable_raw_write(path: str, buffer: np.ndarray) -> None:
    """One ``write`` of ``buffer``'s bytes and an ``fsync``: the physical floor of a save."""
    with open(path, "wb") as fh:
        fh.write(memoryview(buffer).cast("B"))
        fh.flush()
        os.fsync(fh.fileno())


def h5py_write_datasets(path: str, arrays: list) -> None:
    """One plain h5py dataset per array, then ``fsync``: the per-dataset floor."""
    with h5py.File(path, "w") as f:
        for i, a in enumerate(arrays):
            f.create_dataset(str(i), data=a)
    fsync_path(path)


def h5py_read_direct(path: str, targets: list) -> None:
    """``Dataset.read_direct`` of datasets ``0..n-1`` into preallocated arrays."""
    with h5py.File(path, "r") as f:
        for i, t in enumerate(targets):
            f[str(i)].read_direct(t)


def machine() -> dict:
    """Cores, memory and library versions, for the report."""
    mem = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info = {
        "cpus": os.cpu_count(),
        "ram_gib": mem,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "numpy": np.__version__,
    }
    try:
        import keras

        info["keras"] = keras.__version__
        backend = keras.backend.backend()
        info["backend"] = backend
        mod = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend]
        info[backend] = __import__(mod).__version__
    except ImportError:
        pass
    return info


def configure_threads_env() -> None:
    """Quiet TensorFlow's C++ log before it is imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def print_rows(title: str, rows: list) -> None:
    """Print ``rows`` of ``(label, (median, min, max), target or None)``."""
    print(f"\n{title}")
    print(f"  {'':<58} {'median':>8} {'min':>8} {'max':>8}  target")
    for label, (med, lo, hi), target in rows:
        print(f"  {label:<58} {med:8.3f} {lo:8.3f} {hi:8.3f}  {'' if target is None else f'<= {target}'}")


def dump_json(path, benchmark: str, sections: list) -> None:
    """Write results for ``benchmarks/report.py``: ``sections`` of ``{title, rows}``."""
    if not path:
        return
    out = {
        "benchmark": benchmark,
        "machine": machine(),
        "sections": [
            {
                "title": s["title"],
                "rows": [
                    {"label": label, "median": m, "min": lo, "max": hi, "target": target}
                    for label, (m, lo, hi), target in s["rows"]
                ],
            }
            for s in sections
        ],
    }
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


def mlp_for_bytes(state_bytes: int, seed: int = 0):
    """An 8 x Dense MLP of width ``w`` with Adam, built and with its optimizer built,
    whose state (weights + two Adam slots, float32) is about ``state_bytes``."""
    import keras

    width = max(8, int(round((state_bytes / (3 * 4 * 8)) ** 0.5)))
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(8)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def state_arrays(model) -> list:
    """Host copies of every model and optimizer variable (for raw baselines)."""
    from keras_stable_state._core.apply import to_numpy

    return [np.ascontiguousarray(to_numpy(v)) for v in model.variables + model.optimizer.variables]
