"""A sealed HDF5 image read once into memory, its arrays taken as views of it.

A whole-file read (`read_file`, every restore) of a
sealed record reads its bytes once, into one buffer starting at a multiple of
`READ_ALIGN` bytes, hashing each chunk as it
arrives (`read_sealed`); HDF5 then parses its metadata from that buffer
(`ImageFile`), and each array is a view of the buffer at its dataset's offset
(`dataset_view`): no second read and no copy. What HDF5 parses and what the
restore uses are the bytes the seal covered, so a file changed on disk after the check
cannot reach a variable.

The arrays share the buffer: one of them kept alive keeps the whole image alive (the
restore core copies instead where the variables would take less than half of it).
`read_hashed` reads a ``.keras`` archive's Keras weights member the same way, its
xxh3-128 checked against the sealed index, where the caller can use views at Keras'
unaligned offsets (Torch); `aligned_copy` is the 64-byte aligned copy the reader
and the restore core make where a view cannot be used.

This module imports no Keras.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from keras_stable_state.format import sandbox, seal
from keras_stable_state.format.keras_archive import SizedReader
from keras_stable_state.format.record import USERBLOCK_SIZE


def read_sealed(fh, user_block: bytes, size: int, where: str) -> tuple[int, str, bool, np.ndarray]:
    """Read the file ``fh`` (``size`` bytes, its first 512 bytes ``user_block``) whole into
    one aligned buffer, hashing it for its seal as it is read (`read_hashed`).

    Returns:
        ``(format version, hash name, whether the digest matches, the buffer)``.

    Raises:
        NewerFormatError: for the seal of a format version this version does not read.
        CorruptCheckpointError: if the seal is malformed, or the file is not as long as
            it says or ends sooner when read.
        MemoryError: if there is no memory for the buffer.
        OSError: a failed read.
    """
    version, name, h, digest = seal.start(user_block, size, where)
    image = read_hashed(fh, size, h, where, skip=USERBLOCK_SIZE)
    return version, name, h.digest() == digest, image


def read_hashed(fh, size: int, h, where: str, *, skip: int = 0, key: str | None = None) -> np.ndarray:
    """Read ``size`` bytes of the file ``fh`` from its start into one new buffer, feeding
    every byte past the first ``skip`` to the hasher ``h`` (``update``) as it is read.

    The file is read in chunks of `CHUNK` bytes;
    past `_OVERLAP_ABOVE` bytes another thread hashes each chunk while the next is
    read (``readinto`` and ``xxhash`` both release the GIL), so the hash costs little
    more than the read; an error in that thread is raised here, and an error here stops
    it at once. ``fh`` is left at offset 0.

    Returns:
        A writable ``uint8`` array of ``size`` bytes whose data starts at a multiple of
        `READ_ALIGN` bytes.

    Raises:
        CorruptCheckpointError: naming ``where`` (and ``key``) if the file ends before
            ``size`` bytes.
        MemoryError: if there is no memory for the buffer.
        OSError: a failed read, as ``fh`` raised it.
    """
    image = sandbox.aligned_empty((size,), np.uint8)
    view = memoryview(image)

    def hash_now(lo, hi):
        h.update(view[lo:hi])

    if size <= _OVERLAP_ABOVE:
        _read_chunks(fh, view, size, where, skip, key, hash_now)
        return image
    chunks: queue.SimpleQueue = queue.SimpleQueue()
    failed: list = []  # the hashing thread's error, raised in this one
    stop = threading.Event()  # set when this thread fails: the rest is not hashed

    def hash_chunks():
        try:
            while (span := chunks.get()) is not None:
                if not stop.is_set():
                    hash_now(*span)
        except BaseException as err:  # handed to the reading thread, raised there
            failed.append(err)
            stop.set()

    hasher = threading.Thread(target=hash_chunks, name="kss-seal-hash", daemon=True)
    try:
        hasher.start()
    except RuntimeError:  # no thread can start (a thread limit): hash in this one
        _read_chunks(fh, view, size, where, skip, key, hash_now)
        return image
    try:
        _read_chunks(fh, view, size, where, skip, key, lambda lo, hi: failed or chunks.put((lo, hi)))
    except BaseException:
        stop.set()
        raise
    finally:
        chunks.put(None)
        hasher.join()
    if failed:
        raise failed[0]
    return image


# Files larger than this are hashed in another thread while they are read.
_OVERLAP_ABOVE = 2 * seal.CHUNK


def _read_chunks(fh, view: memoryview, size: int, where: str, skip: int, key, done_chunk) -> None:
    """Read ``size`` bytes of ``fh`` from its start into ``view``, chunk by chunk, calling
    ``done_chunk(lo, hi)`` with each chunk's span past the first ``skip`` bytes."""
    fh.seek(0)
    done = 0
    while done < size:
        n = fh.readinto(view[done : min(size, done + seal.CHUNK)])
        if not n:
            raise seal.truncated(where, size, done, key=key)
        if done + n > skip:
            done_chunk(max(done, skip), done + n)
        done += n
    fh.seek(0)


class ImageFile(SizedReader):
    """A read-only, seekable file over a ``uint8`` buffer, for h5py to parse metadata from."""

    def __init__(self, image: np.ndarray):
        super().__init__(image.nbytes)
        self._view = memoryview(image)

    def readinto(self, buf):
        n = self._left(buf)
        if n:
            memoryview(buf).cast("B")[:n] = self._view[self._pos : self._pos + n]
            self._pos += n
        return n


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` in new memory starting at a multiple of
    `READ_ALIGN` bytes."""
    out = sandbox.aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def dataset_view(image: np.ndarray, offset: int, dsid) -> np.ndarray:
    """The data of the contiguous dataset ``dsid`` (an ``h5py.h5d.DatasetID`` that
    `check_dataset` passed, its data at byte
    ``offset`` of the image, inside it) as a view of ``image``: its stored dtype and
    shape, C order, writable."""
    return np.ndarray(dsid.shape, dtype=dsid.dtype, buffer=image, offset=offset)
