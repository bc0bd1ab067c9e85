"""Asynchronous saves: ``save_training_state(..., blocking=False)`` and
``StableCheckpoint(save_on_background=True)``: the same file as a blocking save, errors of the
background write raised (by ``wait()``, at the next batch or save, and at train end),
exact resume, the verbose summary, and SIGKILL during background writes."""

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import test_checkpoint_dir
from conftest import StopAt, slots_by_key, to_np
from kit import mlp
from test_checkpoint_dir import CHILD, X, Y, _check_resume_after_kills, _finish, _temporaries, _wait_for

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.format import writer


def _train(m, steps=3):
    m.fit(X[: 8 * steps], Y[: 8 * steps], batch_size=8, epochs=1, shuffle=False, verbose=0)


def _assert_records_equal(a, b):
    for section in ("model", "optimizer", "arrays"):
        got, want = getattr(a, section), getattr(b, section)
        assert list(got) == list(want), section
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
            assert got[key].dtype == want[key].dtype, key
    assert a.contract == b.contract and a.extra == b.extra and a.metadata == b.metadata


# -- save_training_state(blocking=False) -------------------------------------------------------
@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_async_save_writes_what_a_blocking_save_writes_while_training_goes_on(tmp_path, ext, monkeypatch):
    m = mlp(6, 8, activation="tanh", seed=0)
    _train(m)
    weights = [to_np(v).copy() for v in m.weights]
    slots = {k: v.copy() for k, v in slots_by_key(m.optimizer).items()}
    blocking = kss.save_training_state(tmp_path / f"blocking.{ext}", m)
    trained, real = threading.Event(), writer.write_record

    def write_after_training(*args, **kwargs):
        assert trained.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_record", write_after_training)
    handle = kss.save_training_state(tmp_path / f"async.{ext}", m, blocking=False)
    assert isinstance(handle, kss.SaveHandle) and handle.path == str(tmp_path / f"async.{ext}")
    assert handle.blocked_secs > 0 and not handle.done()
    _train(m)  # changes every variable (in place on Torch) before the file is written
    assert not np.array_equal(to_np(m.weights[0]), weights[0])
    trained.set()
    assert handle.wait() == handle.path and handle.done()
    assert handle.nbytes == os.path.getsize(handle.path) and handle.write_secs > 0
    _assert_records_equal(format.read_file(handle.path), format.read_file(blocking))
    assert not _temporaries(tmp_path)
    fresh = mlp(6, 8, activation="tanh", seed=0)
    kss.restore_training_state(handle.path, fresh)
    for v, w in zip(fresh.weights, weights, strict=True):
        np.testing.assert_array_equal(to_np(v), w)
    for k, v in slots_by_key(fresh.optimizer).items():
        np.testing.assert_array_equal(v, slots[k], err_msg=k)
    if ext == "keras":  # Keras' own part holds the weights as they were at the call too
        loaded = keras.saving.load_model(handle.path)
        for v, w in zip(loaded.weights, weights, strict=True):
            np.testing.assert_array_equal(to_np(v), w)


@pytest.mark.parametrize("copy", ["as the backend has it", "on the device"])
def test_background_save_at_step_k_holds_step_k_after_later_donating_steps(tmp_path, copy, monkeypatch):
    """A save taken at step k, written after three more ``train_on_batch`` steps (each of
    which donates the state to its jitted step on JAX), holds exactly step k's values,
    compared by position with copies taken before the call."""
    from keras_stable_state._engines import background

    jax_cpu = keras.backend.backend() == "jax" and __import__("jax").devices()[0].platform == "cpu"
    if copy == "on the device":
        if keras.backend.backend() != "jax":
            pytest.skip("device copies are made of JAX arrays only (TensorFlow and Torch copy to the host)")
        monkeypatch.setattr(background, "_on_cpu", lambda array: False)  # the accelerator path, on CPU
    m = mlp(6, 8, activation="tanh", seed=0)
    _train(m)
    x, y = X[:8], Y[:8]
    m.train_on_batch(x, y)
    weights = [to_np(v).copy() for v in m.weights]
    slots = [to_np(v).copy() for v in m.optimizer.variables]
    gate, real = threading.Event(), writer.write_record

    def write_later(*args, **kwargs):
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_record", write_later)
    handle = kss.save_training_state(tmp_path / "k.h5", m, blocking=False)
    for _ in range(3):
        m.train_on_batch(x, y)
    assert not np.array_equal(to_np(m.weights[0]), weights[0])
    assert not np.array_equal(to_np(m.optimizer.variables[-1]), slots[-1])
    gate.set()
    handle.wait()
    monkeypatch.setattr(writer, "write_record", real)
    if jax_cpu:  # the steps donate: a plain reference to a variable's array would have been deleted
        ref = m.weights[0].value
        m.train_on_batch(x, y)
        assert ref.is_deleted()
    fresh = mlp(6, 8, activation="tanh", seed=0)
    kss.restore_training_state(handle.path, fresh)
    assert len(fresh.weights) == len(weights) and len(fresh.optimizer.variables) == len(slots)
    for i, (v, w) in enumerate(zip(fresh.weights, weights, strict=True)):
        np.testing.assert_array_equal(to_np(v), w, err_msg=f"weight {i}")
    for i, (v, w) in enumerate(zip(fresh.optimizer.variables, slots, strict=True)):
        np.testing.assert_array_equal(to_np(v), w, err_msg=f"optimizer variable {i}")


