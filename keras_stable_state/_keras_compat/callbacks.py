"""The private state of Keras callbacks (``SwapEMAWeights``, ``ModelCheckpoint``) and
Keras' ``print_msg``.
"""

from __future__ import annotations

__all__ = [
    "ema_weights_in_model",
    "model_checkpoint_counters",
    "print_msg",
    "set_ema_weights_in_model",
    "set_model_checkpoint_counters",
]


def print_msg(message: str) -> None:
    """Keras' ``print_msg`` (stdout, or absl logging when Keras is set to log)."""
    from keras.src.utils.io_utils import print_msg as keras_print_msg

    keras_print_msg(message)


def ema_weights_in_model(cb) -> bool:
    """Whether ``SwapEMAWeights`` has the EMA weights swapped into the model (its private
    ``_ema_weights_in_model``, ``keras/src/callbacks/swap_ema_weights.py``)."""
    return bool(getattr(cb, "_ema_weights_in_model", False))


def set_ema_weights_in_model(cb, value: bool) -> None:
    """Set ``SwapEMAWeights``' flag of `ema_weights_in_model`."""
    cb._ema_weights_in_model = bool(value)


def model_checkpoint_counters(cb) -> dict:
    """``ModelCheckpoint``'s private save counters."""
    return {
        "batches_seen_since_last_saving": int(getattr(cb, "_batches_seen_since_last_saving", 0)),
        "last_batch_seen": getattr(cb, "_last_batch_seen", None),
        "current_epoch": int(getattr(cb, "_current_epoch", 0)),
    }


def set_model_checkpoint_counters(cb, state) -> None:
    cb._batches_seen_since_last_saving = state["batches_seen_since_last_saving"]
    cb._last_batch_seen = state["last_batch_seen"]
    cb._current_epoch = state["current_epoch"]
