"""The object-store engine: objects in ``s3://``, ``gs://``, ``az://``, ``memory://``... stores,
read and written through fsspec.

The entry points tell a URL from a local path with `keras_stable_state.format.urls`
(``is_remote``: a URL that is not ``file://``) and send it here: `target` checks a
``filepath`` for a save or a restore and connects its `RemotePath`, `write` uploads a
training state written by the file engine, `fetch` downloads one whole for the file format
to read (`keras_stable_state.format.read_bytes`).

Everything goes through fsspec (the ``[cloud]`` extra: fsspec, s3fs, gcsfs) with
fsspec's own configuration (``fsspec.config.conf``, ``FSSPEC_*`` variables) and the
store's (``AWS_ENDPOINT_URL``, credentials files...) left as they are;
``storage_options`` (a ``dict``) is passed to the filesystem as given. A scheme whose
implementation is not installed is refused with [`StorageBackendError`][keras_stable_state.StorageBackendError], naming the package to install.
The store's failures are raised in our words (`store_failures`).

What is assumed of the store: an object written whole by one upload (a ``PUT``, or a
multipart / resumable upload that is completed last) becomes visible only once complete,
and replaces the previous object at that name in one step. S3 and S3-compatible stores,
Google Cloud Storage, Azure Blob Storage (block blobs) and fsspec's ``memory://`` keep
it (`WHOLE_OBJECT_PROTOCOLS`). For any other fsspec filesystem (``sftp://``,
``hdfs://``, ``ftp://``...) a file is written under a temporary name beside its
final one and then moved (`RemotePath.put_file`), which is a rename there.
`RemotePath` is the small filesystem interface a checkpoint directory needs
(list, exists, remove, read, put whole), and `write_marker` / `read_marker`
write and read a small JSON commit marker, for directories whose checkpoints must
become visible only when complete (the marker is written after what it commits).

This module imports no Keras (the command line reads object stores through it), and
importing it loads no framework."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, cast

from keras_stable_state._engines.store_failures import store_failure, talking_to
from keras_stable_state.errors import (
    CheckpointFormatError,
    CorruptCheckpointError,
    StorageBackendError,
    StorageError,
)
from keras_stable_state.format.urls import is_remote, resolve, scheme_of

__all__ = [
    "MARKER_FORMAT",
    "WHOLE_OBJECT_PROTOCOLS",
    "RemotePath",
    "fetch",
    "read_marker",
    "store_failure",
    "talking_to",
    "target",
    "upload_written",
    "write_marker",
]

WHOLE_OBJECT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
"""fsspec protocols whose upload makes an object visible only once complete (so a file
is uploaded straight to its name: there is no rename in an object store)."""

# The package behind each scheme and where it comes from ("cloud": our [cloud] extra).
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
}
_STORES = {
    "s3": "Amazon S3 or an S3-compatible store",
    "s3a": "Amazon S3 or an S3-compatible store",
    "gs": "Google Cloud Storage",
    "gcs": "Google Cloud Storage",
    "az": "Azure Blob Storage",
    "abfs": "Azure Blob Storage",
    "abfss": "Azure Blob Storage",
    "adl": "Azure Data Lake",
}
_IN_CLOUD_EXTRA = frozenset({"fsspec", "s3fs", "gcsfs"})

MARKER_FORMAT = "keras_stable_state-marker"
"""The ``format`` field of a commit marker (`write_marker`)."""
_MARKER_VERSION = 1
_MARKER_LIMIT = 1 << 20  # a marker larger than this is refused (it is a few hundred bytes)


def _check_storage_options(storage_options: object) -> dict[str, Any]:
    if storage_options is None:
        return {}
    if not isinstance(storage_options, dict) or not all(isinstance(k, str) for k in storage_options):
        text = repr(storage_options)
        text = text if len(text) <= 100 else text[:97] + "..."
        raise TypeError(
            "`storage_options` must be a dict of keyword arguments for the fsspec filesystem "
            "(e.g. {'anon': True} or {'client_kwargs': {'endpoint_url': ...}}), or None. "
            f"Received: storage_options={text} (of type {type(storage_options).__name__})"
        )
    return dict(storage_options)


def _missing(url: str, scheme: str, package: str | None, err: BaseException) -> StorageBackendError:
    store = _STORES.get(scheme, f"a {scheme}:// store")
    if package is None or package in _IN_CLOUD_EXTRA:
        named = package or "fsspec"
        install = f'pip install "keras-stable-state[cloud]" (fsspec, s3fs, gcsfs) or pip install {named}'
    else:
        install = f'pip install "keras-stable-state[cloud]" {package}'
    reason = str(err).strip() or type(err).__name__
    return StorageBackendError(
        f"{url!r} is in {store} ({scheme}://), read and written through "
        f"{package or 'fsspec'}, which is not installed ({reason}). Nothing was read or written, "
        f"and no local folder named {scheme + ':'!r} was made. Install it: {install}.",
        path=url,
        scheme=scheme,
        package=package or "fsspec",
    )


def _connect(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    scheme = scheme_of(url) or "file"  # fsspec takes a plain path as file://
    try:
        import fsspec
        import fsspec.core
    except ImportError as err:
        raise _missing(url, scheme, "fsspec", err) from err
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        return fs, path
    except ImportError as err:
        cause = err.__cause__ if isinstance(err.__cause__, ImportError) else err
        package = getattr(cause, "name", None) or _PACKAGES.get(scheme)
        raise _missing(url, scheme, package.split(".")[0] if package else None, err) from err
    except ValueError as err:
        if "not known" not in str(err):
            raise
        raise StorageBackendError(
            f"{url!r} names the scheme {scheme}://, which no installed fsspec implementation knows "
            f"({err}). Nothing was read or written. Check the URL, or install the fsspec package "
            "for that store.",
            path=url,
            scheme=scheme,
        ) from err


_ORBAX = ".orbax"


def target(
    filepath: str, storage_options: object, verb: str, *, write: bool = True
) -> tuple[str, RemotePath | None]:
    """``(filepath, store)`` for a save or a restore: ``filepath`` (a ``file://`` URL as the
    local path it names) and, for an object-store URL, its `RemotePath` (``None`` for a
    local path), connected before anything is collected, written or read.

    Args:
        filepath: The ``filepath`` argument, as a ``str``.
        storage_options: The ``storage_options`` argument.
        verb: The caller, for messages.
        write: ``True`` for a save: the URL must end in ``.h5`` or ``.keras``.

    Raises:
        CheckpointFormatError: for ``storage_options`` with a local path, a ``.orbax``
            URL, a save URL of another extension, or a ``file://`` URL on another host.
        StorageBackendError: if fsspec or the scheme's implementation is not installed.
        TypeError: if ``storage_options`` is not a ``dict`` (or ``None``).
    """
    filepath = resolve(filepath, "filepath")
    if not is_remote(filepath):
        if storage_options is not None:
            raise CheckpointFormatError(
                f"`storage_options` of {verb} are options of an object store's fsspec filesystem, "
                f"but {filepath!r} is a local path. Leave `storage_options` out, or pass the object's "
                "URL (s3://bucket/run.h5, gs://...).",
                expected="an object-store URL",
                received=filepath,
            )
        return filepath, None
    if filepath.rstrip("/").endswith(_ORBAX):
        raise CheckpointFormatError(
            f"{filepath!r} is a '{_ORBAX}' training state in an object store, which {verb} does not "
            "support yet (a '.orbax' directory is written by Orbax, one folder per process). Save to a "
            "local or shared-filesystem '.orbax' path, or to a '.h5' / '.keras' object.",
            expected="a '.h5' or '.keras' object, or a local '.orbax' path",
            received=filepath,
        )
    if write and not filepath.endswith((".keras", ".h5")):
        raise CheckpointFormatError(
            f"Unsupported training-state path {filepath!r}: use a '.keras' or '.h5' extension.",
            received=filepath,
        )
    return filepath, RemotePath(filepath, cast("Mapping[str, Any] | None", storage_options))  # checked there


def fetch(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole object at ``url``, read once (for the file format to read:
    `keras_stable_state.format.read_bytes`, naming the URL in its messages).

    Raises:
        The errors of `RemotePath` and of `RemotePath.read_bytes`.
    """
    return RemotePath(url, storage_options).read_bytes()


