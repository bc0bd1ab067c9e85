"""The file engine: a training state written as one ``.h5`` / ``.keras`` file in the calling
thread, atomically on a local disk (`keras_stable_state.format.writer.write_record`:
seal, temporary file, ``fsync``, rename) or, for an object-store URL, the same file
written in a private temporary folder and uploaded whole
(`keras_stable_state._engines.object_store.upload_written`).

`write` is the engine (process 0 alone writes where several processes save); `put` is
the write itself, which the background engine runs in its thread. A ``.keras`` archive
holds Keras' own archive of the model beside the record: `keras_archive` makes the
writer of it that goes into the `WriteRequest`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keras_stable_state import _keras_compat, _processes
from keras_stable_state._engines.object_store import upload_written
from keras_stable_state._engines.write_request import WriteRequest
from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format import writer
from keras_stable_state.format.sink import LimitedFile

if TYPE_CHECKING:
    import keras

__all__ = ["keras_archive", "live_value", "put", "write"]


def live_value(variable: Any, to_numpy: Callable[[Any], Any]) -> Any:
    """``variable``'s value as a NumPy array (``to_numpy``); on TensorFlow, a plain variable
    through one ``ReadVariableOp`` of its resource (``compat.tf_read``): 30 us per variable
    instead of 140."""
    read = _keras_compat.tf_read(variable)
    return to_numpy(variable) if read is None else read.numpy()


def keras_archive(model: keras.Model, filepath: str, *, now: bool = False) -> Callable[[str], None]:
    """What writes Keras' own ``.keras`` archive of ``model`` (config and weights) at the
    temporary path the writer gives (``filepath``: the file saved, for messages).

    With ``now=True`` the archive is made here, in memory (a background save: the model
    may change once the call returns), and the writer copies its bytes; else it is made
    when the file is written, straight into the temporary file.

    Raises:
        CheckpointFormatError: (with ``now=True`` here, else from the writer) for a model
            Keras cannot serialize (no ``get_config``).
    """
    if not now:
        return lambda tmp: _save_archive(model, tmp, filepath)
    buffer = io.BytesIO()
    _save_archive(model, buffer, filepath)
    archive = buffer.getvalue()
    del buffer

    def copy(tmp: str) -> None:
        with LimitedFile(tmp, "wb") as fh:
            fh.write(archive)

    return copy


def _save_archive(model: keras.Model, tmp: str | io.IOBase, filepath: str) -> None:
    try:
        if isinstance(tmp, io.IOBase):
            _keras_compat.save_keras_archive_to(model, tmp)
        else:  # what model.save(tmp) does, through a file that respects RLIMIT_FSIZE
            with LimitedFile(tmp, "wb") as fh:
                _keras_compat.save_keras_archive_to(model, fh)
    except NotImplementedError as err:
        if "get_config" not in str(err):
            raise
        raise CheckpointFormatError(
            f"Cannot save {filepath!r}: a '.keras' archive holds the model's config, and Keras cannot "
            f"serialize {type(model).__name__} ({str(err).strip().splitlines()[0]} ...). Implement "
            "`get_config()` on the model (and register it with "
            "@keras.saving.register_keras_serializable()), or save to a '.h5' path: a '.h5' file holds "
            "the same training state without the model config, and restore_training_state restores it "
            "into a model you build in code.",
            key=None,
            expected="a serializable model (get_config)",
            received=type(model).__name__,
        ) from err


def put(request: WriteRequest) -> int | None:
    """Write ``request.record`` to ``request.path`` (`write_record`), or, with a
    ``request.store``, to a local temporary file uploaded whole to it; the size uploaded in
    bytes for an upload, else ``None``.

    Raises:
        The errors of ``write_record`` and of `RemotePath.put_file`.
    """
    if request.store is None:
        writer.write_record(request.path, request.record, keras_archive_writer=request.keras_archive)
        return None
    return upload_written(
        request.path,
        lambda local: writer.write_record(local, request.record, keras_archive_writer=request.keras_archive),
        store=request.store,
    )


def write(request: WriteRequest) -> str:
    """The engine: `put` on process 0 alone (with several processes every process gathered
    the same arrays; the others wait for its outcome); ``request.path``.

    Raises:
        The errors of `put`; on the other processes a ``StateError`` when it failed on process 0.
    """
    with _processes.on_primary(request.path) as turn:
        if turn.runs:
            put(request)
    return request.path
