"""Preemption: a real SIGTERM from this process to a child ``fit`` at random steps (the
next run resumes at that step and ends where the uninterrupted run ends), the custom-loop
``CheckpointManager.preemption_guard()``, the previous handlers put back (after ``fit``,
after a ``fit`` that raised, after a guard whose block raised), a second signal during the
save, the main-thread rule, the options, and the multi-process agreement on the step."""

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from kit import TESTS, StopAt, assert_same_state, mlp

import keras_stable_state as kss
from keras_stable_state import _processes
from keras_stable_state._manager import checkin, preemption

SCRIPT = os.path.join(TESTS, "scripts", "preempt_fit.py")
# Trials of the child fit (issue 18's acceptance: 20 per backend, `make fuzz`); make test runs 2.
TRIALS = int(os.environ.get("KSS_PREEMPT_TRIALS", "2"))
SEED = int(os.environ.get("KSS_PREEMPT_SEED", "0"))
EPOCHS, STEPS, BATCH = 2, 12, 4  # as in the script
TIMEOUT_S = 300

RNG = np.random.default_rng(0)
X = RNG.normal(size=(STEPS * BATCH, 4)).astype("float32")
Y = (X @ RNG.normal(size=(4, 1))).astype("float32")


class _Recorder:
    """A SIGTERM handler installed by the test before ours: the "previous handler" (and a
    safety net: a signal that ours missed lands here instead of ending pytest)."""

    def __init__(self):
        self.calls = []

    def __call__(self, signum, frame):
        self.calls.append(signum)


@pytest.fixture
def previous():
    recorder = _Recorder()
    old = signal.signal(signal.SIGTERM, recorder)
    try:
        yield recorder
    finally:
        signal.signal(signal.SIGTERM, old)


class _SignalAt(keras.callbacks.Callback):
    """Send ``signal`` to this process at the end of global batch ``at`` (1-based)."""

    def __init__(self, at, sig=signal.SIGTERM):
        super().__init__()
        self.at, self.sig, self.step = at, sig, 0

    def get_state(self):
        return {}

    def set_state(self, state):
        pass

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == self.at:
            os.kill(os.getpid(), self.sig)


def _fit(model, callbacks, epochs=EPOCHS):
    return model.fit(X, Y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks)


def _arrays(model):
    return [keras.ops.convert_to_numpy(v) for v in [*model.weights, *model.optimizer.variables]]


def _readline(child, deadline):
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([child.stdout], [], [], left)[0]:
            child.kill()
            pytest.fail(f"the child printed nothing for {TIMEOUT_S} s and was killed")
        line = child.stdout.readline()
        if not line:
            child.wait(30)
            pytest.fail(f"the child ended (exit {child.returncode}) before the protocol did")
        if line.startswith(("step ", "stopped ", "resumed ", "reference done", "done")):
            return line.split()


