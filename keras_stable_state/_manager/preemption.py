"""Preemption: signal handlers that only note that a signal came, and the step at which
every process agrees to save and stop (used by ``CheckpointManager.preemption_guard`` and
by ``StableCheckpoint(save_on_preemption=True)``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from keras_stable_state import _processes
from keras_stable_state.errors import StateError

DEFAULT_SIGNALS = (signal.SIGTERM,)
_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}


def check_signals(signals, argument="signals") -> tuple:
    """``signals`` as a tuple of distinct ``signal.Signals``.

    Raises:
        TypeError: if ``signals`` is not a sequence of ints (``signal.SIGTERM``...).
        ValueError: if it is empty, names no signal of this platform, or names one that no
            handler can catch (``SIGKILL``, ``SIGSTOP``).
    """
    if isinstance(signals, (int, str, bytes)) or not hasattr(signals, "__iter__"):
        raise TypeError(
            f"`{argument}` must be a sequence of signals, e.g. (signal.SIGTERM, signal.SIGUSR1). "
            f"Received: {argument}={signals!r}"
        )
    out = []
    for sig in signals:
        if not isinstance(sig, int) or isinstance(sig, bool):
            raise TypeError(
                f"`{argument}` must hold signal numbers (signal.SIGTERM...); received {sig!r} in "
                f"{argument}={signals!r}."
            )
        try:
            sig = signal.Signals(sig)
        except ValueError:
            raise ValueError(
                f"`{argument}` holds {sig!r}, which is no signal of this platform. Received: "
                f"{argument}={signals!r}"
            ) from None
        if sig in _UNCATCHABLE:
            raise ValueError(
                f"`{argument}` holds {sig.name}, which no handler can catch (the process is stopped "
                f"or killed at once). Use SIGTERM, SIGUSR1... Received: {argument}={signals!r}"
            )
        if sig not in out:
            out.append(sig)
    if not out:
        raise ValueError(f"`{argument}` must name at least one signal. Received: {argument}={signals!r}")
    return tuple(out)


def _on_stack(target, frame) -> bool:
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


class PreemptionGuard:
    """Signal handlers, installed while the guard is entered, that only note which signal
    came; `reached_preemption` tells the training loop when to save and stop.

    Made by `CheckpointManager.preemption_guard<keras_stable_state.CheckpointManager.preemption_guard>` (and by ``StableCheckpoint``
    for its ``fit``). Entering it installs one handler for each of ``signals`` (replacing
    the previous ones), leaving it (also by an exception) puts the previous handlers back,
    where the guard's are still installed. A handler does nothing but record the signal: a
    second signal, for example during the save, changes nothing. The process is not stopped
    by the signal while the guard is entered: the loop decides, at a step boundary.

    Attributes:
        signals: The signals handled, a tuple of ``signal.Signals``.
        signal_received: The first signal this process received while the guard was
            entered (a ``signal.Signals``), or ``None``.
    """

    def __init__(
        self,
        signals: Sequence[int] = DEFAULT_SIGNALS,
        *,
        owner: str = "CheckpointManager",
        fit_frame: FrameType | None = None,
        check_in: Callable[[bool, int], bool] | None = None,
    ) -> None:
        self.signals = check_signals(signals)
        self._check_in = check_in  # a CheckpointManager's: the check-in of its processes
        self.signal_received: signal.Signals | None = None
        self._owner = owner
        self._fit_frame = fit_frame  # StableCheckpoint's: the fit that ends without on_train_end
        self._previous = None

    @property
    def installed(self) -> bool:
        """Whether the guard's handlers are installed (between entering and leaving it)."""
        return self._previous is not None

    def __enter__(self):
        """Install the handlers (the previous ones are kept to be put back).

        Raises:
            StateError: off the main thread (Python lets only the main thread install signal
                handlers), or if this guard is entered already.
        """
        if threading.current_thread() is not threading.main_thread():
            raise StateError(
                f"{self._owner}: a preemption guard installs signal handlers "
                f"({', '.join(s.name for s in self.signals)}), which Python allows only in the main "
                f"thread; this is thread {threading.current_thread().name!r}. Enter the guard in the "
                "main thread (run the training loop there), or train without it.",
                expected="the main thread",
                received=threading.current_thread().name,
            )
        if self._previous is not None:
            raise StateError(
                f"{self._owner}: this preemption guard is entered already; leave it before entering "
                "it again (or make another one).",
                expected="a guard not entered",
                received="a guard entered",
            )
        previous = {}
        try:
            for sig in self.signals:
                previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self._restore(previous)
            raise
        self.signal_received = None
        self._previous = previous
        return self

    def __exit__(self, exc_type, exc, tb):
        self.uninstall()

    def uninstall(self) -> None:
        """Put the previous handlers back (where the guard's handler is still the one
        installed: a handler installed after it is left in place); nothing if not installed.
        A previous handler installed outside Python (``signal.getsignal`` gave ``None``)
        comes back as ``signal.SIG_DFL``."""
        previous, self._previous = self._previous, None
        if previous is not None:
            self._restore(previous)

    def _restore(self, previous):
        for sig, handler in previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum, frame):
        # Only record (Python runs this in the main thread, between two bytecodes).
        target = self._fit_frame
        if target is not None and not _on_stack(target, frame):
            # The fit of a StableCheckpoint ended by an exception (Keras skips on_train_end):
            # the previous handler back, and this signal is the previous handler's.
            handler = (self._previous or {}).get(signal.Signals(signum))
            self.uninstall()
            if callable(handler):
                handler(signum, frame)
            elif handler in (signal.SIG_DFL, None):
                signal.raise_signal(signum)
            return
        if self.signal_received is None:
            self.signal_received = signal.Signals(signum)

    def reached_preemption(self, step) -> bool:
        """Whether the loop should save at ``step`` and stop: a signal came to this process,
        or (several processes) to any process.

        With one process this only reads `signal_received`. With several processes (JAX
        processes; the Torch ranks of a ``CheckpointManager``'s guard under
        ``torch.distributed``) it is a collective (one small all-gather): every process must
        call it at every step, with the same ``step``, and all get the same answer, so all
        save the same step. A ``CheckpointManager``'s guard gathers its check-in there
        (the step, the step restored, the world size: see ``CheckpointManager.save``).

        Raises:
            StateError: with several processes, if they called it with different steps (or,
                a manager's guard, restored different steps).
        """
        if self._check_in is not None:
            return self._check_in(self.signal_received is not None, step)
        return _processes.any_process(
            self.signal_received is not None, step, f"{self._owner}.reached_preemption({step})"
        )


