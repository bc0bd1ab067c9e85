"""``tf.data`` pipelines of ``fit``: the ops that draw new random seeds for each iteration,
the ops whose state outlives an iterator, the iterators ``fit`` makes, and tf.data's own
iterator checkpoint (``tensorflow/python/data/ops/iterator_ops.py``, ``OwnedIterator._save``).

Every function here is called for a ``tf.data.Dataset`` the user passed to ``fit``, so
TensorFlow is already imported: none of them imports it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "assigned_variables",
    "hook_tf_iterators",
    "reseeding_datasets",
    "restore_tf_iterator",
    "serialize_tf_iterator",
    "stateful_pipeline_ops",
    "tf_dataset_seeds",
]

# Stateful ops of a pipeline's functions that keep no state from one iterator to the next
# (tf.data instantiates the function's kernels for each iterator: a seeded
# ``tf.random.uniform`` draws the same numbers in each iteration), or only read state
# (variables, lookup tables): a replay from a fresh iterator draws what the first one drew.
_PER_ITERATOR_OPS = frozenset(
    {
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "Multinomial",
        "RandomShuffle",
        "RandomCrop",
        # an inner dataset's seed generator (a shuffle inside interleave/flat_map): made anew
        # for each inner dataset, from its seeds
        "DummySeedGenerator",
        "AnonymousSeedGenerator",
        "AnonymousRandomSeedGenerator",
        "ReadVariableOp",
        "VarHandleOp",
        "LookupTableFindV2",
        "LookupTableSizeV2",
        "LookupTableExportV2",
        "HashTableV2",
        "MutableHashTableV2",
        "MutableDenseHashTableV2",
        "InitializeTableV2",
        "InitializeTableFromTextFileV2",
        "Assert",
        "Print",
        "PrintV2",
    }
)

# Ops that advance a variable the pipeline captures: a ``tf.random.Generator``'s state, a
# Keras random preprocessing layer's seed generator (``RandomFlip`` in ``map``), a counter.
_WRITES = frozenset(
    {
        "AssignVariableOp",
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "RngReadAndSkip",
        "RngSkip",
        "StatefulUniform",
        "StatefulUniformInt",
        "StatefulUniformFullInt",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
    }
)

# What the user wrote, for the op types a warning names.
_WRITTEN_AS = {
    "EagerPyFunc": "tf.py_function",
    "PyFunc": "tf.numpy_function or Dataset.from_generator",
    "PyFuncStateless": "tf.numpy_function",
    "RngReadAndSkip": "tf.random.Generator",
    "RngSkip": "tf.random.Generator",
    "StatefulUniform": "tf.random.Generator",
    "StatefulUniformInt": "tf.random.Generator",
    "StatefulUniformFullInt": "tf.random.Generator",
    "StatefulStandardNormalV2": "tf.random.Generator",
    "StatefulTruncatedNormal": "tf.random.Generator",
    "AssignVariableOp": "a variable assigned in the pipeline",
    "AssignAddVariableOp": "a variable assigned in the pipeline",
    "AssignSubVariableOp": "a variable assigned in the pipeline",
}


def _datasets(dataset) -> Iterator[Any]:
    """``dataset`` and every dataset it reads from (through ``_inputs()``), once each."""
    todo, seen = [dataset], set()
    while todo:
        ds = todo.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        yield ds
        inputs = getattr(ds, "_inputs", None)
        if callable(inputs):
            todo.extend(inputs())


def reseeding_datasets(dataset) -> list:
    """The datasets of a pipeline that draw new random seeds for each iteration:
    ``shuffle(reshuffle_each_iteration=True)`` (``shuffle_op.py``) and
    ``Dataset.random(rerandomize_each_iteration=True)`` (also under
    ``sample_from_datasets``); their seeds come from a seed generator that lives in the
    dataset, which tf.data's iterator checkpoint saves."""
    found = []
    for ds in _datasets(dataset):
        name = type(ds).__name__
        if (name == "_ShuffleDataset" and getattr(ds, "_reshuffle_each_iteration", False)) or (
            name == "_RandomDataset" and getattr(ds, "_rerandomize", False)
        ):
            found.append(ds)
    return found


