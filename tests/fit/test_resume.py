"""Exact resume: model.fit killed and restarted, accumulation windows, custom loops, LoRA, fallbacks."""

import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND, StopAt, slots_by_key, to_np
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state._fit import UNREADABLE_DIR, UnreadableCheckpointWarning

SCRIPT = os.path.join(TESTS, "scripts", "crash_fit.py")
rng = np.random.default_rng(0)
X = rng.normal(size=(48, 6)).astype("float32")
Y = (X @ rng.normal(size=(6, 1))).astype("float32")


def _run(ckpt_dir, out, kill_at=None, reference=None):
    """crash_fit.py in a child; ``reference=(dir, out)`` runs the uninterrupted reference first, in
    the same child."""
    cmd = [sys.executable, SCRIPT, str(ckpt_dir), str(out)] + ([str(kill_at)] if kill_at is not None else [])
    cmd += ["--reference-first", *map(str, reference)] if reference is not None else []
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_fit_killed_with_sigkill_at_random_steps_finishes_like_uninterrupted(tmp_path):
    seed = int(os.environ.get("KSS_CRASH_SEED", np.random.SeedSequence().entropy % 2**32))
    # 5 batches per epoch, EarlyStopping stops the run after some 35 steps; kill once (each
    # kill costs a training process), or KSS_KILL_SAVES times in a campaign (at most 28)
    count = int(os.environ.get("KSS_KILL_SAVES", "1"))
    kills = sorted(np.random.default_rng(seed).choice(np.arange(2, 30), size=count, replace=False).tolist())
    for i, k in enumerate(kills):
        # the first child runs the uninterrupted reference, then the run it kills
        reference = (tmp_path / "ref", tmp_path / "ref.npz") if i == 0 else None
        r = _run(tmp_path / "run", tmp_path / "run.npz", kill_at=k, reference=reference)
        assert r.returncode == -9, (
            f"kill at {k} (seed {seed}) did not happen: rc={r.returncode} {r.stderr[-1500:]}"
        )
        assert not (tmp_path / "run.npz").exists()
    assert (tmp_path / "ref.npz").exists()  # the reference ran to its end before the kill
    final = _run(tmp_path / "run", tmp_path / "run.npz")
    assert final.returncode == 0, final.stderr[-2000:]
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "run.npz")
    assert sorted(a.files) == sorted(b.files)
    tol = 1e-6 if BACKEND == "tensorflow" else 0.0
    for name in a.files:
        assert a[name].shape == b[name].shape, f"{name}: kills at {kills} (KSS_CRASH_SEED={seed})"
        diff = (
            float(np.max(np.abs(a[name].astype("float64") - b[name].astype("float64"))))
            if a[name].size
            else 0.0
        )
        assert diff <= tol, f"{name} differs by {diff} after kills at {kills} (KSS_CRASH_SEED={seed})"
    assert int(a["stopped_epoch"]) > 0  # EarlyStopping really decided the end, in both runs
    assert len(os.listdir(tmp_path / "run")) <= 2  # max_to_keep=2


def _adam_accumulating():  # Adam with a window of 4 accumulated micro-steps
    return keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4)


def test_gradient_accumulation_window_resumes_mid_window(tmp_path):
    keras.utils.set_random_seed(3)
    ref = mlp(6, 5, activation="tanh", inner=_adam_accumulating)
    init = ref.get_weights()
    batches = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 48, 8)]  # 6 micro-steps
    for xb, yb in batches:
        ref.train_on_batch(xb, yb)
    run = mlp(6, 5, activation="tanh", inner=_adam_accumulating)
    run.set_weights(init)
    for xb, yb in batches[:2]:  # 2 micro-steps into the first window of 4
        run.train_on_batch(xb, yb)
    acc = slots_by_key(run.optimizer)
    assert any(k.endswith("#accumulated_gradients") and np.any(v) for k, v in acc.items())
    kss.save_training_state(tmp_path / "acc.h5", run)
    resumed = mlp(6, 5, activation="tanh", inner=_adam_accumulating)
    kss.restore_training_state(tmp_path / "acc.h5", resumed)
    for xb, yb in batches[2:]:
        resumed.train_on_batch(xb, yb)
    for a, b in zip(ref.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.optimizer.iterations) == int(ref.optimizer.iterations) == 1


