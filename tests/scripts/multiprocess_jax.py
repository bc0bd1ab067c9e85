"""One of two JAX processes (2 CPU devices each) training a sharded model; run by
tests/transfer/test_multiprocess_jax.py.

    python multiprocess_jax.py PROCESS_ID PORT PHASE FOLDER ENGINE[,ENGINE]

PHASE ``train``: train 2 epochs, save the training state to FOLDER/state.<engine>
for each engine, train 2 more epochs (the uninterrupted run). PHASE ``resume``:
for each engine, build a fresh model, restore, train the same 2 epochs. Process
0 writes what the test compares to FOLDER/<what>.npz: every model and optimizer
variable gathered whole (a collective run on both processes) and the losses.

With the ``orbax`` engine, ``train`` then fits a fresh model for 4 epochs with
``StableCheckpoint(FOLDER/fit.orbax, save_freq=2)`` and both processes SIGKILL
themselves inside epoch 1 (after the save of global step 6); ``resume`` fits a fresh
model with the same callback, which resumes from that directory.
"""

import os
import signal
import sys

PROCESS_ID, PORT, PHASE, FOLDER, ENGINES = sys.argv[1:6]
PROCESS_ID = int(PROCESS_ID)
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{PORT}", num_processes=2, process_id=PROCESS_ID)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_stable_state as kss  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2

mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=jax.devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden.*kernel"] = (None, "model")  # columns split across the "model" axis
layout_map[".*hidden.*bias"] = ("model",)
layout_map[".*out.*kernel"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
distribution.auto_shard_dataset = False  # each process passes its own half of every batch
keras.distribution.set_distribution(distribution)

GLOBAL_BATCH, STEPS = 8, 4
rng = np.random.default_rng(0)
x_all = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
y_all = rng.normal(size=(GLOBAL_BATCH * STEPS, 1)).astype("float32")


def local(a):
    """This process' half of every global batch (Keras makes the global batch from them)."""
    half = GLOBAL_BATCH // 2
    rows = [
        a[s * GLOBAL_BATCH + PROCESS_ID * half : s * GLOBAL_BATCH + (PROCESS_ID + 1) * half]
        for s in range(STEPS)
    ]
    return np.concatenate(rows)


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def fit(model, epochs):
    history = model.fit(
        local(x_all), local(y_all), batch_size=GLOBAL_BATCH // 2, epochs=epochs, shuffle=False, verbose=0
    )
    return np.array(history.history["loss"], dtype="float64")


class KillAt(keras.callbacks.Callback):
    """Both processes meet at the begin of batch ``batch`` of ``epoch``, then SIGKILL themselves."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def get_state(self):
        return {}

    def set_state(self, state):
        pass

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            multihost_utils.sync_global_devices("kill")
            print(f"process {PROCESS_ID} killed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def fit_with_checkpoint(model, kill=None):
    ckpt = kss.StableCheckpoint(os.path.join(FOLDER, "fit.orbax"), save_freq=2, max_to_keep=2)
    callbacks = [ckpt] if kill is None else [ckpt, KillAt(*kill)]
    history = model.fit(
        local(x_all), local(y_all), batch_size=GLOBAL_BATCH // 2, epochs=4, shuffle=False, verbose=0,
        callbacks=callbacks,
    )  # fmt: skip
    return ckpt, np.array(history.history["loss"], dtype="float64")


def gathered(model):
    values = {}
    for prefix, variables in (("model", model.variables), ("optimizer", model.optimizer.variables)):
        for i, v in enumerate(variables):
            value = v.value
            if not value.is_fully_addressable:
                value = multihost_utils.process_allgather(value, tiled=True)
            values[f"{prefix}/{i}"] = np.asarray(value)
    return values


def dump(name, values):
    if PROCESS_ID == 0:
        np.savez(os.path.join(FOLDER, f"{name}.npz"), **values)


def shards(model):
    """Each model variable's sharding: (process-local shard shapes, number of devices)."""
    return {
        v.path: (sorted({s.data.shape for s in v.value.addressable_shards}), len(v.value.sharding.device_set))
        for v in model.variables
    }


if PHASE == "train":
    model = build()
    kernel = model.get_layer("hidden").kernel.value
    assert not kernel.is_fully_addressable and kernel.addressable_shards[0].data.shape == (6, 4), shards(
        model
    )
    first = fit(model, 2)
    dump("saved", gathered(model))
    for engine in ENGINES.split(","):
        kss.save_training_state(os.path.join(FOLDER, f"state.{engine}"), model)
    second = fit(model, 2)
    dump("uninterrupted", {**gathered(model), "loss": np.concatenate([first, second])})
    if "orbax" in ENGINES:  # saves at global steps 2, 4, 6 (4 steps an epoch); killed at step 7
        print(f"process {PROCESS_ID} {PHASE} done", flush=True)
        fit_with_checkpoint(build(), kill=(1, 3))
else:
    for engine in ENGINES.split(","):
        model = build()
        before = shards(model)
        report = kss.restore_training_state(os.path.join(FOLDER, f"state.{engine}"), model)
        assert shards(model) == before, (before, shards(model))  # placed on the variables' own layout
        assert not report.left_fresh and len(report.matched) == len(model.variables) + len(
            model.optimizer.variables
        ), report
        dump(f"restored_{engine}", gathered(model))
        second = fit(model, 2)
        dump(f"resumed_{engine}", {**gathered(model), "loss": second})
    if "orbax" in ENGINES:
        model = build()
        ckpt, losses = fit_with_checkpoint(model)
        assert ckpt.restore_report is not None and not ckpt.restore_report.left_fresh, ckpt.restore_report
        dump("fit_resumed", {**gathered(model), "loss": losses})
print(f"process {PROCESS_ID} {PHASE} done", flush=True)
