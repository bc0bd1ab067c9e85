"""A resume on another number of tf.distribute replicas than the save's is warned about at
train begin, naming both counts and the layers whose results depend on it (issue 33, item 7);
a JAX or Torch run records no replica count (a JAX mesh change stays as it was)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BACKEND
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import format

SCRIPT = os.path.join(TESTS, "scripts", "replica_resume.py")


def _run(directory, layers):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, SCRIPT, str(directory), layers], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute replicas: the TensorFlow backend")
@pytest.mark.parametrize("layers", ["bn-dropout", "dense"])  # sync-bn warns as bn (4e-4 off, measured)
def test_a_resume_on_another_number_of_replicas_warns_naming_both_counts_and_the_layers(tmp_path, layers):
    out = _run(tmp_path, layers)
    assert out["two"] == [] and out["two_diff"] == 0.0  # the same two replicas: exact, no warning
    if layers == "dense":  # nothing computed per replica: off by the order of the reductions only
        assert out["one"] == [] and out["one_diff"] < 1e-6
        return
    names = "['bn', 'drop']" if layers == "bn-dropout" else "['bn']"
    assert len(out["one"]) == 1, out["one"]
    assert "saved on 2 tf.distribute replicas and training resumes on 1" in out["one"][0]
    assert f"the layers {names} compute per replica" in out["one"][0]
    assert out["one_diff"] > 1e-5  # measured: really off


def test_the_replica_count_is_recorded_on_tensorflow_only(tmp_path):
    mlp(seed=0).fit(
        np.ones((8, 4), "float32"),
        np.ones((8, 1), "float32"),
        epochs=1,
        verbose=0,
        callbacks=[kss.StableCheckpoint(tmp_path)],
    )
    record = format.read_file(os.path.join(tmp_path, sorted(os.listdir(tmp_path))[-1]))
    data = record.extra["providers"]["position"]["data"]
    assert data.get("replicas") == (1 if BACKEND == "tensorflow" else None)
