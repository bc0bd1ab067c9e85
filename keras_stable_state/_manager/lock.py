"""The lock of a local checkpoint directory: the file `LOCK_NAME` that its one writer
(a [`CheckpointManager`][keras_stable_state.CheckpointManager] or [`StableCheckpoint`][keras_stable_state.StableCheckpoint])
holds with ``flock``, recording who holds it (pid, host, thread), and the one holder per
directory in this process (`DirectoryLock`)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

from keras_stable_state import format as storage
from keras_stable_state.errors import CheckpointInUseError, StateError

try:
    import fcntl
except ImportError:  # Windows: no flock; StableCheckpoint refuses to run unlocked (see the docs)
    fcntl = None

LOCK_NAME = ".stable-checkpoint.lock"
"""Name of the lock file a writing [`StableCheckpoint`][keras_stable_state.StableCheckpoint] holds in its directory."""

LOCKING = fcntl is not None
"""Whether directories can be locked (``flock`` exists: not on Windows, where
`DirectoryLock.acquire` refuses)."""


# -- the directory lock -------------------------------------------------------------------
_HELD = {}  # realpath of a directory -> DirectoryLock held by this process
_HELD_GUARD = threading.Lock()
_TOKENS = itertools.count(1)


def new_token() -> int:
    """A token no other lock owner of this process holds (an owner's identity for the lock)."""
    return next(_TOKENS)


def writer_of(info) -> str:
    """The writer kind a lock's JSON names (``"StableCheckpoint"`` when unknown)."""
    kind = info.get("writer") if isinstance(info, dict) else None
    return kind if kind in ("StableCheckpoint", "CheckpointManager") else "StableCheckpoint"


def holder_text(info):
    """``"pid <n> on host <h>, since <t>"`` from a lock's JSON, or ``None``."""
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return None
    text = f"pid {info['pid']} on host {info.get('host', '?')}"
    if info.get("since"):
        text += f", since {info['since']}"
    return text


def _read_holder(fd):
    """``(holder text or None, writer kind)`` from the lock file's JSON."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError):  # being written right now, or not ours: holder unknown
        return None, "StableCheckpoint"
    return holder_text(info), writer_of(info)


def _open_lock(directory, path) -> int:
    """Open (or create) the lock file ``path``: never through a symbolic link, never a file
    with another name too (a hard link), never anything but a regular file.

    Raises:
        StateError: naming ``path`` if it is a symbolic link, a hard link, a FIFO, a
            device, a directory...: the lock file is written, so writing it would change
            the file it points to.
        OSError: naming ``path`` if it cannot be created or opened (read-only file
            system, permissions), with its ``errno``.
    """
    try:
        return storage.open_regular(
            path,
            os.O_RDWR | os.O_CREAT,
            mode=0o644,
            follow_symlinks=False,
            single_link=True,
            what=f"the lock file of the checkpoint directory {directory!r}",
            advice=(
                "StableCheckpoint writes its pid and host into its lock file, and never through a link: "
                f"that would overwrite the file it points to. Remove {path!r} and fit again (nothing "
                "but StableCheckpoint should write into its directory)."
            ),
            error=StateError,
        )
    except OSError as err:
        raise OSError(
            err.errno,
            f"Cannot create the lock file {path!r} of the checkpoint directory {directory!r} "
            f"({err.strerror}). StableCheckpoint writes its lock and its checkpoints there: give it a "
            "folder it can write. (To restore the newest checkpoint without training, call "
            "keras_stable_state.restore_training_state(StableCheckpoint(directory).checkpoints()[0], model).)",
            path,
        ) from err


def refuse_other_owner(held, token, directory) -> None:
    """Refuse ``token`` the lock ``held`` by another owner of this process, unless that
    owner took it ``reclaimable`` in this thread (or a thread that ended): the rule of
    `DirectoryLock.acquire`, for local and object-store directories alike.

    Raises:
        CheckpointInUseError: naming this process, the holder's thread and ``directory``.
    """
    alive = {t.ident for t in threading.enumerate()}
    other_thread = held.thread != threading.get_ident() and held.thread in alive
    if held.token != token and (other_thread or not held.reclaimable):
        names = {t.ident: t.name for t in threading.enumerate()}
        where = "another thread still training" if other_thread else "this thread"
        thread = names.get(held.thread, "ended")
        holder = f"pid {os.getpid()} on host {socket.gethostname()}, thread {thread!r}"
        raise CheckpointInUseError(
            f"Checkpoint directory {directory!r} is in use by another {held.writer} writer "
            f"({holder}: this process, {where}); wait for it to finish (close() a "
            "CheckpointManager, or leave its `with` block) or use another directory.",
            path=directory,
            holder=holder,
        )


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/.stable-checkpoint.lock``, held by one
    writer (a [`CheckpointManager`][keras_stable_state.CheckpointManager], or the one a [`StableCheckpoint`][keras_stable_state.StableCheckpoint] runs
    over) of this process at a time.

    The lock file holds the writer's kind, pid and host as JSON so that a refused writer
    can name it. It is removed on release (while still locked; acquirers check that
    the file they locked is still the one at the path). A lock of a dead process is
    released by the operating system. Within one process, a ``StableCheckpoint``
    whose ``fit`` raised (Keras then skips ``on_train_end``) keeps the lock until it
    is garbage collected, the process exits, or another ``StableCheckpoint`` on the
    same directory begins training in the same thread and takes the lock over (a lock
    taken with ``reclaimable=True``); a ``CheckpointManager``'s lock is never taken over.
    """

    def __init__(self, key, directory, path, fd):
        self.key = key
        self.directory = directory
        self.path = path
        self.fd = fd
        self.pid = os.getpid()
        self.token = None
        self.thread = None
        self.reclaimable = False
        self.writer = "StableCheckpoint"

    @classmethod
    def acquire(cls, directory, token, *, writer="StableCheckpoint", reclaimable=True):
        """Return the held lock of ``directory`` with ``token`` as owner.

        ``writer`` (``"StableCheckpoint"`` or ``"CheckpointManager"``) is written into the
        lock file and named to a refused writer. Another owner of this process in the same
        thread takes a held lock over only if its holder took it ``reclaimable`` (a
        ``StableCheckpoint`` whose ``fit`` raised never released it).

        Raises:
            CheckpointInUseError: if another writer holds it.
            StateError: if the lock file is not a regular file of one name (see
                `_open_lock`), or this platform has no ``flock`` (Windows): the
                directory cannot be locked, and StableCheckpoint does not run unlocked.
            OSError: if the lock file cannot be created (read-only file system, permissions).
        """
        if not LOCKING:
            raise StateError(
                f"{writer} cannot lock its directory {directory!r}: this platform has no "
                "flock (the fcntl module; Windows has none), and without the lock a second writer "
                f"could not be refused. {writer} runs on Linux and macOS; elsewhere, save and "
                "restore in your own loop with keras_stable_state.save_training_state and "
                "restore_training_state.",
                key=LOCK_NAME,
            )
        key = os.path.realpath(directory)
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is not None and not held._still_in_place():
                held._close()  # the directory or lock file was removed meanwhile: lock afresh
                held = None
            if held is not None:
                refuse_other_owner(held, token, directory)
            else:
                held = cls(key, directory, *cls._lock(directory, writer))
                _HELD[key] = held
            held.token, held.thread = token, threading.get_ident()
            held.reclaimable, held.writer = reclaimable, writer
            return held

    @staticmethod
    def _lock(directory, writer):
        path = os.path.join(directory, LOCK_NAME)
        for _ in range(20):
            fd = _open_lock(directory, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder, kind = _read_holder(fd)
                os.close(fd)
                raise CheckpointInUseError(
                    f"Checkpoint directory {directory!r} is in use by another {kind} writer "
                    f"({holder or 'holder unknown: the lock file names none'}); wait for it to finish or "
                    f"use another directory. (The lock is {path!r}, held with flock; the operating "
                    "system releases it when that process ends.)",
                    path=directory,
                    holder=holder,
                ) from None
            except OSError as err:
                os.close(fd)
                raise OSError(
                    err.errno,
                    f"Cannot lock the checkpoint directory {directory!r}: flock on {path!r} failed "
                    f"({err.strerror}). Use a directory on a local file system.",
                    path,
                ) from err
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file after we opened it: lock the new one
        else:
            raise CheckpointInUseError(
                f"Checkpoint directory {directory!r}: its lock file {path!r} keeps being replaced; another "
                "process is creating and removing it. Use another directory.",
                path=directory,
            )
        info = {
            "writer": writer,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        return path, fd

    def _still_in_place(self):
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.path))
        except (FileNotFoundError, NotADirectoryError):  # the directory was removed (or replaced by a file)
            return False

    def _close(self):
        fd, self.fd = self.fd, None
        if _HELD.get(self.key) is self:
            del _HELD[self.key]
        os.close(fd)

    def release(self, token):
        """Unlock and remove the lock file if ``token`` owns the lock (else do nothing)."""
        with _HELD_GUARD:
            if self.fd is None or self.token != token:
                return
            try:
                if self.pid == os.getpid() and self._still_in_place():
                    os.unlink(self.path)
            finally:
                self._close()


def release_token(token):
    for held in list(_HELD.values()):
        held.release(token)


def _forget_locks_in_child():
    # A forked child shares the parent's lock; it must neither use nor remove it.
    global _HELD_GUARD
    _HELD_GUARD = threading.Lock()
    for held in list(_HELD.values()):
        if held.fd is not None:
            try:
                os.close(held.fd)
            except OSError:
                pass
            held.fd = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def acquire_lock(directory, token, *, writer="StableCheckpoint", reclaimable=True):
    """`DirectoryLock.acquire` (the lock of a local directory)."""
    return DirectoryLock.acquire(directory, token, writer=writer, reclaimable=reclaimable)