def test_async_save_writes_the_other_state_as_it_was_at_the_call(tmp_path, monkeypatch):
    class Live:
        """A provider whose state holds its live containers and array."""

        def __init__(self):
            self.log, self.table, self.counts = ["a"], {"k": [1, 2]}, np.arange(3)

        def get_state(self):
            return {"log": self.log, "table": self.table, "counts": self.counts}

        def set_state(self, state):
            self.log, self.table, self.counts = state["log"], state["table"], state["counts"]

    m, live = mlp(6, 8, activation="tanh", seed=0), Live()
    _train(m)
    written, real = threading.Event(), writer.write_record

    def write_when_told(*args, **kwargs):
        assert written.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_record", write_when_told)
    handle = kss.save_training_state(tmp_path / "s.h5", m, state={"live": live}, blocking=False)
    live.log.append("b")
    live.table["k"].append(3)
    live.table["new"] = []
    live.counts += 10
    written.set()
    handle.wait()
    fresh = Live()
    kss.restore_training_state(tmp_path / "s.h5", mlp(6, 8, activation="tanh", seed=0), state={"live": fresh})
    assert fresh.log == ["a"] and fresh.table == {"k": [1, 2]}
    np.testing.assert_array_equal(fresh.counts, np.arange(3))


def test_wait_reraises_the_write_error_with_its_type_and_path(tmp_path):
    m = mlp(6, 8, activation="tanh", seed=0)
    _train(m, 1)
    (tmp_path / "gone").write_text("a file where the folder should be")
    target = tmp_path / "gone" / "run.h5"
    with pytest.raises(OSError) as blocking_err:
        kss.save_training_state(target, m)
    handle = kss.save_training_state(target, m, blocking=False)  # the call itself succeeds
    with pytest.raises(OSError, match=re.escape(repr(str(target)))) as async_err:
        handle.wait()
    assert type(async_err.value) is type(blocking_err.value)
    assert async_err.value.errno == blocking_err.value.errno and async_err.value.filename == str(target)
    assert handle.done() and handle.nbytes is None and handle.write_secs is None
    with pytest.raises(OSError, match="Nothing was written there"):
        handle.wait()  # raised again, every time


def test_refusals_that_need_no_write_are_raised_by_the_call(tmp_path):
    m = mlp(6, 8, activation="tanh", seed=0)
    _train(m, 1)
    with pytest.raises(kss.CheckpointFormatError, match="use a '.keras' or '.h5' extension"):
        kss.save_training_state(tmp_path / "run.txt", m, blocking=False)
    (tmp_path / "d.h5").mkdir()
    with pytest.raises(kss.CheckpointFormatError, match="is a directory"):
        kss.save_training_state(tmp_path / "d.h5", m, blocking=False)
    with pytest.raises(TypeError, match="`blocking` of save_training_state must be True or False"):
        kss.save_training_state(tmp_path / "run.h5", m, blocking="no")


def test_saves_into_one_folder_are_written_in_order_and_the_next_call_waits(tmp_path, monkeypatch):
    m = mlp(6, 8, activation="tanh", seed=0)
    _train(m, 1)
    gate, order, real = threading.Event(), [], writer.write_record

    def slow_write(path, record, **kwargs):
        gate.wait(30)
        order.append(os.path.basename(path))
        return real(path, record, **kwargs)

    monkeypatch.setattr(writer, "write_record", slow_write)
    first = kss.save_training_state(tmp_path / "a.h5", m, blocking=False)
    assert not first.done()
    with pytest.raises(TimeoutError, match="has not finished within 0.05 s"):
        first.wait(timeout=0.05)
    threading.Timer(0.3, gate.set).start()
    second = kss.save_training_state(tmp_path / "b.h5", m, blocking=False)
    assert first.done() and second.blocked_secs >= 0.2  # the call waited for the first write
    second.wait()
    assert order == ["a.h5", "b.h5"]


