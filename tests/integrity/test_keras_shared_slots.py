"""``.keras``: the optimizer slots are stored once, shared with Keras' own ``model.weights.h5``
as the model weights are (same index reference, same sealed member checks, slots still bound by
key), so the file is about the size of ``model.save``'s; files written before still restore."""

import os
import shutil
import zipfile

import _records
import h5py
import keras
import numpy as np
import pytest
import xxhash
from conftest import to_np
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import cli, format
from keras_stable_state.format import keras_archive
from keras_stable_state.format.record import KERAS_WEIGHTS_MEMBER, MEMBER, PACK_LIMIT
from keras_stable_state.format.writer import reseal

DATA = os.path.join(TESTS, "data")
PREFIX = "model.weights.h5:/"
# HDF5 and zip headers, the record's JSON (metadata, contract, index) and the NumPy RNG state
# (2.5 KB): what a .keras state holds besides the arrays and Keras' config, with room to spare.
HEADERS = 64 * 1024

# The kit's model: two kernels over 64 KiB (72 x 256 and 256 x 128 float32) and small biases and head.
WIDE = {
    "features": 72,
    "hidden": (256, 128),
    "activation": "tanh",
    "layer_names": ("wide", "mid", "head"),
    "out_units": 4,
}
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    # four slot kinds: momentums, velocities, velocity_hats and the EMA of every model variable
    "adam_amsgrad_ema": lambda: keras.optimizers.Adam(1e-3, amsgrad=True, use_ema=True),
    "stable_adamw": lambda: kss.StableOptimizer(keras.optimizers.AdamW(1e-3)),
}


def _trained(kind):
    m = mlp(**WIDE, optimizer="plain", inner=OPTIMIZERS[kind])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 72)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)  # two steps: every slot distinct, not zero
    return m


def _fresh(kind):
    m = mlp(**WIDE, optimizer="plain", inner=OPTIMIZERS[kind])
    m.build((None, 72))
    m.optimizer.build(m.trainable_variables)
    return m


def _variables(m):
    return [*m.variables, *m.optimizer.variables]


def _assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _member(path, name):
    with zipfile.ZipFile(path) as zf:
        return zf.read(name)


