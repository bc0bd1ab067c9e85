"""What a restore reads, and into what: a sealed file is read once, whole, and its arrays are
views of that buffer at 64-byte aligned offsets (which a variable may then keep without a
copy, unless it would keep a buffer mostly unused, or shares memory with another array),
and a ``.keras`` restore reads the record member and Keras' weights member in place, each
checked by its hash, never through zip's reader nor again for its zip CRC-32."""

import zipfile

import numpy as np
import pytest
from conftest import to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state.format import keras_archive
from keras_stable_state.format.record import MEMBER, PACK_LIMIT


def _trained(data, hidden=64):
    x, y = data
    model = mlp(4, hidden, named=True, seed=5)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    return model


def test_arrays_read_from_a_file_are_aligned_and_writable(tmp_path, data):
    model = _trained(data, hidden=(8192,))  # a 4 x 8192 kernel (128 KiB): a blob of its own
    kss.save_training_state(tmp_path / "s.h5", model)
    record = format.read_file(tmp_path / "s.h5")
    kernel = record.model["path:layers/hidden/kernel"]
    np.testing.assert_array_equal(kernel, to_np(model.get_layer("hidden").kernel))
    big = [a for a in [*record.model.values(), *record.optimizer.values()] if a.nbytes > PACK_LIMIT]
    assert big, "no array large enough for a blob of its own"
    for array in big:
        assert array.ctypes.data % 64 == 0 and array.flags.writeable and array.flags.c_contiguous


def test_keras_restore_reads_its_hashed_members_in_place(tmp_path, data, monkeypatch):
    model = _trained(data)
    path = tmp_path / "s.keras"
    kss.save_training_state(path, model)
    with zipfile.ZipFile(path) as zf:
        names = {i.filename: i.compress_type for i in zf.infolist()}
    assert names[MEMBER] == zipfile.ZIP_STORED and keras_archive.MEMBER in names
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
    assert MEMBER not in opened and keras_archive.MEMBER not in opened, opened
    assert "config.json" in opened  # the members no hash covers are still read for their CRC-32


def test_keras_record_member_damaged_in_place_is_refused_by_its_seal(tmp_path, data):
    model = _trained(data, hidden=(2048,))
    path = tmp_path / "s.keras"
    kss.save_training_state(path, model)
    raw = bytearray(path.read_bytes())
    # an Adam slot of the hidden kernel (2 x 4 x 2048 float32 moments): only in the record member
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(MEMBER)
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


@pytest.mark.parametrize("suffix", ["h5", "keras"])
def test_a_restore_reads_the_file_once_whole(tmp_path, data, suffix):
    """Every array comes from the bytes read while the seals were checked (a ``.keras``:
    the record member's and Keras' weights member's): the file emptied on disk after
    opening changes nothing of what is read (model and optimizer, by position, against
    the saved values)."""
    model = _trained(data, hidden=(8192,))
    path = tmp_path / f"s.{suffix}"
    kss.save_training_state(path, model)
    saved = [to_np(v) for v in model.weights]
    slots = {v.path: to_np(v) for v in model.optimizer.variables}
    with format.CheckpointFile(str(path), whole=True) as f:
        with open(path, "r+b") as fh:  # the same file, emptied in place
            fh.truncate(0)
        got = {e.key: f.read(e) for e in f.entries if e.section == "model"}
        optimizer = [f.read(e) for e in f.entries if e.section == "optimizer"]
    assert len(got) == len(saved)
    for want, array in zip(saved, got.values(), strict=True):
        np.testing.assert_array_equal(array, want)
    big = [a for a in slots.values() if a.nbytes > PACK_LIMIT]
    assert len(big) == 2  # the hidden kernel's two Adam moments, both among those read
    for want in big:
        assert any(a.shape == want.shape and np.array_equal(a, want) for a in optimizer)


