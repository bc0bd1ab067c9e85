"""The resume-conformance matrix (issue 14): helpers, no tests.

A *case* is a JSON config drawn by :func:`draw_case` from ``(seed, index, backend)``
alone (a NumPy ``Generator`` seeded with them), so any case replays from those three.
It holds a ``model.fit`` configuration (input kind, compile, optimizer, callbacks,
``save_freq``, validation, weights), a resume variant, and one or more *scenarios*:
lists of global steps at which a run is killed (``SIGKILL``, from a stateless callback)
and resumed in a fresh process. All scenarios of a case share one uninterrupted
reference run.

:func:`plan_processes` turns cases into child processes (``tests/scripts/matrix_child.py``),
each running a list of *phases*: ``ref`` (uninterrupted), ``fresh`` (a new run killed
at a step), ``resume`` (a ``StableCheckpoint`` resume; always the first phase of its
process, the fresh-process promise). :func:`run_cases` runs them and
:func:`classify` compares every model and optimizer variable by position
(``model.weights``, ``model.optimizer.variables``), the ``History`` and the per-epoch
learning rate against the reference.

Outcomes per scenario: ``EXACT``, ``WARNED`` (``InexactResumeWarning`` at train begin
of a resume), ``REFUSED`` (``StateError`` at train begin of a resume), ``SILENT``
(differs without either), ``CRASH`` (a resume raised something else, or later),
``HARNESS_ERROR`` (the reference or a fresh run failed, a child died unexpectedly),
``NOTHING_SAVED`` (killed before the first checkpoint was written: the rerun started
afresh under another seed or after a decoy model, and differs for that reason alone);
``FALSE_REFUSAL`` is found across cases by :func:`false_refusals`; ``SKIPPED``: the case
needs a package that is not installed here (grain, torchdata, another framework) and was not
run, or one of its runs met a failure of stock Keras itself (`STOCK_FAILURES`), named in its
``problems`` (never counted as passed).

Every case also runs its uninterrupted fit without the library (``plain``: no
``StableCheckpoint``, the bare optimizer) beside the reference; each scenario result
carries the case's ``invariance`` (:func:`invariance`): ``SAME`` (bit for bit),
``DIFFERENT`` (an invariance failure), ``UNREPEATABLE`` (the two differ, and the input is one
`UNREPEATABLE_INPUTS` names, or one of them met one of `STOCK_FAILURES`: stock Keras itself
does not repeat its run), ``ERROR`` or
``NOT_RUN``, apart from its outcome.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import matrix_inputs as mi
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD = os.path.join(HERE, "scripts", "matrix_child.py")
BACKENDS = ("tensorflow", "jax", "torch")

INPUTS = (
    "numpy",
    "numpy_shuffle",
    "tfdata",
    "tfdata_shuffle_fixed",
    "tfdata_reshuffle",
    "tfdata_repeat_steps",
    "tfdata_take",
    "pydataset",
    "pydataset_threads",
    "pydataset_processes",
    "pydataset_shuffle_state",
    "pydataset_shuffle_nostate",
    "generator",
)
#: The weights of :data:`INPUTS` (those of the generator before issue 33, kept).
INPUT_WEIGHTS = (3, 3, 2, 1, 1, 1.5, 1, 1.5, 1, 0.3, 1, 1, 1)
#: Every input kind drawn: the above, then issue 33's (``matrix_inputs.NEW_INPUTS``).
ALL_INPUTS = INPUTS + tuple(mi.NEW_INPUTS)
OPTIMIZERS = ("adam", "sgd_schedule", "loss_scale", "accumulation", "ema", "multi")
CALLBACKS = (
    "lr_scheduler",
    "reduce_lr",
    "early_stopping",
    "model_checkpoint",
    "custom_state",
    "custom_nostate",
)
STATEFUL = ("reduce_lr", "early_stopping", "model_checkpoint", "custom_state", "swap_ema")
RESUMES = ("same_seed", "other_seed", "unseeded", "decoy", "cross_backend", "batch_changed")
#: Features shown in the docs table (config key -> label).
FEATURES = {
    "input": "input",
    "optimizer": "optimizer",
    "mixed_precision": "mixed_float16",
    "callbacks": "callback",
    "resume": "resume",
    "outputs": "outputs",
    "metrics": "metrics",
    "steps_per_execution": "steps_per_execution",
    "jit_compile": "jit_compile",
    "save_freq": "save_freq",
    "validation": "validation",
    "weights": "weights",
    "loader_workers": "DataLoader num_workers",
    "drop_last": "drop_last",
    "loader_augment": "random __getitem__",
    "kill": "kill point",
}

# -- drawing ---------------------------------------------------------------------------


def _rng(seed, index, backend):
    return np.random.default_rng([int(seed), int(index), zlib.crc32(backend.encode())])


def _pick(rng, options, p=None):
    if p is not None:
        p = np.asarray(p, dtype=float)
        p = p / p.sum()
    return options[int(rng.choice(len(options), p=p))]


def draw_case(seed, index, backend, scenarios=None):
    """The case ``index`` of ``seed`` on ``backend``: a JSON-serializable dict. Only
    configurations Keras supports on that backend are drawn (``steps_per_execution > 1``
    and ``jit_compile=True`` not on Torch). ``scenarios`` fixes how many kill scenarios
    share the reference (default: 1 to 3, drawn).

    A second stream (its own seed from the same three) decides whether the case takes one
    of issue 33's input kinds (``matrix_inputs.NEW_INPUTS``) and draws that input's options:
    a case that keeps one of :data:`INPUTS` is the one earlier versions drew, field for field,
    and those kinds keep their relative weights."""
    second = np.random.default_rng([int(seed), int(index), zlib.crc32(backend.encode()), 33])
    new = sum(mi.NEW_INPUTS.values())
    if second.random() >= new / (sum(INPUT_WEIGHTS) + new):
        return _draw(_rng(seed, index, backend), seed, index, backend, scenarios)
    kind = _pick(second, tuple(mi.NEW_INPUTS), p=list(mi.NEW_INPUTS.values()))
    c = _draw(_rng(seed, index, backend), seed, index, backend, scenarios, kind)
    mi.draw_options(second, c)
    if c.get("drop_last"):  # fewer batches: the kill points drawn again
        n = len(c["scenarios"])
        c["scenarios"] = [_draw_kills(second, c) for _ in range(n)]
    return c


def _draw(rng, seed, index, backend, scenarios, kind=None):
    """:func:`draw_case` from the stream ``rng``; ``kind`` replaces the drawn input."""
    c = {"seed": int(seed), "index": int(index), "backend": backend}
    c["run_seed"] = int(rng.integers(0, 2**16))
    c["features"] = int(rng.integers(4, 9))
    c["samples"] = int(rng.choice([32, 48, 64, 80, 96]))
    c["batch_size"] = int(rng.choice([8, 12, 16]))
    c["epochs"] = int(rng.integers(2, 5))
    c["input"] = _pick(rng, INPUTS, p=INPUT_WEIGHTS)
    if kind is not None:
        c["input"] = kind
    c["task"] = _pick(rng, ("regression", "classification"), p=[3, 1])
    c["outputs"] = (
        "single"
        if c["task"] == "classification"
        else _pick(rng, ("single", "two_auto", "two_named"), p=[3, 1, 1])
    )
    c["dropout"] = bool(rng.random() < 0.4)
    c["metrics"] = _pick(rng, ("none", "metrics", "weighted_metrics", "both"), p=[2, 2, 1, 1])
    c["jit_compile"] = (
        _pick(rng, ("auto", True, False)) if backend != "torch" else _pick(rng, ("auto", False))
    )
    c["steps_per_execution"] = 1 if backend == "torch" else int(_pick(rng, (1, 1, 2)))
    c["optimizer"] = _pick(rng, OPTIMIZERS, p=[3, 1.5, 1, 1, 1, 1])
    cbs = [name for name in CALLBACKS if rng.random() < 0.3]
    if c["optimizer"] in ("sgd_schedule", "multi"):  # no settable learning rate: a schedule, groups
        cbs = [n for n in cbs if n not in ("lr_scheduler", "reduce_lr", "custom_state", "custom_nostate")]
    c["callbacks"] = cbs
    c["callbacks_passed"] = bool(rng.random() < 0.85)
    spe = c["steps_per_execution"]
    c["save_freq"] = "epoch" if rng.random() < 0.4 else int(spe * rng.integers(1, 4))
    numpy_input = c["input"].startswith("numpy")
    c["validation"] = _pick(
        rng, ("none", "validation_data", "validation_split") if numpy_input else ("none", "validation_data")
    )
    c["validation_freq"] = int(_pick(rng, (1, 2))) if c["validation"] != "none" else 1
    weights = ["none"]
    if numpy_input and c["outputs"] == "single":
        weights.append("sample_weight")
        if c["task"] == "classification":
            weights.append("class_weight")
    c["weights"] = _pick(rng, tuple(weights))
    if c["input"] == "tfdata_repeat_steps":  # epochs straddle the stream's passes
        c["steps_per_epoch"] = max(1, math.ceil(c["samples"] / c["batch_size"]) - 1)
    elif c["input"] == "tfdata_take":
        c["take"] = max(1, math.ceil(c["samples"] / c["batch_size"]) - 2)
    resumes = list(RESUMES)
    if c["input"] in ("tfdata_repeat_steps", "tfdata_take", "generator") or c["input"].startswith(
        ("pydataset", "grain_iter")
    ):
        resumes.remove("batch_changed")
    c["resume"] = _pick(rng, tuple(resumes))
    if c["resume"] == "cross_backend":
        others = [b for b in BACKENDS if b != backend]
        ok = [b for b in others if b != "torch" or (spe == 1 and c["jit_compile"] is not True)]
        c["resume_backend"] = _pick(rng, tuple(ok))
    if c["resume"] == "batch_changed":
        c["resume_batch_size"] = int(_pick(rng, tuple(b for b in (8, 12, 16) if b != c["batch_size"])))
    c["other_seed"] = int(rng.integers(2**16, 2**17))
    n = int(rng.integers(1, 4)) if scenarios is None else int(scenarios)
    c["scenarios"] = [_draw_kills(rng, c) for _ in range(n)]
    # Drawn last so that the fields above stay those of earlier versions of the generator.
    # float16 compute differs between backends by far more than the 1e-5 of a float32
    # cross-backend comparison: mixed precision is drawn for same-backend resumes only.
    c["mixed_precision"] = bool(
        c["optimizer"] == "loss_scale" and c["resume"] != "cross_backend" and rng.random() < 0.6
    )
    return c


def steps_per_epoch(c):
    """Training batches per epoch of the case's input."""
    if "steps_per_epoch" in c:
        return c["steps_per_epoch"]
    if "take" in c:
        return c["take"]
    n = c["samples"]
    if c["validation"] == "validation_split":
        n = int(n * (1 - 0.25))
    return mi.batches(c, n, c["batch_size"])


