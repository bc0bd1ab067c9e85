"""A [`CheckpointManager`][keras_stable_state.CheckpointManager] directory in an object store
(``s3://``, ``gs://``, ``az://``, ``memory://``...) reached through fsspec.

An object store has no atomic rename and no ``flock``, so a checkpoint is made visible
by a commit marker instead, and the one-writer rule by a lock object:

* **Checkpoints and markers.** Each checkpoint ``ckpt-<step:010d>.h5`` is written locally,
  then uploaded whole (`upload_written`: the
  object appears only once its upload completes); then its commit marker
  ``ckpt-<step:010d>.h5.commit`` (`MARKER_SUFFIX`) is written: a small JSON object
  holding the object's size and ETag and the manager's record (step, epoch, metrics,
  wall time), the writer's backend and format version. A checkpoint **is** in the
  directory only when its marker is there and names the object's current size (and
  ETag, where the store gives one): `RemoteDirectory.checkpoints` lists those
  alone, so ``latest_step()``, ``all_steps()`` and ``restore(step="latest")`` never pick
  an object whose upload was interrupted, nor one replaced behind the marker's back.
  Saving a step that is already there removes its marker first. Pruning removes the
  marker first, then the object, so a half-removed checkpoint is never listed.
  The step, epoch and metrics of ``metadata()``, ``best_step()``, ``all_steps()`` and
  pruning come from each object's sealed record, read once per ``(size, ETag)`` its
  marker names (the marker's copy of the record is never taken for it: an edited marker
  changes nothing).
* **Left-overs.** When the lock is taken (so no other writer can be saving), objects a
  killed writer left are cleaned up: a checkpoint object without a marker (its upload
  or its marker was interrupted) and a ``.kss-*`` temporary object are removed; a marker
  without its object (an interrupted prune) is removed; a checkpoint whose marker is
  damaged or names another object is moved aside into ``unreadable/`` with its marker
  (it may be a good checkpoint with a bad marker: it is kept, never listed).
* **Unreadable checkpoints** (a committed object that fails its checks) are copied into
  ``<directory>/unreadable/`` (``<name>.<n>`` if taken), then their marker and object are
  removed: the copy and delete of an object store, in place of a rename.
* **The lock** is the object ``.stable-checkpoint.lock``, created with an exclusive
  (conditional, ``If-None-Match: *``) write where the filesystem offers one (fsspec's
  ``pipe_file(mode="create")``: s3fs on S3 and S3-compatible stores, gcsfs, ``memory://``);
  a filesystem that refuses that write mode is refused (no lock is pretended). It holds
  the writer's kind, pid and host and a random nonce, and is removed on release (only
  if it is still this writer's). Nothing releases the lock of a process that died: a
  lock whose holder is on this host and no longer runs is taken over; one held by
  another host is refused with [`CheckpointInUseError`][keras_stable_state.CheckpointInUseError]
  naming it and the lock object to remove once that writer is known to be gone. What
  is assumed: one writer per directory, which the lock enforces among writers that use
  it (a writer that ignores it, or a store that does not honour the conditional write,
  is not stopped).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import secrets
import socket
import threading
import time
from typing import Any

from keras_stable_state import format
from keras_stable_state._engines import object_store
from keras_stable_state._manager import lock
from keras_stable_state._manager.directory import LOCK_NAME, TEMP_PREFIX, UNREADABLE_DIR, step_of
from keras_stable_state.errors import (
    CheckpointInUseError,
    CorruptCheckpointError,
    StateError,
    StorageError,
)

__all__ = ["MARKER_SUFFIX", "RemoteDirectory", "RemoteLock"]

MARKER_SUFFIX = ".commit"
"""The suffix of a checkpoint's commit marker (``ckpt-<step:010d>.h5.commit``)."""
_MARKER = re.compile(r"^(ckpt-\d{10}\.h5)\.commit$")

