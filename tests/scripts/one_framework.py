"""Run a script, a module or a console command of this environment, then fail if a framework
other than the backend's is in ``sys.modules``.

    python one_framework.py BACKEND path/to/script.py [args...]
    python one_framework.py BACKEND -m module [args...]
    python one_framework.py BACKEND path/to/venv/bin/console-script [args...]

``BACKEND`` is the one framework the run may import (``tensorflow``, ``jax`` or ``torch``);
``KERAS_BACKEND`` is left as the caller set it (unset: the script chooses). The target runs
in this interpreter with ``sys.argv`` set as it would be; its exit status is this one's,
and 3 when another framework was imported (the names are printed to stderr).
"""

import runpy
import sys

FRAMEWORKS = ("tensorflow", "jax", "torch")


def _others(backend):
    return sorted(name for name in FRAMEWORKS if name != backend and name in sys.modules)


def main():
    backend, target, *rest = sys.argv[1:]
    status = 0
    try:
        if target == "-m":
            module, *rest = rest
            sys.argv = [module, *rest]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *rest]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    others = _others(backend)
    if others:
        print(f"one_framework: {target} imported {', '.join(others)} beside {backend}", file=sys.stderr)
        return 3
    print(f"one_framework: {target} imported no framework but {backend}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