def execution_ends(c):
    """Every global step (1-based count of batches applied) at which the batch callbacks
    run, i.e. the possible kill points: ends of executions and of epochs."""
    spe, k = steps_per_epoch(c), c["steps_per_execution"]
    ends = []
    for e in range(c["epochs"]):
        ends += [e * spe + min(j * k, spe) for j in range(1, math.ceil(spe / k) + 1)]
    return ends


def _draw_kills(rng, c):
    ends = execution_ends(c)
    spe = steps_per_epoch(c)
    kind = _pick(rng, ("any", "epoch_last", "two_in_one_epoch"), p=[3, 1, 1])
    if c["resume"] == "batch_changed":
        kind = "any" if kind == "two_in_one_epoch" else kind
    if kind == "epoch_last":
        return {"kind": kind, "steps": [spe * int(rng.integers(1, c["epochs"] + 1))]}
    if kind == "two_in_one_epoch":
        e = int(rng.integers(0, c["epochs"]))
        inside = [s for s in ends if e * spe < s <= (e + 1) * spe]
        if len(inside) >= 2:
            pair = sorted(int(s) for s in rng.choice(inside, size=2, replace=False))
            return {"kind": kind, "steps": pair}
        kind = "any"
    return {"kind": kind, "steps": [int(rng.choice(ends))]}


