"""Resume-conformance matrix, fixed-seed sample, half 0 (issue 14; see tests/resume_matrix.py):
each drawn `model.fit` configuration is run uninterrupted and killed (SIGKILL) and resumed in
fresh processes; every model and optimizer variable (by position), the History and the
learning rates must equal the uninterrupted run's, unless the resume was refused or warned
at train begin naming the cause."""

import resume_matrix as rm
from _matrix_sample import half_tests

results, test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned = half_tests(0)


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
    expected = sum(1 + sum(len(s["steps"]) + 1 for s in c["scenarios"]) for c in cases)
    assert len(seen) == expected
