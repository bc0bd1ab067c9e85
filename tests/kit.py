"""The tests' shared kit: the one model factory (:func:`mlp`), the interrupt callback, one
comparison of two models' training state, and where the tests' files are.

    from kit import StopAt, assert_same_state, mlp

The test files live in folders named by the promise they check (``tests/<promise>/test_*.py``,
see ``tests/README.md``); this kit, ``conftest.py``, the helper modules, ``scripts/`` and
``data/`` stay in ``tests/`` itself (``TESTS``), which pytest puts on ``sys.path`` for
``conftest.py``. ``tests/conftest.py`` re-exports :class:`StopAt` (``from conftest import
StopAt`` keeps working).
"""

import glob
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import keras
import numpy as np

import keras_stable_state as kss

__all__ = [
    "ROOT",
    "TESTS",
    "StopAt",
    "assert_resumes_exactly",
    "assert_same_state",
    "fit_input",
    "folder_of",
    "frameworks_selected",
    "grads",
    "mlp",
]

#: The tests' own folder (``tests/``: this kit, ``conftest.py``, ``scripts/``, ``data/``) and
#: the repository root above it, as strings.
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def folder_of(module):
    """The folder of the test module ``module`` (``"test_fit_input"``: ``tests/fit``), for a
    child process that imports it."""
    found = glob.glob(os.path.join(TESTS, "*", f"{module}.py"))
    assert len(found) == 1, f"{module}.py: expected in one folder of {TESTS}, found {found}"
    return os.path.dirname(found[0])


# make test runs each backend's suite in an environment with that framework alone (the
# user's install, tests/install_check.py), then, in the environment with all three, only the
# tests that need another framework beside the backend's (KSS_TEST_PASS=several-frameworks).
SEVERAL_FRAMEWORKS_PASS = os.environ.get("KSS_TEST_PASS") == "several-frameworks"


def frameworks_needed(names):
    """The frameworks of ``names`` other than this process's backend, sorted."""
    return sorted(set(names) - {keras.backend.backend()})


def frameworks_missing(names):
    """The frameworks of ``names`` (other than the backend's) that are not installed here."""
    return [name for name in frameworks_needed(names) if importlib.util.find_spec(name) is None]


def frameworks_selected(names):
    """Whether a test (or a case) needing ``names`` runs in this pass: in a one-framework
    environment only if it needs no other framework; in the several-frameworks pass only
    if it does (the one-framework pass ran the others)."""
    needed = frameworks_needed(names)
    if SEVERAL_FRAMEWORKS_PASS:
        return bool(needed) and not frameworks_missing(names)
    return not frameworks_missing(names)


