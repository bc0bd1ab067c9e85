"""The package's structure: one direction of dependency, a Keras-free key grammar,
Keras internals in one module, and wrapped inner optimizers that refuse to be used alone."""

import ast
import pathlib

import keras
import numpy as np
import pytest

import keras_stable_state as kss
from keras_stable_state import _keras_compat

PACKAGE = pathlib.Path(kss.__file__).parent


def _imports(module: str) -> set:
    """Package modules ``module`` imports (at module level or inside functions)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_stable_state"):
            if node.module == "keras_stable_state":
                found |= {alias.name for alias in node.names}
            else:
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("keras_stable_state.")}
    return found - {module}


def _graph() -> dict:
    modules = [p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    return {m: _imports(m) for m in modules}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state = {}

    def visit(node, path):
        if state.get(node) == "open":
            raise AssertionError(f"import cycle: {' -> '.join([*path, node])}")
        if state.get(node) == "done":
            return
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        state[node] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_dependency_direction():
    graph = _graph()
    assert "checkpoint" not in graph["optimizer"] and "slots" not in graph["optimizer"]
    assert "checkpoint" not in graph["slots"] and "callbacks" not in graph["checkpoint"]
    assert graph["identity"] <= {"errors", "keys", "_keras_compat"}


def test_the_key_grammar_imports_no_keras():
    tree = ast.parse((PACKAGE / "keys.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name.split(".")[0] == "keras" for name in names), names
    assert _imports("keys") <= {"errors"}


def test_keras_internals_only_in_the_compat_module():
    offenders = [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.stem != "_keras_compat" and ("keras.src" in p.read_text() or "_getframe" in p.read_text())
    ]
    assert offenders == []


def test_keras_version_outside_the_supported_range_is_refused():
    _keras_compat.check_keras_version(keras.__version__)
    _keras_compat.check_keras_version("3.15.0")
    for version in ("3.14.2", "4.0.0", "2.15.0", "unknown"):
        with pytest.raises(ImportError, match=r"supports Keras >=3.15,<4; installed: Keras"):
            _keras_compat.check_keras_version(version)


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
    return model


def test_inner_optimizer_taken_out_of_the_wrapper_refuses_to_save_alone(tmp_path):
    model = _model()
    wrapper = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    model.compile(optimizer=wrapper, loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    model.save(tmp_path / "wrapped.keras")  # the wrapper saves its inner optimizer's state by key

    model.compile(optimizer=wrapper.inner_optimizer, loss="mse")  # taken out of the wrapper
    with pytest.raises(kss.StateError, match=r"was wrapped by StableOptimizer .* on its own"):
        model.save(tmp_path / "alone.keras")
