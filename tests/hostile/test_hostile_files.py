"""Hostile files in every place a path is taken (issue 16, items 1, 2 and 9): FIFOs, devices,
symbolic and hard links as the file given to a restore or the command line, as checkpoints
of a ``StableCheckpoint`` directory, as its lock file and ``unreadable/`` folder, as
temporary files and as ``.keras`` archive members; the arguments and platforms
``StableCheckpoint`` refuses. Whatever could hang (a FIFO) or read without end
(``/dev/zero``) runs in a child process with a timeout. See ``docs/concepts/security.md``.
"""

import errno
import json
import os
import stat
import subprocess
import sys
import threading
import zipfile

import keras
import numpy as np
import pytest
from kit import ROOT, TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state._manager import lock
from keras_stable_state.format.atomic import atomic_path
from keras_stable_state.format.files import open_regular

posix_only = pytest.mark.skipif(os.name != "posix", reason="FIFOs, devices and symbolic links are POSIX")


def _child(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# -- one child process tries every case that needs a model (cases below read its findings) --
@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile")
    done = _child([os.path.join(TESTS, "scripts", "hostile_files.py"), str(work)])
    return json.loads(done.stdout.strip().splitlines()[-1])


@posix_only
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fifo.h5", "zero.h5", "urandom.keras"])
def test_restore_refuses_a_fifo_or_a_device_and_changes_nothing(hostile, name):
    case = hostile[f"restore {name}"]
    assert case["error"]["type"] == "CheckpointFormatError"
    assert name in case["error"]["message"]
    kind = "FIFO (named pipe)" if name.startswith("fifo") else "character device"
    assert f"is a {kind}" in case["error"]["message"]
    assert case["unchanged"] is True


@posix_only
@pytest.mark.slow
def test_a_symbolic_link_to_a_regular_checkpoint_restores_exactly(hostile):
    assert hostile["restore through a symbolic link"] is True


@posix_only
@pytest.mark.slow
def test_stable_checkpoint_moves_non_regular_checkpoints_aside_and_resumes_the_real_one(hostile):
    found = hostile["directory"]
    names = ["ckpt-0000000006.h5", "ckpt-0000000007.h5", "ckpt-0000000008.h5", "ckpt-0000000009.h5"]
    assert found["moved"] == names
    assert found["unreadable/"] == names  # moved as links / FIFOs: renamed, never opened
    assert any("FIFO" in r for r in found["reasons"]) and any("/dev/zero" in r for r in found["reasons"])
    assert any("/dev/urandom" in r for r in found["reasons"]) and any(
        "nothing" in r for r in found["reasons"]
    )
    assert "UnreadableCheckpointWarning" in found["warnings"]
    assert found["resumed exactly"] is True  # the checkpoint behind the symbolic link ckpt-2
    # max_to_keep=1 pruned the link ckpt-2, not the file it points to; the planted .kss- link is left
    assert found["left"] == [".kss-planted.h5", "ckpt-0000000004.h5", "unreadable"]
    assert found["outside kept"] is True and found["temp victim intact"] is True


@posix_only
@pytest.mark.slow
@pytest.mark.parametrize("case", ["symlink", "hardlink", "fifo", "directory"])
def test_the_lock_file_is_never_written_through(hostile, case):
    found = hostile[f"lock {case}"]
    assert found["error"]["type"] == "StateError"
    assert ".stable-checkpoint.lock" in found["error"]["message"]
    words = {"symlink": "symbolic link", "hardlink": "2 names", "fifo": "FIFO", "directory": "a directory"}
    assert words[case] in found["error"]["message"]
    assert found["victim intact"] is True
    assert found["files"] == [".stable-checkpoint.lock"]  # nothing was saved


@posix_only
@pytest.mark.slow
def test_unreadable_is_never_a_symbolic_link(hostile):
    found = hostile["unreadable symlink"]
    assert found["error"]["type"] == "StateError"
    assert "unreadable" in found["error"]["message"] and "symbolic link" in found["error"]["message"]
    assert found["elsewhere"] == []


# -- the format layer and the command line (no Keras: quick, in a child for the hangs) ------
_FORMAT_CASES = r"""
import json, os, sys
from keras_stable_state import format
root = sys.argv[1]
out = {}
for name in sorted(os.listdir(root)):
    path = os.path.join(root, name)
    for verb, call in (("read_file", format.read_file), ("open_file", format.open_file)):
        try:
            call(path)
            out[f"{verb} {name}"] = None
        except Exception as err:
            out[f"{verb} {name}"] = [type(err).__name__, str(err)]
print(json.dumps(out))
"""


@posix_only
def test_the_reader_and_the_command_line_refuse_non_regular_files_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo.h5")
    os.symlink("/dev/zero", tmp_path / "zero.keras")
    os.symlink("/dev/urandom", tmp_path / "urandom.h5")
    os.symlink(tmp_path / "fifo.h5", tmp_path / "to-fifo.h5")
    found = json.loads(_child(["-c", _FORMAT_CASES, str(tmp_path)], timeout=60).stdout)
    for name, kind in [
        ("fifo.h5", "a FIFO (named pipe)"),
        ("to-fifo.h5", "a FIFO (named pipe) (through a symbolic link"),
        ("zero.keras", "a character device (through a symbolic link to '/dev/zero')"),
        ("urandom.h5", "a character device (through a symbolic link to '/dev/urandom')"),
    ]:
        for verb in ("read_file", "open_file"):
            err_type, message = found[f"{verb} {name}"]
            assert err_type == "CheckpointFormatError"
            assert message.startswith(f"{str(tmp_path / name)!r} is {kind}")
    for command in ("verify", "inspect"):
        done = subprocess.run(
            [sys.executable, "-m", "keras_stable_state", command, str(tmp_path / "fifo.h5")],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=ROOT),
            check=False,
        )
        assert done.returncode != 0 and "FIFO (named pipe)" in done.stdout + done.stderr


