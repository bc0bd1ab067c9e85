"""Where ``fit``'s input stands: the order of each epoch and the place in a stream.

Two facts decide which batches a resumed ``model.fit`` trains on, and neither is
kept by Keras:

* **The order of NumPy array inputs with ``shuffle=True``** (or ``"batch"``). Keras
  draws it with each backend's own generator (NumPy on JAX, Torch's global generator
  in a ``RandomSampler``, ``tf.random.shuffle`` inside a ``tf.data`` pipeline on
  TensorFlow, whose state no API exposes). `EpochOrder` takes the shuffle
  over: it switches the data adapter's own shuffling off and, at each epoch begin,
  draws the epoch's permutation with NumPy's global generator (whose state is in
  every checkpoint) and hands the adapter the arrays in that order. The permutation
  of the current epoch travels in the checkpoint (record ``providers/data``), so the
  rest of an interrupted epoch is the same samples on any backend.
* **The place in a stream that outlives an epoch.** With ``steps_per_epoch``, Keras
  keeps one iterator across epochs (``keras/src/trainers/epoch_iterator.py``) until the
  input runs out, so a ``tf.data`` pipeline with ``repeat()`` continues where the last
  epoch stopped. `EpochOrder` records how many batches of that iterator were
  drawn before the current epoch began (``stream_offset``); a resumed run draws them
  from a fresh iterator before the epoch's own batches are skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_stable_state import _keras_compat as compat
from keras_stable_state import _state as state
from keras_stable_state.errors import CorruptCheckpointError, StateError

RECORD = "providers/data"
"""Record of the input's place in a checkpoint (the epoch's permutation and stream offset)."""


class EpochOrder:
    """The order and stream place of one ``fit`` input, as a state provider.

    Args:
        epoch_iterator: The ``EpochIterator`` of the running ``fit`` (or ``None``).

    Attributes:
        shuffle: The ``shuffle`` of ``fit`` that this object took over (``True`` or
            ``"batch"``), or ``False`` when Keras' own adapter orders the input.
        permutation: int64 array of shape ``(num_samples,)``: the current epoch's
            sample order (empty when the input is not taken over).
        stream_offset: Batches drawn from an iterator that outlives epochs before the
            current epoch began (``0`` when each epoch starts a fresh iterator).
    """

    def __init__(self, epoch_iterator: Any = None) -> None:
        self.epoch_iterator = epoch_iterator
        self._arrays = None
        self.shuffle = False
        self.permutation = np.zeros((0,), dtype="int64")
        self.stream_offset = 0
        arrays = compat.shufflable_arrays(epoch_iterator)
        if arrays is not None:
            self._arrays, self.shuffle, self._batch_size = arrays
            self._num_samples = compat.num_samples(self._arrays)
            compat.set_array_order(epoch_iterator, None)  # Keras' own shuffle off

    def get_state(self) -> dict:
        return {"permutation": self.permutation, "stream_offset": int(self.stream_offset)}

    def set_state(self, value) -> None:
        """Take a saved state's fields as they are; [`StableCheckpoint`][keras_stable_state.StableCheckpoint] applies them
        at the resumed epoch's begin (`begin_epoch`)."""
        self.permutation = np.asarray(value["permutation"], dtype="int64")
        self.stream_offset = int(value["stream_offset"])

    def begin_epoch(self, resumed=None, mid_epoch=False) -> None:
        """Draw the epoch's order and note where the stream stands, at an epoch begin.

        Args:
            resumed: The checked saved state (`check`) of the checkpoint being
                resumed, or ``None``: its stream offset is reached by drawing that many
                batches from a fresh iterator, and with ``mid_epoch`` its permutation is
                the order of the rest of the interrupted epoch (else a new one is drawn).
            mid_epoch: ``True`` when resuming inside the epoch.
        """
        if resumed is not None:
            self.stream_offset = resumed["stream_offset"]
            if self.stream_offset:
                # A fresh iterator may draw from the global generators (a Torch DataLoader
                # draws its base seed): the uninterrupted run made its iterator epochs ago.
                before = state.rng_state()
                compat.advance_stream(self.epoch_iterator, self.stream_offset)
                state.set_rng_state(before)
        else:
            self.stream_offset = compat.stream_position(self.epoch_iterator)
        if self._arrays is None:
            return
        if mid_epoch and resumed is not None and resumed["permutation"].size:
            self.permutation = resumed["permutation"]
        elif self.shuffle == "batch":
            n, size = self._num_samples, self._batch_size
            self.permutation = np.concatenate(
                [np.random.permutation(min(size, n - s)) + s for s in range(0, n, size)]
            ).astype("int64")
        else:
            self.permutation = np.random.permutation(self._num_samples).astype("int64")
        compat.set_array_order(self.epoch_iterator, self._arrays, self.permutation)

    def check(self, value, mid_epoch, where=None) -> dict:
        """The saved state of the interrupted epoch, checked against this input.

        Raises:
            CorruptCheckpointError: if ``providers/data`` is not a permutation and a count.
            StateError: if the saved permutation is of another number of samples, or
                the checkpoint was saved from an input whose order this one cannot take
                (shuffled NumPy arrays then, another input now, or the other way round).
        """
        perm = value.get("permutation") if isinstance(value, dict) else None
        offset = value.get("stream_offset") if isinstance(value, dict) else None
        if (
            not isinstance(perm, np.ndarray)
            or perm.ndim != 1
            or perm.dtype.kind not in "iu"
            or not isinstance(offset, int)
            or isinstance(offset, bool)
            or offset < 0
        ):
            raise CorruptCheckpointError(
                f"The checkpoint's {RECORD} record is not an int permutation and a stream offset >= 0 "
                f"({where or 'the checkpoint'}). The file is damaged; restore from an earlier checkpoint.",
                key=RECORD,
            )
        perm = perm.astype("int64")
        if perm.size and not np.array_equal(np.sort(perm), np.arange(perm.size)):
            raise CorruptCheckpointError(
                f"The checkpoint's {RECORD}/permutation is not a permutation of 0..{perm.size - 1} "
                f"({where or 'the checkpoint'}). The file is damaged; restore from an earlier checkpoint.",
                key=f"{RECORD}/permutation",
            )
        live = self._num_samples if self._arrays is not None else None
        if not mid_epoch:  # a new epoch draws a new order: only the stream offset is used
            return {"permutation": perm, "stream_offset": offset}
        if perm.size and live is None:
            raise StateError(
                f"The checkpoint was saved mid-epoch from NumPy arrays that fit shuffled ({perm.size} "
                "samples); this fit's input is not a shuffled NumPy array input, so the rest of the epoch "
                "cannot be the same samples. Resume with the same input and shuffle as when saved.",
                key=f"{RECORD}/permutation",
                expected="no saved permutation",
                received=f"a permutation of {perm.size} samples",
            )
        if live is not None and perm.size not in (0, live):
            raise StateError(
                f"The checkpoint's epoch order covers {perm.size} samples, this fit's input has {live}: "
                "the data changed since the save. Resume with the same data, or start a new run in "
                "another directory.",
                key=f"{RECORD}/permutation",
                expected=live,
                received=int(perm.size),
            )
        if live is not None and not perm.size:
            raise StateError(
                "The checkpoint was saved mid-epoch from an input that was not shuffled NumPy arrays "
                f"(or with shuffle=False); this fit shuffles NumPy arrays ({live} samples), so the rest of "
                "the epoch cannot be the same samples. Resume with the same input and shuffle as when saved.",
                key=f"{RECORD}/permutation",
                expected=f"a permutation of {live} samples",
                received="none",
            )
        return {"permutation": perm, "stream_offset": offset}