def _rewrite_archive(path, change):
    """Rewrite the zip at ``path`` with ``change(name, data) -> data`` per member (zip CRC-32s
    recomputed: only the record's own checks can notice)."""
    with zipfile.ZipFile(path) as zin:
        members = [(info, zin.read(info.filename)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for info, data in members:
            zout.writestr(info, change(info.filename, data))


def _edit_record(path, fn):
    """Apply ``fn(h5py.File)`` to the record member of the archive at ``path``, then reseal."""
    member = path + ".member.h5"
    with open(member, "wb") as fh:
        fh.write(_member(path, MEMBER))
    with h5py.File(member, "r+") as f:
        fn(f)
    with open(member, "rb") as fh:
        data = fh.read()
    os.remove(member)
    _rewrite_archive(path, lambda name, old: data if name == MEMBER else old)
    reseal(path)


def _assert_refused_untouched(path, m, error, match=None):
    """Restore of ``path`` raises ``error`` and leaves every variable of ``m`` (first given
    values other than the file's) as it was; ``verify`` refuses the file too."""
    for v in _variables(m):
        v.assign(to_np(v) + np.ones((), to_np(v).dtype))
    before = [to_np(v) for v in _variables(m)]
    with pytest.raises(error, match=match) as info:
        kss.restore_training_state(path, m)
    for a, v in zip(before, _variables(m), strict=True):
        _assert_same(a, to_np(v))
    assert cli.main(["verify", path]) != 0
    return info.value


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def saved(request, tmp_path_factory):
    """A trained model saved to ``.keras``, with its values by position at the save."""
    m = _trained(request.param)
    path = str(tmp_path_factory.mktemp(request.param) / "s.keras")
    kss.save_training_state(path, m)
    return request.param, path, m, [to_np(v) for v in _variables(m)]


# -- size -----------------------------------------------------------------------------------
def test_a_keras_state_is_about_the_size_of_the_arrays_it_holds(saved, tmp_path):
    kind, path, m, values = saved
    model_bytes = sum(a.nbytes for a in values[: len(m.variables)])
    slots = values[len(m.variables) :]
    slot_bytes = sum(a.nbytes for a in slots)
    small = sum(a.nbytes for a in slots if a.nbytes <= PACK_LIMIT)  # packed in the record
    assert slot_bytes > 2 * model_bytes  # the slots are most of the state: storing them twice shows
    with zipfile.ZipFile(path) as zf:
        config = sum(zf.getinfo(n).file_size for n in ("config.json", "metadata.json"))
    state = model_bytes + slot_bytes
    assert os.path.getsize(path) <= 1.05 * state + config + small + HEADERS
    stock = str(tmp_path / "stock.keras")
    m.save(stock)  # Keras' own file holds the same weights and slots
    assert os.path.getsize(path) <= 1.05 * os.path.getsize(stock) + small + HEADERS

    # every optimizer array over PACK_LIMIT bytes names a dataset of Keras' weights file holding
    # the same bytes (its own slot under optimizer/vars, or an earlier dataset equal to it)
    with format.open_file(path) as f:
        shared = [e for e in f.section("optimizer") if e.dataset.startswith(PREFIX)]
        assert all(e.checksum == "xxh3-64" for e in f.entries)
    large = sorted(a.nbytes for a in slots if a.nbytes > PACK_LIMIT)
    assert sorted(e.nbytes for e in shared) == large and len(large) >= (
        6 if kind == "adam_amsgrad_ema" else 4
    )


def test_a_background_save_shares_the_slots_too(tmp_path):
    m = _trained("adam")
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m, blocking=False).wait()
    slots = [to_np(v) for v in m.optimizer.variables]
    with format.open_file(path) as f:
        shared = [e.nbytes for e in f.section("optimizer") if e.dataset.startswith(PREFIX)]
    assert sorted(shared) == sorted(a.nbytes for a in slots if a.nbytes > PACK_LIMIT)


# -- restore --------------------------------------------------------------------------------
def test_every_model_and_optimizer_variable_restores_equal_by_position(saved):
    kind, path, _, values = saved
    fresh = _fresh(kind)
    kss.restore_training_state(path, fresh)
    for saved_value, v in zip(values, _variables(fresh), strict=True):
        _assert_same(saved_value, to_np(v))
    assert cli.main(["verify", path]) == 0


def test_keras_load_model_still_loads_the_file_weights_and_slots(saved):
    kind, path, m, values = saved
    loaded = keras.saving.load_model(path)
    if isinstance(loaded.optimizer, kss.StableOptimizer):
        loaded.optimizer.bind(loaded)  # its slots come back by key, once bound to the model
    for saved_value, v in zip(values[: len(m.variables)], loaded.variables, strict=True):
        _assert_same(saved_value, to_np(v))
    # Keras restores its compiled optimizer by position from the datasets the record shares
    assert loaded.optimizer.built
    for saved_value, v in zip(values[len(m.variables) :], loaded.optimizer.variables, strict=True):
        _assert_same(saved_value, to_np(v))


# -- integrity ------------------------------------------------------------------------------
def _flip_slot(path, m):
    """Flip one bit of the mid kernel's velocities (Adam's second slot of it) where Keras'
    ``model.weights.h5`` holds them; returns the slot's key and the damaged member's bytes."""
    (velocities,) = [v for v in m.optimizer.variables if tuple(v.shape) == (256, 128) and "velocit" in v.path]
    raw = to_np(velocities).tobytes()
    data = _member(path, KERAS_WEIGHTS_MEMBER)
    at = data.find(raw)
    assert at > 0
    data = data[: at + 9] + bytes([data[at + 9] ^ 0x10]) + data[at + 10 :]
    _rewrite_archive(path, lambda name, old: data if name == KERAS_WEIGHTS_MEMBER else old)
    return "path:layers/mid/kernel#velocities", data


def test_a_changed_shared_slot_is_refused_naming_its_key(tmp_path):
    m = _trained("adam")
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m)
    key, _ = _flip_slot(path, m)
    err = _assert_refused_untouched(
        path, m, kss.CorruptCheckpointError, match="model.weights.h5.*not the one the training state"
    )
    assert err.key == key and "xxh3-64 checksum" in str(err)  # a probe process names the slot