def test_open_regular_refuses_a_symbolic_link_where_the_file_is_written(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"x" * 2000)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(kss.CheckpointFormatError, match=r"'.*link' is a symbolic link to '.*target'"):
        open_regular(str(tmp_path / "link"), os.O_RDWR | os.O_CREAT, follow_symlinks=False)
    fd = open_regular(str(tmp_path / "link"))  # read: followed to the regular file
    try:
        assert os.read(fd, 10) == b"x" * 10
    finally:
        os.close(fd)
    assert target.read_bytes() == b"x" * 2000


def test_a_dangling_symbolic_link_is_a_file_not_found_naming_its_target(tmp_path):
    os.symlink(tmp_path / "gone.h5", tmp_path / "latest.h5")
    with pytest.raises(FileNotFoundError, match=r"latest\.h5' \(a symbolic link to '.*gone\.h5'\)") as info:
        format.read_file(tmp_path / "latest.h5")
    assert info.value.errno == errno.ENOENT


def _keras_file_with_member_mode(tmp_path, mode):
    model = mlp(named=True)
    path = str(tmp_path / "m.keras")
    kss.save_training_state(path, model)
    crafted = str(tmp_path / "crafted.keras")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename == "config.json":
                info.external_attr = (mode | 0o777) << 16
            dst.writestr(info, data)
    return crafted


@pytest.mark.parametrize("mode, kind", [(stat.S_IFLNK, "a symbolic link"), (stat.S_IFIFO, "a FIFO")])
def test_an_archive_member_that_is_a_link_or_a_fifo_is_refused(tmp_path, mode, kind):
    crafted = _keras_file_with_member_mode(tmp_path, mode)
    with pytest.raises(kss.CorruptCheckpointError, match=rf"archive member 'config.json' is {kind}") as info:
        format.open_file(crafted)
    assert info.value.key == "config.json"


