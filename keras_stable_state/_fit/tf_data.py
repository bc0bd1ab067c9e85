"""The random state of a ``tf.data`` input, as the ``fit`` input's state provider.

A pipeline with ``shuffle(reshuffle_each_iteration=True)`` (or
``Dataset.random(rerandomize_each_iteration=True)``) draws the seeds of each iterator from
a seed generator that lives in the dataset: the order of an epoch depends on how many
iterators were made before it. `TFDataState` keeps tf.data's own checkpoint of each
iterator ``fit`` makes, taken when it is made (its seeds, the seed generator's count and
its other state, before ``fit`` draws from it), and saves that of the iterator in use
(record ``providers/input``). A resume puts it back: into the first iterator the resumed
run makes when the checkpoint was saved inside that iterator's stream (a mid-epoch
checkpoint, or a stream that outlives epochs with ``steps_per_epoch``), after which the
batches already trained on are drawn and skipped as for any input; into a throwaway
iterator when it was saved at an epoch end, so that the next iterator draws the seeds
the uninterrupted run's next one drew.

Variables the pipeline's functions advance (a ``tf.random.Generator``'s state, the seed
generator of a Keras random preprocessing layer such as ``RandomFlip`` in ``map``) are
saved with it: their values when the iterator in use was made (or, at an epoch end, now),
set back before the resumed run makes its first iterator.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state.errors import InexactResumeWarning, StateError


class TFDataState:
    """tf.data's checkpoint of the iterators of one ``fit`` input, as a state provider.

    Args:
        dataset: The ``tf.data.Dataset`` ``fit`` iterates.

    Attributes:
        optional_state: ``True``: a checkpoint saved before tf.data states were saved
            resumes (with a warning), it is not refused.
        input_name: How messages name the input.
    """

    optional_state = True
    input_name = "(a tf.data pipeline)"

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.seeds = _keras_compat.tf_dataset_seeds(dataset)
        self.variables = _keras_compat.assigned_variables(dataset)
        self.reseeds = bool(_keras_compat.reseeding_datasets(dataset))
        self.hooked = False  # whether fit's iterators are seen (it reseeds, or advances variables)
        self._created: bytes = b""  # the state of the newest iterator fit made, when made
        self._values: list = []  # the variables' values when that iterator was made
        self._pending: bytes | None = None  # to put into the next iterator fit makes
        self.at_epoch_end = False  # the next save is taken before the epoch's iterator is made

    def hook(self, epoch_iterator: Any) -> bool:
        """Be called with each iterator ``fit`` makes of the dataset; ``False`` where the
        iterators cannot be reached (see ``compat.hook_tf_iterators``)."""
        real = _keras_compat.hook_tf_iterators(epoch_iterator, self._made)
        if real is None:
            return False
        self.dataset, self.hooked = real, True
        return True

    def _read_variables(self) -> list:
        return [np.array(v.numpy()) for v in self.variables]

    def _made(self, iterator: Any) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            _keras_compat.restore_tf_iterator(iterator, pending)
        if self.reseeds:
            self._created = _keras_compat.serialize_tf_iterator(iterator) or b""
        # After the checkpoint, which may have filled a shuffle buffer through the functions
        # that advance them: the values that go with it.
        self._values = self._read_variables()

    def note_position(self, at_epoch_end: bool) -> None:
        """Called before each save: ``at_epoch_end`` when the next batch comes from an
        iterator not made yet (an epoch-boundary checkpoint of an input that ``fit``
        iterates anew in each epoch)."""
        self.at_epoch_end = at_epoch_end

    def get_state(self) -> dict:
        return {
            "iterator": np.frombuffer(self._created, dtype="uint8").copy(),
            "at_epoch_end": int(self.at_epoch_end),
            "seeds": np.asarray(self.seeds, dtype="int64").reshape(-1, 2),
            "variables": {
                str(i): v for i, v in enumerate(self._read_variables() if self.at_epoch_end else self._values)
            },
        }

    def validate_state(self, value: dict) -> None:
        """Refuse a state that is not tf.data's checkpoint of an iterator of this pipeline
        (tried on a throwaway iterator).

        Raises:
            StateError: naming the record, with tf.data's reason.
        """
        saved = value.get("variables") or {}
        live = [(tuple(v.shape), np.dtype(v.dtype.as_numpy_dtype)) for v in self.variables]
        found = [(np.shape(saved[k]), np.asarray(saved[k]).dtype) for k in sorted(saved, key=int)]
        if saved and found != live:
            raise StateError(
                "The checkpoint's values of the variables the tf.data pipeline advances (record "
                f"providers/input/variables: {found}) do not fit this pipeline's ({live}). Resume "
                "with the pipeline the checkpoint was saved with, or start a new run in another "
                "directory.",
                key="providers/input/variables",
                expected=str(live),
                received=str(found),
            )
        data = bytes(np.asarray(value["iterator"], dtype="uint8"))
        if not data:
            return
        import tensorflow as tf

        try:
            _keras_compat.restore_tf_iterator(iter(self.dataset), data)
        except (tf.errors.OpError, ValueError) as err:
            raise StateError(
                "The checkpoint's tf.data iterator state (record providers/input/iterator) does not "
                f"fit this fit's tf.data pipeline: {err.message if hasattr(err, 'message') else err}. "
                "Resume with the pipeline the checkpoint was saved with (the same datasets and "
                "transformations, in the same order), or start a new run in another directory.",
                key="providers/input/iterator",
            ) from err

    def warn_seeds(self, value: Any) -> None:
        """Warn, at train begin, when the saved state ``value`` (``providers/input``, its
        arrays joined) was taken from a pipeline made with other random seeds than this one."""
        if not isinstance(value, dict):
            return  # malformed: refused by the checks at the resumed epoch's begin
        try:
            saved_seeds = np.asarray(value.get("seeds", np.zeros((0, 2))), dtype="int64").reshape(-1, 2)
        except (TypeError, ValueError):
            return  # malformed: refused by the checks at the resumed epoch's begin
        live_seeds = np.asarray(self.seeds, dtype="int64").reshape(-1, 2)
        if saved_seeds.shape != live_seeds.shape or not np.array_equal(saved_seeds, live_seeds):
            warnings.warn(
                "StableCheckpoint: the random seeds (seed, seed2) of the input tf.data pipeline's "
                "shuffle, Dataset.random and random ops differ from those of the checkpoint's run "
                f"(saved {saved_seeds.tolist()}, now {live_seeds.tolist()}): the dataset was made "
                "under another global seed (tf.random.set_seed, keras.utils.set_random_seed) or "
                "with other ops, so it draws other orders and numbers than the saved run from the "
                "resumed epoch on. Set the same global seed before making the dataset (an op's "
                "seed= is combined with the global seed) to resume exactly.",
                InexactResumeWarning,
                stacklevel=_keras_compat.outside_stacklevel(),
            )

    def set_state(self, value: dict) -> None:
        """Put a saved state back: at once into a throwaway iterator for a checkpoint taken at
        an epoch end, else into the next iterator ``fit`` makes."""
        data = bytes(np.asarray(value["iterator"], dtype="uint8"))
        if data and value["at_epoch_end"]:
            throwaway = iter(self.dataset)
            _keras_compat.restore_tf_iterator(throwaway, data)
            del throwaway  # before the variables are set: nothing of it draws after
        elif data:
            self._pending = data
        saved = value.get("variables") or {}
        if saved and self.hooked:
            for variable, key in zip(self.variables, sorted(saved, key=int), strict=True):
                variable.assign(saved[key])
