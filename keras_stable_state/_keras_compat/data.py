"""The order and stream place of ``fit``'s input: its data adapters (arrays, ``PyDataset``,
``tf.data``, a Torch ``DataLoader``) and its epoch iterator's stream.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

__all__ = [
    "advance_stream",
    "fit_trace_seed",
    "keras_array_order",
    "num_samples",
    "prefetched_batches",
    "py_dataset_of",
    "set_prefetched_batches",
    "serve_keras_order",
    "set_array_order",
    "shufflable_arrays",
    "shuffled_unowned_arrays",
    "stream_persists",
    "stream_position",
    "tf_dataset_of",
    "torch_loader_of",
]


def shufflable_arrays(epoch_iterator):
    """``(inputs, shuffle, batch_size)`` of a ``fit`` over NumPy arrays with ``shuffle``
    ``True`` or ``"batch"`` and a fresh iterator per epoch (no ``steps_per_epoch``), whose
    order `keras_stable_state._fit.input.EpochOrder` can take over; else ``None``.

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
    """``True`` for shuffled array inputs whose order `shufflable_arrays` cannot take
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
        _rebuild_tf_dataset(epoch_iterator)


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


def py_dataset_of(adapter):
    """The ``keras.utils.PyDataset`` a data adapter reads, or ``None``."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    return adapter.py_dataset if isinstance(adapter, PyDatasetAdapter) else None


def _ready_queue(adapter):
    """The ``ready_queue`` of a ``PyDataset``'s worker enqueuer (``workers > 1`` or
    ``use_multiprocessing``), or ``None`` (no enqueuer: batches are read in the main thread)."""
    enqueuer = getattr(adapter, "enqueuer", None)
    return getattr(enqueuer, "ready_queue", None)


def prefetched_batches(adapter) -> list | None:
    """The batches a ``PyDataset``'s worker enqueuer carries into its next run, in the
    order it serves them; ``None`` for an adapter without an enqueuer.

    Keras' ``OrderedEnqueuer.stop`` (``keras/src/trainers/data_adapters/py_dataset_adapter.py``)
    moves the batches its workers had already fetched into ``ready_queue``, and the next
    run serves those first: ``fit`` draws one batch to build the model, stops the workers,
    and each epoch begins with what the one before left (an epoch of ``n`` batches over a
    ``shuffle=False`` dataset reads ``1, ..., n-1, 0``). Read between runs (epoch begin,
    epoch end), not while the workers run."""
    ready = _ready_queue(adapter)
    if ready is None:
        return None
    with ready.mutex:
        return list(ready.queue)


def set_prefetched_batches(adapter, batches: list) -> None:
    """Replace what a ``PyDataset``'s stopped worker enqueuer carries into its next run by
    ``batches`` (see `prefetched_batches`)."""
    ready = _ready_queue(adapter)
    with ready.mutex:
        ready.queue.clear()
        ready.queue.extend(batches)


def torch_loader_of(adapter):
    """The ``torch.utils.data.DataLoader`` a data adapter reads (on any backend:
    ``keras/src/trainers/data_adapters/torch_data_loader_adapter.py``), or ``None``.
    Imports no Torch: that adapter's module imports it only when one is made."""
    from keras.src.trainers.data_adapters.torch_data_loader_adapter import TorchDataLoaderAdapter

    return adapter._dataloader if isinstance(adapter, TorchDataLoaderAdapter) else None


def tf_dataset_of(adapter):
    """The ``tf.data.Dataset`` a data adapter reads, or ``None``."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    return adapter._dataset if isinstance(adapter, TFDatasetAdapter) else None


def fit_trace_seed() -> int | None:
    """TensorFlow's global seed (``tf.random.set_seed``, which ``keras.utils.set_random_seed``
    calls), from which a ``tf.data`` pipeline takes the seeds of its random ops when it is
    traced; ``None`` without one, or off the TensorFlow backend.

    Keras' TensorFlow ``ArrayDataAdapter`` shuffles with ``tf.random.shuffle`` inside a
    ``tf.data`` ``map``: with a global seed, each epoch's fresh iterator draws the same
    order, a function of that seed alone; without one, an order nothing can replay."""
    if keras.backend.backend() != "tensorflow":
        return None
    from tensorflow.python.eager import context

    seed = context.global_seed()
    return None if seed is None else int(seed)


@contextlib.contextmanager
def _traced_with_seed(seed: int | None):
    """Trace ``tf.data`` functions inside as under the global seed ``seed`` (the eager
    context's ``_seed``, which ``FuncGraph`` copies), leaving the eager op-seed sequence
    and kernel caches (which ``tf.random.set_seed`` resets) untouched."""
    from tensorflow.python.eager import context

    ctx = context.context()
    before = ctx._seed
    ctx._seed = seed
    try:
        yield
    finally:
        ctx._seed = before


def keras_array_order(num_samples: int, batch_size: int, shuffle, tf_seed: int | None = None) -> np.ndarray:
    """The sample order Keras' own ``ArrayDataAdapter`` serves in an epoch of
    ``num_samples`` samples in batches of ``batch_size`` with ``shuffle`` (``True`` or
    ``"batch"``), as ``fit`` would draw it if it began the epoch now: int64 array of shape
    ``(num_samples,)``.

    It is Keras' own code run over the sample indices: the iterator each backend's ``fit``
    makes (``get_numpy_iterator``'s ``np.random.permutation`` on JAX, the ``DataLoader``
    with a ``RandomSampler`` drawing from Torch's global generator, the ``tf.data``
    pipeline traced under ``tf_seed`` on TensorFlow), so it draws from the global random
    states exactly as ``fit``'s iterator will: the caller takes a snapshot of them before
    and puts it back after, and ``fit`` then draws this order itself. On TensorFlow it is
    ``fit``'s order only with a global seed (`fit_trace_seed`). Draws Keras makes lazily
    per batch (``shuffle="batch"`` on JAX and Torch) match ``fit``'s unless a train step
    draws from the same global generator between batches."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    probe = ArrayDataAdapter(np.arange(num_samples, dtype="int64"), batch_size=batch_size, shuffle=shuffle)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        with _traced_with_seed(tf_seed):
            dataset = probe.get_tf_dataset()
        batches = [b.numpy() for b in dataset]
    elif backend == "torch":
        batches = [b.numpy() for b in probe.get_torch_dataloader()]
    else:
        batches = [np.asarray(b) for b in probe.get_numpy_iterator()]
    return np.concatenate([np.reshape(b, (-1,)) for b in batches]).astype("int64")


def serve_keras_order(epoch_iterator, inputs, shuffle, tf_seed: int | None = None) -> None:
    """Give the ``ArrayDataAdapter`` back its own ``inputs`` and ``shuffle`` (after
    `set_array_order` served another order), so ``fit`` draws its own order again; on
    TensorFlow the iterator's ``tf.data`` pipeline is built anew, traced under the global
    seed ``tf_seed`` (the seed the interrupted run's pipeline was traced under)."""
    adapter = epoch_iterator.data_adapter
    adapter._inputs, adapter._shuffle = inputs, shuffle
    if keras.backend.backend() == "tensorflow":
        with _traced_with_seed(tf_seed):
            _rebuild_tf_dataset(epoch_iterator)


def _rebuild_tf_dataset(epoch_iterator) -> None:
    import tensorflow as tf

    dataset = epoch_iterator.data_adapter.get_tf_dataset()
    if not isinstance(dataset, tf.distribute.DistributedDataset):
        dataset = epoch_iterator._distribute_strategy.experimental_distribute_dataset(dataset)
    epoch_iterator._distributed_dataset = dataset
