"""The checkpoint directory of a :class:`~keras_stable_state.CheckpointManager` (and so of
a :class:`~keras_stable_state.StableCheckpoint`): its ``ckpt-<step>.h5`` files (listed
newest first, pruned), the lock file :data:`LOCK_NAME` that its one writer holds, the
stale ``.kss-*`` temporary files of a killed save, the unreadable checkpoints moved aside
into :data:`UNREADABLE_DIR` (with the :class:`~keras_stable_state.UnreadableCheckpointWarning`
naming them) and the fallback over them (:func:`restore_newest`).

Every access to the directory (list, exists, stat, remove, rename, open) goes through a
function of this module; :class:`~keras_stable_state._manager.remote_directory.RemoteDirectory`
has the same functions as methods for a directory in an object store (the manager holds
one or the other as its ``files``). Here a file is visible once it is renamed into place,
so :func:`begin_save` and :func:`commit` do nothing."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import socket
import threading
import time
import warnings

from keras_stable_state import format as storage
from keras_stable_state._manager import orbax_steps
from keras_stable_state.errors import (
    CheckpointFormatError,
    CheckpointInUseError,
    CorruptCheckpointError,
    NewerFormatError,
    StateError,
    UnreadableCheckpointWarning,
)

try:
    import fcntl
except ImportError:  # Windows: no flock; StableCheckpoint refuses to run unlocked (see the docs)
    fcntl = None

_NAME = re.compile(r"^ckpt-(\d{10})\.h5$")
MAX_STEP = 10**10 - 1
"""The largest step a file name holds (``ckpt-<10 digits>.h5``)."""
LOCK_NAME = ".stable-checkpoint.lock"
"""Name of the lock file a writing :class:`StableCheckpoint` holds in its directory."""
TEMP_PREFIX = ".kss-"
"""Prefix of the temporary files of atomic writes (``storage.atomic_path``)."""
UNREADABLE_DIR = "unreadable"
"""Subfolder of the checkpoint directory that unreadable checkpoints are moved into."""
LOCKING = fcntl is not None
"""Whether directories can be locked (``flock`` exists: not on Windows, where
:meth:`DirectoryLock.acquire` refuses)."""


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
    :meth:`DirectoryLock.acquire`, for local and object-store directories alike.

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
    writer (a :class:`CheckpointManager`, or the one a :class:`StableCheckpoint` runs
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
                :func:`_open_lock`), or this platform has no ``flock`` (Windows): the
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
    """:meth:`DirectoryLock.acquire` (the lock of a local directory)."""
    return DirectoryLock.acquire(directory, token, writer=writer, reclaimable=reclaimable)


# -- the files ------------------------------------------------------------------------------
STORAGE_OPTIONS = None
"""The ``storage_options`` of a local directory's saves and restores: none."""


def begin_save(path) -> None:
    """Nothing: a local checkpoint replaces the one of its step by an atomic rename."""


def commit(path, step, info) -> None:
    """Nothing: a local checkpoint is visible once renamed into place, and complete then."""


def checkpoints(directory) -> list:
    """Paths of the checkpoints in ``directory``, newest first (files named
    ``ckpt-<10 digits>.h5``; in a directory named ``*.orbax``, step directories
    ``ckpt-<10 digits>.orbax``; ``[]`` if ``directory`` is not a folder)."""
    if orbax_steps.uses_orbax(directory):
        return orbax_steps.checkpoints(directory)
    if not os.path.isdir(directory):
        return []
    names = sorted((n for n in os.listdir(directory) if _NAME.match(n)), reverse=True)
    return [os.path.join(directory, n) for n in names]


def path_of(directory, step: int) -> str:
    """The path of the checkpoint of ``step`` in ``directory`` (``ckpt-<step:010d>.h5``, or
    ``ckpt-<step:010d>.orbax`` in a directory named ``*.orbax``)."""
    suffix = orbax_steps.SUFFIX if orbax_steps.uses_orbax(directory) else ".h5"
    return os.path.join(directory, f"ckpt-{step:010d}{suffix}")


def step_of(path) -> int | None:
    """The step a checkpoint path names, or ``None`` if its name is not ``ckpt-<10 digits>.h5``
    (or ``.orbax``)."""
    name = os.path.basename(path)
    found = _NAME.match(name) or orbax_steps.NAME.match(name)
    return None if found is None else int(found.group(1))


def exists(path) -> bool:
    """Whether something (a file, or a symbolic link even to nothing) is at ``path``."""
    return os.path.lexists(path)