def mlp(
    features=4,
    hidden=8,
    *,
    activation=None,
    named=False,
    layer_names=None,
    out_units=1,
    dropout=None,
    dtype=None,
    out_dtype=None,
    name=None,
    seed=None,
    optimizer="stable",
    inner=None,
    learning_rate=1e-2,
    build=False,
    loss="mse",
    **compile_kwargs,
):
    """A ``keras.Sequential`` multilayer perceptron (a chain of ``Dense`` layers), compiled:
    the one model factory of the tests (no test file has its own).

    Args:
        features: The input width, ``keras.Input((features,))``.
        hidden: The width of the hidden ``Dense`` layer, or a sequence of widths (one layer
            each; ``()`` for none).
        activation: The hidden layers' activation (``None``: linear), or a sequence of them,
            one per hidden layer.
        named: Name the one hidden layer ``"hidden"`` and the output layer ``"out"``
            (otherwise Keras names them, ``dense``, ``dense_1``, ...).
        layer_names: The name of each ``Dense`` layer, the hidden ones then the output one
            (``None`` in it: Keras names that one); instead of ``named``.
        out_units: The output layer's width.
        dropout: A ``Dropout`` rate after the hidden layers, or ``None`` for none.
        dtype: The hidden layers' ``dtype`` (``None``: the default policy).
        out_dtype: The output layer's ``dtype`` (``None``: the default policy).
        name: The ``Sequential``'s name (``None``: Keras names it, ``sequential``, ...).
        seed: ``keras.utils.set_random_seed(seed)`` before the layers are made, or ``None``.
        optimizer: ``"stable"``: ``StableOptimizer(inner, model=model)``; ``"stable-unbound"``:
            ``StableOptimizer(inner)`` (keys resolved at build); ``"plain"``: ``inner``;
            ``None``: not compiled; a callable: called with the model, its result is the
            optimizer; anything else is passed to ``compile``. Every optimizer is made after
            the layers.
        inner: A callable with no arguments that makes the optimizer of ``"stable"``,
            ``"stable-unbound"`` and ``"plain"`` (default: ``Adam(learning_rate)``).
        learning_rate: The default ``inner`` optimizer's learning rate.
        build: Build the optimizer (``model.optimizer.build(model.trainable_variables)``)
            after ``compile``, so that its slots exist before any training.
        loss, compile_kwargs: The rest of ``model.compile``'s arguments.
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    if named and (len(widths) != 1 or layer_names is not None):
        raise ValueError(
            f"named=True names one hidden layer (and no layer_names); received hidden={hidden!r}, "
            f"layer_names={layer_names!r}"
        )
    names = ("hidden", "out") if named else tuple(layer_names or (None,) * (len(widths) + 1))
    if len(names) != len(widths) + 1:
        raise ValueError(f"layer_names: one per hidden layer and the output one; received {layer_names!r}")
    activations = tuple(activation) if isinstance(activation, list | tuple) else (activation,) * len(widths)
    if len(activations) != len(widths):
        raise ValueError(f"activation: one per hidden layer; received {activation!r}")

    def options(layer_name, layer_dtype):
        return {
            **({"name": layer_name} if layer_name is not None else {}),
            **({"dtype": layer_dtype} if layer_dtype is not None else {}),
        }

    layers = [keras.Input((features,))]
    for width, act, layer_name in zip(widths, activations, names, strict=False):
        layers.append(keras.layers.Dense(width, activation=act, **options(layer_name, dtype)))
    if dropout is not None:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(out_units, **options(names[-1], out_dtype)))
    model = keras.Sequential(layers, **({"name": name} if name is not None else {}))
    if optimizer is None:
        return model
    make_inner = inner or (lambda: keras.optimizers.Adam(learning_rate))
    if optimizer == "stable":
        optimizer = kss.StableOptimizer(make_inner(), model=model)
    elif optimizer == "stable-unbound":
        optimizer = kss.StableOptimizer(make_inner())
    elif optimizer == "plain":
        optimizer = make_inner()
    elif callable(optimizer):
        optimizer = optimizer(model)
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs)
    if build:
        model.optimizer.build(model.trainable_variables)
    return model


class StopAt(keras.callbacks.Callback):
    """Raise ``RuntimeError(message)`` (a preemption) when the batch (or execution) starting
    at ``batch`` of ``epoch`` begins, or, with ``batch=None``, when ``epoch`` begins (in its
    ``on_epoch_begin``, after the callbacks listed before it)."""

    repeatable_epoch_begin = True  # its on_epoch_begin only notes the epoch (StableCheckpoint's opt-out)

    def __init__(self, epoch, batch=None, message="preempted"):
        super().__init__()
        self.at, self.epoch, self.message = (epoch, batch), -1, message

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.at == (epoch, None):
            raise RuntimeError(self.message)

    def get_state(self):  # stateless for training: a resumed fit need not warn about it
        return {}

    def set_state(self, state):
        pass

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError(self.message)


def assert_same_state(model_a, model_b, *, all_variables=False, rtol=0.0, atol=0.0):
    """Assert that two models hold the same training state, by position: as many
    ``model.weights`` (``model.variables`` with ``all_variables=True``: also seed generators
    and other non-weight variables) and ``model.optimizer.variables``, each pair equal
    (bit for bit by default, ``np.testing.assert_allclose`` with ``rtol``/``atol`` otherwise);
    the failure names the variable's path."""
    from keras_stable_state._numpy import numpy_copy as to_np

    def variables(model):
        return list(model.variables if all_variables else model.weights)

    for what, a_vars, b_vars in (
        ("model", variables(model_a), variables(model_b)),
        ("optimizer", list(model_a.optimizer.variables), list(model_b.optimizer.variables)),
    ):
        assert len(a_vars) == len(b_vars), f"{what}: {len(a_vars)} variables != {len(b_vars)}"
        for va, vb in zip(a_vars, b_vars, strict=True):
            if rtol or atol:
                np.testing.assert_allclose(to_np(va), to_np(vb), rtol=rtol, atol=atol, err_msg=va.path)
            else:
                np.testing.assert_array_equal(to_np(va), to_np(vb), err_msg=va.path)


