"""Where the test suite's CPU goes: a summary of the per-test log ``KSS_CPU_LOG`` writes.

``tests/conftest.py`` appends one JSON line per test to the file ``KSS_CPU_LOG`` names:
``{"test": node id, "backend": ..., "own": CPU s, "children": CPU s, "wall": s}``, where
``own`` is the test process's user + system CPU (every thread) from setup to teardown and
``children`` that of the child processes it waited for (``RUSAGE_CHILDREN``). On a
CPU-bound machine (2 cores, 3 test processes) these, not wall seconds, say what a cut of the
suite saves. ``make test`` passes the variable through to every pass, so one run logs all
three backends and the several-frameworks passes into one file::

    KSS_CPU_LOG=/tmp/cpu.jsonl make test
    python tests/cpu_report.py /tmp/cpu.jsonl [--by folder|file|function] [--top 30]

prints the total per backend, then the largest groups (a folder of ``tests/``, a file, or a
test function over its parameters) with their CPU seconds on each backend and the part spent
in child processes (each child imports Keras and its framework again: 5-8 CPU-s on these
machines).

It needs only the standard library.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

BACKENDS = ("tensorflow", "jax", "torch")


def group_of(node_id: str, by: str) -> str:
    """The group of a test's node id: its folder under ``tests/``, its file, or its function
    (the node id without its parameters)."""
    path = node_id.split("::")[0]
    if by == "folder":
        parts = path.split("/")
        return "/".join(parts[:2]) if len(parts) > 2 else path
    if by == "file":
        return path
    return node_id.split("[")[0]


def summarize(lines, by: str) -> tuple[dict, dict]:
    """``({backend: [own, children, tests]}, {group: {backend: [own, children, tests]}})``
    over the JSON lines of a CPU log."""
    totals: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    groups: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0.0, 0]))
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        for cell in (totals[row["backend"]], groups[group_of(row["test"], by)][row["backend"]]):
            cell[0] += row["own"]
            cell[1] += row["children"]
            cell[2] += 1
    return totals, groups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the file KSS_CPU_LOG named")
    parser.add_argument("--by", choices=("folder", "file", "function"), default="file")
    parser.add_argument("--top", type=int, default=30, help="groups shown, largest first")
    args = parser.parse_args(argv)
    with open(args.log, encoding="utf-8") as f:
        totals, groups = summarize(f, args.by)
    grand = sum(own + kids for own, kids, _ in totals.values())
    print(f"CPU seconds of {sum(n for *_, n in totals.values())} tests: {grand:.0f}")
    for backend in BACKENDS:
        own, kids, n = totals.get(backend, (0.0, 0.0, 0))
        print(f"  {backend:<10} {own + kids:7.0f} ({kids:.0f} in child processes) over {n} tests")
    header = "".join(f"{b:>12}" for b in BACKENDS)
    print(f"\n{'CPU s':>7} {'children':>8}{header}  {args.by}")
    ranked = sorted(groups.items(), key=lambda kv: -sum(own + kids for own, kids, _ in kv[1].values()))
    for name, cells in ranked[: args.top]:
        total = sum(own + kids for own, kids, _ in cells.values())
        kids = sum(k for _, k, _ in cells.values())
        per = "".join(f"{sum(cells[b][:2]) if b in cells else 0.0:12.1f}" for b in BACKENDS)
        print(f"{total:7.1f} {kids:8.1f}{per}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
