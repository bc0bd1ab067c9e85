"""Interrupt a training run, resume it in a fresh process, and compare with never stopping.

Run it from the project root as::

    python examples/resume_demo.py --backend tensorflow|jax|torch     # or: make demo BACKEND=...

It needs keras_stable_state, the backend it runs on and scikit-learn (the ``[demo]`` extra:
``pip install "keras-stable-state[demo,jax]"``); without scikit-learn it exits with a one-line
message naming that extra.

What it shows. A small conv net is trained on scikit-learn's 8x8 digits (no
download) three times, with the same seeds and the same per-epoch data order:

A. uninterrupted: ``E`` epochs in one go (Adam wrapped in
   :class:`keras_stable_state.StableOptimizer`).
B. keras_stable_state: ``E/2`` epochs, :func:`keras_stable_state.save_training_state`,
   then a **fresh process** builds the model from a refactored class whose layers
   are created in another order, compiles, calls
   :func:`keras_stable_state.restore_training_state` and trains the remaining epochs.
C. stock Keras: the same interruption with ``model.save_weights`` /
   ``model.load_weights`` and a plain ``keras.optimizers.Adam`` (built before
   ``load_weights``, so Keras does restore the optimizer, by position).

The refactored class creates ``branch_b`` before ``branch_a``: two parallel
``Dense(32)`` layers of the same shape (a gated unit, ``relu(branch_a(h)) *
sigmoid(branch_b(h))``), so the model computes the same function but lists its
trainable variables in another order. Keras restores the *weights* of both runs
correctly (it addresses layers by attribute name) but restores Adam's moments by
position, so in run C the moments of ``branch_a`` land on ``branch_b`` and vice
versa, silently: no error, no warning.
keras_stable_state keys every slot by the stable path of its variable
(``path:branch_a/kernel#momentums``), so run B continues exactly where run A
was at mid-training: its final weights equal run A's (bit-identical on JAX and
Torch on CPU; TensorFlow within float round-off).

The table at the end gives, for each run, the final test loss and accuracy, the
largest absolute difference of its final weights from run A, and the largest
error of any restored optimizer slot against the slot saved for the same
variable. The exit code is 0 when the keras_stable_state resume matches run A
(max weight difference <= 1e-6 and every slot restored exactly), else 1.

Note on ``--backend``: Keras fixes its backend when it is first imported. The demo sets
``KERAS_BACKEND`` before it imports Keras; when Keras is already imported with another
backend (the script run through ``runpy`` or an interpreter that imported Keras at
start-up), it re-executes this file in a new interpreter, so Keras is imported afresh
with the requested backend.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

BACKENDS = ("tensorflow", "jax", "torch")
_REEXEC_FLAG = "_KSS_DEMO_REEXEC"
TOLERANCE = 1e-6


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python examples/resume_demo.py",
        description="Interrupt training, resume it in a fresh process with a refactored model, and "
        "compare keras_stable_state with stock Keras save_weights/load_weights.",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=os.environ.get("KERAS_BACKEND") or "jax",
        help="Keras backend (default: $KERAS_BACKEND, else jax).",
    )
    parser.add_argument("--epochs", type=int, default=8, help="total epochs E (even; default 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--seed", type=int, default=1337, help="random seed (default 1337)")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads for torch and tensorflow (default 1: the model is tiny, and on a busy "
        "2-core machine more threads make steps several times slower; 0 keeps the backend's default)",
    )
    # Hidden: the resume half, run in a fresh process by the parent.
    parser.add_argument("--_resume", choices=("kss", "stock"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.epochs % 2:
        parser.error("--epochs must be an even number >= 2")
    return args


def _require_sklearn():
    """Exit with a one-line message naming the ``[demo]`` extra when scikit-learn is missing."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise SystemExit(
            'The resume demo needs scikit-learn (its digits data set): pip install "keras-stable-state[demo]"'
        ) from None


