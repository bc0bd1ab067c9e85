"""Messages with bounds, and files from a newer keras_stable_state.

A key of a megabyte, or 300,000 extra index rows, give a message that names at most a
few keys, each shortened, with the count of the others (``errors.listed`` /
``errors.shown``), and ``inspect`` prints a short line for the key. A file written by a
newer keras_stable_state (a later format version, in its seal or its root attribute, or
records this version does not know under an intact seal) is refused with
:class:`~keras_stable_state.NewerFormatError`, not as damage: ``StableCheckpoint`` leaves
it where it is and does not fall back past it, and the CLI exits 3.
``KSS_HOSTILE_ROWS`` sets the number of extra rows (default 20,000; ``make fuzz``: 300,000).
"""

import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from _records import index, write_json
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import cli, format
from keras_stable_state._numpy import numpy_copy
from keras_stable_state.errors import listed, shown
from keras_stable_state.format import sandbox
from keras_stable_state.format.record import USERBLOCK_SIZE
from keras_stable_state.format.writer import reseal

ROWS = int(os.environ.get("KSS_HOSTILE_ROWS", "20000"))
LIMIT = 2000  # characters: a message about any number of keys of any length


def _trained():
    model = mlp(named=True, seed=3)
    model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    return model


def _state(model):
    return [numpy_copy(v) for v in [*model.weights, *model.optimizer.variables]]


def _edited(tmp_path, model, name, edit):
    path = tmp_path / name
    kss.save_training_state(path, model)
    with h5py.File(path, "r+") as f:
        edit(f)
    reseal(path)
    return path


def _extra_rows(section, keys):
    """Add zero-size arrays ``keys`` to ``section``, in a blob of their own (a valid layout)."""

    def edit(f):
        idx = index(f)
        rows = idx[section]
        blob = 1 + max((r[3] for r in rows if isinstance(r[3], int)), default=-1)
        f.create_dataset(f"{section}/{blob}", data=np.zeros(0, np.uint8))
        empty = np.zeros(0, np.uint8)
        rows.extend(
            [k, "float32", [0], blob, 0, f"{sandbox.digest_v3(k, 'float32', (0,), empty):016x}"] for k in keys
        )
        write_json(f, "index", idx)

    return edit


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "keras_stable_state", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


# -- the helper ---------------------------------------------------------------------------------
def test_listed_names_at_most_five_each_shortened_with_the_count_of_the_others():
    assert listed([]) == "[]"
    assert listed(["a", "b"]) == "['a', 'b']"
    assert listed(range(12)) == "[0, 1, 2, 3, 4 and 7 more]"
    long = "k" * 10**6
    assert shown(long) == f"{'k' * 96!r}... (1,000,000 characters)"
    assert len(listed([long] * 10**5)) < 1000


def test_every_state_error_message_is_bounded():
    err = kss.StateError("x" * 10**6 + " and " + "y " * 10**5 + "Fix it.")
    text = str(err)
    assert len(text) < 9000 and text.endswith("Fix it.") and "(1,000,000 characters)" in text


# -- a key of a megabyte ------------------------------------------------------------------------
def test_a_megabyte_key_is_shortened_in_the_error_and_in_inspect(tmp_path):
    model = _trained()
    key = "path:layers/" + "x" * 10**6
    path = _edited(tmp_path, model, "big.h5", _extra_rows("model", [key]))
    before = _state(model)
    with pytest.raises(
        kss.BindingError, match=r"\(1,000,012 characters\)\] \(1\) in .*not in the model"
    ) as info:
        kss.restore_training_state(path, model)
    assert len(str(info.value)) < LIMIT
    assert info.value.key == key  # the attribute keeps it whole
    for a, b in zip(before, _state(model), strict=True):
        np.testing.assert_array_equal(a, b)
    done = _cli("inspect", path)
    assert done.returncode == cli.EXIT_OK, done.stderr
    assert len(done.stdout) < 20_000 and "(1,000,012 characters)" in done.stdout


# -- many extra rows ----------------------------------------------------------------------------
def _refusal_seconds(path, model, error, rows):
    """The wall time of a refused restore of ``path`` (``rows`` extra index rows)."""
    started = time.perf_counter()
    with pytest.raises(error, match=rf"and {rows - 5:,} more\] \({rows:,}\)") as info:
        kss.restore_training_state(path, model)
    assert len(str(info.value)) < LIMIT
    return time.perf_counter() - started


