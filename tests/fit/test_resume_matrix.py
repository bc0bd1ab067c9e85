"""Resume-conformance matrix, fixed-seed sample (issue 14; see tests/resume_matrix.py):
each drawn `model.fit` configuration is run uninterrupted and killed (SIGKILL) and resumed in
fresh processes; every model and optimizer variable (by position), the History and the
learning rates must equal the uninterrupted run's, unless the resume was refused or warned
at train begin naming the cause."""

import hashlib
import json
import os

import matrix
import matrix_causes as mc
import matrix_inputs as mi
import numpy as np
import pytest
import resume_matrix as rm
from _matrix_sample import sample_tests

results, test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned = sample_tests()


def test_cases_replay_from_seed_and_index_and_fit_the_backend():
    drawn = [rm.draw_case(3, i, rm.BACKENDS[i % 3]) for i in range(200)]
    assert drawn == [rm.draw_case(3, i, rm.BACKENDS[i % 3]) for i in range(200)]
    assert len({rm.describe(c) for c in drawn}) > 150
    for c in drawn:
        if c["backend"] == "torch" or c.get("resume_backend") == "torch":
            assert c["steps_per_execution"] == 1 and c["jit_compile"] is not True, c
        ends = set(rm.execution_ends(c))
        for scen in c["scenarios"]:
            assert set(scen["steps"]) <= ends and scen["steps"] == sorted(set(scen["steps"])), c


def test_plan_puts_each_resume_first_in_its_process_and_each_kill_last(tmp_path):
    cases = [rm.draw_case(5, i, "jax") for i in range(30)]
    procs = rm.plan_processes(cases, str(tmp_path))
    seen = set()
    for _, phases in procs:
        assert all(ph["kind"] != "resume" for ph in phases[1:]), phases
        assert all(ph.get("kill_at") is None for ph in phases[:-1]), phases
        seen |= {(ph["case"], ph["name"]) for ph in phases}
    expected = sum(2 + sum(len(s["steps"]) + 1 for s in c["scenarios"]) for c in cases)  # ref, plain
    assert len(seen) == expected


# Digests of draw_case(3, i, backend) before issue 33's input kinds: a case that keeps one of
# the earlier kinds is drawn field for field as before (the new kinds come from a second stream).
_EARLIER = {
    ("tensorflow", 1): "5310447fa7cb",
    ("tensorflow", 14): "1e00b830c882",
    ("tensorflow", 22): "6032fcaa7020",
    ("tensorflow", 34): "b70f2450ed96",
    ("jax", 3): "9d9a806ff57a",
    ("jax", 12): "240ea8967b83",
    ("jax", 18): "3579dfaeaee7",
    ("jax", 32): "a44af6661f87",
    ("torch", 1): "0ac1f476217c",
    ("torch", 12): "345aade963de",
    ("torch", 18): "3d6a7a81d3b2",
    ("torch", 31): "a0a43484d1fc",
    ("torch", 39): "f40c49a56a10",
}


def _digest(c):
    return hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:12]


def test_earlier_input_kinds_are_drawn_as_before_and_every_kind_fit_accepts_is_drawn():
    for (backend, i), digest in _EARLIER.items():
        c = rm.draw_case(3, i, backend)
        assert c["input"] in rm.INPUTS and _digest(c) == digest, (backend, i, c)
    drawn = [rm.draw_case(5, i, b) for b in rm.BACKENDS for i in range(600)]
    assert {mi.family(c["input"]) for c in drawn} == {label for _, label in mi.FAMILIES}
    assert set(rm.ALL_INPUTS) == {c["input"] for c in drawn}
    old = [c["input"] for c in drawn if c["input"] in rm.INPUTS]
    new = len(drawn) - len(old)
    share = sum(mi.NEW_INPUTS.values()) / (sum(rm.INPUT_WEIGHTS) + sum(mi.NEW_INPUTS.values()))
    assert abs(new / len(drawn) - share) < 0.05, (new, len(drawn), share)
    for c in drawn:  # a loader's or grain's options drawn, the kill points inside its epochs
        if mi.is_loader(c["input"]):
            assert c["loader_workers"] in (0, 1, 2) and isinstance(c["drop_last"], bool), c
        for scen in c["scenarios"]:
            assert set(scen["steps"]) <= set(rm.execution_ends(c)), c


