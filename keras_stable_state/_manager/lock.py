"""The lock of a local checkpoint directory: the file `LOCK_NAME` that its one writer
(a `CheckpointManager` or `StableCheckpoint`)
holds, recording who holds it (writer kind, pid, host, since) as JSON, and the one holder per
directory in this process (`DirectoryLock`).

Two implementations, chosen in one place (`lock_kind`), once per acquire. Both take the marker
file ``<lock file>.owner``, created exclusively (`portable_lock`, through ``filelock``): a
marker of a process of this host that no longer runs is taken over; one of another host is
refused. They differ in how they use ``flock``:

* ``"flock"``, the default where the ``fcntl`` module exists (Linux, macOS: POSIX): an exclusive
  ``flock`` on the lock file, then the marker. The operating system releases the ``flock``
  when its process ends, and the marker it leaves is taken over by the next writer of its host.
* ``"portable"``, the default where ``fcntl`` does not exist (Windows): where ``fcntl`` exists,
  a non-blocking exclusive ``flock`` on the lock file, then the marker. A ``flock`` held by
  another process is a refusal; a ``flock`` that fails otherwise (a file system without it) is
  ignored, since that is what this lock is chosen for.

So writers of the two kinds on one directory exclude each other: a ``flock`` writer is refused by
a portable writer's marker (or its ``flock``), a portable writer by a ``flock`` writer's
``flock`` (or its marker, where the file system has no ``flock``). Both take the ``flock``
first, so of two writers starting at once one gets in (and never both are refused).

The environment variable ``KSS_DIRECTORY_LOCK`` (``flock`` or ``portable``) forces one: the
portable lock on a file system where ``flock`` fails (some network file systems), or in tests.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

from keras_stable_state._manager import portable_lock
from keras_stable_state._manager.protocols import WriterLock
from keras_stable_state.errors import CheckpointInUseError, StateError
from keras_stable_state.format.files import open_regular

try:
    import fcntl
except ImportError:  # Windows: no flock; the portable lock is used instead
    fcntl = None

LOCK_NAME = ".stable-checkpoint.lock"
"""Name of the lock file a writing [`StableCheckpoint`][keras_stable_state.StableCheckpoint] holds in its directory."""

LOCK_ENV = "KSS_DIRECTORY_LOCK"
"""The environment variable that forces a lock implementation: ``flock`` or ``portable``."""

KINDS = ("flock", "portable")


def lock_kind() -> str:
    """The lock implementation to use now: ``KSS_DIRECTORY_LOCK`` if set, else ``"flock"`` where
    ``fcntl`` exists and ``"portable"`` where it does not.

    Raises:
        StateError: if ``KSS_DIRECTORY_LOCK`` names no implementation, or ``flock`` where this
            platform has none.
    """
    forced = os.environ.get(LOCK_ENV, "")
    if forced not in ("", *KINDS):
        raise StateError(
            f"The environment variable {LOCK_ENV}={forced!r} names no directory lock; expected 'flock' or "
            f"'portable' (or unset: flock where it exists). Set it to one of those, or unset it.",
            key=LOCK_ENV,
        )
    if forced == "flock" and fcntl is None:
        raise StateError(
            f"The environment variable {LOCK_ENV}=flock asks for flock, but this platform has none (no "
            f"fcntl module). Unset {LOCK_ENV}, or set it to 'portable'.",
            key=LOCK_ENV,
        )
    return forced or ("flock" if fcntl is not None else "portable")


# -- the directory lock -------------------------------------------------------------------
_HELD = {}  # realpath of a directory -> DirectoryLock held by this process
_HELD_GUARD = threading.Lock()
# Tokens of owners collected (``weakref.finalize``: `release_token`) while _HELD_GUARD was
# taken, released by the next call that takes it: a collection can run inside a guarded
# section of this very thread, where waiting for the guard would hang for ever.
_PENDING: list[int] = []
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


def _read_record(fd):
    """The lock file's JSON (``None`` if it is being written right now, or not ours)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096).decode("utf-8"))
    except (OSError, ValueError):
        return None


