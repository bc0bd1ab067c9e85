"""``model.fit`` integration: [`StableCheckpoint`][keras_stable_state.StableCheckpoint] and its parts (the position and
metric providers, the checkpoint directory, the train-begin checks and warnings, the
restore of a resumed fit, and the data order of its input)."""

from keras_stable_state._fit.callback import StableCheckpoint
from keras_stable_state._manager.directory import LOCK_NAME, UNREADABLE_DIR
from keras_stable_state.errors import InexactResumeWarning, UnreadableCheckpointWarning

__all__ = [
    "LOCK_NAME",
    "UNREADABLE_DIR",
    "InexactResumeWarning",
    "StableCheckpoint",
    "UnreadableCheckpointWarning",
]
