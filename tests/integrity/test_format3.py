"""Format 3: small arrays packed into shared blobs, the index checked byte for byte, xxh3
checksums; files written in format 2 still restore exactly."""

import json
import os
import shutil
import zipfile

import _records
import h5py
import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import hypothesis_examples, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state import cli, format
from keras_stable_state.errors import StateError
from keras_stable_state.format.record import ALIGN, BLOB_TARGET, MEMBER, PACK_LIMIT, USERBLOCK_SIZE
from keras_stable_state.format.writer import reseal, write_record

DATA = os.path.join(TESTS, "data")
META = {"backend": keras.backend.backend(), "keras_version": keras.__version__}
EXTRA = {"callbacks": {}, "providers": {}, "rng": None}


def _record(model, optimizer=None):
    return format.StateRecord(
        metadata=META, contract=None, model=model, optimizer=optimizer or {}, extra=EXTRA
    )


def _assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


# -- layout --------------------------------------------------------------------------------
def test_small_arrays_share_blobs_large_ones_have_their_own_and_all_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    model = {f"path:layers/d{i}/kernel": rng.normal(size=(3, i % 5)).astype("float32") for i in range(300)}
    model["path:layers/big/kernel"] = rng.normal(size=(200, 100)).astype("float32")  # 80 KB: own blob
    model["path:layers/b16/kernel"] = rng.normal(size=(7,)).astype(ml_dtypes.bfloat16)
    model["path:layers/mask/kernel"] = np.array([True, False, True])
    model["path:layers/steps/count"] = np.array(5, dtype="int64")
    model["path:layers/empty/kernel"] = np.zeros((0, 4), "float64")
    # 40 x 60 KB packed arrays: more than one shared blob of about BLOB_TARGET bytes
    model.update({f"path:layers/m{i}/kernel": np.full((15_000,), i, "float32") for i in range(40)})
    write_record(tmp_path / "s.h5", _record(model))

    with format.open_file(tmp_path / "s.h5") as f:
        entries = {e.key: e for e in f.entries}
        assert f.version == 3 and f.seal_version == 3
        assert all(e.checksum == "xxh3-64" for e in f.entries)
        assert all(e.offset % ALIGN == 0 for e in f.entries)
        big = entries["path:layers/big/kernel"]
        assert big.offset == 0 and sum(e.dataset == big.dataset for e in f.entries) == 1
        assert entries["path:layers/d0/kernel"].dataset == entries["path:layers/d299/kernel"].dataset
        blobs = {e.dataset for e in f.entries}
    with h5py.File(tmp_path / "s.h5", "r") as h:
        assert len(h["model"]) == len(blobs)
        sizes = sorted(h[name].shape[0] for name in blobs)
    assert len(blobs) >= 3 and len(blobs) < 20  # 346 arrays in a handful of datasets
    assert sizes[-1] <= BLOB_TARGET + PACK_LIMIT + ALIGN

    back = format.read_file(tmp_path / "s.h5")
    assert list(back.model) == list(model)
    for key, value in model.items():
        _assert_same(value, back.model[key])


_DTYPES = ["float32", "float16", "float64", "int8", "int32", "int64", "uint8", "bool", "bfloat16"]