class RemotePath:
    """An object, or a folder of objects, in a store reached through fsspec.

    Args:
        url: The object's or folder's URL (``"s3://bucket/run.h5"``, ``"gs://bucket/ckpts"``).
        storage_options: ``dict`` passed to the fsspec filesystem as keyword arguments
            (credentials, ``client_kwargs``...), or ``None``; fsspec's configuration
            and the store's environment variables apply as fsspec applies them.

    Attributes:
        url: The URL (a folder's without a trailing ``/``).
        fs: The fsspec filesystem.
        path: The filesystem's path of the object (``"bucket/run.h5"``).

    Raises:
        StorageBackendError: if fsspec or the scheme's implementation is not installed
            (naming the package), or no fsspec implementation knows the scheme.
        TypeError: if ``storage_options`` is not a ``dict`` with ``str`` keys (or ``None``).
        The errors of the fsspec filesystem for options it refuses.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        _fs: Any = None,
        _path: str | None = None,
    ) -> None:
        self.url = url.rstrip("/") if not url.endswith("://") else url
        self.storage_options = _check_storage_options(storage_options)
        if _fs is None:
            _fs, _path = _connect(self.url, self.storage_options)
        self.fs = _fs  # an fsspec filesystem
        assert _path is not None  # given with _fs, or from _connect
        self.path: str = _path
        self.protocol = scheme_of(self.url)

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def child(self, name: str) -> RemotePath:
        """The object ``name`` in this folder (the same filesystem and options)."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"An object name in {self.url!r} must be one path part. Received: {name!r}")
        return RemotePath(
            f"{self.url}/{name}", self.storage_options, _fs=self.fs, _path=f"{self.path.rstrip('/')}/{name}"
        )

    def _not_found(self, err: BaseException | None = None) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, f"No object at {self.url!r}.", self.url)

    def exists(self) -> bool:
        """Whether an object (or a folder holding objects) is at this URL now (not a cached listing).

        Raises:
            StorageError: naming the URL when the store fails.
        """
        self.fs.invalidate_cache(self.path)
        with talking_to(self.url, "look up"):
            return bool(self.fs.exists(self.path))

    def is_object(self) -> bool:
        """Whether an object (not a folder) is at this URL now.

        Raises:
            StorageError: naming the URL when the store fails.
        """
        self.fs.invalidate_cache(self.path)
        with talking_to(self.url, "look up"):
            return bool(self.fs.isfile(self.path))

    def size(self) -> int:
        """The object's size in bytes.

        Raises:
            FileNotFoundError: naming the URL if there is no object.
            StorageError: naming the URL when the store fails.
        """
        self.fs.invalidate_cache(self.path)
        try:
            with talking_to(self.url, "look up the size of", keep=(FileNotFoundError,)):
                return int(self.fs.size(self.path))
        except FileNotFoundError as err:
            raise self._not_found() from err

    def entries(self) -> list[dict[str, Any]]:
        """fsspec's detailed listing of this folder (``[]`` for none), listed now.

        Raises:
            StorageError: naming the URL when the store fails.
        """
        self.fs.invalidate_cache(self.path)
        try:
            with talking_to(self.url, "list", keep=(FileNotFoundError,)):
                return list(self.fs.ls(self.path, detail=True))
        except FileNotFoundError:
            return []

    def list(self) -> list[str]:
        """The names of the objects directly in this folder, sorted (``[]`` for none: an
        object store has no empty folders); folders inside it are not listed.

        Raises:
            StorageError: naming the URL when the store fails.
        """
        names = []
        for entry in self.entries():
            if entry.get("type") != "file":
                continue
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            if name:
                names.append(name)
        return sorted(names)

    def remove(self, missing_ok: bool = True) -> None:
        """Remove the object.

        Raises:
            FileNotFoundError: naming the URL, if there is none and not ``missing_ok``
                (S3 itself deletes a missing key without an error: it is looked up first).
            StorageError: naming the URL when the store fails.
        """
        if not missing_ok and not self.is_object():
            raise self._not_found()
        try:
            with talking_to(self.url, "remove", keep=(FileNotFoundError,)):
                self.fs.rm_file(self.path)
        except FileNotFoundError as err:
            if not missing_ok:
                raise self._not_found() from err
        finally:
            self.fs.invalidate_cache(self.path)

    def read_bytes(self) -> bytes:
        """The whole object, read once.

        Raises:
            FileNotFoundError: naming the URL if there is no object.
            CheckpointFormatError: if the URL is a folder of objects, not one object.
            StorageError: naming the URL when the store fails (a
                `StoragePermissionError` for refused credentials), the store library's
                exception as its ``__cause__``.
        """
        self.fs.invalidate_cache(self.path)
        try:
            return bytes(self.fs.cat_file(self.path))
        except (FileNotFoundError, IsADirectoryError) as err:
            if self._is_folder():
                raise self._folder_error() from err
            raise FileNotFoundError(
                errno.ENOENT, f"No training-state object at {self.url!r}.", self.url
            ) from err
        except Exception as err:  # the store's own errors (refused credentials...)
            if self._is_folder():  # s3fs refuses to read a bucket's root (ParamValidationError)
                raise self._folder_error() from err
            failure = store_failure(err, self.url, "read")
            if failure is None:
                raise
            raise failure from err

    def _is_folder(self) -> bool:
        try:
            return bool(self.fs.isdir(self.path))
        except Exception:  # the store failing again: the caller reports the first failure
            return False

    def _folder_error(self) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.url!r} is a folder of objects, not one training state. Pass the URL of one "
            ".keras or .h5 object (`keras-stable-state ls` lists a checkpoint directory).",
            received=self.url,
        )

    def open_read(self) -> Any:
        """The object opened for reading (``"rb"``), as a context manager.

        Raises:
            FileNotFoundError: naming the URL if there is no object.
            StorageError: naming the URL when the store fails.
        """
        self.fs.invalidate_cache(self.path)
        try:
            with talking_to(self.url, "open", keep=(FileNotFoundError,)):
                return self.fs.open(self.path, "rb")
        except FileNotFoundError as err:
            raise self._not_found() from err

    def _upload_advice(self) -> str:
        return (
            "The object that was there, if any, is unchanged (an object appears only once its upload "
            "completes). Check the store (its endpoint, the network, the bucket), then save again."
        )

    def put_file(self, local_path: str) -> None:
        """Upload the local file ``local_path`` as this object, whole.

        In a store of `WHOLE_OBJECT_PROTOCOLS` the upload goes to the object's name
        (visible only once complete); elsewhere to a temporary name beside it, then moved
        onto it. An interrupted upload leaves the previous object as it was.

        Raises:
            StorageError: naming the URL when the upload fails (no connection, a timeout, an
                HTTP 5xx, a missing bucket...; a `StoragePermissionError` for refused or
                missing credentials), the store library's exception as its ``__cause__``.
        """
        target = self.path if self.protocol in WHOLE_OBJECT_PROTOCOLS else self._temporary_path()
        try:
            with talking_to(self.url, "upload the training state to", self._upload_advice()):
                self.fs.put_file(local_path, target)
                if target != self.path:
                    self.fs.mv(target, self.path)
        except StorageError:
            if target != self.path:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(target)
            raise
        finally:
            self.fs.invalidate_cache(self.path)

    def put_bytes(self, data: bytes) -> None:
        """Write ``data`` as this object, whole (as `put_file`).

        Raises:
            StorageError: naming the URL when the upload fails.
        """
        if self.protocol in WHOLE_OBJECT_PROTOCOLS:
            try:
                with talking_to(self.url, "upload", self._upload_advice()):
                    self.fs.pipe_file(self.path, bytes(data))
            finally:
                self.fs.invalidate_cache(self.path)
            return
        with tempfile.TemporaryDirectory(prefix="kss-upload-") as folder:
            local = os.path.join(folder, "object")
            with open(local, "wb") as fh:
                fh.write(data)
            self.put_file(local)

    def _temporary_path(self) -> str:
        folder, _, name = self.path.rstrip("/").rpartition("/")
        return (
            f"{folder}/.kss-{secrets.token_hex(6)}-{name}"
            if folder
            else f".kss-{secrets.token_hex(6)}-{name}"
        )


