"""The fixed-seed sample of the resume-conformance matrix that ``make test`` runs
(tests/fit/test_resume_matrix.py): one case per backend, enough to keep the harness and the
matrix's checks running on every backend; ``make matrix`` runs hundreds."""

import keras
import pytest
import resume_matrix as rm
from kit import frameworks_selected

BACKEND = keras.backend.backend()
SEED = 14
CASES = 1  # per backend (each one takes 10-30 CPU-s of child processes; make matrix runs hundreds)


def sample():
    """The cases: one kill scenario each (a few are two kills in one epoch); the reference and
    killed runs chain through shared child processes."""
    return [rm.draw_case(SEED, i, BACKEND, scenarios=1) for i in range(CASES)]


def check(results, case):
    rs = results[rm.case_id(case)]
    for r in rs:
        print(f"{rm.case_id(case)} scenario {r['scenario']} kills {r['kills']}: {r['outcome']}")
        for cause in r["causes"]:
            print(f"  cause: {cause[:300]}")
    bad = [r for r in rs if r["outcome"] in ("SILENT", "CRASH", "HARNESS_ERROR")]
    lines = [f"{r['outcome']} (kills {r['kills']}): " + "; ".join(r["problems"][:6]) for r in bad]
    if rs and rs[0]["invariance"] in ("DIFFERENT", "ERROR"):  # the checkpoint changed the run
        lines.append(
            f"invariance {rs[0]['invariance']}: the uninterrupted fit with StableCheckpoint vs the same "
            "fit without the library: " + "; ".join(rs[0]["invariance_problems"][:6])
        )
    if lines:
        pytest.fail(
            f"resume matrix seed {SEED} case {case['index']} on {BACKEND} ({rm.describe(case)}):\n"
            + "\n".join(lines)
            + f"\nreplay: python tests/matrix.py --seed {SEED} --replay {BACKEND}:{case['index']}",
            pytrace=False,
        )
    for r in rs:
        if r["outcome"] in ("WARNED", "REFUSED"):
            assert any(c.strip() for c in r["causes"]), r  # a warning or refusal names its cause


def sample_tests():
    """The module fixture and the parametrized test, for the test file's namespace:
    ``results, test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned = sample_tests()``."""
    cases = sample()
    # A case on tf.data or resumed on another backend needs that framework too; the fixture
    # runs the cases this pass selects (the others are skipped with the reason, or deselected).
    runnable = [c for c in cases if frameworks_selected(rm.frameworks_needed(c))]

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        return rm.run_cases(runnable, root=str(tmp_path_factory.mktemp("matrix")))

    params = [pytest.param(c, marks=pytest.mark.frameworks(*rm.frameworks_needed(c))) for c in cases]

    @pytest.mark.slow
    @pytest.mark.parametrize("case", params, ids=[rm.case_id(c) for c in cases])
    def test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned(results, case):
        check(results, case)

    return results, test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned
