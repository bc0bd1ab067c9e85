"""The lock of a local checkpoint directory, with each implementation (``flock``, and the
portable marker lock of platforms without ``fcntl``, forced by ``KSS_DIRECTORY_LOCK`` here and
in the child processes): two processes contending, a lock left by a process that exited or was
killed, release and re-acquire, a second writer of this process, links and other files where
the lock file or the marker belong, a forked child, and the choice of implementation."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from kit import ROOT, TESTS, mlp

import keras_stable_state as kss
from keras_stable_state._manager import lock, portable_lock

LOCK = lock.LOCK_NAME
MARKER = LOCK + portable_lock.MARKER_SUFFIX

# A process that takes the lock of argv[1] and then, by argv[2]: "hold" (until stdin closes,
# then releases it), "exit" (ends at once without releasing it: os._exit runs no clean-up),
# "elsewhere" (as "exit", its host name changed first: a holder on another host). argv[3]:
# "noflock" (flock fails as on a file system without it: the portable lock holds the marker
# alone), "nomarker" (takes no marker: a flock writer of an older version), or "".
HOLDER = """
import errno, os, socket, sys
directory, how, variant = sys.argv[1:4]
if how == "elsewhere":
    socket.gethostname = lambda: "another-host.example"
from keras_stable_state._manager import lock
if variant == "noflock":
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    lock.fcntl.flock = flock
if variant == "nomarker":
    lock._take_marker = lambda directory, path, fd, **kw: None
held = lock.acquire_lock(directory, lock.new_token(), writer="CheckpointManager", reclaimable=False)
print("locked", flush=True)
if how == "hold":
    sys.stdin.read()
    held.release(held.token)
    sys.exit(0)
os._exit(0)
"""


def _holder(directory, how, kind=None, variant=""):
    """The `HOLDER` process, with the lock ``kind`` (``KSS_DIRECTORY_LOCK``) if given."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    if kind is not None:
        env["KSS_DIRECTORY_LOCK"] = kind
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), how, variant],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    line = child.stdout.readline().strip()
    if line != b"locked":
        child.kill()
        pytest.fail(f"the holder did not lock: {child.communicate(timeout=60)[1].decode()[-3000:]}")
    return child


def _acquire(directory, writer="StableCheckpoint", reclaimable=True):
    token = lock.new_token()
    return lock.acquire_lock(str(directory), token, writer=writer, reclaimable=reclaimable), token


def _names(directory):
    return sorted(os.listdir(directory))


def _record(directory):
    with open(os.path.join(directory, LOCK)) as f:
        return json.load(f)


@pytest.mark.backend_free
def test_the_forced_implementation_is_used(tmp_path, directory_lock):
    held, token = _acquire(tmp_path)
    try:
        assert held.marker is not None  # both kinds take the marker
        assert _names(tmp_path) == [LOCK, MARKER]
        assert _record(tmp_path)["pid"] == os.getpid()
    finally:
        held.release(token)
    assert _names(tmp_path) == []


@pytest.mark.backend_free
@pytest.mark.slow
def test_a_second_process_is_refused_naming_the_first(tmp_path, directory_lock):
    child = _holder(tmp_path, "hold")
    try:
        holder = f"pid {child.pid} on host {socket.gethostname()}"
        with pytest.raises(
            kss.CheckpointInUseError, match=re.escape(f"another CheckpointManager writer ({holder}, since ")
        ) as info:
            _acquire(tmp_path)
        assert info.value.path == str(tmp_path) and info.value.holder.startswith(holder)
        assert str(tmp_path / LOCK) in str(info.value)  # both kinds take the flock first, where it works
    finally:
        child.communicate(b"", timeout=60)
    assert child.returncode == 0
    assert _names(tmp_path) == []  # released, files removed
    held, token = _acquire(tmp_path)
    held.release(token)


@pytest.mark.backend_free
@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_lock_left_by_a_process_that_ended_is_taken_over(tmp_path, directory_lock, end):
    child = _holder(tmp_path, "hold" if end == "kill" else "exit")
    if end == "kill":
        os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)  # reaped: a zombie still runs, as far as a pid check can tell
    assert child.returncode == (-signal.SIGKILL if end == "kill" else 0)
    assert _names(tmp_path) == [LOCK, MARKER] and _record(tmp_path)["pid"] == child.pid
    held, token = _acquire(tmp_path)
    try:
        assert _record(tmp_path)["pid"] == os.getpid()
        assert _record(tmp_path)["writer"] == "StableCheckpoint"
    finally:
        held.release(token)
    assert _names(tmp_path) == []


