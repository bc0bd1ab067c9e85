"""``CheckpointManager`` in a custom training loop (``model.train_on_batch``): a loop killed
with SIGKILL and resumed with ``restore(step="latest")`` ends where the uninterrupted loop
ends; ``restore(step="best")`` restores the best by the metric; pruning keeps exactly the
latest ``max_to_keep`` and the best ``keep_best``; the metadata of each checkpoint; the
directory lock shared with ``StableCheckpoint``; the fallback over unreadable checkpoints;
``StableCheckpoint``'s deprecated ``keep`` / ``async_save`` aliases and ``keep_best``; and a
finished ``fit`` run again returns its restored ``History``."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ROOT, TESTS, assert_same_state, mlp

import keras_stable_state as kss
from keras_stable_state._manager import records
from keras_stable_state._numpy import numpy_copy

BACKEND = keras.backend.backend()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")
STEPS, EVERY, BATCH = 14, 3, 8


def _batch(step):
    start = (step * BATCH) % len(X)
    return X[start : start + BATCH], Y[start : start + BATCH]


def _loop(model, mgr, start, stop, kill_after=None):
    """The custom loop: one ``train_on_batch`` per step, a save every EVERY steps."""
    for step in range(start, stop):
        loss = model.train_on_batch(*_batch(step))
        if (step + 1) % EVERY == 0:
            mgr.save(step + 1, model, metrics={"loss": float(loss)})
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


CHILD = """
import sys
import numpy as np
import keras_stable_state as kss
from kit import mlp
from test_checkpoint_manager import _loop, STEPS
directory, init, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = mlp(seed=0)
with np.load(init) as f:
    model.set_weights([f[k] for k in sorted(f.files, key=int)])
with kss.CheckpointManager(directory, max_to_keep=2) as mgr:
    _loop(model, mgr, 0, STEPS, kill_after=kill_after)
