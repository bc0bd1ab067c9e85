"""The two shapes a [`CheckpointManager`][keras_stable_state.CheckpointManager] works through,
whatever holds its checkpoints: `CheckpointDirectory`, what reads and writes the directory
(`.directory.LocalDirectory` for a local folder, `.remote_directory.RemoteDirectory` for an
object store), and `WriterLock`, the lock its one writer holds (`.lock.DirectoryLock`, the
lock file of a local folder; `.remote_directory.RemoteLock`, the lock object of a store).

Typing only: no Keras, no I/O."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckpointDirectory", "WriterLock"]

# (metadata, extra, format version) of a checkpoint, read without its arrays
Summary = tuple[dict[str, Any], dict[str, Any], "int | None"]


@runtime_checkable
class WriterLock(Protocol):
    """The lock of a checkpoint directory, held by one writer (a ``CheckpointManager``, or
    the one a ``StableCheckpoint`` runs over) of this process at a time.

    Attributes:
        directory: The directory locked (a path, or the store's URL).
        held: Whether the lock is held (``False`` once released, or in a forked child).
        token: The owner's token (`.lock.new_token`), or ``None`` before the first owner.
        thread: The ident of the owner's thread.
        reclaimable: Whether another owner of the same thread may take it over (a
            ``StableCheckpoint`` whose ``fit`` raised).
        writer: ``"CheckpointManager"`` or ``"StableCheckpoint"``: named to a refused writer.
    """

    directory: str
    token: int | None
    thread: int | None
    reclaimable: bool
    writer: str

    @property
    def held(self) -> bool: ...

    def release(self, token: int) -> None:
        """Release the lock if ``token`` owns it (else do nothing)."""


@runtime_checkable
class CheckpointDirectory(Protocol):
    """What reads and writes one checkpoint directory for a manager: every access to the
    directory (list, exists, stat, remove, move, lock) goes through one of these.

    Attributes:
        storage_options: The fsspec options of every save and restore in it (``None`` for a
            local folder, and for a store without options).
        local: ``True`` for a folder of this machine's file system (a checkpoint may be
            read in place, its large arrays left in the open file; ``.orbax`` step
            directories), ``False`` for an object store (each object read whole through
            its filesystem).
    """

    storage_options: dict[str, Any] | None
    local: bool

    def checkpoints(self) -> list[str]:
        """Paths (URLs) of the checkpoints in the directory, newest first (listed now)."""

    def exists(self, path: str) -> bool:
        """Whether the checkpoint ``path`` is in the directory."""

    def identity(self, path: str) -> Hashable | None:
        """What tells one written checkpoint at ``path`` from another, or ``None`` if none is
        there: a cache key for what was read from it."""

    def read_summary(self, path: str) -> Summary:
        """``(metadata, extra, format version)`` of ``path``, its arrays neither read nor decoded."""

    def size_of(self, path: str) -> int:
        """Size in bytes of the checkpoint ``path``."""

    def prepare(self, writer: str) -> None:
        """Make the directory ready to be locked and written (or refuse it)."""

    def acquire_lock(self, token: int, *, writer: str, reclaimable: bool) -> WriterLock:
        """Take the directory's lock for the owner of ``token``; the held lock."""

    def release_token(self, token: int) -> None:
        """Release the lock the owner of ``token`` holds, if any (a finalizer's call)."""

    def remove_temporary_files(self) -> list[str]:
        """Remove what a killed save left (called holding the lock); the paths removed."""

    def begin_save(self, path: str) -> None:
        """Before the checkpoint ``path`` is written."""

    def commit(self, path: str, step: int, info: dict[str, Any]) -> None:
        """Once the checkpoint ``path`` of ``step`` is written (``info``: the manager's record)."""

    def remove(self, paths: Sequence[str]) -> None:
        """Remove the checkpoints ``paths``; one removed meanwhile is skipped."""

    def move_aside(self, path: str, writer: str, folder: str = ...) -> str | None:
        """Move the checkpoint ``path`` into the subfolder ``folder`` (``unreadable/`` by
        default); its new path, or ``None`` if it was removed meanwhile."""
