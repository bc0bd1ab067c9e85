"""Every use of Keras internals, in one place, checked against the supported Keras range.

keras_stable_state relies on a few things Keras does not export: its saving
walk (``keras/src/saving/saving_lib.py``), the variable lists layers and
optimizers keep (``_trainable_variables``, ``_non_trainable_variables``,
``_variables``), ``MultiOptimizer``'s routing tables, the trainer's
``train_function`` and ``_initial_epoch``, ``ModelCheckpoint``'s counters,
Keras' global seed generator and ``print_msg``. They are reached only through
the functions of this package (``compat.<function>``, re-exported here from one
module per area), so a Keras release that changes them breaks this package only:

- `.version`: the supported range, checked once on import;
- `.saving`: the saving walk, Keras' naming, its ``.keras`` writer;
- `.layers`: the variables layers and metrics own, lookup vocabularies;
- `.optimizers`: optimizer variable lists, ``MultiOptimizer`` routing, the
  hand-over of a wrapped optimizer's save/load, undoing a build;
- `.fit`: the running ``fit`` (epoch iterator, callbacks, compile state);
- `.data`: the order and stream place of ``fit``'s input;
- `.tf_data`: ``tf.data`` pipelines: their reseeding and stateful ops, iterator checkpoints;
- `.callbacks`: private state of Keras callbacks, ``print_msg``;
- `.rng`: Keras' global seed generator.

The supported range is pyproject's ``keras>=3.15,<4``. Importing the package
with a Keras outside it raises `UnsupportedKerasError` (an
``ImportError``): these internals decide which slot lands on which variable, and
a silent mismatch is exactly what this library exists to prevent.
"""

from __future__ import annotations

import keras

from keras_stable_state._keras_compat.callbacks import (
    ema_weights_in_model,
    model_checkpoint_counters,
    print_msg,
    set_ema_weights_in_model,
    set_model_checkpoint_counters,
)
from keras_stable_state._keras_compat.data import (
    advance_stream,
    fit_trace_seed,
    keras_array_order,
    num_samples,
    prefetched_batches,
    py_dataset_of,
    serve_keras_order,
    set_array_order,
    set_prefetched_batches,
    shufflable_arrays,
    shuffled_unowned_arrays,
    stream_persists,
    stream_position,
    tf_dataset_of,
    torch_loader_of,
)
from keras_stable_state._keras_compat.fit import (
    build_compile_state,
    fit_callbacks,
    fit_data_adapter,
    fit_epoch_iterator,
    fit_frame,
    fit_threads,
    fit_validation_arrays,
    outside_stacklevel,
    per_output_loss_names,
    per_output_loss_weighting,
    replica_count,
    set_initial_epoch,
    skip_batches,
    total_loss_count_index,
)
from keras_stable_state._keras_compat.layers import (
    called_as_layer,
    clear_vocabulary,
    flatten_layers,
    frozen_vocabulary_size,
    index_lookup_class,
    layer_own_variables,
    lookup_token_start,
    metric_own_variables,
    seed_generator_states,
    text_vectorization_lookup,
    tf_plain_resource,
    tf_read,
    torch_swap_is_assign,
    variable_storage,
)
from keras_stable_state._keras_compat.optimizers import (
    arm,
    build_routed,
    built_variables,
    group_of,
    hand_over,
    iterations_variable,
    learning_rate_variable,
    own_variables,
    set_built_variables,
    snapshot_unbuilt,
    sub_optimizers,
    var_key,
)
from keras_stable_state._keras_compat.rng import (
    global_seed_generator,
    make_global_seed_generator,
    random_seed_dtype,
    set_global_seed_generator,
)
from keras_stable_state._keras_compat.saving import (
    attribute_names,
    obj_type,
    save_keras_archive_to,
    to_snake_case,
    walk_saveable,
)
from keras_stable_state._keras_compat.tf_data import (
    assigned_variables,
    hook_tf_iterators,
    reseeding_datasets,
    restore_tf_iterator,
    serialize_tf_iterator,
    stateful_pipeline_ops,
    tf_dataset_seeds,
)
from keras_stable_state._keras_compat.version import (
    SUPPORTED_KERAS,
    UnsupportedKerasError,
    check_keras_version,
)

__all__ = [
    "replica_count",
    "outside_stacklevel",
    "tf_dataset_seeds",
    "stateful_pipeline_ops",
    "serialize_tf_iterator",
    "restore_tf_iterator",
    "reseeding_datasets",
    "hook_tf_iterators",
    "SUPPORTED_KERAS",
    "UnsupportedKerasError",
    "advance_stream",
    "arm",
    "assigned_variables",
    "build_compile_state",
    "build_routed",
    "built_variables",
    "called_as_layer",
    "check_keras_version",
    "clear_vocabulary",
    "fit_trace_seed",
    "frozen_vocabulary_size",
    "keras_array_order",
    "ema_weights_in_model",
    "fit_callbacks",
    "fit_data_adapter",
    "fit_epoch_iterator",
    "fit_frame",
    "fit_validation_arrays",
    "fit_threads",
    "flatten_layers",
    "global_seed_generator",
    "group_of",
    "hand_over",
    "index_lookup_class",
    "iterations_variable",
    "layer_own_variables",
    "learning_rate_variable",
    "lookup_token_start",
    "make_global_seed_generator",
    "metric_own_variables",
    "model_checkpoint_counters",
    "num_samples",
    "obj_type",
    "own_variables",
    "per_output_loss_names",
    "per_output_loss_weighting",
    "print_msg",
    "prefetched_batches",
    "py_dataset_of",
    "set_prefetched_batches",
    "random_seed_dtype",
    "save_keras_archive_to",
    "seed_generator_states",
    "serve_keras_order",
    "set_array_order",
    "set_built_variables",
    "set_ema_weights_in_model",
    "set_global_seed_generator",
    "set_initial_epoch",
    "set_model_checkpoint_counters",
    "shufflable_arrays",
    "shuffled_unowned_arrays",
    "skip_batches",
    "snapshot_unbuilt",
    "stream_persists",
    "stream_position",
    "sub_optimizers",
    "text_vectorization_lookup",
    "tf_dataset_of",
    "torch_loader_of",
    "to_snake_case",
    "total_loss_count_index",
    "var_key",
    "tf_plain_resource",
    "torch_swap_is_assign",
    "tf_read",
    "variable_storage",
    "walk_saveable",
    "attribute_names",
]

# The guard: runs once, when this package is first imported (before any caller uses it).
check_keras_version(keras.__version__)