def _select_backend(argv):
    """Make sure Keras runs on the requested backend, before this module imports Keras.

    Sets ``KERAS_BACKEND``; if Keras is already imported with another backend,
    re-executes this file in a new interpreter.
    """
    args = _parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    keras_mod = sys.modules.get("keras")
    if keras_mod is None:
        return
    current = keras_mod.backend.backend()
    if current == args.backend:
        return
    if os.environ.get(_REEXEC_FLAG):
        raise SystemExit(
            f"Keras was imported with backend {current!r} although KERAS_BACKEND={args.backend!r}; "
            "check ~/.keras/keras.json and the environment."
        )
    os.environ[_REEXEC_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *argv])


if __name__ == "__main__":
    _require_sklearn()
    _select_backend(sys.argv[1:])

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402

# Internal: keys every optimizer variable (a stock Adam's too) by its model variable, which is
# how the demo measures a restored slot against the one saved for the same variable.
from keras_stable_state._optimizer import optimizer_entries  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Model: one computation, two classes that create their layers in different orders.
# --------------------------------------------------------------------------------------------------


class _DigitNetBase(keras.Model):
    """conv -> conv -> flatten -> dense(64) -> gated unit relu(branch_a) * sigmoid(branch_b) -> dense(10).

    ``branch_a`` and ``branch_b`` are parallel ``Dense(32)`` layers on the same input:
    same shapes, different gradients (so different Adam moments).
    """

    def call(self, x):
        h = self.dense(self.flatten(self.conv2(self.conv1(x))))
        return self.head(keras.ops.relu(self.branch_a(h)) * keras.ops.sigmoid(self.branch_b(h)))


