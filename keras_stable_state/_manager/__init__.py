"""A directory of checkpoints for any training loop: :class:`CheckpointManager` (``manager``),
what it keeps and calls best (``policy``), and the directory itself: the lock, listing,
pruning, temporary files, unreadable files moved aside and the fallback over them
(``directory``)."""

from keras_stable_state._manager.directory import LOCK_NAME, UNREADABLE_DIR
from keras_stable_state._manager.manager import CheckpointManager, CheckpointMetadata, wait_for_earlier_saves

__all__ = ["LOCK_NAME", "UNREADABLE_DIR", "CheckpointManager", "CheckpointMetadata", "wait_for_earlier_saves"]
