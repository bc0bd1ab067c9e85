"""Which directory a manager writes: `open_directory` gives a local folder's path and its
`LocalDirectory`, or an object-store URL and its `RemoteDirectory` (both a
`.protocols.CheckpointDirectory`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from keras_stable_state._manager.directory import LocalDirectory
from keras_stable_state._manager.protocols import CheckpointDirectory
from keras_stable_state._manager.remote_directory import RemoteDirectory
from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format import urls
from keras_stable_state.format.files import fs_path

__all__ = ["open_directory", "refuse_options"]


def refuse_options(storage_options: object, directory: str, writer: str) -> None:
    """Refuse ``storage_options`` given with a local ``directory``.

    Raises:
        CheckpointFormatError: naming the directory.
    """
    if storage_options is not None:
        raise CheckpointFormatError(
            f"`storage_options` of {writer} are options of an object store's fsspec filesystem, but "
            f"{directory!r} is a local path. Leave `storage_options` out, or pass the directory's URL "
            "(s3://bucket/run, gs://...).",
            expected="an object-store URL",
            received=directory,
        )


def open_directory(
    directory: str | bytes | os.PathLike[str],
    storage_options: Mapping[str, Any] | None,
    writer: str,
    backend: str | None = None,
) -> tuple[str, CheckpointDirectory]:
    """``(directory, files)`` of a manager: ``directory`` as a ``str`` (a ``file://`` URL
    as the local path it names) and what reads and writes it: a `LocalDirectory` for a
    local folder, a `RemoteDirectory` for an object-store URL (``backend``: the writer's
    Keras backend, recorded in its commit markers).

    Raises:
        TypeError: if ``directory`` is not a ``str``, ``bytes`` or ``os.PathLike``, or
            ``storage_options`` not a ``dict`` (or ``None``).
        CheckpointFormatError: for ``storage_options`` with a local directory, or a
            ``file://`` URL on another host.
        StorageBackendError: if fsspec or the scheme's implementation is not installed.
    """
    directory = urls.resolve(fs_path(directory, "directory", urls=True), "directory")
    if urls.is_remote(directory):
        store = RemoteDirectory(directory, storage_options, backend=backend)
        return store.url, store
    refuse_options(storage_options, directory, writer)
    path = fs_path(directory, "directory")
    return path, LocalDirectory(path)