def case_id(c):
    return f"{c['backend']}-s{c['seed']}-i{c['index']}"


def frameworks_needed(c):
    """The packages case ``c`` runs on: its backend, the backend it resumes on, and its
    input's (``matrix_inputs.frameworks``: TensorFlow for ``tf.data`` on every backend,
    Torch for a ``DataLoader``, torchdata, grain)."""
    needed = {c["backend"], c.get("resume_backend", c["backend"])}
    needed.update(mi.frameworks(c["input"]))
    return tuple(sorted(needed))


def frameworks_missing(c):
    """The packages case ``c`` needs that are not installed here (it is then not run:
    counted ``SKIPPED``)."""
    import importlib.util

    return [name for name in frameworks_needed(c) if importlib.util.find_spec(name) is None]


def describe(c):
    """One line naming the drawn configuration (for test ids and failure messages)."""
    keys = (
        "input",
        "optimizer",
        "mixed_precision",
        "callbacks",
        "resume",
        "outputs",
        "metrics",
        "save_freq",
        "validation",
        "weights",
    )
    parts = [f"{k}={c[k]}" for k in keys]
    parts += [f"{k}={c[k]}" for k in ("loader_workers", "drop_last", "loader_augment") if k in c]
    parts.append(
        f"spe={c['steps_per_execution']} jit={c['jit_compile']} kills={[s['steps'] for s in c['scenarios']]}"
    )
    return " ".join(parts)


# -- planning ---------------------------------------------------------------------------


def _phases_of(c, workdir):
    """The process chain of one case: a list of processes, each ``(backend, [phase])``."""
    backend = c["backend"]
    resume_backend = c.get("resume_backend", backend)
    resume_seed = {"other_seed": c["other_seed"], "unseeded": None}.get(c["resume"], c["run_seed"])
    base = {"case": case_id(c), "workdir": workdir}
    procs = []
    # The reference, then the same fit without the library (the invariance check).
    current = [
        dict(base, kind="ref", name="ref", seed=c["run_seed"], kill_at=None),
        dict(base, kind="plain", name="plain", seed=c["run_seed"], kill_at=None),
    ]
    for s, scen in enumerate(c["scenarios"]):
        ck = os.path.join(workdir, f"ckpt{s}")
        fresh = dict(
            base,
            kind="fresh",
            name=f"s{s}.fresh",
            scenario=s,
            seed=c["run_seed"],
            ckpt=ck,
            kill_at=scen["steps"][0],
        )
        current.append(fresh)
        procs.append((backend, current))
        resume = dict(
            base, kind="resume", scenario=s, seed=resume_seed, ckpt=ck, decoy=c["resume"] == "decoy"
        )
        if c["resume"] == "batch_changed":
            resume["batch_size"] = c["resume_batch_size"]
        for j, step in enumerate(scen["steps"][1:], 1):
            procs.append((resume_backend, [dict(resume, name=f"s{s}.resume{j}", kill_at=step)]))
        current = [dict(resume, name=f"s{s}.resume", kill_at=None)]
        if resume_backend != backend:
            procs.append((resume_backend, current))
            current = []
    if current:
        procs.append((backend, current))
    return procs


