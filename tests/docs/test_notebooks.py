"""The example notebooks run top to bottom on this backend, and their committed outputs are current.

Each notebook is executed with nbclient, one after the other, in a ``python3`` kernel that runs
this interpreter (``notebooks/_run.py`` hands the kernel manager a temporary kernelspec whose
``argv`` is ``sys.executable``, so nothing has to be installed and no other ``python3``
kernelspec on the machine is used) with ``KERAS_BACKEND`` set to this pytest process's backend.

The committed outputs come from the JAX backend. In the JAX pass, the text outputs of the fresh
run (stdout and ``text/plain``; not images, not stderr, not cells tagged ``volatile-output``)
must equal the committed ones; on every backend, each printed line that ends in ``True`` or
``False`` (a notebook's checked result) must equal the committed one. On JAX and Torch the kernel must not import TensorFlow (no
output carries its C++ start-up log lines), and every notebook of :data:`PLOTS` shows a plot.
Notebook 03 (a second backend continues what the first wrote) runs in the JAX pass of the
environment with every framework only (see ``_ONE_KERNEL``).
"""

import difflib
import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import BACKEND
from kit import ROOT

NOTEBOOKS_DIR = Path(ROOT) / "notebooks"
NOTEBOOKS = [
    "01_quickstart.ipynb",
    "02_resume_model_fit.ipynb",
    "03_cross_backend_transfer.ipynb",
    "04_finetune_frozen_and_lora.ipynb",
    "05_custom_training_loop.ipynb",
]
#: Notebooks that show at least one plot, on every backend and in their committed outputs.
PLOTS = [
    "02_resume_model_fit.ipynb",
    "03_cross_backend_transfer.ipynb",
    "04_finetune_frozen_and_lora.ipynb",
    "05_custom_training_loop.ipynb",
]
#: TensorFlow's C++ log lines (process id and time in each), printed to stderr when TensorFlow
#: is imported; TF_CPP_MIN_LOG_LEVEL does not silence the ones written before absl is initialised.
TF_LOG_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] .*)",
    re.M,
)

