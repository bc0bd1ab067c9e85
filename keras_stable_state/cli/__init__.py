"""The ``keras-stable-state`` command line: ``inspect``, ``verify``, ``diff`` and ``ls``."""

from keras_stable_state.cli.app import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK, main, max_abs_difference

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "EXIT_OK", "main", "max_abs_difference"]
