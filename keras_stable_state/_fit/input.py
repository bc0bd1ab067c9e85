"""Where ``fit``'s input stands: the order of each epoch and the place in a stream.

Two facts decide which batches a resumed ``model.fit`` trains on, and neither is
kept by Keras:

* **The order of NumPy array inputs with ``shuffle=True``** (or ``"batch"``). Keras
  draws it with each backend's own generator (NumPy on JAX, Torch's global generator
  in a ``RandomSampler``, ``tf.random.shuffle`` inside a ``tf.data`` pipeline on
  TensorFlow, which with a global seed draws the same order each epoch).
  `EpochOrder` leaves that draw to ``fit`` (a run with a checkpoint draws the orders
  of the same run without one) and computes the same order by Keras' own code from
  the epoch's starting random state when a save inside the epoch needs it; the
  permutation travels in the checkpoint (record ``providers/data``, with who drew it
  and TensorFlow's seed), and a resumed run is served it for the rest of the
  interrupted epoch, on any backend. On TensorFlow without a global seed, whose draw
  nothing can replay, `EpochOrder` draws each order with NumPy and serves it.
* **The place in a stream that outlives an epoch.** With ``steps_per_epoch``, Keras
  keeps one iterator across epochs (``keras/src/trainers/epoch_iterator.py``) until the
  input runs out, so a ``tf.data`` pipeline with ``repeat()`` continues where the last
  epoch stopped. `EpochOrder` records how many batches of that iterator were
  drawn before the current epoch began (``stream_offset``); a resumed run draws them
  from a fresh iterator before the epoch's own batches are skipped.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_stable_state import _keras_compat, _state
from keras_stable_state.errors import CorruptCheckpointError, StateError

RECORD = "providers/data"
"""Record of the input's place in a checkpoint (the epoch's permutation and stream offset)."""


SOURCES = ("numpy", "torch", "tensorflow")
"""Who draws each epoch's order of shuffled NumPy arrays: ``"numpy"``,
``np.random.permutation`` at epoch begin (JAX's ``fit``, and `EpochOrder` itself on
TensorFlow without a global seed); ``"torch"``, Keras' ``RandomSampler`` over Torch's global
generator; ``"tensorflow"``, Keras' ``tf.data`` pipeline traced under a global seed."""


def _live_source(tf_seed) -> tuple[str, bool]:
    """``(source, own)`` of this backend: the order ``fit`` draws, and whether ``fit`` draws it
    itself (``False``: `EpochOrder` draws it with NumPy and serves it)."""
    backend = keras.backend.backend()
    if backend == "torch":
        return "torch", True
    if backend == "tensorflow":
        return ("tensorflow", True) if tf_seed is not None else ("numpy", False)
    return "numpy", True