def _write_record(fd, writer, *, flocked) -> None:
    """Replace the lock file's content with this writer's JSON record: kind, pid, host, since,
    and whether it holds the ``flock`` too (``"flock"``: what lets a writer of another host take
    its marker over once that ``flock`` is free, see `_take_marker`)."""
    info = {
        "writer": writer,
        "flock": bool(flocked),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    data = json.dumps(info).encode("utf-8")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    while data:
        data = data[os.write(fd, data) :]


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
        return open_regular(
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


def refuse_other_owner(held: WriterLock, token, directory) -> None:
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
    """The lock of ``<directory>/.stable-checkpoint.lock`` (its marker, with ``flock`` or the
    portable lock: see the module docstring), held by one writer (a `CheckpointManager`, or the one a
    `StableCheckpoint` runs over) of this process at a time.

    The lock file holds the writer's kind, pid, host and start as JSON so that a refused writer
    can name it. It is removed on release (while still locked; acquirers check that the file
    they locked is still the one at the path), and the marker with it. A lock of a dead
    process is released by the operating system (its ``flock``) and taken over by the next
    writer on its host (its marker). Within one process, a ``StableCheckpoint`` whose
    ``fit`` raised (Keras then skips ``on_train_end``) keeps the lock until it is garbage
    collected, the process exits, or another ``StableCheckpoint`` on the same directory begins
    training in the same thread and takes the lock over (a lock taken with
    ``reclaimable=True``); a ``CheckpointManager``'s lock is never taken over. A forked child
    never uses or removes its parent's lock. A `.protocols.WriterLock`, as the lock object
    of a store (`.remote_directory.RemoteLock`) is.

    Attributes:
        fd: The lock file's descriptor, ``None`` once released.
    """

    def __init__(self, key, directory, path, fd, marker):
        self.key = key
        self.directory = directory
        self.path = path
        self.fd = fd
        self.marker = marker  # the held filelock.SoftFileLock (both kinds); None once released
        self.pid = os.getpid()
        self.token = None
        self.thread = None
        self.reclaimable = False
        self.writer = "StableCheckpoint"

    @property
    def held(self) -> bool:
        """Whether the lock is held (its file open; ``False`` once released)."""
        return self.fd is not None

    @classmethod
    def acquire(cls, directory, token, *, writer="StableCheckpoint", reclaimable=True):
        """Return the held lock of ``directory`` with ``token`` as owner.

        ``writer`` (``"StableCheckpoint"`` or ``"CheckpointManager"``) is written into the
        lock file and named to a refused writer. Another owner of this process in the same
        thread takes a held lock over only if its holder took it ``reclaimable`` (a
        ``StableCheckpoint`` whose ``fit`` raised never released it). The implementation is
        `lock_kind`'s, read here.

        Raises:
            CheckpointInUseError: if another writer holds it.
            StateError: if the lock file (or its marker) is not a regular file of
                one name (see `_open_lock`), or ``KSS_DIRECTORY_LOCK`` is not valid here.
            OSError: if the lock file cannot be created or locked (read-only file system,
                permissions, a file system without ``flock``).
        """
        key = os.path.realpath(directory)
        with _HELD_GUARD:
            _release_pending()
            held = _HELD.get(key)
            if held is not None and not held._still_in_place():
                held._close()  # the directory or lock file was removed meanwhile: lock afresh
                held = None
            if held is not None:
                refuse_other_owner(held, token, directory)
            else:
                lock = _flock if lock_kind() == "flock" else _portable
                path, fd, marker, flocked = lock(directory, os.path.join(directory, LOCK_NAME))
                held = cls(key, directory, path, fd, marker)
                try:
                    _write_record(held.fd, writer, flocked=flocked)
                except BaseException:
                    held._close()
                    raise
                _HELD[key] = held
            held.token, held.thread = token, threading.get_ident()
            held.reclaimable, held.writer = reclaimable, writer
            _release_pending()  # tokens collected meanwhile (never this one: it is alive)
            return held

    def _still_in_place(self):
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.path))
        except (FileNotFoundError, NotADirectoryError):  # the directory was removed (or replaced by a file)
            return False

    def _close(self, *, unlink=False):
        """Release the lock: remove the lock file if ``unlink``, release the marker, close the
        lock file (releasing its ``flock``). The file is removed while both are still held, so no
        writer comes in between (acquirers check that the file they locked is still the one at
        the path); on Windows (no ``flock``) after closing it, since Windows removes no file that
        is open, and before releasing the marker."""
        fd, self.fd = self.fd, None
        marker, self.marker = self.marker, None
        if _HELD.get(self.key) is self:
            del _HELD[self.key]
        try:
            if os.name == "nt":
                os.close(fd)
                fd = None
            if unlink:
                try:
                    os.unlink(self.path)
                except PermissionError:
                    if os.name != "nt":
                        raise  # Windows: a refused writer has it open for a moment; the next holder reuses it
        finally:
            try:
                if marker is not None:
                    portable_lock.release(marker)
            finally:
                if fd is not None:
                    os.close(fd)

    def release(self, token):
        """Unlock and remove the lock file (and the marker) if ``token`` owns the lock (else do
        nothing). A forked child (another pid) never removes its parent's."""
        with _HELD_GUARD:
            self._release(token)
            _release_pending()

    def _release(self, token):
        """`release`, with ``_HELD_GUARD`` taken."""
        if self.fd is None or self.token != token:
            return
        self._close(unlink=self.pid == os.getpid() and self._still_in_place())


