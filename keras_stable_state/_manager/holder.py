"""The lock a [`CheckpointManager`][keras_stable_state.CheckpointManager] holds over its directory:
taking it (with several processes, process 0 alone takes it and cleans up), releasing
it, and the context manager."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from keras_stable_state import _processes
from keras_stable_state._manager import shared
from keras_stable_state._manager.protocols import CheckpointDirectory, WriterLock

if TYPE_CHECKING:
    from typing_extensions import Self


class DirectoryHolder:
    """The lock part of [`CheckpointManager`][keras_stable_state.CheckpointManager], which sets what it
    uses: ``directory``, ``files`` (its `.protocols.CheckpointDirectory`), ``name``,
    ``removed_temporary_files``, ``_token``, ``_lock``, ``_finalizer``, ``_say`` and ``wait``.
    """

    directory: str
    files: CheckpointDirectory
    name: str
    removed_temporary_files: list[str]
    _token: int
    _lock: WriterLock | shared.Follower | None
    _finalizer: weakref.finalize[..., Any] | None
    _say: Callable[[str], None]
    wait: Callable[[], None]

    @_processes.torch_ranks(collective=False)
    def lock(self, *, reclaimable: bool = False) -> list[str]:
        """Create the directory, take its lock, remove the ``.kss-*`` temporary files a killed
        save left; their paths. ``reclaimable=True`` (``StableCheckpoint``'s) lets a
        ``StableCheckpoint`` of the same thread take the lock over (its ``fit`` raised).

        With several processes process 0 alone takes the lock and cleans up: JAX processes
        wait for it (a collective); Torch ranks (``torch.distributed``) do not (no collective:
        the others return ``[]``), but inside a save, which runs it as a collective.

        Raises:
            CheckpointInUseError: if another writer (a ``CheckpointManager`` or
                ``StableCheckpoint``, in this process or another) holds the directory,
                naming its pid and host.
            NotADirectoryError: if ``directory`` is a file.
            StateError: if the lock file (or its marker) is a symbolic link, a hard link
                of another file or not a regular file, if ``KSS_DIRECTORY_LOCK`` is not valid here, or in a
                store without exclusive writes.
            OSError: if the directory or its lock file (object) cannot be created or locked (read-only
                file system: ``errno.EROFS``; permissions; no bucket, refused credentials), naming it.
        """
        with _processes.on_primary(self.directory, share=True) as turn:
            if turn.runs:
                turn.result = self._lock_here(reclaimable)
            elif turn.alone:
                turn.result = []
        removed: list[str] = turn.result
        self._lock, self.removed_temporary_files = shared.held(self._lock, self._token), removed
        return removed

    def lock_everywhere(self) -> None:
        """`lock` as a collective of a save's check-in that found a process without the lock,
        where process 0 may hold it already (then it keeps it as it is)."""
        with _processes.on_primary(self.directory, share=True) as turn:
            if turn.runs:
                turn.result = self.removed_temporary_files if self.locked else self._lock_here(False)
        removed: list[str] = turn.result
        self._lock, self.removed_temporary_files = shared.held(self._lock, self._token), removed

    def _lock_here(self, reclaimable: bool) -> list[str]:
        self.files.prepare(self.name)
        self._lock = self.files.acquire_lock(self._token, writer=self.name, reclaimable=reclaimable)
        if self._finalizer is None:  # released when the manager is garbage collected or the process exits
            self._finalizer = weakref.finalize(self, self.files.release_token, self._token)
        self.removed_temporary_files = self.files.remove_temporary_files()
        if self.removed_temporary_files:
            self._say(
                f"removed {len(self.removed_temporary_files)} temporary file(s) of an interrupted save: "
                f"{self.removed_temporary_files}"
            )
        return self.removed_temporary_files

    @property
    def locked(self) -> bool:
        """Whether this manager holds its directory's lock."""
        lock = self._lock
        return lock is not None and lock.held and lock.token == self._token

    def _ensure_locked(self) -> None:
        if not self.locked:
            self.lock()

    def release(self) -> None:
        """Release the lock now, without waiting for a background save (see `close`)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(self._token)

    def close(self) -> None:
        """Wait for the background save in flight (raising its error), then release the lock."""
        try:
            self.wait()
        finally:
            self.release()

    def __enter__(self) -> Self:
        self._ensure_locked()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        # the block's own error is the one raised; an error of closing is told in it
        for failed, step in (("the background save failed as well", self.wait),
                             ("releasing the directory's lock failed as well", self.release)):  # fmt: skip
            try:
                step()
            except Exception as err:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"{self.name}: {failed}: {err!r}")
                elif exc.__cause__ is None:
                    exc.__cause__ = err
