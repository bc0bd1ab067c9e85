"""``StableCheckpoint`` and ``CheckpointManager`` on a directory named ``*.orbax``, in one
process, on every backend: each checkpoint a ``ckpt-<step>.orbax`` step directory of the
``.orbax`` engine; an interrupted fit resumes exactly; pruning removes step directories;
a killed save's partial folder is removed and never restored; a damaged step is moved
aside; background saves and a missing orbax-checkpoint are refused. (Several JAX
processes: tests/transfer/test_multiprocess_jax.py.)"""

import builtins
import os
import shutil

import keras
import numpy as np
import pytest
from conftest import to_np
from kit import StopAt, assert_same_state, mlp

import keras_stable_state as kss

pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint (the [orbax] extra) is not installed")


def _fit(model, data, ckpt=None, stop=None, epochs=3):
    callbacks = [c for c in (ckpt, stop) if c is not None]
    x, y = data
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def _steps(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("ckpt-"))


def test_fit_killed_mid_epoch_resumes_exactly_from_orbax_steps(tmp_path, data):
    folder = tmp_path / "run.orbax"
    reference = mlp(seed=3)
    _fit(reference, data)

    first = mlp(seed=3)
    with pytest.raises(RuntimeError, match="preempted"):
        _fit(first, data, kss.StableCheckpoint(folder, save_freq=2, max_to_keep=2), StopAt(1, 3))
    # 4 batches per epoch: saves at global steps 2, 4, 6; the latest 2 are kept.
    assert _steps(folder) == ["ckpt-0000000004.orbax", "ckpt-0000000006.orbax"]
    assert sorted(os.listdir(folder / "ckpt-0000000006.orbax")) == ["arrays", "state.h5"]

    resumed = mlp(seed=4)  # other initial weights: everything must come from the checkpoint
    ckpt = kss.StableCheckpoint(folder, save_freq=2, max_to_keep=2)
    _fit(resumed, data, ckpt)
    assert ckpt.restore_report is not None and not ckpt.restore_report.left_fresh
    assert_same_state(resumed, reference)
    assert _steps(folder) == ["ckpt-0000000010.orbax", "ckpt-0000000012.orbax"]
    assert ckpt.manager.metadata(12).size_bytes > 0


def test_partial_step_of_a_killed_save_is_removed_and_never_restored(tmp_path, data):
    folder = tmp_path / "run.orbax"
    model = mlp(seed=3)
    _fit(model, data, kss.StableCheckpoint(folder), epochs=1)  # ckpt-0000000004.orbax
    saved = [to_np(v) for v in model.weights]
    # A save of step 8 killed before its commit (the rename), and one of step 4 killed
    # between its two renames (its previous directory moved aside, the new one not in place).
    shutil.copytree(folder / "ckpt-0000000004.orbax", folder / ".ckpt-0000000008.orbax.kss-partial")
    os.rename(folder / "ckpt-0000000004.orbax", folder / "ckpt-0000000004.orbax.kss-old")
    mgr = kss.CheckpointManager(folder)
    assert mgr.all_steps() == []
    other = mlp(seed=4)
    with mgr:
        assert mgr.removed_temporary_files == [str(folder / ".ckpt-0000000008.orbax.kss-partial")]
        mgr.restore(other)
    assert mgr.restored_step == 4 and _steps(folder) == ["ckpt-0000000004.orbax"]
    for a, b in zip(saved, other.weights, strict=True):
        np.testing.assert_array_equal(to_np(b), a)


def test_damaged_step_is_moved_aside_and_the_one_before_restored(tmp_path, data):
    folder = tmp_path / "run.orbax"
    model = mlp(seed=3)
    _fit(model, data, kss.StableCheckpoint(folder, save_freq=4, max_to_keep=None), epochs=2)
    assert _steps(folder) == ["ckpt-0000000004.orbax", "ckpt-0000000008.orbax"]
    os.remove(folder / "ckpt-0000000008.orbax" / "state.h5")
    ckpt = kss.StableCheckpoint(folder, save_freq=4)
    resumed = mlp(seed=4)
    with pytest.warns(kss.UnreadableCheckpointWarning, match=r"ckpt-0000000008\.orbax.*state\.h5"):
        _fit(resumed, data, ckpt, epochs=1)
    assert ckpt.run_complete  # step 4 (the end of epoch 0) restored: epochs=1 is done
    one_epoch = mlp(seed=3)
    _fit(one_epoch, data, epochs=1)
    assert_same_state(resumed, one_epoch)
    assert ckpt.moved_checkpoints == [
        (str(folder / "ckpt-0000000008.orbax"), str(folder / "unreadable" / "ckpt-0000000008.orbax"))
    ]
    assert os.path.isdir(folder / "unreadable" / "ckpt-0000000008.orbax")


