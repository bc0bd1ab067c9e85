"""Every use of Keras internals, in one place, checked against the supported Keras range.

keras_stable_state relies on a few things Keras does not export: its saving
walk (``keras/src/saving/saving_lib.py``), the variable lists layers and
optimizers keep (``_trainable_variables``, ``_non_trainable_variables``,
``_variables``), ``MultiOptimizer``'s routing tables, the trainer's
``train_function`` and ``_initial_epoch``, ``ModelCheckpoint``'s counters,
Keras' global seed generator and ``print_msg``. They are reached only through
the functions here, so a Keras release that changes them breaks one module.

The supported range is pyproject's ``keras>=3.15,<4``. Importing the package
with a Keras outside it raises :class:`UnsupportedKerasError` (an
``ImportError``): these internals decide which slot lands on which variable, and
a silent mismatch is exactly what this library exists to prevent.

The save/load methods of an optimizer wrapped by ``StableOptimizer`` are
replaced here too (:func:`hand_over`): while wrapped, its state is saved and
loaded by key by the wrapper; used on its own after being taken out of the
wrapper, they raise a :class:`~keras_stable_state.StateError`.
"""

from __future__ import annotations

import queue
import re
import sys

import keras

from keras_stable_state.errors import StateError

__all__ = ["SUPPORTED_KERAS", "UnsupportedKerasError", "check_keras_version"]

SUPPORTED_KERAS = ((3, 15), (4, 0))  # [lowest, first unsupported): pyproject's keras>=3.15,<4


class UnsupportedKerasError(ImportError):
    """The installed Keras is outside the range whose internals this package uses."""


def check_keras_version(version: str) -> None:
    """Refuse a Keras version outside :data:`SUPPORTED_KERAS`.

    Raises:
        UnsupportedKerasError: naming the installed and the supported versions.
    """
    match = re.match(r"(\d+)\.(\d+)", str(version))
    (lo, hi) = SUPPORTED_KERAS
    if match is not None and lo <= (int(match.group(1)), int(match.group(2))) < hi:
        return
    raise UnsupportedKerasError(
        f"keras_stable_state supports Keras >={lo[0]}.{lo[1]},<{hi[0]}; installed: Keras {version}. It uses "
        "Keras internals (the saving walk, optimizer variable lists) that decide which saved slot lands on "
        f"which variable, and refuses to guess with another version. Install 'keras>={lo[0]}.{lo[1]},"
        f"<{hi[0]}'."
    )


check_keras_version(keras.__version__)


# -- naming and the saving walk ------------------------------------------------------------
def to_snake_case(name: str) -> str:
    """Keras' ``to_snake_case`` (the base of its auto-generated layer names)."""
    return keras.src.utils.naming.to_snake_case(name)


# Keras' own attribute skip sets by object type. ``saving_lib.get_attr_skipset`` caches
# under ``saving_attr_skipset_<type>`` but looks under ``saving_attr_skiplist_<type>``
# (Keras 3.15), so it builds a reference ``Layer()`` (about 1 ms) for every object walked.
_SKIPSETS: dict = {}


def walk_saveable(obj):
    """``(attribute, child)`` pairs Keras' saving walk visits under ``obj`` (none for
    objects Keras does not save).

    The same pairs in the same order as Keras' ``saving_lib._walk_saveable``: the
    ``layers`` of a Sequential or Functional model first, then every attribute in
    ``dir()`` order with private ones last, less those of a plain reference object
    of the same type (``saving_lib.get_attr_skipset``, computed once per type here).
    """
    from keras.src.saving import keras_saveable, saving_lib

    if not isinstance(obj, keras_saveable.KerasSaveable):
        return
    kind = obj._obj_type()
    skip = _SKIPSETS.get(kind)
    if skip is None:
        skip = _SKIPSETS[kind] = frozenset(saving_lib.get_attr_skipset(kind))
    if kind in ("Sequential", "Functional"):
        yield "layers", obj.layers
    # Filtered before sorting (the same order: the filter does not depend on it), so only
    # the few attributes left are sorted, not all of ``dir()``.
    names = [a for a in dir(obj) if a not in skip and a[:2] != "__"]
    for attr in sorted(names, key=saving_lib._name_key):
        try:
            child = getattr(obj, attr)
        except Exception:  # noqa: BLE001 (Keras' walk skips attributes that raise, so must this one)
            continue
        yield attr, child


