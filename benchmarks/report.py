"""Run the save/restore benchmarks on each backend and write their table into docs/performance.md.

Usage::

    python benchmarks/report.py [--backends jax,torch,tensorflow] [--full] [--out docs/performance.md]

Each benchmark (``save_restore.py``, ``many_variables.py``, ``memory.py``) runs
in its own process per backend with ``--json``; the tables replace the text
between the ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` markers of the
output page (the rest of the page is kept). ``--full`` runs the full sizes
(1 GB states, 100k variables); the default is the quick sizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import NOISE_LEGEND  # noqa: E402

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
QUICK = {
    "save_restore.py": ["--sizes", "12,120", "--rounds", "5"],
    "many_variables.py": ["--counts", "1000,10000", "--rounds", "3"],
    "memory.py": ["--sizes", "120", "--rounds", "3"],
}
FULL = {  # issue 32: 12 MB, 120 MB and 1 GB, warm, cold and in a fresh process
    "save_restore.py": ["--sizes", "12,120,1000", "--rounds", "5"],
    "many_variables.py": ["--counts", "1000,10000,100000", "--rounds", "3"],
    "memory.py": ["--sizes", "12,120,1000", "--rounds", "3"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="jax,torch,tensorflow")
    p.add_argument("--benchmarks", default=",".join(QUICK), help="scripts to run, comma separated")
    p.add_argument("--full", action="store_true", help="full sizes (12 MB-1 GB states, 100k variables)")
    p.add_argument("--out", default=os.path.join(HERE, "..", "docs", "performance.md"))
    p.add_argument("--from-json", nargs="*", default=None, help="render these result files; run nothing")
    p.add_argument("--note", default="", help="a sentence added to the header (e.g. how the files were made)")
    return p.parse_args(argv)


def render(results: list, full: bool, note: str = "") -> str:
    """Markdown tables of ``results`` (the ``--json`` outputs), with the machine described
    and ``note`` after it."""
    lines = []
    machines = {}
    for r in results:
        m = r["machine"]
        machines.setdefault(m.get("backend"), m)
    if machines:
        m = next(iter(machines.values()))
        versions = ", ".join(
            f"{b} {mm.get(b)}" for b, mm in sorted(machines.items(), key=lambda kv: str(kv[0])) if b
        )
        lines += [
            f"Measured {datetime.date.today().isoformat()} ({'full' if full else 'quick'} sizes) on "
            f"{m['cpus']} CPU cores, {m['ram_gib']} GiB RAM, {m['platform']}; Python {m['python']}, "
            f"Keras {m.get('keras')}, {versions}; h5py {m['h5py']} (HDF5 {m['hdf5']}), NumPy {m['numpy']}. "
            "Read each ratio against its A/A row (the noise of the machine during the run)."
            + (f" {note}" if note else ""),
            "",
        ]
    marked = False
    for r in results:
        for s in r["sections"]:
            lines += [f"**{r['benchmark']}** - {s['title']}", ""]
            lines += [f"_{note}_" for note in s.get("notes", [])] + ([""] if s.get("notes") else [])
            lines += ["| ratio | median | min | max | target |", "|---|---|---|---|---|"]
            for row in s["rows"]:
                target = "" if row["target"] is None else f"<= {row['target']}"
                mark = " ~" if row.get("within_noise") else ""
                marked = marked or bool(mark)
                lines.append(
                    f"| {row['label']} | {row['median']:.3f}{mark} | {row['min']:.3f} | {row['max']:.3f} | {target} |"
                )
            lines.append("")
    if marked:
        lines += [f"{NOISE_LEGEND}.", ""]
    return "\n".join(lines)


def write_page(path: str, body: str) -> None:
    text = open(path).read() if os.path.exists(path) else f"# Performance\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def main(argv=None):
    args = parse_args(argv)
    results = []
    if args.from_json is not None:
        for path in args.from_json:
            with open(path) as fh:
                results.append(json.load(fh))
    else:
        sizes = FULL if args.full else QUICK
        folder = tempfile.mkdtemp(prefix="kss-report-")
        for backend in [b for b in args.backends.split(",") if b]:
            for script in [s for s in args.benchmarks.split(",") if s]:
                out = os.path.join(folder, f"{backend}-{script}.json")
                env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
                cmd = [sys.executable, os.path.join(HERE, script), *sizes[script], "--json", out]
                print(f"=== {backend}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, env=env, check=True)
                with open(out) as fh:
                    results.append(json.load(fh))
    write_page(os.path.abspath(args.out), render(results, args.full, args.note))
    print(f"wrote {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