@pytest.mark.parametrize("ext", [".h5", ".keras"])
def test_a_restore_waits_for_the_background_save_of_its_file(tmp_path, ext, monkeypatch):
    """A restore of a file whose background save is still being written reads the state
    of that save's call, not the file it replaces (compared by position)."""
    path = tmp_path / f"s{ext}"
    m = mlp(6, 8, activation="tanh", seed=0)
    _train(m, 1)
    kss.save_training_state(path, m)  # the older file on disk
    _train(m, 2)
    expected = [to_np(v) for v in m.variables + m.optimizer.variables]
    gate, real = threading.Event(), writer.write_record

    def slow_write(path, record, **kwargs):
        gate.wait(30)
        return real(path, record, **kwargs)

    monkeypatch.setattr(writer, "write_record", slow_write)
    handle = kss.save_training_state(path, m, blocking=False)
    _train(m, 1)  # the model moves on; the save holds the call's values
    fresh = mlp(6, 8, activation="tanh", seed=0)
    _train(fresh, 1)
    assert not handle.done()
    threading.Timer(0.3, gate.set).start()
    kss.restore_training_state(path, fresh)
    assert handle.done()
    got = [to_np(v) for v in fresh.variables + fresh.optimizer.variables]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)


# -- StableCheckpoint(save_on_background=True) ----------------------------------------------------------


def _fit(directory, extra=(), epochs=3, **options):
    m = mlp(6, 8, activation="tanh", seed=0)
    ckpt = kss.StableCheckpoint(directory, save_freq=4, max_to_keep=2, save_on_background=True, **options)
    try:
        m.fit(X, Y, batch_size=8, epochs=epochs, shuffle=True, verbose=0, callbacks=[ckpt, *extra])
    except RuntimeError as err:
        assert "preempted" in str(err)
    return m, ckpt


def test_fit_with_async_checkpoints_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    ref, _ = _fit(tmp_path / "ref")
    _fit(tmp_path / "run", extra=[StopAt(epoch=1, batch=5)])  # last save: global step 8
    res, ckpt = _fit(tmp_path / "run")
    assert ckpt.restore_report is not None and ckpt._position.global_step == 18
    assert int(ref.optimizer.iterations) == int(res.optimizer.iterations) == 18
    for a, b in zip(ref.get_weights(), res.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for k, v in slots_by_key(ref.optimizer).items():
        np.testing.assert_array_equal(slots_by_key(res.optimizer)[k], v, err_msg=k)
    # max_to_keep=2 counts written files only; the last save was waited for by on_train_end
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt-0000000012.h5", "ckpt-0000000016.h5"]
    assert ckpt.last_save.done() and ckpt.last_save.path.endswith("ckpt-0000000016.h5")


class _Sabotage(keras.callbacks.Callback):
    """Replace the checkpoint folder by a file (once the write in flight is done): every
    later write into it fails."""

    def __init__(self, ckpt, epoch):
        super().__init__()
        self.ckpt, self.directory, self.epoch = ckpt, Path(ckpt.directory), epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            if self.ckpt.last_save is not None:
                self.ckpt.last_save.wait()
            shutil.rmtree(self.directory)
            self.directory.write_text("not a folder")


def test_failed_background_save_is_raised_by_on_train_end(tmp_path):
    d = tmp_path / "ckpts"
    m = mlp(6, 8, activation="tanh", seed=0)
    ckpt = kss.StableCheckpoint(d, save_freq="epoch", save_on_background=True)
    with pytest.raises(OSError, match=re.escape(repr(str(d / "ckpt-0000000012.h5")))):
        # the last epoch's save runs in on_train_end; its write fails in the background
        m.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[ckpt, _Sabotage(ckpt, epoch=1)])
    assert ckpt.last_save.done() and not ckpt.manager.locked  # the directory was released


def test_failed_background_save_is_raised_during_fit(tmp_path):
    d = tmp_path / "ckpts"
    m = mlp(6, 8, activation="tanh", seed=0)
    ckpt = kss.StableCheckpoint(d, save_freq="epoch", save_on_background=True)
    with pytest.raises(OSError, match=re.escape(repr(str(d / "ckpt-0000000006.h5")))):
        m.fit(X, Y, batch_size=8, epochs=4, verbose=0, callbacks=[ckpt, _Sabotage(ckpt, epoch=0)])
    assert int(m.optimizer.iterations) < 24  # raised at a batch or at the next save, not after fit


@pytest.mark.parametrize("async_save", [False, True])
def test_verbose_prints_one_summary_line_per_save(tmp_path, capsys, async_save):
    m = mlp(6, 8, activation="tanh", seed=0)
    ckpt = kss.StableCheckpoint(
        tmp_path / "ckpts", save_freq="epoch", verbose=1, save_on_background=async_save
    )
    m.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[ckpt])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "saved ckpt-" in ln]
    timing = r"\d+ ms in the background, training blocked \d+ ms" if async_save else r"\d+ ms"
    pattern = (
        r"StableCheckpoint: saved ckpt-(\d{10})\.h5 \(epoch (\d), step 0, global step \d+\): ([\d.]+) MB in "
    )
    assert len(lines) == 2, lines
    for line, step in zip(lines, (6, 12), strict=True):
        found = re.fullmatch(pattern + timing, line)
        assert found, line
        size = os.path.getsize(tmp_path / "ckpts" / f"ckpt-{step:010d}.h5") / 1e6
        assert int(found.group(1)) == step and float(found.group(3)) == pytest.approx(size, abs=0.006)


