"""What a directory of ``.orbax`` step directories needs from the Orbax engine (and so from
Keras and JAX): the option checks and reading a step; and reading a checkpoint for a
restore (`read_from`: the one read that needs the core, which the directories themselves,
`.directory` and `.remote_directory`, never import). `.orbax_steps` (listing, names,
removal) stays free of both, so the command line lists such a directory without them."""

from __future__ import annotations

from keras_stable_state import format
from keras_stable_state._core.apply import takes_unaligned
from keras_stable_state._engines import orbax
from keras_stable_state._manager import orbax_steps
from keras_stable_state._manager.protocols import CheckpointDirectory
from keras_stable_state.format import proven


def check_options(directory, save_on_background, writer="CheckpointManager") -> None:
    """Refuse what a ``.orbax`` checkpoint directory cannot do.

    Raises:
        StateError: if orbax-checkpoint is not installed (naming the ``[orbax]`` extra).
        ValueError: for ``save_on_background=True``: the ``.orbax`` engine writes in the
            calling thread (its shards are written by every process together); for an
            object-store URL (``s3://...``): the ``.orbax`` engine writes a local folder.
    """
    if not orbax_steps.uses_orbax(directory):
        return
    if "://" in str(directory):
        raise ValueError(
            f"{writer}({directory!r}): a directory named '*{orbax_steps.SUFFIX}' keeps each checkpoint as a "
            f"'{orbax_steps.SUFFIX}' step folder that the Orbax engine writes on a local (or shared, mounted) file "
            "system, not in an object store. Give a local path for '*.orbax', or a directory not "
            "ending in '.orbax' to keep ckpt-<step>.h5 objects in the store."
        )
    orbax.check_installed()
    if save_on_background:
        raise ValueError(
            f"{writer}({directory!r}, save_on_background=True): a directory named '*{orbax_steps.SUFFIX}' keeps "
            f"each checkpoint as a '{orbax_steps.SUFFIX}' step directory, which the Orbax engine writes in the "
            "calling thread (every process its own shards, together). Pass save_on_background=False, "
            "or give a directory not ending in '.orbax' to write ckpt-<step>.h5 files in the background."
        )


def read_step(path) -> format.StateRecord:
    """The record of the step directory ``path`` (its arrays read on demand).

    Raises:
        CheckpointFormatError: if ``path`` is a symbolic link (never followed) or not a
            ``.orbax`` training state; every error of the engine's ``read``.
    """
    orbax_steps.refuse_link(path)
    return orbax.read(path)


def read(path) -> format.StateRecord:
    """The record of the checkpoint ``path`` of a local directory (a ``.h5`` file, or a
    ``.orbax`` step directory: `read_step`).

    Raises:
        Every error of `keras_stable_state.format.read_file` (of `read_step`).
    """
    if orbax_steps.is_step(path):
        return read_step(path)
    return format.read_file(path, unaligned_views=takes_unaligned())


def read_in_place(path) -> format.StateRecord:
    """`read`, for a restore in place: a ``.h5`` checkpoint proven whole, its large arrays
    left in the open file (`keras_stable_state.format.proven.read_proven`; closed by the restore).

    Raises:
        Every error of `read`.
    """
    if orbax_steps.is_step(path):
        return read_step(path)
    return proven.read_proven(path)


def read_from(files: CheckpointDirectory, path: str, *, in_place: bool = False) -> format.StateRecord:
    """The record of the checkpoint ``path`` of the directory ``files``: a local one by `read`
    (by `read_in_place` for a restore in place, ``in_place=True``), an object read whole
    through its store (``in_place`` does not apply: nothing is left open).

    Raises:
        Every error of `read` (`read_in_place`; for an object, of
        `keras_stable_state.format.read_file`).
    """
    if not files.local:
        return format.read_file(
            path, storage_options=files.storage_options, unaligned_views=takes_unaligned()
        )
    return read_in_place(path) if in_place else read(path)
