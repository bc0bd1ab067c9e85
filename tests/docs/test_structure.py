"""The package's structure, read by ``ast`` from its files (every ``keras_stable_state/**.py``):
layers that depend one way, no import cycle, a Keras-free file format and command line,
Keras internals in one module, no reaching into another module's private names, no module
that changes another when it is imported, modules and classes small enough to read, no
context variables and no core function over seven parameters (a call's state travels in its
request); wrapped
inner optimizers that refuse to be used alone, and a ``StableOptimizer`` that loads its slots
without the restore core.

The layers, low to high (a module may import its own layer and lower ones)::

    errors, _numpy, _processes < _keras_compat < _identity < _optimizer, _state < format
      < _engines < format (its public door, ``format/__init__.py``) < _core < _manager < _fit
      < cli < keras_stable_state (__init__), __main__, demo

The file format's modules keep the bytes and sit below the engines; its package namespace
(``keras_stable_state.format``: ``open_file``, ``read_file``) is the public door above them,
which reads an object-store URL through the object-store engine.

Imports inside functions count like module-level ones: a lazy import upward is still an
upward dependency.
"""

import ast
import collections
import functools
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import _keras_compat
from keras_stable_state._numpy import to_numpy

BACKEND = keras.backend.backend()
# The source tree is the same in every pass: its static checks run once, in the jax pass.
once = pytest.mark.skipif(
    BACKEND != "jax",
    reason="the package's source tree, read by ast: the same on every backend; run once, in the jax pass",
)

PACKAGE = pathlib.Path(kss.__file__).parent
ROOT = "keras_stable_state"

# Rank of each first-level part of the package; a name absent here is refused by
# test_every_module_has_a_layer (a new part must be placed in the order on purpose).
LAYERS = {
    "errors": 0,
    "_numpy": 0,
    "_processes": 0,
    "_keras_compat": 1,
    "_identity": 2,
    "_optimizer": 3,
    "_state": 3,
    "format": 4,
    "_engines": 5,
    "_core": 6,
    "_manager": 7,
    "_fit": 8,
    "cli": 9,
    # The application layer: the public namespace and ``python -m``.
    "__init__": 10,
    "__main__": 10,
}
# The file format's public door (``keras_stable_state.format``, its ``__init__``): above the
# engines (an object-store URL is fetched through ``_engines.object_store``), below ``_core``.
FORMAT_DOOR = f"{ROOT}.format"
DOOR_RANK = 5.5
# Parts that import no Keras and no backend (and no package module that does).
KERAS_FREE = ("format", "cli")
# Modules of other parts held to the same: the object-store engine, which the command line reads
# stores through, and the engines' package ``__init__``, which importing it runs first.
KERAS_FREE_MODULES = (f"{ROOT}._engines", f"{ROOT}._engines.object_store", f"{ROOT}._engines.store_failures")
FRAMEWORKS = ("keras", "tensorflow", "jax", "jaxlib", "torch", "tf_keras", "orbax")
# What reaches an object store: the object-store engine's, never the file format's.
STORE_LIBRARIES = ("fsspec", "s3fs", "gcsfs", "adlfs")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]  # a subpackage's __init__ is the subpackage
    return ".".join([ROOT, *parts])


