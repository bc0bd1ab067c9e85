"""Child of tests/manager/test_preemption.py: trials of a ``fit`` preempted by a real signal from
the parent, each resumed by a fresh model, in one process (a framework import per trial
would cost seconds).

    python preempt_fit.py FOLDER TRIALS

First the uninterrupted run (``FOLDER/reference.npz``). Then per trial ``i``: a fresh
model fits 2 epochs of 12 steps with ``StableCheckpoint(FOLDER/trial-i)``; at each batch
end (a callback listed before the checkpoint) it prints ``step <global step>`` and waits
for a line on stdin: the parent sends SIGTERM at the step it drew, then ``go``. The fit
must stop; the child prints ``stopped i <reached_preemption> <checkpoint step> <epochs in
History>``, then resumes with a fresh model built from another seed, keras.utils.clear_session
first, prints ``resumed i <batches trained>`` and writes ``FOLDER/trial-i.npz`` (model
weights then optimizer variables, by position).
"""

import os
import signal
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kit import mlp  # noqa: E402

import keras_stable_state as kss  # noqa: E402

EPOCHS, STEPS, BATCH = 2, 12, 4


class Handshake(keras.callbacks.Callback):
    """Print each batch end's global step and wait for the parent (``wait``); count the
    batches trained (a skipped one of a resume has empty logs)."""

    def __init__(self, wait):
        super().__init__()
        self.wait, self.step, self.trained = wait, 0, 0

    def get_state(self):  # stateless for the resume: no InexactResumeWarning
        return {}

    def set_state(self, state):
        pass

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        self.trained += bool(logs)
        if self.wait:
            print(f"step {self.step}", flush=True)
            assert sys.stdin.readline().strip() == "go"


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    return x, (x @ rng.normal(size=(4, 1))).astype("float32")


def run(folder, seed, wait):
    keras.utils.clear_session(free_memory=False)
    model = mlp(seed=seed)
    ckpt = kss.StableCheckpoint(folder)
    shake = Handshake(wait)
    x, y = data()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[shake, ckpt])
    return model, ckpt, shake, history


def dump(model, path):
    arrays = [keras.ops.convert_to_numpy(v) for v in [*model.weights, *model.optimizer.variables]]
    np.savez(path, *arrays)


def main():
    folder, trials = sys.argv[1], int(sys.argv[2])
    before = signal.getsignal(signal.SIGTERM)
    model, _, _, _ = run(os.path.join(folder, "reference"), 0, wait=False)
    dump(model, os.path.join(folder, "reference.npz"))
    print("reference done", flush=True)
    for i in range(trials):
        d = os.path.join(folder, f"trial-{i}")
        _, ckpt, _, history = run(d, 0, wait=True)
        assert signal.getsignal(signal.SIGTERM) == before, "the previous SIGTERM handler is not back"
        saved = kss.CheckpointManager(d).latest_step()
        print(f"stopped {i} {ckpt.reached_preemption} {saved} {len(history.epoch)}", flush=True)
        model, ckpt, shake, _ = run(d, 100 + i, wait=False)
        print(f"resumed {i} {shake.trained}", flush=True)
        dump(model, os.path.join(folder, f"trial-{i}.npz"))
    print("done", flush=True)


if __name__ == "__main__":
    main()
