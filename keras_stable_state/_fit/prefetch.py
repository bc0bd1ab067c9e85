"""The batches a ``keras.utils.PyDataset``'s workers carry from one epoch into the next,
as a state provider.

With ``workers > 1`` or ``use_multiprocessing=True`` Keras reads a ``PyDataset`` through an
``OrderedEnqueuer`` whose ``stop`` keeps the batches its workers had already fetched, and
the next run serves those first (`keras_stable_state._keras_compat.prefetched_batches`):
``fit`` draws one batch to build the model, so each epoch begins with batches the run
before it fetched, under the dataset's state and the order of that run. A resumed process
begins with the batches of its own model-building draw instead, so this provider saves the
batches carried into the epoch of the save (record ``providers/prefetched``) and a resume
puts them back before the epoch's workers start: the run with
[`StableCheckpoint`][keras_stable_state.StableCheckpoint] leaves Keras' order as it is, and a
resumed one reads the batches an uninterrupted one reads.

The batches are saved as they are (NumPy arrays in their tuple, list and dict structure):
at most the enqueuer's ``max_queue_size`` batches plus one (Keras' default 10), usually the
epoch's batches but one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._state.tree import is_array, malformed, show

RECORD = "providers/prefetched"
"""Record of the batches a ``PyDataset``'s enqueuer carries into the saved epoch."""

_KINDS = ("tuple", "list", "dict")


def _encode(value: Any) -> Any:
    """A batch as a tree of JSON objects and NumPy arrays: ``{"tuple": [...]}``,
    ``{"list": [...]}``, ``{"dict": {...}}``, arrays as NumPy arrays, ``None`` as is."""
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): _encode(v) for k, v in value.items()}}
    if value is None:
        return None
    return np.asarray(value)


def _decode(value: Any, record: str, where: str | None) -> Any:
    """Inverse of `_encode`.

    Raises:
        CorruptCheckpointError: naming ``record`` for anything `_encode` does not write.
    """
    if value is None or is_array(value):
        return value
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in _KINDS:
        kind, items = next(iter(value.items()))
        if kind == "dict" and isinstance(items, dict):
            return {k: _decode(v, f"{record}/{k}", where) for k, v in items.items()}
        if kind != "dict" and isinstance(items, list):
            out = [_decode(v, f"{record}/{i}", where) for i, v in enumerate(items)]
            return tuple(out) if kind == "tuple" else out
    raise malformed(
        record, f"expected a batch of arrays in tuples, lists and dicts, found {show(value)}", where
    )


class PrefetchedBatches:
    """The batches a ``PyDataset``'s worker enqueuer carries into the current epoch.

    Args:
        adapter: The ``fit``'s ``PyDatasetAdapter`` with an enqueuer (`present`).

    Attributes:
        carried: The batches the enqueuer held at the current epoch's begin, in the
            order it serves them (NumPy arrays in their structure).
    """

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self.carried: list = []

    @staticmethod
    def present(adapter: Any) -> bool:
        """Whether ``adapter`` reads a ``PyDataset`` through a worker enqueuer."""
        return adapter is not None and _keras_compat.prefetched_batches(adapter) is not None

    def begin_epoch(self) -> None:
        """Note the batches carried into the epoch about to begin (at its begin, or at a
        save at the end of the one before, once its workers stopped)."""
        self.carried = [_encode(b) for b in _keras_compat.prefetched_batches(self._adapter) or []]

    def get_state(self) -> dict:
        """``{"batches": [...]}``: the batches carried into the epoch of the save."""
        return {"batches": list(self.carried)}

    def set_state(self, value: dict) -> None:
        """`check`, then `resume`: call before the epoch's workers start."""
        self.resume(self.check(value))

    def check(self, value: Any, where: str | None = None) -> list:
        """The saved batches, checked and decoded, setting nothing.

        Raises:
            CorruptCheckpointError: if ``providers/prefetched`` is not a list of batches.
        """
        batches = value.get("batches") if isinstance(value, dict) and set(value) == {"batches"} else None
        if not isinstance(batches, list):
            raise malformed(RECORD, f"expected {{'batches': [...]}}, found {show(value)}", where)
        return [_decode(b, f"{RECORD}/batches/{i}", where) for i, b in enumerate(batches)]

    def resume(self, batches: list) -> None:
        """Carry the saved ``batches`` (from `check`) into the resumed epoch in place of
        those of this process' model-building draw; called before its workers start."""
        self.carried = [_encode(b) for b in batches]
        _keras_compat.set_prefetched_batches(self._adapter, batches)
