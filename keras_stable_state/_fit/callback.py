"""``StableCheckpoint``: exact resume for ``model.fit``."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import socket
import threading
import time
import warnings
import weakref

import keras

from keras_stable_state import _core as checkpoint
from keras_stable_state import _keras_compat as compat
from keras_stable_state import _state as state
from keras_stable_state._engines import background as _async
from keras_stable_state._fit import checks as _fit_checks
from keras_stable_state._fit import input as _fit_input
from keras_stable_state._numpy import numpy_copy
from keras_stable_state._optimizer import stable_optimizer_in, tracked_optimizers
from keras_stable_state.errors import (
    CheckpointFormatError,
    CheckpointInUseError,
    CorruptCheckpointError,
    InexactResumeWarning,
    StateError,
    UnreadableCheckpointWarning,
)

try:
    import fcntl
except ImportError:  # Windows: no flock; the directory is not locked (see the docs)
    fcntl = None

__all__ = ["StableCheckpoint", "UnreadableCheckpointWarning", "InexactResumeWarning"]

_NAME = re.compile(r"^ckpt-(\d{10})\.h5$")
LOCK_NAME = ".stable-checkpoint.lock"
"""Name of the lock file a writing :class:`StableCheckpoint` holds in its directory."""
TEMP_PREFIX = ".kss-"
"""Prefix of the temporary files of atomic writes (``storage.atomic_path``)."""
UNREADABLE_DIR = "unreadable"
"""Subfolder of the checkpoint directory that unreadable checkpoints are moved into."""


# -- the directory lock -------------------------------------------------------------------
_HELD = {}  # realpath of a directory -> _DirectoryLock held by this process
_HELD_GUARD = threading.Lock()
_TOKENS = itertools.count(1)


def _holder_text(info):
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return None
    text = f"pid {info['pid']} on host {info.get('host', '?')}"
    if info.get("since"):
        text += f", since {info['since']}"
    return text


def _read_holder(fd):
    try:
        raw = os.pread(fd, 4096, 0)
        return _holder_text(json.loads(raw.decode("utf-8")))
    except (OSError, ValueError):  # being written right now, or not ours: holder unknown
        return None


class _DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/.stable-checkpoint.lock``, held by one
    :class:`StableCheckpoint` of this process at a time.

    The lock file holds the writer's pid and host as JSON so that a refused writer
    can name it. It is removed on release (while still locked; acquirers check that
    the file they locked is still the one at the path). A lock of a dead process is
    released by the operating system. Within one process, a ``StableCheckpoint``
    whose ``fit`` raised (Keras then skips ``on_train_end``) keeps the lock until it
    is garbage collected, the process exits, or another ``StableCheckpoint`` on the
    same directory begins training in the same thread and takes the lock over.
    """

    def __init__(self, key, directory, path, fd):
        self.key = key
        self.directory = directory
        self.path = path
        self.fd = fd
        self.pid = os.getpid()
        self.token = None
        self.thread = None

    @classmethod
    def acquire(cls, directory, token):
        """Return the held lock of ``directory`` with ``token`` as owner, or raise
        :class:`CheckpointInUseError`."""
        key = os.path.realpath(directory)
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is not None and not held._still_in_place():
                held._close()  # the directory or lock file was removed meanwhile: lock afresh
                held = None
            if held is not None:
                alive = {t.ident for t in threading.enumerate()}
                if held.token != token and held.thread != threading.get_ident() and held.thread in alive:
                    names = {t.ident: t.name for t in threading.enumerate()}
                    holder = (
                        f"pid {os.getpid()} on host {socket.gethostname()}, thread {names[held.thread]!r}"
                    )
                    raise CheckpointInUseError(
                        f"Checkpoint directory {directory!r} is in use by another StableCheckpoint writer "
                        f"({holder}: this process, another thread still training); wait for it to finish "
                        "or use another directory.",
                        path=directory,
                        holder=holder,
                    )
            else:
                held = cls(key, directory, *cls._lock(directory))
                _HELD[key] = held
            held.token, held.thread = token, threading.get_ident()
            return held

    @staticmethod
    def _lock(directory):
        path = os.path.join(directory, LOCK_NAME)
        for _ in range(20):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise CheckpointInUseError(
                    f"Checkpoint directory {directory!r} is in use by another StableCheckpoint writer "
                    f"({holder or 'holder unknown: the lock file names none'}); wait for it to finish or "
                    f"use another directory. (The lock is {path!r}, held with flock; the operating "
                    "system releases it when that process ends.)",
                    path=directory,
                    holder=holder,
                ) from None
            except OSError as err:
                os.close(fd)
                raise OSError(
                    err.errno,
                    f"Cannot lock the checkpoint directory {directory!r}: flock on {path!r} failed "
                    f"({err.strerror}). Use a directory on a local file system.",
                    path,
                ) from err
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file after we opened it: lock the new one
        else:
            raise CheckpointInUseError(
                f"Checkpoint directory {directory!r}: its lock file {path!r} keeps being replaced; another "
                "process is creating and removing it. Use another directory.",
                path=directory,
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        return path, fd

    def _still_in_place(self):
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.path))
        except (FileNotFoundError, NotADirectoryError):  # the directory was removed (or replaced by a file)
            return False

    def _close(self):
        fd, self.fd = self.fd, None
        if _HELD.get(self.key) is self:
            del _HELD[self.key]
        os.close(fd)

    def release(self, token):
        """Unlock and remove the lock file if ``token`` owns the lock (else do nothing)."""
        with _HELD_GUARD:
            if self.fd is None or self.token != token:
                return
            try:
                if self.pid == os.getpid() and self._still_in_place():
                    os.unlink(self.path)
            finally:
                self._close()


def _release_token(token):
    for held in list(_HELD.values()):
        held.release(token)


