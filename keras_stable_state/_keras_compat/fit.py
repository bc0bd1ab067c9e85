"""The ``fit`` call running in this thread: its epoch iterator, data adapter and callbacks,
its initial epoch and train function, and the compiled metrics and loss trackers it builds.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import keras

from keras_stable_state.errors import StateError

__all__ = [
    "build_compile_state",
    "fit_callbacks",
    "fit_data_adapter",
    "fit_epoch_iterator",
    "fit_frame",
    "fit_threads",
    "outside_stacklevel",
    "per_output_loss_weighting",
    "replica_count",
    "set_initial_epoch",
    "skip_batches",
    "total_loss_count_index",
]


def set_initial_epoch(model, epoch) -> None:
    """Set the epoch ``fit`` starts from (the trainer's ``_initial_epoch``; ``None``: fit's own)."""
    model._initial_epoch = epoch


def skip_batches(model, count: int, per_call: int = 1) -> None:
    """Make ``model``'s next ``count`` calls of its train function draw their batches
    (``per_call`` each: the ``steps_per_execution`` it was compiled with) without training
    on them, then put the train function back. ``fit`` calls ``train_function`` once per
    execution: on JAX with ``(state, iterator)``, on TensorFlow with ``(iterator)``, on
    Torch with a list of ``per_call`` batches already drawn (Torch allows only 1)."""
    original = model.train_function
    remaining = [count]
    backend = keras.backend.backend()

    def skip(*args):
        remaining[0] -= 1
        if remaining[0] == 0:
            model.train_function = original
        if backend == "jax":
            state_arg, iterator = args
            for _ in range(per_call):
                next(iterator)
            return {}, state_arg
        if backend == "tensorflow":
            for _ in range(per_call):
                next(args[0])
            return {}
        return {}

    model.train_function = skip


def fit_epoch_iterator() -> Any:
    """The ``EpochIterator`` of the ``fit`` call running in this thread, or ``None``.

    Keras gives a callback no handle on ``fit``'s inputs: this looks up the call stack
    for the ``fit`` frame of a Keras trainer (TensorFlow, JAX and Torch name its
    ``EpochIterator`` ``epoch_iterator``, ``keras/src/trainers/epoch_iterator.py``).
    ``None`` outside ``fit`` or under a trainer that keeps it elsewhere."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and "epoch_iterator" in frame.f_code.co_varnames:
            found = frame.f_locals.get("epoch_iterator")
            if isinstance(found, EpochIterator):
                return found
        frame = frame.f_back
    return None


def outside_stacklevel() -> int:
    """The ``stacklevel`` that points the caller's warning at the first frame outside
    keras_stable_state (the user's code or Keras' callback list)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("keras_stable_state"):
        frame, level = frame.f_back, level + 1
    return level


def fit_frame() -> FrameType | None:
    """The frame of the ``fit`` call running in this thread (found as `fit_epoch_iterator`
    finds its iterator), or ``None``: a caller learns later whether that ``fit`` still runs
    by looking for the frame on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and "epoch_iterator" in frame.f_code.co_varnames:
            return frame
        frame = frame.f_back
    return None


