"""What a restore reads, and into what: arrays land in 64-byte aligned host memory of their
own (which a variable may then keep without a copy), and a ``.keras`` restore reads the
record member and Keras' weights member in place, each checked by its hash, never copied
whole into memory or read a second time for its zip CRC-32."""

import zipfile

import numpy as np
from conftest import to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format as storage
from keras_stable_state.format import keras_archive


def _trained(data, hidden=64):
    x, y = data
    model = mlp(4, hidden, named=True, seed=5)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    return model


def test_arrays_read_from_a_file_are_aligned_and_writable(tmp_path, data):
    model = _trained(data, hidden=(8192,))  # a 4 x 8192 kernel (128 KiB): a blob of its own
    kss.save_training_state(tmp_path / "s.h5", model)
    record = storage.read_file(tmp_path / "s.h5")
    kernel = record.model["path:layers/hidden/kernel"]
    np.testing.assert_array_equal(kernel, to_np(model.get_layer("hidden").kernel))
    big = [a for a in [*record.model.values(), *record.optimizer.values()] if a.nbytes > storage.PACK_LIMIT]
    assert big, "no array large enough for a blob of its own"
    for array in big:
        assert array.ctypes.data % 64 == 0 and array.flags.writeable and array.flags.c_contiguous


def test_keras_restore_reads_its_hashed_members_in_place(tmp_path, data, monkeypatch):
    model = _trained(data)
    path = tmp_path / "s.keras"
    kss.save_training_state(path, model)
    with zipfile.ZipFile(path) as zf:
        names = {i.filename: i.compress_type for i in zf.infolist()}
    assert names[storage.MEMBER] == zipfile.ZIP_STORED and keras_archive.MEMBER in names
    saved = [to_np(v) for v in model.weights]
    for v in model.weights:
        v.assign(np.zeros(tuple(v.shape), to_np(v).dtype))
    opened = []
    real_open = zipfile.ZipFile.open

    def watch(self, name, *args, **kwargs):
        opened.append(name.filename if isinstance(name, zipfile.ZipInfo) else name)
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", watch)
    kss.restore_training_state(path, model)
    monkeypatch.undo()
    for v, want in zip(model.weights, saved, strict=True):
        np.testing.assert_array_equal(to_np(v), want)
    assert storage.MEMBER not in opened and keras_archive.MEMBER not in opened, opened
    assert "config.json" in opened  # the members no hash covers are still read for their CRC-32


def test_keras_record_member_damaged_in_place_is_refused_by_its_seal(tmp_path, data):
    model = _trained(data, hidden=(2048,))
    path = tmp_path / "s.keras"
    kss.save_training_state(path, model)
    raw = bytearray(path.read_bytes())
    # an Adam slot of the hidden kernel (2 x 4 x 2048 float32 moments): only in the record member
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(storage.MEMBER)
    with open(path, "rb") as fh:
        start, size = keras_archive.member_span(fh, info)
    at = start + size - 4096  # inside the member's data, past its user block
    raw[at] ^= 0x40
    bad = tmp_path / "bad.keras"
    bad.write_bytes(bytes(raw))
    before = [to_np(v) for v in model.weights + model.optimizer.variables]
    try:
        kss.restore_training_state(bad, model)
    except kss.CorruptCheckpointError as err:
        assert "bad.keras" in str(err)
    else:
        raise AssertionError("a damaged record member was restored")
    for v, want in zip(model.weights + model.optimizer.variables, before, strict=True):
        np.testing.assert_array_equal(to_np(v), want)