_HELD = {}  # lock object URL -> RemoteLock held by this process
_HELD_GUARD = threading.Lock()
_GONE = object()  # the lock object was removed while it was being read
_LEFT = {}  # lock object URL -> nonce of a lock of this process whose release failed (left in the store)
_RELEASE_TRIES = (0.2, 1.0, None)  # the pause after each failed try to remove a lock object


def _float_out(value):
    return value if not isinstance(value, float) or math.isfinite(value) else repr(value)


def _encode(info: dict) -> dict:
    """The manager's record as JSON (a non-finite metric as ``"nan"``, ``"inf"``, ``"-inf"``)."""
    metrics = {k: _float_out(v) for k, v in (info.get("metrics") or {}).items()}
    return {**info, "metrics": metrics}


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id: never taken for a dead holder
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RemoteLock:
    """The lock object of an object-store directory, held by one writer of this process (a
    `.protocols.WriterLock`, as a local directory's `DirectoryLock` is).

    Attributes:
        url: The lock object's URL.
        held: Whether the lock is held (``False`` once released, or in a forked child).
        directory, token, thread, reclaimable, writer: As for ``DirectoryLock``.
    """

    def __init__(self, store, directory, nonce):
        self.store = store
        self.url = store.url
        self.directory = directory
        self.nonce = nonce
        self.held = True
        self.pid = os.getpid()
        self.token = None
        self.thread = None
        self.reclaimable = False
        self.writer = "StableCheckpoint"

    def release(self, token) -> None:
        """Remove the lock object if ``token`` owns the lock and it is still this writer's.

        The lock is released in this process whatever the store does: a removal the store
        fails is tried again (three times in all); if it still fails, the lock object is
        left in the store, remembered as this process's own, and taken over by the next
        lock of this directory in this process (no writer of this process is locked out by
        it). Another process is refused by it until it is removed.

        Raises:
            StorageError: naming the lock object, when the store failed every try (the lock
                is released in this process all the same).
        """
        with _HELD_GUARD:
            if not self.held or self.token != token:
                return
            self.held = False
            if _HELD.get(self.url) is self:
                del _HELD[self.url]
            if self.pid != os.getpid():
                return  # a forked child never removes its parent's lock
            _LEFT[self.url] = self.nonce  # until it is removed: this process's own, to take over
            for pause in _RELEASE_TRIES:
                try:
                    self._remove_if_ours()
                    _LEFT.pop(self.url, None)
                    return
                except StorageError as err:
                    if pause is None:
                        cause = err.__cause__ or err
                        advice = (
                            f"The checkpoint directory {self.directory!r} is released in this process all "
                            f"the same (tried {len(_RELEASE_TRIES)} times); its lock object is left in the "
                            "store: the next lock of this directory in this process takes it over, and "
                            "another process is refused by it until it is removed. Once the store answers, "
                            "remove that object unless a writer of this process locks the directory again."
                        )
                        raise (
                            object_store.store_failure(cause, self.url, "release the lock object", advice)
                            or err
                        ) from cause
                    time.sleep(pause)

    def _remove_if_ours(self) -> None:
        try:
            info = json.loads(self.store.read_bytes().decode("utf-8"))
        except (FileNotFoundError, ValueError):
            return  # removed, or replaced by something not ours: not ours to remove
        if isinstance(info, dict) and info.get("nonce") == self.nonce:
            self.store.remove()


def _forget_locks_in_child():
    global _HELD_GUARD
    _HELD_GUARD = threading.Lock()
    for owned in list(_HELD.values()):
        owned.held = False
    _HELD.clear()
    _LEFT.clear()  # the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


@dataclasses.dataclass(frozen=True)
class Survey:
    """What `survey` found in a folder, by object URL: ``sizes`` in bytes of every object;
    ``committed`` checkpoints (their marker matches), newest first; ``damaged`` ``[(url,
    reason)]`` (a marker that does not match or cannot be read); ``incomplete`` objects of a
    save that did not finish (temporary, or without a marker)."""

    sizes: dict[str, int]
    committed: list[str]
    damaged: list[tuple[str, str]]
    incomplete: list[str]