def upload_written(
    url: str,
    write_local: Callable[[str], object],
    storage_options: Mapping[str, Any] | None = None,
    *,
    store: RemotePath | None = None,
) -> int:
    """Write a file locally with ``write_local(path)`` (in a private temporary folder: the
    library's own atomic, checked write), then upload it whole to ``url``; the size
    uploaded in bytes.

    The temporary file is named like the object (its extension kept) and removed
    afterwards; a failure before the upload leaves the store untouched.

    Args:
        url: The object's URL.
        write_local: Called with the local path to write.
        storage_options: As for `RemotePath`.
        store: The `RemotePath` of ``url`` made already, if any.

    Raises:
        The errors of ``write_local`` and of `RemotePath.put_file`.
    """
    store = store or RemotePath(url, storage_options)
    name = url.rstrip("/").rsplit("/", 1)[-1] or "state"
    ext = next((e for e in (".weights.h5", ".keras", ".h5") if name.endswith(e)), "")
    with tempfile.TemporaryDirectory(prefix="kss-upload-") as folder:
        local = os.path.join(folder, f"state{ext}")
        write_local(local)
        size = os.path.getsize(local)
        store.put_file(local)
    return size


def write_marker(folder: RemotePath, name: str, payload: dict[str, Any]) -> None:
    """Write the commit marker ``name`` in ``folder``: one small JSON object holding
    ``payload`` (a JSON-serializable ``dict``), written whole.

    Write it after every object it commits is complete; a reader that requires the
    marker (`read_marker`) then never takes an incomplete checkpoint.

    Raises:
        TypeError: if ``payload`` is not a ``dict`` or not JSON-serializable.
        StorageError: naming the marker's URL when the write fails.
    """
    if not isinstance(payload, dict):
        raise TypeError(f"A commit marker's payload must be a dict. Received: {type(payload).__name__}")
    document = {"format": MARKER_FORMAT, "version": _MARKER_VERSION, "payload": payload}
    folder.child(name).put_bytes(json.dumps(document, sort_keys=True, allow_nan=False).encode("utf-8"))