def obj_type(obj) -> str:
    """Keras' ``_obj_type()`` (``"Sequential"``, ``"Functional"``, ``"Layer"``...)."""
    return obj._obj_type()


# -- layers and models -----------------------------------------------------------------------
def layer_own_variables(layer):
    """``(trainable, non_trainable)``: the variables a layer owns itself, in Keras' order."""
    return list(layer._trainable_variables), list(layer._non_trainable_variables)


def seed_generator_states(layer) -> list:
    """The state variables of a layer's own seed generators."""
    return [sg.state for sg in layer._seed_generators]


def metric_own_variables(metric) -> list:
    return list(metric._variables)


def flatten_layers(model):
    """Every layer inside ``model`` (Keras' ``_flatten_layers``)."""
    return model._flatten_layers()


def called_as_layer(model) -> bool:
    """Whether ``model`` was called on another model's inputs (it is a layer of that model)."""
    return bool(getattr(model, "_inbound_nodes", None))


def index_lookup_class():
    """Keras' ``IndexLookup``, the base of ``StringLookup`` and ``IntegerLookup``."""
    from keras.src.layers.preprocessing.index_lookup import IndexLookup

    return IndexLookup


def text_vectorization_lookup(layer):
    """The lookup layer a ``TextVectorization`` keeps its vocabulary in."""
    return layer._lookup_layer


def lookup_token_start(lookup) -> int:
    """How many special tokens (mask, OOV) come before the first vocabulary token."""
    return lookup._token_start_index()


def clear_vocabulary(lookup) -> None:
    """Put a lookup layer back to an empty vocabulary (``set_vocabulary`` refuses one)."""
    lookup.lookup_table = lookup._uninitialized_lookup_table()
    lookup._record_vocabulary_size()


# -- optimizers ----------------------------------------------------------------------------
def built_variables(optimizer) -> list:
    """The variables ``optimizer`` was built with (``_trainable_variables``), ``[]`` if none."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def own_variables(optimizer) -> list:
    """Every variable ``optimizer`` itself tracks (``_variables``): slots and its own."""
    return list(optimizer._variables)


def iterations_variable(optimizer):
    return getattr(optimizer, "_iterations", None)


def learning_rate_variable(optimizer):
    """The learning-rate variable (``None`` for a schedule, or an optimizer without one)."""
    return getattr(optimizer, "_learning_rate", None)


def var_key(optimizer, variable):
    """Keras' ``_var_key`` (the key its optimizers index per-variable tables by)."""
    return optimizer._var_key(variable)


def sub_optimizers(optimizer):
    """A ``MultiOptimizer``'s groups (``_inner_optimizers``), or ``None``."""
    return getattr(optimizer, "_inner_optimizers", None)


def group_of(multi, variable) -> int:
    """The index of the group a built ``MultiOptimizer`` routes ``variable`` to."""
    return int(multi._var_to_optimizer_idx[multi._var_key(variable)])


def build_routed(multi, variables, group_for) -> None:
    """Build a ``MultiOptimizer`` with each variable in the group ``group_for(variable)``
    names (an index into its groups; ``None``: its pattern decides)."""
    subs = multi._inner_optimizers
    multi._var_to_optimizer_idx = {}
    multi._trainable_variables_indices = {}
    per_group = [[] for _ in subs]
    for i, var in enumerate(variables):
        idx = group_for(var)
        if idx is None:
            idx = subs.index(multi._optimizer_map(var))
        multi._var_to_optimizer_idx[multi._var_key(var)] = idx
        multi._trainable_variables_indices[multi._var_key(var)] = i
        per_group[idx].append(var)
    for sub, group in zip(subs, per_group, strict=True):
        if group:
            sub.build(group)
    super(keras.optimizers.MultiOptimizer, multi).build(variables)


