"""One framework at a time: the library imports no framework the backend does not need.

A user installs one framework's extra (``[jax]``, ``[torch]``, ``[tensorflow]``). Here every
framework is installed, so an import of another one would succeed and go unseen: a child
process runs the library's entry points with an import hook that refuses, to the library's
own modules only, every framework but the backend's (as a one-framework install would:
``ModuleNotFoundError``) and records each attempt with the module that made it. Keras' own
imports (Keras imports JAX for its Orbax callback wherever JAX is installed) are not ours
and pass. ``make test-installs`` checks the same in real one-framework environments.
"""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import BACKEND

import keras_stable_state

PACKAGE = Path(keras_stable_state.__file__).resolve().parent
FRAMEWORKS = ("tensorflow", "jax", "jaxlib", "torch", "orbax", "tensorstore")
# What each backend may import beside Keras (Orbax and tensorstore are JAX's '.orbax' engine).
ALLOWED = {"tensorflow": {"tensorflow"}, "jax": {"jax", "jaxlib", "orbax", "tensorstore"}, "torch": {"torch"}}

HOOK = """
import importlib.abc, os, sys

PACKAGE = {package!r}
REFUSED = {refused!r}
attempts = []


class OneFramework(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in REFUSED:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(("<frozen", os.path.dirname(os.__file__))):
            frame = frame.f_back  # importlib's own frames: find the module that asked
        where = frame.f_code.co_filename if frame is not None else "?"
        if where.startswith(PACKAGE):
            attempts.append(f"{{name}} from {{where}}:{{frame.f_lineno}}")
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test's one-framework hook)")
        return None


sys.meta_path.insert(0, OneFramework())
"""

# Every entry point a user reaches: fit with StableCheckpoint (and its resume), the two verbs
# on .h5 and .keras (blocking and in the background), bytes, the manager, the accumulator,
# the report, the command line.
SCRIPT = """
import contextlib, io, os, sys, tempfile
import keras
import numpy as np
import keras_stable_state as kss
from keras_stable_state import cli

tmp = tempfile.mkdtemp()
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-3), model=model), loss="mse")
    return model


ckpts = os.path.join(tmp, "ckpts")
model = build()
model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[kss.StableCheckpoint(ckpts, save_freq=2)])
model = build()
model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[kss.StableCheckpoint(ckpts, save_freq=2)])
for ext in ("h5", "keras"):
    path = os.path.join(tmp, f"state.{{ext}}")
    kss.save_training_state(path, model)
    kss.save_training_state(path + ".bg." + ext, model, blocking=False).wait()
    print(kss.restore_training_state(path, build()))
kss.restore_training_state_from_bytes(kss.training_state_to_bytes(model), build())
with kss.CheckpointManager(os.path.join(tmp, "manager"), save_on_background=True) as manager:
    manager.save(1, model, metrics={{"loss": 1.0}})
    manager.save(2, model, metrics={{"loss": 0.5}})
    manager.wait()
    manager.restore(build())
acc = kss.GradientAccumulator(model)
files = sorted(os.listdir(ckpts))
for argv in (["ls", ckpts], ["inspect", os.path.join(tmp, "state.keras")], ["verify", os.path.join(tmp, "state.h5")],
             ["diff", os.path.join(tmp, "state.h5"), os.path.join(tmp, "state.keras")]):
    with contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(argv)
    assert status in (0, 1), (argv, status)
"""


def test_the_library_imports_no_framework_the_backend_does_not_need(tmp_path):
    refused = sorted(set(FRAMEWORKS) - ALLOWED[BACKEND])
    hook = HOOK.format(package=str(PACKAGE), refused=refused)
    code = hook + textwrap.dedent(SCRIPT.format()) + "\nprint('ATTEMPTS', attempts)\n"
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    attempts = [line for line in proc.stdout.splitlines() if line.startswith("ATTEMPTS")]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert attempts == ["ATTEMPTS []"], f"on {BACKEND}, the library imported another framework: {attempts}"
    assert "Restored" in proc.stdout  # the report was printed: the run went through the restores


def test_the_hook_sees_an_import_the_library_makes(tmp_path):
    """The hook above is not blind: a framework import from inside the package is caught."""
    refused = sorted(set(FRAMEWORKS) - ALLOWED[BACKEND])
    hook = HOOK.format(package=str(PACKAGE), refused=refused)
    probe = PACKAGE / "_one_framework_probe.py"
    probe.write_text(f"import {refused[0]}\n")
    try:
        code = (
            hook
            + "\ntry:\n    import keras_stable_state._one_framework_probe\nexcept ImportError:\n    pass\n"
        )
        code += "print('ATTEMPTS', attempts)\n"
        env = dict(os.environ, KERAS_BACKEND=BACKEND)
        # from tmp_path: the package imported is the one PACKAGE names, not a checkout in the cwd
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        probe.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{refused[0]} from {probe}:1" in proc.stdout


def _import_time_imports(statements):
    """The modules imported by ``statements`` when they run at import time: class bodies,
    ``if``/``try``/``with`` blocks; not function bodies, not ``if TYPE_CHECKING:``."""
    for node in statements:
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                yield from _import_time_imports(node.body)
            yield from _import_time_imports(node.orelse)
        elif isinstance(node, ast.ClassDef):
            yield from _import_time_imports(node.body)
        elif isinstance(node, (ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _import_time_imports(block)
            for handler in getattr(node, "handlers", []):
                yield from _import_time_imports(handler.body)


def test_no_module_of_the_library_imports_a_framework_at_import_time():
    """Every import of a framework in the package runs inside a function (the backend decides
    at run time), never when a module is imported."""
    found = [
        f"{path.relative_to(PACKAGE)}:{line} {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name in _import_time_imports(ast.parse(path.read_text(encoding="utf-8")).body)
        if name.split(".")[0] in FRAMEWORKS
    ]
    assert found == [], f"framework imports that run when a module is imported: {found}"