def test_a_case_needing_a_package_not_installed_is_skipped_and_counted(tmp_path, monkeypatch):
    c = next(rm.draw_case(5, i, "jax") for i in range(200) if mi.is_grain(rm.draw_case(5, i, "jax")["input"]))
    monkeypatch.setattr(rm, "frameworks_missing", lambda case: ["grain"])
    results = rm.run_cases([c], root=str(tmp_path))
    assert [r["outcome"] for r in results[rm.case_id(c)]] == ["SKIPPED"] * len(c["scenarios"])
    assert results[rm.case_id(c)][0]["problems"] == ["needs grain, not installed"]
    assert os.listdir(tmp_path) == []  # nothing run


def test_causes_are_named_in_full_with_their_acceptance():
    cb = mc.classify_cause(
        "InexactResumeWarning: StableCheckpoint: the callback EveryOtherEpoch of this fit has no "
        "get_state()/set_state(), so any state it keeps in its attributes is not saved."
    )
    assert cb == (
        "InexactResumeWarning: user callback without get_state()/set_state(): EveryOtherEpoch",
        "callback",
    )
    keras_cb = mc.classify_cause(
        "InexactResumeWarning: StableCheckpoint: the callback EarlyStopping of this fit keeps state "
        "(best, wait) that is not saved, because it is not given in StableCheckpoint(callbacks=...)"
    )
    assert keras_cb == (
        "InexactResumeWarning: Keras stateful callback not given in StableCheckpoint(callbacks=...): "
        "EarlyStopping (best, wait)",
        None,
    )
    data = mc.classify_cause(
        "StateError: The checkpoint was saved after batch 1 of epoch 0 with other data than this fit's "
        "(batch_size saved 8, now 16, steps saved 4, now 2): skipping 1 batches"
    )
    assert data == ("StateError: mid-epoch checkpoint with other data (batch_size, steps)", "data")
    order = mc.classify_cause(
        "InexactResumeWarning: StableCheckpoint: the checkpoint's shuffled NumPy input was ordered by "
        "jax's fit (its own generator) and training resumes on torch, whose fit draws"
    )
    assert order == (
        "InexactResumeWarning: shuffled NumPy order of jax's fit continued on torch (later epochs "
        "drawn by torch)",
        "input",
    )
    unknown = mc.classify_cause("InexactResumeWarning: StableCheckpoint: a new cause: it says why. Fix it.")
    assert unknown == ("InexactResumeWarning (unclassified): a new cause: it says why.", None)


def test_the_docs_first_line_counts_each_category_and_the_invariance_failures():
    case = rm.draw_case(5, 0, "jax", scenarios=2)
    res = [
        dict(
            outcome="EXACT", causes=[], problems=[], invariance="DIFFERENT", invariance_problems=["History"]
        ),
        dict(
            outcome="WARNED",
            causes=[
                "InexactResumeWarning: StableCheckpoint: the callback X of this fit has no get_state()/set_state()"
            ],
            problems=[],
            invariance="DIFFERENT",
            invariance_problems=["History"],
        ),
    ]
    for r in res:
        r.update(kill_kind="any", kills=[1])
    data = {"seed": [5], "cases": {rm.case_id(case): case}, "results": {rm.case_id(case): res}}
    line = matrix.render(data).splitlines()[0]
    assert line.startswith(
        "Seeds 5, 1 cases. **jax**: 2 kill scenarios (1 cases): 1 exact, 1 warned, 0 refused"
    ), line
    assert "invariance failures 1 and errors 0 of 1 cases; exact 100.0% (1 of 1)" in line, line