def _variables_on_cpu() -> bool:
    """Whether Keras' backend keeps variables in host memory here (no accelerator)."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        return not torch.cuda.is_available()
    if backend == "jax":
        import jax

        return jax.default_backend() == "cpu"
    import tensorflow as tf

    return not tf.config.list_physical_devices("GPU")


def _image_of_next_restore(monkeypatch):
    """Weak references to the memory of the images the next whole read makes (``refs[i]()``:
    the array that owns each, which every view of it keeps alive): the record's, and a
    ``.keras`` archive's Keras weights member's."""
    import weakref

    from keras_stable_state.format import image

    refs = []
    real = image.read_hashed

    def watch(*args, **kwargs):
        buffer = real(*args, **kwargs)
        owner = buffer
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        refs.append(weakref.ref(owner))
        return buffer

    monkeypatch.setattr(image, "read_hashed", watch)
    return refs


def test_a_partial_restore_keeps_no_view_of_the_whole_file(tmp_path, data, monkeypatch):
    """Variables keep the read image as their memory only where they take at least half
    of it: a model restored from a file mostly made of another layer's arrays gets copies,
    and the image is freed after the restore; a whole restore keeps it (the variables are
    views of it). Values are compared by position with the saved ones."""
    import gc

    import keras

    x, y = data
    keras.utils.set_random_seed(3)
    small = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")])
    big = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(1, name="out"), keras.layers.Dense(65536, name="wide")]
    )
    for m in (small, big):
        m.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=m), loss="mse")
    big.fit(x, np.zeros((len(x), 65536), "float32"), epochs=1, batch_size=16, verbose=0)
    path = tmp_path / "big.h5"
    kss.save_training_state(path, big)
    want = [to_np(v) for v in big.get_layer("out").weights]
    small.fit(x, y, epochs=1, batch_size=16, verbose=0)
    refs = _image_of_next_restore(monkeypatch)
    kss.restore_training_state(path, small, strict=False)
    gc.collect()
    assert len(refs) == 1 and refs[0]() is None, "a variable keeps the whole file's image alive"
    for v, w in zip(small.get_layer("out").weights, want, strict=True):
        np.testing.assert_array_equal(to_np(v), w)
    refs = _image_of_next_restore(monkeypatch)
    kss.restore_training_state(path, big)
    gc.collect()
    assert len(refs) == 1
    if _variables_on_cpu():  # on an accelerator the values are copied there and the image freed
        assert refs[0]() is not None, "a whole restore copied what it could keep"


def test_a_file_that_ends_sooner_than_its_size_is_damaged_naming_it():
    """The whole read stops at the end of the file's bytes: a file shorter when read than
    when measured is refused as damaged, naming it, with the bytes expected and read."""
    import io

    import xxhash

    from keras_stable_state.format import image

    data = bytes(range(256)) * 100_000  # 25.6 MB: hashed in another thread as it is read
    h = xxhash.xxh3_128()
    got = image.read_hashed(io.BytesIO(data), len(data), h, "whole.h5", skip=512)
    assert got.tobytes() == data and got.ctypes.data % 64 == 0
    assert h.hexdigest() == xxhash.xxh3_128(data[512:]).hexdigest()
    for size in (1000, len(data)):  # hashed in this thread / in another
        with pytest.raises(kss.CorruptCheckpointError, match="cut.h5") as err:
            image.read_hashed(io.BytesIO(data[: size - 7]), size, xxhash.xxh3_128(), "cut.h5")
        assert (err.value.expected, err.value.received) == (size, size - 7)


@pytest.mark.parametrize("suffix", ["h5", "keras"])
def test_misaligned_arrays_are_kept_as_views_only_where_the_backend_can(tmp_path, data, monkeypatch, suffix):
    """A record written before the writer aligned its arrays (the writer's alignment is
    turned off here), and Keras' own weights member of a ``.keras`` (never aligned): Torch
    keeps views of the file's image at any offset; TensorFlow and JAX, which would copy
    every such view while the image is held (twice the state at the peak), get arrays
    read one by one into aligned memory: Keras' member is not read whole, and a
    misaligned record's image is dropped before the values are assigned. Values are
    compared by position with the saved ones on every backend."""
    import gc

    import h5py
    import keras

    from keras_stable_state._core import plan
    from keras_stable_state.format import writer

    monkeypatch.setattr(writer, "DATA_ALIGN_ABOVE", 1 << 62)
    model = mlp(4, (8192, 64), seed=5)  # kernels of 128 KiB and 2 MiB, with their Adam moments
    model.fit(*data, epochs=1, batch_size=8, verbose=0)
    path = tmp_path / f"s.{suffix}"
    kss.save_training_state(path, model)
    if suffix == "h5":
        with h5py.File(path, "r") as f:
            offsets = [f[f"model/{n}"].id.get_offset() for n in f["model"]]
        assert any(o % 64 for o in offsets if o is not None), "the arrays happen to be aligned"
    saved = [to_np(v) for v in model.weights]
    for v in model.weights:
        v.assign(np.zeros(tuple(v.shape), to_np(v).dtype))
    refs = _image_of_next_restore(monkeypatch)
    held = []  # whether each image read is still held when the assignments start
    real_apply = plan.apply_steps

    def watch(*args, **kwargs):
        gc.collect()
        held.append([r() is not None for r in refs])
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(plan, "apply_steps", watch)
    kss.restore_training_state(path, model)
    for v, want in zip(model.weights, saved, strict=True):
        np.testing.assert_array_equal(to_np(v), want)
    (during,) = held
    if keras.backend.backend() == "torch":  # the record's image, and Keras' member's
        assert len(refs) == (2 if suffix == "keras" else 1), len(refs)
        assert all(during) or not _variables_on_cpu(), during
    elif suffix == "keras":  # Keras' member never read whole (the record's image: misaligned
        # here too, so dropped again before the assignments)
        assert len(refs) == 1, f"Keras' weights member was read whole on {keras.backend.backend()}"
        assert not any(during), f"an image is held on {keras.backend.backend()}"
    else:  # the misaligned record opened again, read array by array
        assert len(refs) == 1 and not any(during), f"an image is held on {keras.backend.backend()}"


@pytest.mark.parametrize("writer", ["now", "before"])
@pytest.mark.parametrize("unaligned_views", [True, False])
def test_equal_arrays_read_from_one_dataset_do_not_share_memory(
    tmp_path, monkeypatch, unaligned_views, writer
):
    """Equal arrays of a ``.keras`` (two fresh zero biases; their Adam moments) each refer to
    a dataset of their own in Keras' weights member; a file written before they did
    ("before": rows of equal arrays refer to one dataset) is read with a copy for each
    repeat. Either way each array read has memory of its own, so a restored variable
    updated in place leaves the other as it was (by position)."""
    import keras

    from keras_stable_state.format import keras_archive

    if writer == "before":
        monkeypatch.setattr(
            keras_archive.KerasWeights,
            "find",
            lambda self, a: (self.by_content.get(keras_archive.content_key(a)) or [None])[0],
        )
    keras.utils.set_random_seed(7)
    x = keras.Input((4,))
    y = keras.layers.Add()([keras.layers.Dense(20000, name="a")(x), keras.layers.Dense(20000, name="b")(x)])
    model = keras.Model(x, y)
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model), loss="mse")
    model.optimizer.build(model.trainable_variables)
    path = tmp_path / "twins.keras"
    kss.save_training_state(path, model)
    with format.open_file(path) as f:
        refs = [e.dataset for e in f.entries if e.shape == (20000,)]
    assert len(refs) == 6 and all(r.startswith(keras_archive.PREFIX) for r in refs)
    assert len(set(refs)) == (6 if writer == "now" else 1), refs
    record = format.read_file(path, unaligned_views=unaligned_views)
    arrays = [*record.model.values(), *record.optimizer.values()]
    zeros = [a for a in arrays if a.nbytes > PACK_LIMIT and not a.any() and a.shape == (20000,)]
    assert len(zeros) == 6  # two biases and their two Adam moments each
    for i, a in enumerate(zeros):
        for b in zeros[i + 1 :]:
            assert not np.shares_memory(a, b)
    kss.restore_training_state(path, model)
    model.get_layer("a").bias.assign(np.full((20000,), 3.0, "float32"))
    np.testing.assert_array_equal(to_np(model.get_layer("b").bias), np.zeros((20000,), "float32"))
    np.testing.assert_array_equal(to_np(model.get_layer("a").bias), np.full((20000,), 3.0, "float32"))


def test_an_error_of_the_hashing_thread_is_raised_by_the_read():
    """Past 8 MiB another thread hashes while the file is read: its error is the read's
    error (not a digest that merely fails, which would call the file damaged)."""
    import io

    from keras_stable_state.format import image

    class Refusing:
        calls = 0

        def update(self, data):
            Refusing.calls += 1
            if Refusing.calls == 2:
                raise ValueError("hasher refused")

    data = bytes(64 << 20)
    with pytest.raises(ValueError, match="hasher refused"):
        image.read_hashed(io.BytesIO(data), len(data), Refusing(), "big.h5")
    assert Refusing.calls == 2  # no chunk was hashed after the error
