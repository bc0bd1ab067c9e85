"""What a [`CheckpointManager`][keras_stable_state.CheckpointManager] keeps and calls best: the checks of
its ``max_to_keep``, ``keep_best``, ``monitor`` and ``mode``, the direction of a metric,
and the kept set (the latest ``max_to_keep`` and the best ``keep_best`` by the metric)."""

from __future__ import annotations

import math
from typing import Any

MODES = ("auto", "min", "max")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(max_to_keep, keep_best, monitor, mode) -> str | None:
    """The direction (``"min"`` or ``"max"``) of ``monitor``, or ``None`` without one.

    Raises:
        ValueError: if ``max_to_keep`` is not ``None`` or an int ``>= 1``, ``keep_best`` not an
            int ``>= 0`` (``True`` is refused for both), ``monitor`` not ``None`` or a non-empty
            ``str``, ``keep_best > 0`` without ``monitor``, ``mode`` not one of `MODES`,
            or ``mode="auto"`` for a name whose direction it cannot tell.
    """
    if max_to_keep is not None and not (_is_int(max_to_keep) and max_to_keep >= 1):
        raise ValueError(
            f"`max_to_keep` must be None (keep every checkpoint) or an int >= 1. Received: "
            f"max_to_keep={max_to_keep!r}"
        )
    if not (_is_int(keep_best) and keep_best >= 0):
        raise ValueError(f"`keep_best` must be an int >= 0. Received: keep_best={keep_best!r}")
    if monitor is not None and not (isinstance(monitor, str) and monitor):
        raise ValueError(
            f"`monitor` must be None or the name of a metric (e.g. 'val_loss'). Received: monitor={monitor!r}"
        )
    if keep_best and monitor is None:
        raise ValueError(
            f"`keep_best={keep_best}` keeps the best checkpoints by a metric: pass `monitor=` (e.g. "
            "monitor='val_loss') and the metrics of each save. Received: monitor=None"
        )
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {list(MODES)}. Received: mode={mode!r}")
    if monitor is None:
        return None
    if mode != "auto":
        return mode
    return direction_of(monitor)


def direction_of(monitor: str) -> str:
    """``"min"`` for a loss or an error, ``"max"`` for an accuracy, AUC, precision, recall or
    F-score (by the name, ``val_`` aside), as Keras' ``ModelCheckpoint`` infers it.

    Raises:
        ValueError: for another name, asking for ``mode="min"`` or ``"max"``.
    """
    name = monitor.lower().removeprefix("val_")
    if "loss" in name or "error" in name or name in ("mse", "mae", "mape", "msle"):
        return "min"
    if any(part in name for part in ("acc", "auc", "precision", "recall", "f1", "fmeasure")):
        return "max"
    raise ValueError(
        f"mode='auto' cannot tell whether a higher or lower {monitor!r} is better. Pass mode='min' "
        "or mode='max'."
    )


def score(metrics: dict[str, Any] | None, monitor: str, direction: str) -> float | None:
    """The value ranking a checkpoint (lower is better), or ``None`` if ``metrics`` has no
    finite ``monitor`` (such a checkpoint is never the best)."""
    value = (metrics or {}).get(monitor)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return value if direction == "min" else -value


def best_steps(scores: dict[int, float | None], count: int) -> list[int]:
    """The ``count`` best steps of ``{step: score or None}``, best first (ties: the earlier step)."""
    ranked = sorted((s, step) for step, s in scores.items() if s is not None)
    return [step for _, step in ranked[:count]]


def kept_steps(steps: list, newest: int | None, max_to_keep, best: list) -> set:
    """The steps to keep of ``steps`` (newest first): the ``max_to_keep`` latest (``newest``,
    the one just written, always among them) and the ``best`` ones; every step with
    ``max_to_keep=None``."""
    if max_to_keep is None:
        return set(steps)
    latest = [newest] if newest is not None else []
    latest += [s for s in steps if s != newest][: max_to_keep - len(latest)]
    return set(latest) | set(best)
