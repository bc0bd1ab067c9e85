"""A model.fit run with StableCheckpoint, ReduceLROnPlateau, EarlyStopping(restore_best_weights),
Dropout and shuffle=True. Used by tests/fit/test_resume.py, which kills it with SIGKILL and starts it
again until it completes.

usage: crash_fit.py CKPT_DIR OUT_NPZ [KILL_AT_GLOBAL_STEP] [--reference-first REF_DIR REF_NPZ]

With ``--reference-first``, the uninterrupted reference run (into REF_DIR, REF_NPZ) runs first in
this same process (one framework start for both), after a cleared Keras session and the same
seeds as a fresh process.
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402

args = sys.argv[1:]
reference = None
if "--reference-first" in args:
    at = args.index("--reference-first")
    reference, args = args[at + 1 : at + 3], args[:at] + args[at + 3 :]
ckpt_dir, out = args[0], args[1]
kill_at = int(args[2]) if len(args) > 2 else None
save_freq = int(os.environ.get("CRASH_SAVE_FREQ", "3"))


def run(ckpt_dir, out, kill_at):
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(80, 1))).astype("float32")

    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(3e-2), model=model), loss="mse")

    class Kill(keras.callbacks.Callback):
        """SIGKILL this process once the run has applied KILL_AT_GLOBAL_STEP optimizer steps."""

        def on_train_batch_end(self, batch, logs=None):
            if kill_at is not None and int(self.model.optimizer.iterations) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class LrLog(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    es = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=0.02, restore_best_weights=True)
    rlr = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=0.05)
    ckpt = kss.StableCheckpoint(
        ckpt_dir, save_freq=save_freq, max_to_keep=2, callbacks={"es": es, "rlr": rlr}
    )
    history = model.fit(
        x, y, epochs=14, batch_size=16, shuffle=True, verbose=0, callbacks=[ckpt, Kill(), rlr, es, LrLog()]
    )
    opt = {e.key: keras.ops.convert_to_numpy(e.variable) for e in model.optimizer.entries()}
    np.savez(
        out,
        **{f"w{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.variables)},
        **{f"opt:{k}": v for k, v in opt.items()},
        stopped_epoch=es.stopped_epoch,
        best_epoch=es.best_epoch,
        lr=float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
        loss=np.array(history.history["loss"]),
        epochs=np.array(history.epoch),
        lrs=np.array(history.history["lr"]),
    )


if reference is not None:
    run(*reference, None)
run(ckpt_dir, out, kill_at)