def grads(loss_fn, variables):
    """Gradients of ``loss_fn()`` (built from keras.ops on ``variables``) on any backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn()
        return tape.gradient(loss, variables)
    if backend == "torch":
        for v in variables:
            v.value.grad = None
        loss_fn().backward()
        return [v.value.grad.detach().clone() for v in variables]
    import jax

    def pure(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
            return loss_fn()

    return jax.grad(pure)([v.value for v in variables])


def fit_input(directory, make_input, seed, stop=None, *, epochs, save_freq=2, **fit_kwargs):
    """``model.fit(make_input(seed), epochs=epochs, **fit_kwargs)`` of a fresh ``mlp`` (a ReLU
    layer of 8 and Dropout, initial weights from ``seed``) with a ``StableCheckpoint(directory,
    save_freq=save_freq)``; ``stop=(epoch, batch)`` preempts it there (a ``StopAt`` after the
    checkpoint). Returns ``(model, checkpoint)``."""
    keras.utils.set_random_seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)  # set_random_seed seeds Torch on the Torch backend only
    model = mlp(hidden=8, activation="relu", dropout=0.2)
    ckpt = kss.StableCheckpoint(directory, save_freq=save_freq, max_to_keep=2)
    callbacks = [ckpt, *([StopAt(*stop)] if stop else [])]
    try:
        model.fit(make_input(seed), epochs=epochs, verbose=0, callbacks=callbacks, **fit_kwargs)
    except RuntimeError as err:
        assert stop is not None and str(err) == "preempted", err
    return model, ckpt


def assert_resumes_exactly(directory, reference, make_input, stops, **kw):
    """`fit_input` preempted at each ``((epoch, batch), saved_at)`` of ``stops`` in turn (each
    run but the first resumes, with a fresh model and another seed, from the newest
    checkpoint, at global step ``saved_at``), then resumed to the end with seed 99: its
    weights, optimizer variables and History equal the uninterrupted ``reference`` model's,
    bit for bit, by position. Returns the last run's ``StableCheckpoint``."""
    for i, (stop, saved_at) in enumerate(stops):
        _, stopped = fit_input(directory, make_input, 0 if i == 0 else 10 + i, stop, **kw)
        assert stopped.checkpoints()[0].endswith(f"ckpt-{saved_at:010d}.h5")
    resumed, ckpt = fit_input(directory, make_input, 99, **kw)
    assert ckpt.restore_report is not None  # resumed, not restarted
    assert_same_state(reference, resumed)
    expected, found = reference.history.history, resumed.history.history
    assert sorted(found) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_array_equal(values, found[key], err_msg=key)
    return ckpt


def run_on_backend(backend, module, code, timeout=300):
    """Run ``code`` in a child Python on ``backend`` with the test module ``module`` imported
    as ``t`` (a checkpoint written on another backend); its stdout. Fails the test if it fails."""
    path = [TESTS, folder_of(module)]
    source = f"import sys; sys.path[:0] = {path!r}\nimport {module} as t\n{code}\n"
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def inexact_warnings(fn):
    """``(fn(), [message of each InexactResumeWarning it raised])``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kss.InexactResumeWarning)
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, kss.InexactResumeWarning)]


def free_port():
    """A TCP port of 127.0.0.1 free now (for a rendezvous of processes the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argvs, timeout, env=None):
    """Start one process per argv at once, wait for all, and return ``[(returncode, output)]``
    (stdout and stderr together), or ``None`` if one was still running after ``timeout``
    seconds (then every one is killed). Each output goes to a file, not a pipe: a pipe read
    one process after another would block a process whose unread pipe is full, and with it
    the others waiting for it in a collective."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as folder:
        logs = [open(os.path.join(folder, f"{i}.log"), "w+", encoding="utf-8") for i in range(len(argvs))]  # noqa: SIM115
        try:
            procs = [
                subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
                for argv, log in zip(argvs, logs, strict=True)
            ]
            deadline = time.monotonic() + timeout
            hung = False
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    hung = True
                    break
            if hung:
                for p in procs:
                    p.kill()
                    p.wait()
                return None
            results = []
            for p, log in zip(procs, logs, strict=True):
                log.seek(0)
                results.append((p.returncode, log.read()))
            return results
        finally:
            for log in logs:
                log.close()
