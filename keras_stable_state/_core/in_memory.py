"""A training state as bytes, for object stores: ``training_state_to_bytes`` and
``restore_training_state_from_bytes``.

The bytes are exactly a sealed ``.h5`` training state (what
``save_training_state("x.h5", ...)`` writes), and reading them runs exactly the
checks a file gets: the xxh3-128 seal (SHA-256 in format 2), the HDF5 structure,
the records' checksums and schema, every array's xxh3-64 (CRC-32 in format 2)
(`keras_stable_state.format.read_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keras_stable_state import format
from keras_stable_state._core import boundary
from keras_stable_state._core.apply import takes_unaligned
from keras_stable_state._core.requests import RestoreOptions, SaveOptions
from keras_stable_state._core.restore import PendingRestore, restore_with
from keras_stable_state._core.save import training_state_record
from keras_stable_state.format.writer import record_to_bytes

if TYPE_CHECKING:
    import keras

    from keras_stable_state._core.report import RestoreReport


__all__ = ["restore_training_state_from_bytes", "training_state_to_bytes"]

_LABEL = "<bytes>"


def training_state_to_bytes(
    model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None, **kwargs: Any
) -> bytes:
    """The training state as the bytes of a sealed ``.h5`` file, e.g. to put in an object store.

    Takes the arguments of [`save_training_state`][keras_stable_state.save_training_state]
    except ``filepath``, and saves the same state (a ``.keras`` archive's model
    config is not included: build the model in code, or save the model
    separately). Writing the bytes to a file ``x.h5`` gives a file that
    [`restore_training_state`][keras_stable_state.restore_training_state] restores.

    Args:
        model: A built ``keras.Model``.
        optimizer: As for ``save_training_state`` (on Torch a ``torch.optim.Optimizer``
            too); default ``model.optimizer``.
        **kwargs: ``model_state``, ``callbacks``, ``state``, ``include_rng``,
            ``allow_order_keys``, ``variables``, ``mappers``: as for
            ``save_training_state``.

    Returns:
        ``bytes``: a 512-byte seal block (``KSS-SEAL 3 xxh3-128 <hex> <length>``)
        then the HDF5 image; about the size of the arrays plus a few KiB.

    Raises:
        StateError: every error of ``save_training_state`` but those about the path
            (its subclasses, ``TypeError`` and ``ValueError`` for invalid arguments);
            from another thread during ``fit`` it waits or is refused as that one does.

    Examples:
        >>> data = kss.training_state_to_bytes(model)
        >>> bucket.put_object(Key="run/step-100.h5", Body=data)
    """
    with boundary.saving(model, "training_state_to_bytes"):  # as save_training_state's
        options = SaveOptions.from_keywords("training_state_to_bytes", optimizer=optimizer, **kwargs)
        record = training_state_record(model, options, verb="training_state_to_bytes")
        return record_to_bytes(record)


def restore_training_state_from_bytes(
    data: bytes,
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = None,
    strict: bool = True,
    allow_cast: bool = False,
    **kwargs: Any,
) -> RestoreReport | PendingRestore:
    """Restore a training state from bytes (from [`training_state_to_bytes`][keras_stable_state.training_state_to_bytes], or a
    ``.h5`` / ``.keras`` file's bytes fetched from an object store).

    The bytes get every check a file gets (seal, structure, records, every
    array's checksum: xxh3-64, or CRC-32 in format 2) before anything is assigned; then the restore is exactly
    [`restore_training_state`][keras_stable_state.restore_training_state]'s, all or nothing.
    Messages name the source as ``'<bytes>'``.

    Args:
        data: ``bytes``, ``bytearray`` or ``memoryview``.
        model: The built ``keras.Model`` to restore into.
        optimizer: As for ``restore_training_state``.
        strict: As for ``restore_training_state``.
        allow_cast: As for ``restore_training_state``.
        **kwargs: ``callbacks``, ``state``, ``include_rng``,
            ``check_schedule``, ``variables``, ``prefix``, ``rename``,
            ``keep_learning_rate``, ``defer``: as for ``restore_training_state``.

    Returns:
        A [`RestoreReport`][keras_stable_state.RestoreReport] (with ``defer=True`` a
        [`PendingRestore`][keras_stable_state.PendingRestore]).

    Raises:
        TypeError: if ``data`` is not bytes-like (a path: use
            ``restore_training_state``), or for a keyword argument that is not
            one of those above.
        CorruptCheckpointError: if the bytes are truncated or damaged (seal,
            structure, a record or an array's checksum), naming the key where
            there is one; the model is left untouched.
        StateError: every other error of ``restore_training_state`` (its subclasses
            ``ContractError``, ``BindingError``, ``DtypeMismatchError``...).

    Examples:
        >>> data = bucket.get_object(Key="run/step-100.h5")["Body"].read()
        >>> report = kss.restore_training_state_from_bytes(data, model)
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        hint = (
            " To restore from a file, call restore_training_state(path, model)."
            if isinstance(data, str)
            else ""
        )
        raise TypeError(
            "`data` of restore_training_state_from_bytes must be bytes (or bytearray / memoryview) "
            f"holding a training state.{hint} Received: {type(data).__name__} {data!r:.60}"
        )
    defer = kwargs.pop("defer", False)
    options = RestoreOptions.from_keywords(
        "restore_training_state_from_bytes",
        optimizer=optimizer,
        strict=strict,
        allow_cast=allow_cast,
        **kwargs,
    )
    record = format.read_bytes(bytes(data), unaligned_views=takes_unaligned())
    restored: RestoreReport | PendingRestore = restore_with(
        _LABEL, model, options, defer=defer, record=record, take=True
    )
    return restored
