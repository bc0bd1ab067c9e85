"""Cross-backend transfer harness: write a training state under one backend, continue under another.

usage:
  KERAS_BACKEND=<writer> transfer.py write DIR       trains each case, saves its training state
                                                     (DIR/<case>.keras), keeps going STEPS steps
                                                     and saves what it reached (DIR/<case>.npz)
  KERAS_BACKEND=<reader> transfer.py read DIR OUT [DIR OUT ...]
                                                     for each case: restores DIR/<case>.keras into a
                                                     fresh model, compares every restored array with
                                                     the saved one, takes the same STEPS steps on the
                                                     same data and writes OUT/<case>.json with the
                                                     differences, the report and a load_model check

Cases: "dense" (Dense, Conv2D, BatchNormalization, LayerNormalization; AdamW with a schedule),
"mixed" (the same under mixed_float16, so with a LossScaleOptimizer), "embedding" (Embedding,
Dropout) and "wide" (a Dense kernel of 72 x 256: its slots, over 64 KiB, are shared with Keras'
model.weights.h5 in the .keras file; OUT/wide.json lists the optimizer keys read from there).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402
from keras_stable_state import format  # noqa: E402
from keras_stable_state._optimizer import optimizer_entries  # noqa: E402

STEPS = 20
CASES = ("dense", "mixed", "embedding", "wide")


def data(case):
    rng = np.random.default_rng(1)
    if case == "embedding":
        x = rng.integers(0, 50, size=(64, 7)).astype("int32")
    else:
        x = rng.normal(size=(64, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    return x, y


def build(case):
    keras.config.set_dtype_policy("mixed_float16" if case == "mixed" else "float32")
    if case == "embedding":
        layers = [
            keras.Input((7,), dtype="int32"),
            keras.layers.Embedding(50, 8, name="embed"),
            keras.layers.Dropout(0.2, name="drop"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, name="head", dtype="float32"),
        ]
    elif case == "wide":
        layers = [
            keras.Input((6, 6, 2)),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="tanh", name="wide"),
            keras.layers.Dense(1, name="head"),
        ]
    else:
        layers = [
            keras.Input((6, 6, 2)),
            # no bias straight into a normalization: Adam amplifies rounding noise along the
            # directions a normalization ignores, and backends round differently (docs: transfer)
            keras.layers.Conv2D(4, 3, use_bias=False, name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Activation("relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(1, name="head", dtype="float32"),
        ]
    model = keras.Sequential(layers)
    sched = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=200)
    model.compile(
        optimizer=kss.StableOptimizer(keras.optimizers.AdamW(sched, weight_decay=1e-3), model=model),
        loss="mse",
    )
    return model


def steps(model, case, start, count):
    x, y = data(case)
    for i in range(start, start + count):
        j = (i * 8) % 64
        model.train_on_batch(x[j : j + 8], y[j : j + 8])


def arrays(model):
    out = {
        f"model:{k}": keras.ops.convert_to_numpy(v) for k, v in kss.VariableRegistry.from_model(model).entries
    }
    opt = model.optimizer
    entries = (
        opt.entries()
        if isinstance(opt, kss.StableOptimizer)
        else optimizer_entries(opt, kss.VariableRegistry.from_model(model, opt._trainable_variables))
    )
    out.update({f"opt:{e.key}": keras.ops.convert_to_numpy(e.variable) for e in entries})
    return out


def np_safe(a):
    return a.astype("float64") if a.dtype.kind in "fiub" or a.dtype.name == "bfloat16" else a


def write(directory):
    os.makedirs(directory, exist_ok=True)
    for case in CASES:
        keras.utils.set_random_seed(0)
        model = build(case)
        steps(model, case, 0, 12)
        # predict before saving: under Torch, predict's data loader draws from the global RNG
        predict = keras.ops.convert_to_numpy(model.predict(data(case)[0][:8], verbose=0)).astype("float32")
        kss.save_training_state(os.path.join(directory, f"{case}.keras"), model)
        saved = arrays(model)
        steps(model, case, 12, STEPS)
        np.savez(
            os.path.join(directory, f"{case}.npz"),
            **{f"saved|{k}": v for k, v in saved.items()},
            **{f"final|{k}": v for k, v in arrays(model).items()},
            predict=predict,
        )


def read(directory, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for case in CASES:
        keras.utils.set_random_seed(123)  # a different init: everything must come from the file
        model = build(case)
        model(data(case)[0][:1])
        path = os.path.join(directory, f"{case}.keras")
        report = kss.restore_training_state(path, model)
        ref = np.load(os.path.join(directory, f"{case}.npz"))
        got = arrays(model)
        restored = {}
        for name in (n for n in ref.files if n.startswith("saved|")):
            key = name.split("|", 1)[1]
            a, b = ref[name], got[key]
            same_bits = a.dtype == b.dtype and a.tobytes() == b.tobytes()
            same_value = np.array_equal(np_safe(a), np_safe(b))
            restored[key] = {
                "bits": bool(same_bits),
                "value": bool(same_value),
                "saved": a.dtype.name,
                "live": b.dtype.name,
            }
        steps(model, case, 12, STEPS)
        final = arrays(model)
        cont = {}
        for name in (n for n in ref.files if n.startswith("final|")):
            key = name.split("|", 1)[1]
            a, b = np_safe(ref[name]), np_safe(final[key])
            diff = float(np.max(np.abs(a - b))) if a.size else 0.0
            scale = float(np.max(np.abs(a))) if a.size else 0.0
            cont[key] = {"abs": diff, "rel": diff / scale if scale else diff}
        with format.open_file(path) as f:
            shared = [e.key for e in f.section("optimizer") if e.dataset.startswith("model.weights.h5:")]
        loaded = keras.saving.load_model(path)
        pred = keras.ops.convert_to_numpy(loaded.predict(data(case)[0][:8], verbose=0)).astype("float32")
        keras.config.set_dtype_policy("float32")
        with open(os.path.join(out_dir, f"{case}.json"), "w") as fh:
            json.dump(
                {
                    "reader": keras.backend.backend(),
                    "writer": report.writer,
                    "casts": report.casts,
                    "report": str(report),
                    "restored": restored,
                    "continued": cont,
                    "predict_max_abs": float(np.max(np.abs(pred - ref["predict"]))),
                    "shared_optimizer_keys": shared,
                },
                fh,
            )


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    else:  # read DIR OUT [DIR OUT ...]
        for i in range(2, len(sys.argv), 2):
            read(sys.argv[i], sys.argv[i + 1])
