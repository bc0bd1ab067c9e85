"""Strict test environment: one backend per pytest process (KERAS_BACKEND), warnings
are errors (pyproject), a clean Keras session and fixed seeds for every test."""

import os
import re
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _jax_compilation_cache():
    """Every test builds fresh models, and JAX compiles each one's train step anew (about
    4 s each on a 2-core machine): JAX's persistent compilation cache, keyed by the
    computation, gives the same executable back from disk in a fraction of that. Set
    through the environment, so that the training subprocesses some tests start use it
    too. Eviction on (a size limit) makes JAX lock the folder, so that pytest-xdist workers
    never read an entry another one is still writing; without the ``filelock`` package that
    needs, no cache. ``KSS_JAX_CACHE_DIR=`` (empty) turns it off."""
    import importlib.util
    import tempfile

    folder = os.environ.get(
        "KSS_JAX_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"kss-test-jax-cache-{os.getuid()}")
    )
    if not folder or importlib.util.find_spec("filelock") is None:
        return
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", folder)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(512 * 2**20))


_jax_compilation_cache()


def _one_thread_per_test_process():
    """On the torch and tensorflow backends, the framework runs one intra-op (and, TensorFlow,
    one inter-op) thread in each test process (set through the environment before it is
    imported, so the child processes tests start inherit it). The suite's models are tiny and
    pytest-xdist already runs more workers than the machine has cores: the frameworks' default
    of one thread per core makes the workers' threads spin against each other (measured here
    with three workers on two cores: 35% less CPU time for test_cases.py and test_optimizers.py
    on torch with one thread; 8% less for five fit-heavy files on TensorFlow, 2026-12-06). JAX's
    XLA CPU client is left as it is (one thread there measured no faster). Settings the caller
    made win."""
    backend = os.environ.get("KERAS_BACKEND")
    if backend == "torch":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    elif backend == "tensorflow":
        os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
        os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")


_one_thread_per_test_process()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from kit import StopAt  # noqa: E402, F401  (the interrupt callback: tests import it from here too)

BACKEND = keras.backend.backend()


_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
_PACKAGE = "keras_stable_state"
# Where a value is converted (NumPy, the backends, Keras' conversion ops and variables'
# __array__): the frame past these asked for the conversion.
_CONVERSION = re.compile(
    r"^(warnings|numpy|torch|tensorflow|jax|jaxlib|ml_dtypes|keras\.src\.ops\.core"
    r"|keras\.src\.backend\.\w+\.core|keras\.src\.backend\.common\.variables"
    r"|keras\.src\.backend\.\w+\.variables)(\.|$)"
)