@functools.cache
def _sources() -> dict:
    """``{dotted module name: (path, source text, ast tree)}`` for every package file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        found[_module_name(path)] = (path, text, ast.parse(text, filename=str(path)))
    return found


def _is_module(name: str) -> bool:
    return name in _sources()


def _part(module: str) -> str:
    """The first-level part of the package a module belongs to (its layer's name)."""
    rest = module.split(".")[1:]
    return rest[0] if rest else "__init__"


def _rank(module: str) -> float:
    """The layer of a module: its part's, but the file format's public door's (`DOOR_RANK`)."""
    return DOOR_RANK if module == FORMAT_DOOR else LAYERS.get(_part(module), 0)


def _where(module: str, node) -> str:
    return f"{_sources()[module][0].relative_to(PACKAGE.parent)}:{node.lineno}"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    path = _sources()[module][0]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """``(node, imported package module, name or None)`` for every import of a package
    module in ``module`` (at module level or inside functions): ``from a.b import c`` is
    module ``a.b.c`` when that is a module, else name ``c`` of module ``a.b``."""
    for node in ast.walk(_sources()[module][2]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                    yield node, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            if target != ROOT and not target.startswith(ROOT + "."):
                continue
            for alias in node.names:
                if _is_module(f"{target}.{alias.name}"):
                    yield node, f"{target}.{alias.name}", None
                else:
                    yield node, target, alias.name


def _external_imports(module: str):
    """``(node, top-level name)`` for every import of a module outside the package."""
    for node in ast.walk(_sources()[module][2]):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name != ROOT and not name.startswith(ROOT + "."):
                yield node, name.split(".")[0]


def _graph() -> dict:
    return {m: sorted({t for _, t, _ in _imports(m)} - {m}) for m in _sources()}


@once
def test_every_module_has_a_layer():
    assert sorted({_part(m) for m in _sources()} - set(LAYERS)) == []


@once
def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state = {}

    def visit(node, path):
        if state.get(node) == "open":
            raise AssertionError(f"import cycle: {' -> '.join([*path, node])}")
        if state.get(node) == "done":
            return
        state[node] = "open"
        for dep in graph.get(node, ()):
            visit(dep, [*path, node])
        state[node] = "done"

    for module in sorted(graph):
        visit(module, [])


@once
def test_no_module_imports_a_higher_layer():
    upward = [
        f"{_where(module, node)}: {module} ({_rank(module)}) imports {target}"
        + (f".{name}" if name else "")
        + f" ({_rank(target)})"
        for module in _sources()
        for node, target, name in _imports(module)
        if _rank(target) > _rank(module)
    ]
    assert upward == [], "\n".join(["imports of a higher layer:", *upward])


@once
def test_dependency_direction_inside_a_layer():
    """The wrapper does not know the slot mapping built on it, and the registry of variable
    keys needs only the key grammar, the model walk, the errors and the Keras compatibility
    layer."""
    graph = _graph()
    assert f"{ROOT}._optimizer.slots" not in graph[f"{ROOT}._optimizer.wrapper"]
    assert set(graph[f"{ROOT}._identity.registry"]) <= {
        f"{ROOT}.errors",
        f"{ROOT}._identity.keys",
        f"{ROOT}._identity.paths",
        f"{ROOT}._keras_compat",
    }


def _reachable(module: str) -> set:
    """The package modules ``module`` imports, directly or through others."""
    graph, seen, todo = _graph(), set(), [module]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@once
def test_the_file_format_and_the_command_line_import_no_keras_and_no_backend():
    """``format`` and ``cli`` read files and print: no Keras, no TensorFlow, JAX, Torch or
    Orbax, at module level or inside a function, in themselves or in any package module
    they import; nor the object-store engine they read stores through (and the engines'
    ``__init__``, which importing it runs: `KERAS_FREE_MODULES`). The command line needs none for any command (inspect, verify, diff and ls
    read the file through ``format``), so it has no lazy exception either."""
    offenders = []
    for module in _sources():
        if _part(module) not in KERAS_FREE and module not in KERAS_FREE_MODULES:
            continue
        for source in sorted({module} | _reachable(module)):
            for node, name in _external_imports(source):
                if name in FRAMEWORKS:
                    via = "" if source == module else f" (imported by {module})"
                    offenders.append(f"{_where(source, node)}: {source} imports {name}{via}")
    offenders = sorted(set(offenders))
    assert offenders == [], "\n".join(["Keras or a backend under format/ or cli/:", *offenders])


@once
def test_the_file_format_reaches_no_object_store():
    """Object stores are an engine (``_engines.object_store``): no module of ``format/``
    imports fsspec, s3fs, gcsfs or adlfs, at module level or inside a function, and none but
    the package's public door (``format/__init__.py``, above the engines) reaches one
    through another package module. The format's modules keep the bytes; a caller that
    reads an object store fetches its bytes through the engine and hands them to
    ``format.read_bytes``."""
    offenders = []
    for module in _sources():
        if _part(module) != "format":
            continue
        sources = {module} if module == FORMAT_DOOR else {module} | _reachable(module)
        for source in sorted(sources):
            for node, name in _external_imports(source):
                if name in STORE_LIBRARIES:
                    via = "" if source == module else f" (reached from {module})"
                    offenders.append(f"{_where(source, node)}: {source} imports {name}{via}")
    offenders = sorted(set(offenders))
    assert offenders == [], "\n".join(["an object store reached from format/:", *offenders])


@pytest.mark.slow
@once
def test_importing_the_file_format_and_the_command_line_loads_no_keras():
    """What the static rule above cannot see: importing ``keras_stable_state.format`` or
    ``keras_stable_state.cli`` first runs ``keras_stable_state/__init__.py``, which must then
    not load Keras or a backend either (``keras-stable-state --help`` in a fresh process)."""
    code = (
        "import sys, keras_stable_state.format, keras_stable_state.cli; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert sorted({name.split(".")[0] for name in loaded}) == []


@pytest.mark.slow
@once
def test_importing_the_object_store_engine_loads_no_keras():
    """The command line reads object stores through ``_engines.object_store``: importing it
    in a fresh process (``keras_stable_state/__init__.py`` and ``_engines/__init__.py``
    first) loads no Keras, no backend and no Orbax."""
    code = (
        "import sys, keras_stable_state._engines.object_store; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert sorted({name.split(".")[0] for name in loaded}) == []


def _parameters(node) -> set:
    args = node.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}


@once
def test_the_processes_module_calls_nothing_it_is_given():
    """``_processes`` (layer 0) never calls up: no function of it calls one of its parameters
    (a write, a computation or a hook handed in by a higher layer). Who does the work on
    process 0 runs it inside ``with _processes.on_primary(...)``, which only sees its outcome."""
    module = f"{ROOT}._processes"
    offenders = []
    for node in ast.walk(_sources()[module][2]):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        given = _parameters(node)
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id in given:
                offenders.append(f"{_where(module, inner)}: calls its parameter {inner.func.id!r}")
    offenders = sorted(set(offenders))
    assert offenders == [], "\n".join(["_processes calls what it is given:", *offenders])


def _callee(module: str, call: ast.Call, bound: dict, imported: dict) -> str | None:
    """The package module whose function ``call`` calls (``mod.f(...)`` on a bound module,
    ``f(...)`` imported from one, ``functools.partial(f, ...)``), or ``None``."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "partial" and call.args:
        func = call.args[0]  # functools.partial(f, ...): the arguments go to f
    if isinstance(func, ast.Name):
        return imported.get(func.id)
    if isinstance(func, ast.Attribute):
        return _module_operand(module, func.value, bound)
    return None


def _own_callables(call: ast.Call, defined: set) -> list:
    """The arguments of ``call`` that hand over the caller's own code: a lambda, a function or
    method the calling module defines (``clear``, ``self.prune``)."""
    found = []
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(arg, ast.Lambda):
            found.append("a lambda")
        elif isinstance(arg, ast.Name) and arg.id in defined:
            found.append(arg.id)
        elif (
            isinstance(arg, ast.Attribute) and getattr(arg.value, "id", "") == "self" and arg.attr in defined
        ):
            found.append(f"self.{arg.attr}")
    return found


@once
def test_no_callback_is_handed_to_an_engine_or_to_processes():
    """A save and a restore go down the layers once: no module hands its own code (a lambda,
    a function or method it defines) to ``_processes`` or, from outside ``_engines``, to an
    engine, so that neither calls back up into it (the write of old, ``lambda: write_to(...)``
    handed to ``_processes.run_on_primary`` and ``background.submit``, ran ``_core`` code from
    layer 0 and from an engine's thread). Work on process 0 runs inside
    ``with _processes.on_primary(...)``; an engine gets a ``WriteRequest``."""
    offenders = []
    for module, (_, _, tree) in _sources().items():
        bound = _bound_modules(module)
        imported = {}
        for node, target, name in _imports(module):
            if name is not None:
                for alias in node.names:
                    if alias.name == name:
                        imported[alias.asname or name] = target
        defined = {
            node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            callee = _callee(module, node, bound, imported)
            if callee is None or callee == module:
                continue
            down = _part(callee) == "_processes" or (_part(callee) == "_engines" != _part(module))
            if down:
                for what in _own_callables(node, defined):
                    offenders.append(f"{_where(module, node)}: {module} hands {what} to {callee}")
    assert offenders == [], "\n".join(["code handed down to be called back:", *offenders])


@once
def test_the_key_grammar_imports_no_keras():
    keys = f"{ROOT}._identity.keys"
    names = {name for _, name in _external_imports(keys)}
    assert not names & set(FRAMEWORKS), names
    assert {t for _, t, _ in _imports(keys)} <= {f"{ROOT}.errors"}


# The types that tell one layout of a training state from another (keras_stable_state.format.layout):
# the records read whole, the opened files and the protocol, and the command line's former
# second reader of '.orbax' folders. Which layout a file has is decided in format/ only:
# elsewhere a record or file is asked (``matched_by``, ``metadata``...), never its type.
LAYOUT_TYPES = ("StateRecord", "StockWeights", "CheckpointFile", "OrbaxFile", "Layout", "OrbaxState")


def _type_names(node) -> list:
    """The names in the second argument of ``isinstance``: ``A``, ``m.A``, ``A | B``, ``(A, B)``."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.BinOp):
        return _type_names(node.left) + _type_names(node.right)
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _type_names(element)]
    return []


@once
def test_which_layout_a_file_has_is_decided_in_the_file_format_only():
    """No ``isinstance(x, <a layout type>)`` outside ``keras_stable_state/format/`` (issue 34:
    one door for every layout): a record or an opened file answers ``matched_by`` (by key,
    by structure), ``metadata``, ``contract``, ``extra``, ``checksum``."""
    in_format = {
        node.name
        for module, (_, _, tree) in _sources().items()
        if _part(module) == "format"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    assert set(LAYOUT_TYPES) - in_format == {"OrbaxState"}  # each (but the former) a class of format/
    offenders = []
    for module, (_, _, tree) in _sources().items():
        if _part(module) == "format":
            continue
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                continue
            found = sorted(set(_type_names(node.args[1])) & set(LAYOUT_TYPES))
            if found:
                offenders.append(f"{_where(module, node)}: isinstance on {', '.join(found)}")
    assert offenders == [], "\n".join(["which layout a file has, decided outside format/:", *offenders])


@once
def test_the_restore_core_does_not_import_the_orbax_engine():
    """``_core`` reads every layout through ``_engines.dispatch.read`` (``format``'s readers; a
    ``.orbax`` folder's arrays through the source the Orbax engine supplies to ``format``) and
    writes a ``.orbax`` folder through the engine ``_engines.dispatch.save_engine`` gives: it
    never imports ``_engines.orbax``."""
    engine = f"{ROOT}._engines.orbax"
    offenders = [
        f"{_where(module, node)}: {module} imports {target}" + (f".{name}" if name else "")
        for module in _sources()
        if _part(module) == "_core"
        for node, target, name in _imports(module)
        if target == engine or (target == f"{ROOT}._engines" and name == "orbax")
    ]
    assert offenders == [], "\n".join(["the Orbax engine imported by the restore core:", *offenders])


def _keras_private_attributes(tree) -> list:
    """Attribute chains rooted at ``keras`` (``keras.a._b``) that reach a private name."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id == "keras":
            private = [a for a in chain if a.startswith("_") and not _dunder(a)]
            if private and node.attr == private[-1]:
                found.append((node, ".".join(["keras", *chain])))
    return found


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _defined_privates(tree) -> set:
    """The private names a source defines for its objects: attributes set on ``self`` or
    ``cls`` (``self._x = ...``, ``setattr(self, "_x", ...)``), methods and functions, and names
    assigned in a class body."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = (
                        item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    )
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif _attribute_call(node) == "setattr":
            if isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"):
                names.add(node.args[1].value)
    return {name for name in names if _private(name)}


def _attribute_call(node) -> str | None:
    """``getattr``, ``hasattr``, ``setattr`` or ``delattr`` when ``node`` calls one with a
    literal attribute name (``getattr(x, "_y", None)``), else ``None``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.func.id
    return None


# ``._name`` or ``def _name`` in a source: a private name it uses or defines.
_PRIVATE_USE = re.compile(r"(?:\.|\bdef\s+)(_[A-Za-z0-9]\w*)")


@functools.cache
def _keras_privates() -> frozenset:
    """Every private name the installed Keras defines or reaches for (``._name`` or ``def
    _name`` anywhere in the ``keras`` package; read as text, which is quick): a superset of
    the private attributes of Keras objects."""
    names = set()
    for path in pathlib.Path(keras.__file__).parent.rglob("*.py"):
        names.update(_PRIVATE_USE.findall(path.read_text()))
    return frozenset(name for name in names if _private(name))


@functools.cache
def _keras_class_privates(cls) -> frozenset:
    """The private names the Keras classes of ``cls``'s method resolution order define."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "keras":
            names |= _defined_privates(ast.parse(textwrap.dedent(inspect.getsource(base))))
    return frozenset(names)


def _keras_base(node: ast.ClassDef):
    """The first base of a class that is a Keras class (``keras.callbacks.Callback``), or ``None``."""
    for base in node.bases:
        chain = ast.unparse(base).split(".")
        if chain[0] == "keras":
            return functools.reduce(getattr, chain[1:], keras)
    return None


def _keras_private_reads(tree, ours: set) -> list:
    """``(node, name)`` for every read, write or test of a private attribute Keras defines
    (``layer._frozen_vocab_size``, ``getattr(lookup, "_frozen_vocab_size", None)``). A name
    the package also defines for its own objects (`_defined_privates`) is its own there,
    except on ``self`` inside a subclass of a Keras class, where it is Keras' when that
    class's Keras bases define it (``self._trainable_variables`` in an ``Optimizer``)."""
    keras_class = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and (base := _keras_base(node)) is not None:
            for inner in ast.walk(node):
                keras_class[id(inner)] = base
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif _attribute_call(node):
            owner, name = node.args[0], node.args[1].value
        else:
            continue
        if not _private(name):
            continue
        if id(node) in keras_class and isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            if name in _keras_class_privates(keras_class[id(node)]):
                found.append((node, name))
        elif name in _keras_privates() and name not in ours:
            found.append((node, name))
    return found


@once
def test_keras_internals_only_in_the_compat_module():
    """``keras.src``, ``sys._getframe``, private attributes of ``keras`` (``keras.x._y``) and
    private attributes of Keras objects (``layer._frozen_vocab_size``, ``getattr(x, "_y")``:
    a private name the installed Keras defines that the package does not define for its
    own objects, see `_keras_private_reads`) appear only in ``_keras_compat``, which guards
    them by the supported Keras range."""
    compat = f"{ROOT}._keras_compat"
    outside = {
        module: source
        for module, source in _sources().items()
        if module != compat and not module.startswith(compat + ".")
    }
    ours = set().union(*(_defined_privates(tree) for _, _, tree in outside.values()))
    offenders = []
    for module, (path, text, tree) in outside.items():
        name = path.relative_to(PACKAGE.parent)
        offenders += [f"{name}: {word}" for word in ("keras.src", "_getframe") if word in text]
        offenders += [f"{_where(module, node)}: {chain}" for node, chain in _keras_private_attributes(tree)]
        offenders += [
            f"{_where(module, node)}: .{attr} (Keras')" for node, attr in _keras_private_reads(tree, ours)
        ]
    assert offenders == [], "\n".join(["Keras internals outside _keras_compat:", *offenders])


# Exception classes defined outside errors.py: signals raised and caught inside the package,
# never raised to a caller, each with the reason it lives beside its one raiser and catcher.
INTERNAL_SIGNALS = {
    # sandbox.py also runs as a script in the probe process and imports nothing of the package.
    f"{ROOT}.format.sandbox.StructureError",
    # "another process holds the marker": turned into CheckpointInUseError by _manager/lock.py.
    f"{ROOT}._manager.portable_lock.Busy",
    # a command's refusal of one file: printed (one line, or --json) by cli.app.main.
    f"{ROOT}.cli.app.Refusal",
}


def _exception_classes() -> dict:
    """``{dotted name: (module, node)}`` of every class in the package that derives from an
    exception or a warning: a base named ``Exception``, ``BaseException`` or ``...Error``,
    ``...Warning``, or a package class found so (by name, to a fixed point)."""
    classes = [
        (module, node)
        for module, (_, _, tree) in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]
    found, grew = {}, True
    while grew:
        grew = False
        known = {name.rsplit(".", 1)[1] for name in found}
        for module, node in classes:
            name = f"{module}.{node.name}"
            bases = {ast.unparse(base).split(".")[-1] for base in node.bases}
            if name not in found and any(
                base in ("Exception", "BaseException") or base.endswith(("Error", "Warning")) or base in known
                for base in bases
            ):
                found[name] = (module, node)
                grew = True
    return found


@once
def test_every_error_class_is_in_errors():
    """Every exception and warning a caller can meet is defined in ``errors.py`` (and
    re-exported where it is public), so one module lists what the package raises; the
    signals of `INTERNAL_SIGNALS` are the exceptions."""
    errors = f"{ROOT}.errors"
    assert len([name for name in _exception_classes() if name.startswith(errors + ".")]) >= 15
    outside = [
        f"{_where(module, node)}: {name}"
        for name, (module, node) in _exception_classes().items()
        if module != errors and name not in INTERNAL_SIGNALS
    ]
    assert outside == [], "\n".join(["exception classes outside errors.py:", *outside])


def _bound_modules(module: str) -> dict:
    """``{local name: package module}`` the imports of ``module`` bind to a module."""
    bound = {}
    for node, target, name in _imports(module):
        if name is not None:
            continue
        for alias in node.names:
            if isinstance(node, ast.Import):
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:  # ``import a.b.c`` binds ``a``
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif target.endswith("." + alias.name):
                bound[alias.asname or alias.name] = target
    return bound


def _private(name: str) -> bool:
    return name.startswith("_") and not _dunder(name)


@once
def test_no_module_uses_another_modules_private_names():
    """Siblings import each other's public names: no ``from keras_stable_state.x import _y``
    and no ``x._y`` on an imported package module (a private *module* such as ``_core`` or
    ``_keras_compat`` is not a private name: the package is made of them)."""
    offenders = []
    for module in _sources():
        for node, target, name in _imports(module):
            if name is not None and _private(name) and target != module:
                offenders.append(f"{_where(module, node)}: {module} imports {target}.{name}")
        bound = _bound_modules(module)
        for node in ast.walk(_sources()[module][2]):
            if not isinstance(node, ast.Attribute):
                continue
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            target = bound[value.id]
            for attr in chain:
                if not _is_module(f"{target}.{attr}"):
                    break
                target = f"{target}.{attr}"
            else:
                continue
            if attr == node.attr and _private(attr) and target != module:
                offenders.append(f"{_where(module, node)}: {module} uses {target}.{attr}")
    offenders = sorted(set(offenders))
    assert offenders == [], "\n".join(["private names of another module:", *offenders])


def _run_at_import(tree):
    """The nodes of a module that run when it is imported: its body and class bodies, and
    the decorators and default values of its functions, not the functions' bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [*node.decorator_list, *node.args.defaults, *filter(None, node.args.kw_defaults)]
        elif not isinstance(node, ast.Lambda):
            todo += list(ast.iter_child_nodes(node))


_MUTATORS = {"append", "extend", "insert", "update", "add", "setdefault", "clear", "pop", "remove"}


def _rebinds_globals(function) -> bool:
    """Whether a function's body changes its module's globals: rebinds them (a ``global``
    statement) or changes a module-level container in place (``_hooks[:] = [f]``,
    ``_hooks.append(f)``, ``_table[key] = f``: a name neither a parameter nor assigned in it)."""
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    local = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(function):
        if isinstance(node, ast.Global):
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            root = _module_root(node)
            if root is not None and root not in local:
                return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id not in local
            and node.func.value.id.startswith("_")
        ):
            return True
    return False


def _called(module: str, func, bound: dict, names: dict):
    """``(package module, function name)`` a call's ``func`` names, or ``None``: ``f`` bound by
    ``from m import f``, or ``m.f`` on a package module bound by an import."""
    if isinstance(func, ast.Name):
        return names.get(func.id)
    chain, value = [], func
    while isinstance(value, ast.Attribute):
        chain.insert(0, value.attr)
        value = value.value
    if not isinstance(value, ast.Name) or value.id not in bound:
        return None
    target = bound[value.id]
    while len(chain) > 1 and _is_module(f"{target}.{chain[0]}"):
        target = f"{target}.{chain.pop(0)}"
    return (target, chain[0]) if len(chain) == 1 else None


def _module_root(node):
    """The name an assignment target such as ``m.x``, ``m.x[k]`` or ``m.__dict__["x"]`` starts at."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@once
def test_no_module_registers_into_another_at_import():
    """Importing a module changes no other module of the package: nothing at import time
    assigns into another module's globals (``m.x = ...``, ``setattr(m, ...)``) or calls a
    function of another module that rebinds that module's globals (a registration such as
    the former ``register_keyed_restore``). What one part needs from another it imports
    and calls, or is given by its caller, so that it does not depend on import order."""
    functions = {
        (module, node.name): node
        for module, (_, _, tree) in _sources().items()
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    offenders = []
    for module, (_, _, tree) in _sources().items():
        bound = _bound_modules(module)
        names = {
            alias.asname or alias.name: (target, name)
            for node, target, name in _imports(module)
            if name is not None
            for alias in node.names
            if alias.name == name
        }
        for node in _run_at_import(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if not isinstance(target, ast.Name) and bound.get(_module_root(target), module) != module:
                    offenders.append(f"{_where(module, node)}: assigns into {bound[_module_root(target)]}")
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
                root = _module_root(node.args[0])
                if bound.get(root, module) != module:
                    offenders.append(f"{_where(module, node)}: setattr on {bound[root]}")
            called = _called(module, node.func, bound, names)
            if called and called[0] != module and _rebinds_globals(functions.get(called, ast.Pass())):
                offenders.append(
                    f"{_where(module, node)}: calls {called[0]}.{called[1]}, which rebinds its globals"
                )
    assert offenders == [], "\n".join(["modules that change another module when imported:", *offenders])


@once
def test_the_file_format_package_is_used_through_its_all():
    """``keras_stable_state.format``'s namespace is what a tool that reads files needs (its
    ``__all__``); every other name (the writer, the in-place reader, the file and URL
    doors, the layout's sizes) is imported from the module defining it, so the package's
    ``__all__`` promises nothing the library keeps for itself."""
    package = f"{ROOT}.format"
    public = set(importlib.import_module(package).__all__)
    offenders = []
    for module, (_, _, tree) in _sources().items():
        if module == package:
            continue
        for node, target, name in _imports(module):
            if target == package and name is not None and name not in public:
                offenders.append(f"{_where(module, node)}: from {package} import {name}")
        bound = {local for local, target in _bound_modules(module).items() if target == package}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr not in public
                and not _is_module(f"{package}.{node.attr}")
            ):
                offenders.append(f"{_where(module, node)}: {node.value.id}.{node.attr}")
    assert offenders == [], "\n".join(
        [f"names outside {package}.__all__ taken from the package:", *offenders]
    )


@once
def test_package_modules_are_imported_under_their_own_names():
    """A package module is called by its own name wherever it is imported (``format``, not
    ``storage``; ``_core``, not ``checkpoint``; ``_keras_compat``, not ``compat``), in the
    package and in the tests, benchmarks and examples, so that a reader finds the folder from
    the name: an ``import ... as`` of a package module under another name is refused."""
    tree_root = PACKAGE.parent
    files = [path for _, (path, _, _) in _sources().items()]
    for folder in ("tests", "benchmarks", "examples"):
        files += sorted((tree_root / folder).rglob("*.py"))
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(ROOT):
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    if alias.asname and alias.asname != alias.name and _is_module(dotted):
                        where = f"{path.relative_to(tree_root)}:{node.lineno}"
                        offenders.append(f"{where}: {dotted} as {alias.asname}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(ROOT + ".") and alias.asname:
                        offenders.append(
                            f"{path.relative_to(tree_root)}:{node.lineno}: {alias.name} as {alias.asname}"
                        )
    assert offenders == [], "\n".join(["package modules imported under another name:", *offenders])


@once
def test_no_module_over_600_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): len(text.splitlines())
        for path, text, _ in _sources().values()
        if len(text.splitlines()) > 600
    }
    assert long == {}


@once
def test_no_class_over_400_lines():
    """No class is over 400 lines, its docstring counted: a long explanation goes to the
    how-to pages, linked from the docstring."""
    long = {
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for path, _, tree in _sources().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400
    }
    assert long == {}


@once
def test_no_context_variables_in_the_package():
    """What one save or restore knows of its model (the walk, its registries, layer paths,
    the keys parsed) travels in its request (``SaveRequest``, ``RestoreRequest``: their
    ``ModelIndex``), passed whole to what plans the call: no module imports ``contextvars``
    or names a ``ContextVar``, whose value no signature shows and a thread the call starts
    (a background write) does not see."""
    offenders = []
    for path, _, tree in _sources().values():
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            else:
                continue
            found = [n for n in names if n.split(".")[0] == "contextvars" or n == "ContextVar"]
            offenders += [f"{where}:{node.lineno}: {n}" for n in found]
    offenders = sorted(set(offenders), key=offenders.index)
    assert offenders == [], "\n".join(["context variables in the package:", *offenders])


# The most parameters a function of the core takes (``self``/``cls`` not counted; ``*args``
# and ``**kwargs`` one each): more travel together, in a request or an options object.
MAX_CORE_PARAMETERS = 7
# The public verbs whose parameters are public API (each in ``keras_stable_state.__all__``),
# exempt: their signatures are promises, and they pass their arguments on grouped.
WIDE_PUBLIC_VERBS = {
    f"{ROOT}._core.save": {"save_training_state"},
    f"{ROOT}._core.restore": {"restore_training_state"},
}


def _parameter_count(node) -> int:
    args = node.args
    named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


@once
def test_no_core_function_takes_more_than_seven_parameters():
    """No function (method, nested function, lambda) of ``_core`` takes more than
    `MAX_CORE_PARAMETERS` parameters: a save's or restore's arguments travel checked and
    whole, in its request, to the planners. Only the public verbs of `WIDE_PUBLIC_VERBS`
    (public API, in ``keras_stable_state.__all__``) are exempt, at module level."""
    for module, names in WIDE_PUBLIC_VERBS.items():
        assert names <= set(kss.__all__), f"{module}: exempt names must be public verbs: {names}"
    offenders = []
    for module, (path, _, tree) in _sources().items():
        if _part(module) != "_core":
            continue
        exempt = {
            id(node)
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in WIDE_PUBLIC_VERBS.get(module, ())
        }
        for node in ast.walk(tree):
            if (
                not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                or id(node) in exempt
            ):
                continue
            count = _parameter_count(node)
            if count > MAX_CORE_PARAMETERS:
                name = getattr(node, "name", "<lambda>")
                offenders.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}: {count} parameters"
                )
    assert offenders == [], "\n".join(
        [f"core functions over {MAX_CORE_PARAMETERS} parameters (group them in a request):", *offenders]
    )


# What reads and writes a checkpoint directory: a local folder's, an object store's. The
# command line lists directories with them, and the manager holds one as its ``files``.
DIRECTORY_MODULES = (f"{ROOT}._manager.directory", f"{ROOT}._manager.remote_directory")


@once
def test_the_checkpoint_directories_import_no_keras_and_no_core():
    """Neither directory module imports Keras, a backend or ``_core``, in itself or in any
    package module it imports, nor looks Keras up in ``sys.modules`` (an import in disguise):
    what they need of the writer (its backend) is given to them."""
    offenders = []
    for module in DIRECTORY_MODULES:
        for source in sorted({module} | _reachable(module)):
            offenders += [
                f"{_where(source, node)}: {source} imports {name} (reached from {module})"
                for node, name in _external_imports(source)
                if name in FRAMEWORKS
            ]
            offenders += [
                f"{_where(source, node)}: {source} imports {target} (reached from {module})"
                for node, target, _ in _imports(source)
                if _part(target) == "_core"
            ]
        for node in ast.walk(_sources()[module][2]):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "modules"
                and getattr(node.value, "id", "") == "sys"
            ):
                offenders.append(f"{_where(module, node)}: {module} reads sys.modules")
    offenders = sorted(set(offenders))
    assert offenders == [], "\n".join(["Keras or the core behind a checkpoint directory:", *offenders])


