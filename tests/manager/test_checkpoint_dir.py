"""StableCheckpoint's directory: one writer at a time (lock file), unreadable checkpoints moved
aside with a warning, pruning that tolerates vanished files, stale temporary files removed, a
checkpoint in use is not a damaged one, and SIGKILL during saves."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND, slots_by_key, to_np
from kit import StopAt, mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state._fit import LOCK_NAME, UNREADABLE_DIR, UnreadableCheckpointWarning

rng = np.random.default_rng(0)
X = rng.normal(size=(48, 6)).astype("float32")  # 6 batches of 8 per epoch
Y = (X @ rng.normal(size=(6, 1))).astype("float32")

# A training process for the tests below: `hold` trains one epoch and waits at its first batch
# until a file appears; `train` saves at every batch until it is killed; `kill-in-rename N`
# kills itself (SIGKILL) in the N-th checkpoint save, after the temporary file is written and
# before it is renamed.
CHILD = """
import os, signal, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import numpy as np
import keras_stable_state as kss

mode, directory, hidden, ready = sys.argv[1:5]
rng = np.random.default_rng(0)
x = rng.normal(size=(48, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1))).astype("float32")
keras.utils.set_random_seed(0)
layers = [keras.layers.Dense(int(w), activation="tanh") for w in hidden.split(",")]
model = keras.Sequential([keras.Input((6,)), *layers, keras.layers.Dense(1)])
model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")