def test_manager_on_orbax_steps_keeps_latest_and_best(tmp_path, data):
    x, y = data
    model = mlp(seed=3)
    with kss.CheckpointManager(tmp_path / "m.orbax", max_to_keep=1, keep_best=1, monitor="loss") as mgr:
        for step, loss in ((1, 0.5), (2, 0.25), (3, 0.75)):
            model.train_on_batch(x[:8], y[:8])
            if step == 2:
                best = [to_np(v) for v in model.weights]
            mgr.save(step, model, metrics={"loss": loss})
        assert mgr.all_steps() == [2, 3] and mgr.best_step() == 2
        assert mgr.metadata(2).metrics["loss"] == 0.25
        other = mlp(seed=4)
        mgr.restore(other, step="best")
    for a, b in zip(best, other.weights, strict=True):
        np.testing.assert_array_equal(to_np(b), a)


@pytest.mark.parametrize("make", [kss.StableCheckpoint, kss.CheckpointManager])
def test_background_saves_are_refused_for_orbax_steps(tmp_path, make):
    with pytest.raises(
        ValueError, match=r"save_on_background=True.*Orbax engine writes in the calling thread"
    ):
        make(tmp_path / "run.orbax", save_on_background=True)
    assert not (tmp_path / "run.orbax").exists()


def test_missing_orbax_is_refused_naming_the_extra(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_orbax(name, *args, **kwargs):
        if name.startswith("orbax"):
            raise ImportError("No module named 'orbax'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_orbax)
    with pytest.raises(kss.StateError, match=r"keras-stable-state\[orbax\]"):
        kss.StableCheckpoint(tmp_path / "run.orbax")
    assert not (tmp_path / "run.orbax").exists()


_JAX_ONLY = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="Orbax writes JAX arrays: the relative-path case runs on JAX"
)


@_JAX_ONLY
def test_relative_orbax_directory_resumes_and_nothing_is_moved_aside(tmp_path, data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reference = mlp(seed=3)
    _fit(reference, data)

    first = mlp(seed=3)
    with pytest.raises(RuntimeError, match="preempted"):
        _fit(first, data, kss.StableCheckpoint("run.orbax", save_freq=2, max_to_keep=2), StopAt(1, 2))
    assert _steps(tmp_path / "run.orbax") == ["ckpt-0000000004.orbax", "ckpt-0000000006.orbax"]
    saved = [to_np(v) for v in first.weights]  # stopped as batch 2 of epoch 1 began: global step 6

    # The step directory by its relative path: every array comes back as saved.
    other = mlp(seed=4)
    report = kss.restore_training_state("run.orbax/ckpt-0000000006.orbax", other)
    assert not report.left_fresh
    for a, b in zip(saved, other.weights, strict=True):
        np.testing.assert_array_equal(to_np(b), a)

    resumed = mlp(seed=4)  # other initial weights: everything must come from the checkpoint
    ckpt = kss.StableCheckpoint("run.orbax", save_freq=2, max_to_keep=2)
    _fit(resumed, data, ckpt)
    assert ckpt.moved_checkpoints == [] and ckpt.skipped_checkpoints == []
    assert not (tmp_path / "run.orbax" / "unreadable").exists()
    assert ckpt.restore_report is not None and not ckpt.restore_report.left_fresh
    assert_same_state(resumed, reference)


@_JAX_ONLY
def test_orbax_refusing_a_path_is_not_taken_for_damage(tmp_path, monkeypatch):
    from keras_stable_state._engines import orbax

    model = mlp(seed=3)
    path = tmp_path / "run.orbax"
    kss.save_training_state(path, model)

    def refuse(self, wanted):
        raise ValueError(f"Checkpoint path should be absolute. Got {self.directory}")

    monkeypatch.setattr(orbax._Source, "_restore", refuse)
    with pytest.raises(kss.StateError, match=r"refused the path.*not damaged") as caught:
        kss.restore_training_state(path, mlp(seed=4))
    assert not isinstance(caught.value, kss.CorruptCheckpointError)
    assert sorted(os.listdir(path)) == ["arrays", "state.h5"]
