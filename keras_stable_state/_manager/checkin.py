"""The check-in of a [`CheckpointManager`][keras_stable_state.CheckpointManager] run by several
processes (Torch ranks under ``torch.distributed``, JAX processes under ``jax.distributed``):
at each of its collective calls (``save``, ``reached_preemption``) the processes gather a
small digest of their training state and refuse, on every process, to go on when the
digests differ (a rank that skipped the restore, or drifted), naming each rank's values and
what to do. With one process nothing is exchanged."""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_stable_state import _processes
from keras_stable_state._manager import timeline
from keras_stable_state._numpy import to_numpy
from keras_stable_state.errors import InexactResumeWarning, StateError

# ``mgr`` below is a CheckpointManager (not imported: manager imports this module).
CheckpointManager = Any

CALLS = ("save", "reached_preemption")
FIELDS = ("call", "flag", "step", "restored", "iterations", "world", "locked")
"""The digest, one int each (``-1``: none): the call (an index of `CALLS`), a signal
received (``reached_preemption``), the step, the step restored (``restored_step``), the
optimizer's ``iterations`` (see `iterations`), the world size, whether the process holds its lock."""
_COMPARED = ("call", "step", "restored", "iterations", "world")  # "flag", "locked": any, all
_COLUMN = {name: i for i, name in enumerate(FIELDS)}


def iterations(model: Any, optimizer: Any) -> int:
    """The ``iterations`` of the Keras optimizer given (the first by name of a dict), else of
    ``model.optimizer``; for a ``torch.optim`` optimizer the largest ``step`` of its
    per-parameter state (``0`` before its first step); ``-1`` where there is none."""
    if isinstance(optimizer, dict):
        optimizer = optimizer[sorted(optimizer)[0]] if optimizer else None
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return int(np.asarray(to_numpy(optimizer.iterations)).reshape(-1)[0])
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(optimizer, torch.optim.Optimizer):
        steps = [state["step"] for state in optimizer.state.values() if "step" in state]
        return max((int(step) for step in steps), default=0)
    return -1


def _row(mgr: CheckpointManager, call: str, step: int, flag: bool, count: int) -> list[int]:
    restored = mgr.restored_step
    values = {
        "call": CALLS.index(call),
        "flag": int(bool(flag)),
        "step": int(step),
        "restored": -1 if restored is None else int(restored),
        "iterations": count,
        "world": _processes.process_count(),
        "locked": int(mgr.locked),
    }
    return [values[name] for name in FIELDS]


def check_in(
    mgr: CheckpointManager,
    call: str,
    step: int,
    *,
    model: Any = None,
    optimizer: Any = None,
    flag: bool = False,
) -> np.ndarray | None:
    """The digests of every process (``int64`` of shape ``(processes, len(FIELDS))``), once
    they agree; ``None`` with one process (nothing exchanged). A collective with several.

    Raises:
        StateError: on every process, if the digests differ in call, step, step restored,
            optimizer iterations or world size, naming each rank's values and the fix.
    """
    if _processes.process_count() == 1:
        return None
    count = -1 if call != "save" else iterations(model, optimizer)
    rows = _processes.gather_rows(_row(mgr, call, step, flag, count), f"{mgr.name}.{call}({step})")
    compare(mgr, call, step, rows)
    return rows


def compare(mgr: CheckpointManager, call: str, step: int, rows: np.ndarray) -> None:
    """Check the gathered digests ``rows`` of `check_in` (one row of `FIELDS` per process).

    Raises:
        StateError: if they differ in call, step, step restored, optimizer iterations or
            world size, naming each rank's values and the fix.
    """
    differ = [name for name in _COMPARED if len(set(rows[:, _COLUMN[name]].tolist())) > 1]
    if differ:
        raise _refusal(mgr, call, step, rows, differ)


