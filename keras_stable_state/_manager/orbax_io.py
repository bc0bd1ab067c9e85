"""What a directory of ``.orbax`` step directories needs from the Orbax engine (and so from
Keras and JAX): the option checks; and reading a checkpoint for a restore (`read_from`,
through the restore's one door, `keras_stable_state._engines.dispatch.read`: the one read
that needs the engines and the core, which the directories themselves, `.directory` and
`.remote_directory`, never import). `.orbax_steps` (listing, names,
removal) stays free of both, so the command line lists such a directory without them."""

from __future__ import annotations

from typing import cast

from keras_stable_state import format
from keras_stable_state._core.apply import takes_unaligned
from keras_stable_state._engines import dispatch, object_store, orbax
from keras_stable_state._manager import orbax_steps
from keras_stable_state._manager.protocols import CheckpointDirectory


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


def read_from(files: CheckpointDirectory, path: str, *, in_place: bool = False) -> format.StateRecord:
    """The record of the checkpoint ``path`` of the directory ``files``, read through the one
    door of a restore (`keras_stable_state._engines.dispatch.read`): a local ``.h5`` file
    (with ``in_place``, for a restore in place: proven whole, its large arrays left in the
    open file, closed by the restore), a ``.orbax`` step directory (never through a symbolic
    link; its arrays read on demand by the Orbax engine), or an object read whole through its
    store (``in_place`` does not apply: nothing is left open).

    Raises:
        CheckpointFormatError: if a step directory ``path`` is a symbolic link (never followed)
            or not a ``.orbax`` training state.
        Every error of `keras_stable_state.format.read_file` and of the store.
    """
    store = None
    if not files.local:
        store = object_store.RemotePath(path, files.storage_options)
    elif orbax_steps.is_step(path):
        orbax_steps.refuse_link(path)
    record = dispatch.read(path, store, in_place=in_place and files.local, unaligned_views=takes_unaligned())
    return cast("format.StateRecord", record)