def read_marker(folder: RemotePath, name: str) -> dict[str, Any] | None:
    """The payload of the commit marker ``name`` in ``folder``, or ``None`` if there is none.

    Raises:
        CorruptCheckpointError: naming the marker if it is not a commit marker
            `write_marker` wrote (not JSON, another format or version, too large).
        StorageError: naming the marker's URL when the store fails.
    """
    marker = folder.child(name)
    try:
        data = marker.read_bytes()
    except FileNotFoundError:
        return None
    problem = None
    if len(data) > _MARKER_LIMIT:
        problem = f"it is {len(data)} bytes, more than a marker's {_MARKER_LIMIT}"
    else:
        try:
            document = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            document, problem = None, f"it is not JSON ({err})"
        if problem is None and not (
            isinstance(document, dict)
            and document.get("format") == MARKER_FORMAT
            and isinstance(document.get("payload"), dict)
        ):
            problem = f"it is not a {MARKER_FORMAT} document"
        elif problem is None and document.get("version") != _MARKER_VERSION:
            problem = f"its version {document.get('version')!r} is not {_MARKER_VERSION}"
    if problem is not None:
        raise CorruptCheckpointError(
            f"The commit marker {marker.url!r} is damaged: {problem}. The checkpoint it commits is "
            "not taken; remove the marker (and its checkpoint) or write it again.",
            key=name,
        )
    payload: dict[str, Any] = document["payload"]  # checked: a dict
    return payload