class Signal(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if mode == "hold" and not os.path.exists(ready):
            open(ready, "w").close()
            deadline = time.monotonic() + 240
            while not os.path.exists(sys.argv[5]) and time.monotonic() < deadline:
                time.sleep(0.05)
        if mode == "train" and int(self.model.optimizer.iterations) >= 3 and not os.path.exists(ready):
            open(ready, "w").close()


if mode == "kill-in-rename":
    kill_at, seen, real_replace = int(sys.argv[5]), [0], os.replace

    def replace(src, dst, **kwargs):
        if os.path.basename(os.fspath(dst)).startswith("ckpt-"):
            seen[0] += 1
            if seen[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, **kwargs)

    os.replace = replace

save_freq = "epoch" if mode == "hold" else 1
epochs = 1 if mode == "hold" else 10_000
ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, max_to_keep=3)
model.fit(x, y, epochs=epochs, batch_size=8, shuffle=True, verbose=0, callbacks=[ckpt, Signal()])
"""


def _fit(directory, epochs, save_freq="epoch", max_to_keep=3, extra=(), hidden=(4,)):
    m = mlp(6, hidden, activation="tanh", seed=0)
    ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, max_to_keep=max_to_keep)
    m.fit(X, Y, epochs=epochs, batch_size=8, shuffle=True, verbose=0, callbacks=[ckpt, *extra])
    return m, ckpt


def _names(directory):
    return sorted(os.listdir(directory))


def _temporaries(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(".kss-"))


def _start(tmp_path, mode, directory, *args, hidden="4", source=None):
    """Start the child script (``source``, default :data:`CHILD`) in ``mode``."""
    script = tmp_path / ("child.py" if source is None else "other_child.py")
    script.write_text(CHILD if source is None else source)
    log = open(tmp_path / f"child-{mode}.log", "ab")  # noqa: SIM115  (closed by _finish)
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3")
    cmd = [sys.executable, str(script), mode, str(directory), hidden, *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log, proc.log_path = log, tmp_path / f"child-{mode}.log"
    return proc


def _finish(proc, timeout=300):
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.log.close()


def _wait_for(path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if proc.poll() is not None:
            _finish(proc)
            raise AssertionError(
                f"child exited with {proc.returncode} before {path}: {proc.log_path.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            _finish(proc, timeout=0)
            raise AssertionError(f"child did not create {path} within {timeout}s")
        time.sleep(0.05)


class _Snapshots(keras.callbacks.Callback):
    """Weights and slots at each epoch end: what the checkpoint of that epoch holds."""

    def __init__(self):
        super().__init__()
        self.at = {}

    def on_epoch_end(self, epoch, logs=None):
        self.at[epoch + 1] = ([to_np(v) for v in self.model.weights], slots_by_key(self.model.optimizer))


# -- one writer per directory -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.pairwise("directory_lock")
def test_second_writer_in_another_process_is_refused_naming_its_pid(tmp_path, directory_lock):
    d = tmp_path / "ckpts"
    ready, release = tmp_path / "ready", tmp_path / "release"
    child = _start(tmp_path, "hold", d, ready, release)
    try:
        _wait_for(ready, child)
        live_tmp = d / ".kss-in-flight.h5"  # the other writer's save in progress
        live_tmp.write_bytes(b"partial")
        m = mlp(6, (4,), activation="tanh", seed=0)
        before = [to_np(v) for v in m.weights]
        ckpt = kss.StableCheckpoint(d)
        holder = f"pid {child.pid} on host {socket.gethostname()}"
        with pytest.raises(
            kss.CheckpointInUseError, match=re.escape(f"another StableCheckpoint writer ({holder}")
        ) as info:
            m.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[ckpt])
        assert live_tmp.exists()  # refused before touching the other writer's files
        # the error's attributes name the directory and its holder
        err = info.value
        assert isinstance(err, BlockingIOError) and isinstance(err, kss.StateError)
        assert err.path == str(d)
        assert err.holder.startswith(holder)
        assert "wait for it to finish or use another directory" in str(err)
        assert ckpt.restore_report is None
        for a, b in zip(before, m.weights, strict=True):
            np.testing.assert_array_equal(a, to_np(b))
    finally:
        release.touch()
        rc = _finish(child)
    assert rc == 0, child.log_path.read_text()[-3000:]
    try:
        kss.StableCheckpoint(d)._take_directory()
    except kss.CheckpointInUseError as err:
        pytest.fail(f"the lock outlived its writer: {err}")
    # the directory is free again; the next fit resumes the other writer's checkpoint
    live_tmp.write_bytes(b"partial")
    m2, ckpt2 = _fit(d, epochs=2)
    assert ckpt2.restore_report is not None and int(m2.optimizer.iterations) == 12
    assert not live_tmp.exists()
    assert _names(d) == ["ckpt-0000000006.h5", "ckpt-0000000012.h5"]  # lock file removed


def test_second_writer_in_another_thread_is_refused(tmp_path, directory_lock):
    d = tmp_path / "ckpts"
    started, release, failures = threading.Event(), threading.Event(), []

    class Hold(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            started.set()
            release.wait(120)

    def first():
        try:
            _fit(d, epochs=1, extra=[Hold()])
        except BaseException as err:  # reported by the main thread below
            failures.append(err)
            started.set()

    thread = threading.Thread(target=first, name="first-writer")
    thread.start()
    try:
        assert started.wait(120)
        with pytest.raises(kss.CheckpointInUseError, match="this process, another thread still training"):
            kss.StableCheckpoint(d)._take_directory()
    finally:
        release.set()
        thread.join(120)
    assert not failures, failures
    assert _names(d) == ["ckpt-0000000006.h5"]


def test_fit_that_raised_leaves_the_lock_to_the_next_fit_in_the_same_thread(tmp_path, directory_lock):
    d = tmp_path / "ckpts"

    m = mlp(6, (4,), activation="tanh", seed=0)
    first = kss.StableCheckpoint(d)
    with pytest.raises(RuntimeError, match="interrupted"):
        m.fit(X, Y, epochs=3, batch_size=8, verbose=0, callbacks=[first, StopAt(1, message="interrupted")])
    assert LOCK_NAME in os.listdir(d)  # Keras skipped on_train_end: still held by `first`
    _, second = _fit(d, epochs=3)
    assert second.restore_report is not None
    assert _names(d) == ["ckpt-0000000006.h5", "ckpt-0000000012.h5", "ckpt-0000000018.h5"]
    del first  # its release no longer removes the lock of a later writer
    _fit(d, epochs=4)


def test_directory_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "x.h5"
    path.write_bytes(b"not a folder")
    m = mlp(6, (4,), activation="tanh", seed=0)
    with pytest.raises(NotADirectoryError, match=re.escape(f"{str(path)!r} is a file, not a folder")):
        m.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(path)])
    assert path.read_bytes() == b"not a folder"


# -- pruning ------------------------------------------------------------------------------------
def test_pruning_tolerates_a_checkpoint_removed_meanwhile(tmp_path):
    d = tmp_path / "ckpts"
    m = mlp(6, (4,), activation="tanh", seed=0)
    ckpt = kss.StableCheckpoint(d, save_freq=2, max_to_keep=2)
    listed, removed = ckpt.manager.checkpoints, []

    def racing():
        paths = listed()
        if len(paths) > 2:  # someone removes the oldest right after it was listed
            os.remove(paths[-1])
            removed.append(os.path.basename(paths[-1]))
        return paths

    ckpt.manager.checkpoints = racing
    m.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[ckpt])
    assert removed == ["ckpt-0000000002.h5", "ckpt-0000000004.h5", "ckpt-0000000006.h5", "ckpt-0000000008.h5"]
    assert _names(d) == ["ckpt-0000000010.h5", "ckpt-0000000012.h5"]


def test_keep_counts_only_checkpoint_files(tmp_path):
    d = tmp_path / "ckpts"
    d.mkdir()
    others = ["notes.txt", "ckpt-1.h5", "ckpt-0000000099.h5.bak", "ckpt-0000000099.keras"]
    for name in others:
        (d / name).write_bytes(b"x")
    _fit(d, epochs=3, max_to_keep=1)
    assert _names(d) == sorted(["ckpt-0000000018.h5", *others])


# -- unreadable checkpoints ---------------------------------------------------------------------
def _damage(path, how):
    data = Path(path).read_bytes()
    if how == "truncated":
        Path(path).write_bytes(data[: len(data) // 3])
    else:
        Path(path).write_bytes(np.random.default_rng(1).bytes(len(data)))
    return Path(path).read_bytes()


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_damaged_newest_falls_back_to_the_older_one_exactly_and_warns(tmp_path, how):
    d = tmp_path / "ckpts"
    snaps = _Snapshots()
    _fit(d, epochs=2, extra=[snaps])
    older, newest = (str(d / n) for n in ["ckpt-0000000006.h5", "ckpt-0000000012.h5"])
    damaged = _damage(newest, how)
    with pytest.warns(UnreadableCheckpointWarning) as caught:
        m, ckpt = _fit(d, epochs=1)  # resumes at epoch 1 of 1: nothing left to train
    (warning,) = [w for w in caught if w.category is UnreadableCheckpointWarning]
    moved = os.path.join(d, UNREADABLE_DIR, "ckpt-0000000012.h5")
    message = str(warning.message)
    assert f"{newest!r} -> {moved!r}" in message
    assert f"Fell back to the older {older!r} (epoch 1, step 0 of the epoch, global step 6)" in message
    assert ckpt.skipped_checkpoints[0][0] == newest and ckpt.moved_checkpoints == [(newest, moved)]
    assert ckpt.restore_report is not None
    weights, slots = snaps.at[1]
    for a, b in zip(weights, m.weights, strict=True):
        np.testing.assert_array_equal(a, to_np(b))
    live = slots_by_key(m.optimizer)
    assert sorted(live) == sorted(slots)
    for key, value in slots.items():
        np.testing.assert_array_equal(value, live[key], err_msg=key)
    assert int(m.optimizer.iterations) == 6
    assert _names(d) == ["ckpt-0000000006.h5", UNREADABLE_DIR]
    assert Path(moved).read_bytes() == damaged  # moved, not rewritten


def test_every_checkpoint_unreadable_starts_fresh_with_a_warning_and_new_checkpoints_survive_keep(tmp_path):
    d = tmp_path / "ckpts"
    _fit(d, epochs=2, max_to_keep=2)
    newest, older = (str(d / n) for n in ["ckpt-0000000012.h5", "ckpt-0000000006.h5"])
    _damage(newest, "garbage")
    _damage(older, "truncated")
    ref, _ = _fit(tmp_path / "ref", epochs=1)  # a run from scratch
    with pytest.warns(UnreadableCheckpointWarning, match="training starts fresh") as caught:
        m, ckpt = _fit(d, epochs=1, max_to_keep=1)
    (warning,) = [w for w in caught if w.category is UnreadableCheckpointWarning]
    message = str(warning.message)
    assert "2 unreadable checkpoints" in message
    for path in (newest, older):
        assert f"{path!r} -> {os.path.join(d, UNREADABLE_DIR, os.path.basename(path))!r}" in message
    assert [p for p, _ in ckpt.skipped_checkpoints] == [newest, older]
    assert ckpt.restore_report is None
    for a, b in zip(ref.weights, m.weights, strict=True):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    # the new checkpoint is the one kept, not deleted right after it was written
    assert _names(d) == ["ckpt-0000000006.h5", UNREADABLE_DIR]
    assert _names(d / UNREADABLE_DIR) == ["ckpt-0000000006.h5", "ckpt-0000000012.h5"]
    m2, ckpt2 = _fit(d, epochs=3, max_to_keep=2)  # no warning now: warnings are errors here
    assert ckpt2.restore_report is not None and int(m2.optimizer.iterations) == 18
    assert _names(d) == ["ckpt-0000000012.h5", "ckpt-0000000018.h5", UNREADABLE_DIR]
    # a second unreadable file of the same name does not overwrite the first one moved aside
    _damage(str(d / "ckpt-0000000012.h5"), "truncated")
    _damage(str(d / "ckpt-0000000018.h5"), "truncated")
    with pytest.warns(UnreadableCheckpointWarning, match="training starts fresh"):
        _fit(d, epochs=1, max_to_keep=2)
    assert _names(d / UNREADABLE_DIR) == [
        "ckpt-0000000006.h5",
        "ckpt-0000000012.h5",
        "ckpt-0000000012.h5.1",
        "ckpt-0000000018.h5",
    ]


def test_checkpoint_that_does_not_fit_the_model_is_not_moved_aside(tmp_path):
    d = tmp_path / "ckpts"
    _fit(d, epochs=1)
    other = mlp(6, (5,), activation="tanh", seed=0)
    with pytest.raises(kss.ContractError):
        other.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(d)])
    assert _names(d) == ["ckpt-0000000006.h5"]  # readable, kept, and the lock released
    _fit(d, epochs=2)


# -- a checkpoint in use is not damaged -----------------------------------------------------------
HOLD_FILE = {
    "flock": (
        "import fcntl, sys\n"
        "f = open(sys.argv[1], 'rb+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    ),
    "h5py-write": (
        "import sys, h5py\nf = h5py.File(sys.argv[1], 'r+')\nprint('held', flush=True)\nsys.stdin.read()\n"
    ),
}


@pytest.mark.parametrize("how", sorted(HOLD_FILE))
def test_newest_checkpoint_locked_by_another_process_raises_in_use_without_fallback(tmp_path, how):
    d = tmp_path / "ckpts"
    _fit(d, epochs=2)
    newest = str(d / "ckpt-0000000012.h5")
    content = Path(newest).read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_FILE[how], newest],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        m = mlp(6, (4,), activation="tanh", seed=0)
        before = [to_np(v) for v in m.weights]
        with pytest.raises(kss.CheckpointInUseError, match=re.escape(repr(newest))) as info:
            m.fit(X, Y, epochs=3, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(d)])
        assert info.value.path == newest
        assert "does not fall back" in str(info.value)
        assert _names(d) == ["ckpt-0000000006.h5", "ckpt-0000000012.h5"]  # nothing moved aside or pruned
        if how == "flock":  # h5py marks a file open for writing in its superblock
            assert Path(newest).read_bytes() == content
        for a, b in zip(before, m.weights, strict=True):
            np.testing.assert_array_equal(a, to_np(b))
    finally:
        holder.stdin.close()
        holder.wait(60)
        holder.stdout.close()
    m2, ckpt2 = _fit(d, epochs=3)  # released: the newest is restored, no fallback
    assert ckpt2.skipped_checkpoints == [] and int(m2.optimizer.iterations) == 18


# -- temporary files and SIGKILL ----------------------------------------------------------------
def test_stale_temporary_files_are_removed_at_train_begin_and_nothing_else(tmp_path):
    d = tmp_path / "ckpts"
    _fit(d, epochs=1)
    stale = [d / ".kss-abc123.h5", d / ".kss-q8x_z"]
    for path in stale:
        path.write_bytes(b"\0" * 4096)
    (d / ".kss-folder").mkdir()
    (d / "notes.txt").write_text("mine")
    m, ckpt = _fit(d, epochs=2)
    assert sorted(ckpt.removed_temporary_files) == sorted(str(p) for p in stale)
    assert _names(d) == [".kss-folder", "ckpt-0000000006.h5", "ckpt-0000000012.h5", "notes.txt"]
    assert ckpt.restore_report is not None and int(m.optimizer.iterations) == 12


class _AtTrainBegin(keras.callbacks.Callback):
    """After StableCheckpoint's on_train_begin: what the restore left; stops after one batch."""

    def get_state(self):  # declares it stateless for a resumed fit (no InexactResumeWarning)
        return {}

    def set_state(self, state):
        pass

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_train_begin(self, logs=None):
        self.names = _names(self.directory)
        self.weights = [to_np(v) for v in self.model.weights]
        self.model.stop_training = True


