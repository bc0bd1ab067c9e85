"""Saves from another thread while ``fit`` trains, and a resume whose file is replaced while
it runs.

* With a ``StableCheckpoint`` in the fit, a save from another thread waits for the next
  step boundary: every file restores into a fresh model with the weights and optimizer
  variables of ONE step (the training thread records them at every step end, keyed by
  ``optimizer.iterations``; each restored file is compared with the record of its own
  iteration count, by position). ``KSS_THREAD_SAVES=1000`` (``make fuzz``) takes 1000.
* Without one, a save from another thread during fit is refused, naming the thread.
* A resume reads its checkpoint once: the file replaced by another checkpoint right after
  ``StableCheckpoint`` read it changes nothing of what is restored.

The fits run in a child process with a timeout, so a hang is a failure.
"""

import json
import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import BACKEND
from kit import ROOT, mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.format import proven

SAVES = int(os.environ.get("KSS_THREAD_SAVES", "8"))

CHILD = r"""
import json, os, sys, threading
import keras
import numpy as np
import keras_stable_state as kss


def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="hidden"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    return model


def values(model):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in list(model.weights) + list(model.optimizer.variables)]


def run(folder, saves, gated):
    model = build()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 4)).astype("float32"), rng.standard_normal((64, 1)).astype("float32")
    steps = {}  # optimizer.iterations -> every variable at that step's end (training thread)
    done = threading.Event()
    saved, refused, errors = [], [], []


    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self._record()

        def on_train_batch_end(self, batch, logs=None):
            self._record()
            if done.is_set():
                self.model.stop_training = True

        def _record(self):
            m = self.model  # on JAX this attaches the training state to the variables
            steps[int(keras.ops.convert_to_numpy(m.optimizer.iterations))] = values(m)


    def saver():
        i = 0
        try:
            while len(saved) + len(refused) < saves:
                path = os.path.join(folder, f"s-{i:05d}.h5")
                i += 1
                try:
                    kss.save_training_state(path, model, include_rng=False)
                    saved.append(path)
                except kss.StateError as err:
                    refused.append(str(err))
        except BaseException as err:
            errors.append(repr(err))
        finally:
            done.set()


    model.optimizer.build(model.trainable_variables)
    callbacks = [kss.StableCheckpoint(os.path.join(folder, "ckpt"), save_freq="epoch", verbose=0)] if gated else []
    thread = threading.Thread(target=saver, name="saver-thread")
    started = threading.Event()

    class Start(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not started.is_set():
                started.set()
                thread.start()


    model.fit(x, y, batch_size=8, epochs=10000, verbose=0, callbacks=[*callbacks, Record(), Start()])
    done.wait(300)
    thread.join(300)
    return ({"saved": saved, "refused": refused[:3], "refusals": len(refused), "errors": errors,
                                  "steps": {str(k): [a.tolist() for a in v] for k, v in steps.items()}})


results = {}
for folder, saves, mode in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):  # each mode in turn, one process
    results[mode] = run(folder, int(saves), mode == "gated")
print("RESULT " + json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """Both fits in one child process (one framework start), each in a folder of its own:
    with a ``StableCheckpoint`` (``SAVES`` saves from the other thread), then without one
    (3 tries). ``{"gated": ..., "plain": ...}``."""
    runs = [
        (tmp_path_factory.mktemp("gated"), SAVES, "gated"),
        (tmp_path_factory.mktemp("plain"), 3, "plain"),
    ]
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *[str(a) for run in runs for a in run]],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


def _fresh():
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="hidden"), keras.layers.Dense(1, name="out")]
    )
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _values(model):
    return [keras.ops.convert_to_numpy(v) for v in list(model.weights) + list(model.optimizer.variables)]


@pytest.mark.slow
def test_saves_from_another_thread_during_fit_are_each_of_one_step(found):
    found = found["gated"]
    assert found["errors"] == [] and found["refusals"] == 0, found["refused"]
    assert len(found["saved"]) == SAVES
    steps = {int(k): [np.asarray(a) for a in v] for k, v in found["steps"].items()}
    model = _fresh()
    torn, iterations = [], set()
    for path in found["saved"]:
        kss.restore_training_state(path, model, include_rng=False)
        got = _values(model)
        it = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        iterations.add(it)
        expected = steps.get(it)
        assert expected is not None, f"{path}: iteration {it} was never a step end"
        assert len(expected) == len(got)
        if not all(np.array_equal(g, e.astype(g.dtype)) for g, e in zip(got, expected, strict=True)):
            torn.append((os.path.basename(path), it))
    assert torn == [], f"{len(torn)} of {len(found['saved'])} files mix two steps: {torn[:5]}"
    assert len(iterations) > 1  # the saves were taken while the training went on


@pytest.mark.slow
def test_a_save_from_another_thread_during_a_fit_without_stable_checkpoint_is_refused(found):
    found = found["plain"]
    assert found["errors"] == []
    assert found["refusals"] >= 1 and found["refused"], found
    assert "'saver-thread'" in found["refused"][0] and "'MainThread'" in found["refused"][0]
    assert "StableCheckpoint" in found["refused"][0]
    # A save that was let in (before fit, or after it) is of one step too.
    steps = {int(k): [np.asarray(a) for a in v] for k, v in found["steps"].items()}
    model = _fresh()
    for path in found["saved"]:
        kss.restore_training_state(path, model, include_rng=False)
        it = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        for g, e in zip(_values(model), steps[it], strict=True):
            np.testing.assert_array_equal(g, e.astype(g.dtype))


# -- one resume, one read ---------------------------------------------------------------
def test_a_resume_reads_its_checkpoint_once_even_if_it_is_replaced_meanwhile(tmp_path, monkeypatch):
    """The newest checkpoint is replaced by another run's checkpoint right after
    StableCheckpoint read it: weights, optimizer, position, EarlyStopping's best and the
    random state all come from the file as it was read, and it is read once."""
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    y = np.random.default_rng(1).standard_normal((32, 1)).astype("float32")
    folder = tmp_path / "run"
    model_a = mlp(4, 8, named=True, seed=1)
    es_a = keras.callbacks.EarlyStopping(monitor="loss", patience=50)
    model_a.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[kss.StableCheckpoint(folder, callbacks={"es": es_a}), es_a],
    )
    newest = sorted(folder.glob("ckpt-*.h5"))[-1]
    # Another checkpoint of the same name: other weights, other position, other best.
    other = tmp_path / "other"
    model_b = mlp(4, 8, named=True, seed=2)
    es_b = keras.callbacks.EarlyStopping(monitor="loss", patience=50)
    model_b.fit(
        x * 3,
        y,
        batch_size=4,
        epochs=3,
        verbose=0,
        callbacks=[kss.StableCheckpoint(other, callbacks={"es": es_b}), es_b],
    )
    replacement = sorted(other.glob("ckpt-*.h5"))[-1]
    expected = format.read_file(str(newest))
    theirs = format.read_file(str(replacement))
    assert expected.extra["callbacks"]["es"]["best"] != theirs.extra["callbacks"]["es"]["best"]
    final_a = [keras.ops.convert_to_numpy(v) for v in model_a.weights]

    reads = []

    def read_then_replace(real_read):
        def read(path, **kwargs):
            reads.append(os.fspath(path))
            record = real_read(path, **kwargs)
            if len(reads) == 1:  # the file changes between its check and its restore
                tmp = folder / "incoming.tmp"
                shutil.copyfile(replacement, tmp)
                os.replace(tmp, newest)
            return record

        return read

    # read_proven: the restore in place into a model that never trained (its arrays are read
    # after the replacement, from the file it proved, held open); read_file: any other read
    for module, name in ((format, "read_file"), (proven, "read_proven")):
        monkeypatch.setattr(module, name, read_then_replace(getattr(module, name)))
    resumed = mlp(4, 8, named=True, seed=3)
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=50)
    seen = {}

    class Probe(keras.callbacks.Callback):
        def get_state(self):
            return {}  # stateless (StableCheckpoint would warn about an opaque callback)

        def set_state(self, state):
            pass

        def on_epoch_begin(self, epoch, logs=None):
            if not seen:
                seen["epoch"], seen["best"] = epoch, es.best
                seen["values"] = [keras.ops.convert_to_numpy(v) for v in resumed.weights]
                seen["iterations"] = int(keras.ops.convert_to_numpy(resumed.optimizer.iterations))
                self.model.stop_training = True

    resumed.fit(
        x,
        y,
        batch_size=8,
        epochs=5,
        verbose=0,
        callbacks=[kss.StableCheckpoint(folder, callbacks={"es": es}), es, Probe()],
    )
    assert reads == [str(newest)]
    assert seen["epoch"] == 2 and seen["iterations"] == 8  # model_a's position, not the replacement's (24)
    assert seen["best"] == expected.extra["callbacks"]["es"]["best"]
    for got, want in zip(seen["values"], final_a, strict=True):
        np.testing.assert_array_equal(got, want)
