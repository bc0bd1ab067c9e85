"""Errors raised by keras_stable_state, and the warnings of [`StableCheckpoint`][keras_stable_state.StableCheckpoint].

Every refusal derives from [`StateError`][keras_stable_state.StateError] (but
`UnsupportedKerasError`, an ``ImportError`` raised on import by a Keras outside the
supported range). Each subclass also inherits the
built-in exception a Python user would catch for that kind of problem
(``ValueError``, ``KeyError``, ``OSError``), following orbax-checkpoint's
``errors.py``. Messages say which key, what was expected, what was found, and
what to do about it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "StateError",
    "KeyFormatError",
    "BindingError",
    "ContractError",
    "DtypeMismatchError",
    "CheckpointFormatError",
    "NewerFormatError",
    "CorruptCheckpointError",
    "MalformedKeyError",
    "CheckpointInUseError",
    "StorageBackendError",
    "StorageError",
    "StoragePermissionError",
    "ScheduleMismatchError",
    "UnsupportedKerasError",
    "UnreadableCheckpointWarning",
    "InexactResumeWarning",
]


# What one message shows of names (keys, paths, records) read from a file or a model:
# at most NAMES_SHOWN of a list, each at most NAME_WIDTH characters.
NAMES_SHOWN = 5
NAME_WIDTH = 120


def shown(name: object, width: int = NAME_WIDTH, quote: bool = True) -> str:
    """``repr(name)`` (``str(name)`` with ``quote=False``), shortened to about ``width``
    characters: its start, then ``... (N characters)``. Every message that echoes a
    name from a file or a model goes through this (or `listed`), so no name
    makes a message unbounded."""
    text = name if isinstance(name, str) else repr(name)
    if len(text) <= width:
        return repr(name) if quote else text
    head = text[: max(8, width - 24)]
    return f"{repr(head) if quote else head}... ({len(text):,} characters)"


def listed(
    names: Iterable[object], limit: int = NAMES_SHOWN, width: int = NAME_WIDTH, quote: bool = True
) -> str:
    """``names`` as ``['a', 'b', 'c' and 295 more]`` (``[]`` when empty): at most ``limit``,
    each `shown`, with the count of the others."""
    names = names if isinstance(names, list | tuple) else list(names)
    head = ", ".join(shown(n, width, quote) for n in names[:limit])
    more = f" and {len(names) - limit:,} more" if len(names) > limit else ""
    return f"[{head}{more}]"


# The longest message an error carries: a longer one keeps its start and its end (the fix).
MESSAGE_LIMIT = 8000
_WORD_LIMIT = 1000


def bounded(message: str) -> str:
    """``message`` with every run of more than 1,000 characters without a space
    shortened (`shown`'s way) and, if still longer than `MESSAGE_LIMIT`,
    its middle left out: the net under `shown` and `listed`, applied to
    every [`StateError`][keras_stable_state.StateError]."""
    if len(message) <= _WORD_LIMIT:
        return message
    words = message.split(" ")
    if any(len(w) > _WORD_LIMIT for w in words):
        message = " ".join(
            w if len(w) <= _WORD_LIMIT else f"{w[:NAME_WIDTH]}... ({len(w):,} characters)" for w in words
        )
    if len(message) > MESSAGE_LIMIT:
        keep = MESSAGE_LIMIT // 2
        message = (
            f"{message[:keep]} ... ({len(message) - 2 * keep:,} characters left out) ... {message[-keep:]}"
        )
    return message


class StateError(Exception):
    """Base class of every error raised by keras_stable_state.

    Attributes:
        key (str | None): The variable or slot key the error is about, or ``None``.
        expected (Any): What the library expected (shape, dtype, count...), or ``None``.
        received (Any): What it found instead, or ``None``.

    Examples:
        >>> try:
        ...     kss.restore_training_state("run.h5", model)
        ... except kss.StateError as err:
        ...     print(err.key, err.expected, err.received)
    """

    def __init__(
        self, message: str, *, key: str | None = None, expected: object = None, received: object = None
    ) -> None:
        super().__init__(bounded(str(message)))
        self.key = key
        self.expected = expected
        self.received = received


class KeyFormatError(StateError, ValueError):
    """A key read from a file is malformed (not ``path:<path>`` or ``order:<int>``).

    Examples:
        >>> kss.VariableKey.parse("layers/dense/kernel")   # raises KeyFormatError
    """


class BindingError(StateError, ValueError):
    """A saved entry cannot be bound to a live variable.

    Raised when a key matches nothing, when an order bind would land on a
    variable of another shape or dtype, when an order bind would claim a
    variable that a named key owns, or when counts differ in a positional file.

    Examples:
        >>> kss.restore_training_state("stock.weights.h5", model_with_other_optimizer)
        BindingError: The file holds 10 optimizer variables in positional order, but SGD has 6; ...
    """


class ContractError(StateError, ValueError):
    """The model's trainable variables differ from the saved contract.

    Attributes:
        missing (list[str]): Keys in the contract that the model does not train.
        unexpected (list[str]): Keys the model trains that the contract does not list.
        reshaped (list[tuple[str, Any, Any]]): ``(key, saved_shape, current_shape)`` triples.
        retyped (list[tuple[str, Any, Any]]): ``(key, saved_dtype, current_dtype)`` triples.

    Examples:
        >>> model.get_layer("hidden").trainable = False
        >>> kss.restore_training_state("run.h5", model)
        ContractError: ... missing (saved as trainable, not trained now: frozen or removed): [...]
        >>> err.missing
        ['path:layers/hidden/kernel', 'path:layers/hidden/bias']
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        reshaped: Sequence[tuple[str, Any, Any]] = (),
        retyped: Sequence[tuple[str, Any, Any]] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.reshaped = list(reshaped)
        self.retyped = list(retyped)


class DtypeMismatchError(StateError, TypeError):
    """A saved array's dtype differs from its variable's and no cast was allowed,
    or an integer value does not fit the target integer dtype.

    Examples:
        >>> kss.restore_training_state("half.h5", model)          # float16 array, float32 variable
        DtypeMismatchError: Saved array for path:layers/hidden/kernel is float16, but its variable is float32 ...
        >>> kss.restore_training_state("half.h5", model, allow_cast=True).casts
        [('path:layers/hidden/kernel', 'float16', 'float32')]
    """


class CheckpointFormatError(StateError, ValueError):
    """The file is not a training-state file this version can read.

    Examples:
        >>> kss.save_training_state("run.ckpt", model)   # raises: use a '.keras' or '.h5' extension
    """


class NewerFormatError(CheckpointFormatError):
    """The file was written by a newer keras_stable_state: a format version this
    version does not read, or records (HDF5 objects, attributes, index fields) this
    version does not know in a file whose seal checks.

    The file is not damaged, and nothing is done to it:
    [`StableCheckpoint`][keras_stable_state.StableCheckpoint] neither moves it to ``unreadable/``
    nor falls back past it to an older checkpoint (which would train again what the
    newer one holds), and ``keras-stable-state verify`` exits with 3, not 1. Upgrade
    keras_stable_state to read it.

    Attributes:
        path (str | None): The file (``"<archive>:<member>"`` inside a ``.keras`` archive).
        version (int | None): The format version it was written in (``int``).
        unknown (list[str]): The names this version does not know (records, attributes,
            fields), at most a few, or ``[]`` for a newer format version.

    Examples:
        >>> kss.restore_training_state("from-the-future.h5", model)
        NewerFormatError: from-the-future.h5: written by a newer keras_stable_state (format 4); upgrade to read it ...
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        version: int | None = None,
        unknown: Sequence[str] = (),
        key: str | None = None,
    ) -> None:
        super().__init__(message, key=key, received=version)
        self.path = path
        self.version = version
        self.unknown = list(unknown)


class CorruptCheckpointError(StateError, OSError):
    """An array in the file fails its checksum or cannot be read (truncation).

    Examples:
        >>> kss.restore_training_state("damaged.h5", model)
        CorruptCheckpointError: damaged.h5: array for key 'path:layers/hidden/kernel' fails its CRC-32 checksum ...
    """


class MalformedKeyError(CorruptCheckpointError, KeyFormatError):
    """A key in a file cannot be parsed: the file is damaged (or was written by
    something else), not a model that differs. Both a
    [`CorruptCheckpointError`][keras_stable_state.CorruptCheckpointError] and a
    [`KeyFormatError`][keras_stable_state.KeyFormatError].

    Examples:
        >>> kss.restore_training_state("damaged.h5", model)
        MalformedKeyError: damaged.h5: model variable key 'layers/hidden/kernel' is malformed ...
    """


class CheckpointInUseError(StateError, BlockingIOError):
    """A checkpoint file or checkpoint directory is held by another process.

    Raised instead of [`CorruptCheckpointError`][keras_stable_state.CorruptCheckpointError] when a healthy file is
    locked (open for writing by h5py, or ``flock``-ed exclusively) by another
    process, and by [`StableCheckpoint`][keras_stable_state.StableCheckpoint] when another
    writer holds its directory's lock file. The file is not damaged: wait for
    the other process, or stop it. [`StableCheckpoint`][keras_stable_state.StableCheckpoint]
    never falls back to an older checkpoint for this error.

    Attributes:
        path (str | None): The file or directory that is in use.
        holder (str | None): What is known of the other process (``"pid 1234 on host x"``), or ``None``.

    Examples:
        >>> kss.restore_training_state("run.h5", model)   # another process has it open for writing
        CheckpointInUseError: 'run.h5' is in use by another process (locked for writing) ...
    """

    def __init__(
        self, message: str, *, path: str | None = None, holder: str | None = None, key: str | None = None
    ) -> None:
        super().__init__(message, key=key)
        self.path = path
        self.holder = holder


class StorageBackendError(StateError, ImportError):
    """A path is an object-store URL (``gs://``, ``s3://``, ``az://``...) whose fsspec
    implementation is not installed (or fsspec itself is not): nothing was read or
    written, and no local folder named after the scheme was made.

    Attributes:
        path (str | None): The URL.
        scheme (str | None): Its scheme (``"gs"``).
        package (str | None): The package that implements it (``"gcsfs"``), or ``None`` if unknown.

    Examples:
        >>> kss.save_training_state("gs://bucket/run.h5", model)   # gcsfs not installed
        StorageBackendError: 'gs://bucket/run.h5' is in Google Cloud Storage (gs://), read and written through gcsfs, which is not installed ...
    """

    def __init__(
        self, message: str, *, path: str | None = None, scheme: str | None = None, package: str | None = None
    ) -> None:
        super().__init__(message, expected=package, received=scheme)
        self.path = path
        self.scheme = scheme
        self.package = package


class StorageError(StateError, OSError):
    """An object store (``s3://``, ``gs://``, ``az://``...) failed an operation: saving,
    listing, reading, removing (pruning), taking or releasing the lock of a checkpoint
    directory. The store did not answer (the server gone, a timeout), answered with an
    error (an HTTP 5xx), or its library raised (botocore's ``EndpointConnectionError``...);
    that exception is kept as ``__cause__``. An ``OSError``, whatever the store library
    raised, so ``except OSError`` catches every failure of a store.

    What was in the store before is as it was, unless the message says otherwise (an
    object appears only once its upload completes): save again once the store is back.

    Attributes:
        url (str): The object's or folder's URL.
        operation (str): What was being done (``"upload"``, ``"list"``, ``"read"``,
            ``"remove"``, ``"lock"``, ``"release the lock"``...).

    Example:
        >>> mgr.save(7, model)   # the S3 endpoint stopped answering
        StorageError: Could not upload 's3://bucket/run/ckpt-0000000007.h5' (upload): the store did not answer (EndpointConnectionError: ...) ...
    """

    def __init__(self, message: str, *, url: str | None = None, operation: str | None = None) -> None:
        super().__init__(message, received=url)
        self.url = url
        self.operation = operation


class StoragePermissionError(StorageError, PermissionError):
    """An object store refused the credentials (or had none) for an operation on a URL: a
    [`StorageError`][keras_stable_state.StorageError] and a ``PermissionError``. The message
    names the URL and where the store's library takes its credentials from.

    Example:
        >>> kss.restore_training_state("s3://bucket/run.h5", model)   # a wrong secret key
        StoragePermissionError: The store refused the credentials to read 's3://bucket/run.h5' (Forbidden) ...
    """


class ScheduleMismatchError(StateError, ValueError):
    """The learning-rate schedule differs from the one saved.

    Attributes:
        fields (list[tuple[str, Any, Any]]): ``(field, saved value, current value)`` for each difference.

    Examples:
        >>> kss.restore_training_state("run.h5", model_with_decay_steps_20)
        ScheduleMismatchError: The learning-rate schedule differs from the one saved
        (config.decay_steps: saved 10, now 20). ...
    """

    def __init__(self, message: str, *, fields: Sequence[tuple[str, Any, Any]] = ()) -> None:
        super().__init__(message)
        self.fields = list(fields)


# -- the installed Keras (on import) -----------------------------------------------------------
class UnsupportedKerasError(ImportError):
    """The installed Keras is outside the range whose internals this package uses: raised
    on ``import keras_stable_state`` (by ``keras_stable_state._keras_compat``), so an
    ``ImportError`` and not a [`StateError`][keras_stable_state.StateError]. The message names
    the installed and the supported versions and the ``pip install`` that fixes it.

    Examples:
        >>> import keras_stable_state   # with Keras 3.14 installed
        UnsupportedKerasError: keras_stable_state supports Keras >=3.15,<4; installed: Keras 3.14.2. ...
    """


# -- warnings (StableCheckpoint, on train begin) --------------------------------------------
class UnreadableCheckpointWarning(UserWarning):
    """[`StableCheckpoint`][keras_stable_state.StableCheckpoint] moved unreadable checkpoints aside on train begin.

    Issued when it falls back past damaged checkpoints to an older one, or when
    every checkpoint in the directory is unreadable and training starts fresh.
    The message names each unreadable file, why it is unreadable and where it
    was moved (``<directory>/unreadable/``).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     model.fit(x, y, callbacks=[kss.StableCheckpoint("ckpts")])
        >>> [w.message for w in caught if issubclass(w.category, kss.UnreadableCheckpointWarning)]
    """


class InexactResumeWarning(UserWarning):
    """[`StableCheckpoint`][keras_stable_state.StableCheckpoint] cannot make a resumed ``fit`` see the same data as an
    uninterrupted one.

    Issued on train begin, naming the input and what a resumed run will see otherwise:
    a ``keras.utils.PyDataset`` that overrides ``on_epoch_end`` (e.g. to shuffle) but
    keeps its order without ``get_state()`` / ``set_state()``, a ``tf.data`` pipeline
    with ops tf.data cannot checkpoint (``tf.py_function``, ``Dataset.from_generator``)
    or made under other random seeds than the saved run's, a
    resume on another number of ``tf.distribute`` replicas of a model with
    ``BatchNormalization`` or random layers, shuffled arrays whose order
    [`StableCheckpoint`][keras_stable_state.StableCheckpoint] cannot take over, or a resume on another backend than the
    writer's of a model with random layers (or, with TensorFlow on one side, of an input of
    unknown length, or of a model with a loss per output whose batches are of unequal
    sizes: TensorFlow averages those losses over batches, the others over samples), a
    callback whose state the library
    cannot see (no ``get_state()``/``set_state()``) on a resume, and a ``fit`` whose
    planned batches would take an optimizer's ``iterations`` counter past its dtype's
    maximum (``int32`` on JAX and Torch), naming the global step where it would wrap.
    In a custom loop, [`ResumableSampler`][keras_stable_state.ResumableSampler] issues it on
    restore where the data order cannot be replayed (another global batch or world size
    that cannot split the saved order, other sampler settings), naming saved and live world
    size and batch.

    Examples:
        >>> import warnings
        >>> warnings.simplefilter("error", kss.InexactResumeWarning)  # refuse such inputs
    """
