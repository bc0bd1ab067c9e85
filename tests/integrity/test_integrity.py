"""Fuzz suite: damaged training-state files are restored exactly or refused cleanly.

Pristine files (``save_training_state`` to ``.h5`` and ``.keras``, and a
mid-epoch ``StableCheckpoint`` ``ckpt-*.h5``) are written on the current
backend, then damaged by random single-byte flips, truncations and HDF5
attribute / record edits (drawn by hypothesis with a fixed seed). For every
case exactly one of:

* restore returns and every model variable, optimizer variable, random
  state, callback state and provider state equals what was saved, bit for bit;
* a ``StateError`` subclass naming a key or the file is raised, and every one
  of those states equals its value before the call;

and ``keras-stable-state verify`` exits 0 exactly when restore returned, with
no traceback from ``verify`` or ``inspect``. Anything else is a failure: a raw
exception, a silent difference, a partial assignment, a crash or a hang.

The cases run in a worker process (``tests/_fuzz_worker.py``) so that a crash
of the interpreter is a failing case, not a dead test run: the worker is
restarted from the next case. ``make test`` runs a small budget; ``make fuzz``
the long campaign. Budget and seed come from the environment:

* ``KSS_FUZZ_FLIPS`` (default 40), ``KSS_FUZZ_TRUNCATIONS`` (6),
  ``KSS_FUZZ_EDITS`` (5, after one of each edit kind, also resealed): cases of each kind;
* ``KSS_FUZZ_SEED``: draw other cases (default: derandomized, the same every run);
* ``KSS_FUZZ_CASE_TIMEOUT`` (60): seconds before a case counts as a hang;
* ``KSS_FUZZ_INSPECT_EVERY`` (4): run ``inspect`` on every n-th case (``verify`` runs on all);
* ``KSS_FUZZ_REPORT``: a path to write every case result to (JSON lines).
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from kit import TESTS

WORKER = os.path.join(TESTS, "_fuzz_worker.py")
FLIPS = int(os.environ.get("KSS_FUZZ_FLIPS", "40"))
TRUNCATIONS = int(os.environ.get("KSS_FUZZ_TRUNCATIONS", "6"))
EDITS = int(os.environ.get("KSS_FUZZ_EDITS", "5"))
SEED = os.environ.get("KSS_FUZZ_SEED")
CASE_TIMEOUT = float(os.environ.get("KSS_FUZZ_CASE_TIMEOUT", "60"))
START_TIMEOUT = float(os.environ.get("KSS_FUZZ_START_TIMEOUT", "600"))
REPORT = os.environ.get("KSS_FUZZ_REPORT")
INSPECT_EVERY = max(1, int(os.environ.get("KSS_FUZZ_INSPECT_EVERY", "4")))
TARGETS = ("h5", "keras", "ckpt")
EDIT_KINDS = (
    "json_digit",
    "json_field",
    "attr_crc",
    "attr_dtype",
    "attr_key",
    "root_attr",
    "byteorder_bits",
    "byteorder_values",
    "retype_uint",
    "retype_float64",
    "reshape",
    "delete_dataset",
    "add_dataset",
)


class WorkerDied(Exception):
    pass


class Campaign:
    """Runs cases in a worker process, restarting it after a crash or hang."""

    def __init__(self, workdir, command=None, report=None):
        self.workdir = str(workdir)
        self.report = report
        self.command = command or [sys.executable, WORKER, "serve", self.workdir]
        self.proc = None
        self.buf = b""
        self.ready = None
        self.next_id = 0
        self.results = []
        self.starts = 0
        self.stderr_path = os.path.join(self.workdir, "worker-stderr.txt")
        if report:
            open(report, "w").close()

    # -- worker process ---------------------------------------------------------------------
    def _start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
        env.setdefault("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "jax"))
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            cwd=os.path.dirname(os.path.dirname(WORKER)),
        )
        self.buf = b""
        self.starts += 1
        tag, doc = self._read(START_TIMEOUT)
        if tag != "KSSFUZZ-READY":
            self.proc.kill()
            self.proc.wait()
            why = self._death()
            self._kill()
            raise WorkerDied(f"the fuzz worker did not start ({doc}): {why}")
        self.ready = doc

    def _read(self, timeout):
        """The next ``KSSFUZZ-*`` line as ``(tag, doc)``; ``(None, why)`` on death or timeout."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith("KSSFUZZ-"):
                    tag, _, body = text.partition(" ")
                    return tag, json.loads(body)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, "timeout"
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None, "eof"
                self.buf += chunk

    def _death(self):
        rc = self.proc.poll() if self.proc else None
        self.stderr.flush()
        with open(self.stderr_path, "rb") as fh:
            tail = fh.read()[-3000:].decode(errors="replace")
        return f"worker exit code {rc}; stderr tail:\n{tail}"

    def _kill(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                stream.close()
            except OSError:
                pass
        self.proc = None

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    # -- cases ------------------------------------------------------------------------------
    def run(self, timeout=CASE_TIMEOUT, **case):
        case["id"] = self.next_id
        self.next_id += 1
        # `inspect` (reads no arrays) on every INSPECT_EVERY-th case; `verify` on every case.
        case["inspect"] = case["id"] % INSPECT_EVERY == 0
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps(case) + "\n").encode())
            self.proc.stdin.flush()
            tag, doc = self._read(timeout)
        except (BrokenPipeError, OSError):
            tag, doc = None, "eof"
        if tag == "KSSFUZZ-RESULT":
            result = doc
        else:
            how = "crash"
            if doc == "timeout":
                how = f"hang (no result in {timeout:.0f} s)"
                self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            result = {
                "id": case["id"],
                "case": case,
                "verdict": "failure",
                "problems": [f"{how}: {self._death()}"],
            }
            self._kill()  # the next case starts a fresh worker
        self.results.append(result)
        if self.report:
            with open(self.report, "a") as fh:
                fh.write(json.dumps(result, default=str) + "\n")
        return result

    def summary(self, kind):
        rs = [r for r in self.results if r["case"]["kind"] == kind]
        verdicts = collections.Counter(r["verdict"] for r in rs)
        errors = collections.Counter(
            r["error"].split(":")[0] for r in rs if r.get("verdict") == "refused" and r.get("error")
        )
        targets = collections.Counter(r["case"]["target"] for r in rs if r["verdict"] != "skipped")
        backend = (self.ready or {}).get("backend", os.environ.get("KERAS_BACKEND"))
        return (
            f"fuzz [{backend}] {kind}: {len(rs) - verdicts['skipped']} cases ({dict(targets)}), "
            f"refused {verdicts['refused']} {dict(errors)}, restored exactly {verdicts['exact']}, "
            f"failures {verdicts['failure']}, not applicable {verdicts['skipped']}, worker starts {self.starts}"
        )

    def check(self, kind):
        failures = [r for r in self.results if r["case"]["kind"] == kind and r["verdict"] == "failure"]
        if not failures:
            return
        lines = [self.summary(kind), f"{len(failures)} failing case(s):"]
        for r in failures[:40]:
            case = {k: v for k, v in r["case"].items() if k != "id"}
            lines.append(f"- case {r['id']} {json.dumps(case)}: {r.get('detail', '')}")
            for p in r.get("problems", []):
                lines.append(f"    {p[:2500]}")
            if r.get("traceback") and any("raw exception" in p for p in r.get("problems", [])):
                lines.append("    " + r["traceback"][-2500:].replace("\n", "\n    "))
        if len(failures) > 40:
            lines.append(f"... and {len(failures) - 40} more (set KSS_FUZZ_REPORT=path for all)")
        pytest.fail("\n".join(lines), pytrace=False)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, request):
    c = Campaign(tmp_path_factory.mktemp("fuzz"), report=REPORT)
    yield c
    c.close()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        for kind in ("pristine", "flip", "truncate", "edit"):
            if any(r["case"]["kind"] == kind for r in c.results):
                reporter.write_line(c.summary(kind))