@pytest.mark.backend_free
@pytest.mark.slow
def test_a_portable_lock_of_another_host_is_refused_naming_its_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("KSS_DIRECTORY_LOCK", "portable")
    child = _holder(tmp_path, "elsewhere", variant="noflock")  # its marker alone held the lock
    child.communicate(timeout=60)  # ended, but no process of this host can tell
    for _ in range(2):  # never taken over
        with pytest.raises(kss.CheckpointInUseError) as info:
            _acquire(tmp_path)
        message = str(info.value)
        assert f"pid {child.pid} on host another-host.example" in message
        assert "cannot probe" in message
        assert f"remove {str(tmp_path / MARKER)!r}" in message
    os.remove(tmp_path / MARKER)  # what the message says to do, once that process is known gone
    held, token = _acquire(tmp_path)
    held.release(token)
    assert _names(tmp_path) == []


@pytest.mark.backend_free
@pytest.mark.parametrize("holder_kind", ["flock", "portable"])
def test_a_marker_of_another_host_whose_writer_held_flock_is_taken_over(
    tmp_path, directory_lock, holder_kind
):
    """A job killed on one node and requeued on another (a shared file system whose flock spans
    hosts): the ended writer's flock is free, and its record says it held it, so its marker is
    taken over by a writer of either kind; the new record names this host."""
    child = _holder(tmp_path, "elsewhere", kind=holder_kind)
    child.communicate(timeout=60)
    assert _record(tmp_path)["flock"] is True and _record(tmp_path)["host"] == "another-host.example"
    assert os.path.exists(tmp_path / MARKER)
    held, token = _acquire(tmp_path)
    assert _record(tmp_path)["host"] == socket.gethostname() and _record(tmp_path)["pid"] == os.getpid()
    held.release(token)
    assert _names(tmp_path) == []


@pytest.mark.backend_free
def test_a_live_writer_of_another_host_holding_flock_is_refused(tmp_path, directory_lock):
    """The take-over needs the flock free: while that writer holds it, it is refused by the flock."""
    child = _holder(tmp_path, "hold", kind="flock")
    try:
        with pytest.raises(kss.CheckpointInUseError, match=re.escape(f"(pid {child.pid} on host ")):
            _acquire(tmp_path)
    finally:
        child.communicate(b"", timeout=60)


KINDS = [("flock", "portable"), ("portable", "flock")]


@pytest.mark.backend_free
@pytest.mark.slow
@pytest.mark.parametrize(("first", "second"), KINDS)
def test_a_writer_of_the_other_kind_is_refused_naming_the_first(tmp_path, monkeypatch, first, second):
    child = _holder(tmp_path, "hold", kind=first)
    try:
        monkeypatch.setenv("KSS_DIRECTORY_LOCK", second)
        holder = f"pid {child.pid} on host {socket.gethostname()}"
        for _ in range(2):  # refused each time, and the refusal leaves the holder's files alone
            with pytest.raises(
                kss.CheckpointInUseError,
                match=re.escape(f"another CheckpointManager writer ({holder}, since "),
            ) as info:
                _acquire(tmp_path)
            assert info.value.holder.startswith(holder)
            assert _names(tmp_path) == [LOCK, MARKER] and _record(tmp_path)["pid"] == child.pid
        assert os.path.realpath(tmp_path) not in lock._HELD
    finally:
        child.communicate(b"", timeout=60)
    assert child.returncode == 0 and _names(tmp_path) == []
    held, token = _acquire(tmp_path)  # the refused writer released its marker (or flock) too
    held.release(token)
    assert _names(tmp_path) == []


@pytest.mark.backend_free
@pytest.mark.slow
def test_a_writer_is_refused_by_a_portable_marker_where_flock_fails(tmp_path, directory_lock):
    child = _holder(tmp_path, "hold", kind="portable", variant="noflock")  # as on NFS without locking
    try:
        with pytest.raises(kss.CheckpointInUseError, match=re.escape(f"(pid {child.pid} on host ")) as info:
            _acquire(tmp_path)
        assert f"The lock is the marker {str(tmp_path / MARKER)!r}" in str(info.value)
    finally:
        child.communicate(b"", timeout=60)
    assert child.returncode == 0 and _names(tmp_path) == []


@pytest.mark.backend_free
@pytest.mark.slow
def test_a_portable_writer_is_refused_by_a_flock_writer_without_a_marker(tmp_path, monkeypatch):
    child = _holder(tmp_path, "hold", kind="flock", variant="nomarker")  # an older version
    try:
        monkeypatch.setenv("KSS_DIRECTORY_LOCK", "portable")
        with pytest.raises(kss.CheckpointInUseError, match=re.escape(f"(pid {child.pid} on host ")) as info:
            _acquire(tmp_path)
        assert f"The lock is {str(tmp_path / LOCK)!r}, held with flock" in str(info.value)
        assert _names(tmp_path) == [LOCK]  # the refused writer's marker is released
    finally:
        child.communicate(b"", timeout=60)
    assert child.returncode == 0 and _names(tmp_path) == []