"""


def _weights(model):
    return [numpy_copy(v) for v in model.weights]


# -- a custom loop, killed and resumed ------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_custom_loop_resumes_exactly_from_the_latest_checkpoint(tmp_path):
    """The loop is SIGKILLed after a step drawn at random (``KSS_CRASH_SEED`` replays it)
    from those that leave two checkpoints and steps to train (5..12)."""
    seed = int(os.environ.get("KSS_CRASH_SEED", np.random.SeedSequence().entropy % 2**32))
    kill_after = int(np.random.default_rng(seed).integers(2 * EVERY - 1, STEPS - 1))
    print(f"killed after step {kill_after} (KSS_CRASH_SEED={seed})")
    directory, init = tmp_path / "ckpts", tmp_path / "init.npz"
    start_model = mlp(seed=0)
    np.savez(init, **{str(i): w for i, w in enumerate(_weights(start_model))})
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(
        os.environ,
        KERAS_BACKEND=BACKEND,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
    )
    child = subprocess.run(
        [sys.executable, str(script), str(directory), str(init), str(kill_after)],
        env=env,
        capture_output=True,
        timeout=240,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-3000:]

    # The uninterrupted loop, from the same initial weights.
    whole = mlp(seed=0)
    whole.set_weights(_weights(start_model))
    with kss.CheckpointManager(tmp_path / "whole", max_to_keep=None) as mgr:
        _loop(whole, mgr, 0, STEPS)

    resumed = mlp(seed=7)  # other initial weights: the restore puts everything back
    with kss.CheckpointManager(directory, max_to_keep=2) as mgr:
        saved = (kill_after + 1) // EVERY * EVERY
        assert mgr.all_steps() == [saved - EVERY, saved]
        report = mgr.restore(resumed)
        assert report is not None and mgr.restored_step == saved
        assert int(resumed.optimizer.iterations) == saved
        _loop(resumed, mgr, saved, STEPS)
    assert_same_state(whole, resumed)


# -- best --------------------------------------------------------------------------------------
def test_restore_best_restores_the_best_by_the_metric_and_a_new_manager_knows_it(tmp_path):
    model = mlp(seed=0)
    losses = [0.5, 0.2, 0.9, 0.3, 0.7]
    snapshots = {}
    with kss.CheckpointManager(tmp_path, max_to_keep=1, keep_best=1, monitor="loss") as mgr:
        for i, loss in enumerate(losses):
            model.train_on_batch(*_batch(i))
            mgr.save(i + 1, model, metrics={"loss": loss})
            snapshots[i + 1] = (_weights(model), [numpy_copy(v) for v in model.optimizer.variables])
        assert mgr.all_steps() == [2, 5] and mgr.best_step() == 2 and mgr.latest_step() == 5
    again = kss.CheckpointManager(tmp_path, max_to_keep=1, keep_best=1, monitor="loss", mode="min")
    assert again.best_step() == 2  # read from the checkpoints' metadata
    for step in ("best", "latest"):
        fresh = mlp(seed=3)
        again.restore(fresh, step=step)
        want = 2 if step == "best" else 5
        assert again.restored_step == want
        weights, opt = snapshots[want]
        for a, b in zip(_weights(fresh), weights, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(fresh.optimizer.variables, opt, strict=True):
            np.testing.assert_array_equal(numpy_copy(a), b)
    with pytest.raises(FileNotFoundError, match=r"No checkpoint of step 3 .* its steps are \[2, 5\]"):
        again.restore(mlp(seed=3), step=3)
    again.close()
    higher = kss.CheckpointManager(tmp_path, monitor="loss", mode="max")
    assert higher.best_step() == 5  # 0.7 > 0.5... of the two left
    with pytest.raises(ValueError, match="has no `monitor`"):
        kss.CheckpointManager(tmp_path).best_step()


def _expected_kept(metrics, max_to_keep, keep_best, mode):
    """The steps left after saving steps 1..n with ``metrics`` (None: no metric), computed
    by replaying the rule: after each save, the latest ``max_to_keep`` present and the best
    ``keep_best`` present (a lower loss, or a higher accuracy; ties: the earlier step)."""
    present = []
    for step, value in enumerate(metrics, start=1):
        present.append(step)
        latest = sorted(present)[-max_to_keep:]
        with_metric = [s for s in present if metrics[s - 1] is not None]

        def rank(s):
            value = metrics[s - 1]
            return (value if mode == "min" else -value, s)

        best = sorted(with_metric, key=rank)[:keep_best]
        present = sorted(set(latest) | set(best))
    return present


_MODEL = {}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    metrics=st.lists(
        st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.3, 0.5, 0.9])), min_size=1, max_size=7
    ),
    max_to_keep=st.integers(1, 3),
    keep_best=st.integers(0, 3),
    mode=st.sampled_from(["min", "max"]),
)
def test_pruning_keeps_exactly_the_latest_and_the_best(
    tmp_path_factory, metrics, max_to_keep, keep_best, mode
):
    model = _MODEL.setdefault("m", mlp(hidden=(), seed=0))
    directory = tmp_path_factory.mktemp("prune")
    monitor = "val_loss" if mode == "min" else "val_accuracy"
    mgr = kss.CheckpointManager(directory, max_to_keep, keep_best=keep_best, monitor=monitor, mode="auto")
    with mgr:
        for step, value in enumerate(metrics, start=1):
            mgr.save(step, model, metrics=None if value is None else {monitor: value, "other": -1.0})
    assert mgr.all_steps() == _expected_kept(metrics, max_to_keep, keep_best, mode)
    named = sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))
    assert named == [f"ckpt-{s:010d}.h5" for s in mgr.all_steps()]


# -- metadata ----------------------------------------------------------------------------------
def test_metadata_tells_step_epoch_metrics_time_size_format_and_backend(tmp_path):
    model = mlp(seed=0)
    before = time.time()
    with kss.CheckpointManager(tmp_path) as mgr:
        path = mgr.save(40, model, metrics={"loss": np.float32(0.25), "acc": 1}, epoch=2)
        mgr.save(41, model)
    after = time.time()
    info = mgr.metadata(40)
    assert (info.step, info.epoch, dict(info.metrics), info.path) == (40, 2, {"loss": 0.25, "acc": 1.0}, path)
    assert before <= info.wall_time <= after
    assert info.size_bytes == os.path.getsize(path) and info.backend == BACKEND
    assert info.format == kss.format.FORMAT_VERSION
    assert info.world_size == 1  # one process (Torch ranks, JAX processes: their number)
    # a checkpoint of an older version, whose record has no world size: unknown
    older = records.metadata_of(40, path, ({"backend": BACKEND}, {"step": 40}, 3), 1)
    assert older.world_size is None
    bare = mgr.metadata(41)
    assert (bare.epoch, dict(bare.metrics)) == (None, {})
    with pytest.raises(TypeError, match=r"`metrics\['loss'\]` must be a number"):
        mgr.save(42, model, metrics={"loss": "low"})
    with pytest.raises(ValueError, match=r"`step` must be an int from 0"):
        mgr.save(-1, model)
    with pytest.raises(TypeError, match="use save_on_background=True"):
        mgr.save(42, model, blocking=False)
    with pytest.raises(ValueError, match="keep_best=1` keeps the best checkpoints by a metric"):
        kss.CheckpointManager(tmp_path, keep_best=1)
    with pytest.raises(ValueError, match="mode='auto' cannot tell"):
        kss.CheckpointManager(tmp_path, monitor="throughput")
    mgr.close()


# -- background saves --------------------------------------------------------------------------
def test_background_saves_write_the_same_checkpoints_and_prune_once_written(tmp_path):
    model = mlp(seed=0)
    with kss.CheckpointManager(tmp_path / "bg", max_to_keep=2, save_on_background=True) as mgr:
        for step in range(1, 5):
            model.train_on_batch(*_batch(step))
            handle = mgr.save(step, model, metrics={"loss": float(step)})
            assert isinstance(handle, kss.SaveHandle)
            blocking_path = kss.save_training_state(tmp_path / f"b{step}.h5", model)
        mgr.wait()
        assert mgr.all_steps() == [3, 4]
    fresh = mlp(seed=1)
    kss.CheckpointManager(tmp_path / "bg").restore(fresh)
    other = mlp(seed=2)
    kss.restore_training_state(blocking_path, other)
    assert_same_state(fresh, other)


# -- the lock --------------------------------------------------------------------------------
def test_the_lock_excludes_a_second_manager_and_a_stable_checkpoint(tmp_path, directory_lock):
    model = mlp(seed=0)
    with kss.CheckpointManager(tmp_path) as mgr:
        assert mgr.locked
        with pytest.raises(kss.CheckpointInUseError, match=r"in use by another CheckpointManager writer"):
            kss.CheckpointManager(tmp_path).save(2, model)
        with pytest.raises(kss.CheckpointInUseError, match=r"in use by another CheckpointManager writer"):
            model.fit(X, Y, epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path)])
        assert mgr.all_steps() == []
    assert not mgr.locked
    # released: a StableCheckpoint takes it, then (its fit ended) a manager again
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path)])
    with kss.CheckpointManager(tmp_path, max_to_keep=None) as mgr:
        mgr.save(100, model)
        assert mgr.all_steps() == [4, 100]


HOLD = """
import sys
import keras_stable_state as kss
mgr = kss.CheckpointManager(sys.argv[1])
mgr.lock()
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.pairwise("directory_lock")
def test_a_manager_of_another_process_excludes_this_one_naming_it(tmp_path, directory_lock):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(
            kss.CheckpointInUseError, match=rf"another CheckpointManager writer \(pid {holder.pid} "
        ):
            kss.CheckpointManager(tmp_path).restore(mlp(seed=0))
    finally:
        holder.communicate(b"", timeout=60)
    assert kss.CheckpointManager(tmp_path).restore(mlp(seed=0)) is None  # released with its process