def tf_dataset_seeds(dataset) -> list:
    """``[seed, seed2]`` of each random op of a pipeline, in a fixed order: its ``shuffle``
    and ``Dataset.random`` datasets (the op seeds their seed generators start from) and the
    random ops of its functions (a seeded ``tf.random.uniform`` in ``map``). They are fixed
    when the dataset is made, from the op's ``seed=`` and the global seed of
    ``tf.random.set_seed``: a pipeline made under another global seed draws other numbers."""
    import numpy as np

    found = []
    for ds in _datasets(dataset):
        if type(ds).__name__ in ("_ShuffleDataset", "_RandomDataset"):
            found.append(
                [int(np.asarray(getattr(ds, "_seed", 0))), int(np.asarray(getattr(ds, "_seed2", 0)))]
            )
        functions = getattr(ds, "_functions", None)
        for wrapper in functions() if callable(functions) else ():
            graph = getattr(getattr(wrapper, "function", None), "graph", None)
            if graph is not None:
                found.extend(_graph_seeds(graph, set()))
    return found


def _graph_seeds(graph, seen) -> Iterator[list]:
    if id(graph) in seen:
        return
    seen.add(id(graph))
    for op in graph.get_operations():
        if op.type in _PER_ITERATOR_OPS and op.type.startswith(
            ("Random", "Truncated", "Parameterized", "Multinomial")
        ):
            try:
                yield [int(op.get_attr("seed")), int(op.get_attr("seed2"))]
            except ValueError:
                continue
    for fn in list(getattr(graph, "_functions", {}).values()):
        inner = getattr(fn, "graph", None)
        if inner is not None:
            yield from _graph_seeds(inner, seen)


def _graph_ops(graph, seen) -> Iterator[str]:
    """The op types of a function graph and of the functions it calls, each graph once."""
    if id(graph) in seen:
        return
    seen.add(id(graph))
    for op in graph.get_operations():
        op_def = op.op_def
        if op_def is not None and op_def.is_stateful:
            yield op.type
    for fn in list(getattr(graph, "_functions", {}).values()):
        inner = getattr(fn, "graph", None)
        if inner is not None:
            yield from _graph_ops(inner, seen)


def stateful_pipeline_ops(dataset, variables_saved: bool = False) -> list:
    """``[(op type, what the user wrote)]``, sorted: the stateful ops in a pipeline's
    functions (``map``, ``filter``, ``interleave``, ``from_generator``, ...) whose state
    outlives an iterator and that tf.data cannot checkpoint (Python functions, a
    ``tf.random.Generator``, assigned variables, unknown stateful ops), so a replay from a
    fresh iterator may give other elements. Dataset ops and the ops of `_PER_ITERATOR_OPS`
    are not listed, nor, with ``variables_saved``, the ops of `_WRITES` (the caller saves
    the `assigned_variables`)."""
    found, seen = set(), set()
    for ds in _datasets(dataset):
        functions = getattr(ds, "_functions", None)
        for wrapper in functions() if callable(functions) else ():
            graph = getattr(getattr(wrapper, "function", None), "graph", None)
            if graph is None:
                continue
            for op_type in _graph_ops(graph, seen):
                if op_type in _PER_ITERATOR_OPS or "Dataset" in op_type or "Iterator" in op_type:
                    continue
                if variables_saved and op_type in _WRITES:
                    continue
                found.add((op_type, _WRITTEN_AS.get(op_type, op_type)))
    return sorted(found)


