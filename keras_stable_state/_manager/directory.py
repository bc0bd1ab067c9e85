"""The checkpoint directory of a [`CheckpointManager`][keras_stable_state.CheckpointManager] (and so of
a [`StableCheckpoint`][keras_stable_state.StableCheckpoint]): its ``ckpt-<step>.h5`` files (listed
newest first, pruned), the lock file `LOCK_NAME` that its one writer holds, the
stale ``.kss-*`` temporary files of a killed save, the unreadable checkpoints moved aside
into `UNREADABLE_DIR` (with the [`UnreadableCheckpointWarning`][keras_stable_state.UnreadableCheckpointWarning]
naming them) and the fallback over them (`restore_newest`).

Every access to a local directory (list, exists, stat, remove, rename, lock) goes through a
method of `LocalDirectory`; `RemoteDirectory`
has the same methods for a directory in an object store: both are the
`.protocols.CheckpointDirectory` a manager holds as its ``files``. The functions of this
module work on paths alone (names, steps, summaries, the warning and the fallback), for
both and for the command line. Neither this module nor `.remote_directory` imports Keras
or the core."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import warnings
from typing import Any

from keras_stable_state import format  # noqa: F401 - `directory.storage`: the format package (tests patch through it)
from keras_stable_state._manager import lock, orbax_steps
from keras_stable_state.errors import (
    CheckpointFormatError,
    CheckpointInUseError,
    CorruptCheckpointError,
    NewerFormatError,
    StateError,
    UnreadableCheckpointWarning,
)
from keras_stable_state.format import summary

_NAME = re.compile(r"^ckpt-(\d{10})\.h5$")
MAX_STEP = 10**10 - 1
"""The largest step a file name holds (``ckpt-<10 digits>.h5``)."""
TEMP_PREFIX = ".kss-"
"""Prefix of the temporary files of atomic writes (`keras_stable_state.format.atomic.atomic_path`)."""
UNREADABLE_DIR = "unreadable"
"""Subfolder of the checkpoint directory that unreadable checkpoints are moved into (damaged
ones, and those whose sealed record names another step than their file name)."""
ABANDONED_DIR = "abandoned"
"""Subfolder of the checkpoint directory that the checkpoints of an abandoned timeline are
moved into (the later ones, when a save follows a rollback; see ``CheckpointManager.save``)."""
LOCK_NAME = lock.LOCK_NAME
MANAGER_RECORD = "checkpoint"
"""The provider of the manager's record (``records.RECORD``, whose module imports this one)."""


# -- paths ----------------------------------------------------------------------------------
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


def read_summary(path: str) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """The small part of a checkpoint's records, read without its arrays: ``(metadata,
    extra, format version)`` (see `keras_stable_state.format.summary`: its seal
    is checked (it covers the records), its arrays are neither read nor decoded; of
    ``extra`` only the manager's record ``providers/checkpoint`` is kept).

    Raises:
        Every error of `keras_stable_state.format.open_file`.
    """
    if orbax_steps.is_step(path):
        return orbax_steps.read_summary(path)
    return summary.read_summary(path, MANAGER_RECORD)


