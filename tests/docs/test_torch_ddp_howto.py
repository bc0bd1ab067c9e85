"""docs/how-to/torch-ddp.md, executed: examples/ddp_resume.py (the page includes it whole)
launched with ``python -m torch.distributed.run`` (``torchrun``), gloo on CPU, small sizes.

Two ranks train a Keras model inside ``DistributedDataParallel`` with ``torch.optim.Adam``,
a ``StepLR`` scheduler and ``kss.ResumableSampler(DistributedSampler(shuffle=True))``, every
rank calling one ``CheckpointManager``: the uninterrupted run; a run whose two ranks are
SIGKILLed at a random step inside an epoch (``--kill-at``: after that step's save, if any)
and relaunched to the end: every rank's weights, Adam state and learning rate equal the
uninterrupted run's bit for bit (``--dump``: each rank's arrays by position). The killed
run's checkpoint resumed on 1 process: with the same global batch (per-rank batch 8
instead of 4) the same samples in every step, the weights equal within float rounding;
with the per-rank batch kept (the global batch halved) an ``InexactResumeWarning`` naming
both world sizes and batches. A SIGTERM to ``torchrun`` reaches every rank: all save the same
step and stop (``preemption_guard``).
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import kit
import numpy as np
import pytest
from conftest import BACKEND

ROOT = Path(kit.ROOT)
EXAMPLE = ROOT / "examples" / "ddp_resume.py"
PAGE = ROOT / "docs" / "how-to" / "torch-ddp.md"
TIMEOUT_S = 150  # per launch; the 2-core CI machine is shared
SIZES = ["--samples", "64", "--epochs", "3", "--save-every", "5"]
BATCH, STEPS_PER_EPOCH, STEPS, SAVE_EVERY = 4, 8, 24, 5  # 64 samples / 2 ranks / batch 4

on_torch = pytest.mark.skipif(BACKEND != "torch", reason="torchrun ranks train on the Torch backend")


def _torchrun(processes, folder, *args, kill_at=None, sigterm_at=None):
    """The output of ``torchrun --nproc_per_node processes examples/ddp_resume.py ...`` run in
    ``folder``, once it ended as expected: killed at step ``kill_at``; preempted by a SIGTERM
    sent to ``torchrun`` once a line of its output starts with ``sigterm_at``; else done on
    every rank. Killed, with its workers, if it runs for more than TIMEOUT_S."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a rendezvous on a free port of localhost, bound by torchrun itself
        "--nproc_per_node",
        str(processes),
        str(EXAMPLE),
        *SIZES,
        *args,
    ]
    if kill_at is not None:
        command += ["--kill-at", str(kill_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "torch"}
    hung, lines, terminated = threading.Event(), [], False
    with subprocess.Popen(
        command,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # torchrun and its workers: one process group to kill
    ) as proc:

        def kill():
            hung.set()
            os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(TIMEOUT_S, kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if sigterm_at is not None and not terminated and line.startswith(sigterm_at):
                    proc.send_signal(signal.SIGTERM)  # torchrun's own: it passes it on to the workers
                    terminated = True
            proc.wait()
        finally:
            watchdog.cancel()
    out = "".join(lines)
    ended = f"killed at step {kill_at}" if kill_at is not None else "done at step"
    # torchrun exits with an error when a worker was killed or it received a signal
    expected_error = kill_at is not None or sigterm_at is not None
    if (
        hung.is_set()
        or terminated != (sigterm_at is not None)
        or (proc.returncode != 0) != expected_error
        or any(f"rank {rank}: {ended}" not in out for rank in range(processes))
    ):
        hang = f"hung for {TIMEOUT_S} s and was killed, " if hung.is_set() else ""
        pytest.fail(
            f"torchrun {' '.join(args)}: {hang}exit code {proc.returncode}, expected '{ended}':\n{out[-6000:]}"
        )
    return out


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    kill_at = random.choice([s for s in range(SAVE_EVERY + 1, STEPS) if s % STEPS_PER_EPOCH])
    batch = ["--batch-size", str(BATCH)]
    out = {"folder": folder, "kill_at": kill_at}
    out["full"] = _torchrun(2, folder, "--dir", "full", *batch, "--dump", "full")
    _torchrun(2, folder, "--dir", "run", *batch, kill_at=kill_at)
    out["killed_steps"] = sorted(os.listdir(folder / "run"))
    for copy in ("one_same", "one_other"):
        shutil.copytree(folder / "run", folder / copy)
    out["resume"] = _torchrun(2, folder, "--dir", "run", *batch, "--dump", "resumed")
    out["one_same"] = _torchrun(
        1, folder, "--dir", "one_same", "--batch-size", str(2 * BATCH), "--dump", "same"
    )
    out["one_other"] = _torchrun(1, folder, "--dir", "one_other", *batch)
    # a long run; SIGTERM to torchrun once rank 0 has ended epoch 0 (inside the guard)
    out["preempted"] = _torchrun(
        2, folder, "--dir", "preempt", *batch, "--epochs", "1000", sigterm_at="epoch 0:"
    )
    return out


@on_torch
@pytest.mark.slow
def test_killed_inside_an_epoch_and_relaunched_equals_the_uninterrupted_run_on_every_rank(runs):
    folder, kill_at = runs["folder"], runs["kill_at"]
    last_save = kill_at // SAVE_EVERY * SAVE_EVERY  # --kill-at kills after the step's save
    assert runs["killed_steps"][-1] == f"ckpt-{last_save:010d}.h5", (kill_at, runs["killed_steps"])
    assert f"from step {last_save} (epoch {last_save // STEPS_PER_EPOCH})" in runs["resume"], kill_at
    ranks = []
    for rank in range(2):
        assert f"rank {rank}/2: from step 0 (epoch 0)" in runs["full"]
        full, resumed = _load(folder / f"full-rank{rank}.npz"), _load(folder / f"resumed-rank{rank}.npz")
        assert len(full) == 17 and sorted(resumed) == sorted(full)  # 4 weights, 4 x 3 Adam, lr
        assert full["lr"].tolist() == [0.01]  # StepLR(step_size=30) has not stepped the rate yet
        for key, value in full.items():
            np.testing.assert_array_equal(
                resumed[key], value, err_msg=f"rank {rank} {key}, killed at {kill_at}"
            )
        ranks.append(full)
    for key in ranks[0]:  # DDP keeps the ranks equal
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert sorted(os.listdir(folder / "full")) == [f"ckpt-{s:010d}.h5" for s in (15, 20, 24)]
    assert "InexactResumeWarning" not in runs["resume"] + runs["full"]


@on_torch
@pytest.mark.slow
def test_one_process_with_the_same_global_batch_resumes_the_same_samples(runs):
    # 2 ranks x 4 -> 1 x 8: the same samples in every step; the gradients are averaged in
    # another order, so the weights agree to float rounding; the step counts and lr exactly.
    out, kill_at = runs["one_same"], runs["kill_at"]
    assert (
        "InexactResumeWarning" not in out
        and f"rank 0/1: from step {kill_at // SAVE_EVERY * SAVE_EVERY}" in out
    )
    assert "rank 0: done at step 24" in out
    full, one = _load(runs["folder"] / "full-rank0.npz"), _load(runs["folder"] / "same-rank0.npz")
    assert sorted(one) == sorted(full)
    for key, value in full.items():
        if key == "lr" or key.endswith("_step"):
            np.testing.assert_array_equal(one[key], value, err_msg=key)
        else:
            np.testing.assert_allclose(
                one[key], value, rtol=1e-5, atol=1e-6, err_msg=f"{key}, killed at {kill_at}"
            )


@on_torch
@pytest.mark.slow
def test_one_process_with_another_global_batch_is_warned_naming_both(runs):
    out = runs["one_other"]
    assert (
        "InexactResumeWarning: ResumableSampler: the checkpoint was saved by 2 processes with per-rank "
        in out
    )
    assert (
        "batch 4 (global batch 8)" in out
        and "this run has 1 process with per-rank batch 4 (global batch 4)" in out
    )
    assert "To resume exactly, keep the global batch: a per-rank batch of 8 on 1 process." in out


def test_the_page_includes_the_example_whole():
    """The page shows examples/ddp_resume.py through pymdownx.snippets (a missing file fails
    the strict docs build), so the code on the page is the code this module runs."""
    page = PAGE.read_text(encoding="utf-8")
    assert '--8<-- "examples/ddp_resume.py"' in page
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "pymdownx.snippets:" in config and "check_paths: true" in config
    assert "how-to/torch-ddp.md" in config


@on_torch
@pytest.mark.slow
def test_a_sigterm_to_torchrun_saves_the_same_step_on_every_rank(runs):
    out = runs["preempted"]
    (saved,) = {line.split()[-1] for line in out.splitlines() if ": preempted, saved step " in line}
    for rank in range(2):
        assert (
            f"rank {rank}: preempted, saved step {saved}" in out
            and f"rank {rank}: done at step {saved}" in out
        )
    assert int(saved) >= STEPS_PER_EPOCH
    assert sorted(os.listdir(runs["folder"] / "preempt"))[-1] == f"ckpt-{int(saved):010d}.h5"
