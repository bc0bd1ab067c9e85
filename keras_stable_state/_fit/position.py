"""Where a ``fit`` stands, as the state providers a checkpoint saves: the position
(epoch, step within the epoch, global step, the epoch-start random state and the data
facts) and the model's metric variables (for a mid-epoch resume: `Metrics`, defined in
``keras_stable_state._state.metrics``, which ``save_training_state`` saves too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keras_stable_state import _state
from keras_stable_state._state.metrics import Metrics as Metrics  # the provider StableCheckpoint saves
from keras_stable_state.errors import CorruptCheckpointError, StateError


class Position:
    """Epoch, step within the epoch and global step, as a state provider."""

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.epoch = 0
        self.step = 0
        self.global_step = 0
        self.epoch_rng: Any = None
        self.steps_per_execution = steps_per_execution
        self.data: dict[str, Any] | None = (
            None  # this fit's batch_size, num_samples, steps, replicas (see checks.live_data)
        )
        self.saved_data: dict[str, Any] | None = (
            None  # the checkpoint's, or None (saved before they were recorded)
        )
        # A run its callbacks stopped (EarlyStopping, model.stop_training): {"epoch", "epochs",
        # "global_step"} of the stop (the fit's epochs then), else None; never a preemption's.
        self.stopped: dict[str, Any] | None = None

    def get_state(self):
        out = {
            "epoch": self.epoch,
            "step": self.step,
            "global_step": self.global_step,
            "epoch_rng": self.epoch_rng,
        }
        if self.data is not None:  # absent while restoring: older checkpoints have no "data"
            out["data"] = self.data
        if self.stopped is not None:
            out["stopped"] = self.stopped
        return out

    def end_execution(self, begin: int, batch: int, steps: int | None) -> None:
        """Count an execution of the batches ``begin`` to ``batch`` (the indices Keras gives
        its first and last batch) in ``step`` and ``global_step``; with ``steps`` (batches
        per epoch, or ``None``), the epoch's last execution may hold fewer batches."""
        last = batch
        if steps:  # the epoch's last execution may hold fewer than steps_per_execution batches
            last = min(last, steps - 1)
        count = max(1, last - begin + 1)
        self.global_step += count
        self.step = begin + count

    def validate_state(self, value):
        """Refuse a position that is not three counts >= 0 and an epoch-start random state."""
        for field in ("epoch", "step", "global_step"):
            count = value.get(field) if isinstance(value, dict) else None
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise CorruptCheckpointError(
                    f"The checkpoint's position record has {field}={count!r}, not a count >= 0. The "
                    "file is damaged; restore from an earlier checkpoint.",
                    key=f"providers/position/{field}",
                )
        spe = self.steps_per_execution
        if value["step"] % spe:
            raise StateError(
                f"The checkpoint was saved after batch {value['step']} of epoch {value['epoch']}, inside "
                f"an execution of the model's steps_per_execution={spe} batches (it was written with "
                "another steps_per_execution): a resume cannot start there and train the same batches. "
                f"Compile with a steps_per_execution that divides {value['step']} (e.g. the one used "
                "when it was saved, or 1) to resume from it.",
                key="providers/position/step",
                expected=f"a multiple of steps_per_execution={spe}",
                received=value["step"],
            )
        if value.get("epoch_rng") is not None:
            _state.parse_rng_state(value["epoch_rng"])
        stopped = value.get("stopped")
        if stopped is not None and not (
            isinstance(stopped, dict)
            and all(
                isinstance(stopped.get(k), int) and not isinstance(stopped.get(k), bool)
                for k in ("epoch", "epochs")
            )
        ):
            raise CorruptCheckpointError(
                f"The checkpoint's position record has stopped={stopped!r}, not the epoch and epochs of a "
                "stopped run. The file is damaged; restore from an earlier checkpoint.",
                key="providers/position/stopped",
            )

    def set_state(self, value):
        self.validate_state(value)
        self.epoch, self.step, self.global_step = value["epoch"], value["step"], value["global_step"]
        self.epoch_rng = value["epoch_rng"]
        self.saved_data = value.get("data")
        self.stopped = value.get("stopped")


def numeric_logs(logs: Mapping[str, Any] | None) -> dict[str, float]:
    """The values of ``logs`` (of a batch or epoch end) that are numbers: the metrics the
    next save records."""
    out = {}
    for name, value in (logs or {}).items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError):
            continue  # not a number (a string, an array of several values): not a metric of the save
    return out