def test_config_round_trips_with_async_save(tmp_path):
    ckpt = kss.StableCheckpoint(tmp_path, save_freq=5, max_to_keep=2, verbose=1, save_on_background=True)
    config = ckpt.get_config()
    assert config == {
        "directory": str(tmp_path),
        "save_freq": 5,
        "max_to_keep": 2,
        "verbose": 1,
        "save_on_background": True,
        "on_data_change": "raise",
        "monitor": None,
        "mode": "auto",
        "keep_best": 0,
        "storage_options": None,
        "save_on_preemption": True,
        "preemption_signals": (int(signal.SIGTERM),),
        "resume_stopped": False,
    }
    assert kss.StableCheckpoint.from_config(config).get_config() == config
    with pytest.raises(TypeError, match="save_on_background"):
        kss.StableCheckpoint(tmp_path, save_on_background=1)


# -- SIGKILL during background writes -----------------------------------------------------------
_SYNC_CKPT = "ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, max_to_keep=3)"
assert _SYNC_CKPT in CHILD  # the training process of test_checkpoint_dir, saving asynchronously
ASYNC_CHILD = (
    CHILD.replace(_SYNC_CKPT, _SYNC_CKPT[:-1] + ", save_on_background=True)")
    .replace(
        'if mode == "kill-in-rename":',
        'if mode == "kill-in-rename":\n    import threading\n    main_thread = threading.main_thread()',
    )
    .replace(
        "            if seen[0] == kill_at:\n",
        "            if seen[0] == kill_at:\n                if threading.current_thread() is main_thread:\n"
        "                    os._exit(3)  # the rename must happen in the background thread\n",
    )
)
assert "save_on_background=True" in ASYNC_CHILD and "os._exit(3)" in ASYNC_CHILD


def _start(tmp_path, mode, directory, *args, hidden="4"):
    return test_checkpoint_dir._start(tmp_path, mode, directory, *args, hidden=hidden, source=ASYNC_CHILD)


@pytest.mark.slow
def test_sigkill_inside_a_background_write_leaves_only_a_temporary_file(tmp_path):
    d = tmp_path / "ckpts"
    child = _start(tmp_path, "kill-in-rename", d, tmp_path / "unused", 5)
    rc = _finish(child)
    assert rc == -signal.SIGKILL, f"no kill in the 5th save: rc={rc} {child.log_path.read_text()[-3000:]}"
    assert len(_temporaries(d)) == 1  # the 5th checkpoint, written in full but never renamed
    assert sorted(n for n in os.listdir(d) if n.startswith("ckpt-")) == [
        f"ckpt-000000000{i}.h5" for i in (2, 3, 4)
    ]
    ckpt = _check_resume_after_kills(tmp_path, d, hidden=(4,))
    assert len(ckpt.removed_temporary_files) == 1 and ckpt._position.global_step == 4


@pytest.mark.slow
def test_sigkill_at_random_moments_during_background_writes_resumes_a_whole_checkpoint(tmp_path):
    """One kill by default (each costs a training process); ``KSS_KILL_SAVES=50`` runs a
    campaign of 50 kills (``KSS_CRASH_SEED`` draws the moments).

    Each restarted child's train begin restores the newest checkpoint; one that a kill left
    damaged would be moved into ``unreadable/`` (and fallen back from): none may be."""
    d = tmp_path / "ckpts"
    kills = int(os.environ.get("KSS_KILL_SAVES", "1"))
    seed = int(os.environ.get("KSS_CRASH_SEED", np.random.SeedSequence().entropy % 2**32))
    delays = np.random.default_rng(seed).uniform(0.0, 1.0, size=kills)
    for i, delay in enumerate(delays):
        ready = tmp_path / f"ready-{i}"
        child = _start(tmp_path, "train", d, ready, hidden="256,256")
        _wait_for(ready, child)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        rc = _finish(child)
        assert rc == -signal.SIGKILL, f"child ended by itself (rc={rc}, KSS_CRASH_SEED={seed})"
        assert not (d / "unreadable").exists(), f"a kill left a damaged checkpoint (KSS_CRASH_SEED={seed})"
    _check_resume_after_kills(tmp_path, d, hidden=(256, 256))
    assert not (d / "unreadable").exists()