class _WrappedHook:
    """``save_own_variables`` / ``load_own_variables`` of an optimizer inside a
    ``StableOptimizer``. Keras' saving walk reaches it right after the wrapper, which
    saved or loaded its state by key and armed this hook: it then does nothing. Called
    unarmed, the optimizer is being saved or loaded on its own (taken out of the
    wrapper), where it would silently save or load nothing: it raises."""

    def __init__(self, optimizer, wrapper_name, verb):
        self.name = f"{optimizer.name!r} ({type(optimizer).__name__})"
        self.wrapper_name = wrapper_name
        self.verb = verb
        self.armed = False

    def __call__(self, store):
        if self.armed:
            self.armed = False
            return None
        raise StateError(
            f"Optimizer {self.name} was wrapped by StableOptimizer {self.wrapper_name!r}, which "
            f"{self.verb}s its state by key; it cannot {self.verb} its state on its own (its "
            f"{self.verb}_own_variables belongs to the wrapper), so {'saving' if self.verb == 'save' else 'loading'} "
            "it outside the wrapper would silently leave its slots out. Compile the model with the "
            "StableOptimizer, or with a new optimizer of its own (`type(opt).from_config(opt.get_config())`).",
            key=self.name,
            expected=f"StableOptimizer {self.wrapper_name!r}",
            received=self.name,
        )


def hand_over(optimizers, wrapper_name) -> None:
    """Replace the save/load methods of ``optimizers`` (every optimizer inside a
    ``StableOptimizer``) with hooks that only the wrapper arms (:func:`arm`)."""
    for opt in optimizers:
        for verb in ("save", "load"):
            if not isinstance(opt.__dict__.get(f"{verb}_own_variables"), _WrappedHook):
                setattr(opt, f"{verb}_own_variables", _WrappedHook(opt, wrapper_name, verb))


def arm(optimizers, verb) -> None:
    """Let the next ``<verb>_own_variables`` call of each of ``optimizers`` (from Keras'
    saving walk, right after the wrapper's) pass."""
    for opt in optimizers:
        hook = opt.__dict__.get(f"{verb}_own_variables")
        if isinstance(hook, _WrappedHook):
            hook.armed = True


# -- trainer -------------------------------------------------------------------------------
def print_msg(message: str) -> None:
    """Keras' ``print_msg`` (stdout, or absl logging when Keras is set to log)."""
    from keras.src.utils.io_utils import print_msg as keras_print_msg

    keras_print_msg(message)


def save_keras_archive_to(model, fileobj) -> None:
    """Keras' own ``.keras`` archive of ``model`` (config and weights) into a binary file
    object, e.g. ``io.BytesIO`` (``model.save`` takes only paths)."""
    from keras.src.saving import saving_lib

    saving_lib.save_model(model, fileobj)


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


def fit_epoch_iterator():
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


def fit_data_adapter():
    """The data adapter of the ``fit`` call running in this thread (that of
    :func:`fit_epoch_iterator`), or ``None``."""
    found = fit_epoch_iterator()
    return None if found is None else found.data_adapter


# -- the order and stream place of fit's input ---------------------------------------------
def shufflable_arrays(epoch_iterator):
    """``(inputs, shuffle, batch_size)`` of a ``fit`` over NumPy arrays with ``shuffle``
    ``True`` or ``"batch"`` and a fresh iterator per epoch (no ``steps_per_epoch``), whose
    order :class:`keras_stable_state._fit.input.EpochOrder` can take over; else ``None``.

    ``inputs`` is the ``ArrayDataAdapter``'s packed ``(x, y, sample_weight)`` structure
    (class weights already turned into sample weights,
    ``keras/src/trainers/data_adapters/array_data_adapter.py``)."""
    import numpy as np
    from keras.src import tree
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    if epoch_iterator is None or epoch_iterator.steps_per_epoch is not None:
        return None
    adapter = epoch_iterator.data_adapter
    if not isinstance(adapter, ArrayDataAdapter) or adapter._shuffle not in (True, "batch"):
        return None
    leaves = tree.flatten(adapter._inputs)
    if not leaves or not all(isinstance(a, np.ndarray) for a in leaves):
        return None
    return adapter._inputs, adapter._shuffle, adapter._batch_size