_spec = importlib.util.spec_from_file_location("_kss_notebook_runner", NOTEBOOKS_DIR / "_run.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def _committed(name):
    return nbformat.read(NOTEBOOKS_DIR / name, as_version=4)


def _tf_log_lines(nb):
    """``(cell index, line)`` of every TensorFlow log line in any output of ``nb``."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            text = out.get("text", "") + out.get("data", {}).get("text/plain", "")
            text += "\n".join(out.get("traceback", []))
            found += [(i, m.group(0)) for m in TF_LOG_LINE.finditer(text)]
    return found


def test_notebook_list_is_complete():
    assert sorted(NOTEBOOKS) == runner.NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_executed_and_clean(name):
    nb = _committed(name)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), f"{name} is committed unexecuted"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: run top to bottom"
    assert code[0].source.startswith('import os\n\nos.environ.setdefault("KERAS_BACKEND", "jax")')
    for i, cell in enumerate(nb.cells):
        assert "execution" not in cell.metadata, f"{name} cell {i}: execution timestamps"
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{name} cell {i}: committed with an error"
            text = out.get("text", "") + out.get("data", {}).get("text/plain", "")
            assert not re.search(r"/tmp/|/var/folders/|\bat 0x[0-9a-f]+", text), (
                f"{name} cell {i}: temporary path or object address in the output: {text[:300]!r}"
            )
    assert not _tf_log_lines(nb), (
        f"{name}: TensorFlow log lines in the committed outputs: {_tf_log_lines(nb)[:3]}"
    )
    if name in PLOTS:
        assert _image_count(nb) >= 1, f"{name}: the committed notebook has no plot"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_names_what_it_needs(name):
    """The first cell says which backend or extra the notebook needs, with its pip line."""
    first = _committed(name).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "**Needs" in first.source and 'pip install "keras-stable-state[' in first.source, (
        f"{name}: the first cell does not name the backend or extra it needs"
    )
    assert "KERAS_BACKEND" in first.source


def _timeless(outputs):
    """Text outputs with durations masked (StableCheckpoint(verbose=1) prints "in 34 ms")."""
    return [(i, re.sub(r"\b\d+(?:\.\d+)? ms\b", "N ms", text)) for i, text in outputs]


def _claims(nb):
    """The printed lines of ``nb`` that end in ``True`` or ``False``, in order."""
    return [
        line.strip()
        for _, text in runner.text_outputs(nb)
        for line in text.splitlines()
        if re.search(r"\b(True|False)\s*$", line)
    ]


def _image_count(nb):
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


# Notebook 03 continues under a second backend (its READER) in a child process, so it runs in
# the several-frameworks pass, and there in the pass of its committed outputs' backend only
# (JAX: it writes on JAX, continues on TensorFlow): its other kernels' pairs (TensorFlow to JAX,
# Torch to TensorFlow) are two of the nine writer/reader pairs tests/transfer/test_transfer.py checks,
# and running the notebook under them cost about 18 CPU-s each in make test.
_READER = {"jax": "tensorflow", "tensorflow": "jax", "torch": "tensorflow"}[BACKEND]
_NEEDS = {"03_cross_backend_transfer.ipynb": (_READER,)}
_ONE_KERNEL = {"03_cross_backend_transfer.ipynb": runner.COMMITTED_BACKEND}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.frameworks(*_NEEDS.get(n, ()))) for n in NOTEBOOKS]
)
def test_notebook_runs_on_this_backend(name, tmp_path):
    if _ONE_KERNEL.get(name, BACKEND) != BACKEND:
        pytest.skip(
            f"{name} runs on {_ONE_KERNEL[name]} only, where its committed outputs are compared; its "
            f"{BACKEND} writer/reader pair is tests/transfer/test_transfer.py's"
        )
    nb, probe = runner.execute(NOTEBOOKS_DIR / name, BACKEND, cwd=tmp_path, timeout=180)
    # the kernel is this interpreter, on this backend
    assert probe[:2] == [sys.executable, BACKEND]
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    if name in PLOTS:
        assert _image_count(nb) >= 1, f"{name}: the plot is missing on {BACKEND}"
        assert _image_count(_committed(name)) >= 1, f"{name}: the committed notebook has no plot"
    if BACKEND != "tensorflow":
        # keras.utils.set_random_seed (and a .keras save) import TensorFlow wherever it is installed
        assert not _tf_log_lines(nb), f"{name}: TensorFlow log lines on {BACKEND}: {_tf_log_lines(nb)[:3]}"
        assert probe[2] == "False", f"{name}: the kernel imported TensorFlow on {BACKEND}"
    # Every printed claim ("...: True" / "...: False", e.g. notebook 02's "every loss equal to
    # the reference: True") holds on every backend as in the committed (JAX) outputs.
    assert _claims(nb) == _claims(_committed(name)), f"{name}: printed results differ on {BACKEND}"
    if BACKEND != runner.COMMITTED_BACKEND:
        return
    fresh, committed = _timeless(runner.text_outputs(nb)), _timeless(runner.text_outputs(_committed(name)))
    assert [i for i, _ in fresh] == [i for i, _ in committed], (
        f"committed output is stale: re-run notebooks/{name} "
        f"(python notebooks/_run.py {name}); its cells changed"
    )
    for (i, new), (_, old) in zip(fresh, committed, strict=True):
        if new != old:
            diff = "\n".join(
                difflib.unified_diff(
                    old.splitlines(), new.splitlines(), "committed", "fresh run", lineterm="", n=1
                )
            )
            pytest.fail(
                f"committed output is stale: re-run notebooks/{name} "
                f"(python notebooks/_run.py {name}); "
                f"cell {i} differs:\n{diff[:3000]}"
            )
