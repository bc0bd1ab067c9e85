"""The cross-backend transfer matrix: every writer/reader pair in {tensorflow, jax, torch}.

The matrix drives all three backends in subprocesses (tests/scripts/transfer.py), so it runs
once, in the pytest pass of the backend named by KSS_TRANSFER_BACKEND (default: torch, whose
several-frameworks pass is otherwise the shortest of the three that run at once), and is
skipped with that reason in the other passes.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import BACKEND
from kit import TESTS

SCRIPT = os.path.join(TESTS, "scripts", "transfer.py")
BACKENDS = ("tensorflow", "jax", "torch")
DRIVER = os.environ.get("KSS_TRANSFER_BACKEND", "torch")
CASES = ("dense", "mixed", "embedding", "wide")

pytestmark = [
    pytest.mark.frameworks(*BACKENDS),  # one writer and one reader process per backend
    pytest.mark.skipif(
        BACKEND != DRIVER,
        reason=f"the matrix drives all backends in subprocesses; it runs in the {DRIVER} pass",
    ),
]


def _spawn(backend, *args):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait(procs):
    for name, p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"{name} failed:\n{err[-3000:]}"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    _wait([(f"write {w}", _spawn(w, "write", str(root / w))) for w in BACKENDS])
    procs = []
    for r in BACKENDS:  # one reader process per backend reads the three writers' files in turn
        pairs = [str(p) for w in BACKENDS for p in (root / w, root / f"{w}_to_{r}")]
        procs.append((f"read on {r}", _spawn(r, "read", *pairs)))
    _wait(procs)
    out = {}
    for w in BACKENDS:
        for r in BACKENDS:
            for case in CASES:
                with open(root / f"{w}_to_{r}" / f"{case}.json") as fh:
                    out[w, r, case] = json.load(fh)
    return out


PAIRS = [(w, r) for w in BACKENDS for r in BACKENDS]


def _params(result):
    return {
        k: v for k, v in result["continued"].items() if k.startswith("model:") and "seed_generator" not in k
    }


@pytest.mark.parametrize("writer,reader", PAIRS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_restored_state_is_exact_and_every_cast_reported(matrix, writer, reader, case):
    res = matrix[writer, reader, case]
    assert res["writer"]["backend"] == writer and res["reader"] == reader
    assert res["writer"]["keras_version"]
    if writer != reader:
        assert f"written with backend {writer}, read with {reader}" in res["report"]
    not_equal = [k for k, v in res["restored"].items() if not v["value"]]
    assert not_equal == []
    casts = {c[0]: (c[1], c[2]) for c in res["casts"]}
    for key, v in res["restored"].items():
        if v["saved"] != v["live"]:
            entry = key.split(":", 1)[1]
            assert casts.get(entry) == (v["saved"], v["live"]), f"{key}: cast {v} not reported"
        else:
            assert v["bits"], f"{key}: same dtype but other bits"


@pytest.mark.parametrize("writer,reader", PAIRS)
@pytest.mark.slow
def test_float32_continuation_matches_writer(matrix, writer, reader):
    res = matrix[writer, reader, "dense"]
    worst = max(_params(res).items(), key=lambda kv: kv[1]["abs"])
    assert worst[1]["abs"] <= (0.0 if writer == reader else 1e-5), worst
    assert res["predict_max_abs"] <= 1e-5  # the .keras file loads with load_model and predicts the same


@pytest.mark.parametrize("writer,reader", PAIRS)
@pytest.mark.slow
def test_mixed_precision_continuation_matches_writer(matrix, writer, reader):
    res = matrix[writer, reader, "mixed"]
    worst = max(_params(res).items(), key=lambda kv: kv[1]["rel"])
    assert worst[1]["rel"] <= (0.0 if writer == reader else 1e-2), worst
    assert res["predict_max_abs"] <= 1e-2


@pytest.mark.parametrize("writer,reader", PAIRS)
@pytest.mark.slow
def test_embedding_continuation_same_backend_exact_other_backends_documented(matrix, writer, reader):
    worst = max(v["abs"] for v in _params(matrix[writer, reader, "embedding"]).values())
    if writer == reader:
        assert worst == 0.0
    else:
        # Backends update Embedding rows and draw Dropout masks differently; the
        # restored state is exact (test above) and docs/transfer.md gives the size.
        assert 0.0 < worst < 0.1


@pytest.mark.parametrize("writer,reader", PAIRS)
@pytest.mark.slow
def test_slots_shared_with_keras_weights_restore_on_every_backend(matrix, writer, reader):
    """The "wide" case's kernel slots (72 x 256 float32, over 64 KiB) are read from Keras'
    model.weights.h5 in the .keras file, and restore exactly (bits, or reported casts) above."""
    res = matrix[writer, reader, "wide"]
    assert sorted(res["shared_optimizer_keys"]) == [
        "path:layers/wide/kernel#momentums",
        "path:layers/wide/kernel#velocities",
    ]
    assert [k for k, v in res["restored"].items() if not v["value"]] == []
    assert res["predict_max_abs"] <= 1e-5