def test_a_changed_shared_slot_with_the_member_hash_forged_fails_its_own_checksum(tmp_path):
    """The member's length and xxh3-128 forged in the index and the record resealed: the
    slot's own xxh3-64 (over its key, dtype, shape and bytes) still refuses it."""
    m = _trained("adam")
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m)
    key, data = _flip_slot(path, m)

    def forge(f):
        index = _records.index(f)
        index["shared"].update(bytes=len(data), **{"xxh3-128": xxhash.xxh3_128(data).hexdigest()})
        _records.write_json(f, "index", index)

    _edit_record(path, forge)
    err = _assert_refused_untouched(path, m, kss.CorruptCheckpointError, match="fails its xxh3-64")
    assert err.key == key


def test_a_slot_row_naming_a_dataset_of_another_shape_is_refused(tmp_path):
    m = _trained("adam")
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m)
    key = "path:layers/mid/kernel#velocities"

    def point_elsewhere(f):
        index = _records.index(f)
        row = next(r for r in index["optimizer"] if r[0] == key)
        row[3] = "model.weights.h5:/optimizer/vars/0"  # the iteration count: int, shape ()
        _records.write_json(f, "index", index)

    _edit_record(path, point_elsewhere)
    err = _assert_refused_untouched(path, m, kss.CorruptCheckpointError, match="not the optimizer array")
    assert err.key == key


def test_shared_slots_without_the_index_saying_so_are_refused(tmp_path):
    """Without ``shared_sections`` (as files written before the slots were shared) only model
    rows may name Keras' datasets: a slot row that does is refused, naming its key."""
    m = _trained("adam")
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m)
    seen = {}

    def drop_field(f):
        index = _records.index(f)
        assert index.pop("shared_sections") == ["model", "optimizer"]
        seen["key"] = next(r[0] for r in index["optimizer"] if isinstance(r[3], str))
        _records.write_json(f, "index", index)

    _edit_record(path, drop_field)
    err = _assert_refused_untouched(path, m, kss.CorruptCheckpointError, match="shares only the sections")
    assert err.key == seen["key"]


@pytest.mark.parametrize("value", [["model", "state"], ["model", "model"], [], "optimizer", None])
def test_a_malformed_shared_sections_field_is_refused(tmp_path, value):
    m = _trained("adam")
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m)

    def change(f):
        index = _records.index(f)
        index["shared_sections"] = value
        _records.write_json(f, "index", index)

    _edit_record(path, change)
    err = _assert_refused_untouched(path, m, kss.CorruptCheckpointError, match="shared_sections")
    assert err.key == "index"


# -- files written before the slots were shared ----------------------------------------------
def test_a_keras_state_written_before_the_slots_were_shared_still_restores_exactly(tmp_path):
    path = str(tmp_path / "old.keras")
    shutil.copyfile(os.path.join(DATA, "format3_model_shared.keras"), path)
    with format.open_file(path) as f:  # the old layout: the slots in the record's own blobs
        assert f.version == 3
        assert all(e.dataset.startswith(PREFIX) for e in f.section("model"))
        assert not any(e.dataset.startswith(PREFIX) for e in f.section("optimizer"))
        assert max(e.nbytes for e in f.section("optimizer")) > PACK_LIMIT
    # expected values from Keras' side of the archive, read without this library
    expected_model = [to_np(v) for v in keras.saving.load_model(path).variables]
    with zipfile.ZipFile(path) as zf, zf.open(KERAS_WEIGHTS_MEMBER) as fh:
        with h5py.File(fh, "r") as w:
            group = w["optimizer/vars"]
            expected_slots = [group[str(i)][()] for i in range(len(group))]
    # The model tests/data/format3_model_shared.keras was written for (keras_stable_state before
    # the slots were shared, format 3, jax backend): Dense(1) over 16,400 inputs (a kernel and
    # slots of 65,600 bytes, over PACK_LIMIT) -> Dense(2), Adam(1e-2), two steps.
    m = mlp(
        16400, 1, layer_names=("wide", "out"), out_units=2, name="fixture3", optimizer="plain", build=True
    )
    kss.restore_training_state(path, m)
    for a, v in zip(expected_model, m.variables, strict=True):
        _assert_same(a, to_np(v))
    assert len(expected_slots) == len(m.optimizer.variables)
    for a, v in zip(expected_slots, m.optimizer.variables, strict=True):
        live = to_np(v)
        if a.dtype.kind in "iu":  # the iteration counter: int32 when written (jax), int64 on TF
            a = a.astype(live.dtype)
        _assert_same(a, live)
    assert int(to_np(m.optimizer.iterations)) == 2
    assert cli.main(["verify", path]) == 0


