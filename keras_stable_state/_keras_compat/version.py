"""The supported Keras range; `keras_stable_state._keras_compat` checks it once, on import.

The supported range is pyproject's ``keras>=3.15,<4``. Importing the package
with a Keras outside it raises `UnsupportedKerasError` (an
``ImportError``): these internals decide which slot lands on which variable, and
a silent mismatch is exactly what this library exists to prevent.
"""

from __future__ import annotations

import re

from keras_stable_state.errors import UnsupportedKerasError

__all__ = ["SUPPORTED_KERAS", "UnsupportedKerasError", "check_keras_version"]


SUPPORTED_KERAS = ((3, 15), (4, 0))  # [lowest, first unsupported): pyproject's keras>=3.15,<4


def check_keras_version(version: str) -> None:
    """Refuse a Keras version outside `SUPPORTED_KERAS`.

    Raises:
        UnsupportedKerasError: naming the installed and the supported versions.
    """
    match = re.match(r"(\d+)\.(\d+)", str(version))
    (lo, hi) = SUPPORTED_KERAS
    if match is not None and lo <= (int(match.group(1)), int(match.group(2))) < hi:
        return
    raise UnsupportedKerasError(
        f"keras_stable_state supports Keras >={lo[0]}.{lo[1]},<{hi[0]}; installed: Keras {version}. It uses "
        "Keras internals (the saving walk, optimizer variable lists) that decide which saved slot lands on "
        f"which variable, and refuses to guess with another version. Install 'keras>={lo[0]}.{lo[1]},"
        f"<{hi[0]}'."
    )