@pytest.mark.backend_free
@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_killed_flock_writers_marker_blocks_no_writer_of_either_kind(tmp_path, directory_lock, end):
    child = _holder(tmp_path, "hold" if end == "kill" else "exit", kind="flock")
    if end == "kill":
        os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    assert _names(tmp_path) == [LOCK, MARKER]  # the flock is gone with its process; the marker is left
    held, token = _acquire(tmp_path)  # with the kind directory_lock forces
    try:
        assert _record(tmp_path)["pid"] == os.getpid()
    finally:
        held.release(token)
    assert _names(tmp_path) == []


# Trains in argv[1], saving every step (12 in all), and at step 3 leaves a temporary file as a
# save in progress does, creates argv[2] and waits for argv[3]; fails if its temporary file was
# removed meanwhile.
TRAINER = """
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import numpy as np
import keras_stable_state as kss
from kit import mlp

directory, ready, go = sys.argv[1:4]
in_flight = os.path.join(directory, ".kss-in-flight.h5")


class Pause(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == 3 and not os.path.exists(ready):
            with open(in_flight, "wb") as f:
                f.write(b"partial")
            open(ready, "w").close()
            deadline = time.monotonic() + 240
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not os.path.exists(in_flight):
                sys.exit("the temporary file of the save in progress was removed")
            os.remove(in_flight)


x = np.ones((48, 4), "float32")
ckpt = kss.StableCheckpoint(directory, save_freq=1, max_to_keep=100)
mlp(seed=0).fit(x, x[:, :1], epochs=2, batch_size=8, verbose=0, callbacks=[ckpt, Pause()])
"""


@pytest.mark.slow
@pytest.mark.pairwise("first", "second")
@pytest.mark.parametrize(("first", "second"), KINDS)
def test_a_fit_of_the_other_kind_is_refused_and_the_first_trains_on(tmp_path, monkeypatch, first, second):
    d, ready, go = tmp_path / "ckpts", tmp_path / "ready", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]), KSS_DIRECTORY_LOCK=first)
    env["KERAS_BACKEND"] = keras.backend.backend()
    child = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(d), str(ready), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), child.communicate(timeout=60)[0].decode()[-3000:]
        monkeypatch.setenv("KSS_DIRECTORY_LOCK", second)
        x = np.ones((48, 4), "float32")
        with pytest.raises(
            kss.CheckpointInUseError, match=re.escape(f"StableCheckpoint writer (pid {child.pid} on host ")
        ):
            mlp(seed=1).fit(
                x, x[:, :1], epochs=2, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(d)]
            )
        assert (d / ".kss-in-flight.h5").exists()  # refused before its clean-up of temporary files
    finally:
        go.touch()
        out = child.communicate(timeout=300)[0].decode()
    assert child.returncode == 0, out[-3000:]
    steps = [f"ckpt-{n:010d}.h5" for n in range(1, 13)]
    assert _names(d) == steps  # every checkpoint of the first writer; its lock files removed
    resumed = kss.StableCheckpoint(d)
    model = mlp(seed=1)
    model.fit(x, x[:, :1], epochs=2, batch_size=8, verbose=0, callbacks=[resumed])  # the second kind now
    assert resumed.restore_report is not None and int(model.optimizer.iterations) == 12


@pytest.mark.backend_free
def test_release_then_acquire_again(tmp_path, directory_lock):
    for writer in ("CheckpointManager", "StableCheckpoint", "CheckpointManager"):
        held, token = _acquire(tmp_path, writer=writer, reclaimable=False)
        assert _record(tmp_path)["writer"] == writer
        held.release(token)
        assert held.fd is None and held.marker is None
        assert _names(tmp_path) == []
        held.release(token)  # a second release does nothing


@pytest.mark.backend_free
def test_an_owner_collected_while_the_guard_is_taken_never_hangs(tmp_path, directory_lock):
    """The finalizer of a collected owner (``release_token``) may run inside a garbage
    collection in a section of this thread that holds the guard (a ``fit`` taking the lock
    while the checkpoint of an earlier ``fit`` is collected: it hung there on Torch). It
    waits for nothing; the next acquire releases the collected owner's lock."""
    held, token = _acquire(tmp_path, reclaimable=False)
    done = threading.Event()
    with lock._HELD_GUARD:  # as the collection inside DirectoryLock.acquire holds it
        worker = threading.Thread(target=lambda: (lock.release_token(token), done.set()))
        worker.start()
        assert done.wait(10), "release_token waited for the guard"
    worker.join()
    assert held.fd is not None  # not released yet: the guard was taken
    other, other_token = _acquire(tmp_path, reclaimable=False)  # not refused: released first
    assert held.fd is None and other is not held
    other.release(other_token)
    assert _names(tmp_path) == []