@pytest.mark.slow
def test_sigterm_at_random_steps_of_a_child_fit_resumes_exactly_at_that_step(tmp_path):
    """TRIALS fits in one child process; this process sends SIGTERM (os.kill) at a step drawn
    from KSS_PREEMPT_SEED (the first trial at the first epoch's last batch: the epoch-end
    checkpoint). Each fit stops with the checkpoint of that step; the next run, a fresh model
    built from another seed, trains only the batches after it and ends with the weights and
    optimizer variables of the uninterrupted run, by position."""
    draw = random.Random(SEED)
    total = EPOCHS * STEPS
    targets = [STEPS] + [draw.randint(1, total - 1) for _ in range(TRIALS - 1)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, SCRIPT, str(tmp_path), str(len(targets))],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        assert _readline(child, deadline) == ["reference", "done"]
        for i, target in enumerate(targets):
            while True:
                words = _readline(child, deadline)
                if words[0] != "step":
                    break
                step = int(words[1])
                assert step <= target, f"trial {i}: the fit went on past the signal at step {target}"
                if step == target:
                    os.kill(child.pid, signal.SIGTERM)
                child.stdin.write("go\n")
                child.stdin.flush()
            epochs_run = 1 + (target - 1) // STEPS
            assert words == ["stopped", str(i), "True", str(target), str(epochs_run)], (i, target)
            assert _readline(child, deadline) == ["resumed", str(i), str(total - target)], (i, target)
        assert _readline(child, deadline) == ["done"]
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
    with np.load(tmp_path / "reference.npz") as f:
        reference = [f[f"arr_{k}"] for k in range(len(f.files))]
    assert len(reference) == 4 + 10  # 4 model weights; Adam: iterations, learning rate, 2 x 4 slots
    for i, target in enumerate(targets):
        with np.load(tmp_path / f"trial-{i}.npz") as f:
            resumed = [f[f"arr_{k}"] for k in range(len(f.files))]
        assert len(resumed) == len(reference)
        for k, (a, b) in enumerate(zip(resumed, reference, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"trial {i} (signal at step {target}), array {k}")


def test_fit_stops_at_the_signal_step_and_puts_the_previous_handler_back(tmp_path, previous):
    """In this process: SIGTERM at global step 5 stops the fit there (model.stop_training, the
    History of the one epoch begun), the checkpoint of step 5 holds the state at that batch
    end, the handler installed before the fit is back and never saw the signal."""
    model = mlp(seed=0)
    ckpt = kss.StableCheckpoint(tmp_path / "c")
    seen = {}

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                seen["arrays"] = _arrays(self.model)

    history = _fit(model, [_SignalAt(5), Snapshot(), ckpt])
    assert ckpt.reached_preemption and ckpt.preemption.step == 5 and ckpt.preemption.handled
    assert model.stop_training
    assert history.epoch == [0]
    assert kss.CheckpointManager(tmp_path / "c").all_steps() == [5]
    assert signal.getsignal(signal.SIGTERM) is previous and previous.calls == []
    fresh = mlp(seed=3)
    kss.CheckpointManager(tmp_path / "c").restore(fresh)
    for k, (a, b) in enumerate(zip(_arrays(fresh), seen["arrays"], strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"array {k}")


def test_a_second_signal_during_the_save_changes_nothing(tmp_path, previous):
    """A state provider sends another SIGTERM while the preemption's checkpoint is written:
    the handler only notes it; one checkpoint, whole (restored equal to the model at the
    stop), training stopped once, nothing reaches the previous handler."""
    calls = []

    class Noisy(keras.callbacks.Callback):
        def get_state(self):  # called while the checkpoint is written
            calls.append("save")
            os.kill(os.getpid(), signal.SIGTERM)
            return {"n": len(calls)}

        def set_state(self, state):
            pass

    model = mlp(seed=0)
    ckpt = kss.StableCheckpoint(tmp_path / "c", save_freq=100, callbacks={"noisy": Noisy()})
    _fit(model, [_SignalAt(7), ckpt])
    assert calls == ["save"] and ckpt.preemption.step == 7
    assert previous.calls == [] and signal.getsignal(signal.SIGTERM) is previous
    fresh = mlp(seed=3)
    kss.CheckpointManager(tmp_path / "c").restore(fresh)
    assert_same_state(fresh, model)


def test_a_fit_that_raises_hands_the_next_signal_to_the_previous_handler(tmp_path, previous):
    """Keras skips on_train_end when fit raises: the next SIGTERM finds the fit gone, puts the
    previous handler back and goes to it; the next fit of the callback installs afresh."""
    model = mlp(seed=0)
    ckpt = kss.StableCheckpoint(tmp_path / "c")
    with pytest.raises(RuntimeError, match="preempted"):
        _fit(model, [StopAt(0, 3), ckpt])
    os.kill(os.getpid(), signal.SIGTERM)
    assert previous.calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is previous
    _fit(model, [ckpt], epochs=1)
    assert not ckpt.reached_preemption and signal.getsignal(signal.SIGTERM) is previous


def test_preemption_guard_in_a_custom_loop_resumes_exactly(tmp_path, previous):
    """A custom loop checks mgr.reached_preemption(step) each step; SIGTERM after step 4
    makes it save step 4 and break; the handler is back on leaving the guard (also when the
    block raises); a fresh model restores and continues to the uninterrupted loop's state."""

    def batch(step):
        start = (step * BATCH) % len(X)
        return X[start : start + BATCH], Y[start : start + BATCH]

    reference = mlp(seed=0)
    for step in range(10):
        reference.train_on_batch(*batch(step))

    model = mlp(seed=0)
    with kss.CheckpointManager(tmp_path / "m") as mgr:
        with mgr.preemption_guard() as guard:
            assert signal.getsignal(signal.SIGTERM) is not previous
            for step in range(10):
                model.train_on_batch(*batch(step))
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                if mgr.reached_preemption(step + 1):
                    mgr.save(step + 1, model)
                    break
        assert guard.signal_received == signal.SIGTERM and guard.reached_preemption(5)
    assert signal.getsignal(signal.SIGTERM) is previous and previous.calls == []
    assert kss.CheckpointManager(tmp_path / "m").all_steps() == [4]

    resumed = mlp(seed=7)
    with kss.CheckpointManager(tmp_path / "m") as mgr:
        mgr.restore(resumed)
        for step in range(mgr.restored_step, 10):
            resumed.train_on_batch(*batch(step))
    assert_same_state(resumed, reference)

    with pytest.raises(ZeroDivisionError):
        with kss.CheckpointManager(tmp_path / "m").preemption_guard(
            (signal.SIGTERM, signal.SIGUSR1)
        ) as guard:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert guard.signal_received == signal.SIGUSR1
            1 / 0  # noqa: B018
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_reached_preemption_outside_a_guard_and_off_the_main_thread_are_refused(tmp_path):
    mgr = kss.CheckpointManager(tmp_path / "m")
    with pytest.raises(kss.StateError, match=r"no preemption guard of this manager is entered"):
        mgr.reached_preemption(0)
    failures = []

    def enter():
        try:
            with mgr.preemption_guard():
                pass
        except kss.StateError as err:
            failures.append(str(err))

    thread = threading.Thread(target=enter, name="worker")
    thread.start()
    thread.join(60)
    assert len(failures) == 1 and "only in the main thread" in failures[0] and "'worker'" in failures[0]


def test_a_fit_off_the_main_thread_trains_without_handlers(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ckpt = kss.StableCheckpoint(tmp_path / "c")
    model = mlp(seed=0)
    errors = []

    def train():
        try:
            _fit(model, [ckpt], epochs=1)
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join(240)
    assert errors == [] and not ckpt.preemption.handled and not ckpt.reached_preemption
    assert signal.getsignal(signal.SIGTERM) == before
    assert kss.CheckpointManager(tmp_path / "c").all_steps() == [STEPS]


def test_save_on_preemption_false_installs_nothing(tmp_path, previous):
    ckpt = kss.StableCheckpoint(tmp_path / "c", save_on_preemption=False)
    _fit(mlp(seed=0), [_SignalAt(3), ckpt], epochs=1)
    assert previous.calls == [signal.SIGTERM] and not ckpt.reached_preemption and not ckpt.preemption.handled


def test_preemption_options_are_checked_and_round_trip(tmp_path):
    config = kss.StableCheckpoint(tmp_path, preemption_signals=[signal.SIGUSR1, signal.SIGTERM]).get_config()
    assert config["save_on_preemption"] is True
    assert config["preemption_signals"] == (int(signal.SIGUSR1), int(signal.SIGTERM))
    assert kss.StableCheckpoint.from_config(config).get_config() == config
    with pytest.raises(ValueError, match="SIGKILL, which no handler can catch"):
        kss.StableCheckpoint(tmp_path, preemption_signals=(signal.SIGKILL,))
    with pytest.raises(ValueError, match="at least one signal"):
        kss.StableCheckpoint(tmp_path, preemption_signals=())
    with pytest.raises(TypeError, match="must be a sequence of signals"):
        kss.StableCheckpoint(tmp_path, preemption_signals=signal.SIGTERM)
    with pytest.raises(TypeError, match="signal numbers"):
        kss.CheckpointManager(tmp_path).preemption_guard(("SIGTERM",))
    with pytest.raises(ValueError, match="no signal of this platform"):
        kss.CheckpointManager(tmp_path).preemption_guard((10_000,))
    with pytest.raises(TypeError, match="save_on_preemption"):
        kss.StableCheckpoint(tmp_path, save_on_preemption="yes")


def test_processes_agree_on_the_step_of_a_signal_any_of_them_got():
    """The decision of the multi-process collective (_processes.any_process), from the table
    every process gathers: one process' signal stops all at the same step; processes at
    different steps are refused; one process decides alone without a collective."""
    assert _processes.agree(np.array([[0, 7], [1, 7]], np.int32), "x") is True
    assert _processes.agree(np.array([[0, 7], [0, 7]], np.int32), "x") is False
    with pytest.raises(kss.StateError, match=r"different steps \(\{0: 7, 1: 8\}"):
        _processes.agree(np.array([[1, 7], [0, 8]], np.int32), "StableCheckpoint.reached_preemption(7)")
    assert _processes.any_process(True, 3, "x") is True and _processes.any_process(False, 3, "x") is False
    guard = preemption.PreemptionGuard()
    assert guard.reached_preemption(1) is False


def test_a_managers_check_in_refuses_processes_that_differ_naming_each_and_the_fix(tmp_path):
    """The check-in of a manager's collective calls (save, reached_preemption), from the table
    of digests every process gathers (checkin.FIELDS: call, flag, step, restored, iterations,
    world, locked): equal digests pass whatever the flags and locks; a rank that did not
    restore, or is at another step, is refused naming each rank's values and the fix; with
    one process nothing is exchanged."""
    mgr = kss.CheckpointManager(tmp_path)
    save, term = checkin.CALLS.index("save"), checkin.CALLS.index("reached_preemption")
    same = np.array([[save, 0, 28, 24, 28, 2, 1], [save, 1, 28, 24, 28, 2, 0]])
    checkin.compare(mgr, "save", 28, same)
    assert checkin.any_signal(same) and not checkin.locked_everywhere(same)
    skipped = np.array([[save, 0, 28, 24, 28, 2, 1], [save, 0, 4, -1, 4, 2, 1]])
    with pytest.raises(
        kss.StateError, match=r"\.save\(28\) on rank 0: the 2 ranks' training states differ"
    ) as err:
        checkin.compare(mgr, "save", 28, skipped)
    message = str(err.value)
    assert (
        "rank 1 did not restore step 24 that rank 0 restored: call mgr.restore(model, ...) on every rank"
        in message
    )
    assert "different steps (rank 0: 28; rank 1: 4)" in message
    assert "(rank 0: iterations 28; rank 1: iterations 4)" in message
    assert err.value.key is None and err.value.received[1] == {
        "call": "save", "step": 4, "restored": -1, "iterations": 4, "world": 2
    }  # fmt: skip
    apart = np.array([[term, 0, 9, 8, -1, 3, 1], [term, 0, 9, 4, -1, 3, 1], [save, 0, 9, 8, -1, 3, 1]])
    with pytest.raises(
        kss.StateError, match=r"restored different steps \(ranks 0, 2: step 8; rank 1: step 4\)"
    ):
        checkin.compare(mgr, "reached_preemption", 9, apart)
    with pytest.raises(
        kss.StateError, match=r"different calls \(ranks 0, 1: reached_preemption\(\); rank 2: save\(\)\)"
    ):
        checkin.compare(mgr, "reached_preemption", 9, apart)
    assert checkin.check_in(mgr, "save", 1) is None  # one process: no exchange
    assert checkin.iterations(mlp(seed=0), None) == 0
    if keras.backend.backend() == "torch":  # a torch.optim optimizer: the steps of its state
        import torch

        model = mlp(seed=0)
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        assert checkin.iterations(model, adam) == 0
        for _ in range(2):
            sum(p.sum() for p in model.parameters()).backward()
            adam.step()
        assert checkin.iterations(model, adam) == 2
    mgr.close()