def _caused_by_package(frame) -> bool:
    """Whether the frame that asked for what warned (the first one outside NumPy, the
    backends and Keras' conversion code) is one of keras_stable_state's. A warning of
    Keras' own code (e.g. Torch's Nadam converting a tensor inside its update, Keras'
    ``Optimizer.get_config`` reading its learning rate) is Keras', even under our call."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not _CONVERSION.match(name):
            return name == _PACKAGE or name.startswith(_PACKAGE + ".")
        frame = frame.f_back
    return False


def _check_deprecation(record, msg):
    if not issubclass(msg.category, _DEPRECATIONS):
        return record(msg)
    if _caused_by_package(sys._getframe(2)):
        raise msg.category(
            f"raised by a keras_stable_state call ({msg.filename}:{msg.lineno}): {msg.message}"
        )
    return None  # third-party noise of the tests' own calls (or of Keras' own code)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_protocol(item, nextitem):
    """Deprecation warnings reach this check (pyproject makes them ``always``, not
    ``ignore``; this runs inside pytest's own warning capture, for setup, call and
    teardown): one that a keras_stable_state call caused, also inside Keras or NumPy
    (e.g. NumPy 2's ``__array__`` copy-keyword warning when ``keras.ops.convert_to_numpy``
    converts a variable), fails the test where it is raised; the others are dropped.
    Warnings raised by the package's own modules are errors by pyproject's
    ``error::...:keras_stable_state`` filters already."""
    record = warnings._showwarnmsg_impl
    warnings._showwarnmsg_impl = lambda msg: _check_deprecation(record, msg)
    try:
        return (yield)
    finally:
        warnings._showwarnmsg_impl = record


# KSS_CPU_LOG=<file>: each test's CPU seconds (this process's and its waited-for children's,
# user + system, setup to teardown) appended as a JSON line: the data behind `_SECONDS` and
# any cut of the suite's time on a CPU-bound machine, where wall seconds mislead. `make test`
# passes it to every pass; tests/cpu_report.py sums the log by folder, file or test function.
_CPU_LOG = os.environ.get("KSS_CPU_LOG")


@pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_runtest_protocol")
def pytest_runtest_protocol_cpu_log(item, nextitem):
    if not _CPU_LOG:
        return (yield)
    import json
    import resource
    import time

    def cpu():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    (own0, kids0), wall0 = cpu(), time.monotonic()
    try:
        return (yield)
    finally:
        own1, kids1 = cpu()
        line = {"test": item.nodeid, "backend": BACKEND, "own": own1 - own0, "children": kids1 - kids0}
        with open(_CPU_LOG, "a", encoding="utf-8") as log:
            log.write(json.dumps(dict(line, wall=time.monotonic() - wall0)) + "\n")


# Seconds each file takes (wall, over its tests, in a pass with three pytest-xdist workers on
# two cores: TensorFlow, JAX, Torch; measured 2026-12-06, files of 10 s and more). pytest-xdist's
# --dist loadfile hands whole files to its workers in collection order (the Makefile passes
# --no-loadscope-reorder, which otherwise orders files by their number of tests); they are put
# in order of these seconds on this backend, longest first (LPT scheduling), so that the pass
# ends with short files on every worker instead of one long file on one worker while the others
# idle (the TensorFlow pass ended with one core idle for about 25 s in collection order).
_SECONDS = {
    "test_optimizers.py": (84, 37, 13),
    "test_object_store_faults.py": (0, 47, 0),  # runs in the JAX pass only
    "test_checkpoint_invariance.py": (49, 26, 19),
    "test_replicas.py": (49, 0, 0),
    "test_checkpoint_manager.py": (42, 24, 47),
    "test_torch_ddp_howto.py": (0, 0, 47),
    "test_checkpoint_dir.py": (47, 24, 29),
    "test_fit_input.py": (43, 10, 6),
    "test_fit_tf_data_state.py": (42, 0, 0),
    "test_notebooks.py": (38, 22, 30),
    "test_object_store.py": (31, 34, 33),
    "test_multiprocess_torch.py": (0, 0, 33),
    "test_fit_resume_faults.py": (33, 10, 11),
    "test_fit_grain_inputs.py": (33, 26, 23),
    "test_directory_lock.py": (12, 21, 14),  # its backend-free tests: in the JAX pass only
    "test_resume.py": (32, 13, 16),
    "test_inspect_memory.py": (0, 32, 0),
    "test_async_save.py": (31, 12, 15),
    "test_cases.py": (29, 6, 3),
    "test_fit_torch_inputs.py": (0, 0, 28),
    "test_checkpoint.py": (28, 6, 3),
    "test_inputs_resume.py": (26, 12, 8),
    "test_multiprocess_jax.py": (0, 26, 0),
    "test_resume_matrix.py": (24, 1, 23),
    "test_cli.py": (9, 24, 7),
    "test_counters_and_dtypes.py": (24, 4, 2),
    "test_integrity.py": (24, 19, 18),
    "test_all_or_nothing.py": (21, 4, 3),
    "test_compiled_metrics_resume.py": (21, 3, 8),
    "test_hostile_disk.py": (19, 16, 21),
    "test_keras_shared_slots.py": (20, 5, 3),
    "test_timeline.py": (18, 10, 19),
    "test_crafted.py": (17, 10, 18),
    "test_hostile_messages.py": (16, 7, 5),
    "test_docstring_examples.py": (15, 4, 2),
    "test_restore_reads.py": (14, 4, 3),
    "test_preemption.py": (14, 6, 8),
    "test_hostile_files.py": (13, 8, 11),
    "test_layer_state.py": (13, 1, 1),
    "test_transfer_learning.py": (12, 2, 2),
    "test_hostile_memory.py": (9, 11, 10),
    "test_hostile_threads.py": (11, 5, 8),
    "test_ema_resume.py": (11, 4, 1),
    "test_torch_optim.py": (0, 0, 10),
}
_COLUMN = {"tensorflow": 0, "jax": 1, "torch": 2}.get(BACKEND, 0)


# The files that hold tests needing a framework beside the backend's (the frameworks marker,
# also on the cases tests/_matrix_sample.py draws): the only ones the several-frameworks pass
# imports (importing the others costs each of its processes about 6 s). Every pass checks the
# markers it collects against this list (pytest_collection_modifyitems).
SEVERAL_FRAMEWORKS_FILES = frozenset(
    {
        "test_checkpoint_invariance.py",
        "test_compiled_metrics_resume.py",
        "test_distributed_sampler.py",
        "test_fit_grain_inputs.py",
        "test_fit_input.py",
        "test_fit_tf_data_state.py",
        "test_fit_torch_inputs.py",
        "test_layer_state.py",
        "test_notebooks.py",
        "test_resume_matrix.py",
        "test_torch_optim.py",
        "test_transfer.py",
    }
)


def pytest_ignore_collect(collection_path, config):
    from kit import SEVERAL_FRAMEWORKS_PASS

    name = collection_path.name
    if SEVERAL_FRAMEWORKS_PASS and name.startswith("test_") and name.endswith(".py"):
        return name not in SEVERAL_FRAMEWORKS_FILES or None
    return None


# Tests marked backend_free (the directory locks, URL and command-line usage: no Keras variable
# is made in the test's process, which is checked, and the processes it starts import no Keras)
# run in one backend's pass, JAX's by default, and are skipped in the others with that reason:
# three passes would run the same code three times.
BACKEND_FREE_PASS = os.environ.get("KSS_BACKEND_FREE_PASS", "jax")

# Tests marked pairwise(*params): each backend's pass runs one value of those parameters, in
# turn, so that every value runs on some backend and every backend runs the test (pairwise
# coverage of the parameter and the backend instead of every pair); the other values are
# skipped naming the backends that run them. Used where the values are ways of doing one
# thing the library handles alike on every backend, each with its reason beside the mark: the
# directory lock a second process takes (it reaches no backend; tests/manager/test_directory_lock.py
# checks both on their own), and the kill pattern of a resume (killed once mid-epoch, or at an
# epoch boundary and then mid-epoch: both resume from a mid-epoch checkpoint).
_BACKENDS = ("tensorflow", "jax", "torch")


def _pairwise(items):
    """``{item: (value it runs with, {value: [backends that run it]})}`` for the marked items:
    the tests of one function and the same other parameters form a group; this backend runs the
    group's value at (backend's index + CRC-32 of the group) modulo the number of values."""
    import zlib

    groups = {}
    for item in items:
        mark = item.get_closest_marker("pairwise")
        if mark is None or not hasattr(item, "callspec"):
            continue
        params = item.callspec.params
        value = tuple(params[name] for name in mark.args)
        rest = sorted((k, repr(v)) for k, v in params.items() if k not in mark.args)
        groups.setdefault((item.path.name, item.originalname, repr(rest)), []).append((item, value))
    found = {}
    for key, members in groups.items():
        values = list(dict.fromkeys(value for _, value in members))
        start = zlib.crc32(repr(key).encode())
        runs = {
            v: [b for i, b in enumerate(_BACKENDS) if values[(i + start) % len(values)] == v] for v in values
        }
        for item, value in members:
            found[item] = (values[(_BACKENDS.index(BACKEND) + start) % len(values)], runs, value)
    return found


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "frameworks(*names): the frameworks the test needs installed (beside the backend's own); "
        "skipped with the reason where one is missing (a one-framework environment), and the only "
        "tests of the several-frameworks pass (KSS_TEST_PASS=several-frameworks)",
    )
    config.addinivalue_line(
        "markers",
        "backend_free: the test reaches no backend (it makes no Keras variable, which is checked "
        f"where it runs): it runs in the {BACKEND_FREE_PASS} pass only (KSS_BACKEND_FREE_PASS) "
        "and is skipped in the others with that reason",
    )
    config.addinivalue_line(
        "markers",
        "pairwise(*params): each backend's pass runs one value of these parameters, in turn "
        "(every value on some backend, every backend with one), and skips the others naming the "
        "backends that run them",
    )


def _frameworks(item):
    return [name for mark in item.iter_markers("frameworks") for name in mark.args]


def pytest_collection_modifyitems(config, items):
    from kit import SEVERAL_FRAMEWORKS_PASS, frameworks_missing, frameworks_needed

    unlisted = sorted(
        {item.path.name for item in items if frameworks_needed(_frameworks(item))} - SEVERAL_FRAMEWORKS_FILES
    )
    if unlisted:
        raise pytest.UsageError(
            f"{', '.join(unlisted)}: tests that need another framework beside {BACKEND}, in a file "
            "the several-frameworks pass would not collect; add it to conftest.SEVERAL_FRAMEWORKS_FILES"
        )
    if SEVERAL_FRAMEWORKS_PASS:  # only what the one-framework pass could not run
        keep = [item for item in items if frameworks_needed(_frameworks(item))]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    pairwise = _pairwise(items)
    for item in items:
        if item in pairwise:
            chosen, runs, value = pairwise[item]
            if value != chosen:
                names = item.get_closest_marker("pairwise").args
                shown = ", ".join(f"{n}={v}" for n, v in zip(names, value, strict=True))
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"{shown} runs in the {' and '.join(runs[value])} "
                        f"pass{'es' if len(runs[value]) > 1 else ''}; this {BACKEND} pass runs {', '.join(f'{n}={v}' for n, v in zip(names, chosen, strict=True))} "
                        "(pairwise: every value on some backend, every backend with one value)"
                    )
                )
        if BACKEND != BACKEND_FREE_PASS and item.get_closest_marker("backend_free"):
            reason = (
                f"reaches no backend (makes no Keras variable): runs once, in the {BACKEND_FREE_PASS} "
                "pass (KSS_BACKEND_FREE_PASS)"
            )
            item.add_marker(pytest.mark.skip(reason=reason))
        missing = frameworks_missing(_frameworks(item))
        if missing:
            reason = (
                f"needs {' and '.join(missing)} installed beside {BACKEND}: make test runs it in the "
                "environment with every framework (KSS_TEST_PASS=several-frameworks)"
            )
            item.add_marker(pytest.mark.skip(reason=reason))
    seconds = {name: row[_COLUMN] for name, row in _SECONDS.items()}
    items.sort(key=lambda item: -seconds.get(item.path.name, 0))  # stable: a file's order kept


@pytest.fixture(autouse=True)
def _backend_free_check(request, monkeypatch):
    """A test marked backend_free that makes a Keras variable fails: its mark would skip it on
    backends it reaches."""
    if not request.node.get_closest_marker("backend_free"):
        yield
        return
    from keras.src.backend.common import variables

    made = []
    init = variables.Variable.__init__

    def counting(self, *args, **kwargs):
        made.append(kwargs.get("name", "unnamed"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(variables.Variable, "__init__", counting)
    yield
    assert not made, (
        f"{request.node.nodeid} is marked backend_free but made Keras variables {made[:5]}: "
        "drop the mark (it would skip the test on backends it reaches)"
    )


@pytest.fixture(autouse=True)
def _clean_session():
    # No forced gc.collect() (free_memory): a full collection over the heap that hundreds
    # of tests left behind costs seconds per test on TensorFlow; Python's own gc still runs.
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    return x, y


def hypothesis_examples(default):
    """``max_examples`` for a property test: ``default`` (small, for ``make test``), or
    ``KSS_HYPOTHESIS_EXAMPLES`` where a longer campaign sets it."""
    return int(os.environ.get("KSS_HYPOTHESIS_EXAMPLES", default))


def to_np(v):
    """A variable's (or tensor's) value as a NumPy array of its own (without NumPy 2's
    ``__array__`` copy-keyword warning of ``keras.ops.convert_to_numpy`` on Torch and TensorFlow)."""
    from keras_stable_state._numpy import numpy_copy

    return numpy_copy(v)


def slots_by_key(optimizer):
    """``{entry key: numpy array}`` for every optimizer variable."""
    from keras_stable_state._optimizer import optimizer_entries

    if hasattr(optimizer, "entries"):
        entries = optimizer.entries()
    else:
        entries = optimizer_entries(optimizer, allow_order_keys=True)  # a bare optimizer: no model
    return {e.key: to_np(e.variable) for e in entries}


class LrLog(keras.callbacks.Callback):
    """The learning rate at each epoch begin (``lrs[epoch]``) and each batch trained with
    (``seen[(epoch, batch)]``). Stateless for a resumed fit: ``get_state()`` is ``{}``, and its
    ``on_epoch_begin`` only records (``repeatable_epoch_begin``)."""

    repeatable_epoch_begin = True

    def __init__(self):
        super().__init__()
        self.lrs, self.seen, self.epoch = {}, {}, -1

    def get_state(self):
        return {}

    def set_state(self, state):
        pass

    def _lr(self):
        return float(to_np(self.model.optimizer.learning_rate))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.lrs[epoch] = self._lr()

    def on_train_batch_begin(self, batch, logs=None):
        self.seen[(self.epoch, batch)] = self._lr()


@pytest.fixture(params=["flock", "portable"])
def directory_lock(request, monkeypatch):
    """Run a test once with each directory lock (``flock`` and the portable marker lock),
    forced through ``KSS_DIRECTORY_LOCK`` in this process and the child processes it starts;
    the implementation's name."""
    monkeypatch.setenv("KSS_DIRECTORY_LOCK", request.param)
    return request.param
