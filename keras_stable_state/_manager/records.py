"""What a [`CheckpointManager`][keras_stable_state.CheckpointManager] records in each checkpoint (record
``providers/checkpoint``: step, epoch, metrics, wall time, world size), what it tells of one
([`CheckpointMetadata`][keras_stable_state.CheckpointMetadata]), and the checks of the steps and metrics it is given."""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

from keras_stable_state._manager import directory
from keras_stable_state.errors import CheckpointFormatError

RECORD = "checkpoint"
"""The provider name (record ``providers/checkpoint``) of the manager's metadata in each
checkpoint: its step, epoch, metrics, wall time and world size (``"world_size"``: the
number of processes that saved it, JAX processes or Torch ranks), and with a ``monitor`` its name and
direction (``"monitor"``, ``"mode"``: ``"min"`` or ``"max"``), so that ``keras-stable-state
ls`` names the best."""

# The keywords of save_training_state that CheckpointManager.save passes on.
SAVE_KEYWORDS = (
    "model_state",
    "callbacks",
    "state",
    "include_rng",
    "allow_order_keys",
    "variables",
    "mappers",
)


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What [`CheckpointManager.metadata`][keras_stable_state.CheckpointManager.metadata] tells of one checkpoint, read from its
    records alone (its seal is checked, its arrays are not read).

    Attributes:
        step: The step it was saved at, from its sealed record (a file whose name names
            another step is refused: see `check_named_step`).
        path: Its path.
        epoch: The epoch given to [`CheckpointManager.save`][keras_stable_state.CheckpointManager.save] (a ``StableCheckpoint``
            gives the epoch of its position), or ``None``.
        metrics: The metrics given to [`CheckpointManager.save`][keras_stable_state.CheckpointManager.save], ``{name: float}``
            (read-only; ``{}`` for a checkpoint saved without them or by an older version).
        wall_time: When it was saved, in seconds since the Unix epoch (``time.time()``),
            or ``None`` for a checkpoint saved by an older version.
        size_bytes: Its size on disk.
        format: Its file format version.
        backend: The Keras backend that wrote it (``"jax"``, ``"tensorflow"``, ``"torch"``).
        world_size: The number of processes that saved it (JAX processes under
            ``jax.distributed``, Torch ranks under ``torch.distributed``; ``1`` for one),
            or ``None`` for a checkpoint saved by an older version.

    Examples:
        >>> mgr = CheckpointManager("ckpts")
        >>> _ = mgr.save(1, model, metrics={"loss": 0.5}, epoch=0)
        >>> info = mgr.metadata(1)
        >>> info.step, info.epoch, info.metrics["loss"], info.backend == keras.backend.backend()
        (1, 0, 0.5, True)
        >>> mgr.close()
    """

    step: int
    path: str
    epoch: int | None
    metrics: types.MappingProxyType[str, float]
    wall_time: float | None
    size_bytes: int
    format: int | None
    backend: str | None
    world_size: int | None = None


class ManagerRecord:
    """The provider holding the manager's metadata of one save (never restored)."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def get_state(self) -> dict[str, Any]:
        return self.value

    def set_state(self, state: dict[str, Any]) -> None:
        self.value = state


def check_step(step: object) -> int:
    """``step`` if it is an int a file name holds, else ``ValueError`` naming it."""
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= directory.MAX_STEP):
        raise ValueError(
            f"`step` must be an int from 0 to {directory.MAX_STEP} (it names the file ckpt-<step:010d>.h5). "
            f"Received: step={step!r}"
        )
    return step


