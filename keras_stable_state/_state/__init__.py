"""Everything else a resumed run needs besides variables, each with a ``get_state()`` / ``set_state()`` surface.

* `.tree`: states as trees of JSON values and NumPy arrays (`split_arrays`,
  `join_arrays` for storage; `malformed` for a damaged saved record);
* `.schedule`: the learning-rate schedule's identity (`check_schedule`);
* `.callbacks`: stateful callbacks and state providers (`callback_state`,
  `parse_callback_state`, `check_provider_state`);
* `.rng`: the global random state (`rng_state`, `parse_rng_state`);
* `.layers`: layer state that is not a variable (vocabularies, bin boundaries),
  imported as ``keras_stable_state._state.layers``.

Restores are all-or-nothing: a saved state is checked in full before anything is
set, and a malformed one raises [`CorruptCheckpointError`][keras_stable_state.CorruptCheckpointError]
naming its record.
"""

from keras_stable_state._state.callbacks import (
    callback_key,
    callback_state,
    check_provider_state,
    has_known_state,
    parse_callback_state,
    rename_history_keys,
    set_callback_state,
)
from keras_stable_state._state.rng import (
    ParsedRng,
    apply_rng_state,
    parse_rng_state,
    rng_snapshot,
    rng_state,
    set_rng_state,
)
from keras_stable_state._state.schedule import check_schedule, schedule_state
from keras_stable_state._state.tree import copy_state, join_arrays, malformed, same_state, split_arrays

__all__ = [
    "ParsedRng",
    "apply_rng_state",
    "callback_key",
    "callback_state",
    "check_provider_state",
    "check_schedule",
    "copy_state",
    "has_known_state",
    "join_arrays",
    "malformed",
    "parse_callback_state",
    "parse_rng_state",
    "rename_history_keys",
    "rng_snapshot",
    "rng_state",
    "same_state",
    "schedule_state",
    "set_callback_state",
    "set_rng_state",
    "split_arrays",
]
