"""Resume-conformance matrix, fixed-seed sample, half 1 (issue 14; see tests/resume_matrix.py):
each drawn `model.fit` configuration is run uninterrupted and killed (SIGKILL) and resumed in
fresh processes; every model and optimizer variable (by position), the History and the
learning rates must equal the uninterrupted run's, unless the resume was refused or warned
at train begin naming the cause."""

from _matrix_sample import half_tests

results, test_resumed_fit_equals_uninterrupted_or_is_refused_or_warned = half_tests(1)