def _module_operand(module: str, node, bound: dict):
    """The package module an expression names (``name`` or ``name.sub`` bound by an import
    of ``module``), or ``None``."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    target = bound[node.id]
    for attr in chain:
        if not _is_module(f"{target}.{attr}"):
            return None
        target = f"{target}.{attr}"
    return target


@once
def test_no_module_stands_in_for_an_object():
    """No ``x is module`` / ``x is not module``: a module passed where an object is expected
    (the directory a manager holds was once the module ``_manager.directory`` or a
    ``RemoteDirectory``, told apart with ``is``) gets one type with one surface instead."""
    offenders = []
    for module in _sources():
        bound = _bound_modules(module)
        for node in ast.walk(_sources()[module][2]):
            if not isinstance(node, ast.Compare) or not any(
                isinstance(op, ast.Is | ast.IsNot) for op in node.ops
            ):
                continue
            for operand in (node.left, *node.comparators):
                target = _module_operand(module, operand, bound)
                if target is not None:
                    offenders.append(f"{_where(module, node)}: {module} compares with the module {target}")
    assert offenders == [], "\n".join(["identity comparisons with a module:", *offenders])


def _surface(cls) -> dict:
    """``{public method: its parameter names}`` of ``cls``."""
    import inspect

    return {
        name: list(inspect.signature(member).parameters)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_a_manager_reads_and_writes_through_one_directory_type(tmp_path):
    """``CheckpointManager.files`` is a `CheckpointDirectory` for a local folder and an object
    store alike, the two classes have exactly the protocol's methods, and the lock each
    takes is a `WriterLock`."""
    from keras_stable_state._manager.directory import LocalDirectory
    from keras_stable_state._manager.lock import new_token
    from keras_stable_state._manager.protocols import CheckpointDirectory, WriterLock
    from keras_stable_state._manager.remote_directory import RemoteDirectory

    assert _surface(LocalDirectory) == _surface(RemoteDirectory) == _surface(CheckpointDirectory)
    for directory, kind in (
        (str(tmp_path / "run"), LocalDirectory),
        ("memory://kss-structure", RemoteDirectory),
    ):
        files = kss.CheckpointManager(directory).files
        assert type(files) is kind and isinstance(files, CheckpointDirectory)
        files.prepare("CheckpointManager")
        token = new_token()
        held = files.acquire_lock(token, writer="CheckpointManager", reclaimable=False)
        assert isinstance(held, WriterLock) and held.held and held.token == token
        held.release(token)
        assert not held.held


def test_keras_version_outside_the_supported_range_is_refused():
    _keras_compat.check_keras_version(keras.__version__)
    _keras_compat.check_keras_version("3.15.0")
    for version in ("3.14.2", "4.0.0", "2.15.0", "unknown"):
        with pytest.raises(ImportError, match=r"supports Keras >=3.15,<4; installed: Keras"):
            _keras_compat.check_keras_version(version)


def test_inner_optimizer_taken_out_of_the_wrapper_refuses_to_save_alone(tmp_path):
    model = mlp(3, (), layer_names=("dense",), out_units=2, optimizer=None)
    wrapper = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    model.compile(optimizer=wrapper, loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    model.save(tmp_path / "wrapped.keras")  # the wrapper saves its inner optimizer's state by key

    model.compile(optimizer=wrapper.inner_optimizer, loss="mse")  # taken out of the wrapper
    with pytest.raises(kss.StateError, match=r"was wrapped by StableOptimizer .* on its own"):
        model.save(tmp_path / "alone.keras")


@pytest.mark.slow
def test_stable_optimizer_loads_its_slots_by_key_without_the_restore_core(tmp_path):
    """``StableOptimizer``'s own load path (``keras.saving.load_model``, then ``bind``) matches
    its slots itself: in a fresh process that imports only the optimizer part (before Keras,
    so that the package loads nothing else), the slots come back by key and the restore core
    is never imported."""
    model = mlp(3, (), layer_names=("dense",), out_units=2, optimizer=None)
    opt = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((4, 3)), np.arange(8.0).reshape(4, 2), verbose=0)
    model.save(tmp_path / "m.keras")
    saved = {e.key: np.asarray(to_numpy(e.variable)).tolist() for e in opt.entries()}
    (tmp_path / "slots.json").write_text(json.dumps(saved))
    code = (
        "import json, sys\n"
        "import numpy as np\n"
        "from keras_stable_state._optimizer import StableOptimizer\n"
        "from keras_stable_state._numpy import to_numpy\n"
        "import keras\n"
        f"loaded = keras.saving.load_model({str(tmp_path / 'm.keras')!r})\n"
        "assert isinstance(loaded.optimizer, StableOptimizer)\n"
        "loaded.optimizer.bind(loaded)\n"
        "got = {e.key: to_numpy(e.variable).tolist() for e in loaded.optimizer.entries()}\n"
        f"saved = json.loads(open({str(tmp_path / 'slots.json')!r}).read())\n"
        "assert got == saved, (sorted(got), sorted(saved))\n"
        "assert 'keras_stable_state._core' not in sys.modules\n"
        "print('restored', len(got))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"restored {len(saved)}"


# -- the tests' own layout (tests/README.md) ------------------------------------------------------
# The folders of tests/, one per promise the suite checks; every test file is in one of them.
PROMISE_FOLDERS = (
    "identity",
    "state",
    "integrity",
    "fit",
    "manager",
    "transfer",
    "hostile",
    "performance",
    "docs",
)
# The model factories a test file keeps instead of the kit's (``kit.mlp``), because the model's
# structure is the case the file tests; each names its reason in a comment above it.
OWN_MODELS = {
    ("test_binding.py", "_model"): "subclassed, its branches created in either order",
    (
        "test_compiled_metrics_resume.py",
        "_model",
    ): "compiled with metrics, weighted metrics or a loss per output",
    ("test_crafted.py", "_model"): "a functional model with the Lambda layer crafted files target",
    ("test_model_held_state.py", "_torch_model"): "a wrapped torch.nn.Module with BatchNorm buffers",
    ("test_resume.py", "_lora_model"): "LoRA adapters enabled on the kit's model",
}
OWN_MODEL_COMMENT = "# Its own model: "


def _test_files(tests: pathlib.Path) -> list:
    return sorted(path for path in tests.rglob("test_*.py") if "__pycache__" not in path.parts)


def _layout_problems(tests: pathlib.Path) -> list:
    """Why the test files under ``tests`` are not where a reader looks for them: a test file
    outside a promise folder (directly under ``tests/`` or in another folder), a promise folder
    without its ``README.md``, an ``__init__.py`` (pytest's rootdir import mode needs none), two
    test files of one base name (pytest imports each by its base name)."""
    problems = []
    for path in _test_files(tests):
        where = path.relative_to(tests)
        if len(where.parts) != 2 or where.parts[0] not in PROMISE_FOLDERS:
            problems.append(f"tests/{where}: not in a promise folder ({', '.join(PROMISE_FOLDERS)})")
    problems += [
        f"tests/{folder}/README.md: missing (what the folder's promise is)"
        for folder in PROMISE_FOLDERS
        if not (tests / folder / "README.md").is_file()
    ]
    problems += [
        f"tests/{path.relative_to(tests)}: tests/ has no packages" for path in tests.rglob("__init__.py")
    ]
    names = collections.Counter(path.name for path in _test_files(tests))
    problems += [
        f"{name}: {count} test files of this name" for name, count in sorted(names.items()) if count > 1
    ]
    return problems


@once
def test_every_test_file_is_in_the_folder_of_its_promise():
    """``tests/<promise>/test_*.py`` only (issue 34, item 7): every test of a promise in one
    folder that says which promise it is."""
    assert _layout_problems(pathlib.Path(TESTS)) == []


def _is_fixture(node) -> bool:
    return any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)


def _factory_problems(tests: pathlib.Path) -> list:
    """The model factories of test files (a top-level function, not a test or a fixture, with
    ``model`` among the words of its name) other than `OWN_MODELS`, and each of those missing
    or without its reason in the comment line above it."""
    problems, kept = [], set()
    for path in _test_files(tests):
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines), filename=str(path)).body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("test_"):
                continue
            if "model" not in node.name.lower().split("_") or _is_fixture(node):
                continue
            where = f"tests/{path.relative_to(tests)}:{node.lineno}"
            if (path.name, node.name) not in OWN_MODELS:
                problems.append(f"{where}: {node.name}() builds a model of its own: use kit.mlp")
                continue
            kept.add((path.name, node.name))
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first < 2 or not lines[first - 2].startswith(OWN_MODEL_COMMENT):
                problems.append(f"{where}: {node.name}() without its reason ({OWN_MODEL_COMMENT!r}) above it")
    problems += [
        f"{file}: {name}() listed in OWN_MODELS, not found" for file, name in sorted(set(OWN_MODELS) - kept)
    ]
    return problems


@once
def test_no_test_file_builds_its_models_with_a_factory_of_its_own():
    """One shared kit for models (``kit.mlp``): a test file has no ``_model()``-style factory
    of its own, but the few of `OWN_MODELS`, whose model's structure is the case they test."""
    assert _factory_problems(pathlib.Path(TESTS)) == []


@once
def test_a_test_module_imports_test_modules_of_its_own_folder_only():
    """pytest (rootdir import mode, no packages) puts the folder of the test file it imports on
    ``sys.path``: an import of a test module of another folder works or fails by the order
    files are collected in. What two folders share goes to the kit."""
    tests = pathlib.Path(TESTS)
    offenders = []
    for path in _test_files(tests):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                if name.startswith("test_") and not (path.parent / f"{name}.py").is_file():
                    offenders.append(f"tests/{path.relative_to(tests)}:{node.lineno}: imports {name}")
    assert offenders == []


@once
def test_the_lazy_table_lists_exactly_the_type_checking_imports():
    """``_SOURCES`` (what the package loads on first use, and ``__all__``) names each public
    name of the ``if TYPE_CHECKING:`` imports with the module it is imported from there, and
    no other, so the two cannot drift; the package works without its source (it is not read
    at import: an install without sources, a zip import, a frozen application)."""
    tree = ast.parse(pathlib.Path(kss.__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {
        alias.name: (node.module or "").removeprefix("keras_stable_state.")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert kss._SOURCES == imported
    assert kss.__all__ == sorted(imported)
    assert all(
        getattr(kss, name) is getattr(importlib.import_module(f"keras_stable_state.{m}"), name)
        for name, m in imported.items()
    )
