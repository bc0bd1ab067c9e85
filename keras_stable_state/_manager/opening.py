"""Which directory a manager writes: `open_directory` gives a local folder's path and the
module that reads and writes it (`directory`), or an object-store URL and its
`RemoteDirectory`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from keras_stable_state._manager import directory as local
from keras_stable_state._manager.remote_directory import RemoteDirectory
from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format import remote
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
    directory: str | bytes | os.PathLike[str], storage_options: Mapping[str, Any] | None, writer: str
) -> tuple[str, ModuleType | RemoteDirectory]:
    """``(directory, files)`` of a manager: ``directory`` as a ``str`` (a ``file://`` URL
    as the local path it names) and what reads and writes it: the module
    `directory` for a local folder, a
    `RemoteDirectory` for an object-store URL.

    Raises:
        TypeError: if ``directory`` is not a ``str``, ``bytes`` or ``os.PathLike``, or
            ``storage_options`` not a ``dict`` (or ``None``).
        CheckpointFormatError: for ``storage_options`` with a local directory, or a
            ``file://`` URL on another host.
        StorageBackendError: if fsspec or the scheme's implementation is not installed.
    """
    directory = remote.resolve(fs_path(directory, "directory", urls=True), "directory")
    if remote.is_remote(directory):
        files = RemoteDirectory(directory, storage_options)
        return files.url, files
    refuse_options(storage_options, directory, writer)
    return fs_path(directory, "directory"), local