@settings(max_examples=hypothesis_examples(10), deadline=None, derandomize=True)
@given(
    arrays=st.lists(
        st.tuples(
            st.sampled_from(_DTYPES),
            st.lists(st.integers(0, 40), max_size=3),
            st.integers(0, 2**32 - 1),
        ),
        min_size=1,
        max_size=30,
    ),
    big=st.integers(0, 2),
)
@pytest.mark.slow
def test_any_mix_of_arrays_reads_back_bit_for_bit(tmp_path_factory, arrays, big):
    folder = tmp_path_factory.mktemp("mix")
    model = {}
    for i, (dtype, shape, seed) in enumerate(arrays):
        rng = np.random.default_rng(seed)
        np_dtype = format.numpy_dtype(dtype)
        if i < big:  # past PACK_LIMIT: a blob of its own
            shape = [PACK_LIMIT // np_dtype.itemsize + 1 + seed % 7]
        raw = rng.integers(
            0, 256, size=int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize, dtype=np.uint8
        )
        value = raw.view(np_dtype).reshape(shape)
        if dtype == "bool":
            value = value.view(np.uint8) % 2 == 1
        model[f"path:layers/l{i}/kernel"] = value
    write_record(folder / "s.h5", _record(model))
    back = format.read_file(folder / "s.h5")
    for key, value in model.items():
        _assert_same(value, back.model[key])


# -- the index, checked byte for byte ------------------------------------------------------
def _values(m):
    return [to_np(v) for v in [*m.variables, *m.optimizer.variables]]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A saved state with distinct values in every variable and slot, and its model."""
    m = mlp(4, 8, named=True, optimizer="plain", build=True)
    rng = np.random.default_rng(1)
    for v in [*m.variables, *m.optimizer.variables]:
        value = to_np(v)
        v.assign(rng.normal(size=value.shape).astype(value.dtype) if value.dtype.kind == "f" else value + 3)
    path = tmp_path_factory.mktemp("pristine") / "s.h5"
    kss.save_training_state(path, m)
    return str(path), m


@settings(
    max_examples=hypothesis_examples(10),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    section=st.sampled_from(["model", "optimizer", "state"]),
    i=st.integers(0, 50),
    field=st.sampled_from(_records.FIELDS),
    amount=st.integers(1, 64),
)
def test_any_edit_of_the_index_resealed_is_refused_and_nothing_changes(
    tmp_path_factory, pristine, section, i, field, amount
):
    """A forger who edits one index row (or the rows' order), fixes the index checksum and
    reseals the file: verify and restore both refuse it, naming a key, blob or the index,
    and restore leaves every variable as it was."""
    src, m = pristine
    path = str(tmp_path_factory.mktemp("edit") / "bad.h5")
    shutil.copyfile(src, path)
    with h5py.File(path, "r+") as f:
        index = _records.index(f)
        if not index[section]:
            section = "model"
        _records.mutate_index(index, section, i, field, amount)
        _records.write_json(f, "index", index)
    reseal(path)

    with pytest.raises(kss.CorruptCheckpointError) as info:
        format.read_file(path)
    assert info.value.key is not None and str(info.value.key) in str(info.value)
    _assert_refused_untouched(path, m, StateError)


def _assert_refused_untouched(path, m, error, match=None):
    """Restore of ``path`` raises ``error`` and leaves every variable of ``m`` (first given
    values other than the file's) as it was; ``verify`` refuses the file too. Returns the error."""
    for v in [*m.variables, *m.optimizer.variables]:
        v.assign(to_np(v) + np.ones((), to_np(v).dtype))
    before = _values(m)
    with pytest.raises(error, match=match) as info:
        kss.restore_training_state(path, m)
    for a, b in zip(before, _values(m), strict=True):
        _assert_same(a, b)
    assert cli.main(["verify", path]) != 0
    return info.value


def test_a_blob_with_bytes_no_array_claims_is_refused_naming_its_arrays(tmp_path, pristine):
    src, _ = pristine
    path = str(tmp_path / "bad.h5")
    shutil.copyfile(src, path)
    with h5py.File(path, "r+") as f:
        data = f["model/0"][()]
        del f["model/0"]
        f["model"].create_dataset("0", data=np.concatenate([data, np.zeros(16, np.uint8)]))
    reseal(path)
    with pytest.raises(kss.CorruptCheckpointError, match=r"model/0 \(it holds the arrays for keys") as info:
        format.read_file(path)
    assert info.value.key == "path:layers/hidden/kernel"


def test_a_flipped_array_byte_names_the_key_and_its_xxh3(tmp_path, pristine):
    src, _ = pristine
    path = str(tmp_path / "bad.h5")
    shutil.copyfile(src, path)
    with h5py.File(path, "r+") as f:
        _, row = _records.row_of(f, "path:layers/out/bias")
        blob = f[f"model/{row[3]}"]
        data = blob[()]
        data[row[4]] ^= 0x40
        blob[...] = data
    with pytest.raises(
        kss.CorruptCheckpointError, match="xxh3-128 seal.*path:layers/out/bias.*xxh3-64"
    ) as info:
        format.read_file(path)
    assert info.value.key == "path:layers/out/bias"
    reseal(path)  # the same flip, resealed: the array's own checksum refuses it
    with pytest.raises(kss.CorruptCheckpointError, match="path:layers/out/bias.*fails its xxh3-64") as info:
        format.read_file(path)
    assert info.value.key == "path:layers/out/bias"


# -- format 2 ------------------------------------------------------------------------------
# The model tests/data/format2.* were written for (keras_stable_state 0.1.0, format 2, torch
# backend): Dense(3) -> Dense(1) with Adam(1e-2), after one epoch of 2 steps.
FIXTURE = {"features": 4, "hidden": 3, "named": True, "name": "fixture", "optimizer": "plain", "build": True}


@pytest.mark.parametrize("name", ["format2.h5", "format2.keras"])
def test_files_written_in_format_2_still_restore_exactly(name, capsys):
    path = os.path.join(DATA, name)
    expected = np.load(os.path.join(DATA, "format2_expected.npz"))
    m = mlp(**FIXTURE)
    report = kss.restore_training_state(path, m)
    assert report.writer["format_version"] == 2
    for i, w in enumerate(m.get_weights()):
        _assert_same(expected[f"model_{i}"], np.asarray(w))
    for i, v in enumerate(m.optimizer.variables):
        saved, live = expected[f"opt_{i}"], to_np(v)
        if saved.dtype.kind in "iu":  # the iteration counter: int32 when written (torch), int64 on TF
            saved = saved.astype(live.dtype)
        _assert_same(saved, live)
    assert int(to_np(m.optimizer.iterations)) == 2
    with format.open_file(path) as f:
        assert f.version == 2 and f.seal_version == 2 and {e.checksum for e in f.entries} == {"CRC-32"}
    assert cli.main(["verify", path]) == 0
    assert "match their CRC-32 checksums" in capsys.readouterr().out


def test_a_damaged_format_2_file_is_refused_naming_the_key(tmp_path):
    with open(os.path.join(DATA, "format2.h5"), "rb") as fh:
        raw = bytearray(fh.read())
    kernel = np.load(os.path.join(DATA, "format2_expected.npz"))["model_0"].tobytes()
    at = bytes(raw).find(kernel)
    assert at > 0
    raw[at + 5] ^= 0x01
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    m = mlp(**FIXTURE)
    before = _values(m)
    with pytest.raises(
        kss.CorruptCheckpointError, match="SHA-256 seal.*path:layers/hidden/kernel.*CRC-32"
    ) as info:
        kss.restore_training_state(tmp_path / "bad.h5", m)
    assert info.value.key == "path:layers/hidden/kernel"
    for a, b in zip(before, _values(m), strict=True):
        _assert_same(a, b)


def test_a_format_2_file_resealed_keeps_its_format_2_seal(tmp_path):
    path = tmp_path / "v2.h5"
    shutil.copyfile(os.path.join(DATA, "format2.h5"), path)
    reseal(path)
    assert path.read_bytes().startswith(b"KSS-SEAL 2 sha256 ")
    assert format.read_file(path).metadata["format_version"] == 2


def test_a_format_3_record_under_a_format_2_seal_is_refused(tmp_path, pristine):
    src, _ = pristine
    with open(src, "rb") as fh:
        raw = bytearray(fh.read())
    raw[:USERBLOCK_SIZE] = b"KSS-SEAL 2 sha256 " + bytes(USERBLOCK_SIZE - 18)
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    reseal(tmp_path / "bad.h5")
    with pytest.raises(kss.CorruptCheckpointError, match="format-3 record under a format-2 seal"):
        format.read_file(tmp_path / "bad.h5")


def test_the_index_json_is_what_the_docs_describe(pristine):
    src, _ = pristine
    with h5py.File(src, "r") as f:
        index = json.loads(f["index"][()].tobytes())
    assert set(index) == {"model", "optimizer", "state"}
    key, dtype, shape, blob, offset, digest = index["model"][0]
    assert (key, dtype, shape, blob, offset) == ("path:layers/hidden/kernel", "float32", [4, 8], 0, 0)
    assert len(digest) == 16 and int(digest, 16) >= 0


# -- .keras: the model weights are stored once ----------------------------------------------
def _rewrite_archive(path, change):
    """Rewrite the zip at ``path``, ``change(name, data) -> (data, compress_type)`` per member."""
    with zipfile.ZipFile(path) as zin:
        members = [(info, zin.read(info.filename)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for info, data in members:
            data, info.compress_type = change(info.filename, data, info.compress_type)
            zout.writestr(info, data)


@pytest.fixture(scope="module")
def archive(tmp_path_factory, pristine):
    src, m = pristine
    path = tmp_path_factory.mktemp("archive") / "s.keras"
    kss.save_training_state(path, m)
    return str(path), src


def test_a_keras_state_shares_the_model_weights_with_keras_and_still_loads(archive, pristine):
    path, h5 = archive
    _, m = pristine
    with format.open_file(h5) as f:
        model_keys = {e.key for e in f.section("model")}
    with format.open_file(path) as f:
        shared = {e.key for e in f.section("model") if e.dataset.startswith("model.weights.h5:/")}
        assert shared == model_keys
        assert all(e.checksum == "xxh3-64" for e in f.entries)
        sizes = dict(f.members)
    model_bytes = sum(to_np(v).nbytes for v in m.variables)
    # the record member holds the optimizer and other state, not the model weights a second time
    assert sizes[MEMBER] < os.path.getsize(h5) - model_bytes + 4096
    loaded = keras.saving.load_model(path)
    for a, b in zip(m.get_weights(), loaded.get_weights(), strict=True):
        _assert_same(np.asarray(a), np.asarray(b))
    fresh = mlp(4, 8, named=True, optimizer="plain", build=True)
    kss.restore_training_state(path, fresh)
    for a, b in zip(_values(m), _values(fresh), strict=True):
        _assert_same(a, b)


def test_a_changed_keras_weights_member_is_refused_naming_it(tmp_path, archive, pristine):
    path, _ = archive
    _, m = pristine
    bad = str(tmp_path / "bad.keras")
    shutil.copyfile(path, bad)
    kernel = to_np(m.get_layer("hidden").kernel).tobytes()

    def flip(name, data, compress):
        if name == "model.weights.h5":
            at = data.find(kernel)
            assert at > 0
            data = data[: at + 3] + bytes([data[at + 3] ^ 0x08]) + data[at + 4 :]
        return data, compress

    _rewrite_archive(bad, flip)  # zip CRC-32s recomputed: only the record's hash can notice
    err = _assert_refused_untouched(
        bad, m, kss.CorruptCheckpointError, match="model.weights.h5.*not the one the training state"
    )
    # a probe process names the shared array whose xxh3-64 fails
    assert err.key == "path:layers/hidden/kernel" and "xxh3-64 checksum" in str(err)


def test_a_compressed_keras_weights_member_is_refused_naming_it(tmp_path, archive):
    path, _ = archive
    bad = str(tmp_path / "bad.keras")
    shutil.copyfile(path, bad)
    _rewrite_archive(
        bad, lambda name, data, c: (data, zipfile.ZIP_DEFLATED if name == "model.weights.h5" else c)
    )
    with pytest.raises(kss.CorruptCheckpointError, match="model.weights.h5: the member is compressed"):
        format.read_file(bad)


@keras.saving.register_keras_serializable(package="kss_tests")
class _Doubled(keras.layers.Dense):
    """Stores twice its kernel in Keras' weights (a layer with its own save format)."""

    def save_own_variables(self, store):
        store["0"] = to_np(self.kernel) * 2
        store["1"] = to_np(self.bias)

    def load_own_variables(self, store):
        self.kernel.assign(store["0"] / 2)
        self.bias.assign(store["1"])


def test_an_array_keras_stores_differently_is_kept_in_the_record(tmp_path):
    m = keras.Sequential([keras.Input((3,)), _Doubled(2, name="doubled")])
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    m.optimizer.build(m.trainable_variables)
    m.get_layer("doubled").kernel.assign(np.arange(6, dtype="float32").reshape(3, 2) + 0.5)
    path = str(tmp_path / "s.keras")
    kss.save_training_state(path, m)
    with format.open_file(path) as f:
        where = {e.key: e.dataset for e in f.section("model")}
    assert not where["path:layers/doubled/kernel"].startswith("model.weights.h5:")
    fresh = keras.Sequential([keras.Input((3,)), _Doubled(2, name="doubled")])
    fresh.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    kss.restore_training_state(path, fresh)
    for a, b in zip(_values(m), _values(fresh), strict=True):
        _assert_same(a, b)
