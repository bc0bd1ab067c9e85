"""Two Torch ranks (``torch.distributed``, gloo on CPU) training a Keras model inside
``DistributedDataParallel`` with a custom loop and a ``DistributedSampler``, every rank
calling one ``CheckpointManager`` on a shared directory, with a Keras optimizer
(``StableOptimizer(Adam)``) and with ``torch.optim.Adam`` + ``StepLR`` (two tracks trained
in lockstep): the uninterrupted run, a run whose two ranks are SIGKILLed at a random step
inside an epoch and resumed by a new pair (equal to the uninterrupted run bit for bit on
every rank), a rank that skips the restore (refused at its next save on both ranks), a
``torch.optim`` optimizer left out of the saves (refused on both ranks, none left waiting),
and a SIGTERM to one rank (both save the same step).

The ranks run tests/scripts/multiprocess_torch.py; they are killed if they hang.
"""

import os
import random
import signal
import sys
import types

import numpy as np
import pytest
from conftest import BACKEND
from kit import TESTS, free_port, run_processes

pytestmark = [
    pytest.mark.skipif(
        BACKEND != "torch",
        reason="torch.distributed ranks: the Torch backend's (JAX: test_multiprocess_jax.py)",
    ),
    pytest.mark.slow,
]

SCRIPT = os.path.join(TESTS, "scripts", "multiprocess_torch.py")
TIMEOUT_S = 180  # per pair of ranks; the 2-core CI machine is shared
STEPS, STEPS_PER_EPOCH, SAVE_EVERY, PREEMPT_AT = 24, 6, 4, 5  # as in the script
KINDS = ("keras", "torch")
ARRAYS = {"keras": 14, "torch": 17}  # 4 model variables and 10 Adam variables; 12 Adam states and the lr


def _run_pair(phase, folder, *args, returncode=0):
    """Both ranks' outputs, once both ended with ``returncode`` (killed if they hang)."""
    port = str(free_port())
    argvs = [
        [sys.executable, SCRIPT, str(rank), port, phase, str(folder), *map(str, args)] for rank in range(2)
    ]
    results = run_processes(argvs, TIMEOUT_S)
    if results is None:
        pytest.fail(f"the {phase} ranks hung for {TIMEOUT_S} s and were killed")
    outputs = [out for _, out in results]
    procs = [types.SimpleNamespace(returncode=code) for code, _ in results]
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == returncode, f"rank {rank} ({phase}) ended with {p.returncode}:\n{out[-4000:]}"
        if returncode == -signal.SIGKILL:
            assert out.rstrip().endswith(f"rank {rank} killed"), out[-4000:]
        else:
            assert f"rank {rank} {phase} done" in out, out[-4000:]
    return outputs


def _lines(out, start):
    return [line for line in out.splitlines() if line.startswith(start)]


