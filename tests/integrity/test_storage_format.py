"""The format-2 file: seal, format-1 files still read, atomic writes, what is not a training state."""

import errno
import json
import os
import stat
import warnings
import zlib

import h5py
import keras
import numpy as np
import pytest
from conftest import hypothesis_examples, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import cli, format
from keras_stable_state.format.codec import encode_array
from keras_stable_state.format.record import USERBLOCK_SIZE
from keras_stable_state.format.writer import write_record


def _trained(data):
    m = mlp(4, 8, named=True, optimizer="stable-unbound")
    m.fit(*data, epochs=1, batch_size=8, verbose=0, shuffle=False)
    return m


def _values(m):
    return [to_np(v) for v in m.variables] + [to_np(v) for v in m.optimizer.variables]


def _write_v1(record: format.StateRecord, path):
    """A record as keras_stable_state 0.1 wrote it (format 1)."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = format.FORMAT
        f.attrs["format_version"] = 1
        for name in ("metadata", "contract", "extra"):
            value = getattr(record, name)
            if name == "metadata":
                value = {**value, "format_version": 1}
            f.create_dataset(name, data=json.dumps(value))
        for section, arrays in (
            ("model", record.model),
            ("optimizer", record.optimizer),
            ("state", record.arrays),
        ):
            group = f.create_group(section)
            for i, (key, value) in enumerate(arrays.items()):
                stored, name = encode_array(value)
                ds = group.create_dataset(str(i), data=stored)
                ds.attrs["key"] = key
                ds.attrs["dtype"] = name
                ds.attrs["crc32"] = zlib.crc32(stored.tobytes()) & 0xFFFFFFFF


def test_the_seal_covers_every_byte_after_the_user_block(tmp_path, data):
    src = _trained(data)
    path = tmp_path / "s.h5"
    kss.save_training_state(path, src)
    raw = path.read_bytes()
    assert raw.startswith(b"KSS-SEAL 3 xxh3-128 ")
    with h5py.File(path, "r") as f:  # plain h5py still opens it
        assert f.userblock_size == USERBLOCK_SIZE and int(f.attrs["format_version"]) == 3
    with format.open_file(path) as f:
        assert f.sealed and f.version == 3


@settings(
    max_examples=hypothesis_examples(10),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
@pytest.mark.slow
def test_any_flipped_byte_of_a_record_is_refused_before_hdf5_parses_it(tmp_path, data, where, mask):
    path = tmp_path / "s.h5"  # tmp_path is shared by the examples of one test call: save once
    if not path.exists():
        kss.save_training_state(path, _trained(data))
    raw = bytearray(path.read_bytes())
    raw[int(where * len(raw))] ^= mask
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(raw))
    with pytest.raises(kss.CorruptCheckpointError, match="bad.h5"):
        format.read_file(bad)


def test_format_1_files_are_still_read_exactly(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)
    _write_v1(format.read_file(tmp_path / "s.h5"), tmp_path / "v1.h5")
    dst = mlp(4, 8, named=True, optimizer="stable-unbound")
    dst.build((None, 4))
    report = kss.restore_training_state(tmp_path / "v1.h5", dst)
    assert report.writer["format_version"] == 1
    for a, b in zip(_values(src), _values(dst), strict=True):
        np.testing.assert_array_equal(a, b)
    with format.open_file(tmp_path / "v1.h5") as f:
        assert f.version == 1 and not f.sealed
    assert cli.main(["verify", str(tmp_path / "v1.h5")]) == 0


def test_a_damaged_format_1_file_names_the_key(tmp_path, data):
    src = _trained(data)
    kss.save_training_state(tmp_path / "s.h5", src)
    _write_v1(format.read_file(tmp_path / "s.h5"), tmp_path / "v1.h5")
    raw = bytearray((tmp_path / "v1.h5").read_bytes())
    kernel = to_np(src.get_layer("hidden").kernel).tobytes()
    at = bytes(raw).find(kernel[:16])
    raw[at + 4] ^= 0x10
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    dst = mlp(4, 8, named=True, optimizer="stable-unbound")
    dst.build((None, 4))
    before = _values(dst)
    with pytest.raises(kss.CorruptCheckpointError, match="path:layers/hidden/kernel.*CRC-32") as info:
        kss.restore_training_state(tmp_path / "bad.h5", dst)
    assert info.value.key == "path:layers/hidden/kernel"
    for a, b in zip(before, _values(dst), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_record_without_its_seal_is_refused(tmp_path, data):
    kss.save_training_state(tmp_path / "s.h5", _trained(data))
    raw = bytearray((tmp_path / "s.h5").read_bytes())
    raw[:USERBLOCK_SIZE] = bytes(USERBLOCK_SIZE)  # a format-2 record, seal wiped
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    with pytest.raises(kss.CorruptCheckpointError, match="seal .* is missing or damaged"):
        format.read_file(tmp_path / "bad.h5")


def test_files_get_the_umask_permissions_like_model_save(tmp_path, data):
    m = _trained(data)
    old = os.umask(0o027)
    try:
        for ext in ("h5", "keras"):
            kss.save_training_state(tmp_path / f"s.{ext}", m)
            assert stat.S_IMODE(os.stat(tmp_path / f"s.{ext}").st_mode) == 0o640
    finally:
        os.umask(old)


def test_saving_onto_a_directory_is_refused_and_leaves_nothing(tmp_path, data):
    (tmp_path / "x.h5").mkdir()
    with pytest.raises(kss.CheckpointFormatError, match="is a directory"):
        kss.save_training_state(tmp_path / "x.h5", _trained(data))
    assert sorted(os.listdir(tmp_path)) == ["x.h5"]
    with pytest.raises(kss.CheckpointFormatError, match="is a directory, not a training-state file"):
        kss.restore_training_state(tmp_path / "x.h5", _trained(data))


def test_disk_full_names_the_file_and_keeps_the_previous_one(tmp_path, data, monkeypatch):
    m = _trained(data)
    path = tmp_path / "s.h5"
    kss.save_training_state(path, m)
    good = path.read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"s\.h5.*disk is full.*unchanged") as info:
        kss.save_training_state(path, m)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert [n for n in os.listdir(tmp_path) if n.startswith(".kss-")] == []


def test_a_legacy_keras_h5_file_is_named_as_such(tmp_path, data, capsys):
    m = _trained(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save(tmp_path / "legacy.h5")
    with pytest.raises(kss.CheckpointFormatError, match="legacy Keras HDF5 file"):
        kss.restore_training_state(tmp_path / "legacy.h5", mlp(4, 8, named=True, optimizer="stable-unbound"))
    assert cli.main(["verify", str(tmp_path / "legacy.h5")]) != 0
    assert "legacy Keras HDF5 file" in capsys.readouterr().err


def test_a_record_of_callables_and_pairs_is_written_array_by_array_and_read_back_exactly(tmp_path):
    """The writer's seam: values may be zero-argument callables (called one at a time, in
    file order) and a section may be an iterable of ``(key, value)`` pairs; the file is the
    same sealed record, read back bit for bit, and its bytes equal those of plain arrays."""
    rng = np.random.default_rng(3)
    model = {f"path:layers/d{i}/kernel": rng.normal(size=(i + 1, 3)).astype("float32") for i in range(4)}
    model["path:layers/d0/steps"] = np.array(7, dtype="int64")
    opt = {"optimizer#iteration": np.array(11, dtype="int64")}
    calls = []

    def lazy(key, value):
        def make():
            calls.append(key)
            return value.copy()

        return make

    meta = {"backend": keras.backend.backend(), "keras_version": keras.__version__, "format_version": 2}
    extra = {"callbacks": {}, "providers": {}, "rng": None}
    lazy_record = format.StateRecord(
        metadata=meta,
        contract=None,
        model={k: lazy(k, v) for k, v in model.items()},
        optimizer=iter([(k, lazy(k, v)) for k, v in opt.items()]),
        extra=extra,
    )
    plain = format.StateRecord(metadata=meta, contract=None, model=model, optimizer=opt, extra=extra)
    write_record(tmp_path / "lazy.h5", lazy_record)
    write_record(tmp_path / "plain.h5", plain)
    assert calls == [*model, *opt]
    assert (tmp_path / "lazy.h5").read_bytes() == (tmp_path / "plain.h5").read_bytes()
    back = format.read_file(tmp_path / "lazy.h5")
    assert list(back.model) == list(model) and list(back.optimizer) == list(opt)
    for saved, got in ((model, back.model), (opt, back.optimizer)):
        for key, value in saved.items():
            assert got[key].dtype == value.dtype
            np.testing.assert_array_equal(got[key], value)