def shuffled_unowned_arrays(epoch_iterator) -> bool:
    """``True`` for shuffled array inputs whose order :func:`shufflable_arrays` cannot take
    over (``steps_per_epoch`` given, or leaves that are not NumPy arrays)."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    if epoch_iterator is None:
        return False
    adapter = epoch_iterator.data_adapter
    return (
        isinstance(adapter, ArrayDataAdapter)
        and bool(adapter._shuffle)
        and shufflable_arrays(epoch_iterator) is None
    )


def num_samples(inputs) -> int:
    """The number of samples of a packed array structure."""
    from keras.src import tree

    return int(next(a.shape[0] for a in tree.flatten(inputs) if a is not None))


def set_array_order(epoch_iterator, inputs, permutation=None) -> None:
    """Switch the ``ArrayDataAdapter``'s own shuffle off and, with ``inputs``, make it
    serve ``inputs`` gathered in ``permutation`` order (int array of shape
    ``(num_samples,)``; a copy of the arrays). On TensorFlow the iterator's ``tf.data``
    pipeline is built anew from them (``TFEpochIterator`` builds it once, in its
    constructor); JAX and Torch iterators read the adapter's arrays at each epoch."""
    from keras.src import tree

    adapter = epoch_iterator.data_adapter
    adapter._shuffle = False
    if inputs is None:
        return
    adapter._inputs = tree.map_structure(lambda a: None if a is None else a[permutation], inputs)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        dataset = adapter.get_tf_dataset()
        if not isinstance(dataset, tf.distribute.DistributedDataset):
            dataset = epoch_iterator._distribute_strategy.experimental_distribute_dataset(dataset)
        epoch_iterator._distributed_dataset = dataset


def stream_persists(epoch_iterator) -> bool:
    """``True`` when ``fit`` keeps one iterator across epochs: ``steps_per_epoch`` was
    given, so an epoch continues the stream where the last one stopped until the input
    runs out (``EpochIterator._enumerate_iterator``)."""
    return epoch_iterator is not None and epoch_iterator.steps_per_epoch is not None


def stream_position(epoch_iterator) -> int:
    """Batches already drawn from the iterator the next epoch will continue (``0`` when
    it starts a fresh one). Read before the epoch's batches are drawn."""
    if not stream_persists(epoch_iterator) or epoch_iterator._current_iterator is None:
        return 0
    return int(epoch_iterator._steps_seen)


def advance_stream(epoch_iterator, count: int) -> None:
    """Start the iterator the next epoch continues and draw ``count`` batches from it
    without training on them (a resumed run reaching the stream place it was saved at)."""
    iterator = iter(epoch_iterator._get_iterator())
    for _ in range(count):
        next(iterator)
    epoch_iterator._current_iterator = iterator
    epoch_iterator._steps_seen = count


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


def total_loss_count_index(model):
    """Position of the total loss tracker's ``count`` in ``model.metrics_variables``
    (it counts samples on every backend), or ``None``."""
    tracker = getattr(model, "_loss_tracker", None)
    ids = {id(v) for v in getattr(tracker, "variables", []) if v.path.endswith("/count")}
    return next((i for i, v in enumerate(model.metrics_variables) if id(v) in ids), None)


def fit_callbacks() -> list:
    """The callbacks of the ``fit`` call running in this thread (its ``CallbackList``), or ``[]``.

    Used only to warn about stateful callbacks that were not given to ``StableCheckpoint``
    (never to key or save them): the same look-up as :func:`fit_data_adapter`, for the
    ``callbacks`` local that TensorFlow, JAX and Torch trainers' ``fit`` build."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and "callbacks" in frame.f_code.co_varnames:
            found = frame.f_locals.get("callbacks")
            if isinstance(found, keras.callbacks.CallbackList):
                return list(found.callbacks)
        frame = frame.f_back
    return []


def py_dataset_of(adapter):
    """The ``keras.utils.PyDataset`` a data adapter reads, or ``None``."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    return adapter.py_dataset if isinstance(adapter, PyDatasetAdapter) else None


def discard_prefetched(adapter) -> int:
    """Drop the batches a ``PyDataset``'s worker queue kept from before the first epoch;
    their number.

    ``fit`` draws one batch to build the model, which starts the workers, then stops
    them; Keras' ``OrderedEnqueuer.stop`` moves the batches they had prefetched into its
    ``ready_queue``, and the next epoch serves those first (so each epoch is served the
    order of the one before it). Emptying it makes the first epoch draw its own order."""
    enqueuer = getattr(adapter, "enqueuer", None)
    ready = getattr(enqueuer, "ready_queue", None)
    if ready is None or enqueuer.is_running():
        return 0
    count = 0
    while True:
        try:
            ready.get_nowait()
        except queue.Empty:
            return count
        count += 1


