"""Restores under memory pressure: with the address space limited (``RLIMIT_AS``, in a child
process) to the child's own baseline plus ``k`` times the training state, for ``k`` from
1.1 to 3, every attempt either restores exactly or raises a ``StateError`` saying that
memory ran out, naming the file, with every model and optimizer variable unchanged.

The child builds the model, saves its state, then for each ``k`` puts the variables back to
values of its own (``before``), measures its address space (``VmSize``: after imports,
the model, the file and both sets of expected values), lowers the soft limit, restores,
lifts the limit and compares every variable by position with ``before`` or the saved
values. A crash or hang of the child is a failure (it runs under a timeout).

``make test`` tries a few ``k``; ``KSS_MEMORY_LIMITS=20`` (``make fuzz``) tries 20, evenly
spaced from 1.1 to 3; then ``k = 5``, where every backend has room to restore.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND
from kit import ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/status are Linux's")


# glibc keeps freed memory of a few MiB mapped for reuse (its mmap threshold grows up to
# 32 MiB), which would make the measured baseline hold room the limit does not count:
# every allocation above 64 KiB is its own mapping, unmapped when freed.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": "0"}
# A limit with room enough for every backend (TensorFlow's allocator needs the most).
ROOMY = 5.0


def _factors() -> list:
    count = int(os.environ.get("KSS_MEMORY_LIMITS", "0"))
    if count > 0:
        return [round(float(k), 3) for k in np.linspace(1.1, 3.0, count)]
    return [1.1, 1.6, 2.2, 3.0]


# The child: one process, every factor in turn (the first one with nothing warmed up).
CHILD = r"""
import json, os, resource, sys
path, factors, width = sys.argv[1], [float(k) for k in sys.argv[2].split(",")], int(sys.argv[3])
import keras
import numpy as np
import keras_stable_state as kss

keras.utils.set_random_seed(7)
model = keras.Sequential(
    [keras.Input((width,))] + [keras.layers.Dense(width, name=f"d{i}") for i in range(4)]
    + [keras.layers.Dense(1, name="out")]
)
model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-3), model=model), loss="mse")
model.optimizer.build(model.trainable_variables)
variables = list(model.weights) + list(model.optimizer.variables)
rng = np.random.default_rng(0)


def values():
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def put(arrays):
    for v, a in zip(variables, arrays):
        v.assign(a)


def fill(shift):
    out = []
    for v in variables:
        a = np.asarray(keras.ops.convert_to_numpy(v))
        if a.dtype.kind == "f":
            out.append((rng.standard_normal(a.shape) + shift).astype(a.dtype))
        else:
            out.append((np.zeros(a.shape) + 3 + shift).astype(a.dtype))
    return out


put(fill(0))
saved = values()
kss.save_training_state(path, model)
before = fill(10)
state_bytes = sum(a.nbytes for a in saved)


def vm_size():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


soft, hard = resource.getrlimit(resource.RLIMIT_AS)
for k in factors:
    put(before)
    base = vm_size()
    limit = int(base + k * state_bytes)
    outcome, message = None, ""
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        kss.restore_training_state(path, model)
        outcome = "restored"
    except kss.StateError as err:
        outcome, message = type(err).__name__, str(err)
    except BaseException as err:
        outcome, message = "raw " + type(err).__name__, repr(err)[:500]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    got = values()
    same_saved = [bool(np.array_equal(g, s)) for g, s in zip(got, saved)]
    same_before = [bool(np.array_equal(g, b)) for g, b in zip(got, before)]
    result = {
        "k": k,
        "state_mb": state_bytes / 2**20,
        "base_mb": base / 2**20,
        "outcome": outcome,
        "message": message,
        "saved": same_saved,
        "before": same_before,
    }
    print("RESULT " + json.dumps(result), flush=True)  # one line per attempt: a crash shows where
"""


def _run(tmp_path, factors, width):
    path = str(tmp_path / "state.h5")
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3", **_MALLOC}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, path, ",".join(map(str, factors)), str(width)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    results = [
        json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert done.returncode == 0 and len(results) == len(factors), (
        f"the child crashed (exit {done.returncode}) after {[(r['k'], r['outcome']) for r in results]}, at the "
        f"next limit of {factors}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    return path, results


@pytest.mark.slow
def test_restores_under_memory_limits_are_exact_or_refused_unchanged(tmp_path):
    factors = [*_factors(), ROOMY]
    path, results = _run(tmp_path, factors, width=1024)
    assert results[0]["state_mb"] > 40  # large enough that k x state dominates what else is allocated
    report = [(r["k"], r["outcome"], round(r["base_mb"]), r["message"][:160]) for r in results]
    for r in results:
        if r["outcome"] == "restored":
            assert all(r["saved"]), (r["k"], "restored, but variables differ from the file", report)
            continue
        assert r["outcome"] == "StateError", (r["k"], "not a StateError about memory", report)
        assert "ran out of memory" in r["message"] and repr(path) in r["message"], report
        unchanged = r["before"]
        assert all(unchanged), (
            r["k"],
            f"{unchanged.count(False)} of {len(unchanged)} variables changed",
            report,
        )
    # With room enough, the restore restores (the refusals above are about memory, not the file).
    assert results[-1]["outcome"] == "restored", report
    print(report)