def _refused(directory, path, fd, how, *, pid=None, reason=""):
    """The `CheckpointInUseError` of a lock another writer holds, naming it from the lock
    file's JSON (``fd``); ``pid``: the holder's pid as the marker records it,
    which wins over a JSON record of another pid (a record a dead holder left)."""
    info = _read_record(fd)
    holder, kind = holder_text(info), writer_of(info)
    if pid is not None and (not isinstance(info, dict) or info.get("pid") != pid):
        holder = f"pid {pid}, which has not written its lock record yet"
    return CheckpointInUseError(
        f"Checkpoint directory {directory!r} is in use by another {kind} writer "
        f"({holder or 'holder unknown: the lock file names none'}); wait for it to finish or "
        f"use another directory. {reason}({how})",
        path=directory,
        holder=holder,
    )


def _flock(directory, path):
    """Lock the lock file ``path`` with an exclusive ``flock``, then take its marker (as the
    portable lock does, so that each excludes the other): ``(path, fd, marker, flocked)``."""
    return _lock(directory, path, portable=False)


def _portable(directory, path):
    """Lock the lock file ``path`` with the portable lock (`portable_lock`'s marker), taking a
    non-blocking ``flock`` first where there is ``fcntl`` and the file system has it:
    ``(path, fd, marker, flocked)``."""
    return _lock(directory, path, portable=True)


def _lock(directory, path, *, portable):
    """Both kinds, in one order (so that two writers starting at once never refuse each other):
    the ``flock`` (for the portable lock only if the file system has one), then the marker."""
    for _ in range(20):
        fd = _open_lock(directory, path)  # first: a linked or unwritable lock file is refused
        try:
            flocked = _try_flock(directory, path, fd, portable=portable)
        except BaseException:
            os.close(fd)
            raise
        if flocked and not _same_file(fd, path):
            os.close(fd)  # the holder removed the file after we opened it: lock the new one
            continue
        try:
            marker = _take_marker(directory, path, fd, flocked=flocked)
        except BaseException:
            os.close(fd)  # releases the flock
            raise
        try:
            if not _same_file(fd, path):  # without flock: the holder removed it; nobody does now
                os.close(fd)
                fd = None
                fd = _open_lock(directory, path)
        except BaseException:
            try:
                if fd is not None:
                    os.close(fd)
            finally:
                portable_lock.release(marker)
            raise
        return path, fd, marker, flocked
    raise CheckpointInUseError(
        f"Checkpoint directory {directory!r}: its lock file {path!r} keeps being replaced; another "
        "process is creating and removing it. Use another directory.",
        path=directory,
    )


