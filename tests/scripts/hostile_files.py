"""Hostile files around a checkpoint, tried in one process: FIFOs, devices, symbolic and hard
links where a checkpoint, the lock file or ``unreadable/`` should be. Run by
tests/hostile/test_hostile_files.py with a timeout, so that a hang (a FIFO opened blocking) or an
endless read (``/dev/zero``) is a failing test, not a dead run.

usage: hostile_files.py WORKDIR   (prints one JSON document: the findings of each case)
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402

root = sys.argv[1]
VICTIM_TEXT = "a file outside the checkpoint directory\n" * 50
found = {}


def victim(name):
    path = os.path.join(root, name)
    with open(path, "w") as fh:
        fh.write(VICTIM_TEXT)
    return path


def intact(path):
    with open(path) as fh:
        return fh.read() == VICTIM_TEXT


def error(call):
    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported to the test, which checks type and text
        return {"type": type(err).__name__, "message": str(err), "state": isinstance(err, kss.StateError)}
    return None


def model_():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), "mse")
    return model


def weights(model):
    return [np.asarray(v).copy() for v in [*model.weights, *model.optimizer.variables]]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
y = x.sum(axis=1, keepdims=True)

# -- restore_training_state given a non-regular file, and a symbolic link to a good one ---
model = model_()
model.fit(x, y, epochs=1, batch_size=8, verbose=0)
good = os.path.join(root, "good.h5")
kss.save_training_state(good, model)
saved = weights(model)
model.fit(x, y, epochs=1, batch_size=8, verbose=0)  # the model moves on from the file
before = weights(model)
fifo = os.path.join(root, "fifo.h5")
os.mkfifo(fifo)
os.symlink("/dev/zero", os.path.join(root, "zero.h5"))
os.symlink("/dev/urandom", os.path.join(root, "urandom.keras"))
for name in ("fifo.h5", "zero.h5", "urandom.keras"):
    err = error(lambda name=name: kss.restore_training_state(os.path.join(root, name), model))
    found[f"restore {name}"] = {"error": err, "unchanged": same(weights(model), before)}
os.symlink(good, os.path.join(root, "latest.h5"))
kss.restore_training_state(os.path.join(root, "latest.h5"), model)
found["restore through a symbolic link"] = same(weights(model), saved)

# -- StableCheckpoint: checkpoint-named FIFO, devices, dangling and good symbolic links ----
ckpts = os.path.join(root, "ckpts")
model = model_()
model.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(ckpts)])
saved = weights(model)
outside = os.path.join(root, "outside.h5")
os.replace(os.path.join(ckpts, "ckpt-0000000002.h5"), outside)
os.symlink(outside, os.path.join(ckpts, "ckpt-0000000002.h5"))  # followed: a regular file
os.mkfifo(os.path.join(ckpts, "ckpt-0000000009.h5"))
os.symlink("/dev/zero", os.path.join(ckpts, "ckpt-0000000008.h5"))
os.symlink("/dev/urandom", os.path.join(ckpts, "ckpt-0000000007.h5"))
os.symlink(os.path.join(root, "nothing"), os.path.join(ckpts, "ckpt-0000000006.h5"))
os.symlink(victim("temp-victim"), os.path.join(ckpts, ".kss-planted.h5"))
model = model_()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cb = kss.StableCheckpoint(ckpts, max_to_keep=1)
    resumed = {}

    class Grab(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            resumed.setdefault("weights", weights(self.model))

    model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[cb, Grab()])
found["directory"] = {
    "resumed exactly": same(resumed["weights"], saved),
    "moved": sorted(os.path.basename(p) for p, _ in cb.moved_checkpoints),
    "unreadable/": sorted(os.listdir(os.path.join(ckpts, "unreadable"))),
    "reasons": [reason for _, reason in cb.skipped_checkpoints],
    "warnings": [type(w.message).__name__ for w in caught if issubclass(w.category, UserWarning)],
    "left": sorted(os.listdir(ckpts)),
    "outside kept": os.path.isfile(outside),
    "temp victim intact": intact(os.path.join(root, "temp-victim")),
}

# -- the lock file: symbolic link, hard link, FIFO, directory -------------------------------
for case in ("symlink", "hardlink", "fifo", "directory"):
    folder = os.path.join(root, f"lock-{case}")
    os.makedirs(folder)
    lock = os.path.join(folder, ".stable-checkpoint.lock")
    target = victim(f"lock-victim-{case}")
    {
        "symlink": lambda lock=lock, target=target: os.symlink(target, lock),
        "hardlink": lambda lock=lock, target=target: os.link(target, lock),
        "fifo": lambda lock=lock: os.mkfifo(lock),
        "directory": lambda lock=lock: os.mkdir(lock),
    }[case]()
    err = error(
        lambda folder=folder: model.fit(x, y, epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(folder)])
    )
    found[f"lock {case}"] = {
        "error": err,
        "victim intact": intact(target),
        "files": sorted(os.listdir(folder)),
    }

# -- unreadable/ is a symbolic link to another folder -----------------------------------------
folder = os.path.join(root, "moved")
os.makedirs(folder)
elsewhere = os.path.join(root, "elsewhere")
os.makedirs(elsewhere)
os.symlink(elsewhere, os.path.join(folder, "unreadable"))
with open(os.path.join(folder, "ckpt-0000000005.h5"), "wb") as fh:
    fh.write(b"not a checkpoint" * 10)
err = error(lambda: model.fit(x, y, epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(folder)]))
found["unreadable symlink"] = {"error": err, "elsewhere": os.listdir(elsewhere)}

print(json.dumps(found))