def plan_processes(cases, root):
    """Child processes for ``cases``: ``[(backend, [phase, ...]), ...]``. A case's last
    process (it begins with a resume) also runs the next case's reference and first killed
    run when both are on the same backend, so N one-scenario cases take N + 1 processes."""
    procs = []
    for c in cases:
        chain = _phases_of(c, os.path.join(root, case_id(c)))
        if procs and procs[-1][0] == chain[0][0] and procs[-1][1][-1].get("kill_at") is None:
            procs[-1] = (procs[-1][0], procs[-1][1] + chain[0][1])
            chain = chain[1:]
        procs += chain
    return procs


def _env(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def run_cases(cases, root=None, timeout=600, log=None):
    """Run every case's phases in child processes; ``{case_id: [scenario result]}``
    (``SKIPPED`` for a case whose packages are not all installed)."""
    root = root or tempfile.mkdtemp(prefix="kss-matrix-")
    skipped = {case_id(c): skip(c) for c in cases if frameworks_missing(c)}
    cases = [c for c in cases if case_id(c) not in skipped]
    by_id = {case_id(c): c for c in cases}
    for c in cases:
        os.makedirs(os.path.join(root, case_id(c)), exist_ok=True)
    procs = plan_processes(cases, root)
    unkilled = set()  # (case, scenario) whose killed run ended without reaching its kill point
    child_errors = {}
    for p, (backend, phases) in enumerate(procs):
        phases = [
            ph for ph in phases if ph["kind"] != "resume" or (ph["case"], ph["scenario"]) not in unkilled
        ]
        phases = [ph for ph in phases if (ph["case"], ph.get("scenario")) not in child_errors]
        if not phases:
            continue
        plan = os.path.join(root, f"plan-{phases[0]['case']}-{p}.json")
        with open(plan, "w") as f:
            json.dump({"cases": {ph["case"]: by_id[ph["case"]] for ph in phases}, "phases": phases}, f)
        t0 = time.time()
        try:
            done = subprocess.run(
                [sys.executable, CHILD, plan],
                env=_env(backend),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as err:
            rc, tail = "timeout", str(err)[-3000:]
        if log:
            log(
                f"  process {p} ({backend}, {[ph['case'] + ':' + ph['name'] for ph in phases]}): rc={rc} {time.time() - t0:.1f}s"
            )
        for ph in phases:
            rec = read_record(ph)
            if ph.get("kill_at") is not None and rec is not None and rec["status"] == "completed":
                unkilled.add((ph["case"], ph["scenario"]))
        killed_last = phases[-1].get("kill_at") is not None and rc == -signal.SIGKILL
        if rc != 0 and not killed_last:
            for ph in phases:
                if read_record(ph) is None or read_record(ph)["status"] == "killed":
                    child_errors[(ph["case"], ph.get("scenario"))] = (
                        f"child rc={rc} before/at phase {ph['name']}: {tail}"
                    )
                    if ph["kind"] == "ref":
                        for s in range(len(by_id[ph["case"]]["scenarios"])):
                            child_errors[(ph["case"], s)] = child_errors[(ph["case"], None)]
                    break
    results = {cid: classify(c, os.path.join(root, cid), unkilled, child_errors) for cid, c in by_id.items()}
    return {**results, **skipped}


def skip(c):
    """The ``SKIPPED`` results of case ``c``, naming the packages it lacks."""
    why = f"needs {', '.join(frameworks_missing(c))}, not installed"
    return [
        {
            "case": case_id(c),
            "seed": c["seed"],
            "index": c["index"],
            "backend": c["backend"],
            "scenario": s,
            "kills": scen["steps"],
            "kill_kind": scen["kind"],
            "causes": [],
            "problems": [why],
            "outcome": "SKIPPED",
            "invariance": "NOT_RUN",
            "invariance_problems": [why],
        }
        for s, scen in enumerate(c["scenarios"])
    ]


def read_record(phase):
    path = os.path.join(phase["workdir"], phase["name"] + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# -- comparison -------------------------------------------------------------------------


def tolerance(c):
    return 1e-5 if c.get("resume_backend", c["backend"]) != c["backend"] else 1e-6


def _load(workdir, name):
    with open(os.path.join(workdir, name + ".json")) as f:
        rec = json.load(f)
    path = os.path.join(workdir, name + ".npz")
    rec["arrays"] = dict(np.load(path)) if os.path.exists(path) else {}
    return rec


def _close(a, b, tol):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False, float("inf")
    if a.size == 0:
        return True, 0.0
    diff = float(np.max(np.abs(a - b)))
    return bool(np.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)), diff


def compare(ref, out, tol):
    """Differences between two phase outputs: variables by position and History; ``[]`` if equal."""
    problems = []
    for group in ("w", "o"):
        ra = sorted((k for k in ref["arrays"] if k.startswith(group + ":")), key=lambda k: int(k[2:]))
        oa = sorted((k for k in out["arrays"] if k.startswith(group + ":")), key=lambda k: int(k[2:]))
        label = "model.weights" if group == "w" else "optimizer.variables"
        if len(ra) != len(oa):
            problems.append(f"{label}: {len(ra)} variables in the reference, {len(oa)} resumed")
            continue
        for k in ra:
            ok, diff = _close(ref["arrays"][k], out["arrays"][k], tol)
            if not ok:
                problems.append(
                    f"{label}[{k[2:]}] ({ref['names'][group][int(k[2:])]}): max |diff| {diff:.3g}"
                )
    # History keys embed the output names, which are auto-named (dense_3) when the output
    # layers have no names: each run's keys are those of its own model, so compare them with
    # the outputs numbered by position.
    rh, oh = _by_position(ref["history"], ref), _by_position(out["history"], out)
    if sorted(rh) != sorted(oh):
        problems.append(f"History keys: reference {sorted(rh)}, resumed {sorted(oh)}")
    else:
        for k in rh:
            ok, diff = _close(rh[k], oh[k], tol)
            if not ok:
                problems.append(f"History[{k!r}]: max |diff| {diff:.3g} ({rh[k]} vs {oh[k]})")
    if ref["epoch"] != out["epoch"]:
        problems.append(f"History.epoch: reference {ref['epoch']}, resumed {out['epoch']}")
    for e, lr in out["lr"].items():
        if e in ref["lr"] and (ref["lr"][e] is None) != (lr is None):
            problems.append(f"learning rate at epoch {e}: reference {ref['lr'][e]}, resumed {lr}")
        elif e in ref["lr"] and lr is not None and not _close(ref["lr"][e], lr, tol)[0]:
            problems.append(f"learning rate at epoch {e}: reference {ref['lr'][e]}, resumed {lr}")
    return problems


def _by_position(history, rec):
    names = rec.get("output_names") or []
    if len(names) < 2:
        return history
    order = sorted(range(len(names)), key=lambda i: -len(names[i]))  # longest first: dense_1 vs dense_10
    out = {}
    for key, values in history.items():
        prefix, rest = ("val_", key[4:]) if key.startswith("val_") else ("", key)
        for i in order:
            if rest.startswith(names[i] + "_"):
                rest = f"<output {i}>_" + rest[len(names[i]) + 1 :]
                break
        out[prefix + rest] = values
    return out


def _causes(rec):
    return [f"{w['category']}: {w['message']}" for w in rec["warnings"] if w["at_begin"]]


#: ``{(input kind, backend): why}``: inputs whose run without the library is not repeatable
#: bit for bit, so that a difference of the reference from the plain run says nothing about
#: the library. A ``tf.py_function`` drawing from NumPy's global generator on JAX and Torch:
#: their ``fit`` takes one batch from a first iterator of the dataset to build the model
#: (``_symbolic_build(iterator=epoch_iterator)``, then ``epoch_iterator.reset()``,
#: keras/src/backend/{jax,torch}/trainer.py), and how many elements that discarded iterator's
#: prefetch runs through the function before it is dropped depends on thread timing (measured
#: on seed 26, torch case 9: five runs of the plain fit alone, pinned to one busy core, gave
#: three different results).
UNREPEATABLE_INPUTS = {
    ("tfdata_py_function", b): (
        f"unrepeatable without the library: on {b}, fit's first iterator (it builds the model) "
        "prefetches a timing-dependent number of elements through the py_function, each drawing "
        "from NumPy's global generator"
    )
    for b in ("jax", "torch")
}


#: What stock Keras itself fails at, at random, without the library: ``(why, test)`` where
#: ``test(c, error)`` says whether an error of a phase of case ``c`` is it. Keras on
#: TensorFlow iterates a torch ``DataLoader`` in tf.data's ``from_generator`` thread; with
#: ``num_workers > 0`` its workers die at random there ("DataLoader worker ... exited
#: unexpectedly with exit code 1"): 2 of 8 plain 3-epoch fits without keras_stable_state
#: (tests/fit/test_fit_torch_inputs.py skips its worker tests on TensorFlow for it; seed 27,
#: tensorflow case 17 met it in a killed run). No comparison can be made where it happens.
STOCK_FAILURES = (
    (
        "stock Keras on TensorFlow: a torch DataLoader worker died in tf.data's generator thread "
        "(it does without keras_stable_state too: 2 of 8 plain fits), so this run cannot be compared",
        lambda c, error: (
            bool(c.get("loader_workers"))
            and "tensorflow" in (c["backend"], c.get("resume_backend"))
            and "DataLoader worker" in str((error or {}).get("message"))
            and "exited unexpectedly" in str((error or {}).get("message"))
        ),
    ),
)


def stock_failure(c, error):
    """Why ``error`` (a phase record's ``error``) of case ``c`` is one of `STOCK_FAILURES`;
    ``None`` if it is not."""
    return next((why for why, test in STOCK_FAILURES if c is not None and test(c, error)), None)


def invariance(workdir, c=None):
    """``(outcome, problems)`` of the invariance check of a case: its uninterrupted fit with
    ``StableCheckpoint`` (``ref``) against the same fit without the library (``plain``),
    every variable by position, History and learning rate equal bit for bit. Outcomes:
    ``SAME``, ``DIFFERENT`` (an invariance failure), ``UNREPEATABLE`` (they differ and case
    ``c``'s input on its backend is in `UNREPEATABLE_INPUTS`, or one raised one of
    `STOCK_FAILURES`: the why comes first in the problems), ``ERROR`` (the plain fit raised,
    or the reference did and the plain one did not) and ``NOT_RUN`` (neither completed, or the plain run is missing: the child died
    first)."""
    try:
        ref, plain = _load(workdir, "ref"), _load(workdir, "plain")
    except (OSError, ValueError) as e:
        return "NOT_RUN", [f"no reference or plain run: {e}"]
    done = (ref["status"] == "completed", plain["status"] == "completed")
    if done == (True, True):
        problems = compare(ref, plain, 0.0)
        why = UNREPEATABLE_INPUTS.get((c["input"], c["backend"])) if c else None
        if problems and why:
            return "UNREPEATABLE", [why, *problems]
        return ("DIFFERENT" if problems else "SAME"), problems
    if done == (False, False):
        return "NOT_RUN", [f"neither run completed: {ref.get('error')}"]
    bad = plain if done[0] else ref
    why = stock_failure(c, bad.get("error"))
    if why:
        return "UNREPEATABLE", [why, f"{(bad.get('error') or {}).get('message')}"]
    which = "without" if done[0] else "with"
    return "ERROR", [f"only the fit {which} the library raised: {(bad.get('error') or {}).get('message')}"]


def classify(c, workdir, unkilled=(), child_errors=None):
    """One result per scenario of case ``c`` (its phase files are in ``workdir``); each
    carries the case's invariance outcome (:func:`invariance`), never folded into its own."""
    child_errors = child_errors or {}
    cid = case_id(c)
    inv, inv_problems = invariance(workdir, c)
    results = []
    for s, scen in enumerate(c["scenarios"]):
        res = {"case": cid, "seed": c["seed"], "index": c["index"], "backend": c["backend"], "scenario": s}
        res.update(kills=scen["steps"], kill_kind=scen["kind"], causes=[], problems=[])
        res.update(invariance=inv, invariance_problems=inv_problems)
        results.append(res)
        err = child_errors.get((cid, s)) or child_errors.get((cid, None))
        try:
            ref = _load(workdir, "ref")
        except (OSError, ValueError) as e:
            res.update(outcome="HARNESS_ERROR", problems=[err or f"no reference: {e}"])
            continue
        if ref["status"] != "completed":
            why = stock_failure(c, ref.get("error"))
            res.update(
                outcome="SKIPPED" if why else "HARNESS_ERROR",
                problems=[why or f"reference: {ref.get('error')}"],
            )
            continue
        names = [f"s{s}.fresh"] + [f"s{s}.resume{j}" for j in range(1, len(scen["steps"]))] + [f"s{s}.resume"]
        if (cid, s) in unkilled:
            names = [n for n in names if os.path.exists(os.path.join(workdir, n + ".json"))]
            res["kill_not_reached"] = True
        try:
            recs = [_load(workdir, n) for n in names]
        except (OSError, ValueError) as e:
            res.update(outcome="HARNESS_ERROR", problems=[err or f"missing phase output: {e}"])
            continue
        fresh, resumes = recs[0], recs[1:]
        if fresh["status"] == "error":
            why = stock_failure(c, fresh["error"])
            res.update(
                outcome="SKIPPED" if why else "HARNESS_ERROR",
                problems=[why or f"killed run: {fresh['error']}"],
            )
            continue
        res["fresh_warnings"] = _causes(fresh)
        for r in resumes:
            res["causes"] += _causes(r)
        refused = [r for r in resumes if r["status"] == "error" and r["error"]["refused_at_begin"]]
        crashed = [r for r in resumes if r["status"] == "error" and not r["error"]["refused_at_begin"]]
        if refused:
            msg = refused[0]["error"]["message"]
            res["causes"].append(f"{refused[0]['error']['type']}: {msg}")
            res["outcome"] = "REFUSED" if msg.strip() else "CRASH"
            continue
        if crashed and stock_failure(c, crashed[0]["error"]):
            res.update(outcome="SKIPPED", problems=[stock_failure(c, crashed[0]["error"])])
            continue
        if crashed:
            e = crashed[0]["error"]
            res.update(outcome="CRASH", problems=[f"{e['type']}: {e['message']}\n{e['traceback'][-1500:]}"])
            continue
        final = recs[-1]
        if final["status"] != "completed":
            res.update(outcome="HARNESS_ERROR", problems=[f"last phase {names[-1]} {final['status']}"])
            continue
        res["problems"] = compare(ref, final, tolerance(c))
        warned = any(_causes(r) for r in resumes)
        res["outcome"] = "WARNED" if warned else ("EXACT" if not res["problems"] else "SILENT")
        ignored = [r for r in resumes if r.get("checkpoints_before") and r.get("restored") is False]
        if ignored:
            res["problems"].insert(0, f"checkpoints {ignored[0]['checkpoints_before']} were not restored")
            res["outcome"] = "SILENT"
        elif res["outcome"] == "SILENT" and not resumes[0].get("checkpoints_before"):
            # Killed before the first save: nothing to resume, the rerun (and what later kills
            # of it saved) started afresh under the resume's seed, after a decoy model or on
            # another backend, which the library does not decide.
            res["outcome"] = "NOTHING_SAVED"
    return results


def false_refusals(results, cases):
    """Mark ``REFUSED`` results as ``FALSE_REFUSAL`` when another scenario of the same case
    (another kill point) resumed ``EXACT`` without warning. A scenario whose killed run ended
    before its kill point (``kill_not_reached``) resumed nothing, so its EXACT is no evidence."""
    for rs in results.values():
        if any(r["outcome"] == "EXACT" and not r.get("kill_not_reached") for r in rs):
            for r in rs:
                if r["outcome"] == "REFUSED":
                    r["outcome"] = "FALSE_REFUSAL"
    return results


def kinds(c):
    """The feature values of a case (for the summary of SILENT results per kind)."""
    out = {}
    for key in FEATURES:
        if key == "kill" or key not in c:  # the options of one input kind only on its cases
            continue
        v = c[key]
        if key == "resume" and v == "cross_backend":
            v = f"cross_backend->{c['resume_backend']}"
        if key == "callbacks":
            v = [
                f"{n}{'' if c['callbacks_passed'] or n not in STATEFUL else ' (not passed)'}" for n in v
            ] or ["none"]
        out[key] = v if isinstance(v, list) else [str(v)]
    return out


# -- builders (run in the child; Keras imported there) ----------------------------------


def make_data(c):
    """``(x, ys, xv, yvs)``: training and validation arrays (``ys`` a list, one per output),
    from the case's own seed, independent of Keras' random state."""
    rng = np.random.default_rng([c["seed"], c["index"], 7])
    n, f = c["samples"], c["features"]
    x = rng.normal(size=(n + 16, f)).astype("float32")
    if c["task"] == "classification":
        ys = [np.argmax(x @ rng.normal(size=(f, 3)), axis=1).astype("int32")]
    else:
        ys = [(x @ rng.normal(size=(f, 1)) + 0.1 * rng.normal(size=(n + 16, 1))).astype("float32")]
        if c["outputs"] != "single":
            ys.append(np.tanh(x @ rng.normal(size=(f, 2))).astype("float32"))
    return x[:n], [y[:n] for y in ys], x[n:], [y[n:] for y in ys]


def _targets(c, ys):
    return ys[0] if len(ys) == 1 else tuple(ys)


def build_model(c):
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16" if c.get("mixed_precision") else "float32")
    inp = keras.Input((c["features"],))
    h = keras.layers.Dense(8, activation="relu")(inp)
    if c["dropout"]:
        h = keras.layers.Dropout(0.3)(h)
    if c["task"] == "classification":
        outs = [keras.layers.Dense(3, activation="softmax", dtype="float32")(h)]
    else:
        names = (None, None) if c["outputs"] != "two_named" else ("out_a", "out_b")
        outs = [keras.layers.Dense(1, name=names[0], dtype="float32")(h)]
        if c["outputs"] != "single":
            outs.append(keras.layers.Dense(2, name=names[1], dtype="float32")(h))
    return keras.Model(inp, outs[0] if len(outs) == 1 else outs)


def build_optimizer(c):
    import keras

    kind = c["optimizer"]
    if kind == "sgd_schedule":
        return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.8), momentum=0.9)
    if kind == "loss_scale":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**8)
    if kind == "accumulation":
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
    if kind == "ema":
        return keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9)
    if kind == "multi":
        return keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(
                keras.optimizers.SGD(1e-2, momentum=0.9), {".*dense/.*": keras.optimizers.Adam(1e-2)}
            )
        )
    return keras.optimizers.Adam(0.01)