def _try_flock(directory, path, fd, *, portable) -> bool:
    """Take an exclusive non-blocking ``flock`` on ``fd``; whether it was taken (the portable
    lock: ``False`` without ``fcntl`` or where the file system has no ``flock``).

    Raises:
        CheckpointInUseError: naming the holder if another process holds it.
        OSError: for the ``flock`` lock, if ``flock`` fails otherwise, saying to use the portable lock.
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        how = (
            f"The lock is {path!r}, held with flock; the operating system releases it when that process ends."
        )
        raise _refused(directory, path, fd, how) from None
    except OSError as err:
        if portable:
            return False  # no flock on this file system: why the portable lock was chosen
        raise OSError(
            err.errno,
            f"Cannot lock the checkpoint directory {directory!r}: flock on {path!r} failed "
            f"({err.strerror}); expected a file system with flock. Use a directory on a local file "
            f"system, or set {LOCK_ENV}=portable for the portable lock (a marker file, for file systems "
            "without flock, such as some network file systems).",
            path,
        ) from err
    return True


def _take_marker(directory, path, fd, *, flocked):
    """Take the marker of the lock file ``path`` (`portable_lock.take`), refusing a live holder
    with the `CheckpointInUseError` that names it (``fd``: the lock file, for its record).

    A marker of another host cannot be proven dead from here, except when its writer held the
    ``flock`` too (its record says so) and this writer now holds that ``flock`` (``flocked``):
    the ``flock`` is free, so that writer has ended (a job killed on one node and requeued on
    another, over a shared file system whose ``flock`` spans hosts, as NFS's does); its marker
    is taken over. A marker of a portable writer of another host is still refused."""
    try:
        return portable_lock.take(directory, path)
    except portable_lock.Busy as busy:
        info = _read_record(fd) if flocked and busy.other_host else None
        if (
            isinstance(info, dict)
            and info.get("flock") is True
            and info.get("host") not in (None, socket.gethostname())
            and (busy.pid is None or info.get("pid") == busy.pid)
        ):
            return portable_lock.take_over(directory, path)
        mark = portable_lock.marker_path(path)
        how = (
            f"The lock is the marker {mark!r}, which every writer holds (with flock or the portable lock); "
            "the next writer of this host takes it over once that process has ended. A marker of another "
            f"host is never taken over: once that process is known to have ended, remove {mark!r}."
        )
        reason = busy.reason + " " if busy.reason else ""
        raise _refused(directory, path, fd, how, pid=busy.pid, reason=reason) from None


def _same_file(fd, path) -> bool:
    """Whether the open ``fd`` is still the file at ``path``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def release_token(token):
    """Release the lock the owner of ``token`` holds, if any: called by the finalizer of a
    collected owner, so it never waits for ``_HELD_GUARD`` (a garbage collection may run
    inside a section of this thread that holds it): if the guard is taken, the token is
    released by the next `DirectoryLock.acquire` or `DirectoryLock.release`."""
    _PENDING.append(token)
    if _HELD_GUARD.acquire(blocking=False):
        try:
            _release_pending()
        finally:
            _HELD_GUARD.release()


def _release_pending():
    """Release the locks of the tokens in `_PENDING` (``_HELD_GUARD`` taken)."""
    while _PENDING:
        token = _PENDING.pop()
        for held in list(_HELD.values()):
            held._release(token)


def _forget_locks_in_child():
    # A forked child shares the parent's lock; it must neither use nor remove it.
    global _HELD_GUARD
    _HELD_GUARD = threading.Lock()
    _PENDING.clear()  # the parent's owners: never released from the child
    for held in list(_HELD.values()):
        if held.fd is not None:
            try:
                os.close(held.fd)
            except OSError:
                pass
            held.fd = None
        held.marker = None  # the parent's marker: filelock never removes it from a forked child
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def acquire_lock(directory, token, *, writer="StableCheckpoint", reclaimable=True):
    """`DirectoryLock.acquire` (the lock of a local directory)."""
    return DirectoryLock.acquire(directory, token, writer=writer, reclaimable=reclaimable)
