"""The file object HDF5 writes a record through, which never fails HDF5.

When a write of HDF5's own ``sec2`` driver fails (a full disk, ``RLIMIT_FSIZE``),
HDF5 cannot close the file: it keeps the file and every object in it open, h5py
raises ``Can't close file`` and, later, ``Can't decrement id ref count`` as those
objects are collected, and collecting them can crash the process (SIGSEGV),
from whatever thread runs the garbage collector. `Sink` is the file
object h5py's ``fileobj`` driver writes through instead: a write that fails is
remembered, not raised, and every later write is counted but dropped, so HDF5
always closes the file cleanly. `Sink.check` then raises the first error,
an ``OSError`` with its errno, naming how many bytes the whole file needed
(HDF5 went on to its end, so that count is exact).

A write that would take the file past the process' file-size limit
(``RLIMIT_FSIZE``) is refused with ``EFBIG`` before it is made, so the kernel
never sends ``SIGXFSZ`` (which kills a process that does not ignore it).

This module imports no Keras.
"""

from __future__ import annotations

import errno
import io
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

try:
    import resource
except ImportError:  # not on Windows: no file-size limit to respect
    resource = None

__all__ = ["LimitedFile", "Sink", "file_size_limit", "free_bytes", "room_for"]


def file_size_limit() -> int | None:
    """The soft ``RLIMIT_FSIZE`` of this process in bytes, or ``None`` if unlimited."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def free_bytes(folder: str) -> int | None:
    """Bytes an unprivileged process may still write in ``folder``'s file system, or
    ``None`` where that cannot be asked."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def room_for(end: int, needed: int | None = None) -> None:
    """Refuse, with ``EFBIG``, a write that would make a file ``end`` bytes long past
    this process' file-size limit (instead of the kernel's ``SIGXFSZ``).

    Raises:
        OSError: ``EFBIG``, with ``needed_bytes`` set to ``needed`` if given.
    """
    limit = file_size_limit()
    if limit is not None and end > limit:
        err = OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        if needed is not None:
            err.needed_bytes = needed
        raise err


class Sink:
    """A binary file object over the file descriptor ``fd`` (positioned writes) for
    h5py's ``fileobj`` driver; see the module docstring.

    Attributes:
        error: The first ``OSError`` a write raised, or ``None``.
        size: The file's length as HDF5 sees it: the end of its furthest write, or
            what it truncated the file to (``int``).
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.pos = 0
        self.size = 0
        self.error = None

    def _fail(self, err: OSError) -> None:
        if self.error is None:
            # Without its traceback: its frames hold views of HDF5's own buffers.
            self.error = err.with_traceback(None)

    def seek(self, offset, whence=os.SEEK_SET):
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self):
        return self.pos

    def write(self, data):
        view = memoryview(data).cast("B")
        n = len(view)
        if self.error is None:
            try:
                room_for(self.pos + n)
                done = 0
                while done < n:
                    wrote = os.pwrite(self.fd, view[done:], self.pos + done)
                    if wrote == 0:  # a file system that takes nothing more without saying why
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += wrote
            except OSError as err:
                self._fail(err)
        self.pos += n
        self.size = max(self.size, self.pos)
        return n

    def readinto(self, buf):
        view = memoryview(buf).cast("B")
        got = 0
        if self.error is None:
            try:
                got = os.preadv(self.fd, [view], self.pos)
            except OSError as err:
                self._fail(err)
        view[got:] = bytes(len(view) - got)  # HDF5 reads what it wrote: nothing past it
        self.pos += len(view)
        return len(view)

    def read(self, size=-1):
        buf = bytearray(max(0, self.size - self.pos) if size is None or size < 0 else size)
        self.readinto(buf)
        return bytes(buf)

    def truncate(self, size=None):
        size = self.pos if size is None else size
        if self.error is None:
            try:
                room_for(size)
                os.ftruncate(self.fd, size)
            except OSError as err:
                self._fail(err)
        self.size = size
        return size

    def flush(self):
        pass

    def check(self, exact: bool = True) -> None:
        """Raise the first error of a write, if any.

        Args:
            exact: Whether HDF5 wrote the image to its end (then `size` is the
                length the file needs; otherwise a lower bound).

        Raises:
            OSError: the write's error (its errno and message), with ``needed_bytes``
                (`size`) and ``needed_exact`` (``exact``) set.
        """
        if self.error is not None:
            code = self.error.errno
            err = OSError(code, os.strerror(code) if code else str(self.error))
            err.needed_bytes = self.size
            err.needed_exact = exact
            raise err


class LimitedFile(io.FileIO):
    """``io.FileIO`` for files other code writes (Keras' own ``.keras`` archive): each
    write is whole (short writes are continued), a write past this process' file-size
    limit raises ``EFBIG`` (`room_for`) instead of drawing ``SIGXFSZ``, and a
    failed write's ``OSError`` carries ``needed_bytes`` (at least its end) and
    ``needed_exact = False``."""

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data).cast("B")
        end = self.tell() + len(view)
        done = 0
        try:
            room_for(end)
            while done < len(view):
                wrote = super().write(view[done:])
                if not wrote:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += wrote
        except OSError as err:  # what the file needs: at least this write's end
            err.needed_bytes, err.needed_exact = end, False
            raise
        return done
