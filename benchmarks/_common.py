"""Shared parts of the save/restore benchmarks: interleaved rounds, summaries, baselines.

Every benchmark here follows /work/shared/PERF_NOTES.md: the operations it compares
run alternately in the same process, round by round (the order rotates), each
ratio is formed inside one round, and the median of the per-round ratios is
reported with its min and max beside an A/A row (the baseline timed against
itself), whose band is the noise floor: a ratio whose median lies inside that
band is printed with ``~`` (no measurable difference). Threads are set once, in
one place, for every contender of a run (:func:`configure_threads`), and cold
reads drop the file from the page cache first (:func:`drop_from_cache`).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import statistics
import sys
import time

import h5py
import numpy as np


def summary(values):
    """``(median, min, max)`` of a list of numbers."""
    return statistics.median(values), min(values), max(values)


def run_rounds(ops: dict, rounds: int, log=None, before=None) -> dict:
    """Time each zero-argument callable in ``ops`` once per round, in a rotating order.

    ``before``: ``{name: callable}`` run (untimed) just before the op of that name,
    e.g. dropping its file from the page cache for a cold read.

    Returns ``{name: [seconds per round]}``.
    """
    names = list(ops)
    times = {n: [] for n in names}
    before = before or {}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if name in before:
                before[name]()
            t0 = time.perf_counter()
            ops[name]()
            times[name].append(time.perf_counter() - t0)
        if log is not None:
            log(r, {n: times[n][-1] for n in names})
    return times


def round_logger(aa_num: str, aa_den: str, unit: str = "ms"):
    """A ``log`` for :func:`run_rounds`: each round's times (in ``unit``, ``"ms"`` or
    ``"s"``) and that round's A/A ratio ``aa_num / aa_den``."""
    scale = 1e3 if unit == "ms" else 1.0

    def log(r, got):
        times = "  ".join(f"{n} {t * scale:7.{1 if unit == 'ms' else 3}f} {unit}" for n, t in got.items())
        aa = f"   A/A {got[aa_num] / got[aa_den]:.3f}" if aa_num in got and aa_den in got else ""
        print(f"  round {r + 1}: {times}{aa}", flush=True)

    return log


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


THREADS_HELP = (
    "intra-op threads of the backend, the same for every contender (default 1; 0: the backend's own "
    "default). On a loaded 2-core machine the default threads swing step times 2-20x and inflate "
    "Torch restores 7-9x (PERF_NOTES). JAX honours only 1 (XLA_FLAGS, set before it is imported) or 0."
)


def add_threads_arg(parser) -> None:
    """The ``--threads`` option of every benchmark (:data:`THREADS_HELP`)."""
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)


def threads_from_argv(argv=None) -> int:
    """``--threads`` from the command line, read before Keras (and JAX) is imported."""
    p = argparse.ArgumentParser(add_help=False)
    add_threads_arg(p)
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.threads


def configure_threads_env(threads: int | None = None) -> None:
    """Before Keras is imported: quiet TensorFlow's C++ log; with ``threads == 1`` under
    JAX, single-threaded XLA CPU (``XLA_FLAGS``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if threads == 1 and os.environ.get("KERAS_BACKEND") == "jax":
        flags = os.environ.get("XLA_FLAGS", "")
        if "intra_op_parallelism_threads" not in flags:
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1".strip()
            )


def configure_threads(threads: int) -> str:
    """After Keras is imported, before any op runs: the backend's thread pools set to
    ``threads`` (``torch.set_num_threads``, ``tf.config.threading``; JAX through
    :func:`configure_threads_env`), once for every contender of the process.

    Returns the setting in words, for the header.
    """
    import keras

    backend = keras.backend.backend()
    if threads > 0 and backend == "torch":
        import torch

        torch.set_num_threads(threads)
    elif threads > 0 and backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    if backend == "torch":
        import torch

        return (
            f"torch.set_num_threads({torch.get_num_threads()})"
            if threads > 0
            else (f"torch default ({torch.get_num_threads()})")
        )
    if backend == "tensorflow":
        import tensorflow as tf

        got = tf.config.threading.get_intra_op_parallelism_threads()
        return f"tf.config.threading intra/inter-op {got}" if got else "tensorflow default"
    flags = os.environ.get("XLA_FLAGS", "")
    return (
        "XLA intra_op_parallelism_threads=1" if "intra_op_parallelism_threads=1" in flags else "XLA default"
    )


# -- the page cache -----------------------------------------------------------------------
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


_LIBC = _libc()


def cached_fraction(path: str) -> float | None:
    """The fraction of ``path``'s pages in the page cache (``mincore``), or ``None`` where
    it cannot be told (no libc, an empty file, another OS)."""
    size = os.path.getsize(path)
    if _LIBC is None or size == 0 or not hasattr(_LIBC, "mincore"):
        return None
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        # ACCESS_COPY: a private mapping whose untouched pages are the page cache's.
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        vec = (ctypes.c_ubyte * pages)()
        ok = _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        del addr
        resident = sum(b & 1 for b in vec) if ok else None
    return None if resident is None else resident / pages


def drop_from_cache(path: str) -> None:
    """``fsync`` then ``posix_fadvise(DONTNEED)`` the file (every file under a folder): its
    next read comes from the disk, as a resume after a restart reads it."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_reads_possible(path: str) -> tuple[bool, str]:
    """Whether :func:`drop_from_cache` empties the page cache of ``path`` here (read it,
    drop it, count its resident pages), and the finding in words for the header."""
    if not hasattr(os, "posix_fadvise"):
        return False, "cold reads not measured: os.posix_fadvise is not available on this OS"
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass
    warm = cached_fraction(path)
    drop_from_cache(path)
    cold = cached_fraction(path)
    if cold is None:
        return True, "file dropped from the page cache before each cold read (residency not checkable here)"
    if cold > 0.5:
        return False, (
            f"cold reads not measured: posix_fadvise(DONTNEED) left {cold:.0%} of the file in the page "
            f"cache (was {warm:.0%}; a tmpfs or overlay folder? pass --dir on a disk)"
        )
    return True, f"file dropped from the page cache before each cold read ({warm:.0%} -> {cold:.0%} resident)"


