"""Opening the bytes of a file to read: lock, seal or probe, archive, HDF5.

`Source` holds a file (or bytes in memory) open and locked, checks its
seal before HDF5 parses a byte (`keras_stable_state.format.seal`) or
reads it first in a probe process when it has none
(`keras_stable_state.format.probe`), checks a ``.keras`` archive's
members (safe names, plain compression, no decompression bomb, zip CRC-32 of
the member read) and opens the HDF5 image it finds. What the image holds is
listed by `keras_stable_state.format.CheckpointFile`. See
``docs/concepts/security.md``.

This module imports no Keras.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import tempfile
import zipfile
import zlib
from typing import Any

import h5py

from keras_stable_state.errors import CheckpointFormatError, CheckpointInUseError, CorruptCheckpointError
from keras_stable_state.format import files, image, json_scan, keras_archive, sandbox, seal
from keras_stable_state.format.probe import damaged, diagnose, probe_or_refuse
from keras_stable_state.format.record import (
    KERAS_WEIGHTS_MEMBER,
    MAX_UNPACK_RATIO,
    MEMBER,
    UNPACK_SLACK,
    USERBLOCK_SIZE,
)
from keras_stable_state.format.schema import JSON_MAX_DEPTH, check_json_depth

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; files are still checked
    fcntl = None

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_ZIP_SIGNATURE = b"PK\x03\x04"


class Source:
    """The bytes of one file (or of ``data`` in memory), opened by `open`.

    Attributes:
        path: The file's path (``"<bytes>"`` for data in memory).
        data: The bytes in memory, or ``None`` for a file.
        fh: The open (and, for a file, shared-``flock``-ed) binary handle.
        zip: The ``zipfile.ZipFile`` of a ``.keras`` archive, or ``None``.
        h5: The ``h5py.File`` of the record or weights image, once opened.
        shared_h5: The ``h5py.File`` of Keras' weights member a ``.keras`` record
            shares arrays with, or ``None``; closed with the rest.
        shared_image: With `whole`, that member read once, whole, while its
            xxh3-128 was checked (`shared_h5` parses it; arrays are views of it);
            else ``None``.
        container, where, sealed, seal_version, members, member, model_class:
            As `keras_stable_state.format.CheckpointFile` documents them.
        keras_metadata: Keras' ``metadata.json`` of an archive, or ``{}``.
        hashed_members: The archive members whose every byte a hash checked on opening
            covers (the sealed record member read in place, Keras' weights member the
            record shares arrays with): their zip CRC-32 is not read again.
        whole: Read a sealed image whole into `image` while checking its seal
            (for a reader that reads every array), rather than hash it in chunks and
            read each array from the file when asked.
        unaligned_views: With `whole`: the caller can use arrays at any offset
            (Torch). ``False`` (TensorFlow and JAX need 64-byte aligned memory to use an
            array without a copy): Keras' weights member of a ``.keras`` archive, whose
            datasets Keras does not align, is hashed in chunks and read array by array
            into aligned arrays instead of whole.
        image: The sealed record's image, read once (`read_sealed`),
            which `h5` parses and arrays are views of; else ``None``.
    """

    def __init__(self, path: str, data: bytes | None, whole: bool = False, unaligned_views: bool = True):
        self.path = path
        self.data = data
        self.whole = whole
        self.unaligned_views = unaligned_views
        self.image = self.shared_image = self._sealed_fh = None
        self.fh = self.zip = None
        # h5py.File (untyped: Any) once opened
        self.h5: Any = None
        self.shared_h5: Any = None
        self.container = ".h5 file"
        self.where = path
        self.sealed = False
        self.seal_version = None
        self.members = []
        self.member = None
        self.model_class = None
        self.keras_metadata: dict[str, Any] = {}
        self.hashed_members = set()
        self._member_size = None
        # Where the record member (`_open_member_in_place`) and Keras' weights member a record
        # shares arrays with (`index._open_shared`) start in the archive file, when they are
        # read where they lie (not whole): the base of their datasets' data offsets.
        self.member_start: int | None = None
        self.shared_start: int | None = None

    def _lock(self):
        if fcntl is None:
            return
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise CheckpointInUseError(
                f"{self.path!r} is in use: another process holds it locked for writing (h5py open in "
                "'w'/'a'/'r+' mode, or an exclusive flock). The file is not known to be damaged; wait for "
                "that process to close it, then retry.",
                path=self.path,
            ) from err

    @contextlib.contextmanager
    def on_disk(self):
        """A path holding the file's bytes, for a probe process: the open file itself
        (`inherited_path`), or a private copy of
        bytes in memory."""
        if self.data is None:
            yield files.inherited_path(self.fh)
            return
        with tempfile.TemporaryDirectory(prefix="kss-probe-") as folder:
            copy = os.path.join(folder, "state")
            with open(copy, "wb") as fh:
                fh.write(self.data)
            yield copy

    def open(self) -> None:
        """Open, lock and check the bytes, and open their HDF5 image as `h5`.

        Raises:
            The errors of `keras_stable_state.format.CheckpointFile` about the
            container: in use, failing its seal, an unsafe archive, neither zip nor HDF5.
            Other exceptions (``OSError``, ``zipfile.BadZipFile``...) are left to the caller.
        """
        if self.data is not None:
            self.fh = io.BytesIO(self.data)
        else:
            self.fh = files.open_binary(
                self.path
            )  # a regular file only; held open, and locked, until close()
            self._lock()
        head = self.fh.read(USERBLOCK_SIZE)
        self.fh.seek(0)
        if head.startswith(seal.MAGIC):
            size = self.fh.seek(0, 2)
            self.fh.seek(0)
            version, name, ok = self._check_seal(self.fh, head, size, self.path)
            if not ok:
                with self.on_disk() as path:
                    raise diagnose(self.path, path, None, f"its content fails its {name} seal")
            self.seal_version = version
            self.h5 = h5py.File(self.fh if self.image is None else image.ImageFile(self.image), "r")
            self.sealed = True
        elif head.startswith(_HDF5_SIGNATURE):
            with self.on_disk() as path:
                probe_or_refuse(self.path, path)
            self.h5 = h5py.File(self.fh, "r")
        elif head[: len(seal.MAGIC)] != seal.MAGIC and self._hdf5_after_user_block():
            raise damaged(self.path, "its seal (the first 512 bytes) is missing or damaged")
        elif head.startswith(_ZIP_SIGNATURE) or zipfile.is_zipfile(self.fh):
            self.fh.seek(0)
            if not zipfile.is_zipfile(self.fh):
                raise damaged(
                    self.path, "the zip archive has no central directory at its end: it is truncated"
                )
            self.fh.seek(0)
            self._open_archive()
        else:
            raise damaged(
                self.path, "it is neither a .keras archive nor an HDF5 file (no zip, HDF5 or seal signature)"
            )
        if self.path.endswith(".weights.h5"):
            self.container = ".weights.h5 file"

    def _check_seal(self, fh, head: bytes, size: int, where: str) -> tuple[int, str, bool]:
        """The seal check of `seal`; with `whole`, the
        bytes are kept in `image` as they are hashed."""
        if not self.whole:
            return seal.check_stream(fh, head, size, where)
        version, name, ok, self.image = image.read_sealed(fh, head, size, where)
        self._sealed_fh = fh
        return version, name, ok

    def drop_image(self) -> None:
        """Parse the sealed image from the file (the same open, locked handle it was read
        and hashed from) instead of `image`, and let the image go; Keras' weights
        member a record shares arrays with is closed too, for the listing to open again.
        For a caller that would copy every view of the image (see `unaligned_views`)."""
        for handle in (self.shared_h5, self.h5):
            if handle is not None:
                with contextlib.suppress(OSError, ValueError, RuntimeError):
                    handle.close()
        self.shared_h5 = self.shared_image = self.image = None
        self.hashed_members.discard(keras_archive.MEMBER)
        self._sealed_fh.seek(0)
        self.h5 = h5py.File(self._sealed_fh, "r")

    def _hdf5_after_user_block(self) -> bool:
        self.fh.seek(USERBLOCK_SIZE)
        found = self.fh.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
        self.fh.seek(0)
        return found

    def _check_infos(self, infos: list) -> None:
        """Refuse duplicate, unsafe (a path out of the archive, a symbolic link, FIFO or device),
        oddly compressed or bomb-like archive members."""
        names = [info.filename for info in infos]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise damaged(self.path, f"archive members {twice} appear twice")
        for info in infos:
            name = info.filename
            if name.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", name) or ":" in name.split("/")[0]:
                raise damaged(self.path, f"archive member {name!r} has an unsafe path (absolute or '..')")
            unix = info.external_attr >> 16
            if stat.S_IFMT(unix) not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise damaged(
                    self.path, f"archive member {name!r} is {files.kind(unix)}, not a file", key=name
                )
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise damaged(
                    self.path, f"archive member {name!r} uses compression method {info.compress_type}"
                )
            if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
                raise damaged(
                    self.path,
                    f"archive member {name!r} is stored uncompressed but declares {info.file_size} bytes "
                    f"for {info.compress_size} stored",
                )
            if info.file_size > MAX_UNPACK_RATIO * info.compress_size + UNPACK_SLACK:
                raise damaged(
                    self.path,
                    f"archive member {name!r} would unpack to {info.file_size} bytes from "
                    f"{info.compress_size} stored (more than {MAX_UNPACK_RATIO}x): refused as a "
                    "decompression bomb",
                    key=name,
                )

    def _open_archive(self):
        self.container = ".keras archive"
        self.zip = zipfile.ZipFile(self.fh)
        infos = self.zip.infolist()
        self._check_infos(infos)
        self.members = [(info.filename, info.file_size) for info in infos]
        present = {info.filename for info in infos}
        if MEMBER in present:
            self.member = MEMBER
        elif KERAS_WEIGHTS_MEMBER in present:
            self.member = KERAS_WEIGHTS_MEMBER
        else:
            raise CheckpointFormatError(
                f"{self.path}: this zip archive holds neither a training state ({MEMBER}) nor Keras "
                f"weights ({KERAS_WEIGHTS_MEMBER}). Pass a file written by save_training_state or "
                "keras' model.save.",
                received=self.path,
            )
        self.where = f"{self.path}:{self.member}"
        if self._open_member_in_place():
            self._read_keras_json(present)
            return
        try:
            data = self.zip.read(self.member)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
            raise self._diagnose_member(f"the archive member fails its zip CRC-32 ({err})") from err
        if data.startswith(seal.MAGIC):
            version, name, ok = seal.check_bytes(data, self.where)
            if not ok:
                with self.on_disk() as path:
                    raise diagnose(self.where, path, self.member, f"its content fails its {name} seal")
            self.sealed = True
            self.seal_version = version
        elif data.startswith(_HDF5_SIGNATURE):
            with self.on_disk() as path:
                probe_or_refuse(self.where, path, self.member)
        else:
            raise damaged(self.where, "the archive member is not an HDF5 file", key=self.member)
        self.h5 = h5py.File(io.BytesIO(data), "r")
        self._member_size = len(data)
        self._read_keras_json(present)

    def _open_member_in_place(self) -> bool:
        """Open a sealed record member stored uncompressed where it lies in the archive
        (`Window`), never through zip's
        decompressing reader: its seal (xxh3-128 over every byte after its user block, and
        their count) is checked first, in chunks, or with `whole` while the member is
        read once into `image`, and covers everything the zip CRC-32 would. ``False``
        (nothing opened) for another member, a compressed one or one without a seal:
        those are read whole, with the zip CRC-32 checked."""
        info = self.zip.getinfo(self.member)
        if self.member != MEMBER or info.compress_type != zipfile.ZIP_STORED:
            return False
        start, size = keras_archive.member_span(self.fh, info)
        window = keras_archive.Window(self.fh, start, size)
        head = window.read(USERBLOCK_SIZE)
        if not head.startswith(seal.MAGIC):
            return False
        version, name, ok = self._check_seal(window, head, size, self.where)
        if not ok:
            with self.on_disk() as path:
                raise diagnose(self.where, path, self.member, f"its content fails its {name} seal")
        self.sealed = True
        self.seal_version = version
        self.hashed_members.add(self.member)
        window.seek(0)
        self.h5 = h5py.File(window if self.image is None else image.ImageFile(self.image), "r")
        self._member_size = size
        self.member_start = start if self.image is None else None
        return True

    def _read_keras_json(self, present: set) -> None:
        """Keras' ``metadata.json`` and the model class of ``config.json``, when present. The
        config is streamed through, never held (`json_scan`: memory bounded by one chunk
        whatever its size; the zip's CRC-32 is checked at its end)."""
        for name in ("metadata.json", "config.json"):
            if name not in present:
                continue
            try:
                if name == "config.json":
                    with self.zip.open(name) as member:
                        self.model_class = json_scan.top_level_class_name(member, JSON_MAX_DEPTH)
                    continue
                value = json.loads(self.zip.read(name))
                check_json_depth(value, f"{self.path}:{name}")
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RecursionError) as err:
                raise damaged(
                    f"{self.path}:{name}", f"the archive member is unreadable ({err})", key=name
                ) from err
            if isinstance(value, dict):
                self.keras_metadata = value

    def _diagnose_member(self, what: str) -> CorruptCheckpointError:
        """Name the damaged arrays of a member that fails its zip CRC-32: its raw bytes,
        read past the zip check, are probed in a separate process."""
        try:
            raw = sandbox.raw_member(self.fh, self.zip.getinfo(self.member))
        except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as err:
            return damaged(self.where, f"{what}, and it cannot be read past it ({err})", key=self.member)
        with tempfile.TemporaryDirectory(prefix="kss-probe-") as folder:
            copy = os.path.join(folder, "member.h5")
            with open(copy, "wb") as fh:
                fh.write(raw)
            return diagnose(self.where, copy, None, what, default_key=self.member)

    def data_limit(self) -> int:
        """The length in bytes of the HDF5 image (dataset offsets count from its start,
        user block included)."""
        if self.zip is not None:
            return self._member_size
        if self.image is not None:
            return self.image.nbytes  # what was hashed and is parsed, whatever the file is now
        return len(self.data) if self.data is not None else os.fstat(self.fh.fileno()).st_size

    def close(self) -> None:
        """Close every handle and release the lock; closing twice is harmless."""
        for handle in (self.shared_h5, self.h5, self.zip, self.fh):
            if handle is not None:
                with contextlib.suppress(OSError, ValueError, RuntimeError):
                    handle.close()
        self.h5 = self.zip = self.fh = self.shared_h5 = None
        self.image = self.shared_image = self._sealed_fh = None
