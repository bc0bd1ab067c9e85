"""Execute the example notebooks with this Python, on one Keras backend.

The committed notebooks carry their outputs (the docs show them); they are
executed on the JAX backend (:data:`COMMITTED_BACKEND`, whatever ``KERAS_BACKEND``
says in the calling shell). After editing a notebook, or when the library's output
changed, re-run it with the project's Python::

    .venv/bin/python notebooks/_run.py                            # every notebook, in place
    .venv/bin/python notebooks/_run.py 02_resume_model_fit.ipynb  # one notebook

``tests/docs/test_notebooks.py`` uses the same functions to execute each notebook on
the backend of the pytest process and, on JAX, to check that the committed text
outputs are not stale.

The kernel is always this interpreter (``sys.executable``): a kernelspec named
``python3`` is written to a temporary folder and handed to the kernel manager
directly, so no ``jupyter kernelspec install`` step is needed and a ``python3``
kernelspec elsewhere on the machine (user or system Jupyter folders) is never
picked up. The kernelspec also sets ``KERAS_BACKEND``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import tempfile
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
COMMITTED_BACKEND = "jax"
#: Cells with this tag have outputs that may differ between machines (float
#: rounding of cross-backend differences, file sizes); the staleness check skips them.
VOLATILE_TAG = "volatile-output"
NOTEBOOKS = sorted(p.name for p in HERE.glob("[0-9][0-9]_*.ipynb"))

#: Run in the kernel after the notebook's last cell: what the kernel ran (interpreter, backend)
#: and whether TensorFlow was imported (it must not be, off the TensorFlow backend).
_PROBE = (
    "import sys as _sys, keras as _keras\n"
    "print(_sys.executable)\n"
    "print(_keras.backend.backend())\n"
    "print('tensorflow' in _sys.modules)\n"
    "del _sys, _keras"
)


@contextlib.contextmanager
def kernel_manager_class(backend: str):
    """A kernel manager class for a ``python3`` kernel running ``sys.executable`` on ``backend``.

    Its kernelspec lives in a temporary folder for the duration of the ``with`` block and is the
    only one the manager looks at; NotebookClient creates, starts and shuts down the manager.
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    with tempfile.TemporaryDirectory(prefix="kss-kernels-") as root:
        spec_dir = Path(root) / "python3"
        spec_dir.mkdir()
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
            "env": {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"},
            "metadata": {"debugger": False},
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))

        class ThisPythonKernelManager(AsyncKernelManager):
            @default("kernel_spec_manager")
            def _only_this_python(self):
                return KernelSpecManager(kernel_dirs=[root], ensure_native_kernel=False)

        yield ThisPythonKernelManager


def execute(path, backend: str, cwd=None, timeout: int = 180):
    """Execute the notebook at ``path`` on ``backend``.

    Args:
        path: The ``.ipynb`` file (not modified).
        backend: ``KERAS_BACKEND`` of the kernel.
        cwd: Working folder of the kernel; default the notebook's folder.
        timeout: Seconds per cell.

    Returns:
        ``(notebook, probe)``: the executed notebook (outputs cleaned with
        :func:`clean`) and ``[sys.executable, keras backend, "tensorflow" in sys.modules]``
        as the kernel saw them after the last cell (strings; the last one is ``"True"`` or
        ``"False"``).

    Raises:
        nbclient.exceptions.CellExecutionError: if a cell raises.
    """
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE, id="kernel-probe"))
    with kernel_manager_class(backend) as manager_class:
        client = NotebookClient(
            nb,
            kernel_manager_class=manager_class,
            kernel_name="python3",
            timeout=timeout,
            record_timing=False,
            resources={"metadata": {"path": str(cwd or path.parent)}},
        )
        client.execute()
    probe_cell = nb.cells.pop()
    probe = "".join(o.get("text", "") for o in probe_cell.outputs if o.output_type == "stream").split()
    return clean(nb), probe


def clean(nb):
    """Drop what differs between runs without being content: timings, versions."""
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "name": "python3",
    }
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            out.get("metadata", {}).pop("execution", None)
    return nb


def text_outputs(nb) -> list:
    """``(cell index, text)`` of every stdout stream and ``text/plain`` result.

    Images, stderr (library log lines with process ids and times) and cells
    tagged :data:`VOLATILE_TAG` are left out: this is what the staleness check compares.
    """
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or VOLATILE_TAG in cell.metadata.get("tags", []):
            continue
        text = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stdout":
                text.append(o.text)
            elif o.output_type in ("execute_result", "display_data") and "text/plain" in o.data:
                if not any(k.startswith("image/") for k in o.data):
                    text.append(o.data["text/plain"])
            elif o.output_type == "error":
                text.append(f"{o.ename}: {o.evalue}")
        out.append((i, "".join(text)))
    return out


def _merge_streams(nb):
    """Join consecutive stream outputs of the same name (the kernel may split them)."""
    for cell in nb.cells:
        merged = []
        for o in cell.get("outputs", []):
            if (
                merged
                and o.output_type == "stream"
                and merged[-1].output_type == "stream"
                and merged[-1].name == o.name
            ):
                merged[-1].text += o.text
            else:
                merged.append(copy.deepcopy(o))
        if cell.cell_type == "code":
            cell.outputs = merged
    return nb


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or NOTEBOOKS
    backend = COMMITTED_BACKEND
    for name in names:
        path = HERE / Path(name).name
        with tempfile.TemporaryDirectory(prefix="kss-nb-") as cwd:
            nb, probe = execute(path, backend, cwd=cwd)
        if probe[:2] != [sys.executable, backend]:
            raise RuntimeError(f"{name}: the kernel ran {probe[:2]}, expected {[sys.executable, backend]}")
        nbformat.write(_merge_streams(nb), path)
        print(f"executed {name} on {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
