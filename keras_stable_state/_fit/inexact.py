"""The [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] checks of a
[`StableCheckpoint`][keras_stable_state.StableCheckpoint] at train begin: inputs whose order a resume
cannot replay, checkpoints of an older version or another backend, per-output loss means
counted in other units, callbacks whose state is unknown or not in the checkpoint (or saved
states no callback of the ``fit`` takes), and planned steps that would
wrap an optimizer's iteration counter.

The functions are called from the callback's hooks at the depth its methods were, so
each ``stacklevel`` attributes its warning to the same frame as before the split.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_stable_state import _keras_compat, _state
from keras_stable_state._fit.loss_units import loss_units
from keras_stable_state._fit.prefetch import PrefetchedBatches
from keras_stable_state._fit.tf_data import TFDataState
from keras_stable_state._numpy import to_numpy
from keras_stable_state._optimizer import optimizer_tree, tracked_optimizers
from keras_stable_state.errors import InexactResumeWarning

if TYPE_CHECKING:
    from keras_stable_state._fit.input import EpochOrder
    from keras_stable_state._fit.position import Position


def opaque(cb) -> bool:
    """``True`` for a callback whose state nothing here knows: the user's own classes and
    ``LambdaCallback`` (whose functions may keep state). Keras' other callbacks keep none
    that changes training, or have a known state (``state.callback_state``)."""
    if isinstance(cb, keras.callbacks.LambdaCallback):
        return True
    return not type(cb).__module__.startswith(("keras.", "keras_stable_state."))


def inspect_input() -> Any:
    """The ``fit`` input whose own state is saved (a ``PyDataset`` with ``get_state``
    and ``set_state``, or the `TFDataState` of a ``tf.data`` pipeline that reshuffles),
    or ``None``; warns for inputs a resume cannot replay."""
    adapter = _keras_compat.fit_data_adapter()
    if adapter is None:
        return None
    dataset = _keras_compat.py_dataset_of(adapter)
    if dataset is not None:
        name = f"{type(dataset).__name__} (a keras.utils.PyDataset)"
        if callable(getattr(dataset, "get_state", None)) and callable(getattr(dataset, "set_state", None)):
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
    epoch_iterator = _keras_compat.fit_epoch_iterator()
    if _keras_compat.shuffled_unowned_arrays(epoch_iterator) and (
        keras.backend.backend() == "tensorflow" or _keras_compat.stream_persists(epoch_iterator)
    ):
        reason = (
            "with steps_per_epoch (one shuffled pass spans several epochs)"
            if _keras_compat.stream_persists(epoch_iterator)
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
    dataset = _keras_compat.tf_dataset_of(adapter)
    if dataset is not None:
        return _inspect_tf_dataset(epoch_iterator, dataset)
    return None


def inspect_prefetched() -> PrefetchedBatches | None:
    """The `PrefetchedBatches` of a ``fit`` over a ``PyDataset`` read by workers, else ``None``."""
    adapter = _keras_compat.fit_data_adapter()
    return PrefetchedBatches(adapter) if PrefetchedBatches.present(adapter) else None


def _inspect_tf_dataset(epoch_iterator: Any, dataset: Any) -> Any:
    """The state provider of a ``tf.data`` input with random ops or variables it advances
    (`TFDataState`), or ``None``; warns for the ops of the pipeline whose state tf.data
    cannot checkpoint, and for pipelines whose iterators cannot be reached."""
    provider = TFDataState(dataset)
    ops = _keras_compat.stateful_pipeline_ops(dataset, variables_saved=bool(provider.variables))
    if ops:
        shown = ", ".join(f"{op} ({written})" if written != op else op for op, written in ops)
        warnings.warn(
            f"StableCheckpoint: the input tf.data pipeline {dataset!r} runs ops whose state "
            f"tf.data cannot checkpoint: {shown}. A resumed run replays the interrupted epoch "
            "from a fresh iterator and skips the batches already trained on, so it matches an "
            "uninterrupted run only if each iteration of the pipeline gives the same elements "
            "(no Python state such as a generator's place or unseeded random draws). To resume "
            "exactly, use tf.data ops instead (from_tensor_slices, map with tf.random ops or "
            "stateless random ops, shuffle).",
            InexactResumeWarning,
            stacklevel=4,
        )
    if not provider.seeds and not provider.variables:
        return None  # no random op: a replay from a fresh iterator draws the same batches
    if (provider.reseeds or provider.variables) and not provider.hook(epoch_iterator):
        warnings.warn(
            f"StableCheckpoint: the input tf.data dataset {dataset!r} draws new random numbers "
            "in each iteration (shuffle(reshuffle_each_iteration=True), Dataset.random, or "
            "variables its functions advance), and fit iterates it through a tf.distribute "
            "dataset of several replicas, whose iterators StableCheckpoint cannot checkpoint: a "
            "resumed run sees other batches from the resumed epoch on. To resume exactly, use "
            "reshuffle_each_iteration=False and stateless random ops, or train on one replica.",
            InexactResumeWarning,
            stacklevel=4,
        )
    return provider


def inspect_loader() -> Any:
    """The `LoaderState` of the ``fit``'s ``torch.utils.data.DataLoader`` input when it holds
    generators or stateful samplers, else ``None``; warns for what a resume cannot replay:
    persistent worker processes (their random state runs on across epochs) and samplers
    of the user's without ``state_dict()``/``load_state_dict()``."""
    adapter = _keras_compat.fit_data_adapter()
    loader = None if adapter is None else _keras_compat.torch_loader_of(adapter)
    if loader is None:
        return None
    from keras_stable_state._fit.loader import LoaderState, hidden_samplers

    name = type(loader).__name__
    if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
        warnings.warn(
            f"StableCheckpoint: the input {name} keeps its {loader.num_workers} worker processes across "
            "epochs (persistent_workers=True): the random numbers they draw (in the dataset's "
            "__getitem__, the collate_fn or the worker_init_fn: random augmentation) run on from epoch to "
            "epoch and are not saved, and a resumed run's workers start from other seeds, so if the "
            "dataset draws any, the resumed run reads other samples than an uninterrupted one. To resume "
            "exactly, use persistent_workers=False (each epoch's workers are then seeded from the saved "
            "generators); a dataset that draws no random numbers resumes exactly as it is.",
            InexactResumeWarning,
            stacklevel=3,
        )
    for hidden in hidden_samplers(loader):
        warnings.warn(
            f"StableCheckpoint: the input {name}'s {hidden} is a sampler of yours without "
            "state_dict()/load_state_dict(): any state it keeps in its attributes (an epoch counter, "
            "an order drawn in advance) is not saved, so a resumed run may draw another order from the "
            "resumed epoch on. Give it state_dict() (a dict of JSON values and NumPy arrays, its state "
            "between two passes; {} if it keeps none) and load_state_dict(state): StableCheckpoint "
            "saves it at each epoch begin and loads it on resume. torch.Generator attributes of it are "
            "saved already.",
            InexactResumeWarning,
            stacklevel=3,
        )
    found = LoaderState(loader)
    return found if found else None