def test_a_second_writer_of_this_process_is_refused(tmp_path, directory_lock):
    held, token = _acquire(tmp_path, writer="CheckpointManager", reclaimable=False)
    try:
        with pytest.raises(kss.CheckpointInUseError, match=r"CheckpointManager writer \(pid .*this process"):
            _acquire(tmp_path)
        with pytest.raises(kss.CheckpointInUseError, match="in use by another CheckpointManager writer"):
            mlp().fit(
                np.ones((4, 4)),
                np.ones((4, 1)),
                epochs=1,
                verbose=0,
                callbacks=[kss.StableCheckpoint(tmp_path)],
            )
        held.release(token + 1_000_000)  # not its owner: nothing happens
        assert held.fd is not None
    finally:
        held.release(token)
    reclaimable, token = _acquire(tmp_path)  # a StableCheckpoint whose fit raised never released it
    again, token2 = _acquire(tmp_path)  # same thread: taken over
    assert again is reclaimable and again.token == token2
    again.release(token)  # the old owner's release no longer removes it
    assert again.fd is not None
    again.release(token2)
    assert _names(tmp_path) == []


# Takes the lock of argv[1], forks a child that tries to release it and exits normally (at-exit
# clean-up included), then prints what is left in the directory and whose record it is.
FORKER = """
import json, os, sys
from keras_stable_state._manager import lock
token = lock.new_token()
held = lock.acquire_lock(sys.argv[1], token)
pid = os.fork()
if pid == 0:
    lock.release_token(token)
    held.release(token)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
with open(os.path.join(sys.argv[1], lock.LOCK_NAME)) as f:
    record = json.load(f)
left = sorted(os.listdir(sys.argv[1]))
still = held.fd is not None
held.release(token)
print(json.dumps([os.waitstatus_to_exitcode(status), left, record["pid"] == os.getpid(), still]))
"""


@pytest.mark.backend_free
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX")
def test_a_forked_child_never_releases_the_parents_lock(tmp_path, directory_lock):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORKER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    code, left, ours, still = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0
    assert left == [LOCK, MARKER]  # the child removed nothing
    assert ours and still
    assert _names(tmp_path) == []  # the parent's release removed them


@pytest.mark.backend_free
@pytest.mark.skipif(os.name != "posix", reason="symbolic links, hard links and FIFOs are POSIX")
@pytest.mark.parametrize("name", [LOCK, MARKER])
@pytest.mark.parametrize("case", ["symlink", "hardlink", "fifo", "directory"])
def test_a_lock_file_or_marker_that_is_no_regular_file_is_refused(tmp_path, directory_lock, name, case):
    d = tmp_path / "ckpts"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = d / name
    {
        "symlink": lambda: planted.symlink_to(victim),
        "hardlink": lambda: os.link(victim, planted),
        "fifo": lambda: os.mkfifo(planted),
        "directory": lambda: planted.mkdir(),
    }[case]()
    with pytest.raises(kss.StateError, match=re.escape(repr(str(planted)))) as info:
        _acquire(str(d))
    assert f"Remove {str(planted)!r}" in str(info.value)
    assert victim.read_text() == "keep"
    # nothing else written; a refused marker leaves the (empty) lock file the next writer reuses
    assert _names(d) == ([LOCK] if name == LOCK else [LOCK, MARKER])
    assert os.path.realpath(d) not in lock._HELD


@pytest.mark.backend_free
def test_without_fcntl_the_portable_lock_is_chosen_and_flock_cannot_be_forced(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "fcntl", None)  # as on Windows (tests/hostile/test_hostile_files.py trains so)
    monkeypatch.delenv("KSS_DIRECTORY_LOCK", raising=False)
    assert lock.lock_kind() == "portable"
    held, token = _acquire(tmp_path)
    assert held.marker is not None and _names(tmp_path) == [LOCK, MARKER]
    held.release(token)
    monkeypatch.setenv("KSS_DIRECTORY_LOCK", "flock")
    with pytest.raises(
        kss.StateError, match=r"KSS_DIRECTORY_LOCK=flock asks for flock, but this platform has none"
    ):
        _acquire(tmp_path)
    assert _names(tmp_path) == []


@pytest.mark.backend_free
def test_an_unknown_implementation_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KSS_DIRECTORY_LOCK", "lockf")
    with pytest.raises(kss.StateError, match=r"KSS_DIRECTORY_LOCK='lockf' names no directory lock; expected"):
        _acquire(tmp_path)
    assert _names(tmp_path) == []