class RemoteDirectory:
    """The directory of a manager in an object store: the `.protocols.CheckpointDirectory`
    that `.directory.LocalDirectory` is for a local folder, with the same methods (see the
    module docstring for the markers, the lock and the clean-up).

    Args:
        url: The directory's URL (``"s3://bucket/run"``).
        storage_options: ``dict`` for the fsspec filesystem, or ``None``.
        backend: The writer's Keras backend, recorded in each commit marker; ``None`` for a
            reader without Keras (the command line).

    Raises:
        StorageBackendError: if fsspec or the scheme's implementation is not installed,
            naming the package to install (nothing is read or written).
        TypeError: if ``storage_options`` is not a ``dict`` (or ``None``).
    """

    local = False
    """An object store: each checkpoint is read whole through its filesystem."""

    def __init__(self, url: str, storage_options=None, *, backend: str | None = None):
        self.folder = object_store.RemotePath(url, storage_options)
        self.url = self.folder.url
        self.storage_options = self.folder.storage_options or None
        self.backend = backend
        self._markers = {}  # marker name -> ((size, etag) of the marker, payload or the error)
        self._committed = {}  # checkpoint URL -> its marker's payload, from the last listing

    # -- listing ------------------------------------------------------------------------
    def _entries(self) -> dict:
        """``{name: (size, etag)}`` of the objects directly in the folder, listed now.

        Raises:
            StorageError: naming the directory when the store fails.
        """
        found = {}
        for entry in self.folder.entries():
            name = str(entry.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "file" and name:
                found[name] = (int(entry.get("size") or 0), entry.get("ETag") or entry.get("etag"))
        return found

    def _marker(self, name, key):
        """The payload of marker ``name`` (listed with ``key``), or the error reading it."""
        cached = self._markers.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            payload = object_store.read_marker(self.folder, name)
        except CorruptCheckpointError as err:
            payload = err
        if payload is None:
            payload = FileNotFoundError(f"{name} was removed since it was listed")
        self._markers[name] = (key, payload)
        return payload

    def _sort(
        self, entries: dict[str, tuple[int, str | None]]
    ) -> tuple[dict[str, Any], list[str], list[tuple[str, str]], list[str], list[str]]:
        """``(committed {name: payload}, no marker [names], bad marker [(name, reason)],
        orphan markers [names], temporary [names])``."""
        committed: dict[str, Any] = {}
        bare: list[str] = []
        bad: list[tuple[str, str]] = []
        orphans: list[str] = []
        for name, (size, etag) in entries.items():
            if step_of(name) is None:
                continue
            marker = name + MARKER_SUFFIX
            if marker not in entries:
                bare.append(name)
                continue
            payload = self._marker(marker, entries[marker])
            if isinstance(payload, FileNotFoundError):
                bare.append(name)
            elif isinstance(payload, Exception):
                bad.append((name, str(payload)))
            elif payload.get("size") != size or (etag and payload.get("etag") and payload["etag"] != etag):
                bad.append((name, f"its marker names an object of {payload.get('size')} bytes, ETag "
                            f"{payload.get('etag')}; the object is {size} bytes, ETag {etag}"))  # fmt: skip
            else:
                committed[name] = payload
        for name in entries:
            found = _MARKER.match(name)
            if found and found.group(1) not in entries:
                orphans.append(name)
        temporary = [n for n in entries if n.startswith(TEMP_PREFIX)]
        return committed, bare, bad, orphans, temporary

    def __repr__(self) -> str:
        return f"RemoteDirectory({self.url!r})"

    def checkpoints(self) -> list:
        """URLs of the committed checkpoints, newest first (listed now)."""
        committed = self._sort(self._entries())[0]
        self._committed = {self._url(n): p for n, p in committed.items()}
        return sorted(self._committed, reverse=True)

    def _url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _name(self, path):
        return str(path).rstrip("/").rsplit("/", 1)[-1]

    def exists(self, path) -> bool:
        """Whether the checkpoint ``path`` is committed (listed now)."""
        return path in self.checkpoints()

    def _payload(self, path) -> dict:
        payload = self._committed.get(path)
        if payload is None and path in self.checkpoints():
            payload = self._committed.get(path)
        if payload is None:
            raise FileNotFoundError(
                errno.ENOENT, f"No committed checkpoint at {path!r} (its marker is missing).", path
            )
        return payload

    def identity(self, path):
        """The ``(size, ETag)`` the marker of ``path`` names, or ``None`` if it is not committed."""
        try:
            payload = self._payload(path)
        except FileNotFoundError:
            return None
        return (payload.get("size"), payload.get("etag"))

    def read_summary(self, path):
        """``(metadata, extra, format version)`` as `read_summary` returns them, from the sealed
        record of the object ``path`` (its seal checked; its arrays not decoded). The
        marker only says that the object is committed, and names the ``(size, ETag)`` that
        the manager caches this summary by (`identity`); what it records of the
        checkpoint is never taken for the object's own record.

        Raises:
            FileNotFoundError: if ``path`` is not committed.
            Every error of `keras_stable_state.format.open_file`.
        """
        self._payload(path)
        with format.open_file(path, storage_options=self.storage_options) as f:
            return dict(f.metadata), dict(f.extra), f.version

    def size_of(self, path) -> int:
        """Size in bytes of the object at ``path`` (``FileNotFoundError`` naming it if gone)."""
        return self.folder.child(self._name(path)).size()

    # -- the lock -----------------------------------------------------------------------
    def prepare(self, writer="StableCheckpoint") -> None:
        """Refuse a directory URL that is an object, not a folder (an object store has no
        folders to create).

        Raises:
            NotADirectoryError: if an object is at the directory's URL.
        """
        if self.folder.path and self.folder.is_object():
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"{writer}'s directory {self.url!r} is an object, not a folder of objects. Pass a "
                "folder URL (it holds ckpt-<step>.h5 objects); to save one object use "
                "keras_stable_state.save_training_state",
                self.url,
            )

    def acquire_lock(self, token, *, writer="StableCheckpoint", reclaimable=True) -> RemoteLock:
        """Take the lock object (see the module docstring); the held `RemoteLock`.

        Raises:
            CheckpointInUseError: if another writer holds it (in this process: as for a
                local directory; elsewhere: naming its pid and host and the lock object).
            StateError: if the filesystem has no exclusive write (no lock is pretended).
            StorageError: naming the lock object if the store fails to write or read it (a
                missing bucket, refused credentials, no answer). A lock object of this process
                that no writer of it holds (a release the store failed) is taken over.
        """
        store = self.folder.child(LOCK_NAME)
        with _HELD_GUARD:
            held = _HELD.get(store.url)
            if held is not None:
                lock.refuse_other_owner(held, token, self.url)
            else:
                held = RemoteLock(store, self.url, self._create_lock(store, writer))
                _HELD[store.url] = held
            held.token, held.thread = token, threading.get_ident()
            held.reclaimable, held.writer = reclaimable, writer
            return held

    def _create_lock(self, store, writer) -> str:
        nonce = secrets.token_hex(8)
        info = {
            "writer": writer,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "nonce": nonce,
        }
        data = json.dumps(info).encode("utf-8")
        holder = None
        for _ in range(3):
            try:
                with object_store.talking_to(
                    store.url,
                    "write the lock object",
                    f"The checkpoint directory {self.url!r} is not locked and nothing was saved. Check the "
                    "store (its endpoint, the network, the bucket), then run again.",
                    keep=(FileExistsError, TypeError, NotImplementedError, ValueError),
                ):
                    store.fs.pipe_file(store.path, data, mode="create")
                return nonce
            except FileExistsError:
                holder = self._holder(store)
            except (TypeError, NotImplementedError, ValueError) as err:
                raise StateError(
                    f"The checkpoint directory {self.url!r} cannot be locked: its filesystem "
                    f"({type(store.fs).__name__}) offers no exclusive write (pipe_file(mode='create'): "
                    f"{err}), and without one a second writer could not be refused. Use a local folder, "
                    "or save single objects with keras_stable_state.save_training_state.",
                    key=LOCK_NAME,
                ) from err
            finally:
                store.fs.invalidate_cache(store.path)
            if holder is _GONE:
                continue  # released since the write was refused: try again
            if holder is not None and self._own_left_over(store, holder):
                # this process's own, held by none of its writers (a release the store failed, a
                # lost answer): no other writer takes it, so it is rewritten as this writer's
                store.put_bytes(data)
                _LEFT.pop(store.url, None)
                return nonce
            if holder is None or holder.get("host") != socket.gethostname() or _alive(holder["pid"]):
                break
            store.remove()  # its holder ran on this host and is dead: the lock is stale
        holder = None if holder is _GONE else holder
        text = lock.holder_text(holder) if holder else None
        raise CheckpointInUseError(
            f"Checkpoint directory {self.url!r} is in use by another {lock.writer_of(holder)} writer "
            f"({text or 'holder unknown: the lock object names none'}); wait for it to finish or use "
            f"another directory. (The lock is the object {store.url!r}; nothing releases the lock of "
            "a writer that died on another host: once you know that writer is gone, remove that object "
            "and run again.)",
            path=self.url,
            holder=text,
        )

    @staticmethod
    def _own_left_over(store, holder) -> bool:
        """Whether the lock object ``holder`` (its JSON) is this process's and no writer of it
        holds it: a release whose removal the store failed (`_LEFT`), or a create whose answer
        was lost (the store wrote it, the client saw an error). Called under ``_HELD_GUARD``."""
        if store.url in _HELD:
            return False
        if _LEFT.get(store.url) is not None and holder.get("nonce") == _LEFT[store.url]:
            return True
        return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()

    def _holder(self, store):
        try:
            info = json.loads(store.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            return _GONE  # removed meanwhile: try again
        except ValueError:
            return None
        ok = isinstance(info, dict) and isinstance(info.get("pid"), int)
        return info if ok else None

    def release_token(self, token) -> None:
        """Release every lock of this process that ``token`` owns: the manager's finalizer
        (garbage collection, the end of the process). A store that cannot be reached then
        keeps the lock object (the next writer of this host takes it over; another host's
        is told to remove it): an error at the end of a process has no caller to go to."""
        for held in list(_HELD.values()):
            try:
                held.release(token)
            except Exception:  # the store's errors (no connection at exit...): see above
                continue

    def remove_temporary_files(self) -> list:
        """Clean up what a killed writer left (see the module docstring); the URLs removed
        or moved aside. Call it holding the lock."""
        entries = self._entries()
        _, bare, bad, orphans, temporary = self._sort(entries)
        done = []
        for name in [*temporary, *bare, *orphans]:
            self.folder.child(name).remove()
            done.append(self._url(name))
        for name, _ in bad:
            self.move_aside(self._url(name))
            done.append(self._url(name))
        return done

    # -- saving and removing ------------------------------------------------------------
    def begin_save(self, path) -> None:
        """Remove the marker of ``path``'s step, if any: the checkpoint being replaced is
        not in the directory until its new marker is written."""
        self._forget(path)
        self.folder.child(self._name(path) + MARKER_SUFFIX).remove()

    def _forget(self, path) -> None:
        # A marker read is cached by its listed (size, ETag); a store without ETags
        # (memory://) could list a rewritten marker of the same size as the old one.
        self._committed.pop(path, None)
        self._markers.pop(self._name(path) + MARKER_SUFFIX, None)

    def commit(self, path, step, info) -> None:
        """Write the marker of the uploaded checkpoint ``path`` (``info``: the manager's record).

        Raises:
            FileNotFoundError: if the object is not there.
            StorageError: naming the object or the marker when the store fails.
        """
        name = self._name(path)
        obj = self.folder.child(name)
        obj.fs.invalidate_cache(obj.path)
        try:
            with object_store.talking_to(
                obj.url, "look up the checkpoint just uploaded", keep=(FileNotFoundError,)
            ):
                found = obj.fs.info(obj.path)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                errno.ENOENT, f"The checkpoint {path!r} just saved is not in the store.", path
            ) from err
        payload = {
            "step": step,
            "object": name,
            "size": int(found.get("size") or 0),
            "etag": found.get("ETag") or found.get("etag"),
            "record": _encode(info),
            "backend": self.backend,
            "format_version": format.FORMAT_VERSION,
        }
        self._forget(path)
        object_store.write_marker(self.folder, name + MARKER_SUFFIX, payload)

    def remove(self, paths) -> None:
        """Remove the checkpoints ``paths``: each marker first, then its object.

        Raises:
            StorageError: naming the object when the store fails (the checkpoints removed
                before it are gone; one whose marker is gone is no longer listed).
        """
        for path in paths:
            name = self._name(path)
            self.folder.child(name + MARKER_SUFFIX).remove()
            self.folder.child(name).remove()
            self._forget(path)

    def move_aside(self, path, writer="StableCheckpoint", folder=UNREADABLE_DIR):
        """Copy the checkpoint ``path`` into ``<directory>/unreadable/`` (``<name>.<n>`` if
        taken), then remove its marker and object; the copy's URL, or ``None`` if the
        object was removed meanwhile. ``folder=ABANDONED_DIR``: into ``abandoned/`` (a
        checkpoint of an abandoned timeline).

        Raises:
            StorageError: if the store fails to copy or remove it (a `StateError`).
        """
        name = self._name(path)
        fs = self.folder.fs
        aside = object_store.RemotePath(f"{self.url}/{folder}", _fs=fs, _path=f"{self.folder.path}/{folder}")
        taken = set(aside.list())
        target, n = name, 1
        while target in taken:
            target, n = f"{name}.{n}", n + 1
        copy = aside.child(target)
        advice = (
            f"Move or delete it (and its marker {name + MARKER_SUFFIX!r}) yourself: {writer} does not "
            "restore it, and left in place it would count as one of the `max_to_keep` newest."
        )
        try:
            with object_store.talking_to(path, f"copy aside to {copy.url!r} the checkpoint", advice, keep=(FileNotFoundError,)):  # fmt: skip
                fs.copy(self.folder.child(name).path, copy.path)
        except FileNotFoundError:
            self.folder.child(name + MARKER_SUFFIX).remove()
            return None
        fs.invalidate_cache(aside.path)
        self.remove([path])
        return copy.url


def survey(directory: RemoteDirectory) -> Survey:
    """Every object in ``directory``'s folder by what it is, listed now (what ``keras-stable-state
    list`` shows); later reads take the committed checkpoints' markers from it, as after
    `RemoteDirectory.checkpoints` (a function: the class keeps exactly the protocol's methods).

    Raises:
        StorageError: naming the directory when the store fails.
    """
    entries = directory._entries()
    committed, bare, bad, _, temporary = directory._sort(entries)
    directory._committed = {directory._url(n): p for n, p in committed.items()}
    return Survey(
        sizes={directory._url(n): size for n, (size, _) in entries.items()},
        committed=sorted(directory._committed, reverse=True),
        damaged=[(directory._url(n), reason) for n, reason in sorted(bad, reverse=True)],
        incomplete=sorted(directory._url(n) for n in [*temporary, *bare]),
    )