def compile_model(model, c, stable=True):
    """Compile ``model`` for case ``c``, its optimizer in a ``StableOptimizer`` unless
    ``stable`` is false (the run without the library)."""
    import keras

    import keras_stable_state as kss

    n_out = 1 if c["outputs"] == "single" else 2
    loss = "sparse_categorical_crossentropy" if c["task"] == "classification" else "mse"
    metric = "accuracy" if c["task"] == "classification" else "mae"
    per = (lambda m: [m]) if n_out == 1 else (lambda m: [[m]] * n_out)
    kw = {}
    if c["metrics"] in ("metrics", "both"):
        kw["metrics"] = per(metric)
    if c["metrics"] in ("weighted_metrics", "both"):
        kw["weighted_metrics"] = per("mse" if c["task"] == "regression" else "accuracy")
    optimizer = build_optimizer(c)
    if stable and c["optimizer"] == "loss_scale" and c.get("mixed_precision"):
        # Under mixed_float16 Keras wraps any optimizer that is not a LossScaleOptimizer in one:
        # StableOptimizer(LossScaleOptimizer(...)) would scale the loss twice (docs: mixed
        # precision), so the loss scaling goes outside, as a user writes it.
        inner = kss.StableOptimizer(optimizer.inner_optimizer, model=model)
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=optimizer.initial_scale)
    elif stable:
        optimizer = kss.StableOptimizer(optimizer, model=model)
    model.compile(
        optimizer=optimizer,
        loss=loss if n_out == 1 else [loss] * n_out,
        jit_compile=c["jit_compile"],
        steps_per_execution=c["steps_per_execution"],
        **kw,
    )


