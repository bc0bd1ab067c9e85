"""A checkpoint directory shared by several processes (JAX processes under ``jax.distributed``,
Torch ranks under ``torch.distributed``): process 0 alone locks, lists, prunes and moves
unreadable checkpoints aside; the others wait for it and take its answers. Every function
here is a collective (see `keras_stable_state._processes`), except where a process decides
alone (Torch ranks restoring: ``_processes.independent()``): then each process lists and
reads for itself, and only process 0 moves files. With one process it is the plain
directory call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from keras_stable_state import _processes
from keras_stable_state._manager.protocols import CheckpointDirectory
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, StateError


class Follower:
    """The lock of a manager on a process other than 0 (JAX process, Torch rank): process 0
    holds the directory's; releasing it releases nothing there.

    Attributes:
        held: ``True`` from its making to its release (see ``CheckpointManager.locked``).
        token: The owner's token.
    """

    def __init__(self, token: int) -> None:
        self.token = token
        self.held = True

    def release(self, token: int) -> None:
        if token == self.token:
            self.held = False


_Lock = TypeVar("_Lock")


def held(lock: _Lock, token: int) -> _Lock | Follower:
    """The lock a manager holds once its locking ran on process 0
    (`keras_stable_state._processes.on_primary`): ``lock`` there (and with one process), a `Follower`
    of ``token`` on the others."""
    return lock if _processes.process_index() == 0 else Follower(token)


_OUTCOMES = ("read", "unreadable", "not found", "refused")


@_processes.torch_ranks(collective=False)  # a restore's: no collective on Torch
def checkpoints(files: CheckpointDirectory, directory: str) -> list[str]:
    """The checkpoints of ``directory`` as process 0 lists them (newest first), through
    ``files`` (what reads and writes it); as this process lists them where it decides alone."""
    with _processes.on_primary(directory, share=True) as turn:
        if turn.runs or turn.alone:
            turn.result = files.checkpoints()
    return turn.result


@_processes.torch_ranks(collective=False)  # a restore's: no collective on Torch
def move_aside(files: CheckpointDirectory, path: str, writer: str) -> str | None:
    """``files.move_aside`` on process 0, once every process has read ``path``; its result.
    Where the process decides alone, process 0 moves it and the others return ``None`` (they
    only skip it)."""
    with _processes.on_primary(path, share=True) as turn:
        if turn.runs:
            turn.result = files.move_aside(path, writer)
    return turn.result


@_processes.torch_ranks(collective=False)  # a restore's: no collective on Torch
def read_agreed(path: str, read: Callable[[str], Any]) -> Any:
    """The record of ``path`` (``read(path)``); with several processes, once every
    process read it alike, so that all take the same branch of
    `.directory.restore_newest` (restore, move aside, skip or raise). Where the process
    decides alone (Torch ranks restoring) nothing is compared: each reads for itself, and the
    ranks' steps restored are compared at the next save.

    Raises:
        StateError: if the processes' reads ended differently, naming each outcome.
        Exception: this process' read error, when every process failed alike.
    """
    if _processes.independent():
        return read(path)
    code = 0
    try:
        record, failure = read(path), None
    except (CorruptCheckpointError, CheckpointFormatError) as err:
        record, failure, code = None, err, 1
    except FileNotFoundError as err:
        record, failure, code = None, err, 2
    except Exception as err:  # noqa: BLE001 - re-raised below, once the processes have compared
        record, failure, code = None, err, 3
    codes = _processes.gather_ints(code)
    if len(set(codes)) > 1:
        told = ", ".join(f"process {i}: {_OUTCOMES[c]}" for i, c in enumerate(codes))
        raise StateError(
            f"The processes read the checkpoint {path!r} differently ({told}): they must restore "
            "the same checkpoint, and none falls back on its own. Check that every process sees the "
            "same files (one shared file system), then restore again.",
            key=None,
            expected="the same outcome on every process",
            received=told,
        ) from failure
    if failure is not None:
        raise failure
    return record
