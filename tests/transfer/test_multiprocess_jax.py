"""Two JAX processes x 2 CPU devices each (jax.distributed, gloo collectives), a model
sharded with keras.distribution.ModelParallel: save (.h5: process 0 writes; .orbax:
each process its shards), restore into a fresh model in a new pair of processes,
and compare with the saved arrays and the uninterrupted run. With Orbax, also a ``fit``
with ``StableCheckpoint("fit.orbax")`` whose two processes are SIGKILLed inside an epoch,
resumed by the next pair exactly.

The processes run tests/scripts/multiprocess_jax.py; they are killed if they hang.
"""

import os
import signal
import sys
import types

import numpy as np
import pytest
from conftest import BACKEND
from kit import TESTS, free_port, run_processes

pytestmark = pytest.mark.skipif(
    BACKEND != "jax", reason="jax.distributed is JAX's; TensorFlow and PyTorch have no keras.distribution"
)

SCRIPT = os.path.join(TESTS, "scripts", "multiprocess_jax.py")
TIMEOUT_S = 240  # per pair of processes; the 2-core CI machine is shared


def _engines():
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return "h5"
    return "h5,orbax"


def _run_pair(phase, folder, engines, returncode=0):
    port = str(free_port())
    argvs = [[sys.executable, SCRIPT, str(i), port, phase, str(folder), engines] for i in range(2)]
    results = run_processes(argvs, TIMEOUT_S)
    if results is None:
        pytest.fail(f"the {phase} processes hung for {TIMEOUT_S} s and were killed")
    outputs = [out for _, out in results]
    procs = [types.SimpleNamespace(returncode=code) for code, _ in results]
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == returncode, f"process {i} ({phase}) failed:\n{out[-4000:]}"
        assert f"process {i} {phase} done" in out
        if returncode == -signal.SIGKILL:
            assert out.rstrip().endswith(f"process {i} killed"), out[-4000:]


def _steps(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("ckpt-"))


def _load(folder, name):
    with np.load(os.path.join(folder, f"{name}.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
def test_two_processes_save_restore_and_resume_exactly(tmp_path):
    engines = _engines()
    # With Orbax, the train pair ends killed (SIGKILL) inside a StableCheckpoint fit.
    _run_pair("train", tmp_path, engines, returncode=-signal.SIGKILL if "orbax" in engines else 0)
    if "orbax" in engines:  # killed at global step 7: the steps of saves 4 and 6 are kept
        assert _steps(tmp_path / "fit.orbax") == ["ckpt-0000000004.orbax", "ckpt-0000000006.orbax"]
    _run_pair("resume", tmp_path, engines)
    saved = _load(tmp_path, "saved")
    uninterrupted = _load(tmp_path, "uninterrupted")
    assert len(saved) == 14  # 4 model variables, 10 Adam variables
    for engine in engines.split(","):
        restored = _load(tmp_path, f"restored_{engine}")
        resumed = _load(tmp_path, f"resumed_{engine}")
        assert sorted(restored) == sorted(saved)
        for key, value in saved.items():
            np.testing.assert_array_equal(restored[key], value, err_msg=f"{engine}: {key}")
        for key, value in resumed.items():
            expected = uninterrupted[key][-2:] if key == "loss" else uninterrupted[key]
            np.testing.assert_array_equal(value, expected, err_msg=f"{engine}: {key}")
    # .h5: one file, written by process 0; .orbax: Orbax wrote one shard folder per process.
    assert os.path.isfile(tmp_path / "state.h5")
    if "orbax" in engines:
        names = sorted(os.listdir(tmp_path / "state.orbax" / "arrays"))
        assert [n for n in names if n.startswith("ocdbt.process_")] == ["ocdbt.process_0", "ocdbt.process_1"]
        # StableCheckpoint("fit.orbax") killed inside epoch 1 and resumed: the run ends as the
        # uninterrupted one, and its directory holds the latest 2 of 8 steps, sharded as above.
        resumed = _load(tmp_path, "fit_resumed")
        assert sorted(resumed) == sorted(uninterrupted)
        for key, value in uninterrupted.items():
            np.testing.assert_array_equal(resumed[key], value, err_msg=f"fit.orbax: {key}")
        steps = _steps(tmp_path / "fit.orbax")
        assert steps == ["ckpt-0000000014.orbax", "ckpt-0000000016.orbax"], steps
        names = sorted(os.listdir(tmp_path / "fit.orbax" / steps[-1] / "arrays"))
        assert [n for n in names if n.startswith("ocdbt.process_")] == ["ocdbt.process_0", "ocdbt.process_1"]
