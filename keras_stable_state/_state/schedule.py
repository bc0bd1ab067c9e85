"""The learning-rate schedule's identity: `schedule_state` saves it, `check_schedule`
refuses a resume under another one.

The current learning rate value itself is an optimizer variable and is saved with them.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_stable_state import _keras_compat
from keras_stable_state.errors import ScheduleMismatchError

__all__ = ["schedule_state", "check_schedule"]


def _schedule(optimizer: Any) -> Any:
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        return _schedule(inner)
    lr = _keras_compat.learning_rate_variable(optimizer)
    return lr if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) else None


def schedule_state(optimizer: Any) -> dict[str, Any]:
    """``{"schedule": <Keras serialization of the schedule> | None}``."""
    sched = None if optimizer is None else _schedule(optimizer)
    return {"schedule": None if sched is None else keras.saving.serialize_keras_object(sched)}


def _diff(saved: Any, current: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(saved) | set(current)):
            out += _diff(saved.get(k), current.get(k), k if path == "schedule" else f"{path}.{k}")
        return out
    return [] if saved == current else [(path, saved, current)]


def check_schedule(saved: dict[str, Any], optimizer: Any) -> None:
    """Raise if ``optimizer``'s learning-rate schedule differs from ``saved``.

    Raises:
        ScheduleMismatchError: naming every differing field (class, initial
            learning rate, decay steps...).
    """
    current = schedule_state(optimizer)["schedule"]
    fields = _diff(saved.get("schedule"), current, "schedule")
    if fields:
        listed = "; ".join(f"{f}: saved {s!r}, now {c!r}" for f, s, c in fields)
        raise ScheduleMismatchError(
            f"The learning-rate schedule differs from the one saved ({listed}). A resumed run with "
            "another schedule does not continue the saved one. Build the optimizer with the saved "
            "schedule, or pass check_schedule=False to continue with the new one.",
            fields=fields,
        )