def _settings(n):
    def wrap(fn):
        fn = settings(
            max_examples=max(1, n),
            derandomize=SEED is None,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(fn)
        if SEED is not None:
            fn = hypothesis_seed(int(SEED))(fn)
        return fn

    return wrap


def _sizes(campaign):
    if campaign.ready is None:
        campaign._start()
    return campaign.ready["sizes"]


_FAKE_WORKER = r"""
import json, os, sys, time
print("KSSFUZZ-READY " + json.dumps({"backend": "fake", "sizes": {}, "problems": []}), flush=True)
for line in sys.stdin:
    case = json.loads(line)
    if case["kind"] == "crash":
        os.abort()
    if case["kind"] == "hang":
        time.sleep(3600)
    result = {"id": case["id"], "case": case, "verdict": "exact", "problems": []}
    print("KSSFUZZ-RESULT " + json.dumps(result), flush=True)
"""


def test_a_crash_or_hang_is_a_failing_case_not_a_dead_run(tmp_path):
    """The harness itself: a worker killed by a signal or stuck in a case gives a failing
    case, and the next case runs in a fresh worker."""
    c = Campaign(tmp_path, command=[sys.executable, "-c", _FAKE_WORKER])
    try:
        assert c.run(kind="ok")["verdict"] == "exact"
        crashed = c.run(kind="crash")
        assert crashed["verdict"] == "failure" and "crash" in crashed["problems"][0]
        assert "exit code -6" in crashed["problems"][0]  # SIGABRT
        assert c.run(kind="ok")["verdict"] == "exact"
        hung = c.run(kind="hang", timeout=2)
        assert hung["verdict"] == "failure" and "hang" in hung["problems"][0]
        assert c.run(kind="ok")["verdict"] == "exact"
        assert c.starts == 3
    finally:
        c.close()


@pytest.mark.slow
def test_pristine_files_restore_exactly(campaign):
    for target in TARGETS:
        campaign.run(target=target, kind="pristine")
    assert campaign.ready["problems"] == [], "\n".join(campaign.ready["problems"])
    bad = [r for r in campaign.results if r["case"]["kind"] == "pristine" and r["verdict"] != "exact"]
    assert not bad, json.dumps(bad, indent=1, default=str)[:6000]


@pytest.mark.slow
def test_byte_flips(campaign):
    sizes = _sizes(campaign)

    @_settings(FLIPS)
    @given(st.data())
    def flip(data):
        target = data.draw(st.sampled_from(TARGETS), label="target")
        offset = data.draw(st.integers(0, sizes[target] - 1), label="offset")
        mask = data.draw(st.integers(1, 255), label="mask")
        campaign.run(target=target, kind="flip", offset=offset, mask=mask)

    flip()
    campaign.check("flip")


@pytest.mark.slow
def test_truncations(campaign):
    sizes = _sizes(campaign)

    @_settings(TRUNCATIONS)
    @given(st.data())
    def truncate(data):
        target = data.draw(st.sampled_from(TARGETS), label="target")
        length = data.draw(st.integers(0, sizes[target] - 1), label="length")
        campaign.run(target=target, kind="truncate", length=length)

    truncate()
    campaign.check("truncate")


@pytest.mark.slow
def test_record_and_attribute_edits(campaign):
    _sizes(campaign)
    resign = [False, True] if campaign.ready.get("signer") else [False]
    # Every edit kind at least once (targets in turn), resealed too, then random ones.
    for i, edit in enumerate(EDIT_KINDS):
        for j, r in enumerate(resign):
            target = TARGETS[(i + j) % len(TARGETS)]
            campaign.run(target=target, kind="edit", edit=edit, pick=i, pick2=7, resign=r, allow_cast=False)

    @_settings(EDITS)
    @given(st.data())
    def edit(data):
        campaign.run(
            target=data.draw(st.sampled_from(TARGETS), label="target"),
            kind="edit",
            edit=data.draw(st.sampled_from(EDIT_KINDS), label="edit"),
            pick=data.draw(st.integers(0, 10**6), label="pick"),
            pick2=data.draw(st.integers(0, 10**6), label="pick2"),
            resign=data.draw(st.sampled_from(resign), label="resign"),
            allow_cast=data.draw(st.booleans(), label="allow_cast"),
        )

    edit()
    campaign.check("edit")