# -- unreadable checkpoints ----------------------------------------------------------------------
def test_restore_latest_moves_an_unreadable_checkpoint_aside_and_falls_back(tmp_path):
    model = mlp(seed=0)
    with kss.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, model)
        kept = _weights(model)
        model.train_on_batch(*_batch(0))
        newest = mgr.save(2, model)
    data = pathlib.Path(newest).read_bytes()
    pathlib.Path(newest).write_bytes(data[: len(data) // 2])
    fresh = mlp(seed=5)
    mgr = kss.CheckpointManager(tmp_path)
    with pytest.warns(kss.UnreadableCheckpointWarning, match=r"CheckpointManager: 1 unreadable .*step 1"):
        assert mgr.restore(fresh) is not None
    assert mgr.restored_step == 1 and mgr.all_steps() == [1]
    assert mgr.moved_checkpoints == [(newest, str(tmp_path / "unreadable" / "ckpt-0000000002.h5"))]
    for a, b in zip(_weights(fresh), kept, strict=True):
        np.testing.assert_array_equal(a, b)
    mgr.close()
    with pytest.raises(FileNotFoundError, match="no best to restore"):
        kss.CheckpointManager(tmp_path, monitor="loss").restore(fresh, step="best")


# -- StableCheckpoint: aliases, keep_best, a finished run --------------------------------------
def _fit(directory, epochs=2, **options):
    model = mlp(seed=0)
    ckpt = kss.StableCheckpoint(directory, **options)
    history = model.fit(X, Y, epochs=epochs, batch_size=8, verbose=0, validation_split=0.25, callbacks=[ckpt])
    return model, ckpt, history


def test_the_deprecated_keep_and_async_save_warn_and_behave_as_the_new_names(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"`keep`=\.\.\.\) is deprecated .* use `max_to_keep`="):
        old = kss.StableCheckpoint(tmp_path / "old", save_freq=2, keep=1)
    with pytest.warns(DeprecationWarning, match=r"`async_save`=\.\.\.\) is deprecated"):
        old_bg = kss.StableCheckpoint(tmp_path / "old_bg", async_save=True)
    assert (old.max_to_keep, old_bg.save_on_background) == (1, True)
    assert old.get_config()["max_to_keep"] == 1 and "keep" not in old.get_config()
    with pytest.raises(ValueError, match="both `keep` and `max_to_keep`"):
        kss.StableCheckpoint(tmp_path, keep=1, max_to_keep=2)
    model = mlp(seed=0)
    model.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[old])
    new_model, new, _ = _fit(tmp_path / "new", save_freq=2, max_to_keep=1, epochs=2)
    assert sorted(os.listdir(tmp_path / "old")) == ["ckpt-0000000008.h5"]
    assert sorted(os.listdir(tmp_path / "new")) == ["ckpt-0000000006.h5"]  # validation_split: 3 batches


def test_stable_checkpoint_keeps_the_best_epoch_by_val_loss_beside_the_latest(tmp_path):
    model, ckpt, history = _fit(tmp_path, epochs=5, max_to_keep=1, monitor="val_loss", keep_best=1)
    val = history.history["val_loss"]
    best_epoch = int(np.argmin(val))  # epoch index: its checkpoint is at global step 3 * (epoch + 1)
    steps = sorted({3 * (best_epoch + 1), 15})
    assert ckpt.manager.all_steps() == steps and ckpt.manager.best_step() == 3 * (best_epoch + 1)
    info = ckpt.manager.metadata(3 * (best_epoch + 1))
    assert info.metrics["val_loss"] == pytest.approx(val[best_epoch]) and info.epoch == best_epoch + 1


def test_a_finished_run_run_again_returns_the_restored_history_and_says_it_is_complete(tmp_path, capsys):
    _, first, history = _fit(tmp_path, epochs=2)
    assert first.run_complete is False
    again = mlp(seed=1)
    ckpt = kss.StableCheckpoint(tmp_path, verbose=1)
    rerun = again.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_split=0.25, callbacks=[ckpt])
    assert ckpt.run_complete is True
    assert rerun.epoch == [0, 1] and set(rerun.history) == set(history.history)
    for key, values in history.history.items():
        np.testing.assert_allclose(rerun.history[key], values, rtol=1e-6)
    assert "is complete (epoch 2 of 2" in capsys.readouterr().out