class EpochOrder:
    """The order and stream place of one ``fit`` input, as a state provider.

    Where ``fit`` draws the order of shuffled NumPy arrays from a state a checkpoint keeps
    (JAX and Torch always, TensorFlow under a global seed), ``fit`` keeps drawing it and
    this object only computes the same order, by Keras' own code from the epoch's
    starting random state, at the first save inside the epoch: a run with
    [`StableCheckpoint`][keras_stable_state.StableCheckpoint] draws exactly the orders of
    the same run without it. A resumed run is served the saved order for the rest of the
    interrupted epoch, then ``fit`` draws its own again. On TensorFlow without a global
    seed (an order nothing can replay) this object draws it with NumPy and serves it.

    Args:
        epoch_iterator: The ``EpochIterator`` of the running ``fit`` (or ``None``).

    Attributes:
        shuffle: The ``shuffle`` of ``fit`` over NumPy arrays whose order this object
            knows (``True`` or ``"batch"``), or ``False`` for any other input.
        source: Who draws each epoch's order, one of `SOURCES`.
        permutation: int64 array of shape ``(num_samples,)``: the current epoch's
            sample order (empty until a save inside the epoch needs it, and for other
            inputs).
        stream_offset: Batches drawn from an iterator that outlives epochs before the
            current epoch began (``0`` when each epoch starts a fresh iterator).
        tf_seed: TensorFlow's global seed that Keras' ``tf.data`` pipeline of the run is
            traced under (its order depends on it alone), or ``None``.
    """

    def __init__(self, epoch_iterator: Any = None) -> None:
        self.epoch_iterator = epoch_iterator
        self._arrays = None
        self.shuffle = False
        self.permutation = np.zeros((0,), dtype="int64")
        self.stream_offset = 0
        self.tf_seed = _keras_compat.fit_trace_seed()
        self.source, self._own = _live_source(self.tf_seed)
        self._epoch_rng: Any = None  # the random state at this epoch's begin, until its order is computed
        self._serving_saved = False  # the adapter serves a saved order (the rest of an interrupted epoch)
        arrays = _keras_compat.shufflable_arrays(epoch_iterator)
        if arrays is not None:
            self._arrays, self.shuffle, self._batch_size = arrays
            self._num_samples = _keras_compat.num_samples(self._arrays)
            if not self._own:
                _keras_compat.set_array_order(epoch_iterator, None)  # Keras' own shuffle off

    def get_state(self) -> dict:
        """``{"permutation", "stream_offset", "source"}`` and ``"tf_seed"`` where there is
        one; the epoch's order is computed here, at the first save that needs it."""
        self.draw_pending()
        out = {
            "permutation": self.permutation,
            "stream_offset": int(self.stream_offset),
            "source": self.source,
        }
        if self.tf_seed is not None:
            out["tf_seed"] = int(self.tf_seed)
        return out

    def set_state(self, value) -> None:
        """Take a saved state's fields as they are; [`StableCheckpoint`][keras_stable_state.StableCheckpoint] applies them
        at the resumed epoch's begin (`begin_epoch`)."""
        self.permutation = np.asarray(value["permutation"], dtype="int64")
        self.stream_offset = int(value["stream_offset"])

    def draw_pending(self) -> None:
        """Compute the current epoch's order where ``fit`` draws it: Keras' own code run
        from the random state of the epoch's begin, every global random state put back
        after (`compat.keras_array_order`)."""
        if self._epoch_rng is None:
            return
        epoch_rng, self._epoch_rng = self._epoch_rng, None
        put_back = _state.rng_snapshot()
        try:
            _state.set_rng_state(epoch_rng)
            self.permutation = _keras_compat.keras_array_order(
                self._num_samples, self._batch_size, self.shuffle, self.tf_seed
            )
        finally:
            put_back()

    def end_epoch(self) -> None:
        """The epoch is over (a save at its end): its order is needed no more."""
        self._epoch_rng = None
        self.permutation = np.zeros((0,), dtype="int64")

    def begin_epoch(self, resumed=None, mid_epoch=False, epoch_rng=None) -> None:
        """Note where the stream stands and the epoch's order, at an epoch begin.

        Args:
            resumed: The checked saved state (`check`) of the checkpoint being
                resumed, or ``None``: its stream offset is reached by drawing that many
                batches from a fresh iterator, and with ``mid_epoch`` its permutation is
                served for the rest of the interrupted epoch.
            mid_epoch: ``True`` when resuming inside the epoch.
            epoch_rng: The random state at this epoch's begin (`state.rng_state`), from
                which ``fit`` draws the order; ``None``: the state now.
        """
        if resumed is not None:
            self.stream_offset = resumed["stream_offset"]
            if self.stream_offset:
                # A fresh iterator may draw from the global generators (a Torch DataLoader
                # draws its base seed): the uninterrupted run made its iterator epochs ago.
                before = _state.rng_state()
                _keras_compat.advance_stream(self.epoch_iterator, self.stream_offset)
                _state.set_rng_state(before)
        else:
            self.stream_offset = _keras_compat.stream_position(self.epoch_iterator)
        self._epoch_rng = None
        if self._arrays is None:
            return
        if resumed is not None:
            self._adopt(resumed)
        if mid_epoch and resumed is not None and resumed["permutation"].size:
            self.permutation = resumed["permutation"]
            if self._replays(resumed, epoch_rng):
                # fit draws the saved order again from the epoch's restored random state,
                # lazy draws included (shuffle="batch" draws per batch on JAX and Torch)
                _keras_compat.serve_keras_order(self.epoch_iterator, self._arrays, self.shuffle, self.tf_seed)
                return
            self.permutation = resumed["permutation"]
            _keras_compat.set_array_order(self.epoch_iterator, self._arrays, self.permutation)
            self._serving_saved = True
            return
        if self._own:
            if self._serving_saved or resumed is not None:
                # fit's own order again; TensorFlow's pipeline traced under the run's seed
                _keras_compat.serve_keras_order(self.epoch_iterator, self._arrays, self.shuffle, self.tf_seed)
                self._serving_saved = False
            self.permutation = np.zeros((0,), dtype="int64")
            self._epoch_rng = epoch_rng if epoch_rng is not None else _state.rng_state()
            return
        if self.shuffle == "batch":
            n, size = self._num_samples, self._batch_size
            self.permutation = np.concatenate(
                [np.random.permutation(min(size, n - s)) + s for s in range(0, n, size)]
            ).astype("int64")
        else:
            self.permutation = np.random.permutation(self._num_samples).astype("int64")
        _keras_compat.set_array_order(self.epoch_iterator, self._arrays, self.permutation)

    def _replays(self, resumed, epoch_rng) -> bool:
        """Whether ``fit`` itself draws the saved permutation of ``resumed`` again from the
        epoch's random state ``epoch_rng`` (``None``: the state now): the same source, and
        Keras' order computed from it equal to the saved one."""
        if not self._own or resumed.get("source", "numpy") != self.source:
            return False
        self._epoch_rng = epoch_rng if epoch_rng is not None else _state.rng_state()
        self.draw_pending()
        return bool(np.array_equal(self.permutation, resumed["permutation"]))

    def continues(self, source: str, tf_seed: int | None) -> bool:
        """Whether this backend draws the later orders of a run whose orders came from
        ``source`` (with TensorFlow's seed ``tf_seed``): the same source, ``"numpy"`` (which
        any backend draws), or TensorFlow's pipeline under a saved seed on TensorFlow (traced
        under it again, also in a process without a global seed)."""
        return (
            source in ("numpy", self.source)
            or source == "tensorflow"
            and tf_seed is not None
            and keras.backend.backend() == "tensorflow"
        )

    def _adopt(self, resumed) -> None:
        """Continue the resumed run's order where this backend draws it (`continues`): the
        same source (and TensorFlow seed), ``"numpy"`` (served here), or TensorFlow's
        pipeline traced under the saved seed; another backend's own order cannot be drawn
        here (`inexact` warns)."""
        source, tf_seed = resumed.get("source", "numpy"), resumed.get("tf_seed")
        if source == self.source:
            if tf_seed is not None:
                self.tf_seed = tf_seed
        elif source == "numpy":
            self.source, self._own = "numpy", False
        elif self.continues(source, tf_seed):  # TensorFlow's pipeline, this process unseeded
            self.source, self._own, self.tf_seed = source, True, tf_seed

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
        source = value.get("source", "numpy")
        tf_seed = value.get("tf_seed")
        if source not in SOURCES or not (
            tf_seed is None or (isinstance(tf_seed, int) and not isinstance(tf_seed, bool))
        ):
            raise CorruptCheckpointError(
                f"The checkpoint's {RECORD} record names the order's source {source!r} and TensorFlow "
                f"seed {tf_seed!r}, not one of {list(SOURCES)} and an int ({where or 'the checkpoint'}). "
                "The file is damaged; restore from an earlier checkpoint.",
                key=f"{RECORD}/source",
            )
        perm = perm.astype("int64")
        facts = {"source": source, "tf_seed": tf_seed}
        if perm.size and not np.array_equal(np.sort(perm), np.arange(perm.size)):
            raise CorruptCheckpointError(
                f"The checkpoint's {RECORD}/permutation is not a permutation of 0..{perm.size - 1} "
                f"({where or 'the checkpoint'}). The file is damaged; restore from an earlier checkpoint.",
                key=f"{RECORD}/permutation",
            )
        live = self._num_samples if self._arrays is not None else None
        if not mid_epoch:  # a new epoch draws a new order: only the stream offset is used
            return {"permutation": perm, "stream_offset": offset, **facts}
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
        return {"permutation": perm, "stream_offset": offset, **facts}