class _Custom:
    """Factory of the custom callbacks: halve the learning rate every second epoch,
    counting epochs in ``seen`` (saved through get_state/set_state, or not)."""

    @staticmethod
    def make(with_state):
        import keras

        class EveryOtherEpoch(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seen = 0

            def on_epoch_end(self, epoch, logs=None):
                self.seen += 1
                if self.seen % 2 == 0:
                    opt = self.model.optimizer
                    opt.learning_rate = float(keras.ops.convert_to_numpy(opt.learning_rate)) * 0.5

        if not with_state:
            return EveryOtherEpoch()

        class EveryOtherEpochWithState(EveryOtherEpoch):
            def get_state(self):
                return {"seen": self.seen}

            def set_state(self, state):
                self.seen = int(state["seen"])

        return EveryOtherEpochWithState()


def custom_callback(with_state):
    """The matrix's custom callback, with ``get_state``/``set_state`` or without."""
    return _Custom.make(with_state)


def build_callbacks(c, workdir):
    """``{name: callback}`` of the case's user callbacks (fresh objects)."""
    import keras

    out = {}
    for name in c["callbacks"]:
        if name == "lr_scheduler":
            out[name] = keras.callbacks.LearningRateScheduler(lambda epoch, lr: float(lr) * 0.8)
        elif name == "reduce_lr":
            out[name] = keras.callbacks.ReduceLROnPlateau(
                monitor="loss", patience=1, factor=0.5, min_delta=0.05
            )
        elif name == "early_stopping":
            out[name] = keras.callbacks.EarlyStopping(
                monitor="loss", patience=1, min_delta=0.05, restore_best_weights=True
            )
        elif name == "model_checkpoint":
            path = os.path.join(workdir, "mc.weights.h5")
            out[name] = keras.callbacks.ModelCheckpoint(
                path, monitor="loss", save_best_only=True, save_weights_only=True
            )
        elif name in ("custom_state", "custom_nostate"):
            out[name] = _Custom.make(name == "custom_state")
    if c["optimizer"] == "ema":
        out["swap_ema"] = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
    return out


def build_fit_inputs(c, batch_size):
    """``fit`` keyword arguments of the case's input (fresh objects: datasets, generators)."""
    import keras

    x, ys, xv, yvs = make_data(c)
    kind, b = c["input"], batch_size
    y = _targets(c, ys)
    kw = {}
    if kind.startswith("numpy"):
        kw.update(x=x, y=y, batch_size=b, shuffle=kind == "numpy_shuffle")
        if c["weights"] == "sample_weight":
            kw["sample_weight"] = np.linspace(0.5, 1.5, len(x)).astype("float32")
        elif c["weights"] == "class_weight":
            kw["class_weight"] = {0: 1.0, 1: 2.0, 2: 0.5}
        if c["validation"] == "validation_split":
            kw["validation_split"] = 0.25
    elif kind.startswith("tfdata"):
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if kind == "tfdata_shuffle_fixed":
            ds = ds.shuffle(len(x), seed=7, reshuffle_each_iteration=False)
        elif kind == "tfdata_reshuffle":
            ds = ds.shuffle(len(x), seed=7, reshuffle_each_iteration=True)
        ds = mi.tfdata_extra(c, ds).batch(b)
        if kind == "tfdata_repeat_steps":
            ds = ds.repeat()
            kw["steps_per_epoch"] = c["steps_per_epoch"]
        elif kind == "tfdata_take":
            ds = ds.take(c["take"])
        kw["x"] = ds
    elif kind.startswith("pydataset"):
        kw["x"] = _pydataset(c, x, ys, b)
        kw["shuffle"] = False
    elif kind == "generator":
        kw["x"] = _generator(x, ys, b)
        kw["steps_per_epoch"] = math.ceil(len(x) / b)
    elif mi.is_loader(kind):
        kw["x"] = mi.torch_loader(c, x, ys, b)
    elif mi.is_grain(kind):
        kw["x"] = mi.grain_input(c, x, ys, b)
    if c["validation"] == "validation_data":
        kw["validation_data"] = (xv, _targets(c, yvs))
    if c["validation"] != "none":
        kw["validation_freq"] = c["validation_freq"]
    del keras
    return kw


def _generator(x, ys, b):
    while True:
        for i in range(0, len(x), b):
            yield x[i : i + b], (ys[0][i : i + b] if len(ys) == 1 else tuple(y[i : i + b] for y in ys))


def _pydataset(c, x, ys, b):
    import keras

    kind = c["input"]
    workers = {"pydataset_threads": 2, "pydataset_processes": 2}.get(kind, 1)

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=workers, use_multiprocessing=kind == "pydataset_processes")
            self.order = np.arange(len(x))

        def __len__(self):
            return math.ceil(len(x) / b)

        def __getitem__(self, i):
            idx = self.order[i * b : (i + 1) * b]
            t = ys[0][idx] if len(ys) == 1 else tuple(y[idx] for y in ys)
            return x[idx], t

    if kind not in ("pydataset_shuffle_state", "pydataset_shuffle_nostate"):
        return Batches()

    class Shuffled(Batches):
        def on_epoch_end(self):
            self.order = np.random.permutation(len(x))

    if kind == "pydataset_shuffle_nostate":
        return Shuffled()

    class ShuffledWithState(Shuffled):
        def get_state(self):
            return {"order": self.order}

        def set_state(self, state):
            self.order = np.array(state["order"])

    return ShuffledWithState()
