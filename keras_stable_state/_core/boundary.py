"""Saves from another thread while ``fit`` trains the model: taken at a step boundary, or
refused.

A save reads every variable of the model and its optimizers. ``fit`` changes them in
its training thread, a step at a time (and on JAX keeps them detached from the model
in the middle of an epoch); a save from another thread that reads them while a step
runs would write the weights of one step with the iteration counter of another. A
Keras callback cannot wrap the step, but it runs between steps, and that is what
this module uses:

* while a ``fit`` with a [`StableCheckpoint`][keras_stable_state.StableCheckpoint] runs, the
  callback holds a `StepGate` for the model (`training_begins` at train
  begin, `training_ends` at train end); a save from another thread waits in
  `saving` for the next step boundary, where the training thread, in
  ``on_train_batch_end`` (`step_boundary`), attaches the state to the model
  (JAX) and waits until the save has read everything it saves;
* while any other ``fit`` of the model runs in another thread (found on that thread's
  call stack), a save is refused, naming the thread: nothing at a step boundary can
  let it in.

Waiting rather than refusing, where a gate exists, is the useful answer: a monitoring
or preemption thread that asks for a checkpoint gets one, of one step, after at most
one step. A save from the training thread itself (a callback) is at a boundary
already and runs as before.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from keras_stable_state import _keras_compat
from keras_stable_state.errors import StateError

__all__ = ["StepGate", "saving", "step_boundary", "training_begins", "training_ends"]

_POLL_SECS = 0.2  # how often a waiting save checks that the training thread is still in fit
_GATES: dict = {}  # id(model) -> StepGate
_GATES_LOCK = threading.Lock()


class StepGate:
    """The step boundaries of one ``fit`` of ``model`` in the thread that created it.

    Attributes:
        owner: The training thread's ident.
        owner_name: Its name, for messages.
        waiting: How many saves from other threads wait for (or run at) a boundary.
        paused: ``True`` while the training thread waits at a boundary for them.
        closed: ``True`` once the fit ended (or was found gone): waiting saves run.
    """

    def __init__(self, model):
        thread = threading.current_thread()
        self.model = weakref.ref(model)
        self.owner, self.owner_name = thread.ident, thread.name
        self.cond = threading.Condition()
        self.waiting = 0
        self.paused = False
        self.closed = False

    def alive(self) -> bool:
        """Whether the training thread still runs a ``fit`` of the model."""
        model = self.model()
        return model is not None and self.owner in {ident for ident, _ in _keras_compat.fit_threads(model)}


def _gate(model):
    gate = _GATES.get(id(model))
    return gate if gate is not None and gate.model() is model else None


def training_begins(model) -> StepGate:
    """A ``fit`` of ``model`` starts in this thread: saves from other threads wait for its
    step boundaries from now on (until `training_ends`)."""
    gate = StepGate(model)
    with _GATES_LOCK:
        old = _GATES.get(id(model))
        _GATES[id(model)] = gate
    if old is not None:
        _close(old)
    return gate


def training_ends(model) -> None:
    """The ``fit`` of ``model`` in this thread ended: waiting saves run now."""
    with _GATES_LOCK:
        gate = _GATES.get(id(model))
        if gate is None or gate.owner != threading.get_ident():
            return
        del _GATES[id(model)]
    _close(gate)


def _close(gate) -> None:
    with gate.cond:
        gate.closed = True
        gate.cond.notify_all()


def step_boundary(model, attach) -> None:
    """The training thread is between two steps of ``model``: let every waiting save run.

    Args:
        model: The model trained.
        attach: Called first when a save waits: puts the training state on the model's
            variables (JAX keeps it detached in the middle of an epoch).
    """
    gate = _gate(model)
    if gate is None or gate.owner != threading.get_ident():
        return
    with gate.cond:
        if not gate.waiting:
            return
        attach()
        gate.paused = True
        gate.cond.notify_all()
        while gate.waiting:
            gate.cond.wait()
        gate.paused = False


@contextlib.contextmanager
def saving(model, verb: str):
    """Read ``model`` for a save (``verb`` names it): at once from the training thread or
    when no ``fit`` runs; at the next step boundary while a ``fit`` with a gate runs in
    another thread (saves waiting together run one at a time, the training thread
    waiting until all of them have read what they save).

    Raises:
        StateError: if a ``fit`` of ``model`` without a gate (no ``StableCheckpoint``)
            runs in another thread, naming it.
    """
    me = threading.get_ident()
    gate = _gate(model)
    if gate is not None and gate.owner != me and not gate.closed:
        with gate.cond:
            gate.waiting += 1
            try:
                while not gate.paused and not gate.closed:
                    gate.cond.wait(_POLL_SECS)
                    if not gate.paused and not gate.closed and not gate.alive():
                        gate.closed = True  # the fit raised: Keras calls no on_train_end then
                yield
            finally:
                gate.waiting -= 1
                gate.cond.notify_all()
        return
    if gate is None or gate.closed:
        others = [name for ident, name in _keras_compat.fit_threads(model) if ident != me]
        if others:
            raise StateError(
                f"{verb} was called from thread {threading.current_thread().name!r} while model "
                f"{getattr(model, 'name', model)!r} is trained by fit in thread {others[0]!r}, which has no "
                "StableCheckpoint: a save from another thread would read the variables in the middle of "
                "a training step (the weights of one step with the optimizer's iteration counter of "
                "another; on JAX the variables are detached from the model during an epoch). Save from "
                "a callback in the training thread (on_train_batch_end), or pass a "
                "keras_stable_state.StableCheckpoint to fit: saves from other threads then wait for the "
                "next step boundary.",
                expected="a save in the training thread, or a fit with a StableCheckpoint",
                received=f"thread {threading.current_thread().name!r}",
            )
    yield
