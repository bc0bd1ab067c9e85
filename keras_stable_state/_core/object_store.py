"""Where ``save_training_state`` and ``restore_training_state`` send an object-store URL.

The verbs call `object_store_target` right after checking ``filepath``: a
``file://`` URL becomes its local path, an object-store URL (``s3://``, ``gs://``...)
gets its `RemotePath` (the fsspec
implementation is found, or refused, before anything is collected or written), and
`write_to` writes the record: locally as always, or through
`upload_written` (a local file in a temporary
folder, uploaded whole). Reading goes through
`read_file`, which downloads a URL whole first.
"""

from __future__ import annotations

from collections.abc import Callable

from keras_stable_state import format
from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format import remote, writer

__all__ = ["object_store_target", "write_to"]

_ORBAX = ".orbax"


def object_store_target(
    filepath: str, storage_options: object, verb: str, *, write: bool = True
) -> tuple[str, remote.RemotePath | None]:
    """``(filepath, store)``: ``filepath`` (a ``file://`` URL as the local path it names)
    and, for an object-store URL, its `RemotePath`
    (``None`` for a local path).

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
    filepath = remote.resolve(filepath, "filepath")
    if not remote.is_remote(filepath):
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
    return filepath, remote.RemotePath(filepath, storage_options)


def write_to(
    filepath: str,
    store: remote.RemotePath | None,
    record: format.StateRecord,
    keras_archive_writer: Callable[[str], object] | None = None,
) -> int | None:
    """Write ``record`` to ``filepath`` (`write_record`),
    or, with a ``store``, to a local temporary file uploaded whole to it; the size written
    in bytes for an upload, else ``None``.

    Raises:
        The errors of ``write_record`` and of
        `put_file`.
    """
    if store is None:
        writer.write_record(filepath, record, keras_archive_writer=keras_archive_writer)
        return None
    return remote.upload_written(
        filepath,
        lambda local: writer.write_record(local, record, keras_archive_writer=keras_archive_writer),
        store=store,
    )