# ``ckpt`` below is the StableCheckpoint (Any: callback imports this module).
def warn_prefetched(live: bool, saved: bool, position: Position) -> None:
    """Warn where a ``PyDataset`` is read by workers in only one of the saved run and this
    one (``live``, ``saved``): Keras' enqueuer carries batches from each epoch into the next
    (`keras_stable_state._fit.prefetch`), so the two runs read the epochs in other orders."""
    if live == saved:
        return
    now, then = ("", "not ") if live else ("not ", "")
    warnings.warn(
        f"StableCheckpoint: the checkpoint (epoch {position.epoch}, step {position.step}) was "
        f"{then}saved from a keras.utils.PyDataset read by workers (workers > 1 or "
        f"use_multiprocessing=True), this fit's input is {now}one: Keras' worker queue serves "
        "each epoch's first batches from what the epoch before fetched, so the resumed epochs "
        "read their batches in another order than the saved run. Resume with the same workers "
        "and use_multiprocessing as when saved.",
        InexactResumeWarning,
        stacklevel=4,
    )


def warn_inexact_resume(
    ckpt: Any, record: Any, position: Position, order: EpochOrder, writer: str | None
) -> None:
    """Warn, at train begin, for a resume whose data or random draws cannot be those
    of an uninterrupted run: a mid-epoch checkpoint of shuffled arrays written before
    the epoch's order was saved, a ``tf.data`` input made with other random seeds than the
    saved run's (``TFDataState.warn_seeds``), and a resume on another backend than the
    writer's of a model with random layers (each backend draws its own dropout masks and
    noise) or of an input of unknown length with TensorFlow on one side (TensorFlow's fit
    counts one more optimizer step per epoch of such an input), or of a model with a loss per
    output and batches of unequal sizes with TensorFlow on one side
    (`warn_unequal_batch_losses`).

    Args:
        ckpt: The restoring ``StableCheckpoint`` (its ``model``; skipped among the callbacks).
        record: The checkpoint's record (``extra``, ``arrays``).
        position: The restored `Position`.
        order: The fit's `EpochOrder` (its ``shuffle`` and ``source``).
        writer: The backend that wrote the checkpoint, or ``None`` if not recorded.
    """
    pos = position
    saved = record.extra.get("providers", {})
    shuffle = order.shuffle
    if pos.step > 0 and shuffle and "data" not in saved:
        warnings.warn(
            f"StableCheckpoint: the checkpoint (epoch {pos.epoch}, step {pos.step}) was written by "
            "a version that did not save the epoch's sample order; fit shuffles NumPy arrays, so "
            "the rest of the interrupted epoch is drawn in another order. Let the epoch finish "
            "before an interruption, or accept the difference.",
            InexactResumeWarning,
            stacklevel=3,
        )
    warn_seeds = getattr(ckpt._input, "warn_seeds", None)  # a tf.data input's TFDataState
    if warn_seeds is not None and isinstance(saved.get("input"), dict):
        warn_seeds(_state.join_arrays(saved["input"], record.arrays))
    loader = ckpt._loader
    if loader and (loader.generators or loader.samplers) and "loader" not in saved:
        warnings.warn(
            f"StableCheckpoint: the checkpoint (epoch {pos.epoch}, step {pos.step}) holds no generator "
            "states of a torch DataLoader input (written by an older version, or from another input); "
            "this fit's DataLoader draws its order from generators it holds, so the resumed epochs "
            "read another order than an uninterrupted run. Resume from a checkpoint this version "
            "wrote with the same DataLoader, or accept the difference.",
            InexactResumeWarning,
            stacklevel=3,
        )
    warn_prefetched(ckpt._prefetched is not None, "prefetched" in saved, pos)
    live = keras.backend.backend()
    data = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    source = data.get("source", "numpy")
    if shuffle and not order.continues(source, data.get("tf_seed")):
        warnings.warn(
            f"StableCheckpoint: the checkpoint's shuffled NumPy input was ordered by {source}'s fit "
            f"(its own generator) and training resumes on {live}, whose fit draws its orders from "
            f"another generator: the rest of the interrupted epoch is the saved order, every later "
            f"epoch is drawn by {live}, so the run trains on other batches than on {source} from the "
            f"next epoch on. Resume on {source} for an exact continuation.",
            InexactResumeWarning,
            stacklevel=3,
        )
    if pos.step > 0:
        warn_loss_weighting(ckpt.model, record, position, writer, live)
    if (
        writer
        and writer != live
        and "tensorflow" in (writer, live)
        and (ckpt.params or {}).get("steps") is None
    ):
        warnings.warn(
            f"StableCheckpoint: the checkpoint was written on {writer} and training resumes on {live}, "
            "and this fit's input has no known length (grain, a generator without steps_per_epoch, "
            "tf.data of unknown cardinality): TensorFlow's fit counts one more optimizer step in each "
            "epoch of such an input (the step that finds the data's end; stock Keras counts 4 steps "
            "in an epoch of 3 batches) and the other backends do not, so the optimizer's step count "
            "(Adam's bias correction, learning-rate schedules) and the History's per-output loss "
            f"means differ from the run on {writer} from the resumed epoch on. Resume on {writer} "
            "for an exact continuation.",
            InexactResumeWarning,
            stacklevel=3,
        )
    warn_loader_across_torch(writer, live)
    warn_unequal_batch_losses(ckpt.model, writer, live)
    if writer and writer != live:
        random_layers = sorted(
            {
                layer.name
                for layer in _keras_compat.flatten_layers(ckpt.model)
                if _keras_compat.seed_generator_states(layer)
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


def warn_loader_across_torch(writer: str | None, live: str) -> None:
    """Warn for a ``DataLoader`` whose order draws from Torch generators (a shuffling sampler,
    worker seeds) resumed across the Torch backend: Keras' Torch ``fit`` makes two iterators of
    the loader in each epoch, TensorFlow's and JAX's one, and each draws from the generators,
    so the epochs after the resumed one start from other generator states than the writer's."""
    if not writer or writer == live or "torch" not in (writer, live):
        return
    adapter = _keras_compat.fit_data_adapter()
    loader = None if adapter is None else _keras_compat.torch_loader_of(adapter)
    if loader is None:
        return
    sampler = type(getattr(loader, "sampler", None)).__name__
    if sampler == "SequentialSampler" and not getattr(loader, "num_workers", 0):
        return  # its order draws nothing
    warnings.warn(
        f"StableCheckpoint: the checkpoint was written on {writer} and training resumes on {live} with a "
        f"torch DataLoader input whose order draws from Torch generators ({sampler}, "
        f"num_workers={getattr(loader, 'num_workers', 0)}): Keras' fit on the Torch backend makes two "
        "iterators of the loader in each epoch, on TensorFlow and JAX one, and each draws from the "
        "generators (its base seed, the sampler's seed), so the epochs after the resumed one are drawn "
        f"from other generator states than on {writer}: the rest of the resumed epoch is exact, later "
        f"epochs read other orders. Resume on {writer} for an exact continuation.",
        InexactResumeWarning,
        stacklevel=4,
    )


def _unequal_batches() -> list[str]:
    """What of the running ``fit``'s inputs comes in batches of unequal sizes: ``"training:
    N samples in batches of B"`` (its data adapter has a partial last batch) and the same for
    validation arrays (``validation_data``, or what ``validation_split`` took; their batch
    size ``validation_batch_size`` or ``batch_size``). Inputs of unknown length, datasets and
    generators given as validation data are not told apart (``[]`` for them)."""
    found = []
    adapter = _keras_compat.fit_data_adapter()
    batches, size = getattr(adapter, "num_batches", None), getattr(adapter, "batch_size", None)
    if batches and batches > 1 and size and getattr(adapter, "has_partial_batch", False):
        partial = getattr(adapter, "partial_batch_size", None)
        found.append(f"training: {(batches - 1) * size + (partial or 0)} samples in batches of {size}")
    count, size = _keras_compat.fit_validation_arrays()
    if count > size and count % size:
        found.append(f"validation: {count} samples in batches of {size}")
    return found


def warn_unequal_batch_losses(model, writer: str | None, live: str) -> None:
    """Warn when a checkpoint written on one side of TensorFlow resumes on the other for a
    model that reports a loss per output and an input of unequal batches: TensorFlow's ``fit``
    averages each ``<output>_loss`` over batches when the batch size is not static (a partial
    last batch makes it so: `compat.per_output_loss_weighting`), JAX's and Torch's over
    samples, so the History's per-output losses of the epochs trained after the resume differ
    from the writer's run (stock Keras on the two backends differs alike). Weights, optimizer
    state and the total loss are not affected."""
    if not writer or writer == live or "tensorflow" not in (writer, live):
        return
    indices, _ = _keras_compat.per_output_loss_weighting(model)
    unequal = _unequal_batches() if indices else []
    if not unequal:
        return
    names = _keras_compat.per_output_loss_names(model)
    warnings.warn(
        f"StableCheckpoint: the checkpoint was written on {writer} and training resumes on {live}; "
        f"this model reports a loss per output ({names}) and its batches are of unequal sizes "
        f"({'; '.join(unequal)}): TensorFlow's fit averages each output's loss over batches where "
        "the batch size is not static (each batch counts once), JAX's and Torch's over samples, so "
        f"the History's per-output losses of the epochs trained here differ from the run on {writer} "
        "(stock Keras on the two backends differs alike); weights, optimizer state and the total loss "
        f"do not. Resume on {writer} for the same History.",
        InexactResumeWarning,
        stacklevel=4,
    )


def warn_loss_weighting(model, record, position, writer, live):
    """Warn when the saved per-output loss means of the interrupted epoch were counted
    in other units than this ``fit`` counts them and cannot be converted (`loss_units`:
    batches of unequal sizes): the resumed epoch's History ``<output>_loss`` values would
    then weigh the saved and the new batches unlike an uninterrupted run. Training itself
    is not affected."""
    values = _state.join_arrays(record.extra.get("providers", {}).get("metrics"), record.arrays)
    units = loss_units(model, values, position.step)
    if units is None or units.convertible:
        return
    where = f"on {writer}" if writer else "by another fit"
    warnings.warn(
        f"StableCheckpoint: the checkpoint (epoch {position.epoch}, step {position.step}) was written "
        f"{where}, whose per-output loss trackers {units.names} counted {units.saved} in the interrupted "
        f"epoch; this fit on {live} counts {units.live} (TensorFlow counts batches when the input's "
        "batch size is not static, e.g. a generator or tf.data with batch()), and the epoch's batches "
        "so far held unequal numbers of samples, so the saved means cannot be converted. The History's "
        "per-output losses of that epoch weigh the saved and the new batches unlike an uninterrupted "
        "run; weights, optimizer state, the total loss and later epochs are not affected. Resume "
        f"{'on ' + writer if writer and writer != live else 'with the same kind of input'} or from an "
        "epoch-boundary checkpoint (save_freq='epoch') for exact per-output losses.",
        InexactResumeWarning,
        stacklevel=4,
    )


def warn_resumed_callbacks(ckpt: Any, record: Any, where: str, position: Position) -> None:
    """The warnings of a resume (``ckpt`` restored ``record``, from the file ``where``, at
    ``position``) about the callbacks of its ``fit``: `warn_unknown_callbacks` and
    `warn_changed_callbacks` (called from ``StableCheckpoint._restore_newest`` in
    ``on_train_begin``: they point at its caller). Saved states that no callback takes are
    not warned about when the restored run was stopped by a callback (``position.stopped``):
    continuing it (``resume_stopped=True``, more ``epochs``) usually means removing or
    changing the callback that stopped it; ``report.dropped`` lists them."""
    warn_unknown_callbacks(ckpt)
    warn_changed_callbacks(record, ckpt._callbacks, where, lost=position.stopped is None)


def warn_unknown_callbacks(ckpt):
    """Warn, on a resume, for each callback of this ``fit`` (but ``ckpt``) whose state the library
    cannot see: one of the user's own (or a ``LambdaCallback``) without
    ``get_state()``/``set_state()`` and not a kind whose state is known. Its attributes
    start fresh in the new process, so if they decide anything (a counter, a best
    value) the resumed run acts otherwise. ``get_state()`` returning ``{}`` declares a
    callback stateless."""
    for cb in _keras_compat.fit_callbacks():
        if cb is ckpt or _state.callback_state(cb) is not None or not opaque(cb):
            continue
        name = type(cb).__name__
        warnings.warn(
            f"StableCheckpoint: the callback {name} of this fit has no get_state()/set_state(), "
            "so any state it keeps in its attributes is not in the checkpoint and starts fresh in "
            "the resumed run; if that state changes training (a counter, a best value), the run "
            "does not end like an uninterrupted one. Give it get_state() (a dict of JSON values "
            "and NumPy arrays) and set_state(state): StableCheckpoint then saves and restores it "
            "without configuration; a get_state() that returns {} declares it stateless.",
            InexactResumeWarning,
            stacklevel=5,
        )


def _holds_state(value: Any) -> bool:
    """Whether a callback state (saved, or live) holds anything: ``{}`` (or an empty
    list) is a callback that declares itself stateless."""
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)


def warn_changed_callbacks(record: Any, callbacks: dict[str, Any], where: str, lost: bool = True) -> None:
    """Warn, on a resume, when this ``fit``'s callbacks (``callbacks``: ``{key: callback}``,
    those saved, see ``checks.fit_keyed``) differ from those whose state the checkpoint
    ``where`` holds (``record``): a saved non-empty state no callback of this ``fit`` takes
    (the callback was removed, or is keyed otherwise now), and a stateful callback (but a
    ``History``) that has no saved state and starts fresh (added, or written by a version
    that saved only the callbacks named in ``StableCheckpoint(callbacks=...)``); the former
    only with ``lost``."""
    saved = record.extra.get("callbacks", {})
    unused = sorted(k for k, v in saved.items() if k not in callbacks and _holds_state(v))
    if unused and lost:
        warnings.warn(
            f"StableCheckpoint: the checkpoint {where} holds the state of the callbacks {unused}, "
            "which no callback of this fit takes (keys: the names given in "
            "StableCheckpoint(callbacks=...), else the class name and the position among the fit's "
            "callbacks of that class): the resumed run goes on without that state, and does not "
            "end like an uninterrupted one (e.g. it stops, or changes the learning rate, at "
            "another epoch). Pass the callbacks of the run that saved it, in the same order and "
            "with the same names; if another callback of the same class was removed, the ones "
            "left took the saved states by position: name each in StableCheckpoint(callbacks="
            "{name: callback}) to key it by name. If you removed them on purpose, nothing else "
            "is affected.",
            InexactResumeWarning,
            stacklevel=5,
        )
    fresh = []
    for key, cb in callbacks.items():
        if key in saved or isinstance(cb, keras.callbacks.History):
            continue
        value = _state.callback_state(cb)
        if _holds_state(value):
            fields = f" ({', '.join(sorted(map(str, value)))})" if isinstance(value, dict) else ""
            fresh.append(f"{key}{fields}")
    if fresh:
        warnings.warn(
            f"StableCheckpoint: the checkpoint {where} holds no state for the callbacks "
            f"{fresh} of this fit, so they start fresh: they may act (stop, change the learning "
            "rate, save) at another epoch than in an uninterrupted run. They are new in this fit, "
            "or keyed otherwise than when it was saved (keys: the names given in "
            "StableCheckpoint(callbacks=...), else the class name and the position among the "
            "fit's callbacks of that class), or the checkpoint was written by a version that "
            "saved only the callbacks named there. Pass the callbacks as the run that saved it "
            "did; a callback added on purpose starts fresh, as intended.",
            InexactResumeWarning,
            stacklevel=5,
        )


def warn_counter_limit(model: keras.Model, position: Position, params: dict[str, Any] | None) -> None:
    """Warn, at train begin, when the batches this ``fit`` plans (``params``: its
    ``epochs`` and ``steps``, from ``position`` on) would take an optimizer's
    ``iterations`` counter past its integer dtype's maximum: Keras keeps it as ``int32`` on
    JAX and Torch, where it wraps to -2**31 (schedules and Adam's bias correction break,
    and a save after it is refused). The step named is the global step of the batch
    that wraps it. Nothing is said when the number of steps is not known."""
    epochs, steps = (params or {}).get("epochs"), (params or {}).get("steps")
    if not epochs or not steps:
        return
    planned = (epochs - position.epoch) * steps - position.step
    for name, opt in tracked_optimizers(model).items():
        for prefix, sub in optimizer_tree(opt):
            counter = _keras_compat.iterations_variable(sub)
            if counter is None:
                continue
            dtype = np.dtype(keras.backend.standardize_dtype(counter.dtype))
            if dtype.kind not in "iu":
                continue
            limit, count = int(np.iinfo(dtype).max), int(to_numpy(counter))
            if count < 0 or count + planned <= limit:
                continue
            left = limit - count  # batches before the counter holds its maximum
            offset = position.epoch * steps + position.step + left  # the wrapping batch, from fit's start
            label = f"{name}{'/' + prefix.rstrip('/') if prefix else ''}"
            warnings.warn(
                f"StableCheckpoint: the optimizer {label!r} ({type(sub).__name__}) has counted {count} "
                f"steps in its {dtype.name} iteration counter, whose maximum is {limit}; this fit plans "
                f"{planned} more batches, and the counter wraps to {int(np.iinfo(dtype).min)} at global "
                f"step {position.global_step + left + 1} (epoch {offset // steps}, batch "
                f"{offset % steps}): from there learning-rate schedules and Adam's bias correction "
                "break, and the next checkpoint is refused. Train at most "
                f"{left} more batches in this run (fewer epochs), or continue on TensorFlow, whose "
                "counter is int64.",
                InexactResumeWarning,
                stacklevel=3,
            )
