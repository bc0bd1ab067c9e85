"""``StableCheckpoint``: exact resume for ``model.fit``."""

from __future__ import annotations

import os
import re
import sys

import keras
from keras.src.utils.io_utils import print_msg

from keras_stable_state import checkpoint, state
from keras_stable_state.errors import StateError

__all__ = ["StableCheckpoint"]

_NAME = re.compile(r"^ckpt-(\d{10})\.h5$")


class _Position:
    """Epoch, step within the epoch and global step, as a state provider."""

    def __init__(self):
        self.epoch = 0
        self.step = 0
        self.global_step = 0
        self.epoch_rng = None

    def get_state(self):
        return {
            "epoch": self.epoch,
            "step": self.step,
            "global_step": self.global_step,
            "epoch_rng": self.epoch_rng,
        }

    def set_state(self, value):
        self.epoch, self.step, self.global_step = value["epoch"], value["step"], value["global_step"]
        self.epoch_rng = value["epoch_rng"]


class _Metrics:
    """The model's metric variables (running loss mean...) for a mid-epoch resume."""

    def __init__(self, model):
        self.model = model

    def get_state(self):
        return {"values": [keras.ops.convert_to_numpy(v.value) for v in self.model.metrics_variables]}

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


class StableCheckpoint(keras.callbacks.Callback):
    """Checkpoints the whole training state during ``model.fit`` and resumes it exactly.

    On train begin it restores the newest readable checkpoint in ``directory``
    (model and optimizer variables by key, the learning-rate schedule check,
    the state of the other callbacks of the same ``fit`` call, the global random
    state, metric accumulators and the position) and starts ``fit`` at the saved
    epoch. A checkpoint taken mid-epoch resumes at the next unseen batch: the
    batches already applied are drawn from the data and skipped, not trained on
    again. This is exact for NumPy array inputs and ``keras.utils.PyDataset``
    (whose order is decided by the saved global NumPy/Python random state);
    for ``tf.data`` datasets and generators the skipped batches are drawn from
    a fresh iterator, so the resume is exact only if their order is
    deterministic.

    Each save is one ``ckpt-<global step>.h5`` file (see
    :func:`keras_stable_state.save_training_state`), written atomically; the
    newest ``keep`` files are kept. If the newest file is unreadable (truncated
    or failing its checksum), it says so and falls back to the one before.

    Saves happen after every callback has seen the epoch or batch end (a save
    requested at a batch end is written when the next batch or epoch begins),
    so the state of callbacks listed after this one, e.g. a learning rate that
    ``ReduceLROnPlateau`` just reduced, is in the checkpoint.

    The other callbacks are found through the ``fit`` call's callback list;
    pass ``callbacks=[...]`` to name them yourself. Callbacks that count
    batches themselves see the skipped batches' begin and end events (with
    empty logs).

    Args:
        directory: Folder of the checkpoints (created if needed).
        save_freq: ``"epoch"`` or an ``int``: save every that many batches.
        keep: How many newest checkpoints to keep (``>= 1``).
        verbose: ``1`` prints one line per save and restore.
        callbacks: Callbacks whose state to save and restore; default: the
            other callbacks of the ``fit`` call.

    Raises:
        ValueError: for an invalid ``save_freq`` or ``keep``.
        StateError: on train begin, if the model is not built or was compiled
            with ``steps_per_execution`` other than 1 (a resume lands on a batch),
            and any error of :func:`keras_stable_state.restore_training_state`
            for a readable checkpoint that does not fit the model.

    Example:
        >>> model.fit(x, y, epochs=10, callbacks=[StableCheckpoint("ckpts", save_freq=50), EarlyStopping()])
    """

    def __init__(self, directory, save_freq="epoch", keep=3, verbose=0, callbacks=None):
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq >= 1):
            raise ValueError(f"`save_freq` must be 'epoch' or an int >= 1. Received: save_freq={save_freq!r}")
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"`keep` must be an int >= 1. Received: keep={keep!r}")
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.keep = keep
        self.verbose = verbose
        self._explicit_callbacks = None if callbacks is None else list(callbacks)
        self._siblings = []
        self._position = _Position()
        self._pending_restore = None
        self._save_requested = False
        self._skip_until = 0
        self._rng_after_skip = None
        self.restore_report = None
        self.skipped_checkpoints = []

    # -- discovery ------------------------------------------------------------------
    def set_model(self, model):
        super().set_model(model)
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, keras.callbacks.CallbackList):
            self._siblings = [cb for cb in caller.callbacks if cb is not self]

    @property
    def _callbacks(self):
        return self._explicit_callbacks if self._explicit_callbacks is not None else self._siblings

    def _say(self, message):
        if self.verbose:
            print_msg(f"StableCheckpoint: {message}")

    # -- files ------------------------------------------------------------------------
    def checkpoints(self) -> list:
        """Paths of the checkpoints in ``directory``, newest first."""
        if not os.path.isdir(self.directory):
            return []
        names = sorted((n for n in os.listdir(self.directory) if _NAME.match(n)), reverse=True)
        return [os.path.join(self.directory, n) for n in names]

    def _providers(self):
        return {"position": self._position, "metrics": _Metrics(self.model)}

    # -- restore ----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise StateError(
                f"StableCheckpoint needs a built model to restore into; model {model.name!r} is not built. "
                "Call it on a batch or `model.build(input_shape)` before fit()."
            )
        spe = getattr(model, "steps_per_execution", 1)
        if spe != 1:
            raise StateError(
                "StableCheckpoint resumes at a batch and needs `steps_per_execution=1`; the model was "
                f"compiled with steps_per_execution={spe}. Compile with steps_per_execution=1, or use "
                "save_freq='epoch' with keras_stable_state.save_training_state in your own callback.",
                expected=1,
                received=spe,
            )
        self._position = _Position()
        self._pending_restore = None
        self.skipped_checkpoints = []
        for path in self.checkpoints():
            try:
                record = checkpoint.storage.read_file(path)
            except (
                checkpoint.storage.CorruptCheckpointError,
                checkpoint.storage.CheckpointFormatError,
            ) as err:
                self.skipped_checkpoints.append((path, str(err)))
                print_msg(
                    f"StableCheckpoint: {os.path.basename(path)} is unreadable ({err}); falling back to the one before."
                )
                continue
            self._restore(path, record)
            return
        self._say(f"no checkpoint in {self.directory}; starting fresh")

    def _restore(self, path, record):
        # Variables, optimizer, schedule check and position now; callbacks, metrics and
        # the epoch-start random state once every callback has run on_train_begin.
        self.restore_report = checkpoint.restore_training_state(
            path, self.model, state={"position": self._position}, include_rng=False
        )
        pos = self._position
        self._pending_restore = record
        self.model._initial_epoch = pos.epoch
        self._say(
            f"restored {os.path.basename(path)}: epoch {pos.epoch}, step {pos.step} of the epoch, "
            f"global step {pos.global_step}"
        )

    def on_epoch_begin(self, epoch, logs=None):
        record, self._pending_restore = self._pending_restore, None
        if record is not None:
            self._apply_pending(record)
        elif self._save_requested:
            self._position.step = 0
            self._save()
        self._position.epoch = epoch
        if self._position.step == 0:
            # The random state before this epoch's data order is drawn.
            self._position.epoch_rng = state.rng_state()

    def _apply_pending(self, record):
        for setter in checkpoint.plan_callbacks(record, self._callbacks, self.restore_report):
            setter()
        extra, arrays = record.extra, record.arrays
        pos = self._position
        saved_rng = state.join_arrays(extra["rng"], arrays)
        if pos.step > 0:
            # Replay the epoch's data order from the random state it was drawn with, skip
            # the batches already applied, then continue from the random state at the save
            # (e.g. Torch's unseeded dropout draws from the global generator every step).
            state.set_rng_state(pos.epoch_rng)
            _Metrics(self.model).set_state(state.join_arrays(extra["providers"]["metrics"], arrays))
            self._skip_batches(pos.step)
            self._rng_after_skip = saved_rng
        else:
            state.set_rng_state(saved_rng)

    def _skip_batches(self, count):
        """Draw ``count`` batches from the data without training on them."""
        self._skip_until = count
        model = self.model
        original = model.train_function
        remaining = [count]
        backend = keras.backend.backend()

        def skip(*args):
            remaining[0] -= 1
            if remaining[0] == 0:
                model.train_function = original
            if backend == "jax":
                state_arg, iterator = args
                next(iterator)
                return {}, state_arg
            if backend == "tensorflow":
                next(args[0])
                return {}
            return {}

        model.train_function = skip

    # -- save -------------------------------------------------------------------------
    def on_train_batch_begin(self, batch, logs=None):
        if batch < self._skip_until:
            return
        if self._rng_after_skip is not None:
            state.set_rng_state(self._rng_after_skip)
            self._rng_after_skip = None
        self._position.step = batch
        if self._save_requested:
            self._save()

    def on_train_batch_end(self, batch, logs=None):
        if batch < self._skip_until:  # a batch applied before the checkpoint, drawn and skipped
            return
        self._position.global_step += 1
        self._position.step = batch + 1
        if self.save_freq != "epoch" and self._position.global_step % self.save_freq == 0:
            self._save_requested = True

    def on_epoch_end(self, epoch, logs=None):
        self._skip_until = 0
        self._position.epoch = epoch + 1
        self._position.step = 0
        if self.save_freq == "epoch":
            self._save_requested = True

    def on_train_end(self, logs=None):
        if self._save_requested:
            self._save()
        self.model._initial_epoch = None

    def _save(self):
        self._save_requested = False
        pos = self._position
        if pos.step == 0:
            pos.epoch_rng = state.rng_state()
        name = f"ckpt-{pos.global_step:010d}.h5"
        path = os.path.join(self.directory, name)
        checkpoint.save_training_state(path, self.model, callbacks=self._callbacks, state=self._providers())
        for old in self.checkpoints()[self.keep :]:
            os.remove(old)
        self._say(f"saved {name} (epoch {pos.epoch}, step {pos.step}, global step {pos.global_step})")