_EXIT_CHILD = """
import sys, keras, numpy as np, keras_stable_state as kss
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
mgr = kss.CheckpointManager(sys.argv[1], max_to_keep=2, save_on_background=True)
for step in (1, 2, 3):
    for v in model.weights:
        v.assign(np.full(v.shape, step, "float32"))
    mgr.save(step, model, include_rng=False)
print("SAVED", flush=True)  # no close(), no wait(): a normal exit
"""


def test_a_background_save_pending_at_exit_is_completed_and_pruned(tmp_path):
    """``save_on_background=True, max_to_keep=2`` and no ``close()``: at a normal exit the
    pending save completes and the retention policy applies (two checkpoints, not three),
    and the lock is released."""
    folder = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": ROOT, "KERAS_BACKEND": keras.backend.backend()}
    done = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(folder)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "SAVED" in done.stdout, done.stderr[-3000:]
    assert "pending at exit failed" not in done.stderr
    assert sorted(os.listdir(folder)) == ["ckpt-0000000002.h5", "ckpt-0000000003.h5"]
    mgr = kss.CheckpointManager(folder, max_to_keep=2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    mgr.restore(model, include_rng=False)
    assert mgr.restored_step == 3
    np.testing.assert_array_equal(np.array(model.weights[0]), np.full((4, 3), 3, "float32"))
    mgr.close()


class _ReplaysOrder:
    """A state provider standing for kss.ResumableSampler: it replays the data order for
    another world size itself (and says where it cannot)."""

    replays_other_world_sizes = True

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


class _NoReplay(_ReplaysOrder):
    replays_other_world_sizes = False


def test_a_restore_on_another_number_of_processes_is_warned_unless_the_order_is_replayed(
    tmp_path, monkeypatch
):
    """The world size recorded at save (1 here) against the live one (2, as a relaunch on
    another number of Torch ranks or JAX processes sees it): warned naming both and the fixes,
    unless a provider of the restore replays the order (ResumableSampler); the same world
    size: nothing."""
    from types import SimpleNamespace

    from keras_stable_state._manager import checkin

    model = mlp(seed=0)
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    model.train_on_batch(np.ones((4, 4), "float32"), np.ones((4, 1), "float32"))
    with kss.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, model, state={"data": _ReplaysOrder()})
    assert kss.CheckpointManager(tmp_path).metadata(1).world_size == 1
    with kss.CheckpointManager(tmp_path) as mgr:
        mgr.restore(model, state={"data": _ReplaysOrder()})  # same world size: no warning (they are errors)
    monkeypatch.setattr(checkin, "_processes", SimpleNamespace(process_count=lambda: 2))
    with kss.CheckpointManager(tmp_path) as mgr:
        with pytest.warns(
            kss.InexactResumeWarning, match=r"saved by 1 process\(es\) and this run has 2.*ResumableSampler"
        ):
            mgr.restore(model, state={"data": _NoReplay()})
        assert mgr.restored_step == 1
        mgr.restore(model, state={"data": _ReplaysOrder()})  # the provider replays the order: no warning
