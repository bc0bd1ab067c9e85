"""``python -m keras_stable_state``: the ``keras-stable-state`` command line (see `keras_stable_state.cli`)."""

import sys

from keras_stable_state.cli import main

if __name__ == "__main__":
    sys.exit(main())