def entered_guard(guard: PreemptionGuard | None, owner: str, step: int) -> PreemptionGuard:
    """``guard`` if it is entered.

    Raises:
        StateError: if ``guard`` is ``None`` or not entered: no signal is handled, so
            ``reached_preemption`` could only ever answer ``False``.
    """
    if guard is None or not guard.installed:
        raise StateError(
            f"{owner}.reached_preemption({step!r}): no preemption guard of this manager is entered, so "
            "no signal is handled. Train inside `with manager.preemption_guard():`.",
            expected="an entered preemption_guard()",
            received="none",
        )
    return guard


def fit_guard(signals, owner, fit_frame, explicit) -> PreemptionGuard | None:
    """A `PreemptionGuard` entered for a ``fit`` (``fit_frame``: its frame, whose end
    without ``on_train_end`` hands signals back to the previous handlers, or ``None``); off
    the main thread ``None`` (no handler: the ``fit`` trains without), unless ``explicit``
    (then the [`StateError`][keras_stable_state.StateError] of entering the guard)."""
    if not explicit and threading.current_thread() is not threading.main_thread():
        return None
    return PreemptionGuard(signals, owner=owner, fit_frame=fit_frame).__enter__()


class FitPreemption:
    """The preemption state of a ``StableCheckpoint``: its options, the guard of the ``fit``
    running, and what the last ``fit`` saw (see the callback's docstring)."""

    def __init__(self, enabled: bool, signals: Sequence[int]) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"`save_on_preemption` must be a bool. Received: save_on_preemption={enabled!r}")
        self.enabled = enabled
        self.signals = tuple(int(s) for s in check_signals(signals, "preemption_signals"))
        self.guard: PreemptionGuard | None = None
        self.handled = False  # whether the fit running (or the last one) had the handlers
        self.step: int | None = None  # the global step saved for a preemption, or None
        self.at_epoch_end = False  # the signal came at an epoch's last batch: the epoch-end save

    def config(self) -> dict[str, Any]:
        """``{"save_on_preemption", "preemption_signals"}`` (the signals as ints)."""
        return {"save_on_preemption": self.enabled, "preemption_signals": self.signals}

    def begin(self, fit_frame: FrameType | None, say: Callable[[str], None]) -> None:
        """A ``fit`` begins: enter a guard (off the main thread none: ``say`` tells so)."""
        self.end()  # the handlers of an earlier fit of this callback that raised
        self.step, self.at_epoch_end = None, False
        if self.enabled:
            self.guard = fit_guard(self.signals, "StableCheckpoint", fit_frame, explicit=False)
            if self.guard is None:
                say("fit runs outside the main thread: no signal handler, no save on preemption")
        self.handled = self.guard is not None

    def end(self) -> None:
        """Put the previous handlers back."""
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.uninstall()

    def reached(self, global_step: int) -> bool:
        """Whether to save at ``global_step`` and stop, once per ``fit`` (a collective with
        several processes, JAX processes or the Torch ranks of ``torch.distributed``, whose
        ``StableCheckpoint`` saves are collectives: every process calls it at every batch end)."""
        if self.guard is None or self.step is not None:
            return False
        with _processes.torch_ranks(collective=True):
            return self.guard.reached_preemption(global_step)

    def stop(self, global_step: int, last_batch: bool) -> str:
        """Note the stop at ``global_step`` (``last_batch``: the epoch's last); the signal's name."""
        self.step, self.at_epoch_end = global_step, last_batch
        received = self.guard.signal_received
        return received.name if received is not None else "a signal (to another process)"
