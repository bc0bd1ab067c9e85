"""Time of ``save_training_state`` / ``restore_training_state`` against the I/O floor.

Usage::

    KERAS_BACKEND=jax python benchmarks/save_restore.py [--sizes 12,120] [--rounds 5] [--threads 1]
        [--dir FOLDER] [--no-cold] [--json out.json]

For each state size (MB of weights + Adam slots, float32; ``--sizes 12,120,1000``
for the full run) an 8 x Dense MLP with Adam is built, and in one process,
round by round in a rotating order:

* save: ``save_training_state`` to ``.h5`` and to ``.keras``, stock
  ``model.save_weights`` + ``fsync`` and ``model.save`` (``.keras``) + ``fsync``,
  and the floor: a durable raw write of the same number of bytes (one ``write`` +
  ``fsync``), timed twice (A/A);
* restore, warm (in place, into the same model): ``restore_training_state`` from
  the ``.h5`` and the ``.keras`` (each all or nothing, and with ``all_or_nothing=False``:
  read into the variables in place), stock ``model.load_weights`` (timed twice: its A/A row),
  ``keras.saving.load_model`` of ``model.save``'s file (a new model, as stock
  Keras restores a ``.keras``), and the floor: h5py ``Dataset.read_direct`` of the
  same arrays into preallocated arrays, timed twice (A/A). Files are warm in the
  page cache for every contender alike;
* restore, cold: the same contenders, each file dropped from the page cache first
  (``fsync``, then ``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``, untimed), as
  a resume after a restart reads it; the floor is a cold ``read_direct`` (A/A
  twice). Whether dropping works here is checked first (``mincore``: the share of
  the file still resident) and printed; where it does not (tmpfs, another OS),
  the cold rows are left out and the header says why;
* file sizes (the same every round): the ``.keras`` training state against
  ``model.save``'s file (issue 17: <= 1.05, the optimizer slots stored once) and
  the files against the state's bytes.

Ratios are per round; the median with min and max is printed. Targets: issue 10,
save / raw write <= 1.15, restore / read_direct <= 1.3; issue 17, restore ``.h5``
/ stock ``load_weights`` <= 1.0 warm and cold, ``.keras`` restore <=
``load_model``, ``.keras`` save <= 1.15x ``model.save``. The machine is shared: a
ratio whose median lies inside its section's A/A band (min-max of the A/A ratios
of the same rounds) is marked ``~ (within A/A noise)``: no measurable difference.
Every contender runs with the same threads (``--threads``, set once by
``_common.configure_threads`` and printed in the header).

With orbax-checkpoint installed (``--no-orbax`` to skip), then, with the Adam
slots filled with random values: ``save_training_state`` / ``restore_training_state``
of a ``.orbax`` directory (every check on) against Orbax's own synchronous
``PyTreeCheckpointer`` save of the same arrays (JAX arrays on JAX, NumPy
elsewhere) over the old directory removed first, and, beside it, a save to a new
directory with the previous one removed after (what ours does: one of the two is
whole at every moment); and its restore into NumPy + ``assign`` to the
variables; Orbax's own save and restore timed twice (A/A). Target (issue 17): <= 1.2. Our
restore in place (``all_or_nothing=False``) against the same restore + assign (issue 32:
<= 1.0), warm and, unless ``--no-cold``, cold (each folder dropped from the page cache first).
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

SAVE_TARGET = 1.15
RESTORE_TARGET = 1.3
ORBAX_TARGET = 1.2
STOCK_TARGET = 1.0  # issue 17: restore / stock load_weights, .keras restore / load_model
SIZE_TARGET = 1.05  # issue 17: .keras training state / model.save's file (the slots stored once)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="12,120", help="state sizes in MB, comma separated (full: 12,120,1000)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (default 5)")
    p.add_argument("--dir", default=None, help="folder for the files (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the results here for benchmarks/report.py")
    p.add_argument("--no-orbax", action="store_true", help="skip the .orbax rows (else run if installed)")
    p.add_argument("--no-cold", action="store_true", help="leave out the cold-read rows")
    c.add_threads_arg(p)
    return p.parse_args(argv)


def bench_size(mb: int, rounds: int, folder: str, cold: bool, orbax: bool = False):
    model = c.mlp_for_bytes(mb * 10**6)
    arrays = c.state_arrays(model)
    nbytes = sum(a.nbytes for a in arrays)
    buffer = np.ones(nbytes, dtype=np.uint8)
    targets = [np.empty_like(a) for a in arrays]
    p = {
        n: os.path.join(folder, n)
        for n in ("raw.bin", "raw2.bin", "s.h5", "s.keras", "w.weights.h5", "m.keras")
    }
    p["h5raw"] = os.path.join(folder, "raw.h5")
    c.h5py_write_datasets(p["h5raw"], arrays)

    def stock_save():
        model.save_weights(p["w.weights.h5"])
        c.fsync_path(p["w.weights.h5"])

    def stock_model_save():
        model.save(p["m.keras"])
        c.fsync_path(p["m.keras"])

    save_ops = {
        "raw": lambda: c.durable_raw_write(p["raw.bin"], buffer),
        "raw2": lambda: c.durable_raw_write(p["raw2.bin"], buffer),
        "h5": lambda: kss.save_training_state(p["s.h5"], model),
        "keras": lambda: kss.save_training_state(p["s.keras"], model),
        "stock": stock_save,
        "model_save": stock_model_save,
    }
    for op in save_ops.values():  # warm-up: first-touch memory, imports, tracing
        op()
    print(f"\n== {mb} MB state ({nbytes / 1e6:.1f} MB in {len(arrays)} arrays), save", flush=True)
    st = c.run_rounds(save_ops, rounds, log=c.round_logger("raw2", "raw"))
    restore_ops = {
        "rd": lambda: c.h5py_read_direct(p["h5raw"], targets),
        "rd2": lambda: c.h5py_read_direct(p["h5raw"], targets),
        "h5": lambda: kss.restore_training_state(p["s.h5"], model),
        "h5_in_place": lambda: kss.restore_training_state(p["s.h5"], model, all_or_nothing=False),
        "keras": lambda: kss.restore_training_state(p["s.keras"], model),
        "keras_in_place": lambda: kss.restore_training_state(p["s.keras"], model, all_or_nothing=False),
        "stock": lambda: model.load_weights(p["w.weights.h5"]),
        "stock2": lambda: model.load_weights(p["w.weights.h5"]),
        "load_model": lambda: keras.saving.load_model(p["m.keras"]),
    }
    for op in restore_ops.values():
        op()
    print(f"== {mb} MB state, restore (warm)", flush=True)
    rt = c.run_rounds(restore_ops, rounds, log=c.round_logger("rd2", "rd"))
    raw_s = c.summary(st["raw"])[0]
    rd_s = c.summary(rt["rd"])[0]
    save_aa = c.summary(c.ratios(st, "raw2", "raw"))
    rd_aa = c.summary(c.ratios(rt, "rd2", "rd"))
    save_rows = [
        ("save_training_state .h5 / durable raw write", c.summary(c.ratios(st, "h5", "raw")), SAVE_TARGET),
        (
            "save_training_state .keras / durable raw write",
            c.summary(c.ratios(st, "keras", "raw")),
            SAVE_TARGET,
        ),
        ("stock save_weights+fsync / durable raw write", c.summary(c.ratios(st, "stock", "raw")), None),
        ("stock model.save+fsync / durable raw write", c.summary(c.ratios(st, "model_save", "raw")), None),
        (
            "save_training_state .h5 / stock save_weights+fsync",
            c.summary(c.ratios(st, "h5", "stock")),
            None,
            save_aa,
        ),
        (
            "save_training_state .keras / stock model.save+fsync",
            c.summary(c.ratios(st, "keras", "model_save")),
            SAVE_TARGET,
            save_aa,
        ),
        ("A/A raw write / raw write", save_aa, None),
        *_file_sizes(p, nbytes),
    ]
    restore_rows = [
        (
            "restore_training_state .h5 / h5py read_direct",
            c.summary(c.ratios(rt, "h5", "rd")),
            RESTORE_TARGET,
        ),
        (
            "restore_training_state .keras / h5py read_direct",
            c.summary(c.ratios(rt, "keras", "rd")),
            RESTORE_TARGET,
        ),
        ("stock load_weights / h5py read_direct", c.summary(c.ratios(rt, "stock", "rd")), None),
        (
            "stock keras.saving.load_model / h5py read_direct",
            c.summary(c.ratios(rt, "load_model", "rd")),
            None,
        ),
        *_versus_stock(rt, "", rd_aa),
        *_in_place_rows(rt, ""),
        ("A/A read_direct / read_direct", rd_aa, None),
    ]
    title = (
        f"{mb} MB state ({keras.backend.backend()}): raw write {raw_s * 1e3:.0f} ms "
        f"({nbytes / raw_s / 1e9:.2f} GB/s), read_direct {rd_s * 1e3:.0f} ms ({nbytes / rd_s / 1e9:.2f} GB/s)"
    )
    sections = [{"title": title, "rows": save_rows + restore_rows}]
    if cold:
        sections.append(cold_restore(model, p, targets, rounds, mb, nbytes))
    if orbax:
        sections.append(
            {
                "title": f"{mb} MB state, .orbax ({keras.backend.backend()})",
                "rows": bench_orbax(model, rounds, folder, cold),
            }
        )
    return sections


def bench_orbax(model, rounds: int, folder: str, cold: bool = False) -> list:
    """The .orbax sections: ours (all or nothing, and in place) against Orbax's own save and
    restore + assign of the same arrays (`_common.OrbaxBaseline`), warm, then cold (every
    file of each contender's folder dropped from the page cache just before it is read)."""
    rng = np.random.default_rng(0)
    for v in model.optimizer.variables:  # random slots: what a trained state holds (zeros compress)
        if len(v.shape) and "float" in str(v.dtype):
            v.assign(rng.normal(size=v.shape).astype(v.dtype))
    stock = c.OrbaxBaseline(model)
    ours = os.path.join(folder, "s.orbax")
    own = {n: os.path.join(folder, n) for n in ("own", "own2")}
    steps = [0]

    def own_save_keeping():  # a new step, the previous removed once it is written (like ours)
        steps[0] += 1
        stock.save(os.path.join(folder, f"step{steps[0]}"))
        shutil.rmtree(os.path.join(folder, f"step{steps[0] - 1}"), ignore_errors=True)

    save_ops = {
        "orbax": lambda: stock.save(own["own"]),
        "orbax2": lambda: stock.save(own["own2"]),
        "orbax_keep": own_save_keeping,
        "kss": lambda: kss.save_training_state(ours, model),
    }
    for op in save_ops.values():
        op()
    print("== .orbax save", flush=True)
    st = c.run_rounds(save_ops, rounds, log=c.round_logger("orbax2", "orbax"))
    restore_ops = {
        "orbax": lambda: stock.restore(own["own"]),
        "orbax2": lambda: stock.restore(own["own2"]),
        "kss": lambda: kss.restore_training_state(ours, model),
        "kss_in_place": lambda: kss.restore_training_state(ours, model, all_or_nothing=False),
    }
    for op in restore_ops.values():
        op()
    print("== .orbax restore", flush=True)
    rt = c.run_rounds(restore_ops, rounds, log=c.round_logger("orbax2", "orbax"))
    save_aa = c.summary(c.ratios(st, "orbax2", "orbax"))
    rows = [
        (
            ".orbax save_training_state / Orbax PyTree save",
            c.summary(c.ratios(st, "kss", "orbax")),
            ORBAX_TARGET,
            save_aa,
        ),
        (
            ".orbax save_training_state / Orbax save, previous kept",
            c.summary(c.ratios(st, "kss", "orbax_keep")),
            None,
            save_aa,
        ),
        ("A/A Orbax save / Orbax save", save_aa, None),
        *_orbax_restore_rows(rt, ""),
    ]
    if cold:
        files = {"orbax": own["own"], "orbax2": own["own2"], "kss": ours, "kss_in_place": ours}
        before = {name: (lambda f=files[name]: c.drop_from_cache(f)) for name in restore_ops}
        print("== .orbax restore (cold: each folder dropped from the page cache first)", flush=True)
        cold_times = c.run_rounds(restore_ops, rounds, log=c.round_logger("orbax2", "orbax"), before=before)
        rows += _orbax_restore_rows(cold_times, "cold")
    return rows


def _orbax_restore_rows(times, suffix) -> list:
    """Our .orbax restores (all or nothing; in place, issue 32: <= 1.0) against Orbax's own
    restore + assign in the same rounds, beside that baseline's A/A row."""
    when = f", {suffix}" if suffix else ""
    band = c.summary(c.ratios(times, "orbax2", "orbax"))
    return [
        (
            f".orbax restore_training_state / Orbax restore + assign{when}",
            c.summary(c.ratios(times, "kss", "orbax")),
            ORBAX_TARGET,
            band,
        ),
        (
            f".orbax restore_training_state in place / Orbax restore + assign{when}",
            c.summary(c.ratios(times, "kss_in_place", "orbax")),
            STOCK_TARGET,
            band,
        ),
        (f"A/A Orbax restore + assign / Orbax restore + assign{when}", band, None),
    ]


def _file_sizes(p: dict, nbytes: int) -> list:
    """Rows of file sizes (one value, the same in every round): the ``.keras`` training state
    against ``model.save``'s file (issue 17: <= 1.05) and the files against the state's bytes."""
    ours, stock = os.path.getsize(p["s.keras"]), os.path.getsize(p["m.keras"])

    def row(label, value, target=None):
        return (label, (value, value, value), target)

    return [
        row("file size: .keras state / model.save's .keras", ours / stock, SIZE_TARGET),
        row("file size: .keras state / state bytes", ours / nbytes),
        row("file size: model.save's .keras / state bytes", stock / nbytes),
        row("file size: .h5 state / state bytes", os.path.getsize(p["s.h5"]) / nbytes),
    ]


def _versus_stock(times, suffix, band):
    """Our restores against stock Keras' own, in the same rounds (issue 17: <= 1.0)."""
    when = f", {suffix}" if suffix else ""
    return [
        (
            f"restore_training_state .h5 / stock load_weights{when}",
            c.summary(c.ratios(times, "h5", "stock")),
            STOCK_TARGET,
            band,
        ),
        (
            f"restore_training_state .keras / stock load_model{when}",
            c.summary(c.ratios(times, "keras", "load_model")),
            STOCK_TARGET,
            band,
        ),
    ]


def _in_place_rows(times, suffix):
    """The restore in place (``all_or_nothing=False``, what StableCheckpoint does into a model
    that never trained) against stock ``load_weights`` (issue 32: <= 1.0), beside the A/A
    row of stock against itself in the same rounds."""
    when = f", {suffix}" if suffix else ""
    band = c.summary(c.ratios(times, "stock2", "stock"))
    return [
        (
            f"restore_training_state .h5 in place / stock load_weights{when}",
            c.summary(c.ratios(times, "h5_in_place", "stock")),
            STOCK_TARGET,
            band,
        ),
        (
            f"restore_training_state .keras in place / stock load_weights{when}",
            c.summary(c.ratios(times, "keras_in_place", "stock")),
            STOCK_TARGET,
            band,
        ),
        (f"A/A stock load_weights / stock load_weights{when}", band, None),
    ]


def cold_restore(model, p, targets, rounds, mb, nbytes) -> dict:
    """The cold-read section: every contender's file dropped from the page cache (untimed)
    just before it is read, as a resume after a restart reads it."""
    ops = {
        "rd": lambda: c.h5py_read_direct(p["h5raw"], targets),
        "rd2": lambda: c.h5py_read_direct(p["h5raw"], targets),
        "h5": lambda: kss.restore_training_state(p["s.h5"], model),
        "h5_in_place": lambda: kss.restore_training_state(p["s.h5"], model, all_or_nothing=False),
        "keras": lambda: kss.restore_training_state(p["s.keras"], model),
        "keras_in_place": lambda: kss.restore_training_state(p["s.keras"], model, all_or_nothing=False),
        "stock": lambda: model.load_weights(p["w.weights.h5"]),
        "stock2": lambda: model.load_weights(p["w.weights.h5"]),
        "load_model": lambda: keras.saving.load_model(p["m.keras"]),
    }
    files = {"rd": "h5raw", "rd2": "h5raw", "h5": "s.h5", "keras": "s.keras", "stock": "w.weights.h5"}
    files.update(h5_in_place="s.h5", keras_in_place="s.keras", stock2="w.weights.h5")
    files["load_model"] = "m.keras"
    before = {name: (lambda f=p[files[name]]: c.drop_from_cache(f)) for name in ops}
    print(f"== {mb} MB state, restore (cold: each file dropped from the page cache first)", flush=True)
    times = c.run_rounds(ops, rounds, log=c.round_logger("rd2", "rd"), before=before)
    band = c.summary(c.ratios(times, "rd2", "rd"))
    rd_s = c.summary(times["rd"])[0]
    rows = [
        ("restore_training_state .h5 / h5py read_direct, cold", c.summary(c.ratios(times, "h5", "rd")), None),
        (
            "restore_training_state .keras / h5py read_direct, cold",
            c.summary(c.ratios(times, "keras", "rd")),
            None,
        ),
        ("stock load_weights / h5py read_direct, cold", c.summary(c.ratios(times, "stock", "rd")), None),
        ("stock load_model / h5py read_direct, cold", c.summary(c.ratios(times, "load_model", "rd")), None),
        *_versus_stock(times, "cold", band),
        *_in_place_rows(times, "cold"),
        ("A/A read_direct / read_direct, cold", band, None),
    ]
    title = (
        f"{mb} MB state ({keras.backend.backend()}), cold reads: read_direct {rd_s * 1e3:.0f} ms "
        f"({nbytes / rd_s / 1e9:.2f} GB/s)"
    )
    return {"title": title, "rows": rows}


def main(argv=None):
    args = parse_args(argv)
    threads = c.configure_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    folder = args.dir or tempfile.mkdtemp(prefix="kss-bench-")
    cold, cold_note = False, "cold reads not measured (--no-cold)"
    if not args.no_cold:
        probe = os.path.join(folder, "probe.bin")
        c.durable_raw_write(probe, np.ones(1 << 24, np.uint8))
        cold, cold_note = c.cold_reads_possible(probe)
        os.remove(probe)
    print(
        f"save_restore: {c.machine()}; {args.rounds} rounds; sizes {sizes} MB; threads: {threads} "
        f"(every contender); {cold_note}",
        flush=True,
    )
    sections = []
    try:
        for mb in sizes:
            orbax = not args.no_orbax and c.has_orbax()
            for section in bench_size(mb, args.rounds, folder, cold, orbax=orbax):
                c.print_rows(section["title"], section["rows"])
                sections.append(section)
            keras.backend.clear_session()
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    for section in sections:
        section["notes"] = [f"threads: {threads}", cold_note]
    c.dump_json(args.json, "save_restore", sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