def tf_dataset_of(adapter):
    """The ``tf.data.Dataset`` a data adapter reads, or ``None``."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    return adapter._dataset if isinstance(adapter, TFDatasetAdapter) else None


def reshuffling_ops(dataset) -> list:
    """``shuffle`` ops with ``reshuffle_each_iteration=True`` in a ``tf.data`` pipeline
    (``tensorflow/python/data/ops/shuffle_op.py``), found through each dataset's inputs."""
    found, todo, seen = [], [dataset], set()
    while todo:
        ds = todo.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if type(ds).__name__ == "_ShuffleDataset" and getattr(ds, "_reshuffle_each_iteration", False):
            found.append(ds)
        inputs = getattr(ds, "_inputs", None)
        if callable(inputs):
            todo.extend(inputs())
    return found


# -- callbacks -----------------------------------------------------------------------------
def ema_weights_in_model(cb) -> bool:
    """Whether ``SwapEMAWeights`` has the EMA weights swapped into the model (its private
    ``_ema_weights_in_model``, ``keras/src/callbacks/swap_ema_weights.py``)."""
    return bool(getattr(cb, "_ema_weights_in_model", False))


def set_ema_weights_in_model(cb, value: bool) -> None:
    """Set ``SwapEMAWeights``' flag of :func:`ema_weights_in_model`."""
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


# -- random state --------------------------------------------------------------------------
def global_seed_generator():
    """Keras' global ``SeedGenerator`` (``keras.random`` ops without a seed), or ``None``
    when none was made yet."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


def set_global_seed_generator(gen) -> None:
    """Make ``gen`` (or ``None``) Keras' global seed generator."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, gen)


def make_global_seed_generator():
    """Keras' global seed generator, made if there is none yet."""
    from keras.src.random import seed_generator

    return seed_generator.global_seed_generator()


def random_seed_dtype() -> str:
    """The dtype this backend keeps seed states in."""
    from keras.src.backend import random_seed_dtype as keras_random_seed_dtype

    return keras_random_seed_dtype()


# -- undoing an optimizer build -------------------------------------------------------------
def _optimizer_tree(optimizer) -> list:
    """``optimizer`` and every optimizer it holds (an inner optimizer, MultiOptimizer's groups)."""
    found, todo = [], [optimizer]
    while todo:
        opt = todo.pop()
        if any(opt is f for f in found):
            continue
        found.append(opt)
        for value in vars(opt).values():
            items = value if isinstance(value, list | tuple) else [value]
            todo += [v for v in items if isinstance(v, keras.optimizers.Optimizer)]
    return found


def _containers(obj) -> list:
    """``(container, copy of its items)`` for the lists, dicts and sets in ``obj.__dict__``
    (Keras' tracked lists and TensorFlow's dependency lists among them) and the tracker's id sets."""
    kept = []
    values = list(vars(obj).values())
    tracker = vars(obj).get("_tracker")
    if tracker is not None:
        values += list(getattr(tracker, "stored_ids", {}).values())
    for value in values:
        for kind in (list, dict, set):
            if isinstance(value, kind):
                # TensorFlow's _DictWrapper is a proxy (wrapt) of a plain dict: keep the dict.
                if not issubclass(type(value), kind) and issubclass(
                    type(getattr(value, "__wrapped__", None)), kind
                ):
                    value = value.__wrapped__
                kept.append((value, kind(value)))
                # TensorFlow's ListWrapper / DictWrapper keep their items in a plain `_storage`.
                inner = getattr(value, "__dict__", {}).values()
                kept += [(c, type(c).copy(c)) for c in inner if type(c) in (list, dict, set)]
    return kept


def snapshot_unbuilt(optimizers):
    """A callable that puts every unbuilt optimizer of ``optimizers`` (and the optimizers
    it holds) back as it is now: unbuilt, without the variables a build created.

    ``Optimizer.build`` only adds attributes, replaces a few (``built``,
    ``_trainable_variables``) and appends to the variable lists and the tracker's
    id sets; the snapshot keeps the attribute dict and the items of every list,
    dict and set in it, and the undo puts them back in place (bypassing Keras'
    attribute tracking). Built optimizers are not touched.
    """
    saved = []
    for top in optimizers:
        if top is None or getattr(top, "built", True):
            continue
        for opt in _optimizer_tree(top):
            saved.append((opt, dict(vars(opt)), _containers(opt)))

    def undo():
        for opt, attrs, containers in saved:
            state = vars(opt)
            for name in [n for n in state if n not in attrs]:
                del state[name]
            state.update(attrs)
            for container, items in containers:
                type(items).clear(container)
                (list.extend if isinstance(items, list) else type(items).update)(container, items)

    return undo
