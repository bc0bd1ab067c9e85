"""Atomic writes: a file appears whole at its path, or the previous one stays.

A temporary file ``.kss-*`` in the same folder is written, given the
permissions ``open`` would give (``0o666`` less the umask), ``fsync``-ed and
renamed onto the path (``os.replace``), then the folder is ``fsync``-ed.

This module imports no Keras.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading

from keras_stable_state.errors import CheckpointFormatError, StateError

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _fsync_dir(folder: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(path: str, err: OSError) -> OSError:
    reason = err.strerror or str(err)
    extra = " (the disk is full)" if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return OSError(
        err.errno,
        f"Could not write the training state to {path!r}: {reason}{extra}. Nothing was written there: "
        "the file that was at that path, if any, is unchanged. Free space or choose another folder.",
        path,
    )


def directory_error(path: str) -> CheckpointFormatError:
    """The error for a training-state path that is a directory."""
    return CheckpointFormatError(
        f"{path!r} is a directory; a training state is one file. Choose a file path "
        "(e.g. 'run.h5' or 'run.keras').",
        received=path,
    )


class atomic_path:
    """Context manager yielding a temporary path beside ``filepath``; on success the
    file gets ``0o666 & ~umask`` permissions, is fsynced and renamed onto
    ``filepath`` (``os.replace``), and the folder is fsynced; on error it is removed.

    Args:
        filepath: Where the file is to appear.
        suffix: Ending of the temporary file's name (``".h5"``, ``".keras"``).

    Raises:
        CheckpointFormatError: if ``filepath`` is a directory.
        OSError: naming ``filepath`` when writing fails (disk full, permissions);
            the previous file at ``filepath`` is left as it was.
    """

    def __init__(self, filepath, suffix=""):
        self.filepath = os.fsdecode(os.fspath(filepath))
        self.suffix = suffix

    def __enter__(self):
        if os.path.isdir(self.filepath):
            raise directory_error(self.filepath)
        folder = os.path.dirname(os.path.abspath(self.filepath))
        try:
            os.makedirs(folder, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix=".kss-", suffix=self.suffix, dir=folder)
        except OSError as err:
            raise _write_error(self.filepath, err) from err
        os.close(fd)
        self.folder = folder
        return self.tmp

    def _discard(self):
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._discard()
            if isinstance(exc, OSError) and not isinstance(exc, StateError):
                raise _write_error(self.filepath, exc) from exc
            return False
        try:
            os.chmod(self.tmp, 0o666 & ~_umask())
            with open(self.tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(self.tmp, self.filepath)
        except OSError as err:
            self._discard()
            raise _write_error(self.filepath, err) from err
        _fsync_dir(self.folder)
        return False