def _forget_locks_in_child():
    # A forked child shares the parent's lock; it must neither use nor remove it.
    global _HELD_GUARD
    _HELD_GUARD = threading.Lock()
    for held in list(_HELD.values()):
        if held.fd is not None:
            try:
                os.close(held.fd)
            except OSError:
                pass
            held.fd = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


class _Position:
    """Epoch, step within the epoch and global step, as a state provider."""

    def __init__(self, steps_per_execution=1):
        self.epoch = 0
        self.step = 0
        self.global_step = 0
        self.epoch_rng = None
        self.steps_per_execution = steps_per_execution
        self.data = None  # this fit's batch_size, num_samples, steps (see _fit_checks.live_data)
        self.saved_data = None  # the checkpoint's, or None (saved before they were recorded)

    def get_state(self):
        out = {
            "epoch": self.epoch,
            "step": self.step,
            "global_step": self.global_step,
            "epoch_rng": self.epoch_rng,
        }
        if self.data is not None:  # absent while restoring: older checkpoints have no "data"
            out["data"] = self.data
        return out

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
            state.parse_rng_state(value["epoch_rng"])

    def set_state(self, value):
        self.validate_state(value)
        self.epoch, self.step, self.global_step = value["epoch"], value["step"], value["global_step"]
        self.epoch_rng = value["epoch_rng"]
        self.saved_data = value.get("data")


class _Metrics:
    """The model's metric variables (running loss mean...) for a mid-epoch resume."""

    def __init__(self, model):
        self.model = model

    def get_state(self):
        return {"values": [numpy_copy(v) for v in self.model.metrics_variables]}

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


def _opaque(cb) -> bool:
    """``True`` for a callback whose state nothing here knows: the user's own classes and
    ``LambdaCallback`` (whose functions may keep state). Keras' other callbacks keep none
    that changes training, or have a known state (``state.callback_state``)."""
    if isinstance(cb, keras.callbacks.LambdaCallback):
        return True
    return not type(cb).__module__.startswith(("keras.", "keras_stable_state."))