def _load(folder, name):
    with np.load(os.path.join(folder, f"{name}.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three pairs: ``full`` (uninterrupted, then the SIGTERM run), ``killed`` (at a random
    step inside an epoch, after a save) and ``resume`` (then rank 1 skipping the restore)."""
    folder = tmp_path_factory.mktemp("ranks")
    kill_at = random.choice([s for s in range(SAVE_EVERY + 1, STEPS) if s % STEPS_PER_EPOCH])
    full = _run_pair("full", folder)
    _run_pair("killed", folder, kill_at, returncode=-signal.SIGKILL)
    killed_steps = {kind: sorted(os.listdir(folder / f"run_{kind}")) for kind in KINDS}
    resume = _run_pair("resume", folder)
    return {
        "folder": folder,
        "kill_at": kill_at,
        "full": full,
        "resume": resume,
        "killed_steps": killed_steps,
    }


def test_every_rank_calls_the_manager_and_rank_0_writes(runs):
    # Both ranks opened a manager on one directory and saved every 4 steps (no
    # CheckpointInUseError), got the same paths, and the checkpoint records 2 ranks.
    for kind in KINDS:
        where = runs["folder"] / f"full_{kind}"
        expected = [str(where / f"ckpt-{s:010d}.h5") for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
        for rank, out in enumerate(runs["full"]):
            saved = [line.split(" ", 3)[3] for line in _lines(out, f"rank {rank} saved {where}")]
            assert saved == expected
            assert f"rank {rank} {kind} steps [20, 24] world_size 2" in out
        assert sorted(os.listdir(where)) == ["ckpt-0000000020.h5", "ckpt-0000000024.h5"]


def test_both_ranks_killed_inside_an_epoch_resume_exactly_on_every_rank(runs):
    folder, kill_at = runs["folder"], runs["kill_at"]
    last_save = (kill_at - 1) // SAVE_EVERY * SAVE_EVERY  # the save of kill_at is never made
    for kind in KINDS:
        assert f"ckpt-{last_save:010d}.h5" in runs["killed_steps"][kind], (kill_at, runs["killed_steps"])
        for rank, out in enumerate(runs["resume"]):
            assert f"rank {rank} restored {kind} {last_save}" in _lines(out, f"rank {rank} restored"), kill_at
            full, resumed = _load(folder, f"full_{kind}_{rank}"), _load(folder, f"resumed_{kind}_{rank}")
            assert len(full) == ARRAYS[kind] and sorted(resumed) == sorted(full)
            for key, value in full.items():
                where = f"{kind} rank {rank} {key}, killed at {kill_at}"
                np.testing.assert_array_equal(resumed[key], value, err_msg=where)
        ranks = [_load(folder, f"full_{kind}_{rank}") for rank in range(2)]
        for key in ranks[0]:
            np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=f"{kind} {key}")


def test_a_rank_that_skipped_the_restore_is_refused_at_its_next_save_on_every_rank(runs):
    # Rank 0 restored step 24 and saves step 28; rank 1 did not restore and saves step 4.
    for kind in KINDS:
        for rank, out in enumerate(runs["resume"]):
            (refused,) = _lines(out, f"rank {rank} refused {kind}: ")
            step = 28 if rank == 0 else 4
            assert f"run_{kind}').save({step}) on rank {rank}: the 2 ranks' training states differ" in refused
            assert (
                "rank 1 did not restore step 24 that rank 0 restored: call mgr.restore(model, ...)" in refused
            )
            assert "(rank 0: iterations 28; rank 1: iterations 4)" in refused
        # neither rank saved: the directory holds what the resumed run left
        assert sorted(os.listdir(runs["folder"] / f"run_{kind}")) == [
            "ckpt-0000000020.h5",
            "ckpt-0000000024.h5",
        ]


def test_a_torch_optimizer_left_out_of_the_save_is_refused_on_every_rank(runs):
    # Both ranks train with torch.optim.Adam + StepLR and save with the scheduler alone: each
    # rank refuses its save before rank 0 writes (none waits for the other), naming the
    # optimizer, the variables it trains and the fix.
    for rank, out in enumerate(runs["resume"]):
        (refused,) = _lines(out, f"rank {rank} refused unpassed: ")
        assert (
            "torch.optim optimizer(s) ['Adam'] stepped in this process and train variables of model"
            in refused
        )
        assert "'path:layers/dense/kernel'" in refused
        assert (
            "mgr.save(step, model, optimizer=opt)" in refused and "state={'scheduler': scheduler}" in refused
        )
        assert f"rank {rank} unpassed steps []" in out
    assert not [f for f in os.listdir(runs["folder"] / "unpassed_torch") if f.startswith("ckpt-")]


def test_sigterm_to_one_rank_saves_the_same_step_on_both(runs):
    where = runs["folder"] / "preempt_keras"
    for rank, out in enumerate(runs["full"]):
        assert f"rank {rank} preempted at {PREEMPT_AT} saved {where / 'ckpt-0000000005.h5'}" in out
        assert f"rank {rank} stopped at {PREEMPT_AT}" in out
    assert sorted(os.listdir(where)) == ["ckpt-0000000004.h5", "ckpt-0000000005.h5"]