@pytest.mark.slow
@pytest.mark.parametrize("section", ["model", "state"])
def test_many_extra_index_rows_give_a_short_message_soon(tmp_path, section):
    """Linear in the rows (no quadratic step): a quarter of the rows takes about a quarter of
    the time. Compared as a ratio of the two sizes, each the best of two interleaved rounds, so
    that a loaded machine slows both alike (a wall-clock bound flaked under load)."""
    model = _trained()
    prefix = "path:extra/k" if section == "model" else "extra/k"
    error = kss.BindingError if section == "model" else kss.CorruptCheckpointError
    paths = {}
    for n in (ROWS // 4, ROWS):
        (tmp_path / str(n)).mkdir()
        paths[n] = _edited(
            tmp_path / str(n), model, "rows.h5", _extra_rows(section, [f"{prefix}{i}" for i in range(n)])
        )
    seconds = {n: [] for n in paths}
    for _ in range(2):  # interleaved rounds
        for n, path in paths.items():
            seconds[n].append(_refusal_seconds(path, model, error, n))
    best = {n: min(times) for n, times in seconds.items()}
    # linear: about 4 (less with the fixed costs); a quadratic step: about 16
    assert best[ROWS] / best[ROWS // 4] < 8, best


# -- a newer format -----------------------------------------------------------------------------
def _set_version(f):
    f.attrs["format_version"] = format.FORMAT_VERSION + 1


def _add_record(f):
    f.create_dataset("future", data=np.zeros(3, np.uint8))


def _newer_seal(path):
    data = bytearray(path.read_bytes())
    head = f"KSS-SEAL {format.FORMAT_VERSION + 1} blake9 00ff 12\n".encode()
    data[:USERBLOCK_SIZE] = head.ljust(USERBLOCK_SIZE, b"\0")
    path.write_bytes(bytes(data))


NEWER = {
    "format_version attribute": (_set_version, None, f"format {format.FORMAT_VERSION + 1}"),
    "unknown record": (
        _add_record,
        None,
        rf"format {format.FORMAT_VERSION}, with \['future'\] this version does not know",
    ),
    "seal of a later format": (None, _newer_seal, f"format {format.FORMAT_VERSION + 1}"),
}


def _newer_file(tmp_path, model, how, name="new.h5"):
    edit, raw, _ = NEWER[how]
    path = _edited(tmp_path, model, name, edit or (lambda f: None))
    if raw is not None:
        raw(path)
    return path


@pytest.mark.parametrize("how", sorted(NEWER))
def test_a_newer_format_is_refused_as_such_not_as_damage(tmp_path, how):
    model = _trained()
    path = _newer_file(tmp_path, model, how)
    before = _state(model)
    with pytest.raises(
        kss.NewerFormatError, match=rf"written by a newer keras_stable_state \({NEWER[how][2]}"
    ) as info:
        kss.restore_training_state(path, model)
    assert not isinstance(info.value, kss.CorruptCheckpointError)
    assert "upgrade to read it" in str(info.value) and "damaged;" not in str(info.value)
    assert info.value.version in (format.FORMAT_VERSION, format.FORMAT_VERSION + 1)
    for a, b in zip(before, _state(model), strict=True):
        np.testing.assert_array_equal(a, b)
    for command in ("verify", "inspect"):
        done = _cli(command, path)
        assert done.returncode == cli.EXIT_NEWER, (command, done.stdout, done.stderr)
        assert "newer format: " in done.stderr and "DAMAGED" not in done.stderr


@pytest.mark.parametrize("how", sorted(NEWER))
def test_stable_checkpoint_leaves_a_newer_checkpoint_in_place_and_does_not_fall_back(tmp_path, how):
    d = tmp_path / "ckpts"
    x, y = np.ones((16, 4)), np.ones((16, 1))
    model = _trained()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(d)])
    names = sorted(os.listdir(d))
    newest = d / [n for n in names if n.startswith("ckpt-")][-1]
    newer = _newer_file(tmp_path, model, how)
    shutil.copyfile(newer, newest)
    data = newest.read_bytes()
    again = _trained()
    before = _state(again)
    with pytest.raises(kss.NewerFormatError, match=r"leaves it in place and does not fall back"):
        again.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[kss.StableCheckpoint(d)])
    assert sorted(os.listdir(d)) == names  # nothing moved to unreadable/
    assert newest.read_bytes() == data
    for a, b in zip(before, _state(again), strict=True):
        np.testing.assert_array_equal(a, b)
