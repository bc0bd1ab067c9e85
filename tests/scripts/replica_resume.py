"""A mid-epoch StableCheckpoint written under tf.distribute.MirroredStrategy over two logical
CPU devices, resumed on one replica and on two, for tests/transfer/test_replicas.py (the logical
devices must be set before TensorFlow initializes, hence a process of its own).

usage: replica_resume.py DIRECTORY LAYERS   (LAYERS: "bn-dropout", "sync-bn" or "dense")

Prints one JSON line: {"one": [warning messages], "two": [...], "one_diff": float,
"two_diff": float}: the warnings of the resume on one replica and on two, and the largest
weight difference between each resumed run and an uninterrupted two-replica run.
"""

import json
import os
import sys
import warnings

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from kit import StopAt  # noqa: E402

import keras_stable_state as kss  # noqa: E402

directory, layers = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
X = rng.normal(size=(64, 4)).astype("float32")
Y = (X @ rng.normal(size=(4, 1))).astype("float32")


def fit(devices, sub, stop=None):
    keras.utils.set_random_seed(0)
    with tf.distribute.MirroredStrategy(devices).scope():
        body = [keras.Input((4,)), keras.layers.Dense(8, name="hidden")]
        if layers == "bn-dropout":
            body += [keras.layers.BatchNormalization(name="bn"), keras.layers.Dropout(0.3, name="drop")]
        elif layers == "sync-bn":
            body += [keras.layers.BatchNormalization(synchronized=True, name="bn")]
        model = keras.Sequential([*body, keras.layers.Dense(1, name="out")])
        model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    callbacks = [kss.StableCheckpoint(os.path.join(directory, sub), save_freq=2)] + (
        [StopAt(*stop)] if stop else []
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kss.InexactResumeWarning)
        try:
            model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        except RuntimeError as err:
            assert stop is not None and str(err) == "preempted", err
    messages = [str(w.message) for w in caught if issubclass(w.category, kss.InexactResumeWarning)]
    return model, messages


two = ["/cpu:0", "/cpu:1"]
ref, _ = fit(two, "ref")
fit(two, "one", stop=(1, 2))
one, one_warnings = fit(["/cpu:0"], "one")
fit(two, "two", stop=(1, 2))
two_model, two_warnings = fit(two, "two")


def diff(model):
    return max(
        float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), model.get_weights(), strict=True)
    )


print(
    json.dumps({"one": one_warnings, "two": two_warnings, "one_diff": diff(one), "two_diff": diff(two_model)})
)