# -- output -------------------------------------------------------------------------------
NOISE_MARK = "~"
NOISE_LEGEND = (
    f"{NOISE_MARK}: the median lies inside the section's A/A band [min, max]: no measurable difference"
)


def within_noise(stats, band) -> bool:
    """Whether the median of ``stats`` lies inside the A/A ``band`` ``(median, min, max)``."""
    return band is not None and band[1] <= stats[0] <= band[2]


def print_rows(title: str, rows: list) -> None:
    """Print ``rows`` of ``(label, (median, min, max), target or None[, A/A band])``; a row
    whose median lies inside its A/A band (``(median, min, max)`` of the A/A ratios of
    the same rounds) is marked ``~ (within A/A noise)``."""
    print(f"\n{title}")
    print(f"  {'':<58} {'median':>8} {'min':>8} {'max':>8}  target")
    marked = False
    for label, (med, lo, hi), target, *band in rows:
        noise = within_noise((med, lo, hi), band[0] if band else None)
        marked = marked or noise
        tgt = "" if target is None else f"<= {target}"
        mark = f"  {NOISE_MARK} (within A/A noise)" if noise else ""
        print(f"  {label:<58} {med:8.3f} {lo:8.3f} {hi:8.3f}  {tgt:<8}{mark}".rstrip())
    if marked:
        print(f"  {NOISE_LEGEND}")


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
                "rows": [_json_row(*row) for row in s["rows"]],
                **({"notes": s["notes"]} if s.get("notes") else {}),
            }
            for s in sections
        ],
    }
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


def _json_row(label, stats, target, band=None) -> dict:
    m, lo, hi = stats
    row = {"label": label, "median": m, "min": lo, "max": hi, "target": target}
    if band is not None:
        row["aa"] = list(band)
        row["within_noise"] = within_noise(stats, band)
    return row


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


def has_orbax() -> bool:
    """Whether orbax-checkpoint can be imported (the ``.orbax`` rows need it)."""
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return False
    return True


class OrbaxBaseline:
    """Orbax's own synchronous save and restore + ``assign`` of a model's and its optimizer's
    variables (a PyTree of every array by position), the stock a ``.orbax`` training state is
    measured against: ``save(folder)`` writes one (replacing it), ``restore(folder)`` reads
    every array to host NumPy arrays with ``PyTreeCheckpointer`` and assigns each to its
    variable, as a user of Orbax without this library would resume."""

    def __init__(self, model):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.variables = model.variables + model.optimizer.variables
        self._restore_args = {
            str(i): ocp.RestoreArgs(restore_type=np.ndarray) for i in range(len(self.variables))
        }

    def _tree(self) -> dict:
        import keras

        jax_arrays = keras.backend.backend() == "jax"
        return {
            str(i): v.value if jax_arrays else keras.ops.convert_to_numpy(v)
            for i, v in enumerate(self.variables)
        }

    def save(self, where: str) -> None:
        import shutil

        shutil.rmtree(where, ignore_errors=True)
        with self._ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save(where, self._tree())

    def restore(self, where: str) -> None:
        with self._ocp.PyTreeCheckpointer() as ckptr:
            restored = ckptr.restore(
                where, args=self._ocp.args.PyTreeRestore(restore_args=self._restore_args)
            )
        for i, v in enumerate(self.variables):
            v.assign(restored[str(i)])