def _check_resume_after_kills(tmp_path, d, hidden):
    checkpoints = sorted(n for n in os.listdir(d) if re.fullmatch(r"ckpt-\d{10}\.h5", n))
    assert checkpoints, "no checkpoint was written before the kills"
    newest = str(d / checkpoints[-1])
    format.read_file(newest)  # fully written: every array passes its checksum
    spy = _AtTrainBegin(d)
    _, ckpt = _fit(d, epochs=10_000, save_freq=1, hidden=hidden, extra=[spy])
    assert ckpt.skipped_checkpoints == []  # the newest was whole (and no warning: they are errors)
    assert ckpt.restore_report is not None
    assert not _temporaries(d) and not [n for n in spy.names if n.startswith(".kss-")]
    for path in ckpt.removed_temporary_files:
        assert os.path.dirname(path) == str(d) and os.path.basename(path).startswith(".kss-")
    assert ckpt._position.global_step >= int(checkpoints[-1][5:15])
    reference = mlp(6, hidden, activation="tanh", seed=0)
    kss.restore_training_state(newest, reference)
    for a, b in zip(reference.weights, spy.weights, strict=True):
        np.testing.assert_array_equal(to_np(a), b)
    return ckpt


@pytest.mark.slow
def test_sigkill_inside_a_save_leaves_a_temporary_file_that_the_next_train_begin_removes(tmp_path):
    d = tmp_path / "ckpts"
    child = _start(tmp_path, "kill-in-rename", d, tmp_path / "unused", 5)
    rc = _finish(child)
    assert rc == -signal.SIGKILL, f"no kill in the 5th save: rc={rc} {child.log_path.read_text()[-3000:]}"
    assert len(_temporaries(d)) == 1  # the 5th checkpoint, written in full but never renamed
    assert [n for n in _names(d) if n.startswith("ckpt-")] == [f"ckpt-000000000{i}.h5" for i in (2, 3, 4)]
    ckpt = _check_resume_after_kills(tmp_path, d, hidden=(4,))
    assert len(ckpt.removed_temporary_files) == 1
    assert ckpt._position.global_step == 4  # restored step 4; fit stopped during the skipped batches


