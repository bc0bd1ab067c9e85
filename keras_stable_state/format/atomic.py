"""Atomic writes: a file appears whole at its path, or the previous one stays.

A temporary file ``.kss-<random><suffix>`` in the same folder is created
(`create_temporary`: ``O_CREAT | O_EXCL | O_NOFOLLOW``, so never through a
link nor onto an existing file, with mode ``0o666``: the umask applies as for
``open``, and the process umask is never changed), written, checked to be still
the file created (nothing replaced it meanwhile), ``fsync``-ed through its own
descriptor and renamed onto the path (``os.replace``: a symbolic link at the
path is replaced, never written through), then the folder is ``fsync``-ed. The page
cache of the file being replaced is dropped before the new one is written
(`release_cached_pages`): the write then reuses those pages, as a write that
truncates the file in place does, instead of needing a second file's worth of fresh
memory while both files are cached.

This module imports no Keras.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from types import TracebackType
from typing import Literal

from keras_stable_state.errors import CheckpointFormatError, StateError
from keras_stable_state.format.sink import file_size_limit, free_bytes
from keras_stable_state.format.urls import refuse_url

TEMP_PREFIX = ".kss-"
"""Prefix of every temporary file of an atomic write."""
_CREATE = (
    os.O_RDWR
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def create_temporary(folder: str, suffix: str = "") -> tuple[int, str]:
    """Create a new empty file ``<folder>/.kss-<random><suffix>``; ``(descriptor, path)``.

    The file is created exclusively (``O_EXCL``: a name already taken, also by a symbolic
    link, is never opened) with mode ``0o666`` less the umask.

    Raises:
        OSError: if it cannot be created (the folder is missing or read-only, permissions).
    """
    for _ in range(100):
        path = os.path.join(folder, f"{TEMP_PREFIX}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(path, _CREATE, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name after 100 tries", folder)


_PEEK = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)


def release_cached_pages(path: str) -> None:
    """Drop the page cache of the regular file at ``path`` (``posix_fadvise(DONTNEED)``),
    which an atomic write is about to replace; anything else (no file, a link, a FIFO, a
    device, no ``posix_fadvise``, an error) is left alone. Nothing on disk changes: the
    file stays whole until the rename, it is only read from the disk if read again.

    Why: the temporary file needs as many fresh pages as the file is large while the
    old file's pages stay cached; where fresh memory is slow (a virtual machine that hands
    freed pages back to its host), writing 600 MB then took 1.4-2.7 s instead of
    0.45-0.6 s, the time of a write that truncates the file in place (``open("wb")``,
    as Keras' ``save_weights`` does) or of this one after the drop.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return
        fd = os.open(path, _PEEK)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    """Context manager yielding a temporary path beside ``filepath`` (a new file of
    `create_temporary`, ``0o666 & ~umask`` permissions); on success it is checked to
    be still that file, fsynced and renamed onto ``filepath`` (``os.replace``), and the
    folder is fsynced; on error it is removed.

    Args:
        filepath: Where the file is to appear.
        suffix: Ending of the temporary file's name (``".h5"``, ``".keras"``).

    Raises:
        CheckpointFormatError: if ``filepath`` is a directory or a URL (``s3://...``).
        StateError: if the temporary file was removed or replaced while it was written
            (another process writes into the folder); ``filepath`` is left as it was.
        OSError: naming ``filepath`` when writing fails (disk full, permissions);
            the previous file at ``filepath`` is left as it was.
    """

    def __init__(
        self, filepath: str | bytes | os.PathLike[str] | os.PathLike[bytes], suffix: str = ""
    ) -> None:
        self.filepath = os.fsdecode(os.fspath(filepath))
        refuse_url(self.filepath, "training-state path")  # never a local folder named 's3:'
        self.suffix = suffix

    def __enter__(self) -> str:
        if os.path.isdir(self.filepath):
            raise directory_error(self.filepath)
        folder = os.path.dirname(os.path.abspath(self.filepath))
        try:
            os.makedirs(folder, exist_ok=True)
            self.fd, self.tmp = create_temporary(folder, self.suffix)
        except OSError as err:
            raise _write_error(self.filepath, err) from err
        self.folder = folder
        release_cached_pages(self.filepath)
        return self.tmp

    def _discard(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)

    def _check_in_place(self) -> None:
        """Refuse to rename what is at the temporary path unless it is the file created."""
        try:
            same = os.path.samestat(os.fstat(self.fd), os.lstat(self.tmp))
        except FileNotFoundError:
            same = False
        if not same:
            raise StateError(
                f"The temporary file {self.tmp!r} of the write of {self.filepath!r} was removed or "
                "replaced while it was written: something else writes into that folder. Nothing was "
                f"written at {self.filepath!r} (the file there, if any, is unchanged). Write into a "
                "folder that only this process writes to.",
                key=self.tmp,
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc_type is not None:
            self._discard()
            if isinstance(exc, OSError) and not isinstance(exc, StateError):
                raise _write_error(self.filepath, exc) from exc
            return False
        try:
            self._check_in_place()
            os.fsync(self.fd)
            os.replace(self.tmp, self.filepath)
        except StateError:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            raise
        except OSError as err:
            self._discard()
            raise _write_error(self.filepath, err) from err
        os.close(self.fd)
        _fsync_dir(self.folder)
        return False
