"""The user's install, checked: one framework, from the wheel.

For each backend, in a virtual environment that ``make`` built with nothing but
``pip install "<the wheel>[<backend>]"`` (``.venv-<backend>``; Torch's CPU build is the
one ``constraints.txt`` pins; every install of this script and the Makefile passes
``--no-compile``, so Python compiles a module when it is first imported, not at install),
this script runs, in order:

1. the README's quick start, copied from README.md as it is, in an empty folder, with
   ``KERAS_BACKEND`` unset and a ``HOME`` of its own (no ``~/.keras/keras.json``), twice:
   the second run resumes from what the first wrote and trains nothing;
2. the command line on what it wrote: ``keras-stable-state ls``, ``inspect``,
   ``verify`` and ``diff`` (and ``python -m keras_stable_state ls``);
3. ``examples/resume_demo.py`` after ``pip install "<the wheel>[<backend>,demo]"``;
4. with ``--tests all`` (``make test``) the library's test suite for that backend, or with
   ``--tests quick`` its quick tier (``pytest -m "not slow"``), after installing what the
   tests need (``[<backend>,dev,demo,cloud,grain]``, and ``orbax`` on JAX, ``torchdata`` on Torch): still no other
   framework. A test that needs another framework is skipped with that reason
   (``@pytest.mark.frameworks``); ``make test`` runs those in the environment that has
   every framework.

Every Python step runs under ``tests/scripts/one_framework.py``, which fails the step if a
framework other than the backend's is in ``sys.modules`` at its end. Output of each step
goes to ``build/installs/<backend>/<step>.log`` (the test suite's durations, per test, to
``tests-<tier>.xml`` beside it, JUnit XML); the script prints one line per step and
exits 1 at the first failure, naming the step and its log.

Usage (the Makefile's ``test-installs`` and ``demo`` targets call it)::

    python tests/install_check.py --backend jax --venv .venv-jax [--tests all|quick] [--jobs 2] \
        [--phase all|prepare|tests]

``make test`` runs ``--phase prepare`` of the three backends two at a time (each is pip and
single scripts: one core's work) beside the lint and docs, then ``--phase tests`` of each
backend in turn with every core.

It needs only the standard library: it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "scripts" / "one_framework.py"
FRAMEWORKS = ("tensorflow", "jax", "torch")
# What the test suite needs beside the backend (pytest, hypothesis, moto's S3 server, the
# notebook runner, grain inputs); Orbax is JAX's own extra, torchdata (StatefulDataLoader)
# Torch's.
TEST_EXTRAS = {
    "jax": "dev,demo,cloud,grain,orbax",
    "torch": "dev,demo,cloud,grain,torchdata",
    "tensorflow": "dev,demo,cloud,grain",
}


def quick_start() -> str:
    """The first ``python`` block under the README's "Quick start" heading, as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        raise SystemExit("README.md: no ```python block under '## Quick start'")
    return match.group(1)


def wheel(venv: Path) -> str:
    """The wheel the environment was built from (the Makefile leaves it beside it)."""
    found = sorted(glob.glob(str(venv / "wheel" / "keras_stable_state-*.whl")))
    if len(found) != 1:
        raise SystemExit(f"{venv}/wheel: expected one keras_stable_state wheel, found {found}")
    return found[0]