def _by_value(rows: np.ndarray, name: str, show: Callable[[int], str]) -> str:
    """``"rank 0: step 40; ranks 1, 2: nothing"``: the ranks of each value of column ``name``."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(rows[:, _COLUMN[name]].tolist()):
        groups.setdefault(int(value), []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {show(value)}"
        for value, ranks in groups.items()
    )


def _refusal(mgr: CheckpointManager, call: str, step: int, rows: np.ndarray, differ: list[str]) -> StateError:
    me = _processes.process_index()
    told = []
    if "restored" in differ:
        column = rows[:, _COLUMN["restored"]].tolist()
        missing = [r for r, s in enumerate(column) if s < 0]
        done = sorted({s for s in column if s >= 0})
        if missing and len(done) == 1:
            ranks = [r for r, s in enumerate(column) if s >= 0]
            told.append(
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not restore step "
                f"{done[0]} that rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} restored: "
                "call mgr.restore(model, ...) on every rank before training, and start every rank's loop "
                "from mgr.restored_step"
            )
        else:
            told.append(
                "the ranks restored different steps ("
                + _by_value(rows, "restored", lambda s: "nothing" if s < 0 else f"step {s}")
                + "): every rank must restore the same step of the same directory (one shared file "
                "system): call mgr.restore(model, ...) on every rank, with the same step"
            )
    if "call" in differ:
        told.append(
            "the ranks are in different calls ("
            + _by_value(rows, "call", lambda c: f"{CALLS[c]}()")
            + "): every rank must call save and reached_preemption in the same order"
        )
    if "step" in differ:
        told.append(
            f"the ranks are at different steps ({_by_value(rows, 'step', str)}): every rank must call "
            f"{call} at the same step, with the same step number (the global step, counted alike on every rank)"
        )
    if "iterations" in differ:
        told.append(
            "the ranks' optimizers stepped a different number of times ("
            + _by_value(rows, "iterations", lambda n: "no optimizer" if n < 0 else f"iterations {n}")
            + "): restore the optimizer on every rank (mgr.restore(model, optimizer=...) or a compiled "
            "model), pass the same optimizer to save on every rank, and apply one update per step on each"
        )
    if "world" in differ:
        told.append(f"the ranks see different world sizes ({_by_value(rows, 'world', str)})")
    received = {
        rank: {name: int(rows[rank, _COLUMN[name]]) for name in _COMPARED} for rank in range(rows.shape[0])
    }
    for digest in received.values():
        digest["call"] = CALLS[digest["call"]]
    return StateError(
        f"{mgr.name}({mgr.directory!r}).{call}({step}) on rank {me}: the {rows.shape[0]} ranks' training "
        f"states differ, so none goes on (every rank raises this error): " + "; ".join(told) + ". "
        f"Each rank's digest (-1: none): {received}.",
        key=None,
        expected="the same call, step, step restored, optimizer iterations and world size on every rank",
        received=received,
    )


def begin_save(mgr: CheckpointManager, step: int, new_timeline: bool, model: Any, optimizer: Any) -> None:
    """The start of ``mgr.save(step, model, optimizer=optimizer, new_timeline=...)``: the
    check-in, the lock (with several processes, taken as a collective where a process lacks
    it), the background save in flight collected, then the timeline's move (`.timeline.before_save`).

    Raises:
        StateError: as `check_in`, and as `.timeline.before_save`.
        Exception: the errors of ``mgr.lock`` and of the background save in flight.
    """
    rows = check_in(mgr, "save", step, model=model, optimizer=optimizer)
    if rows is None:
        mgr._ensure_locked()
    elif not locked_everywhere(rows):
        mgr.lock_everywhere()
    mgr.wait()
    timeline.before_save(mgr, step, new_timeline)


def locked_everywhere(rows: np.ndarray | None) -> bool:
    """Whether every process of the check-in ``rows`` holds its lock (``False`` with one process:
    the manager locks as usual)."""
    return rows is not None and bool(rows[:, _COLUMN["locked"]].all())


def any_signal(rows: np.ndarray) -> bool:
    """Whether any process of the check-in ``rows`` received a signal."""
    return bool(rows[:, _COLUMN["flag"]].any())


def preemption_check(mgr: CheckpointManager) -> Callable[[bool, int], bool]:
    """The ``check_in(flag, step)`` of ``mgr``'s preemption guards: whether any process
    received a signal, the processes checked in at ``reached_preemption(step)`` (a collective
    with several; ``flag`` with one). Holds ``mgr`` weakly."""
    ref = weakref.ref(mgr)

    def check(flag: bool, step: int) -> bool:
        manager = ref()
        if manager is None:  # the manager is gone: the plain agreement on the step
            return _processes.any_process(flag, step, f"reached_preemption({step})")
        with _processes.torch_ranks(collective=True):
            rows = check_in(manager, "reached_preemption", step, flag=flag)
        return bool(flag) if rows is None else any_signal(rows)

    return check


@_processes.torch_ranks(collective=False)
def restored(mgr: CheckpointManager, path: str, state: Any) -> None:
    """Say (``verbose``) that ``mgr`` restored ``path``; warn where it was saved by another
    number of processes than this run's and no provider of the restore's ``state`` replays
    the data order for another world size (`kss.ResumableSampler`).

    Warns:
        InexactResumeWarning: naming both numbers of processes and the fixes.
    """
    mgr._say(f"restored {path} (step {mgr.restored_step})")
    saved = timeline.summary(mgr, path)[1].get("world_size")  # the manager's record
    live = _processes.process_count()
    providers = state.values() if isinstance(state, dict) else ()
    if (
        not isinstance(saved, int)
        or saved == live
        or any(getattr(type(p), "replays_other_world_sizes", False) for p in providers)
    ):
        return
    warnings.warn(
        f"{mgr.name}: the checkpoint {path!r} (step {mgr.restored_step}) was saved by {saved} process(es) "
        f"and this run has {live}: a per-rank split of the data (a DistributedSampler) gives each rank other "
        "samples for another number of processes, and the global batch (per-rank batch x processes) "
        "changes with it unless the per-rank batch does, so the resumed run can train other samples "
        f"than the uninterrupted one. Resume on {saved} process(es), or read the data through "
        "kss.ResumableSampler (passed in state=), which replays the saved order where the global batch "
        "is unchanged and says where it cannot.",
        InexactResumeWarning,
        stacklevel=3,
    )
