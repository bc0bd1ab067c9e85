"""Write a mid-epoch StableCheckpoint of a shuffled NumPy fit, and the weights of the same fit
run to the end, for tests/fit/test_fit_input.py's cross-backend resume; with DROPOUT_DIR, also the
checkpoints of one epoch of a model with Dropout (its cross-backend resume warns).

usage: shuffled_writer.py CKPT_DIR REF_NPZ [DROPOUT_DIR]   (backend: KERAS_BACKEND)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.join(TESTS, "fit")]  # the kit, and the test module it writes for

import keras  # noqa: E402
import numpy as np  # noqa: E402
import test_fit_input as t  # noqa: E402
from kit import mlp  # noqa: E402

import keras_stable_state as kss  # noqa: E402

ckpt_dir, ref_npz = sys.argv[1], sys.argv[2]
# On TensorFlow without a global seed (NumPy and Python seeded): StableCheckpoint then draws the
# shuffled orders with NumPy, which the resuming backend draws too.
ref, _ = t.fit_arrays(os.path.join(ckpt_dir + "-ref"), tf_seed=False)
np.savez(ref_npz, *ref)
keras.backend.clear_session(free_memory=False)
t.fit_arrays(ckpt_dir, stop=(1, 3), tf_seed=False)
if len(sys.argv) > 3:
    keras.backend.clear_session(free_memory=False)
    m = mlp(5, 8, activation="relu", dropout=0.3)  # test_fit_input's model, with Dropout
    m.fit(t.X, t.Y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(sys.argv[3])])
