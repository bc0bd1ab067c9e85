"""The two verbs users call, ``save_training_state`` and ``restore_training_state``, and their parts.

* `.save`: the record collected and written;
* `.restore`: the restore's arguments checked and the file read, now or deferred
  ([`PendingRestore`][keras_stable_state.PendingRestore]);
* `.requests`: the arguments of one save or restore, checked (`SaveRequest`,
  `RestoreRequest`), with the `ModelIndex` of its model (one walk, the keys parsed);
* `.plan`: every check and conversion of a read record, then every assignment
  (`plan_callbacks` for the callback states alone);
* `.arguments`, `.scope`, `.apply`, `.in_place`, `.mappers`, `.report`,
  `.guards`, `.in_memory`, `.boundary`: argument checks, key scopes,
  all-or-nothing assignment, assignment in place (and the mark of a model it left partly
  restored), state mappers, the report, the decorators of the verbs,
  bytes, saves from other threads during ``fit``.

Other packages use these names from here (``from keras_stable_state import _core``).
"""

from keras_stable_state._core import host_rollback
from keras_stable_state._core.arguments import check_callbacks
from keras_stable_state._core.boundary import step_boundary, training_begins, training_ends
from keras_stable_state._core.in_memory import restore_training_state_from_bytes, training_state_to_bytes
from keras_stable_state._core.in_place import check_not_partial
from keras_stable_state._core.plan import plan_callbacks
from keras_stable_state._core.report import RestoreReport
from keras_stable_state._core.requests import RestoreOptions
from keras_stable_state._core.restore import PendingRestore, restore_training_state, restore_with
from keras_stable_state._core.save import save_training_state, training_state_record

__all__ = [
    "PendingRestore",
    "RestoreOptions",
    "RestoreReport",
    "check_callbacks",
    "check_not_partial",
    "host_rollback",
    "plan_callbacks",
    "restore_training_state",
    "restore_training_state_from_bytes",
    "restore_with",
    "save_training_state",
    "step_boundary",
    "training_begins",
    "training_ends",
    "training_state_record",
    "training_state_to_bytes",
]
