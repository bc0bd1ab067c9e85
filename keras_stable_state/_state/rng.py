"""The random state that decides the run: `rng_state` and `set_rng_state`.

NumPy's, Python's and Torch's global generators (data shuffling; Torch's wherever
``torch`` is loaded: the Torch backend, or a ``torch.utils.data.DataLoader`` input on
JAX or TensorFlow, whose ``RandomSampler`` and worker seeds draw from it) and Keras'
global seed generator; per-layer seed generators are model
variables and saved with them. A saved state is checked in full before anything
is set (`parse_rng_state`); a malformed one raises
[`CorruptCheckpointError`][keras_stable_state.CorruptCheckpointError] naming its record
(``"rng/python"``).
"""

from __future__ import annotations

import dataclasses
import random
import sys

import keras
import numpy as np

from keras_stable_state import _keras_compat
from keras_stable_state._numpy import numpy_copy
from keras_stable_state._state.tree import check_fields, is_array, is_int, is_number, malformed, show
from keras_stable_state.errors import listed

__all__ = ["rng_state", "ParsedRng", "parse_rng_state", "rng_snapshot", "apply_rng_state", "set_rng_state"]


def rng_state() -> dict:
    """NumPy's, Python's and Torch's (where ``torch`` is loaded, `torch_loaded`) global
    generator states and Keras' global seed generator."""

    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    gen = _keras_compat.global_seed_generator()
    out = {
        "numpy": {
            "name": name,
            "keys": np.asarray(keys),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "keras_global_seed": None if gen is None else numpy_copy(gen.state),
        "torch": None,
    }
    if torch_loaded():
        import torch  # a DataLoader's RandomSampler and base seed draw from torch's global generator

        out["torch"] = torch.get_rng_state().numpy()
    return out


def torch_loaded() -> bool:
    """Whether Torch's global generator is part of the random state: the Torch backend, or
    ``torch`` already imported (by the user: a ``DataLoader`` input on JAX or TensorFlow).
    Torch is never imported here otherwise: a JAX- or TensorFlow-only install has none."""
    return keras.backend.backend() == "torch" or "torch" in sys.modules


@dataclasses.dataclass(frozen=True)
class ParsedRng:
    """A saved random state, checked and converted into what the generators take.

    Attributes:
        numpy: The tuple for ``np.random.set_state``.
        python: The tuple for ``random.setstate``.
        keras_global_seed: Keras' global seed generator state in this backend's
            seed dtype, or ``None``: the saving process had no global seed generator
            (`apply_rng_state` then removes this process's).
        torch: ``uint8`` array for ``torch.set_rng_state``, or ``None`` (none saved, or
            ``torch`` not loaded in this process: nothing here draws from it).
    """

    numpy: tuple
    python: tuple
    keras_global_seed: np.ndarray | None
    torch: np.ndarray | None


def _seed_dtype():
    gen = _keras_compat.global_seed_generator()
    return keras.backend.standardize_dtype(
        gen.state.dtype if gen is not None else _keras_compat.random_seed_dtype()
    )


def _seed_array(value, record, where):
    """Keras' global seed state as this backend's seed dtype; seeds are uint32 values
    that int32 backends keep as the same bits (Keras' ``draw_seed``)."""
    if not is_array(value) or np.asarray(value).dtype.kind not in "iu" or np.shape(value) != (2,):
        raise malformed(record, f"expected an integer array of shape (2,), found {show(value)}", where)
    dtype = _seed_dtype()
    out = []
    for v in np.asarray(value).tolist():
        if dtype == "uint32" and -(2**31) <= v < 0:
            v &= 0xFFFFFFFF
        elif dtype == "int32" and 2**31 <= v < 2**32:
            v -= 2**32
        info = np.iinfo(dtype)
        if not info.min <= v <= info.max:
            raise malformed(record, f"value {v} does not fit this backend's {dtype} seed", where)
        out.append(v)
    return np.asarray(out, dtype=dtype)


def parse_rng_state(state, where: str | None = None) -> ParsedRng:
    """Check a state from `rng_state` in full and convert it, setting nothing.

    Each part is tried on a scratch generator (NumPy, Python, Torch), so what
    passes here is what the global generators take.

    Args:
        state: The saved random state (arrays joined back).
        where: The file, for messages.

    Returns:
        A `ParsedRng` for `apply_rng_state`.

    Raises:
        CorruptCheckpointError: naming the record (``"rng/numpy"``,
            ``"rng/python"``, ``"rng/keras_global_seed"``, ``"rng/torch"``).
    """
    if not isinstance(state, dict):
        raise malformed("rng", f"expected an object, found {show(state)}", where)
    missing = sorted({"numpy", "python"} - set(state))
    unknown = sorted(set(state) - {"numpy", "python", "keras_global_seed", "torch"}, key=str)
    if missing or unknown:
        raise malformed("rng", f"missing fields {listed(missing)}, unknown fields {listed(unknown)}", where)

    n = check_fields(
        state["numpy"],
        "rng/numpy",
        where,
        {
            "name": (lambda v: v == "MT19937", "'MT19937'"),
            "keys": (
                lambda v: (
                    is_array(v)
                    and np.shape(v) == (624,)
                    and np.asarray(v).dtype.kind in "iu"
                    and bool(np.all((np.asarray(v) >= 0) & (np.asarray(v) <= 0xFFFFFFFF)))
                ),
                "an array of 624 uint32 values",
            ),
            "pos": (lambda v: is_int(v) and 0 <= v <= 624, "an integer in [0, 624]"),
            "has_gauss": (lambda v: is_int(v) and v in (0, 1), "0 or 1"),
            "cached": (is_number, "a number"),
        },
    )
    numpy_state = (
        "MT19937",
        np.asarray(n["keys"]).astype(np.uint32),
        int(n["pos"]),
        int(n["has_gauss"]),
        float(n["cached"]),
    )
    try:
        np.random.RandomState().set_state(numpy_state)
    except (ValueError, TypeError) as err:
        raise malformed("rng/numpy", f"NumPy refuses it ({err})", where) from err

    p = check_fields(
        state["python"],
        "rng/python",
        where,
        {
            "version": (lambda v: is_int(v) and v == 3, "3 (the version random.getstate() gives)"),
            "internal": (
                lambda v: (
                    isinstance(v, list)
                    and len(v) == 625
                    and all(is_int(x) and 0 <= x <= 0xFFFFFFFF for x in v)
                    and 0 <= v[-1] <= 624
                ),
                "625 integers (624 uint32 words and a position in [0, 624])",
            ),
            "gauss": (lambda v: v is None or isinstance(v, float), "a float or null"),
        },
    )
    python_state = (int(p["version"]), tuple(int(x) for x in p["internal"]), p["gauss"])
    try:
        random.Random().setstate(python_state)
    except (ValueError, TypeError, OverflowError) as err:
        raise malformed("rng/python", f"Python's random refuses it ({err})", where) from err

    seed = state.get("keras_global_seed")
    seed = None if seed is None else _seed_array(seed, "rng/keras_global_seed", where)

    torch_state = state.get("torch")
    if torch_state is not None:
        if (
            not is_array(torch_state)
            or np.asarray(torch_state).dtype != np.uint8
            or np.ndim(torch_state) != 1
        ):
            raise malformed("rng/torch", f"expected a 1-D uint8 array, found {show(torch_state)}", where)
        torch_state = np.array(torch_state, copy=True)
        if torch_loaded():
            import torch

            try:
                torch.Generator().set_state(torch.from_numpy(torch_state.copy()))
            except (RuntimeError, ValueError, TypeError) as err:
                raise malformed("rng/torch", f"Torch refuses it ({err})", where) from err
        else:
            torch_state = None
    return ParsedRng(numpy=numpy_state, python=python_state, keras_global_seed=seed, torch=torch_state)


def rng_snapshot():
    """A callable that puts every global random state back as it is now."""

    numpy_state, python_state = np.random.get_state(), random.getstate()
    gen = _keras_compat.global_seed_generator()
    gen_value = None if gen is None else numpy_copy(gen.state)
    torch_state = None
    if torch_loaded():
        import torch

        torch_state = torch.get_rng_state().clone()

    def put_back():
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        _keras_compat.set_global_seed_generator(gen)
        if gen is not None:
            gen.state.assign(gen_value)
        if torch_state is not None:
            import torch

            torch.set_rng_state(torch_state)

    return put_back


def apply_rng_state(parsed: ParsedRng) -> None:
    """Set the global generators from a `ParsedRng` (Keras' global seed
    generator removed where the saving process had none); if one refuses, put back
    every one already set and re-raise."""
    put_back = rng_snapshot()
    try:
        # Keras' global seed generator draws its seed from Python's generator when it is
        # created: create (and set) it before Python's state is put back. None was saved
        # when the saving process had none: this process's is dropped, so the next unseeded
        # draw makes one from the restored Python state, as it would have after the save.
        if parsed.keras_global_seed is None:
            _keras_compat.set_global_seed_generator(None)
        else:
            _keras_compat.make_global_seed_generator().state.assign(parsed.keras_global_seed)
        np.random.set_state(parsed.numpy)
        random.setstate(parsed.python)
        if parsed.torch is not None:
            import torch

            torch.set_rng_state(torch.from_numpy(parsed.torch.copy()))
    except BaseException:
        put_back()
        raise


def set_rng_state(state: dict, where: str | None = None) -> None:
    """Put back the states from `rng_state`: all of them, or (for a malformed
    record, or a generator that refuses) none.

    Raises:
        CorruptCheckpointError: naming the malformed record (see `parse_rng_state`).
    """
    apply_rng_state(parse_rng_state(state, where))