def test_the_writer_finds_every_keras_dataset_by_its_dtype_shape_and_bytes(saved, tmp_path):
    """The datasets of Keras' weights file are hashed where they lie, in one pass with the
    whole member: the same map as reading each dataset with h5py and hashing its array
    (every dataset of a content, for equal arrays to refer to one each)."""
    _, path, m, _ = saved
    stock = str(tmp_path / "stock.keras")
    m.save(stock)
    expected = {}
    with zipfile.ZipFile(stock) as zf, zf.open(KERAS_WEIGHTS_MEMBER) as fh:
        with h5py.File(fh, "r") as w:
            w.visititems(
                lambda name, obj: (
                    expected.setdefault(keras_archive.content_key(obj[()]), set()).add(f"{PREFIX}{name}")
                    if isinstance(obj, h5py.Dataset) and obj.dtype.kind in "fiub"
                    else None
                )
            )
        member = zf.read(KERAS_WEIGHTS_MEMBER)
    found = keras_archive.KerasWeights.of_archive(stock)
    assert found.spec == {
        "member": KERAS_WEIGHTS_MEMBER,
        "bytes": len(member),
        "xxh3-128": xxhash.xxh3_128(member).hexdigest(),
    }
    assert set(found.by_content) == set(expected)
    assert all(
        set(refs) == expected[key] and len(refs) == len(expected[key])
        for key, refs in found.by_content.items()
    )


def _h5_datasets(data: bytes) -> dict:
    """``{path: (dtype, shape, bytes)}`` of every dataset of an HDF5 file image."""
    import io

    out = {}
    with h5py.File(io.BytesIO(data), "r") as f:
        f.visititems(
            lambda name, obj: (
                out.__setitem__(name, (obj.dtype.str, obj.shape, obj[()].tobytes()))
                if isinstance(obj, h5py.Dataset)
                else None
            )
        )
    return out


@pytest.mark.parametrize("kind", ["adam", "adam_amsgrad_ema"])
def test_keras_members_are_what_model_save_writes(kind, tmp_path):
    """Keras' part of a ``.keras`` state (its walk given the skip sets it would build, for
    the call) is what ``model.save`` writes: the same config and every weights dataset
    with the same bytes at the same path; nothing is left in Keras' global state."""
    import json

    from keras.src.backend.common import global_state

    m = _trained(kind)
    ours, stock = str(tmp_path / "s.keras"), str(tmp_path / "m.keras")
    kss.save_training_state(ours, m)
    m.save(stock)
    assert json.loads(_member(ours, "config.json")) == json.loads(_member(stock, "config.json"))
    mine, theirs = _h5_datasets(_member(ours, PREFIX[:-2])), _h5_datasets(_member(stock, PREFIX[:-2]))
    assert mine == theirs and any(p.startswith("optimizer/") for p in mine)
    for name in ("Layer", "Sequential", "Functional", "Optimizer", "Metric", "Operation", "Loss"):
        assert global_state.get_global_attribute(f"saving_attr_skiplist_{name}") is None