def _custom_loop(model, opt, acc, batches, window=3):
    """One backend-native custom loop: accumulate weighted gradients, apply every `window` micro-steps."""
    if BACKEND == "jax":
        import jax

        def loss_fn(tv, ntv, xb, yb):
            pred, ntv = model.stateless_call(tv, ntv, xb)
            return keras.ops.mean((pred - yb) ** 2), ntv

        grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True))
        for xb, yb in batches:
            tv = [v.value for v in model.trainable_variables]
            ntv = [v.value for v in model.non_trainable_variables]
            grads, _ = grad_fn(tv, ntv, xb, yb)
            values = acc.stateless_accumulate([v.value for v in acc.variables], grads, weight=len(xb))
            for v, a in zip(acc.variables, values, strict=True):
                v.assign(a)
            if acc.count == window:
                opt_vars = [v.value for v in opt.variables]
                new_tv, new_ov = opt.stateless_apply(opt_vars, acc.gradients(), tv)
                for v, a in zip(model.trainable_variables, new_tv, strict=True):
                    v.assign(a)
                for v, a in zip(opt.variables, new_ov, strict=True):
                    v.assign(a)
                acc.reset()
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def grads_of(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        for xb, yb in batches:
            acc.accumulate(grads_of(xb, yb), weight=len(xb))
            if acc.count == window:
                opt.apply(acc.gradients(), model.trainable_variables)
                acc.reset()
    else:
        import torch

        for xb, yb in batches:
            loss = torch.mean((model(torch.from_numpy(xb)) - torch.from_numpy(yb)) ** 2)
            model.zero_grad()
            loss.backward()
            acc.accumulate([v.value.grad for v in model.trainable_variables], weight=len(xb))
            if acc.count == window:
                opt.apply(acc.gradients(), model.trainable_variables)
                acc.reset()


def test_custom_loop_with_gradient_accumulator_saves_and_resumes(tmp_path):
    # 8 micro-steps of unequal sizes (weights = batch sizes), windows of 3
    edges = [0, 4, 10, 16, 18, 26, 32, 40, 48]
    batches = [(X[a:b], Y[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def fresh():
        model = mlp(6, 4, activation="tanh", seed=7, optimizer=None)
        opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2))
        opt.build(model.trainable_variables)
        return model, opt, kss.GradientAccumulator(model)

    ref_model, ref_opt, ref_acc = fresh()
    _custom_loop(ref_model, ref_opt, ref_acc, batches)

    model, opt, acc = fresh()
    _custom_loop(model, opt, acc, batches[:4])  # one window applied, one micro-step pending
    assert acc.count == 1
    kss.save_training_state(tmp_path / "loop.h5", model, opt, state={"accumulator": acc})
    model2, opt2, acc2 = fresh()
    report = kss.restore_training_state(tmp_path / "loop.h5", model2, opt2, state={"accumulator": acc2})
    assert "state:accumulator" in report.restored_state and acc2.count == 1
    np.testing.assert_array_equal(to_np(acc2.sums[0]), to_np(acc.sums[0]))
    _custom_loop(model2, opt2, acc2, batches[4:])
    for a, b in zip(ref_model.get_weights(), model2.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt2.iterations) == int(ref_opt.iterations) == 2


def test_accumulator_refuses_pending_gradients_of_a_frozen_variable(tmp_path):
    model = mlp(6, 4, activation="tanh", seed=7, optimizer=None)
    acc = kss.GradientAccumulator(model)
    acc.accumulate([keras.ops.ones(v.shape) for v in model.trainable_variables])
    model.layers[0].trainable = False
    with pytest.raises(
        kss.StateError, match=r"pending gradients for path:layers/dense/kernel.*no longer trainable"
    ):
        kss.save_training_state(tmp_path / "a.h5", model, state={"accumulator": acc})
    acc.reset()
    kss.save_training_state(tmp_path / "a.h5", model, state={"accumulator": acc})


# Its own model: the kit's Dense chain with LoRA adapters enabled on d1 and d2, what the tests vary.
def _lora_model(base_weights, lora=True):
    m = mlp(6, (512, 512), layer_names=("d1", "d2", "out"), optimizer=None)
    m.set_weights(base_weights)
    if lora:
        for name in ("d1", "d2"):
            m.get_layer(name).enable_lora(4)
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=m), loss="mse")
    return m


def test_lora_adapter_only_checkpoint(tmp_path):
    keras.utils.set_random_seed(5)
    base = mlp(6, (512, 512), layer_names=("d1", "d2", "out"), optimizer=None).get_weights()
    keras.utils.set_random_seed(6)
    ref = _lora_model(base)
    keras.utils.set_random_seed(6)
    run = _lora_model(base)
    for m in (ref, run):
        m.fit(X, Y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    kss.save_training_state(tmp_path / "adapters.h5", run, model_state="trainable")
    kss.save_training_state(tmp_path / "full.h5", run)
    small, full = os.path.getsize(tmp_path / "adapters.h5"), os.path.getsize(tmp_path / "full.h5")
    assert small < 0.2 * full, (small, full)  # the frozen base kernels are not in it
    record = format.read_file(tmp_path / "adapters.h5")
    assert "path:layers/d1/kernel" not in record.model and "path:layers/d1/lora_kernel_a" in record.model

    keras.utils.set_random_seed(99)  # other adapter init: the restore must bring them back
    resumed = _lora_model(base)
    resumed(X[:1])
    report = kss.restore_training_state(tmp_path / "adapters.h5", resumed)
    assert "path:layers/d1/kernel" in report.left_fresh  # the frozen base came from the caller
    for m in (ref, resumed):
        m.fit(X, Y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    for a, b in zip(ref.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)

    plain = _lora_model(base, lora=False)
    plain(X[:1])
    with pytest.raises(kss.ContractError, match="lora_kernel_a") as e:
        kss.restore_training_state(tmp_path / "adapters.h5", plain)
    assert sorted(e.value.missing) == sorted(
        f"path:layers/{d}/lora_kernel_{ab}" for d in ("d1", "d2") for ab in "ab"
    )


def test_changed_schedule_raises_naming_fields(tmp_path):
    def build(decay_steps):
        m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        sched = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=decay_steps, decay_rate=0.5)
        m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(sched), model=m), loss="mse")
        return m

    m = build(10)
    m.fit(X, Y, epochs=1, batch_size=16, verbose=0)
    kss.save_training_state(tmp_path / "s.h5", m)
    other = build(20)
    other(X[:1])
    with pytest.raises(kss.ScheduleMismatchError, match=r"config.decay_steps: saved 10, now 20") as e:
        kss.restore_training_state(tmp_path / "s.h5", other)
    assert e.value.fields == [("config.decay_steps", 10, 20)]
    kss.restore_training_state(tmp_path / "s.h5", other, check_schedule=False)
    assert int(other.optimizer.iterations) == 3
    same = build(10)
    same(X[:1])
    kss.restore_training_state(tmp_path / "s.h5", same)