@keras.saving.register_keras_serializable(package="kss_demo")
class DigitNet(_DigitNetBase):
    """The model as first written: layers created in the order they are called."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = keras.layers.Conv2D(16, 3, activation="relu")
        self.conv2 = keras.layers.Conv2D(32, 3, activation="relu")
        self.flatten = keras.layers.Flatten()
        self.dense = keras.layers.Dense(64, activation="relu")
        self.branch_a = keras.layers.Dense(32)
        self.branch_b = keras.layers.Dense(32)
        self.head = keras.layers.Dense(10)


@keras.saving.register_keras_serializable(package="kss_demo")
class DigitNetRefactored(_DigitNetBase):
    """The same model after a refactor: same attributes and math, created in another order.

    ``branch_b`` now comes before ``branch_a``, so ``trainable_variables`` (and the
    optimizer's slot list) puts them in swapped positions.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.flatten = keras.layers.Flatten()
        self.conv1 = keras.layers.Conv2D(16, 3, activation="relu")
        self.conv2 = keras.layers.Conv2D(32, 3, activation="relu")
        self.dense = keras.layers.Dense(64, activation="relu")
        self.branch_b = keras.layers.Dense(32)
        self.branch_a = keras.layers.Dense(32)
        self.head = keras.layers.Dense(10)


# --------------------------------------------------------------------------------------------------
# Data, training, helpers
# --------------------------------------------------------------------------------------------------


def set_threads(n):
    """Intra-op thread count for torch / tensorflow (0: leave the backend's default)."""
    if n <= 0:
        return
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        torch.set_num_threads(n)
    elif backend == "tensorflow":
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(n)
            tf.config.threading.set_inter_op_parallelism_threads(n)
        except RuntimeError:  # the TF runtime is already initialised: keep its pools
            pass


def set_seed(seed):
    """Seed Python, NumPy and the backend, as ``keras.utils.set_random_seed`` does, without
    importing TensorFlow on the other backends (Keras' own seeds TensorFlow wherever it is
    installed, which imports it and prints its start-up lines)."""
    if keras.backend.backend() == "tensorflow":
        keras.utils.set_random_seed(seed)
        return
    random.seed(seed)  # Keras draws its default seeds (initial weights, seed generators) from here
    np.random.seed(seed)
    if keras.backend.backend() == "torch":
        import torch

        torch.manual_seed(seed)


def load_data(seed):
    """Digits 8x8 scaled to [0, 1], shape (N, 8, 8, 1); fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return (x_train, y_train), (x_test, y_test)


def make_model(cls, args, x_sample, stable=True, seed=True):
    """Build and compile ``cls``; Adam, wrapped in ``StableOptimizer`` when ``stable``.

    ``seed=True`` seeds the initial weights with :func:`set_seed`; ``seed=False`` leaves
    them random: a resumed process must get everything from the checkpoint.
    """
    if seed:
        set_seed(args.seed)
    model = cls()
    model(x_sample[:1])
    adam = keras.optimizers.Adam(learning_rate=args.lr)
    model.compile(
        optimizer=kss.StableOptimizer(adam, model=model) if stable else adam,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train(model, data, args, start, stop):
    """Epochs ``start..stop-1``; epoch ``e`` sees the data in a fixed order drawn from (seed, e).

    The order depends only on the seed and the epoch, so a resumed process replays the
    same batches. Each epoch drops the last partial batch (a different one each epoch),
    which keeps one batch shape and so one compiled step.
    """
    x, y = data
    n = len(x) // args.batch_size * args.batch_size
    for epoch in range(start, stop):
        order = np.random.default_rng([args.seed, epoch]).permutation(len(x))[:n]
        model.fit(x[order], y[order], batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0)


def evaluate(model, data):
    out = model.evaluate(*data, batch_size=len(data[0]), verbose=0, return_dict=True)
    return float(out["loss"]), float(out["accuracy"])


def weights_by_key(model):
    """``{stable key: array}`` for the model's trainable variables (same keys in both classes)."""
    registry = kss.VariableRegistry.from_model(model, model.trainable_variables)
    return {str(k): _numpy_copy(v) for k, v in registry.entries}


def slots_by_key(model):
    """``{entry key: array}`` for every optimizer variable, keyed by the model (any optimizer)."""
    registry = kss.VariableRegistry.from_model(model, model.trainable_variables)
    return {e.key: _numpy_copy(e.variable) for e in optimizer_entries(model.optimizer, registry)}


def _numpy_copy(variable):
    """The variable's value as a NumPy array of its own (Torch's conversion shares memory)."""
    return np.array(keras.ops.convert_to_numpy(variable), copy=True)


def save_arrays(path, arrays):
    np.savez(
        path,
        __keys__=np.array(json.dumps(list(arrays))),
        **{f"a{i}": v for i, v in enumerate(arrays.values())},
    )


def load_arrays(path):
    with np.load(path) as f:
        keys = json.loads(str(f["__keys__"]))
        return {k: f[f"a{i}"] for i, k in enumerate(keys)}


def max_abs_diff(a, b):
    """Largest absolute difference over common keys, and the keys that differ at all."""
    if set(a) != set(b):
        raise AssertionError(f"key sets differ: {sorted(set(a) ^ set(b))}")
    diffs = {k: float(np.max(np.abs(np.asarray(a[k], "float64") - np.asarray(b[k], "float64")))) for k in a}
    return max(diffs.values(), default=0.0), sorted(k for k, d in diffs.items() if d > 0)


def _short(keys, n=4):
    keys = [k.removeprefix("path:") for k in keys]
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


# --------------------------------------------------------------------------------------------------
# The resume half (fresh process)
# --------------------------------------------------------------------------------------------------


def resume(args):
    """Build the refactored model, restore the half-way state, finish training, write results."""
    import warnings

    t_start = time.perf_counter()
    work = args._workdir
    train_data, test_data = load_data(args.seed)
    half = args.epochs // 2
    tag = "[keras_stable_state]" if args._resume == "kss" else "[stock Keras]"
    # Not seeded: every variable the resumed run needs comes from the checkpoint.
    model = make_model(DigitNetRefactored, args, train_data[0], stable=args._resume == "kss", seed=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args._resume == "kss":
            report = kss.restore_training_state(os.path.join(work, "half.keras"), model)
            print(f"  {tag} fresh process, DigitNetRefactored, restore_training_state:", flush=True)
            print("    " + str(report).replace("\n", "\n    "), flush=True)
            matched = f"{len(report.by_name)} by key, {len(report.by_order)} by order"
        else:
            model.optimizer.build(model.trainable_variables)
            model.load_weights(os.path.join(work, "half.weights.h5"))
            matched = "slots by position"
    print(
        f"  {tag} warnings during restore: {len(caught)}"
        + "".join(f"\n    {w.category.__name__}: {w.message}" for w in caught),
        flush=True,
    )
    saved_weights = load_arrays(os.path.join(work, f"{args._resume}_weights_saved.npz"))
    saved_slots = load_arrays(os.path.join(work, f"{args._resume}_slots_saved.npz"))
    weight_err, _ = max_abs_diff(weights_by_key(model), saved_weights)
    slot_err, bad_slots = max_abs_diff(slots_by_key(model), saved_slots)
    print(
        f"  {tag} after restore: max |weight - saved| = {weight_err:.3g}, "
        f"max |slot - saved slot of the same variable| = {slot_err:.3g}"
        + (f" in {len(bad_slots)} slots ({_short(bad_slots)})" if bad_slots else ""),
        flush=True,
    )
    t_train = time.perf_counter()
    train(model, train_data, args, half, args.epochs)
    loss, acc = evaluate(model, test_data)
    save_arrays(os.path.join(work, f"{args._resume}_final.npz"), weights_by_key(model))
    print(
        f"  {tag} trained epochs {half + 1}-{args.epochs} ({time.perf_counter() - t_train:.1f} s; "
        f"process {time.process_time():.1f} s CPU, {time.perf_counter() - t_start:.1f} s after imports)",
        flush=True,
    )
    with open(os.path.join(work, f"{args._resume}_result.json"), "w") as fh:
        json.dump(
            {
                "loss": loss,
                "accuracy": acc,
                "restore_weight_err": weight_err,
                "slot_err": slot_err,
                "bad_slots": bad_slots,
                "matched": matched,
                "warnings": len(caught),
            },
            fh,
        )
    return 0


# --------------------------------------------------------------------------------------------------
# The main job
# --------------------------------------------------------------------------------------------------


def _run_child(args, kind, work):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--backend",
        args.backend,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--lr",
        repr(args.lr),
        "--threads",
        str(args.threads),
        "--_resume",
        kind,
        "--_workdir",
        work,
    ]
    env = dict(os.environ, KERAS_BACKEND=args.backend)
    env.pop(_REEXEC_FLAG, None)
    sys.stdout.flush()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        raise SystemExit(f"The resumed process ({kind}) failed with exit code {proc.returncode}; see above.")
    with open(os.path.join(work, f"{kind}_result.json")) as fh:
        result = json.load(fh)
    result["final"] = load_arrays(os.path.join(work, f"{kind}_final.npz"))
    return result


def main(args):
    t_start = time.perf_counter()
    train_data, test_data = load_data(args.seed)
    half = args.epochs // 2
    print(
        f"keras_stable_state demo: backend={keras.backend.backend()}, Keras {keras.__version__}, "
        f"digits 8x8: {len(train_data[0])} train / {len(test_data[0])} test, {args.epochs} epochs, "
        f"batch {args.batch_size}, Adam(lr={args.lr}), seed {args.seed}, threads {args.threads or 'default'}",
        flush=True,
    )

    # A. uninterrupted
    model_a = make_model(DigitNet, args, train_data[0], stable=True)
    print(
        f"A. uninterrupted: DigitNet, {model_a.count_params():,} parameters, {args.epochs} epochs", flush=True
    )
    train(model_a, train_data, args, 0, args.epochs)
    loss_a, acc_a = evaluate(model_a, test_data)
    final_a = weights_by_key(model_a)
    print(f"   done ({time.perf_counter() - t_start:.1f} s)", flush=True)

    with tempfile.TemporaryDirectory(prefix="kss-demo-") as work:
        # B. keras_stable_state: train half, save, resume in a fresh process.
        print(
            f"B. keras_stable_state: {half} epochs, save_training_state, resume in a fresh process",
            flush=True,
        )
        model_b = make_model(DigitNet, args, train_data[0], stable=True)
        train(model_b, train_data, args, 0, half)
        kss.save_training_state(os.path.join(work, "half.keras"), model_b)
        save_arrays(os.path.join(work, "kss_weights_saved.npz"), weights_by_key(model_b))
        save_arrays(os.path.join(work, "kss_slots_saved.npz"), slots_by_key(model_b))
        del model_b
        res_b = _run_child(args, "kss", work)
        print(f"   done ({time.perf_counter() - t_start:.1f} s)", flush=True)

        # C. stock Keras: train half, save_weights, load_weights in a fresh process.
        print(
            f"C. stock Keras: {half} epochs, model.save_weights, load_weights in a fresh process", flush=True
        )
        model_c = make_model(DigitNet, args, train_data[0], stable=False)
        train(model_c, train_data, args, 0, half)
        model_c.save_weights(os.path.join(work, "half.weights.h5"))
        save_arrays(os.path.join(work, "stock_weights_saved.npz"), weights_by_key(model_c))
        save_arrays(os.path.join(work, "stock_slots_saved.npz"), slots_by_key(model_c))
        del model_c
        res_c = _run_child(args, "stock", work)
        print(f"   done ({time.perf_counter() - t_start:.1f} s)", flush=True)

    diff_b, _ = max_abs_diff(res_b["final"], final_a)
    diff_c, _ = max_abs_diff(res_c["final"], final_a)

    rows = [
        ("", "uninterrupted", "keras_stable_state", "stock Keras"),
        ("", "(run A)", "resumed (run B)", "resumed (run C)"),
        ("test loss", f"{loss_a:.6f}", f"{res_b['loss']:.6f}", f"{res_c['loss']:.6f}"),
        ("test accuracy", f"{acc_a:.4f}", f"{res_b['accuracy']:.4f}", f"{res_c['accuracy']:.4f}"),
        ("max |w - w(A)| after training", "-", f"{diff_b:.3g}", f"{diff_c:.3g}"),
        ("max slot error after restore", "-", f"{res_b['slot_err']:.3g}", f"{res_c['slot_err']:.3g}"),
        ("slots restored wrongly", "-", str(len(res_b["bad_slots"])), str(len(res_c["bad_slots"]))),
        ("arrays matched", "-", res_b["matched"], res_c["matched"]),
        ("warnings during restore", "-", str(res_b["warnings"]), str(res_c["warnings"])),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]

    def line(row):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  " + "  ".join(cells)

    print()
    print(f"Results ({keras.backend.backend()}, resumed runs use DigitNetRefactored in a fresh process)")
    for i, row in enumerate(rows):
        print(line(row))
        if i == 1:
            print(line(tuple("-" * w for w in widths)))
    if res_c["bad_slots"]:
        print(f"  stock Keras swapped slots: {_short(res_c['bad_slots'], 8)}")

    ok = diff_b <= TOLERANCE and res_b["slot_err"] <= TOLERANCE
    elapsed = time.perf_counter() - t_start
    if ok:
        exact = "bit-identical to" if diff_b == 0.0 else f"within {diff_b:.2g} of"
        print(
            f"\nVERDICT: PASS - keras_stable_state resumed {exact} the uninterrupted run; stock Keras "
            f"{'drifted by ' + format(diff_c, '.3g') if diff_c > TOLERANCE else 'also matched'} "
            f"({elapsed:.1f} s)"
        )
    else:
        print(
            f"\nVERDICT: FAIL - keras_stable_state resume differs from the uninterrupted run by {diff_b:.3g} "
            f"(slot error {res_b['slot_err']:.3g}); tolerance {TOLERANCE:g} ({elapsed:.1f} s)"
        )
    return 0 if ok else 1


def cli(argv=None):
    _require_sklearn()
    args = _parse_args(argv)
    if keras.backend.backend() != args.backend:
        raise SystemExit(
            f"Keras is running on {keras.backend.backend()!r}, not {args.backend!r}: run this as "
            f"`python examples/resume_demo.py --backend {args.backend}` or set KERAS_BACKEND."
        )
    set_threads(args.threads)
    if args._resume:
        return resume(args)
    return main(args)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