class Steps:
    def __init__(self, backend: str, venv: Path, logs: Path):
        self.backend = backend
        self.venv = venv.resolve()
        self.logs = logs
        self.python = str(self.venv / "bin" / "python")
        logs.mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, name: str, argv: list, *, cwd=None, env=None, ok=(0,)) -> str:
        """Run ``argv``; its output goes to ``<logs>/<name>.log``. Exit 1 naming the step if its
        exit status is not in ``ok``."""
        log = self.logs / f"{name}.log"
        start = time.perf_counter()
        with open(log, "w", encoding="utf-8") as out:
            out.write(f"$ {' '.join(map(str, argv))}\n")
            out.flush()
            proc = subprocess.run(argv, cwd=cwd, env=env or self.env(), stdout=out, stderr=subprocess.STDOUT)
        took = time.perf_counter() - start
        if proc.returncode not in ok:
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
            print(f"  {self.backend}: {name} FAILED (exit {proc.returncode}, {took:.0f} s); log {log}:")
            print("\n".join("    " + line for line in tail))
            raise SystemExit(1)
        print(f"  {self.backend}: {name} ok ({took:.0f} s)", flush=True)
        return log.read_text(encoding="utf-8", errors="replace")

    def probe(self, name: str, target: list, **kw) -> str:
        """Run a script (``path``), module (``-m name``) or console command under the probe."""
        return self.run(name, [self.python, str(PROBE), self.backend, *target], **kw)

    def pip(self, name: str, spec: str, *options: str) -> None:
        argv = [
            self.python,
            "-m",
            "pip",
            "install",
            "-q",
            *options,
            "-c",
            str(ROOT / "constraints.txt"),
            spec,
        ]
        self.run(name, argv)

    def installed_frameworks(self) -> list:
        out = subprocess.run(
            [
                self.python,
                "-c",
                f"import importlib.util as u; print([f for f in {FRAMEWORKS!r} if u.find_spec(f)])",
            ],
            env=self.env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return eval(out)  # a list literal printed by the line above


def check(backend: str, venv: Path, tests: str, jobs: int, phase: str = "all") -> None:
    """The steps of the module docstring in ``venv``: all of them (``phase="all"``), those up
    to the test suite's install (``"prepare"``: one core's work, pip and single scripts, which
    ``make test`` runs two at a time), or the test suite alone in a prepared ``venv``
    (``"tests"``)."""
    steps = Steps(backend, venv, ROOT / "build" / "installs" / backend)
    frameworks = steps.installed_frameworks()
    if frameworks != [backend]:
        raise SystemExit(
            f"{venv}: expected only {backend} installed, found {frameworks}; rebuild it (make {venv})"
        )
    if phase == "tests":
        run_tests(steps, tests, jobs)
        return
    work = Path(tempfile.mkdtemp(prefix=f"kss-install-{backend}-"))
    try:
        (work / "home").mkdir()
        (work / "quickstart.py").write_text(quick_start(), encoding="utf-8")
        env = steps.env(HOME=str(work / "home"))  # no KERAS_BACKEND, no keras.json: the README's own choice
        steps.probe("quickstart", [str(work / "quickstart.py")], cwd=work, env=env)
        files = sorted((work / "ckpts").glob("ckpt-*"))
        if not files:
            raise SystemExit(f"  {backend}: the quick start wrote no checkpoint into {work / 'ckpts'}")
        before = {f.name: f.stat().st_mtime_ns for f in files}
        again = steps.probe("quickstart-again", [str(work / "quickstart.py")], cwd=work, env=env)
        after = {f.name: f.stat().st_mtime_ns for f in sorted((work / "ckpts").glob("ckpt-*"))}
        if after != before or "Epoch " in again:
            raise SystemExit(
                f"  {backend}: running the quick start again trained or saved again (see its log)"
            )
        newest, oldest = str(files[-1]), str(files[0])
        cli = str(steps.venv / "bin" / "keras-stable-state")
        steps.probe("cli-ls", [cli, "ls", "ckpts"], cwd=work, env=env)
        steps.probe("cli-inspect", [cli, "inspect", newest], cwd=work, env=env)
        steps.probe("cli-verify", [cli, "verify", newest], cwd=work, env=env)
        # diff exits 1 when the states differ, as diff(1) does; these two do (other steps)
        diff = steps.probe("cli-diff", [cli, "diff", oldest, newest], cwd=work, env=env, ok=(1,))
        if "DIFFERENT" not in diff:
            raise SystemExit(f"  {backend}: keras-stable-state diff of two steps found no difference")
        steps.probe("cli-module", ["-m", "keras_stable_state", "ls", "ckpts"], cwd=work, env=env)
        steps.pip("install-demo", f"{wheel(steps.venv)}[{backend},demo]", "--no-compile")
        steps.probe("demo", [str(ROOT / "examples" / "resume_demo.py"), "--backend", backend], cwd=ROOT)
        if tests != "none":
            # --no-compile (as every install of make test): the modules are compiled when
            # imported, not all at install (about 10 s of this step)
            steps.pip(
                "install-tests", f"{wheel(steps.venv)}[{backend},{TEST_EXTRAS[backend]}]", "--no-compile"
            )
            if steps.installed_frameworks() != [backend]:
                raise SystemExit(f"  {backend}: the test extras installed another framework")
            if phase == "all":
                run_tests(steps, tests, jobs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_tests(steps: Steps, tests: str, jobs: int) -> None:
    """The backend's test suite (``tests``: ``"quick"`` or ``"all"``) in its prepared environment."""
    # -P: the checkout is not on sys.path, so the wheel's package is the one tested.
    argv = [steps.python, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=25"]
    argv += ["-m", "not slow"] if tests == "quick" else []
    argv += ["-n", str(jobs), "--dist", "loadfile", "--no-loadscope-reorder", "-rs", "tests"]
    # every test's duration, beside the log, for finding what the suite's time goes to
    argv += [f"--junitxml={steps.logs / f'tests-{tests}.xml'}"]
    env = steps.env(KERAS_BACKEND=steps.backend)
    site = ROOT / "build" / "site"
    if site.is_dir():
        env["KSS_DOCS_SITE"] = str(site)  # tests/docs/test_docs_api.py reads the site make docs built
    steps.run(f"tests-{tests}", argv, cwd=ROOT, env=env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, choices=FRAMEWORKS)
    parser.add_argument("--venv", required=True, type=Path, help="the environment built from the wheel")
    parser.add_argument(
        "--tests", choices=("none", "quick", "all"), default="none", help="also run the tests in it"
    )
    parser.add_argument("--jobs", type=int, default=2, help="pytest-xdist processes")
    parser.add_argument(
        "--phase",
        choices=("all", "prepare", "tests"),
        default="all",
        help="every step; those before the test suite (and its install); the test suite alone",
    )
    args = parser.parse_args(argv)
    if args.phase == "tests" and args.tests == "none":
        parser.error("--phase tests needs --tests quick or all")
    print(f"=== {args.backend} alone, from the wheel ({args.venv}): {args.phase} ===", flush=True)
    check(args.backend, args.venv, args.tests, args.jobs, args.phase)
    return 0


if __name__ == "__main__":
    sys.exit(main())
