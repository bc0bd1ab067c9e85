"""The model's metric variables (``model.metrics_variables``: compiled metrics, the loss
tracker, and the ``keras.metrics.Metric`` attributes of a subclassed model, e.g. a GAN's
``d_loss_tracker``) as a state provider.

`Metrics` is the provider: ``StableCheckpoint`` saves it for a mid-epoch resume, and
``save_training_state`` saves it (under ``providers/metrics``) for any model with metric
variables. Its state holds the values in ``metrics_variables`` order and, since the
metric variables' paths were added, their ``paths``; `plan_metrics` matches a saved state
to the live variables by path (``"d_loss/total"``), which ``restore_training_state``
restores.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_stable_state._numpy import numpy_copy
from keras_stable_state._state.tree import malformed
from keras_stable_state.errors import CorruptCheckpointError, StateError

__all__ = ["NAME", "Metrics", "plan_metrics"]

#: The provider name the model's metric values are saved under.
NAME = "metrics"


class Metrics:
    """The model's metric variables (running loss mean...) as a state provider."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def get_state(self):
        variables = self.model.metrics_variables
        return {"values": [numpy_copy(v) for v in variables], "paths": [str(v.path) for v in variables]}

    def validate_state(self, value):
        """Refuse metric values whose count or shapes differ from the model's metric variables."""
        variables = self.model.metrics_variables
        values = value.get("values") if isinstance(value, dict) else None
        if not isinstance(values, list):
            raise CorruptCheckpointError(
                "The checkpoint's metrics record holds no list of values. The file is damaged; restore "
                "from an earlier checkpoint.",
                key="providers/metrics",
            )
        if len(variables) != len(values):
            raise StateError(
                f"The checkpoint holds {len(values)} metric variables, the model has "
                f"{len(variables)}: it was compiled with other metrics. Compile it as when saved.",
                expected=len(variables),
                received=len(values),
            )
        for v, a in zip(variables, values, strict=True):
            if tuple(getattr(a, "shape", ())) != tuple(v.shape):
                raise StateError(
                    f"The checkpoint's metric variable {v.path!r} has shape {tuple(getattr(a, 'shape', ()))}, "
                    f"the model's has {tuple(v.shape)}: it was compiled with other metrics. Compile it as "
                    "when saved.",
                    key=v.path,
                    expected=tuple(v.shape),
                    received=tuple(getattr(a, "shape", ())),
                )

    def set_state(self, value):
        variables = self.model.metrics_variables
        if len(variables) != len(value["values"]):
            raise StateError(
                f"The checkpoint holds {len(value['values'])} metric variables, the model has "
                f"{len(variables)}: it was compiled with other metrics. Compile it as when saved.",
                expected=len(variables),
                received=len(value["values"]),
            )
        for v, a in zip(variables, value["values"], strict=True):
            v.assign(a)


def keyed(value) -> bool:
    """Whether the saved metrics state ``value`` names its variables' paths (saved by this
    version's `Metrics`; a checkpoint of an older ``StableCheckpoint`` does not)."""
    return isinstance(value, dict) and "paths" in value


def plan_metrics(model, value, where=None):
    """Match the saved metrics state ``value`` (with ``paths``) to ``model``'s metric variables.

    By path when the paths are unique on both sides, else by position when the counts
    agree. A saved array whose shape differs from its variable's is not restored. A
    saved value the model has no variable for (a metric not built yet: Keras builds
    compiled metrics at the first train step) is not reported.

    Returns:
        ``(pairs, fresh, dropped)``: ``[(variable, array)]`` to assign, the paths of live
        metric variables left as they are, and ``(saved path, reason)`` of saved values
        of another shape than their variable's.

    Raises:
        CorruptCheckpointError: if ``value`` is not ``{"values": [...], "paths": [...]}``
            of equal lengths.
    """
    name = f"providers/{NAME}"
    values, paths = value.get("values"), value.get("paths")
    if not (
        isinstance(values, list)
        and isinstance(paths, list)
        and len(values) == len(paths)
        and all(isinstance(p, str) for p in paths)
    ):
        raise malformed(name, "it is not a list of metric values with their paths", where)
    live = list(model.metrics_variables)
    live_paths = [str(v.path) for v in live]
    if len(set(paths)) == len(paths) and len(set(live_paths)) == len(live_paths):
        saved = dict(zip(paths, values, strict=True))
        candidates = [(v, p, saved[p]) for v, p in zip(live, live_paths, strict=True) if p in saved]
    elif len(paths) == len(live):
        candidates = [(v, p, a) for v, p, a in zip(live, paths, values, strict=True)]
    else:  # repeated names and other counts: nothing matched, every live one left fresh
        candidates = []
    dropped = []
    pairs, taken = [], set()
    for variable, path, array in candidates:
        if tuple(np.shape(array)) != tuple(variable.shape):
            dropped.append((path, f"shape {tuple(np.shape(array))}, the model's is {tuple(variable.shape)}"))
            continue
        pairs.append((variable, array))
        taken.add(id(variable))
    fresh = [p for v, p in zip(live, live_paths, strict=True) if id(v) not in taken]
    return pairs, fresh, dropped
