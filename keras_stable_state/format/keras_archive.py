"""Arrays a ``.keras`` training state shares with Keras' own ``model.weights.h5``.

A ``.keras`` training state is Keras' archive (``config.json``,
``model.weights.h5``: what ``keras.saving.load_model`` reads) plus the record
member ``keras_stable_state.h5``. The model variables and the optimizer slots
(``model.save`` writes the compiled optimizer's variables under
``optimizer/vars``) would be stored twice; instead, a model array, or an
optimizer array larger than `PACK_LIMIT` bytes,
whose dtype, shape and bytes equal a dataset of Keras' weights file is not
written again: its index row names that dataset
(``"model.weights.h5:/layers/dense/vars/0"``, ``"model.weights.h5:/optimizer/vars/2"``)
and keeps the array's own key. Matching is by content, so it holds for any
layer's ``save_own_variables`` and any optimizer; an array Keras stores otherwise
(transformed, another dtype) is simply kept in the record.

The record's sealed index holds the xxh3-128 and length of the whole weights
member, checked before HDF5 parses a byte of it, and each shared array's own
xxh3-64 (over its key, dtype, shape and bytes), checked when it is read. The
member must be stored uncompressed (Keras writes it so): it is read in place
through `Window`, never through zip's decompressing reader; a whole read on
Torch (`image`) reads it once into one buffer while
hashing it, otherwise it is hashed in chunks and its arrays are read one by one.

This module imports no Keras.
"""

from __future__ import annotations

import dataclasses
import io
import zipfile

import numpy as np
import xxhash

from keras_stable_state.format import sandbox

MEMBER = "model.weights.h5"
PREFIX = f"{MEMBER}:"
_CHUNK = 1 << 22


class SizedReader(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes, for h5py: position and seeking; a
    subclass reads (``readinto``) from where its bytes lie."""

    def __init__(self, size: int):
        super().__init__()
        self._size, self._pos = size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _left(self, buf) -> int:
        """How many bytes a read into ``buf`` from the current position gets."""
        return max(0, min(len(buf), self._size - self._pos))


class Window(SizedReader):
    """A read-only, seekable file over ``size`` bytes of ``fh`` starting at ``start``
    (an archive member stored uncompressed), for h5py."""

    def __init__(self, fh, start: int, size: int):
        super().__init__(size)
        self._fh, self._start = fh, start

    def readinto(self, buf):
        n = self._left(buf)
        if not n:
            return 0
        self._fh.seek(self._start + self._pos)
        got = self._fh.readinto(memoryview(buf)[:n])
        self._pos += got or 0
        return got or 0


def member_span(fh, info: zipfile.ZipInfo) -> tuple[int, int]:
    """``(start, size)`` of a stored member's bytes inside the archive file ``fh``.

    Raises:
        zipfile.BadZipFile: if its local header is not where the central directory says.
    """
    return sandbox.member_start(fh, info), info.file_size


def hash_span(fh, start: int, size: int, regions=()) -> tuple[str, list]:
    """xxh3-128 (hex) of ``size`` bytes of ``fh`` from ``start``, read once in chunks into
    one reused buffer, and of each of ``regions`` (``(offset, nbytes)`` inside the span)
    from the same chunks: ``(hex of the span, [hex of each region])``."""
    whole = xxhash.xxh3_128()
    hashers = [xxhash.xxh3_128() for _ in regions]
    order = sorted(range(len(regions)), key=lambda i: regions[i][0])
    buf = bytearray(_CHUNK)
    fh.seek(start)
    pos, first = 0, 0  # order[first:] holds every region not yet hashed to its end
    while pos < size:
        n = fh.readinto(memoryview(buf)[: min(size - pos, _CHUNK)])
        if not n:
            break
        chunk, end = memoryview(buf)[:n], pos + n
        whole.update(chunk)
        for i in order[first:]:
            offset, nbytes = regions[i]
            if offset >= end:
                break
            lo, hi = max(offset, pos), min(offset + nbytes, end)
            if hi > lo:
                hashers[i].update(chunk[lo - pos : hi - pos])
        while first < len(order) and regions[order[first]][0] + regions[order[first]][1] <= end:
            first += 1
        pos = end
    return whole.hexdigest(), [h.hexdigest() for h in hashers]


def content_key(stored: np.ndarray) -> tuple:
    """What two arrays must share to be the same stored array: dtype, shape and bytes."""
    raw = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
    return stored.dtype.str, tuple(int(n) for n in stored.shape), xxhash.xxh3_128(raw).hexdigest()


@dataclasses.dataclass
class KerasWeights:
    """Keras' ``model.weights.h5`` of a freshly written archive, by content.

    Attributes:
        spec: ``{"member", "bytes", "xxh3-128"}`` for the record's index.
        by_content: ``{content_key: ["model.weights.h5:/path", ...]}``, every dataset
            of that content in walk order (Keras stores each variable on its own, so
            equal arrays, zero Adam moments say, each have one).
    """

    spec: dict
    by_content: dict

    @classmethod
    def of_archive(cls, archive: str) -> KerasWeights | None:
        """The weights member of the archive Keras just wrote at ``archive``; ``None``
        when it has none or compressed it (then nothing is shared)."""
        import h5py

        with open(archive, "rb") as fh, zipfile.ZipFile(fh) as zf:
            try:
                info = zf.getinfo(MEMBER)
            except KeyError:
                return None
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            start, size = member_span(fh, info)
            found, regions = [], []  # (path, content key or index into regions), walk order
            with h5py.File(Window(fh, start, size), "r") as f:
                for path, ds in sandbox.walk(f, size):
                    try:
                        sandbox.check_dtype(ds.dtype, path)
                    except sandbox.StructureError:
                        continue
                    nbytes = int(ds.size or 0) * ds.dtype.itemsize
                    offset = ds.id.get_offset() if nbytes else None
                    if offset is None or offset + nbytes > size:  # compact or empty: read it
                        found.append((path, content_key(sandbox.read_dataset(ds))))
                        continue
                    found.append((path, len(regions)))
                    regions.append((offset, nbytes, ds.dtype.str, tuple(int(n) for n in ds.shape)))
            # contiguous datasets hashed where they lie, in the same pass as the whole member
            digest, digests = hash_span(fh, start, size, [r[:2] for r in regions])
            spec = {"member": MEMBER, "bytes": size, "xxh3-128": digest}
            by_content = {}
            for path, key in found:
                if isinstance(key, int):
                    key = (*regions[key][2:], digests[key])
                by_content.setdefault(key, []).append(f"{PREFIX}/{path}")
        return cls(spec=spec, by_content=by_content)

    def find(self, stored: np.ndarray) -> str | None:
        """The dataset of Keras' weights holding exactly ``stored``, or ``None``: for equal
        arrays, a distinct one each while any is left."""
        paths = self.by_content.get(content_key(stored))
        if not paths:
            return None
        # Equal arrays refer to distinct datasets while there are any left (a reader gives each
        # array memory of its own without a copy); past them, to the last one.
        return paths.pop(0) if len(paths) > 1 else paths[0]
