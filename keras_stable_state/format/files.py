"""Paths and files the library opens: only regular files, never blocked on.

Every path a user gives (a training-state file, a ``StableCheckpoint`` directory)
is taken by `fs_path` (``str``, ``bytes`` decoded with ``os.fsdecode`` as
``os.path`` does, or ``os.PathLike``), which never takes a URL (``gs://...``) for a
local path (`urls`). Every file the library opens by a path
goes through `open_regular`: it is opened non-blocking (a FIFO cannot
make ``open`` wait for a writer), and what was opened is checked with ``fstat``
to be a regular file, so a FIFO, a device (``/dev/zero``, ``/dev/urandom``), a
socket or a directory is refused by name before a byte is read, and every read
is bounded by the file's size. A symbolic link is followed to a regular file
where the user names the path (``ln -s ckpt-0000000090.h5 latest.h5`` is a
common way to name a checkpoint); where the library writes into a file it must
not be a link at all (``follow_symlinks=False``: ``O_NOFOLLOW``), nor a second
hard link of another file (``single_link=True``). See
``docs/concepts/security.md``.

This module imports no Keras.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from typing import IO

from keras_stable_state.errors import CheckpointFormatError, StateError
from keras_stable_state.format.urls import refuse_url, resolve

# Flags that do not exist on every platform (Windows has neither): 0 there.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
# What open(O_NOFOLLOW) sets errno to when the path is a link (Linux, macOS: ELOOP; FreeBSD: EMLINK).
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)


def fs_path(value: object, what: str = "path", *, urls: bool = False) -> str:
    """``value`` as a ``str`` path: a ``str``, a ``bytes`` path (decoded with
    ``os.fsdecode``, as ``os.path`` functions accept it) or an ``os.PathLike``.

    A URL is never taken as a local path: a ``file://`` URL becomes the local path it
    names, and any other (``s3://``, ``gs://``, ``memory://``...) is refused, unless
    ``urls=True``, where it is returned as given for the caller to route to the object
    store (`keras_stable_state._engines.object_store`).

    Raises:
        TypeError: naming ``what`` for anything else (``None``, a number, a file object).
        CheckpointFormatError: (``urls=False``) for a URL other than a local ``file://`` one.
    """
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, (str, bytes)):
            path = os.fsdecode(path)
            if urls:
                return path
            path = resolve(path, what)
            refuse_url(path, what)
            return path
    text = repr(value)
    if len(text) > 100:
        text = text[:97] + "..."
    raise TypeError(
        f"`{what}` must be a path: a str, bytes or os.PathLike. Received: {what}={text} "
        f"(of type {type(value).__name__})"
    )


def kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO (named pipe)"``)."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), f"a file of type {stat.S_IFMT(mode):o}")


def _through_link(path: str) -> str:
    try:
        return f" (through a symbolic link to {os.readlink(path)!r})" if os.path.islink(path) else ""
    except OSError:
        return ""


def open_regular(
    path: str,
    flags: int = os.O_RDONLY,
    *,
    mode: int = 0o666,
    follow_symlinks: bool = True,
    single_link: bool = False,
    what: str = "a training state",
    advice: str = "Pass the path of a regular file.",
    error: type[StateError] = CheckpointFormatError,
) -> int:
    """Open ``path`` with ``flags`` only if it is (or, ``O_CREAT`` in ``flags``, becomes) a
    regular file; the open file descriptor, in blocking mode.

    The open is non-blocking and close-on-exec; ``fstat`` of what was opened must be a
    regular file, so the file type is that of the file read, not of the path a moment
    before.

    Args:
        path: The file.
        flags: ``os.open`` flags (``os.O_RDONLY``; ``os.O_RDWR | os.O_CREAT`` for a lock).
        mode: The permissions of a file ``O_CREAT`` creates (the umask applies).
        follow_symlinks: ``False``: ``path`` itself must not be a symbolic link
            (``O_NOFOLLOW``; for files the library writes into).
        single_link: The file must have one name only (``st_nlink == 1``): a hard link
            of another file would be written through just as a symbolic link would.
        what: What the file is meant to be, for the message (``"a training state"``).
        advice: The last sentence of the message: what the user can do.
        error: The ``StateError`` class raised for a file of another type.

    Raises:
        FileNotFoundError: if ``path`` (or, for a symbolic link, its target) does not exist.
        CheckpointFormatError: (or ``error``) naming ``path`` and what it is: a directory,
            FIFO, device or socket, a symbolic link where ``follow_symlinks=False``, a
            file with several hard links where ``single_link=True``.
        OSError: any other error of ``os.open`` (``PermissionError``...), as raised.
    """
    try:
        fd = os.open(
            path, flags | _NONBLOCK | _CLOEXEC | _BINARY | (0 if follow_symlinks else _NOFOLLOW), mode
        )
    except FileNotFoundError as err:
        if os.path.islink(path):
            raise FileNotFoundError(
                errno.ENOENT,
                f"{path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist",
                path,
            ) from err
        raise
    except OSError as err:
        if err.errno in _LINK_ERRNOS and not follow_symlinks and os.path.islink(path):
            found = f"a symbolic link to {os.readlink(path)!r}"
            raise _refusal(path, found, what, advice, error) from err
        if err.errno == errno.EISDIR:
            raise _refusal(path, f"a directory{_through_link(path)}", what, advice, error) from err
        try:  # a UNIX socket cannot be opened at all (ENXIO): say what it is
            st_mode: int | None = os.stat(path).st_mode
        except OSError:
            st_mode = None
        if st_mode is not None and not stat.S_ISREG(st_mode):
            raise _refusal(path, kind(st_mode) + _through_link(path), what, advice, error) from err
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            found = kind(st.st_mode) + _through_link(path)
            if not stat.S_ISDIR(st.st_mode):
                found += ", which could block or never end"
            raise _refusal(path, found, what, advice, error)
        if single_link and st.st_nlink != 1:
            found = f"a file with {st.st_nlink} names (hard links): writing it would change the others"
            raise _refusal(path, found, what, advice, error)
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refusal(path: str, found: str, what: str, advice: str, error: type[StateError]) -> StateError:
    message = f"{path!r} is {found}; {what} must be a regular file. It was not opened. {advice}"
    if issubclass(error, CheckpointFormatError):
        return error(message, received=path)
    return error(message)


def open_binary(path: str, *, what: str = "a training state") -> io.BufferedReader:
    """`open_regular` for reading, as a buffered binary file object (``"rb"``).

    Raises:
        The errors of `open_regular`.
    """
    fd = open_regular(path, what=what)
    return os.fdopen(fd, "rb")


_FD_FOLDER = "/dev/fd/"


def inherited_path(fh: IO[bytes]) -> str:
    """A path that names the open file ``fh`` in a child process given its descriptor
    (``/dev/fd/<n>``, see `inherited_fds`), so the child reads the very file that
    was checked, not what the path names a moment later; the path of ``fh`` where the
    system has no ``/dev/fd``."""
    if os.name == "posix" and os.path.isdir(_FD_FOLDER):
        return f"{_FD_FOLDER}{fh.fileno()}"
    return fh.name


def inherited_fds(path: str) -> tuple[int, ...]:
    """The descriptors a child process must inherit to open ``path`` (``()`` for a plain path)."""
    if path.startswith(_FD_FOLDER) and path[len(_FD_FOLDER) :].isdigit():
        return (int(path[len(_FD_FOLDER) :]),)
    return ()