def fit_threads(model) -> list:
    """``(ident, name)`` of every thread whose call stack runs a Keras trainer's ``fit`` of
    ``model`` (the current thread included), found as `fit_epoch_iterator` finds its
    own: the ``fit`` frame holding an ``epoch_iterator``, whose ``self`` is ``model``."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "fit" and "epoch_iterator" in code.co_varnames and "self" in code.co_varnames:
                if frame.f_locals.get("self") is model:
                    found.append((ident, names.get(ident, str(ident))))
                    break
            frame = frame.f_back
    return found


def fit_data_adapter():
    """The data adapter of the ``fit`` call running in this thread (that of
    `fit_epoch_iterator`), or ``None``."""
    found = fit_epoch_iterator()
    return None if found is None else found.data_adapter


def _compile_state_unbuilt(model) -> bool:
    metrics, loss = getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None)
    return (metrics is not None and not metrics.built) or (loss is not None and not loss.built)


def build_compile_state(model) -> bool:
    """Build ``model``'s compiled metrics and loss trackers now, inside ``fit``, if they
    are not built yet; whether it built them.

    On JAX and Torch (and on TensorFlow under a distribution strategy) ``fit`` builds
    them symbolically before training (``Trainer._symbolic_build``); on TensorFlow
    without one it defers that to the first trace of the train function, after
    ``on_train_begin`` and ``on_epoch_begin``, so a mid-epoch resume could not put the
    saved metric values back. This makes the same ``_symbolic_build`` call Keras makes
    on the other backends, with a symbolic batch (``KerasTensor`` of each shape and
    dtype) made from the ``element_spec`` of the ``tf.data`` dataset ``fit``'s
    ``TFEpochIterator`` iterates: no batch is drawn and no dataset made, so no data or
    random state is consumed. ``_symbolic_build`` also builds an unbuilt optimizer
    (zeros, as its first train step would). Does nothing when they are built, outside
    ``fit``, or where fit's iterator has no element spec (it then returns ``False``).
    """
    if not _compile_state_unbuilt(model):
        return False
    dataset = getattr(fit_epoch_iterator(), "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return False
    import tensorflow as tf

    def symbolic(s):
        if not isinstance(s, tf.TypeSpec):
            return s
        if s.shape.rank is None:
            raise StateError(
                f"Cannot build the compiled metrics of model {model.name!r} before training: its fit "
                f"input has an element of unknown rank ({s!r}). Give the tf.data pipeline static "
                "ranks (e.g. `dataset.map(lambda x, y: (tf.ensure_shape(x, ...), y))`), or build them "
                "yourself with `model.evaluate` on one batch before fit()."
            )
        return keras.KerasTensor(
            tuple(s.shape.as_list()),
            keras.backend.standardize_dtype(s.dtype),
            sparse=isinstance(s, tf.SparseTensorSpec),
            ragged=isinstance(s, tf.RaggedTensorSpec),
        )

    model._symbolic_build(data_batch=tf.nest.map_structure(symbolic, spec))
    return True


def replica_count(model) -> int | None:
    """The number of ``tf.distribute`` replicas ``model`` trains on (its strategy's
    ``num_replicas_in_sync``, ``1`` without one) on the TensorFlow backend; ``None`` on the
    others (a JAX mesh is not counted: its results do not depend on it)."""
    if keras.backend.backend() != "tensorflow":
        return None
    strategy = getattr(model, "distribute_strategy", None)
    count = getattr(strategy, "num_replicas_in_sync", None)
    return int(count) if isinstance(count, int) and count >= 1 else None


def per_output_loss_weighting(model) -> tuple:
    """``(indices, weighting)`` of ``model``'s per-output loss trackers (the
    ``<output>_loss`` means of a multi-output model, ``CompileLoss.metrics``): the
    positions in ``model.metrics_variables`` of their ``count`` variables, and what
    this backend's ``fit`` counts in them, ``"samples"`` or ``"batches"``.

    ``CompileLoss.call`` updates each with ``sample_weight=y_pred.shape[0]``, the static
    batch size: JAX and Torch always know it; TensorFlow's traced train step knows it
    only when the input has a static batch dimension (NumPy arrays do; a generator or a
    ``tf.data`` pipeline with ``batch()`` does not), and otherwise counts each batch
    once. The total loss tracker counts samples on every backend. ``((), "samples")``
    when the model has no per-output loss trackers.
    """
    loss = getattr(model, "_compile_loss", None)
    trackers = [m for m in (getattr(loss, "metrics", None) or []) if m is not None]
    if not trackers:
        return (), "samples"
    counts = {id(v) for m in trackers for v in m.variables if v.path.endswith("/count")}
    indices = tuple(i for i, v in enumerate(model.metrics_variables) if id(v) in counts)
    if keras.backend.backend() != "tensorflow":
        return indices, "samples"
    import tensorflow as tf

    dataset = getattr(fit_epoch_iterator(), "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    flat = [s for s in tf.nest.flatten(spec) if isinstance(s, tf.TypeSpec)] if spec is not None else []
    static = bool(flat) and flat[0].shape.rank and flat[0].shape[0] is not None
    return indices, "samples" if static else "batches"


def per_output_loss_names(model) -> list[str]:
    """Sorted names of ``model``'s per-output loss trackers (``CompileLoss.metrics``, the
    ``<output>_loss`` means of a multi-output model); ``[]`` when it has none."""
    loss = getattr(model, "_compile_loss", None)
    return sorted(m.name for m in (getattr(loss, "metrics", None) or []) if m is not None)


def fit_validation_arrays() -> tuple[int, int]:
    """``(samples, batch_size)`` of the running ``fit``'s validation arrays: its
    ``validation_data`` local (what ``validation_split`` took, or the user's arrays) and
    ``validation_batch_size`` or ``batch_size`` (Keras' default 32). ``(0, batch_size)``
    outside a ``fit`` or when the validation data has no leading array dimension (datasets,
    generators)."""
    frame = fit_frame()
    local = frame.f_locals if frame is not None else {}
    arrays = [a for a in keras.tree.flatten(local.get("validation_data")) if hasattr(a, "shape")]
    size = local.get("validation_batch_size") or local.get("batch_size") or 32
    count = int(arrays[0].shape[0]) if arrays and len(arrays[0].shape) else 0
    return count, int(size)


def total_loss_count_index(model):
    """Position of the total loss tracker's ``count`` in ``model.metrics_variables``
    (it counts samples on every backend), or ``None``."""
    tracker = getattr(model, "_loss_tracker", None)
    ids = {id(v) for v in getattr(tracker, "variables", []) if v.path.endswith("/count")}
    return next((i for i, v in enumerate(model.metrics_variables) if id(v) in ids), None)


def fit_callbacks() -> list:
    """The callbacks of the ``fit`` call running in this thread (its ``CallbackList``), or ``[]``.

    ``StableCheckpoint`` saves the state of those it can read (keyed by class and position,
    ``_fit.checks.fit_keyed``) and warns about the others; Keras gives a callback no handle on
    its siblings, so this is the same look-up as `fit_data_adapter`, for the ``callbacks``
    local that TensorFlow, JAX and Torch trainers' ``fit`` build."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and "callbacks" in frame.f_code.co_varnames:
            found = frame.f_locals.get("callbacks")
            if isinstance(found, keras.callbacks.CallbackList):
                return list(found.callbacks)
        frame = frame.f_back
    return []
