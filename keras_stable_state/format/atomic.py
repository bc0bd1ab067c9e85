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
from keras_stable_state.format.sink import file_size_limit, free_bytes

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
    """The ``OSError`` (``err``'s errno, ``filename`` = ``path``) a failed write raises:
    the reason, the bytes the file needs (``err.needed_bytes``, set by the writer
    where it knows them) and what limits them (free space, ``RLIMIT_FSIZE``)."""
    code = err.errno
    reason = f"{os.strerror(code)} (errno {code})" if code else str(err)
    needed = getattr(err, "needed_bytes", None)
    needs = ""
    if needed is not None:
        needs = (
            f"writing it needs {'' if getattr(err, 'needed_exact', True) else 'at least '}{needed:,} bytes"
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(os.path.dirname(os.path.abspath(path)))
        full = "the disk is full" if code == errno.ENOSPC else "the disk quota is used up"
        room = f"{free:,} bytes are free on that file system" if free is not None else ""
        reason += (
            f" ({full}): {', and '.join(part for part in (needs, room) if part)}"
            if needs or room
            else f" ({full})"
        )
        fix = "Free space (or raise the quota) or choose another folder."
    elif code == errno.EFBIG:
        limit = file_size_limit()
        cap = (
            f"this process' file-size limit (RLIMIT_FSIZE, `ulimit -f`) is {limit:,} bytes"
            if limit is not None
            else ""
        )
        reason += f": {', and '.join(part for part in (needs, cap) if part)}" if needs or cap else ""
        fix = "Raise the file-size limit or choose another file system."
    else:
        reason += f": {needs}" if needs else ""
        fix = "Check the folder's permissions and the device, or choose another folder."
    return OSError(
        code,
        f"Could not write the training state to {path!r}: {reason}. Nothing was written there: "
        f"the file that was at that path, if any, is unchanged. {fix}",
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
