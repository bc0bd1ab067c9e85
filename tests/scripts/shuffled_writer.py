"""Write a mid-epoch StableCheckpoint of a shuffled NumPy fit, and the weights of the same fit
run to the end, for tests/test_fit_input.py's cross-backend resume.

usage: shuffled_writer.py CKPT_DIR REF_NPZ   (backend: KERAS_BACKEND)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from test_fit_input import fit_arrays  # noqa: E402

ckpt_dir, ref_npz = sys.argv[1], sys.argv[2]
ref, _ = fit_arrays(os.path.join(ckpt_dir + "-ref"))
np.savez(ref_npz, *ref)
keras.backend.clear_session()
fit_arrays(ckpt_dir, stop=(1, 3))