# -- temporary files and the umask --------------------------------------------------------
def test_an_atomic_write_keeps_the_umask_and_gives_the_file_its_mode(tmp_path, monkeypatch):
    mask = os.umask(0o027)
    os.umask(mask)
    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or real(m))
    model = mlp()
    kss.save_training_state(tmp_path / "run.h5", model)
    kss.save_training_state(tmp_path / "run.keras", model)
    assert calls == []  # the process-wide umask is never changed (other threads share it)
    for name in ("run.h5", "run.keras"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~mask
    assert sorted(os.listdir(tmp_path)) == ["run.h5", "run.keras"]  # no temporary file left


@posix_only
def test_a_temporary_file_replaced_by_a_link_while_written_is_never_renamed_into_place(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "out.h5"
    with pytest.raises(kss.StateError, match=r"was removed or replaced while it was written"):
        with atomic_path(target, suffix=".h5") as tmp:
            os.remove(tmp)
            os.symlink(victim, tmp)
    assert not os.path.lexists(target)
    assert victim.read_text() == "precious"


def test_temporary_files_are_created_exclusively_with_the_umask(tmp_path):
    from keras_stable_state.format.atomic import create_temporary

    mask = os.umask(0o022)
    os.umask(mask)
    fd, path = create_temporary(str(tmp_path), ".h5")
    os.close(fd)
    assert os.path.basename(path).startswith(".kss-") and path.endswith(".h5")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~mask


# -- StableCheckpoint's arguments and platform --------------------------------------------
@pytest.mark.parametrize("kwargs", [{"max_to_keep": True}, {"save_freq": True}, {"max_to_keep": False}])
def test_a_bool_is_not_a_count(tmp_path, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(
        ValueError, match=rf"`{name}` must be .*not a bool.*Received: {name}=\w+ \(of type bool\)"
    ):
        kss.StableCheckpoint(tmp_path, **kwargs)


def test_a_bytes_directory_is_a_path_like_os_path_takes_it(tmp_path):
    x = np.ones((8, 4), "float32")
    y = np.ones((8, 1), "float32")
    model = mlp()
    cb = kss.StableCheckpoint(os.fsencode(tmp_path / "ckpts"))
    assert cb.directory == str(tmp_path / "ckpts") and cb.get_config()["directory"] == cb.directory
    model.fit(x, y, epochs=1, batch_size=4, verbose=0, callbacks=[cb])
    assert os.listdir(tmp_path / "ckpts") == ["ckpt-0000000002.h5"]
    restored = mlp()
    kss.restore_training_state(os.fsencode(tmp_path / "ckpts" / "ckpt-0000000002.h5"), restored)
    for a, b in zip(model.weights, restored.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("value", [3, None, 1.5])
def test_a_directory_that_is_not_a_path_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"`directory` must be a path: a str, bytes or os.PathLike"):
        kss.StableCheckpoint(value)


def test_without_fcntl_stable_checkpoint_locks_its_directory_with_the_portable_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "fcntl", None)  # as on Windows
    monkeypatch.delenv("KSS_DIRECTORY_LOCK", raising=False)
    held = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            held.append(sorted(os.listdir(tmp_path)))
            refused = []

            def second_writer():  # another thread: refused (another process: tests/manager/test_directory_lock.py)
                try:
                    kss.CheckpointManager(tmp_path).lock()
                except kss.CheckpointInUseError as err:
                    refused.append(str(err))

            thread = threading.Thread(target=second_writer)
            thread.start()
            thread.join(60)
            assert len(refused) == 1 and "another thread still training" in refused[0]

    model = mlp()
    model.fit(
        np.ones((4, 4)),
        np.ones((4, 1)),
        epochs=1,
        batch_size=4,
        verbose=0,
        callbacks=[kss.StableCheckpoint(tmp_path), Look()],
    )
    assert held == [[".stable-checkpoint.lock", ".stable-checkpoint.lock.owner"]]
    assert os.listdir(tmp_path) == ["ckpt-0000000001.h5"]  # released: the lock file and marker removed


def _read_only(monkeypatch):
    """The lock file cannot be created as on a read-only mount (EROFS): tests run unprivileged."""

    def refuse(directory, path):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(lock, "_open_lock", refuse)


def test_a_read_only_directory_resumes_a_finished_fit_and_refuses_one_with_epochs_left(
    tmp_path, monkeypatch, directory_lock
):
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = mlp(seed=0)
    model.fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path)])
    saved = [np.asarray(v).copy() for v in model.weights]
    _read_only(monkeypatch)
    resumed = mlp(seed=1)
    cb = kss.StableCheckpoint(tmp_path)
    resumed.fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[cb])  # nothing left to train
    assert cb.restore_report is not None
    for a, b in zip(resumed.weights, saved, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    more = mlp(seed=1)
    with pytest.raises(OSError, match=r"read-only file system: this fit has epochs left to train") as info:
        more.fit(x, y, epochs=3, batch_size=4, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path)])
    assert info.value.errno == errno.EROFS and info.value.filename == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000000002.h5", "ckpt-0000000004.h5"]  # nothing written


def test_a_lock_file_that_cannot_be_created_names_it_and_the_errno(tmp_path, monkeypatch, directory_lock):
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr("keras_stable_state._manager.lock.open_regular", refuse)
    with pytest.raises(
        OSError, match=r"Cannot create the lock file .*stable-checkpoint.lock.*Permission denied"
    ) as info:
        mlp().fit(
            np.ones((4, 4)), np.ones((4, 1)), epochs=1, verbose=0, callbacks=[kss.StableCheckpoint(tmp_path)]
        )
    assert info.value.errno == errno.EACCES