# SIGKILLs of the test below: one in `make test`, 50 in `make fuzz` (issue 8's acceptance).
KILL_SAVES = int(os.environ.get("KSS_KILL_SAVES", "1"))


@pytest.mark.slow
def test_sigkill_at_random_moments_during_saves_resumes_a_whole_checkpoint(tmp_path):
    """A training process saving at every batch is killed at a random moment, KSS_KILL_SAVES
    times in one directory; after each kill the next train begin restores the newest checkpoint,
    whole (its arrays equal the file's, every checksum passes), and no temporary file survives."""
    d = tmp_path / "ckpts"
    seed = int(os.environ.get("KSS_CRASH_SEED", np.random.SeedSequence().entropy % 2**32))
    draw = np.random.default_rng(seed)
    in_save = 0  # kills that left a temporary file behind: the process died inside a save
    for i in range(KILL_SAVES):
        ready = tmp_path / f"ready-{i}"
        child = _start(tmp_path, "train", d, ready, hidden="256,256")
        _wait_for(ready, child)
        time.sleep(draw.uniform(0.1, 1.0))
        # Then a random moment of the next save (its temporary file lives 3-25 ms): 0-12 ms on.
        deadline = time.monotonic() + 10
        while not _temporaries(d) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(draw.uniform(0.0, 0.012))
        child.send_signal(signal.SIGKILL)
        rc = _finish(child)
        assert rc == -signal.SIGKILL, f"kill {i}: child ended by itself (rc={rc}, KSS_CRASH_SEED={seed})"
        in_save += bool(_temporaries(d))
        try:
            _check_resume_after_kills(tmp_path, d, hidden=(256, 256))
        except AssertionError as exc:
            raise AssertionError(f"after kill {i} of {KILL_SAVES} (KSS_CRASH_SEED={seed}): {exc}") from exc
    print(
        f"[{BACKEND}] {KILL_SAVES} SIGKILLs (KSS_CRASH_SEED={seed}), {in_save} inside a save: all resumed whole"
    )