def identity(path):
    """What tells one written file from another at ``path`` (device, inode, size, modification
    time), or ``None`` if nothing is there: a cache key for what was read from it."""
    if orbax_steps.is_step(path):
        return orbax_steps.identity(path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def size_of(path) -> int:
    """Size in bytes of the file at ``path`` (of a ``.orbax`` step: of its files; ``OSError``
    naming it if it is gone)."""
    if orbax_steps.is_step(path):
        return orbax_steps.size_of(path)
    return os.path.getsize(path)


def read_summary(path):
    """The small part of a checkpoint's records, read without its arrays: ``(metadata,
    extra, format version)`` (see :class:`~keras_stable_state.format.CheckpointFile`; its seal
    is checked, its arrays are neither read nor decoded).

    Raises:
        Every error of :func:`keras_stable_state.format.open_file`.
    """
    if orbax_steps.is_step(path):
        return orbax_steps.read_summary(path)
    with storage.open_file(path) as f:
        return dict(f.metadata), dict(f.extra), f.version


def prepare(directory, writer="StableCheckpoint") -> None:
    """Create ``directory`` (and its parents) if needed.

    Raises:
        NotADirectoryError: if ``directory`` is a file (or a symbolic link to nothing).
        OSError: naming ``directory`` if it cannot be created (read-only file system,
            permissions), with its ``errno``.
    """
    if os.path.islink(directory) and not os.path.exists(directory):
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{writer}'s directory {directory!r} is a symbolic link to {os.readlink(directory)!r}, "
            "which does not exist. Create that folder, or pass another one.",
            directory,
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{writer}'s directory {directory!r} is a file, not a folder. Pass a folder "
            "(it holds ckpt-<step>.h5 files); to save one file use keras_stable_state.save_training_state",
            directory,
        )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise OSError(
            err.errno,
            f"Cannot create {writer}'s directory {directory!r} ({err.strerror}). Give it a "
            "folder it can create and write.",
            directory,
        ) from err


def remove_temporary_files(directory) -> list:
    """Remove the ``.kss-*`` temporary files a killed save left in ``directory`` (and the
    partial step directories of a ``*.orbax`` one, see :mod:`.orbax_steps`); their paths."""
    removed = orbax_steps.remove_temporary(directory) if orbax_steps.uses_orbax(directory) else []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(entry.path)
    return removed


def remove(paths) -> None:
    """Remove the checkpoint files (or ``.orbax`` step directories) ``paths``; one removed
    meanwhile is skipped."""
    for old in paths:
        try:
            orbax_steps.remove(old) if orbax_steps.is_step(old) else os.remove(old)
        except FileNotFoundError:
            continue  # removed by someone else since it was listed