def _phase_files(workdir, name, weight):
    """A completed phase's record and arrays as matrix_child writes them: one weight."""
    record = {"status": "completed", "history": {"loss": [1.0]}, "epoch": [0], "lr": {}}
    record["names"] = {"w": ["dense/kernel"], "o": []}
    with open(workdir / f"{name}.json", "w") as f:
        json.dump(record, f)
    np.savez(workdir / f"{name}.npz", **{"w:0": np.array([weight], "float32")})


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kind", "backend", "expected"),
    [
        ("tfdata_py_function", "torch", "UNREPEATABLE"),
        ("tfdata_py_function", "jax", "UNREPEATABLE"),
        ("tfdata_py_function", "tensorflow", "DIFFERENT"),
        ("tfdata_random_map", "torch", "DIFFERENT"),
        ("numpy", "jax", "DIFFERENT"),
    ],
)
def test_a_difference_without_the_library_is_unrepeatable_only_for_the_inputs_named(
    tmp_path, kind, backend, expected
):
    """Seed 26, torch case 9: a py_function drawing from NumPy's global generator made the
    plain fit (no library) differ from the reference under load, and from itself when run
    alone on one busy core. Only the (input, backend) pairs `UNREPEATABLE_INPUTS` names are
    told apart, with the why first; every other difference stays an invariance failure, and
    equal runs are SAME whatever the input."""
    case = dict(rm.draw_case(26, 9, "torch"), input=kind, backend=backend)
    _phase_files(tmp_path, "ref", 1.0)
    _phase_files(tmp_path, "plain", 1.5)
    outcome, problems = rm.invariance(tmp_path, case)
    assert outcome == expected, problems
    assert problems[-1] == "model.weights[0] (dense/kernel): max |diff| 0.5", problems
    if expected == "UNREPEATABLE":
        assert problems[0] == rm.UNREPEATABLE_INPUTS[(kind, backend)] and backend in problems[0]
    _phase_files(tmp_path, "plain", 1.0)
    assert rm.invariance(tmp_path, case) == ("SAME", [])


def _failed_phase(workdir, name, message):
    record = {
        "status": "error",
        "error": {"type": "RuntimeError", "message": message, "refused_at_begin": False},
    }
    record["error"]["traceback"] = ""
    with open(workdir / f"{name}.json", "w") as f:
        json.dump(record, f)


_WORKER_DIED = (
    "DataLoader worker (pid 19972) exited unexpectedly with exit code 1. Details are lost due to "
    "multiprocessing. Rerunning with num_workers=0 may give better error trace."
)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("backend", "workers", "message", "expected"),
    [
        ("tensorflow", 1, _WORKER_DIED, "SKIPPED"),
        ("tensorflow", 0, _WORKER_DIED, "HARNESS_ERROR"),
        ("jax", 2, _WORKER_DIED, "HARNESS_ERROR"),
        ("tensorflow", 1, "some other error", "HARNESS_ERROR"),
    ],
)
def test_a_failure_of_stock_keras_itself_is_skipped_not_a_harness_error(
    tmp_path, backend, workers, message, expected
):
    """Seed 27, tensorflow case 17: a DataLoader worker died in the killed run, as it does in
    tf.data's generator thread on TensorFlow without the library. Only that error, on that
    backend with workers, is SKIPPED (named; never counted as passed); the plain run meeting
    it makes the invariance UNREPEATABLE, not an error."""
    case = dict(
        rm.draw_case(27, 17, "tensorflow"),
        backend=backend,
        loader_workers=workers,
        input="torch_loader_shuffle",
    )
    case.pop("resume_backend", None)
    case["scenarios"] = [{"kind": "any", "steps": [3]}]
    _phase_files(tmp_path, "ref", 1.0)
    _failed_phase(tmp_path, "plain", message)
    _failed_phase(tmp_path, "s0.fresh", message)
    _phase_files(tmp_path, "s0.resume", 1.0)
    (result,) = rm.classify(case, str(tmp_path))
    assert result["outcome"] == expected, result
    if expected == "SKIPPED":
        assert result["problems"] == [rm.STOCK_FAILURES[0][0]]
        assert (
            result["invariance"] == "UNREPEATABLE"
            and result["invariance_problems"][0] == rm.STOCK_FAILURES[0][0]
        )
    else:
        assert result["invariance"] == "ERROR", result