class StableCheckpoint(keras.callbacks.Callback):
    """Checkpoints the whole training state during ``model.fit`` and resumes it exactly.

    On train begin it restores the newest readable checkpoint in ``directory``
    (model and optimizer variables by key, the learning-rate schedule check,
    the state of the callbacks given as ``callbacks=``, the global random
    state, metric accumulators and the position) and starts ``fit`` at the saved
    epoch. A checkpoint taken mid-epoch resumes at the next unseen batch: the
    batches already applied are drawn from the data and skipped, not trained on
    again. For NumPy array inputs with ``fit(shuffle=True)`` (or ``"batch"``)
    the callback takes the shuffle over from Keras' data adapter, whose order each
    backend draws with its own generator: at each epoch begin it draws the epoch's
    permutation with NumPy's global generator and hands the adapter the arrays
    gathered in that order (a copy of the arrays per epoch); the permutation is
    saved (record ``providers/data``), so the rest of an interrupted epoch is the
    same samples on any backend, whatever the resuming process was seeded with. A
    ``keras.utils.PyDataset``'s order is decided by the saved global NumPy/Python
    random state, also with ``workers > 1`` threads. With ``steps_per_epoch``,
    Keras keeps one iterator across epochs (a ``tf.data`` pipeline with
    ``repeat()``): the number of batches drawn from it before the epoch began is
    saved too, and a resumed run draws them from a fresh iterator first. Shuffled
    arrays whose order cannot be taken over (with ``steps_per_epoch``, or not NumPy
    arrays, on TensorFlow) get an :class:`InexactResumeWarning` on train begin, as
    does a resume on another backend than the writer's of a model with random
    layers (each backend draws its own dropout masks). A ``PyDataset`` that defines ``get_state()``
    (a dict of JSON values and NumPy arrays) and ``set_state(state)`` has that
    state saved (record ``providers/input``) and put back before the resumed
    epoch's iterator starts, so one that shuffles in ``on_epoch_end`` resumes
    exactly; one that overrides ``on_epoch_end`` without them, and a ``tf.data``
    pipeline that shuffles with ``reshuffle_each_iteration=True``, get an
    :class:`InexactResumeWarning` on train begin. The input is found through
    ``fit``'s call frame (Keras gives callbacks no handle on it); the batches a
    ``PyDataset``'s workers prefetched while ``fit`` built the model are dropped,
    so each epoch reads its own order. For other ``tf.data`` datasets and
    generators the skipped batches are drawn from a fresh iterator, so the
    resume is exact only if their order is deterministic.

    Each save is one ``ckpt-<global step>.h5`` file (see
    :func:`keras_stable_state.save_training_state`), written atomically through a
    ``.kss-*`` temporary file; the newest ``keep`` files are kept (only files named
    ``ckpt-<10 digits>.h5`` count, and a file that vanished meanwhile is skipped).

    The directory belongs to one writer at a time: on train begin the callback takes
    an exclusive ``flock`` on ``<directory>/.stable-checkpoint.lock`` (which names
    its pid and host) and releases it, removing the file, on train end. A second
    ``fit`` with a ``StableCheckpoint`` on the same directory, in another process or
    in another thread, is refused. The operating system releases the lock of a
    process that dies. If ``fit`` raises, Keras skips ``on_train_end``: the lock is
    then released when the callback is garbage collected, when the process exits,
    or when a ``StableCheckpoint`` on the same directory begins training again in
    the same thread. Holding the lock, it removes the ``.kss-*`` temporary files
    that a killed save left behind (``removed_temporary_files`` lists them).

    An unreadable checkpoint (truncated, failing a checksum, or of an unknown
    format) is moved into ``<directory>/unreadable/`` (``ckpt-<step>.h5``, or
    ``ckpt-<step>.h5.<n>`` if that name is taken) and the one before is restored,
    with an :class:`UnreadableCheckpointWarning` naming each moved file. If none is
    readable, training starts fresh, with that warning. ``skipped_checkpoints``
    lists ``(path, reason)`` and ``moved_checkpoints`` ``(path, new path)`` of each.
    A checkpoint that is locked by another process is not damaged: the callback
    raises :class:`~keras_stable_state.CheckpointInUseError` and never falls back.

    With ``steps_per_execution=k`` (TensorFlow and JAX; Keras refuses ``k > 1`` on
    Torch) Keras calls the batch callbacks once per execution of ``k`` batches, so
    saves happen at execution boundaries: an int ``save_freq`` must be a multiple
    of ``k`` and a save is taken at the first execution boundary at or after each
    multiple of ``save_freq`` batches (an epoch's last execution may hold fewer
    than ``k`` batches). A mid-epoch resume draws and skips whole executions.

    Saves happen after every callback has seen the epoch or batch end (a save
    requested at a batch end is written when the next batch or epoch begins),
    so the state of callbacks listed after this one, e.g. a learning rate that
    ``ReduceLROnPlateau`` just reduced, is in the checkpoint.

    The state of other callbacks (``EarlyStopping``, ``ReduceLROnPlateau``,
    ``ModelCheckpoint``...) is saved for the callbacks given as ``callbacks=``,
    by the name you give them: ``StableCheckpoint(d, callbacks={"es": es})``,
    then ``fit(..., callbacks=[ckpt, es])``. Keras gives a callback no public
    way to see the other callbacks of a ``fit`` call, so none are guessed: a
    callback not given here restarts with a fresh state on resume, as with
    Keras' ``BackupAndRestore``. Callbacks that count batches themselves see
    the skipped batches' begin and end events (with empty logs). On a resume,
    each callback of the ``fit`` whose state the library cannot see (one of your
    own classes, or a ``LambdaCallback``, without ``get_state()``/``set_state()``)
    gets an :class:`InexactResumeWarning`: its attributes start fresh in the new
    process. A ``get_state()`` that returns ``{}`` declares a callback stateless.

    On a mid-epoch resume Keras runs every callback's ``on_epoch_begin`` again for
    the interrupted epoch: the saved learning rate is put back once they have run
    (at the first batch begin this callback sees), so ``LearningRateScheduler`` is
    applied once per epoch. Every other callback of the ``fit`` that overrides
    ``on_epoch_begin`` (Keras' display, logging and saving callbacks aside) gets an
    :class:`InexactResumeWarning` on train begin, unless it has an attribute
    ``repeatable_epoch_begin = True``. At an epoch-boundary resume, such a callback
    listed before this one (its ``on_epoch_begin`` ran before the epoch-end save was
    written) gets that warning.

    Each checkpoint records the ``fit``'s batch size, number of samples and steps per
    epoch (where Keras knows them); on train begin they are compared with the resumed
    ``fit``'s. A mid-epoch checkpoint whose data differ is refused (``StateError``) or,
    with ``on_data_change="restart_epoch"``, its epoch is trained again from the first
    batch; an epoch-boundary one resumes with the new data. Both of the latter issue
    an :class:`InexactResumeWarning` naming each field, saved and now.

    On train begin every ``StableOptimizer`` the model tracks
    (``model.optimizer`` and optimizer attributes such as a GAN's
    ``d_optimizer``) is bound to the ``fit`` model (see
    :meth:`~keras_stable_state.StableOptimizer.bind`), and every optimizer the
    model tracks is saved and restored, each under its attribute name.

    Args:
        directory: Folder of the checkpoints (created if needed). Give each run
            its own folder; nothing else should write into it.
        save_freq: ``"epoch"`` or an ``int``: save every that many batches (a
            multiple of the model's ``steps_per_execution``).
        keep: How many newest checkpoints to keep (``>= 1``). Only fully
            written files count: with ``async_save`` the older files are
            removed once the new one is written.
        verbose: ``1`` prints one line per restore, and per save its file
            name, size (MB) and time (ms): with ``async_save``, the time of the
            background write and the time training was blocked, printed once
            the write has ended (at a later batch, the next save or train end).
            Lines go through Keras' ``print_msg`` (stdout, or absl logging
            when Keras is set to log).
        callbacks: Callbacks whose state to save and restore: a dict
            ``{name: callback}`` (the names key their state in the checkpoint)
            or a list (keyed by class name and index among callbacks of that
            class). Default: none. The ``History`` of the ``fit`` call
            (``model.history``) is always included, as ``"History/0"``.
        async_save: ``True`` writes each checkpoint in a background thread
            (:func:`~keras_stable_state.save_training_state` with
            ``blocking=False``): the training step waits only while the state
            is copied to host memory. A save first waits for the previous one;
            a failed background write raises its error (an ``OSError`` naming
            the file, or what the write raised) at the next batch, save or
            train end, whichever comes first; ``on_train_end`` waits for the
            last write and raises its failure (none is swallowed). A process
            killed during a write leaves a ``.kss-*`` temporary file, removed
            on the next train begin, and the checkpoints written before it.
        on_data_change: What a mid-epoch resume does when the batch size, number of
            samples or steps per epoch differ from the checkpoint's: ``"raise"``
            (default, ``StateError``) or ``"restart_epoch"``: train the interrupted
            epoch again from its first batch with the new data (the updates of its
            batches applied before the save stay in the weights and optimizer; its
            metrics start afresh, its order is drawn from the random state at the save
            and the global step continues), with an :class:`InexactResumeWarning`.

    Attributes:
        restore_report: The :class:`~keras_stable_state.RestoreReport` of the
            checkpoint restored on train begin, or ``None`` (fresh start).
        skipped_checkpoints: ``(path, reason)`` of each unreadable checkpoint
            skipped on train begin, newest first.
        moved_checkpoints: ``(path, new path)`` of each of them, moved into
            ``<directory>/unreadable/``.
        removed_temporary_files: Stale ``.kss-*`` temporary files removed on train begin.
        last_save: The :class:`~keras_stable_state.SaveHandle` of the newest
            background save (``async_save=True``), or ``None``.

    Raises:
        ValueError: for an invalid ``save_freq``, ``keep``, ``verbose`` or ``on_data_change``,
            a callback name that is empty or holds ``/``, ``#``, ``@`` or whitespace, or a
            ``directory`` ending in ``.orbax`` (StableCheckpoint writes ``.h5`` files; the
            Orbax engine is reached through ``save_training_state`` /
            ``restore_training_state``) (on construction).
        TypeError: if ``callbacks`` is not a dict or list of callbacks, or
            ``async_save`` is not a bool (on construction).
        OSError: with ``async_save``, at a later batch, the next save or train
            end: the error of a background write that failed (disk full, folder
            removed), naming the file; the checkpoints written before it are intact.
        BindingError: on train begin, if a ``StableOptimizer`` of the model is
            built on variables the model does not hold, or its state loaded by
            ``load_model`` does not fit the model.
        StateError: on train begin, if the checkpoint holds input state and the
            ``fit`` input defines no ``get_state()``/``set_state()``, or the other
            way round; if the model is not built; if an int
            ``save_freq`` is not a multiple of the model's ``steps_per_execution``
            (such a save would fall inside an execution); if the checkpoint to
            resume was saved at a batch inside an execution of the current
            ``steps_per_execution`` (saved with another one); or if an unreadable
            checkpoint cannot be moved aside (it would count in ``keep`` and be
            found again); if a mid-epoch checkpoint was saved with another batch size,
            number of samples or steps per epoch and ``on_data_change="raise"``; at the
            first epoch begin of a mid-epoch resume, if the checkpoint's epoch order
            (``providers/data``) is of shuffled NumPy arrays and this fit's input is not,
            or the other way round.
        CorruptCheckpointError: at the first epoch begin of a resume, if the
            checkpoint's ``providers/data`` record is not a permutation of the samples
            and a stream offset (the file is damaged).
        CheckpointInUseError: on train begin, if another ``StableCheckpoint``
            writer (another process, or another thread of this one) holds the
            directory, naming its pid and host; or if the newest checkpoint is
            locked by another process (for example open for writing): it is not
            damaged, so there is no fallback. Wait for the other process or use
            another directory.
        NotADirectoryError: on train begin, if ``directory`` is a file.
        OSError: on train begin, if the lock file cannot be created or locked
            (read-only folder, a file system without ``flock``), naming it.
        ContractError, BindingError, DtypeMismatchError, ScheduleMismatchError:
            and any other error of :func:`keras_stable_state.restore_training_state`
            for a readable checkpoint that does not fit the model (the model or
            its compile arguments changed): fix the model; nothing is moved aside.

    Example:
        >>> model.fit(x, y, epochs=10, callbacks=[StableCheckpoint("ckpts", save_freq=50), EarlyStopping()])
    """

    def __init__(
        self,
        directory,
        save_freq="epoch",
        keep=3,
        verbose=0,
        callbacks=None,
        async_save=False,
        on_data_change="raise",
    ):
        super().__init__()
        _fit_checks.refuse_orbax_directory(os.fspath(directory))
        self.on_data_change = _fit_checks.check_on_data_change(on_data_change)
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq >= 1):
            raise ValueError(f"`save_freq` must be 'epoch' or an int >= 1. Received: save_freq={save_freq!r}")
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"`keep` must be an int >= 1. Received: keep={keep!r}")
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
        if not isinstance(async_save, bool):
            raise TypeError(
                f"`async_save` must be True or False. Received: async_save={async_save!r} "
                f"(of type {type(async_save).__name__})"
            )
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.keep = keep
        self.verbose = int(verbose)
        self.async_save = async_save
        self.last_save = None
        self._in_flight = None
        self._in_flight_where = None
        self._given_callbacks = checkpoint._check_callbacks(callbacks, "StableCheckpoint")
        self._position = _Position()
        self._pending_restore = None
        self._save_requested = False
        self._skip_until = 0
        self._rng_after_skip = None
        self._spe = 1
        self._execution_begin = 0
        self._epoch_guard = None
        self._input = None
        self._order = _fit_input.EpochOrder()
        self.restore_report = None
        self.skipped_checkpoints = []
        self.moved_checkpoints = []
        self.removed_temporary_files = []
        self._lock = None
        self._lock_token = next(_TOKENS)
        self._lock_finalizer = False

    def get_config(self):
        """The constructor arguments but ``callbacks`` (live objects: pass them again).

        Returns:
            ``{"directory", "save_freq", "keep", "verbose", "async_save", "on_data_change"}``.
        """
        return {
            "directory": self.directory,
            "save_freq": self.save_freq,
            "keep": self.keep,
            "verbose": self.verbose,
            "async_save": self.async_save,
            "on_data_change": self.on_data_change,
        }

    @classmethod
    def from_config(cls, config):
        """A ``StableCheckpoint`` from :meth:`get_config`'s dict (plus ``callbacks=`` if given)."""
        return cls(**config)

    # -- discovery ------------------------------------------------------------------
    @property
    def _callbacks(self):
        """The callbacks given, and the ``History`` of the ``fit`` call (``model.history``,
        which Keras sets for every fit) so that a resumed run's history is whole."""
        found = dict(self._given_callbacks)
        history = getattr(self.model, "history", None) if self.model is not None else None
        given = [cb for cb in found.values() if isinstance(cb, keras.callbacks.History)]
        if isinstance(history, keras.callbacks.History) and not given:
            found.setdefault("History/0", history)
        return found

    def _say(self, message):
        if self.verbose:
            compat.print_msg(f"StableCheckpoint: {message}")

    # -- files ------------------------------------------------------------------------
    def checkpoints(self) -> list:
        """Paths of the checkpoints in ``directory``, newest first."""
        if not os.path.isdir(self.directory):
            return []
        names = sorted((n for n in os.listdir(self.directory) if _NAME.match(n)), reverse=True)
        return [os.path.join(self.directory, n) for n in names]

    def _providers(self):
        found = {"position": self._position, "metrics": _Metrics(self.model), "data": self._order}
        if self._input is not None:
            found["input"] = self._input
        return found

    def _inspect_input(self):
        """The ``fit`` input whose own state is saved (a ``PyDataset`` with ``get_state``
        and ``set_state``), or ``None``; warns for inputs a resume cannot replay."""
        adapter = compat.fit_data_adapter()
        if adapter is None:
            return None
        dataset = compat.py_dataset_of(adapter)
        if dataset is not None:
            compat.discard_prefetched(adapter)
            name = f"{type(dataset).__name__} (a keras.utils.PyDataset)"
            if callable(getattr(dataset, "get_state", None)) and callable(
                getattr(dataset, "set_state", None)
            ):
                return dataset
            if type(dataset).on_epoch_end is not keras.utils.PyDataset.on_epoch_end:
                warnings.warn(
                    f"StableCheckpoint: the input {name} overrides on_epoch_end() but has no "
                    "get_state()/set_state(), so the order or other state it sets there is not saved: "
                    "a resumed run reads its batches in another order from the resumed epoch on, and "
                    "does not end like an uninterrupted one. Define get_state() (a dict of JSON values "
                    "and NumPy arrays, e.g. the shuffled indices) and set_state(state) on it to resume "
                    "exactly.",
                    InexactResumeWarning,
                    stacklevel=3,
                )
            return None
        epoch_iterator = compat.fit_epoch_iterator()
        if compat.shuffled_unowned_arrays(epoch_iterator) and (
            keras.backend.backend() == "tensorflow" or compat.stream_persists(epoch_iterator)
        ):
            reason = (
                "with steps_per_epoch (one shuffled pass spans several epochs)"
                if compat.stream_persists(epoch_iterator)
                else "whose arrays are not NumPy arrays"
            )
            warnings.warn(
                f"StableCheckpoint: fit shuffles array inputs {reason}; StableCheckpoint cannot take "
                "that order over, and Keras draws it from a random state that is not saved on this "
                "backend, so a resumed run sees another order from the resumed epoch on. To resume "
                "exactly, pass NumPy arrays without steps_per_epoch, or shuffle=False.",
                InexactResumeWarning,
                stacklevel=3,
            )
        dataset = compat.tf_dataset_of(adapter)
        if dataset is not None:
            for op in compat.reshuffling_ops(dataset):
                warnings.warn(
                    f"StableCheckpoint: the input tf.data dataset {dataset!r} shuffles with "
                    f"{op!r}.shuffle(reshuffle_each_iteration=True): its order is drawn by tf.data "
                    "for each iteration and is not saved, so a resumed run sees another order from "
                    "the resumed epoch on (a mid-epoch resume skips batches of another order) and "
                    "does not end like an uninterrupted one. To resume exactly, use "
                    "reshuffle_each_iteration=False with a seed, or NumPy arrays or a "
                    "keras.utils.PyDataset with fit(shuffle=True).",
                    InexactResumeWarning,
                    stacklevel=3,
                )
        return None

    def _warn_inexact_resume(self, record):
        """Warn, at train begin, for a resume whose data or random draws cannot be those
        of an uninterrupted run: a mid-epoch checkpoint of shuffled arrays written before
        the epoch's order was saved, and a resume on another backend than the writer's of a
        model with random layers (each backend draws its own dropout masks and noise)."""
        pos = self._position
        saved = record.extra.get("providers", {})
        if pos.step > 0 and self._order.shuffle and "data" not in saved:
            warnings.warn(
                f"StableCheckpoint: the checkpoint (epoch {pos.epoch}, step {pos.step}) was written by "
                "a version that did not save the epoch's sample order; fit shuffles NumPy arrays, so "
                "the rest of the interrupted epoch is drawn in another order. Let the epoch finish "
                "before an interruption, or accept the difference.",
                InexactResumeWarning,
                stacklevel=3,
            )
        self._warn_unknown_callbacks()
        writer = (self.restore_report.writer or {}).get("backend")
        live = keras.backend.backend()
        if pos.step > 0:
            self._warn_loss_weighting(record, writer, live)
        if writer and writer != live:
            random_layers = sorted(
                {
                    layer.name
                    for layer in compat.flatten_layers(self.model)
                    if compat.seed_generator_states(layer)
                }
            )
            if random_layers:
                warnings.warn(
                    f"StableCheckpoint: the checkpoint was written on {writer} and training resumes on "
                    f"{live}; the layers {random_layers} draw random numbers (dropout masks, noise), and "
                    f"{live} draws other ones from the same seed state than {writer}, so the resumed run "
                    "trains like an uninterrupted one only up to that randomness. Resume on "
                    f"{writer} for an exact continuation.",
                    InexactResumeWarning,
                    stacklevel=3,
                )

    def _warn_loss_weighting(self, record, writer, live):
        """Warn when the saved per-output loss means of the interrupted epoch were counted
        in other units than this ``fit`` counts them (TensorFlow counts batches for an
        input of unknown batch size, the other backends samples; see
        ``_keras_compat.per_output_loss_weighting``): the resumed epoch's History
        ``<output>_loss`` values would then weigh the saved and the new batches unlike an
        uninterrupted run. Training itself is not affected."""
        indices, weighting = compat.per_output_loss_weighting(self.model)
        total = compat.total_loss_count_index(self.model)
        values = state.join_arrays(record.extra.get("providers", {}).get("metrics"), record.arrays)
        saved = values.get("values") if isinstance(values, dict) else None
        if not indices or total is None or not isinstance(saved, list) or len(saved) <= max(indices):
            return
        samples = float(saved[total])
        counts = [float(saved[i]) for i in indices]
        batches = self._position.step
        if samples == batches or not all(c > 0 for c in counts):
            return  # batch size 1, or nothing counted: both units agree
        saved_weighting = "samples" if all(c == samples for c in counts) else "batches"
        if saved_weighting == weighting:
            return
        names = sorted(
            {v.path.rsplit("/", 1)[0] for i, v in enumerate(self.model.metrics_variables) if i in indices}
        )
        where = f"on {writer}" if writer else "by another fit"
        warnings.warn(
            f"StableCheckpoint: the checkpoint (epoch {self._position.epoch}, step {batches}) was written "
            f"{where}, whose per-output loss trackers {names} counted {saved_weighting} in the interrupted "
            f"epoch; this fit on {live} counts {weighting} (TensorFlow counts batches when the input's "
            "batch size is not static, e.g. a generator or tf.data with batch()). The History's "
            "per-output losses of that epoch weigh the saved and the new batches unlike an uninterrupted "
            "run; weights, optimizer state, the total loss and later epochs are not affected. Resume "
            f"{'on ' + writer if writer and writer != live else 'with the same kind of input'} or from an "
            "epoch-boundary checkpoint (save_freq='epoch') for exact per-output losses.",
            InexactResumeWarning,
            stacklevel=4,
        )

    def _warn_unknown_callbacks(self):
        """Warn, on a resume, for each callback of this ``fit`` whose state the library
        cannot see: one of the user's own (or a ``LambdaCallback``) without
        ``get_state()``/``set_state()`` and not a kind whose state is known. Its attributes
        start fresh in the new process, so if they decide anything (a counter, a best
        value) the resumed run acts otherwise. ``get_state()`` returning ``{}`` declares a
        callback stateless."""
        for cb in compat.fit_callbacks():
            if cb is self or state.callback_state(cb) is not None or not _opaque(cb):
                continue
            name = type(cb).__name__
            warnings.warn(
                f"StableCheckpoint: the callback {name} of this fit has no get_state()/set_state(), "
                "so any state it keeps in its attributes is not in the checkpoint and starts fresh in "
                "the resumed run; if that state changes training (a counter, a best value), the run "
                "does not end like an uninterrupted one. Give it get_state() (a dict of JSON values "
                "and NumPy arrays) and set_state(state) and pass it in StableCheckpoint(callbacks=...); "
                "a get_state() that returns {} declares it stateless.",
                InexactResumeWarning,
                stacklevel=4,
            )

    def _warn_unsaved_callbacks(self):
        """Warn for each stateful callback of this ``fit`` not given in ``callbacks=``: a
        resume restarts it fresh (e.g. EarlyStopping's ``wait`` and ``best``)."""
        given = [id(cb) for cb in self._callbacks.values()]
        for cb in compat.fit_callbacks():
            if cb is self or id(cb) in given or isinstance(cb, keras.callbacks.History):
                continue
            saved = state.callback_state(cb)
            if not saved:  # no state we know of, or none to keep (LearningRateScheduler)
                continue
            name = type(cb).__name__
            fields = ", ".join(sorted(map(str, saved))) if isinstance(saved, dict) else "its get_state()"
            warnings.warn(
                f"StableCheckpoint: the callback {name} of this fit keeps state "
                f"({fields}) that is not saved, because it is not given in "
                f"StableCheckpoint(callbacks=...): a resumed run restarts it fresh, so it may act "
                "(stop, change the learning rate, save) at another step than an uninterrupted run. "
                f'Pass it by name, e.g. StableCheckpoint(directory, callbacks={{"{name.lower()}": cb}}).',
                InexactResumeWarning,
                stacklevel=3,
            )

    # -- the directory --------------------------------------------------------------
    def _take_directory(self):
        """Create ``directory``, lock it, remove stale temporary files."""
        directory = self.directory
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"StableCheckpoint's directory {directory!r} is a file, not a folder. Pass a folder "
                "(it holds ckpt-<step>.h5 files); to save one file use keras_stable_state.save_training_state",
                directory,
            )
        os.makedirs(directory, exist_ok=True)
        if fcntl is not None:
            self._lock = _DirectoryLock.acquire(directory, self._lock_token)
            if not self._lock_finalizer:
                # released when this callback is garbage collected or the process exits
                weakref.finalize(self, _release_token, self._lock_token)
                self._lock_finalizer = True
        removed = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.startswith(TEMP_PREFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                removed.append(entry.path)
        self.removed_temporary_files = removed
        if removed:
            self._say(f"removed {len(removed)} temporary file(s) of an interrupted save: {removed}")

    def _release_directory(self):
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(self._lock_token)

    def _move_aside(self, path):
        """Move an unreadable checkpoint into ``<directory>/unreadable/``; its new path."""
        folder = os.path.join(self.directory, UNREADABLE_DIR)
        name = os.path.basename(path)
        target = os.path.join(folder, name)
        try:
            os.makedirs(folder, exist_ok=True)
            n = 1
            while os.path.lexists(target):
                target = os.path.join(folder, f"{name}.{n}")
                n += 1
            os.rename(path, target)
        except FileNotFoundError:
            if not os.path.lexists(path):
                return None  # removed meanwhile: nothing left to count in `keep`
            raise
        except OSError as err:
            raise StateError(
                f"Checkpoint {path!r} is unreadable and could not be moved aside to {target!r} ({err}). "
                "Move or delete it yourself: StableCheckpoint does not restore it, and left in place it "
                "would count as one of the `keep` newest checkpoints.",
            ) from err
        return target

    # -- restore ----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise StateError(
                f"StableCheckpoint needs a built model to restore into; model {model.name!r} is not built. "
                "Call it on a batch or `model.build(input_shape)` before fit()."
            )
        spe = int(getattr(model, "steps_per_execution", 1) or 1)
        if self.save_freq != "epoch" and self.save_freq % spe:
            raise StateError(
                f"StableCheckpoint(save_freq={self.save_freq}) asks for saves inside an execution: the "
                f"model was compiled with steps_per_execution={spe}, so callbacks see only every "
                f"{spe}th batch and a save after {self.save_freq} batches cannot be taken. Use a "
                f"save_freq that is a multiple of {spe} (e.g. {spe * max(1, round(self.save_freq / spe))}), "
                "or save_freq='epoch', or compile with a steps_per_execution that divides it.",
                key="save_freq",
                expected=f"a multiple of steps_per_execution={spe}",
                received=self.save_freq,
            )
        self._spe = spe
        for opt in tracked_optimizers(model).values():
            stable = stable_optimizer_in(opt)
            if stable is not None:
                stable.bind(model)  # model.optimizer is opt (or an optimizer attribute): its owner
        # TensorFlow builds compiled metrics at the first trace: build them now, so that a
        # mid-epoch resume can put their saved values back (a no-op where fit built them).
        compat.build_compile_state(model)
        self._position = _Position(spe)
        self._pending_restore = None
        self._save_requested = False
        self._skip_until = 0
        self._rng_after_skip = None
        self._execution_begin = 0
        self.restore_report = None
        self.skipped_checkpoints = []
        self.moved_checkpoints = []
        # A background save of an earlier fit (one that raised) is written before the
        # directory is read; its error belonged to that fit.
        self._in_flight = None
        _async.wait_for_folder(_async.folder_of(os.path.join(self.directory, "ckpt")))
        self._input = self._inspect_input()
        self._order = _fit_input.EpochOrder(compat.fit_epoch_iterator())
        self._warn_unsaved_callbacks()
        try:
            self._take_directory()
            self._restore_newest()
            self._check_resume()
        except BaseException:
            self._release_directory()  # fit stops here; Keras will not call on_train_end
            raise

    def _check_resume(self):
        # The on_epoch_begin callbacks Keras runs again for a resumed epoch, then the data size.
        pos = self._position
        self._epoch_guard = _fit_checks.EpochBeginGuard.start(self, pos)
        live = _fit_checks.live_data(self.params)
        if self.restore_report is not None and _fit_checks.check_data(
            pos.saved_data, live, pos, self.on_data_change
        ):
            pos.step = 0  # on_data_change="restart_epoch": the interrupted epoch from its first batch
        pos.data = live

    def _restore_newest(self):
        restored = None
        for path in self.checkpoints():
            try:
                record = checkpoint.storage.read_file(path)
                self._restore(path, record)
            except CheckpointInUseError as err:
                holder = f" ({err.holder})" if err.holder else ""
                raise CheckpointInUseError(
                    f"Checkpoint {path!r}, the newest one left in {self.directory!r}, is in use by "
                    f"another process{holder}: {err} It is not damaged, so StableCheckpoint does not fall "
                    "back to an older checkpoint. Wait for that process to close it, or stop it, then fit "
                    "again.",
                    path=path,
                    holder=err.holder,
                ) from err
            except FileNotFoundError:
                if os.path.lexists(path):
                    raise
                continue  # removed since it was listed: the next one is the newest
            except (CorruptCheckpointError, CheckpointFormatError) as err:
                self._position = _Position(self._spe)
                self._pending_restore = None
                self.restore_report = None
                self.skipped_checkpoints.append((path, str(err)))
                self.moved_checkpoints.append((path, self._move_aside(path)))
                continue
            restored = path
            break
        if self.skipped_checkpoints:
            self._warn_unreadable(restored)
        elif restored is None:
            self._say(f"no checkpoint in {self.directory}; starting fresh")

    def _warn_unreadable(self, restored):
        reasons = dict(self.skipped_checkpoints)
        moved = "; ".join(
            f"{path!r} -> {target!r} ({reasons[path]})"
            if target is not None
            else f"{path!r} (removed meanwhile; {reasons[path]})"
            for path, target in self.moved_checkpoints
        )
        count = len(self.moved_checkpoints)
        head = (
            f"StableCheckpoint: {count} unreadable checkpoint{'s' if count > 1 else ''} in {self.directory!r}"
        )
        if restored is None:
            tail = (
                "No readable checkpoint is left: training starts fresh from the model's current weights. "
                "If you have a copy of a good checkpoint, stop and put it back in the directory."
            )
        else:
            pos = self._position
            tail = (
                f"Fell back to the older {restored!r} (epoch {pos.epoch}, step {pos.step} of the epoch, "
                f"global step {pos.global_step}); the training after it is redone."
            )
        warnings.warn(
            f"{head}, moved aside: {moved}. {tail}",
            UnreadableCheckpointWarning,
            stacklevel=2,
        )

    def _restore(self, path, record):
        # Variables, optimizer, schedule check and position now; callbacks, metrics and
        # the epoch-start random state once every callback has run on_train_begin.
        self.restore_report = checkpoint.restore_training_state(
            path, self.model, state={"position": self._position}, include_rng=False
        )
        pos = self._position
        self._pending_restore = record
        self._warn_inexact_resume(record)
        compat.set_initial_epoch(self.model, pos.epoch)
        self._say(
            f"restored {os.path.basename(path)}: epoch {pos.epoch}, step {pos.step} of the epoch, "
            f"global step {pos.global_step}"
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._collect(wait=False)
        record, self._pending_restore = self._pending_restore, None
        saved_data = None
        if record is not None:
            saved_data = self._apply_pending(record)
        elif self._save_requested:
            self._position.step = 0
            self._save()
        self._position.epoch = epoch
        if self._position.step == 0:
            # The random state before this epoch's data order is drawn, then the order.
            self._position.epoch_rng = state.rng_state()
            self._order.begin_epoch(saved_data)

    def _apply_pending(self, record):
        # Check everything first (callback states, both random states, metric values, the
        # data order), then set. Returns the checked data record of an epoch-boundary resume.
        setters = checkpoint.plan_callbacks(record, self._callbacks, self.restore_report)
        extra, arrays = record.extra, record.arrays
        pos = self._position
        saved_rng = state.join_arrays(extra.get("rng"), arrays)
        parsed_saved = state.parse_rng_state(saved_rng)
        metrics, values = _Metrics(self.model), None
        input_state = self._plan_input(extra, arrays)
        saved_data = extra.get("providers", {}).get("data")
        if saved_data is not None:
            saved_data = self._order.check(state.join_arrays(saved_data, arrays), mid_epoch=pos.step > 0)
        if pos.step > 0:
            parsed_epoch = state.parse_rng_state(pos.epoch_rng)
            values = state.join_arrays(extra.get("providers", {}).get("metrics"), arrays)
            metrics.validate_state(values)
        for setter in setters:
            setter()
        if input_state is not None:
            # Before the epoch's iterator exists, so before any worker prefetches a batch.
            self._input.set_state(input_state)
            self.restore_report.restored_state.append("state:input")
        if pos.step > 0:
            # Replay the epoch's data order from the random state it was drawn with, skip
            # the batches already applied, then continue from the random state at the save
            # (e.g. Torch's unseeded dropout draws from the global generator every step).
            state.apply_rng_state(parsed_epoch)
            metrics.set_state(values)
            self._order.begin_epoch(saved_data, mid_epoch=True)
            self._skip_batches(pos.step)
            self._rng_after_skip = saved_rng
            return None
        state.apply_rng_state(parsed_saved)
        return saved_data

    def _plan_input(self, extra, arrays):
        """The checked saved state of the ``fit`` input, or ``None`` when neither the
        checkpoint nor the input has one."""
        saved = extra.get("providers", {}).get("input")
        name = None if self._input is None else type(self._input).__name__
        if saved is None and self._input is None:
            return None
        if saved is None:
            raise StateError(
                f"The fit input {name} defines get_state()/set_state(), but the checkpoint holds no "
                "input state (it was saved from an input without them): its order cannot be put "
                "back. Resume with the input the checkpoint was saved with, or start a new run in "
                "another directory.",
                key="providers/input",
            )
        if self._input is None:
            raise StateError(
                "The checkpoint holds the state of its fit input (a keras.utils.PyDataset with "
                "get_state()/set_state()), but this fit's input has none: its order cannot be put "
                "back. Pass the same kind of input as when it was saved.",
                key="providers/input",
            )
        value = state.join_arrays(saved, arrays)
        return state.check_provider_state(self._input, value, "providers/input")

    def _skip_batches(self, count):
        """Draw ``count`` batches (whole executions of ``steps_per_execution`` batches) from
        the data without training on them."""
        self._skip_until = count
        compat.skip_batches(self.model, count // self._spe, per_call=self._spe)

    # -- save -------------------------------------------------------------------------
    def on_train_batch_begin(self, batch, logs=None):
        self._collect(wait=False)
        guard, self._epoch_guard = self._epoch_guard, None
        if guard is not None:  # every callback's on_epoch_begin has run for the resumed epoch
            guard.after_epoch_begin()
        # With steps_per_execution=k, Keras calls this once per execution, with the
        # execution's first batch, and on_train_batch_end with its last.
        self._execution_begin = batch
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
        last = batch
        steps = (self.params or {}).get("steps")
        if steps:  # the epoch's last execution may hold fewer than steps_per_execution batches
            last = min(last, steps - 1)
        count = max(1, last - self._execution_begin + 1)
        before = self._position.global_step
        self._position.global_step += count
        self._position.step = self._execution_begin + count
        if (
            self.save_freq != "epoch"
            and self._position.global_step // self.save_freq > before // self.save_freq
        ):
            self._save_requested = True

    def on_epoch_end(self, epoch, logs=None):
        self._skip_until = 0
        self._position.epoch = epoch + 1
        self._position.step = 0
        if self.save_freq == "epoch":
            self._save_requested = True

    def on_train_end(self, logs=None):
        try:
            if self._save_requested:
                self._save()
            self._collect(wait=True)  # the last background save: waited for, and its failure raised
        finally:
            compat.set_initial_epoch(self.model, None)
            self._release_directory()

    def _save(self):
        self._save_requested = False
        self._collect(wait=True)  # the previous background save ends first; its failure is raised
        pos = self._position
        if pos.step == 0:
            pos.epoch_rng = state.rng_state()
            self._order.stream_offset = compat.stream_position(self._order.epoch_iterator)
        name = f"ckpt-{pos.global_step:010d}.h5"
        path = os.path.join(self.directory, name)
        where = f"epoch {pos.epoch}, step {pos.step}, global step {pos.global_step}"
        started = time.perf_counter()
        result = checkpoint.save_training_state(
            path,
            self.model,
            callbacks=self._callbacks,
            state=self._providers(),
            blocking=not self.async_save,
        )
        if self.async_save:
            self.last_save = self._in_flight = result
            self._in_flight_where = where
            return
        self._saved(path, where, time.perf_counter() - started, None)

    def _collect(self, wait):
        """Finish the background save in flight, if any (with ``wait=False`` only if it has
        ended): raise its error, or prune and report it."""
        handle = self._in_flight
        if handle is None or (not wait and not handle.done()):
            return
        self._in_flight = None
        handle.wait()
        self._saved(handle.path, self._in_flight_where, handle.write_secs, handle.blocked_secs)

    def _saved(self, path, where, secs, blocked_secs):
        # The file just written always stays, even if an older run left higher step numbers.
        for old in [p for p in self.checkpoints() if p != path][self.keep - 1 :]:
            try:
                os.remove(old)
            except FileNotFoundError:
                continue  # removed by someone else since it was listed
        if self.verbose:
            size_mb = os.path.getsize(path) / 1e6
            timing = f"{secs * 1e3:.0f} ms"
            if blocked_secs is not None:
                timing = f"{timing} in the background, training blocked {blocked_secs * 1e3:.0f} ms"
            self._say(f"saved {os.path.basename(path)} ({where}): {size_mb:.2f} MB in {timing}")
