"""The marker of a local checkpoint directory's lock: the marker file ``<lock file>.owner``,
created exclusively by `filelock.SoftFileLock`, which records the holder's pid, host and
process start time in it. It is the whole portable lock (platforms without ``flock``, Windows,
and file systems where ``flock`` fails), and the ``flock`` lock takes it too, so that a writer
of each lock on one directory exclude each other.

A marker of a process of this host that no longer runs (killed, crashed) is taken over by
the next writer (filelock's stale detection: the pid is gone, or now belongs to a process
started at another time). A marker of another host is not taken over (that process cannot be
proven dead from here) unless its writer held the ``flock`` that the next writer now holds
(see `lock._take_marker`). `lock` chooses the lock (and takes ``flock`` where it applies) and
keeps the JSON holder record in the lock file itself, for both.
"""

from __future__ import annotations

import os
import stat

from filelock import SoftFileLock, Timeout

from keras_stable_state.errors import StateError

MARKER_SUFFIX = ".owner"
"""Appended to the lock file's path: the marker file of the portable lock."""


def marker_path(lock_path) -> str:
    """The marker file of the lock file ``lock_path``."""
    return lock_path + MARKER_SUFFIX


class Busy(Exception):
    """Another process holds the marker: ``pid`` is the pid it records (``None`` if it cannot
    be read), ``reason`` filelock's own account (it names a holder of another host, then
    ``other_host`` is true)."""

    def __init__(self, pid, reason):
        super().__init__(reason)
        self.pid, self.reason = pid, reason
        self.other_host = bool(reason)


def _refuse_odd_marker(directory, path) -> None:
    """Refuse a marker that is not a regular file of one name: filelock never writes through
    one (it creates markers exclusively), but it could never take such a one over either, and
    every writer would be refused with no holder to name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return
    found = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
    if stat.S_ISREG(st.st_mode):
        found = f"a file with {st.st_nlink} names (hard links)"
    raise StateError(
        f"The lock marker {path!r} of the checkpoint directory {directory!r} is {found}; expected a "
        f"regular file created by the portable directory lock, or none. Remove {path!r} and fit again "
        "(nothing but StableCheckpoint should write into its directory).",
        key=os.path.basename(path),
    )


def take(directory, lock_path) -> SoftFileLock:
    """Create the marker of ``lock_path`` for this process, taking over one left by a process of
    this host that no longer runs; the held `filelock.SoftFileLock` (one attempt, no wait).

    Raises:
        Busy: if a live process (or one of another host) holds the marker.
        StateError: naming the marker if it is a symbolic link, a hard link or not a regular file.
        OSError: naming the marker if it cannot be created (read-only file system, permissions).
    """
    path = marker_path(lock_path)
    _refuse_odd_marker(directory, path)
    marker = SoftFileLock(path, thread_local=False)  # released by whichever thread ends the writer
    try:
        marker.acquire(timeout=0)
    except Timeout as err:
        reason = str(err) if "cannot probe" in str(err) else ""
        raise Busy(marker.pid, reason) from None
    except OSError as err:
        raise OSError(
            err.errno,
            f"Cannot create the lock marker {path!r} of the checkpoint directory {directory!r} "
            f"({err.strerror}). StableCheckpoint writes its lock and its checkpoints there: give it a "
            "folder it can write.",
            path,
        ) from err
    return marker


def take_over(directory, lock_path) -> SoftFileLock:
    """Remove the marker of ``lock_path`` left by a writer known to have ended, then `take` it
    (a writer starting meanwhile takes it first, and this one is refused as by `take`)."""
    try:
        os.unlink(marker_path(lock_path))
    except FileNotFoundError:
        pass
    return take(directory, lock_path)


def release(marker) -> None:
    """Remove this process's marker (filelock removes it only if it is still this one's)."""
    marker.release(force=True)