def assigned_variables(dataset) -> list:
    """The variables captured by the functions of a pipeline that advance one (`_WRITES`),
    each once, in a fixed order: their values at an iterator's start decide what it draws
    (``tf.random.Generator``, Keras' random preprocessing layers in ``map``)."""
    found: dict[int, Any] = {}
    seen: set = set()

    def visit(graph):
        if id(graph) in seen:
            return
        seen.add(id(graph))
        if any(op.type in _WRITES for op in graph.get_operations()):
            for variable in graph.variables:
                found.setdefault(id(variable), variable)
        for fn in list(getattr(graph, "_functions", {}).values()):
            inner = getattr(fn, "graph", None)
            if inner is not None:
                visit(inner)

    for ds in _datasets(dataset):
        functions = getattr(ds, "_functions", None)
        for wrapper in functions() if callable(functions) else ():
            graph = getattr(getattr(wrapper, "function", None), "graph", None)
            if graph is not None:
                visit(graph)
    return list(found.values())


class _IteratorHook:
    """Stands for the dataset ``fit`` iterates: ``iter()`` makes the real dataset's iterator
    and hands it to ``on_created`` (which may restore its state) before ``fit`` draws from
    it (tf.data starts an iterator's threads at its first element); everything else is the
    dataset's."""

    def __init__(self, dataset, on_created: Callable[[Any], None]) -> None:
        self._kss_dataset = dataset
        self._kss_on_created = on_created

    def __iter__(self):
        iterator = iter(self._kss_dataset)
        self._kss_on_created(iterator)
        return iterator

    def __getattr__(self, name):
        if name.startswith("_kss_"):  # not set yet (a copy made without __init__)
            raise AttributeError(name)
        return getattr(self._kss_dataset, name)


def hook_tf_iterators(epoch_iterator, on_created: Callable[[Any], None]):
    """Make ``fit``'s ``EpochIterator`` (over a ``TFDatasetAdapter``) call
    ``on_created(iterator)`` with each iterator it makes of the dataset, before drawing from
    it: on TensorFlow the dataset ``TFEpochIterator`` iterates (``_distributed_dataset``),
    on JAX and Torch the adapter's (its ``get_jax_iterator`` and
    ``get_torch_dataloader`` iterate ``_dataset``). Returns the real dataset iterated, or
    ``None`` where it is not a plain ``tf.data.Dataset`` (a ``tf.distribute`` dataset of
    several replicas, whose iterator is not an ``OwnedIterator``): nothing is hooked then."""
    import tensorflow as tf

    adapter = epoch_iterator.data_adapter
    owner, attr = (epoch_iterator, "_distributed_dataset")
    if not hasattr(epoch_iterator, attr):
        owner, attr = adapter, "_dataset"
    dataset = getattr(owner, attr, None)
    if isinstance(dataset, _IteratorHook):
        dataset = dataset._kss_dataset
    if not isinstance(dataset, tf.data.Dataset):
        return None
    setattr(owner, attr, _IteratorHook(dataset, on_created))
    return dataset


def serialize_tf_iterator(iterator) -> bytes | None:
    """tf.data's checkpoint of ``iterator`` (an ``OwnedIterator``): the state of every
    dataset of its pipeline (shuffle buffers, seeds, seed generators, positions), as
    ``OwnedIterator._save`` writes it, with the external-state policy ``IGNORE`` (the ops
    of `stateful_pipeline_ops` are warned about instead). ``None`` for another iterator."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_dataset_ops

    resource = getattr(iterator, "_iterator_resource", None)
    if resource is None:
        return None
    ignore = tf.data.experimental.ExternalStatePolicy.IGNORE.value
    variant = gen_dataset_ops.serialize_iterator(resource, external_state_policy=ignore)
    parts = [tf.io.serialize_tensor(part) for part in tf.unstack(variant)]
    return tf.strings.reduce_join(tf.io.encode_base64(tf.stack(parts)), separator=",").numpy()


def restore_tf_iterator(iterator, state: bytes) -> None:
    """Put a state of `serialize_tf_iterator` into ``iterator``, a fresh iterator of the
    same pipeline (``OwnedIterator._restore``); its seed generators continue from the
    saved state too.

    Raises:
        tf.errors.OpError: if the state is not one of this pipeline.
    """
    import tensorflow as tf

    iterator._restore(tf.constant(state))