class LocalDirectory:
    """A local checkpoint directory (the `.protocols.CheckpointDirectory` of a folder of this
    machine's file system): its ``ckpt-<step>.h5`` files (or ``.orbax`` step directories),
    its lock file (`.lock`), its stale temporary files and ``unreadable/``. A file is visible
    once it is renamed into place, so `begin_save` and `commit` do nothing.

    Args:
        path: The folder (a ``str`` path; created by `prepare`).
    """

    storage_options: dict[str, Any] | None = None
    """The ``storage_options`` of a local directory's saves and restores: none."""
    local: bool = True
    """A folder of this machine's file system (a checkpoint may be read in place)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"LocalDirectory({self.path!r})"

    # -- the files --------------------------------------------------------------------------
    def checkpoints(self) -> list:
        """Paths of the checkpoints in the folder, newest first (files named
        ``ckpt-<10 digits>.h5``; in a folder named ``*.orbax``, step directories
        ``ckpt-<10 digits>.orbax``; ``[]`` if the path is not a folder)."""
        if orbax_steps.uses_orbax(self.path):
            return orbax_steps.checkpoints(self.path)
        if not os.path.isdir(self.path):
            return []
        names = sorted((n for n in os.listdir(self.path) if _NAME.match(n)), reverse=True)
        return [os.path.join(self.path, n) for n in names]

    def exists(self, path) -> bool:
        """Whether something (a file, or a symbolic link even to nothing) is at ``path``."""
        return os.path.lexists(path)

    def identity(self, path):
        """What tells one written file from another at ``path`` (device, inode, size,
        modification time), or ``None`` if nothing is there: a cache key for what was read
        from it."""
        if orbax_steps.is_step(path):
            return orbax_steps.identity(path)
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def read_summary(self, path: str) -> tuple[dict[str, Any], dict[str, Any], int | None]:
        """The module's `read_summary` of ``path``."""
        return read_summary(path)

    def size_of(self, path) -> int:
        """Size in bytes of the file at ``path`` (of a ``.orbax`` step: of its files;
        ``OSError`` naming it if it is gone)."""
        if orbax_steps.is_step(path):
            return orbax_steps.size_of(path)
        return os.path.getsize(path)

    # -- the lock ---------------------------------------------------------------------------
    def prepare(self, writer="StableCheckpoint") -> None:
        """Create the folder (and its parents) if needed.

        Raises:
            NotADirectoryError: if the path is a file (or a symbolic link to nothing).
            OSError: naming the folder if it cannot be created (read-only file system,
                permissions), with its ``errno``.
        """
        directory = self.path
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

    def acquire_lock(self, token, *, writer="StableCheckpoint", reclaimable=True) -> lock.DirectoryLock:
        """`.lock.DirectoryLock.acquire` of the folder (every error of it)."""
        return lock.DirectoryLock.acquire(self.path, token, writer=writer, reclaimable=reclaimable)

    def release_token(self, token) -> None:
        """`.lock.release_token`: release the lock the owner of ``token`` holds, if any."""
        lock.release_token(token)

    def remove_temporary_files(self) -> list:
        """Remove the ``.kss-*`` temporary files a killed save left in the folder (and the
        partial step directories of a ``*.orbax`` one, see `.orbax_steps`); their paths."""
        directory = self.path
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

    # -- saving and removing ----------------------------------------------------------------
    def begin_save(self, path) -> None:
        """Nothing: a local checkpoint replaces the one of its step by an atomic rename."""

    def commit(self, path, step, info) -> None:
        """Nothing: a local checkpoint is visible once renamed into place, and complete then."""

    def remove(self, paths) -> None:
        """Remove the checkpoint files (or ``.orbax`` step directories) ``paths``; one removed
        meanwhile is skipped."""
        for old in paths:
            try:
                orbax_steps.remove(old) if orbax_steps.is_step(old) else os.remove(old)
            except FileNotFoundError:
                continue  # removed by someone else since it was listed

    def move_aside(self, path, writer="StableCheckpoint", folder=UNREADABLE_DIR):
        """Move an unreadable checkpoint into ``<directory>/unreadable/`` (``<name>.<n>`` if
        the name is taken); its new path, or ``None`` if it was removed meanwhile. With
        ``folder=ABANDONED_DIR``: a checkpoint of an abandoned timeline, into ``abandoned/``.

        What is at ``path`` is renamed, never opened: a symbolic link is moved as the link.
        The folder ``unreadable/`` must be a folder of its own, not a symbolic link (a
        checkpoint is never moved out of the directory through one).

        Raises:
            StateError: if it cannot be moved (it would count in ``keep`` and be found again),
                or ``unreadable/`` is a symbolic link or not a folder.
        """
        kind = "unreadable" if folder == UNREADABLE_DIR else "of an abandoned timeline"
        folder = os.path.join(self.path, folder)
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
                f"Checkpoint {path!r} is {kind} and could not be moved aside to {target!r} ({err}). "
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
                f"{folder!r} is {found}; checkpoints are moved aside into a folder of the "
                "checkpoint directory itself, never through a link. Remove it.",
                key=os.path.basename(folder),
            ) from err
        raise


def _lexists(name, folder_fd) -> bool:
    try:
        os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def warn_unreadable(
    directory: str,
    skipped: list[tuple[str, str]],
    moved: list[tuple[str, str | None]],
    restored: str | None,
    where: str,
    writer: str = "StableCheckpoint",
    stacklevel: int = 2,
) -> None:
    """Issue the [`UnreadableCheckpointWarning`][keras_stable_state.UnreadableCheckpointWarning] naming each
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


def restore_newest(paths, directory, restore, unreadable, writer="StableCheckpoint", *, read_with):
    """Read the checkpoints ``paths`` of ``directory`` (newest first) until one restores.

    Each file is read once (``read_with(path)``, e.g. `.orbax_io.read_from`; one open handle, every check made on the bytes read through
    it), and its record goes to ``restore(path, record)``, which restores everything
    from that record: a file replaced between the check and the restore cannot mix
    two files' state. A file that is unreadable
    (``CorruptCheckpointError``, ``CheckpointFormatError``, raised by the read or by
    ``restore``; a FIFO, device or other non-regular file; a symbolic link to nothing)
    goes to ``unreadable(path, err)`` and the next one is tried; a file removed since it
    was listed is skipped. ``read_with`` reads a record (an object store's directory reads
    through its filesystem; several processes read through a collective that compares, Torch ranks restoring each alone).

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
