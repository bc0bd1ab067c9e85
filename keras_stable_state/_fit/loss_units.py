"""The per-output loss means of an interrupted epoch, in the units this backend's ``fit``
counts them.

Keras' ``CompileLoss`` updates each ``<output>_loss`` mean with ``sample_weight`` equal to
the static batch size: JAX and Torch count samples, TensorFlow counts each batch once when
the input's batch size is not static (a generator, ``tf.data`` with ``batch()``;
`keras_stable_state._keras_compat.per_output_loss_weighting`). A mid-epoch checkpoint
written in one unit and resumed in the other holds the right mean of the batches applied
so far but the other count, so the resumed epoch's History would weigh the saved and the
new batches unlike an uninterrupted run. When every batch applied so far held the same
number of samples, the mean of the batches' means is the mean over their samples, and the
saved means are converted: ``count`` becomes this backend's count, ``total`` the mean times
it. Equal batches are taken from the total loss tracker's sample count being a whole
multiple of the batch count (a save inside an epoch comes before its last, partial batch);
otherwise the means are left as saved and the resume is warned about.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_stable_state import _keras_compat

__all__ = ["LossUnits", "loss_units"]


class LossUnits:
    """What the saved per-output loss means count, against this ``fit``.

    Attributes:
        saved: ``"samples"`` or ``"batches"``, what the writer counted.
        live: What this backend's ``fit`` counts.
        convertible: Whether the samples counted in the interrupted epoch are a whole
            multiple of its batches (taken as equal batches), so `convert` applies.
        names: The trackers' paths (``"compile_loss/out_a_loss"``), for messages.
    """

    def __init__(self, saved: str, live: str, convertible: bool, names: list[str], pairs, batches, samples):
        self.saved, self.live, self.convertible, self.names = saved, live, convertible, names
        self._pairs, self._batches, self._samples = pairs, batches, samples

    def convert(self, values: list) -> list:
        """``values`` (the saved ``metrics_variables`` values, in order) with each per-output
        tracker's ``(total, count)`` counted in this backend's unit; the others as saved."""
        out = list(values)
        count = self._batches if self.live == "batches" else self._samples
        for total_i, count_i in self._pairs:
            old_total, old_count = np.asarray(out[total_i]), np.asarray(out[count_i])
            mean = old_total.astype("float64") / float(old_count)
            out[total_i] = np.asarray(mean * count, dtype=old_total.dtype)
            out[count_i] = np.asarray(count, dtype=old_count.dtype)
        return out


def loss_units(model: Any, values: Any, batches: int) -> LossUnits | None:
    """The units of the per-output loss means in ``values`` (a saved ``providers/metrics``
    state, arrays joined) of a checkpoint taken after ``batches`` batches of its epoch,
    or ``None`` when they agree with this ``fit``'s (or nothing tells them apart: no
    per-output trackers, batch size 1, nothing counted)."""
    indices, live = _keras_compat.per_output_loss_weighting(model)
    total = _keras_compat.total_loss_count_index(model)
    saved = values.get("values") if isinstance(values, dict) else None
    if not indices or total is None or not isinstance(saved, list) or len(saved) <= max(indices):
        return None
    samples = float(saved[total])
    counts = [float(saved[i]) for i in indices]
    if batches <= 0 or samples == batches or not all(c > 0 for c in counts):
        return None
    written = "samples" if all(c == samples for c in counts) else "batches"
    if written == live:
        return None
    variables = list(model.metrics_variables)
    pairs = []
    for i in indices:
        prefix = variables[i].path.rsplit("/", 1)[0]
        total_i = next((j for j, v in enumerate(variables) if v.path == f"{prefix}/total"), None)
        if total_i is None:
            return LossUnits(written, live, False, [prefix], [], batches, samples)
        pairs.append((total_i, i))
    names = sorted(variables[i].path.rsplit("/", 1)[0] for i in indices)
    even = samples % batches == 0 and samples >= batches
    return LossUnits(written, live, even, names, pairs, batches, int(samples))