def check_metrics(metrics: object) -> dict[str, float]:
    """``metrics`` as ``{name: float}``; ``TypeError`` / ``ValueError`` naming a bad entry."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"`metrics` must be a dict of {{name: float}}. Received: {type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"`metrics` names must be non-empty str. Received: {name!r}")
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"`metrics[{name!r}]` must be a number (a float, or a scalar array). Received: {value!r}"
            ) from err
        out[name] = number
    return out


def metadata_of(
    step: int, path: str, summary: tuple[dict[str, Any], dict[str, Any], int | None], size_bytes: int
) -> CheckpointMetadata:
    """The [`CheckpointMetadata`][keras_stable_state.CheckpointMetadata] of the checkpoint ``path`` of ``step`` from its
    ``summary``: ``(writer metadata, manager record, format version)``."""
    metadata, record, version = summary
    epoch = record.get("epoch")
    wall_time = record.get("wall_time")
    world = record.get("world_size")
    return CheckpointMetadata(
        step=step,
        path=path,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        metrics=types.MappingProxyType(dict(record.get("metrics") or {})),
        wall_time=float(wall_time) if isinstance(wall_time, (int, float)) else None,
        size_bytes=size_bytes,
        format=version,
        backend=metadata.get("backend"),
        world_size=world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None,
    )


def saved_message(shown: str, where: str, size_bytes: int, secs: float, blocked_secs: float | None) -> str:
    """The verbose line of a save of ``shown`` (a path or name) taken at ``where``."""
    timing = f"{secs * 1e3:.0f} ms"
    if blocked_secs is not None:
        timing = f"{timing} in the background, training blocked {blocked_secs * 1e3:.0f} ms"
    return f"saved {shown} ({where}): {size_bytes / 1e6:.2f} MB in {timing}"


def check_save_keywords(state: dict[str, Any], epoch: object) -> dict[str, Any]:
    """Check the keywords of [`CheckpointManager.save`][keras_stable_state.CheckpointManager.save] besides its own; pop and return
    its ``state`` providers (``{}`` for none).

    Raises:
        TypeError: for a keyword that is not one of `SAVE_KEYWORDS`, an ``epoch`` that
            is not ``None`` or an int >= 0, or a ``state`` that is not a dict.
        ValueError: for a ``state`` provider named `RECORD`.
    """
    for name in state:
        if name not in SAVE_KEYWORDS:
            hint = " (use save_on_background=True)" if name == "blocking" else ""
            raise TypeError(f"CheckpointManager.save() got an unexpected keyword argument {name!r}{hint}")
    if epoch is not None and not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
        raise TypeError(f"`epoch` must be None or an int >= 0. Received: epoch={epoch!r}")
    providers = state.pop("state", None) or {}
    if not isinstance(providers, dict):
        raise TypeError(f"`state` must be a dict of {{name: provider}}. Received: {type(providers).__name__}")
    if RECORD in providers:
        raise ValueError(
            f"`state` names a provider {RECORD!r}: that name holds the manager's own record (step, "
            "epoch, metrics). Give your provider another name."
        )
    return providers


def recorded_step(record: dict[str, Any]) -> int | None:
    """The step the manager's record (``providers/checkpoint``) of a checkpoint names, or
    ``None`` if it names none (a file not saved by a manager)."""
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def record_of(extra: dict[str, Any]) -> dict[str, Any]:
    """The manager's record in a checkpoint's ``extra`` records (``{}`` if it has none)."""
    record = (extra.get("providers") or {}).get(RECORD) if isinstance(extra, dict) else None
    return record if isinstance(record, dict) else {}


def check_named_step(path: str, record: dict[str, Any]) -> int:
    """The step of the checkpoint ``path``, once its file name and its sealed record
    (the manager's ``record``) agree on it.

    Raises:
        CheckpointFormatError: if the record names another step than the file name (a
            checkpoint copied or renamed onto another step's name) or none (a file not
            written by a manager), naming both; the manager moves such a file into
            ``unreadable/`` as it does a damaged one, and never restores it.
    """
    named = directory.step_of(path)
    found = recorded_step(record)
    if found is not None and found == named:
        return found
    what = f"step {found}" if found is not None else "no step (it was not saved by a CheckpointManager)"
    raise CheckpointFormatError(
        f"Checkpoint {path!r} is named for step {named}, but its sealed record says {what}: it was "
        "copied or renamed onto another step's name, and is never restored as that step. The "
        "directory's manager moves it into 'unreadable/'. To resume from it, rename it to "
        + (f"ckpt-{found:010d}{os.path.splitext(path)[1]}" if found is not None else "to the step it holds")
        + ", or restore it with restore_training_state(path, model).",
        key=f"providers/{RECORD}/step",
        expected=named,
        received=found,
    )