def _fit_with_checkpoint(directory, epochs, extra=(), save_freq=2):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    m.compile(optimizer=kss.StableOptimizer(keras.optimizers.SGD(1e-2), model=m), loss="mse")
    ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, max_to_keep=3)
    m.fit(X, Y, epochs=epochs, batch_size=8, shuffle=False, verbose=0, callbacks=[ckpt, *extra])
    return m, ckpt


def test_truncated_newest_checkpoint_falls_back_and_says_so(tmp_path):
    ref, _ = _fit_with_checkpoint(tmp_path / "ref", epochs=3)
    _, ckpt = _fit_with_checkpoint(tmp_path / "run", epochs=2)
    newest = ckpt.checkpoints()[0]
    data = Path(newest).read_bytes()
    Path(newest).write_bytes(data[: len(data) // 3])
    with pytest.warns(UnreadableCheckpointWarning, match=re.escape(repr(newest))):
        resumed, ckpt2 = _fit_with_checkpoint(tmp_path / "run", epochs=3)
    assert ckpt2.skipped_checkpoints[0][0] == newest
    assert (tmp_path / "run" / UNREADABLE_DIR / os.path.basename(newest)).read_bytes() == data[
        : len(data) // 3
    ]
    assert ckpt2.restore_report is not None  # restored the older one, not a silent restart
    for a, b in zip(ref.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.optimizer.iterations) == int(ref.optimizer.iterations) == 18


def test_stable_checkpoint_validates_options(tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        kss.StableCheckpoint(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match="keep"):
        kss.StableCheckpoint(tmp_path, max_to_keep=0)


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


@pytest.mark.parametrize("kind", ["numpy", "pydataset"])
def test_mid_epoch_resume_with_shuffled_inputs(tmp_path, kind):
    def fit(directory, extra=()):
        keras.utils.set_random_seed(0)
        m = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        )
        m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=m), loss="mse")
        inputs = dict(x=X, y=Y, batch_size=8) if kind == "numpy" else dict(x=_Batches(X, Y, 8))
        try:
            m.fit(
                **inputs, epochs=3, shuffle=True, verbose=0,
                callbacks=[kss.StableCheckpoint(directory, save_freq=4, callbacks=extra), *extra],
            )  # fmt: skip
        except RuntimeError:
            pass
        return m

    ref = fit(tmp_path / "ref")
    fit(tmp_path / "run", extra=[StopAt(epoch=1, batch=5)])  # last save: global step 8 = epoch 1, batch 2
    res = fit(tmp_path / "run")
    assert int(ref.optimizer.iterations) == int(res.optimizer.iterations) == 18
    for a, b in zip(ref.get_weights(), res.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_optimizer_class_change_and_schedule_swap_are_refused(tmp_path):
    def build(opt):
        m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        m.compile(optimizer=kss.StableOptimizer(opt, model=m), loss="mse")
        m(X[:1])
        return m

    m = build(keras.optimizers.Adam(1e-2))
    m.fit(X, Y, epochs=1, batch_size=16, verbose=0)
    kss.save_training_state(tmp_path / "s.h5", m)
    with pytest.raises(
        kss.BindingError, match=r"saved from \['Adam'\] but the live optimizer is \['AdamW'\]"
    ):
        kss.restore_training_state(tmp_path / "s.h5", build(keras.optimizers.AdamW(1e-2)))
    sched = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=10)
    with pytest.raises(kss.ScheduleMismatchError, match=r"schedule: saved None, now \{"):
        kss.restore_training_state(tmp_path / "s.h5", build(keras.optimizers.Adam(sched)))


def test_stable_checkpoint_refuses_saves_inside_an_execution(tmp_path):
    # (exact resume with steps_per_execution > 1: tests/fit/test_inputs_resume.py)
    if BACKEND == "torch":
        pytest.skip("Keras refuses steps_per_execution > 1 on the torch backend itself")
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    m.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    with pytest.raises(kss.StateError, match="steps_per_execution=2"):
        m.fit(X, Y, epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path, save_freq=3)])
