"""Background writes of training states: ``save_training_state(..., blocking=False)``.

`write` is the engine ``save_training_state`` hands a `WriteRequest` to. The calling
thread builds the whole `StateRecord`
(every array held apart from training: a host copy, a TensorFlow read, a view of a JAX
CPU buffer or a JAX copy on its devices, see `host_record`) and hands it to
`submit`; one shared
``concurrent.futures.ThreadPoolExecutor`` runs the write (the file engine's `files.put`, as
a blocking save: ``write_record``, seal, temporary file, ``fsync``, atomic rename; or the
upload to an object store). Writes into one folder run one after the other, in the order they
were submitted: each waits for the previous write into its folder before it starts.

Pending writes finish before the interpreter exits (``concurrent.futures`` joins its
worker threads at exit); a process that is killed leaves at most a ``.kss-*``
temporary file, never a partial checkpoint under its final name.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._engines import files
from keras_stable_state._engines.object_store import RemotePath
from keras_stable_state._engines.write_request import WriteRequest
from keras_stable_state.format.record import StateRecord
from keras_stable_state.format.urls import is_url
from keras_stable_state.format.writer import check_target

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "SaveHandle",
    "device_copies",
    "folder_of",
    "host_record",
    "live_value",
    "prepare",
    "submit",
    "wait_for_folder",
    "write",
]

_WORKERS = 4
_GUARD = threading.Lock()
_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_LATEST: dict[str, SaveHandle] = {}  # real path of a folder -> the SaveHandle submitted last into it


def _forget_in_child() -> None:
    # A forked child has no worker threads; it must not wait on its parent's writes.
    global _GUARD, _EXECUTOR
    _GUARD = threading.Lock()
    _EXECUTOR = None
    _LATEST.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class SaveHandle:
    """A training-state save whose file write runs in a background thread.

    Returned by [`save_training_state`][keras_stable_state.save_training_state] with
    ``blocking=False``. When it is returned, every value is held apart from
    training (Torch: a host copy; TensorFlow: a read, the variable's next update
    writes into a new buffer; JAX on CPU: a view of the buffer, which a step that
    donates it copies first; JAX on an accelerator: a copy on its devices, brought to
    the host by the background thread): training may change the model and optimizer
    at once without changing what is written. The write (HDF5 record, seal, temporary
    file, ``fsync``, atomic rename) runs in a background thread; until it ends, the
    previous file at ``path`` (if any) is left as it was, and a process killed
    meanwhile leaves only a ``.kss-*`` temporary file beside it.

    Attributes:
        path (str): The file being written (``str``).
        blocked_secs (float): Seconds the calling thread spent in ``save_training_state``
            (``float``): waiting for the previous write into the same folder, and
            copying and collecting the state.
        write_secs: Seconds the background write took, from its start to the
            rename (``float``), or ``None`` while it runs or if it failed.
        nbytes: Size of the written file in bytes (``int``), or ``None`` while it
            runs or if it failed.

    Examples:
        >>> handle = kss.save_training_state("run.h5", model, blocking=False)
        >>> ...                                    # keep training
        >>> handle.wait()                          # raises what the write raised
        'run.h5'
    """

    def __init__(self, path: str, future: concurrent.futures.Future[None], blocked_secs: float) -> None:
        self.path = path
        self.blocked_secs = blocked_secs
        self.write_secs: float | None = None
        self.nbytes: int | None = None
        self._future = future

    def done(self) -> bool:
        """``True`` once the write has finished, successfully or not (never blocks)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the write to finish and return `path`.

        Args:
            timeout: Seconds to wait at most (``float``); ``None`` waits as long as
                the write takes.

        Returns:
            The path of the written file (``str``).

        Raises:
            TimeoutError: if the write has not finished within ``timeout``
                seconds; it goes on, and ``wait`` may be called again.
            OSError: the error of the write itself, of its original type, naming
                the path (disk full, folder removed or unwritable); the previous
                file at ``path`` is left intact. Every other error the write
                raised (e.g. [`CheckpointFormatError`][keras_stable_state.CheckpointFormatError])
                is re-raised as it is, each time ``wait`` is called.
        """
        try:
            self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"The background save of {self.path!r} has not finished within {timeout} s; it goes on. "
                "Call wait() again, or wait(None) to wait until it ends."
            ) from None
        return self.path

    def __repr__(self) -> str:
        status = "writing" if not self.done() else ("failed" if self._future.exception() else "written")
        return f"<SaveHandle {self.path!r} {status}>"


def folder_of(path: str) -> str:
    """The real path of the folder ``path`` is written into (the key that orders writes);
    for an object-store URL, the URL of its folder."""
    if is_url(path):
        return path.rstrip("/").rpartition("/")[0]
    return os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))


def _latest(folder: str) -> SaveHandle | None:
    with _GUARD:
        return _LATEST.get(folder)


def wait_for_folder(folder: str, timeout: float | None = None) -> None:
    """Wait until the last write submitted into ``folder`` (see `folder_of`) has finished.

    Its error, if any, is not raised here: it belongs to its [`SaveHandle`][keras_stable_state.SaveHandle].

    Raises:
        TimeoutError: if it has not finished within ``timeout`` seconds.
    """
    handle = _latest(folder)
    if handle is not None:
        _, pending = concurrent.futures.wait([handle._future], timeout=timeout)
        if pending:
            raise TimeoutError(f"The background save of {handle.path!r} has not finished within {timeout} s.")


def prepare(path: str, store: RemotePath | None = None) -> None:
    """Before a background save copies anything: the target is writable (a local path),
    and the previous write into its folder has ended (at most one host copy waiting)."""
    if store is None:
        check_target(path)
    wait_for_folder(folder_of(path))


def write(request: WriteRequest) -> functools.partial[SaveHandle]:
    """The engine: what is still shared with live objects copied (`host_record`), and the
    zero-argument callable that submits the write (the file engine's `files.put`) to a
    background thread and returns its [`SaveHandle`][keras_stable_state.SaveHandle]
    (called once the save has left the model)."""
    request = dataclasses.replace(request, record=host_record(request.record))
    return functools.partial(submit, request.path, functools.partial(files.put, request), request.started)


def _owned(array: Any, always: bool) -> NDArray[Any]:
    if callable(array):  # converted lazily by save_training_state (storage.StateRecord)
        array = array()
    host: NDArray[Any] = np.asarray(array)
    # Torch's .numpy() shares the tensor's memory, which the next step updates in place.
    if always or not host.flags.owndata or host.base is not None:
        return np.array(host, copy=True)
    return host


def _jax_array_type() -> Any:  # jax.Array, or None
    jax = sys.modules.get("jax")  # (no JAX imported: no JAX array to copy)
    return None if jax is None else jax.Array


def live_value(variable: Any, to_numpy: Callable[[Any], Any]) -> Any:
    """What a background save takes of ``variable`` in the calling thread: its JAX array
    as it is (no copy yet: `host_record` copies it on its devices or views it on
    CPU); on TensorFlow, a read of a plain resource variable (``compat.tf_read``, the
    same read a restore keeps: a tensor that shares the variable's buffer; an update of
    the variable, which needs the buffer to itself, writes into a new one, TensorFlow's
    copy-on-write); else ``to_numpy(variable)`` (a
    host array, copied by `host_record` where it shares memory with the
    variable)."""
    value = getattr(variable, "value", variable)
    kind = _jax_array_type()
    if kind is not None and isinstance(value, kind):
        return value
    read = _keras_compat.tf_read(variable)  # None off the TensorFlow backend
    if read is not None:
        return _TensorRead(read)
    return to_numpy(variable)


class _TensorRead:
    """A TensorFlow tensor read from a variable, brought to the host when it is called
    (``.numpy()``, in the background thread)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __call__(self) -> Any:
        return self.tensor.numpy()


def device_copies(arrays: list[Any]) -> list[Any]:
    """A copy of each JAX array on its own devices, with its sharding (one batched
    ``jax.device_put(..., may_alias=False)``; ``Array.copy()`` each on a JAX without
    ``may_alias``). Dispatched asynchronously: the caller waits for the dispatch, not for
    the copy, which the device runs before any later computation that donates the
    original (Keras' JAX trainer donates the state to each step: a reference to the
    original would be deleted by the next step)."""
    import jax

    try:
        return list(jax.device_put(arrays, may_alias=False))
    except TypeError as err:  # JAX < 0.4.36: no may_alias
        if "may_alias" not in str(err):
            raise
        return [a.copy() for a in arrays]


def _on_cpu(array: Any) -> bool:
    return all(device.platform == "cpu" for device in array.devices())


def _host_value(copy: Any) -> NDArray[Any]:
    """A JAX copy made by `device_copies`, on the host (in the background thread): a
    view of its buffer on CPU, the device-to-host transfer elsewhere; nothing else holds
    the copy, so it cannot change or be donated."""
    return np.asarray(copy)


_PLAIN = frozenset({str, int, float, bool, type(None)})


def _json_copy(value: Any) -> Any:
    """``copy.deepcopy`` of JSON-like data, faster: dicts, lists and tuples are rebuilt,
    plain scalars kept, anything else deep-copied."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict:
        return {k: _json_copy(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _PLAIN else _json_copy(v) for v in value]
    if kind is tuple:
        return tuple(_json_copy(v) for v in value)
    return copy.deepcopy(value)


def host_record(record: StateRecord) -> StateRecord:
    """``record`` with nothing shared with live objects: arrays that do not own their
    memory (a view of a Torch tensor), every array of the other state (a provider may
    update its own array in place) and the JSON parts of the other state (a callback's
    or schedule's state may hold its live lists) are copied. ``metadata`` and
    ``contract`` are built for this save alone by ``training_state_record``: they
    are handed over as they are.

    A model or optimizer value that is a JAX array (`live_value`) is not copied
    to the host by the calling thread. On an accelerator it is copied on its own
    devices by one asynchronous `device_copies` and held as a callable that
    brings the copy to the host when the background thread writes it: the calling
    thread waits for the dispatch, not for the copy nor a device-to-host transfer. On
    CPU the record holds a NumPy view of its buffer (``np.asarray``: no copy): the
    view's external reference keeps the buffer alive and unchanged, and a later step
    that donates the array (Keras' JAX trainer donates the state to every step) gets a
    copy of it instead (XLA's CPU client copies a donated buffer that has external
    references), inside that step's execution. On TensorFlow the record holds the
    variable's read (`live_value`), converted by the background thread."""
    try:
        extra = _json_copy(record.extra)
    except RecursionError:  # a self-referencing state: as deepcopy has it (the write refuses it)
        extra = copy.deepcopy(record.extra)
    kind = _jax_array_type()
    sections: dict[str, dict[str, Any]]
    live: list[tuple[dict[str, Any], str, Any]]
    sections, live = {}, []
    for name in ("model", "optimizer"):
        out = sections[name] = {}
        for key, value in getattr(record, name).items():
            if callable(value):  # converted lazily by save_training_state (storage.StateRecord)
                value = value()
            if isinstance(value, _TensorRead):  # converted by the background thread
                out[key] = value
            elif kind is not None and isinstance(value, kind) and _on_cpu(value):
                # A view of the buffer (a copy only where JAX must assemble one): the view's
                # hold keeps the buffer as it is; a step that donates it copies it first.
                out[key] = np.asarray(value)
            elif kind is not None and isinstance(value, kind):
                live.append((out, key, value))
                out[key] = None  # (keeps the order of the keys)
            else:
                out[key] = _owned(value, False)
    if live:
        for (out, key, _), copied in zip(live, device_copies([v for _, _, v in live]), strict=True):
            out[key] = functools.partial(_host_value, copied)
    return dataclasses.replace(
        record,
        extra=extra,
        model=sections["model"],
        optimizer=sections["optimizer"],
        arrays={k: _owned(a, True) for k, a in record.arrays.items()},
    )


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ThreadPoolExecutor(
            max_workers=_WORKERS, thread_name_prefix="keras-stable-state-save"
        )
    return _EXECUTOR


def _name_path(err: BaseException, path: str) -> None:
    """Add ``path`` to an error that does not name it (OSErrors of the writer do)."""
    if path not in str(err) and hasattr(err, "add_note"):
        err.add_note(f"(raised by the background save of {path!r})")


def submit(path: str, write: Callable[[], object], started: float) -> SaveHandle:
    """Run ``write()`` (which writes ``path``) in the background, after the writes
    submitted earlier into the same folder.

    Args:
        path: The file ``write`` writes (``str``), or the object's URL.
        write: A callable taking no argument; it may return the size written in bytes
            (``int``; else the size of the file at ``path`` is taken).
        started: ``time.perf_counter()`` when the save began in the calling thread.

    Returns:
        The [`SaveHandle`][keras_stable_state.SaveHandle].
    """
    folder = folder_of(path)
    box: dict[str, Any] = {}  # the previous handle (or None) into the folder, and this one

    def run() -> None:
        earlier = box["previous"]
        if earlier is not None:
            concurrent.futures.wait([earlier._future])
        begin = time.perf_counter()
        try:
            written = write()
        except BaseException as err:
            _name_path(err, path)
            raise
        handle = box["handle"]
        handle.write_secs = time.perf_counter() - begin
        handle.nbytes = written if isinstance(written, int) else os.path.getsize(path)

    with _GUARD:
        for done in [f for f, h in _LATEST.items() if h.done()]:
            del _LATEST[done]
        box["previous"] = _LATEST.get(folder)
        # its future and blocked_secs are set below, before the handle is returned
        handle = SaveHandle(path, cast("concurrent.futures.Future[None]", None), cast(float, None))
        box["handle"] = handle
        handle._future = _executor().submit(run)
        _LATEST[folder] = handle
    handle.blocked_secs = time.perf_counter() - started
    return handle