def move_aside(directory, path, writer="StableCheckpoint"):
    """Move an unreadable checkpoint into ``<directory>/unreadable/`` (``<name>.<n>`` if
    the name is taken); its new path, or ``None`` if it was removed meanwhile.

    What is at ``path`` is renamed, never opened: a symbolic link is moved as the link. The
    folder ``unreadable/`` must be a folder of its own, not a symbolic link (a checkpoint
    is never moved out of ``directory`` through one).

    Raises:
        StateError: if it cannot be moved (it would count in ``keep`` and be found again),
            or ``unreadable/`` is a symbolic link or not a folder.
    """
    folder = os.path.join(directory, UNREADABLE_DIR)
    name = os.path.basename(path)
    target = os.path.join(folder, name)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder)
        fd = _open_folder(folder)
        try:
            n = 1
            while _lexists(os.path.basename(target), fd):
                target = os.path.join(folder, f"{name}.{n}")
                n += 1
            os.rename(path, os.path.basename(target), dst_dir_fd=fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        if not os.path.lexists(path):
            return None  # removed meanwhile: nothing left to count in `keep`
        raise
    except (OSError, StateError) as err:
        raise StateError(
            f"Checkpoint {path!r} is unreadable and could not be moved aside to {target!r} ({err}). "
            f"Move or delete it yourself: {writer} does not restore it, and left in place it "
            "would count as one of the `max_to_keep` newest checkpoints.",
        ) from err
    return target


def _open_folder(folder) -> int:
    """A descriptor of the folder ``folder`` itself, never of one a symbolic link names."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(folder, flags)
    except OSError as err:
        if os.path.islink(folder) or not os.path.isdir(folder):
            found = "a symbolic link" if os.path.islink(folder) else "not a folder"
            raise StateError(
                f"{folder!r} is {found}; unreadable checkpoints are moved into a folder of the "
                "checkpoint directory itself, never through a link. Remove it.",
                key=UNREADABLE_DIR,
            ) from err
        raise


def _lexists(name, folder_fd) -> bool:
    try:
        os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def warn_unreadable(directory, skipped, moved, restored, where, writer="StableCheckpoint", stacklevel=2):
    """Issue the :class:`~keras_stable_state.UnreadableCheckpointWarning` naming each
    unreadable checkpoint moved aside (``skipped``: ``(path, reason)``, ``moved``:
    ``(path, new path or None)``) and the one ``restored`` (``where`` describes its
    position, e.g. ``"step 40"``), or ``None``: training starts fresh. Attributed to the
    caller's ``stacklevel``-th frame (``2``: the caller of this function)."""
    reasons = dict(skipped)
    listed = "; ".join(
        f"{path!r} -> {target!r} ({reasons[path]})"
        if target is not None
        else f"{path!r} (removed meanwhile; {reasons[path]})"
        for path, target in moved
    )
    count = len(moved)
    head = f"{writer}: {count} unreadable checkpoint{'s' if count > 1 else ''} in {directory!r}"
    if restored is None:
        tail = (
            "No readable checkpoint is left: training starts fresh from the model's current weights. "
            "If you have a copy of a good checkpoint, stop and put it back in the directory."
        )
    else:
        tail = f"Fell back to the older {restored!r} ({where}); the training after it is redone."
    warnings.warn(
        f"{head}, moved aside: {listed}. {tail}",
        UnreadableCheckpointWarning,
        stacklevel=stacklevel + 1,
    )


def read(path):
    """The record of the checkpoint ``path`` (a ``.h5`` file or a ``.orbax`` step directory).

    Raises:
        Every error of :func:`keras_stable_state.format.read_file` (of :func:`.orbax_steps.read`).
    """
    return orbax_steps.read(path) if orbax_steps.is_step(path) else storage.read_file(path)


def restore_newest(paths, directory, restore, unreadable, writer="StableCheckpoint", read_with=read):
    """Read the checkpoints ``paths`` of ``directory`` (newest first) until one restores.

    Each file is read once (``read_with(path)``, by default :func:`read`; one open handle, every check made on the bytes read through
    it), and its record goes to ``restore(path, record)``, which restores everything
    from that record: a file replaced between the check and the restore cannot mix
    two files' state. A file that is unreadable
    (``CorruptCheckpointError``, ``CheckpointFormatError``, raised by the read or by
    ``restore``; a FIFO, device or other non-regular file; a symbolic link to nothing)
    goes to ``unreadable(path, err)`` and the next one is tried; a file removed since it
    was listed is skipped. ``read_with`` reads a record (an object store's directory reads
    through its filesystem; several JAX processes read through a collective that compares).

    Returns:
        The path restored, or ``None`` if none was left.

    Raises:
        CheckpointInUseError: if a checkpoint is locked by another process (it is not
            damaged, so there is no fallback), naming it and its holder.
        NewerFormatError: if a checkpoint was written by a newer keras_stable_state (it
            is not damaged: it is left in place, and there is no fallback).
        FileNotFoundError: if a file that still exists cannot be opened as such.
        Exception: any other error of ``restore`` (a checkpoint that does not fit the model).
    """
    for path in paths:
        try:
            record = read_with(path)
            restore(path, record)
        except CheckpointInUseError as err:
            holder = f" ({err.holder})" if err.holder else ""
            raise CheckpointInUseError(
                f"Checkpoint {path!r}, the newest one left in {directory!r}, is in use by "
                f"another process{holder}: {err} It is not damaged, so {writer} does not fall "
                "back to an older checkpoint. Wait for that process to close it, or stop it, then "
                "restore again.",
                path=path,
                holder=err.holder,
            ) from err
        except FileNotFoundError as err:
            if os.path.islink(path):  # a symbolic link to nothing: unreadable, moved aside
                unreadable(path, err)
                continue
            if os.path.lexists(path):
                raise
            continue  # removed since it was listed: the next one is the newest
        except NewerFormatError as err:
            raise NewerFormatError(
                f"Checkpoint {path!r} in {directory!r} cannot be resumed from: {err} {writer} leaves "
                "it in place and does not fall back to an older checkpoint (that would train again what "
                "this one holds). Upgrade keras_stable_state, or move the file away yourself to resume "
                "from the one before it.",
                path=path,
                version=err.version,
                unknown=err.unknown,
            ) from err
        except (CorruptCheckpointError, CheckpointFormatError) as err:
            unreadable(path, err)
            continue
        return path
    return None
