"""The resume-conformance matrix, long run (``make matrix``; issue 14).

usage: python tests/matrix.py --seed S [S ...] --cases N [--backends tensorflow,jax,torch]
                              [--jobs J] [--out results.json] [--render-docs]
       python tests/matrix.py --results results.json --render-docs
       python tests/matrix.py --seed S --replay BACKEND:INDEX   (one case, verbose)

Draws N cases per backend and seed (tests/resume_matrix.py), runs each one's uninterrupted
fits (with StableCheckpoint, and without the library: the invariance check) and its
killed/resumed fits in child processes, prints per backend the count of each outcome
(EXACT, WARNED, REFUSED, SILENT, FALSE_REFUSAL, CRASH, HARNESS_ERROR, SKIPPED), the
invariance failures, the share of exact results among the kill scenarios that saved
something and have no accepted cause (tests/matrix_causes.py), the failing ones per
configuration feature and the named causes of non-exact results per input kind; writes
every result to ``--out``, and with ``--render-docs`` writes the table of
docs/how-to/resume-fit.md between its markers. Exit status 1 if any result is SILENT,
CRASH or HARNESS_ERROR or any case is an invariance failure or error.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import matrix_causes as mc  # noqa: E402
import matrix_inputs as mi  # noqa: E402
import resume_matrix as rm  # noqa: E402

OUTCOMES = (
    "EXACT",
    "WARNED",
    "REFUSED",
    "NOTHING_SAVED",
    "SILENT",
    "FALSE_REFUSAL",
    "CRASH",
    "HARNESS_ERROR",
    "SKIPPED",
)
FAILING = ("SILENT", "CRASH", "HARNESS_ERROR")
#: Invariance outcomes of a case (``resume_matrix.invariance``); the failing ones.
INVARIANCE = ("SAME", "DIFFERENT", "UNREPEATABLE", "ERROR", "NOT_RUN")
INVARIANCE_FAILING = ("DIFFERENT", "ERROR")
DOC = os.path.join(rm.ROOT, "docs", "how-to", "resume-fit.md")
BEGIN, END = "<!-- resume-matrix:begin -->", "<!-- resume-matrix:end -->"


def run(seeds, cases, backends, jobs, log):
    drawn = [rm.draw_case(seed, i, b) for seed in seeds for b in backends for i in range(cases)]
    root = tempfile.mkdtemp(prefix="kss-matrix-")
    chunks = [drawn[j::jobs] for j in range(jobs)]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for part in pool.map(lambda cs: rm.run_cases(cs, root=root, log=log), [c for c in chunks if c]):
            results.update(part)
    rm.false_refusals(results, drawn)
    return {"seed": list(seeds), "cases": {rm.case_id(c): c for c in drawn}, "results": results}


def case_invariance(data):
    """``{case_id: invariance outcome}`` (the same on every scenario result of a case)."""
    return {
        cid: (rs[0].get("invariance", "NOT_RUN") if rs else "NOT_RUN") for cid, rs in data["results"].items()
    }


def named_causes(r, c):
    """``[(name, acceptance class)]`` of result ``r``'s causes (``matrix_causes``) in case
    ``c``: other data is accepted only where the case's resume changed them on purpose
    (``batch_changed``), layers renamed by a decoy model only on a decoy resume, random
    layers on another backend only on a cross-backend resume."""
    out = []
    for cause in r["causes"]:
        name, accepted = mc.classify_cause(cause)
        if (
            (accepted == "data" and c["resume"] != "batch_changed")
            or (accepted == "decoy" and c["resume"] != "decoy")
        ) or (
            (accepted == "cross_backend" or " continued on " in name)  # another backend's own draws
            and c["resume"] != "cross_backend"
        ):
            accepted = None
        out.append((name, accepted))
    return out


def counted(r, c):
    """Whether result ``r`` of case ``c`` counts for the exact share: it saved something,
    ran, and its resume has no accepted cause (``matrix_causes.ACCEPTED``)."""
    if r["outcome"] in ("NOTHING_SAVED", "SKIPPED", "HARNESS_ERROR"):
        return False
    return not any(accepted for _, accepted in named_causes(r, c))


def totals(data):
    """``(per backend: Counter of outcomes and invariance outcomes, counted, exact-counted)``."""
    inv = case_invariance(data)
    by = collections.defaultdict(collections.Counter)
    for cid, rs in data["results"].items():
        b = data["cases"][cid]["backend"]
        by[b]["cases"] += 1
        by[b]["inv:" + inv[cid]] += 1
        for r in rs:
            by[b][r["outcome"]] += 1
            by[b]["scenarios"] += 1
            if counted(r, data["cases"][cid]):
                by[b]["counted"] += 1
                by[b]["counted_exact"] += r["outcome"] == "EXACT"
    return by


def _share(n):
    return (
        f"{100 * n['counted_exact'] / n['counted']:.1f}% ({n['counted_exact']} of {n['counted']})"
        if n["counted"]
        else "- (none)"
    )


def first_line(data):
    """The table's first line: the counts of every category, the invariance failures and the
    share of exact results among the counted ones, per backend."""
    by = totals(data)
    seeds = data["seed"] if isinstance(data["seed"], list) else [data["seed"]]
    parts = []
    for b, n in sorted(by.items()):
        parts.append(
            f"**{b}**: {n['scenarios']} kill scenarios ({n['cases']} cases): {n['EXACT']} exact, "
            f"{n['WARNED']} warned, {n['REFUSED']} refused, {n['SILENT'] + n['CRASH']} silent "
            f"({n['CRASH']} crashed), {n['FALSE_REFUSAL']} false refusals, {n['NOTHING_SAVED']} nothing "
            f"saved, {n['SKIPPED']} skipped, {n['HARNESS_ERROR']} harness errors; invariance failures "
            f"{n['inv:DIFFERENT']} and errors {n['inv:ERROR']} of {n['cases']} cases"
            + (
                f" ({n['inv:UNREPEATABLE']} unrepeatable without the library)"
                if n["inv:UNREPEATABLE"]
                else ""
            )
            + f"; exact {_share(n)}"
        )
    return (
        f"Seeds {', '.join(map(str, sorted(set(seeds))))}, {len(data['cases'])} cases. "
        + "; ".join(parts)
        + "."
    )


def summary(data):
    """The console report: counts per backend, the failing results per feature, and the
    causes of non-exact results per input kind."""
    lines = [first_line(data).replace("**", "")]
    silent = collections.defaultdict(collections.Counter)
    for cid, rs in data["results"].items():
        c = data["cases"][cid]
        for r in rs:
            if r["outcome"] in FAILING:
                for key, values in rm.kinds(c).items():
                    for v in values:
                        silent[(c["backend"], r["outcome"])][f"{key}={v}"] += 1
                silent[(c["backend"], r["outcome"])][f"kill={r['kill_kind']}"] += 1
    for (b, o), counts in sorted(silent.items()):
        top = ", ".join(f"{k} {n}" for k, n in counts.most_common(25))
        lines.append(f"  {b} {o} by feature: {top}")
    lines += ["", "Non-exact results by input kind:"] + by_input_kind(data)
    inv = case_invariance(data)
    failed = any(r["outcome"] in FAILING for rs in data["results"].values() for r in rs) or any(
        v in INVARIANCE_FAILING for v in inv.values()
    )
    return "\n".join(lines), failed


def _problem_kind(problem):
    """A short name of a comparison problem: what differed (``model.weights``, ``History``...)."""
    return re.split(r"[\[(:]", problem, maxsplit=1)[0].strip()


def by_input_kind(data, top=4):
    """Lines: per input kind (``matrix_inputs.FAMILIES``) and backend, the number of results
    of each category other than exact (invariance: cases) and their most frequent causes
    (a warned result may have several); SILENT and CRASH name the input and what differed."""
    inv = case_invariance(data)
    rows = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    counts = collections.defaultdict(collections.Counter)
    for cid, rs in data["results"].items():
        c = data["cases"][cid]
        key = (mi.family(c["input"]), c["backend"])
        if inv[cid] in (*INVARIANCE_FAILING, "UNREPEATABLE"):
            probs = rs[0].get("invariance_problems") or ["?"]
            what = probs[0] if inv[cid] == "UNREPEATABLE" else _problem_kind(probs[0])
            counts[key]["INVARIANCE " + inv[cid]] += 1
            rows[key]["INVARIANCE " + inv[cid]][f"{c['input']}{_options(c)}: {what}"] += 1
        for r in rs:
            o = r["outcome"]
            if o in ("EXACT", "NOTHING_SAVED"):
                continue
            counts[key][o] += 1
            if o in ("WARNED", "REFUSED", "FALSE_REFUSAL"):
                for name, accepted in dict.fromkeys(named_causes(r, c)):
                    rows[key][o][f"{name}{' [accepted]' if accepted else ''}"] += 1
            else:
                what = ", ".join(sorted({_problem_kind(p) for p in r["problems"]})) or "?"
                rows[key][o][f"{c['input']}{_options(c)}: {what[:200]}"] += 1
    out = []
    for (fam, b), cats in sorted(rows.items()):
        out.append(f"* {fam} on {b}:")
        for o, causes in sorted(cats.items()):
            shown = "; ".join(f"{k} ({n})" for k, n in causes.most_common(top))
            out.append(f"  * {o} {counts[(fam, b)][o]}: {shown}")
    return out


def _options(c):
    """The drawn options of a DataLoader or grain input, as `` (workers 1, drop_last)``."""
    opts = [f"workers {c['loader_workers']}"] if c.get("loader_workers") else []
    opts += [
        name
        for key, name in (("drop_last", "drop_last"), ("loader_augment", "random __getitem__"))
        if c.get(key)
    ]
    return f" ({', '.join(opts)})" if opts else ""


def render(data):
    """The markdown of ``data`` (results of :func:`run`): the first line of counts, the table
    per feature value and backend, the named causes and the non-exact results per input kind."""
    backends = sorted({c["backend"] for c in data["cases"].values()})
    inv = case_invariance(data)
    rows = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    causes = collections.defaultdict(collections.Counter)
    inexact = collections.Counter()
    for cid, rs in data["results"].items():
        c = data["cases"][cid]
        feats = rm.kinds(c)
        for key, values in feats.items():
            for v in values:
                rows[(rm.FEATURES[key], v)][c["backend"]]["inv:" + inv[cid]] += 1
        for r in rs:
            feats["kill"] = [r["kill_kind"]]
            for key, values in feats.items():
                for v in values:
                    rows[(rm.FEATURES[key], v)][c["backend"]][r["outcome"]] += 1
            for name, accepted in dict.fromkeys(named_causes(r, c)):
                causes[(r["outcome"], name, accepted)][c["backend"]] += 1
            if r["outcome"] in ("SILENT", "CRASH"):
                inexact[
                    (
                        c["backend"],
                        f"{c['input']}{_options(c)}, {c['optimizer']}, callbacks {c['callbacks'] or 'none'}, "
                        f"resume {c['resume']}, kill {r['kill_kind']}",
                    )
                ] += 1
    out = [
        first_line(data),
        "",
        f"Generated by `python tests/matrix.py --render-docs` (`make matrix`) from its own results "
        f"(seeds {', '.join(map(str, sorted(set(data['seed'] if isinstance(data['seed'], list) else [data['seed']]))))}, "
        f"{len(data['cases'])} cases, {sum(len(rs) for rs in data['results'].values())} kill scenarios); "
        "do not edit by hand. Each cell: exact / warned / refused / silent (a resumed run that differs "
        "from the uninterrupted one without a warning or refusal) / nothing saved (killed before the "
        "first checkpoint: the rerun starts afresh), over the drawn kill scenarios, then / invariance "
        "failures over the drawn cases (the uninterrupted fit with StableCheckpoint differs from the "
        "same fit without the library, bit for bit), and the scenarios skipped because a package is "
        "not installed. The first line's invariance failures and errors count cases (an error: only one "
        "of the two fits raised); its exact share is that of the kill scenarios that saved something, ran, "
        "and whose resume has none of the accepted causes: "
        + "; ".join(f"{k}: {v}" for k, v in mc.ACCEPTED.items())
        + ".",
        "",
        "| feature | value | " + " | ".join(backends) + " |",
        "|---|---|" + "---|" * len(backends),
    ]
    for (feature, value), per in sorted(rows.items()):
        cells = []
        for b in backends:
            n = per[b]
            skipped = f" ({n['SKIPPED']} skipped)" if n["SKIPPED"] else ""
            cells.append(
                f"{n['EXACT']} / {n['WARNED']} / {n['REFUSED'] + n['FALSE_REFUSAL']} / "
                f"{n['SILENT'] + n['CRASH']} / {n['NOTHING_SAVED']} / {n['inv:DIFFERENT'] + n['inv:ERROR']}"
                f"{skipped}"
                if sum(n.values())
                else "-"
            )
        out.append(f"| {feature} | `{value}` | " + " | ".join(cells) + " |")
    out += ["", "Causes named at train begin (warned or refused), with counts per backend:", ""]
    for (outcome, name, accepted), per in sorted(causes.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        counts = ", ".join(f"{b} {n}" for b, n in sorted(per.items()))
        tag = f" [accepted: {mc.ACCEPTED[accepted]}]" if accepted else ""
        out.append(f"* {outcome.lower()}: {name}{tag} ({counts})")
    out += ["", "Results other than exact, per input kind (count, then the most frequent causes):", ""]
    out += by_input_kind(data)
    if inexact:
        out += [
            "",
            "Configurations the library does not resume exactly and does not warn about "
            "(SILENT or CRASH), with counts:",
            "",
        ]
        for (b, what), n in sorted(inexact.items()):
            out.append(f"* {b}: {what} ({n})")
    return "\n".join(out) + "\n"


def render_docs(data, path=DOC):
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{render(data)}{END}{tail}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, nargs="+", default=[0], help="one or more seeds")
    p.add_argument("--cases", type=int, default=500, help="cases per backend")
    p.add_argument("--backends", default=",".join(rm.BACKENDS))
    p.add_argument("--jobs", type=int, default=2, help="child processes at a time")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--results", nargs="+", help="read results JSON files (merged) instead of running")
    p.add_argument(
        "--render-docs", action="store_true", help="write the table into docs/how-to/resume-fit.md"
    )
    p.add_argument("--replay", help="BACKEND:INDEX: run one case of --seed and print its results")
    args = p.parse_args(argv)
    log = (lambda s: print(s, flush=True)) if args.replay else None
    if args.replay:
        backend, index = args.replay.split(":")
        c = rm.draw_case(args.seed[0], int(index), backend)
        print(json.dumps(c, indent=1))
        res = rm.run_cases([c], log=log)
        print(json.dumps(res, indent=1))
        return 0
    if args.results:
        data = {"seed": [], "cases": {}, "results": {}, "wall_s": 0.0}
        for path in args.results:  # e.g. one file per backend or per seed
            with open(path) as f:
                part = json.load(f)
            data["seed"] += part["seed"] if isinstance(part["seed"], list) else [part["seed"]]
            data["cases"].update(part["cases"])
            data["results"].update(part["results"])
            data["wall_s"] += part.get("wall_s", 0.0)
    else:
        t0 = time.time()
        data = run(args.seed, args.cases, args.backends.split(","), args.jobs, log)
        data["wall_s"] = round(time.time() - t0, 1)
        n = len(data["cases"])
        print(
            f"{args.cases} cases per backend and seed ({n} in all) in {data['wall_s']} s with "
            f"{args.jobs} jobs: {data['wall_s'] * args.jobs / max(n, 1):.1f} s of one job per case"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    text, failed = summary(data)
    print(text)
    if args.render_docs:
        render_docs(data)
        print(f"wrote the table into {DOC}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
