"""Resume-conformance matrix, fixed-seed sample, half 1 (issue 14; see tests/resume_matrix.py):
each drawn `model.fit` configuration is run uninterrupted and killed (SIGKILL) and resumed in
fresh processes; every model and optimizer variable (by position), the History and the
learning rates must equal the uninterrupted run's, unless the resume was refused or warned
at train begin naming the cause."""

import pytest
import resume_matrix as rm
from _matrix_sample import check, sample

CASES = sample(1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return rm.run_cases(CASES, root=str(tmp_path_factory.mktemp("matrix")))


@pytest.mark.parametrize("case", CASES, ids=[rm.case_id(c) for c in CASES])
def test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned(results, case):
    check(results, case)
