"""Crafted files: nothing runs, nothing outside the file is read, memory stays bounded.

Each file is a well-formed training state edited on purpose (external
storage, links, virtual datasets, size bombs, odd dtypes, pickled attributes,
deep JSON, archive path traversal, a Lambda layer, a swapped byte order) and,
where storage can, resealed (``writer.reseal``) so that the deeper checks are
exercised rather than only the whole-file seal. Every one must be refused with
``CorruptCheckpointError`` or ``CheckpointFormatError`` naming the key or the
file, the live model (variables, optimizer variables, NumPy and Python random
state) untouched; ``keras-stable-state inspect`` and ``verify`` print one line
on stderr, no traceback, and exit non-zero. The Lambda layer and path
traversal cases may also be restored (nothing in them is damaged) as long as
nothing runs and nothing is written.
"""

import json
import os
import pickle
import random
import subprocess
import sys
import zipfile
import zlib

import _records
import h5py
import keras
import numpy as np
import pytest
from conftest import to_np
from kit import ROOT

import keras_stable_state as kss
from keras_stable_state import cli
from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError
from keras_stable_state.format import sandbox, writer
from keras_stable_state.format.record import MEMBER

REFUSALS = (CorruptCheckpointError, CheckpointFormatError)
KERNEL = "path:layers/hidden/kernel"
SECRET = b"TOP-SECRET-local-file-bytes-0123"  # 32 bytes, repeated to fill a (4, 8) float32 kernel


# -- the model and its state ----------------------------------------------------------------
# Its own model: a functional model with an optional Lambda layer, the code a crafted file targets.
def _model(lambda_fn=None):
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    if lambda_fn is not None:
        h = keras.layers.Lambda(lambda_fn, name="hook")(h)
    outputs = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(inputs, outputs, name="crafted")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _trained(m):
    """Built, with its optimizer built and every variable and slot set to a distinct value
    (as after training, without the cost of tracing a train step)."""
    m(np.zeros((1, 4), "float32"))
    m.optimizer.build(m.trainable_variables)
    rng = np.random.default_rng(7)
    for v in list(m.variables) + list(m.optimizer.variables):
        value = to_np(v)
        if value.dtype.kind == "f":
            v.assign(rng.normal(size=value.shape).astype(value.dtype))
        else:
            v.assign((value + 4).astype(value.dtype))
    return m


@pytest.fixture
def model():
    return _trained(_model())


def _state(model):
    out = {f"variable {v.path}": to_np(v) for v in model.variables}
    out.update({f"optimizer {v.path}": to_np(v) for v in model.optimizer.variables})
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy rng"] = (keys.copy(), pos, has_gauss, cached)
    out["python rng"] = random.getstate()
    return out


def _assert_same_state(before, after):
    assert before.keys() == after.keys()
    changed = []
    for name in before:
        a, b = before[name], after[name]
        if isinstance(a, np.ndarray):
            same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        elif name == "numpy rng":
            same = np.array_equal(a[0], b[0]) and a[1:] == b[1:]
        else:
            same = a == b
        if not same:
            changed.append(name)
    assert not changed, f"changed by a refused restore: {changed}"


def _perturb(model):
    """Give every variable another value than the file holds, and reseed the generators."""
    for v in list(model.variables) + list(model.optimizer.variables):
        value = to_np(v)
        v.assign((value + np.ones((), value.dtype)).astype(value.dtype))
    np.random.seed(1234)
    random.seed(5678)


# -- crafting ---------------------------------------------------------------------------------
def _reseal(path):
    """Recompute the whole-file seal after an edit, where storage can (else the seal refuses)."""
    fn = getattr(writer, "reseal", None)
    if fn is not None:
        fn(path)
    return fn is not None


def _forged_crc(key, dtype, data: bytes, shape):
    """The CRC-32 a reader expects for an array (format 2: over key, dtype, shape, bytes)."""
    try:
        from keras_stable_state.format import sandbox

        return sandbox.crc_v2(key, dtype, shape, data)
    except (ImportError, AttributeError):
        return zlib.crc32(data) & 0xFFFFFFFF


def _edit(path, fn, reseal=True):
    """Apply ``fn(h5py.File)`` to the record (the archive member of a ``.keras``), then reseal."""
    path = str(path)
    if path.endswith(".keras"):
        member = path + ".member.h5"
        with zipfile.ZipFile(path) as zin:
            infos = [(info, zin.read(info.filename)) for info in zin.infolist()]
        with open(member, "wb") as fh:
            fh.write(dict((i.filename, d) for i, d in infos)[MEMBER])
        with h5py.File(member, "r+") as f:
            fn(f)
        with open(member, "rb") as fh:
            data = fh.read()
        os.remove(member)
        with zipfile.ZipFile(path, "w") as zout:
            for info, old in infos:
                zout.writestr(info, data if info.filename == MEMBER else old)
    else:
        with h5py.File(path, "r+") as f:
            fn(f)
    if reseal:
        _reseal(path)
    return path


def _record_key(f, key):
    """``key``, or, when the record shares it with Keras' ``model.weights.h5`` (a ``.keras``
    state), the key of its Adam momentum: same shape and dtype, held by the record itself."""
    if "index" in f and isinstance(_records.row_of(f, key)[1][3], str):
        return f"{key}#momentums"
    return key


def _dataset_of(f, key):
    """The HDF5 path of the dataset holding ``key`` (see :func:`_record_key`): its blob
    (format 3) or its dataset."""
    if "index" in f:
        return _records.dataset_of(f, _record_key(f, key))
    for section in ("model", "optimizer", "state"):
        for name, ds in f[section].items():
            if ds.attrs.get("key") == key:
                return f"{section}/{name}"
    raise AssertionError(f"no dataset for {key}")


def _replace(f, key, make, *, crc_over=None):
    """Replace the dataset holding ``key`` by ``make(group, name)``, keeping its attributes;
    ``crc_over``: bytes whose CRC-32 the new dataset claims (a self-consistent forgery)."""
    where = _dataset_of(f, key)
    key = _record_key(f, key) if "index" in f else key
    group_name, name = where.split("/")
    group = f[group_name]
    attrs = {k: group[name].attrs[k] for k in group[name].attrs}
    shape = group[name].shape
    del group[name]
    obj = make(group, name)
    if isinstance(obj, h5py.Dataset):
        for k, v in attrs.items():
            obj.attrs[k] = v
        if crc_over is not None and "crc32" in attrs:
            obj.attrs["crc32"] = _forged_crc(key, str(attrs["dtype"]), crc_over, shape)
    if crc_over is not None and "index" in f:
        # format 3: the index claims the key's bytes are crc_over, at offset 0 of the new object
        index = _records.index(f)
        _, row = _records.row_of(f, key)
        for rows in index.values():
            for r in rows:
                if r[0] == key:
                    r[4] = 0
                    r[5] = f"{sandbox.digest_v3(key, row[1], row[2], crc_over):016x}"
        _records.write_json(f, "index", index)
    return where


def _save(tmp_path, model, ext="h5", name="state"):
    path = tmp_path / f"{name}.{ext}"
    kss.save_training_state(path, model)
    return str(path)


def _secret_file(tmp_path):
    path = tmp_path / "secret.bin"
    path.write_bytes(SECRET * 4)  # 128 bytes: exactly a (4, 8) float32 kernel
    return str(path)


def _secret_h5(tmp_path):
    path = tmp_path / "secret.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", data=np.frombuffer(SECRET * 4, "<f4").reshape(4, 8))
        ds.attrs["key"] = KERNEL
        ds.attrs["dtype"] = "float32"
        ds.attrs["crc32"] = _forged_crc(KERNEL, "float32", SECRET * 4, (4, 8))
    return str(path)


# -- checks ---------------------------------------------------------------------------------
def _names_key_or_file(err, path, names=()):
    message = str(err)
    candidates = [path, os.path.basename(path), *names]
    if getattr(err, "key", None) is not None:
        candidates.append(str(err.key))
    return any(c and c in message for c in candidates)


def _assert_cli_refuses(path, capsys):
    for command in ("inspect", "verify"):
        capsys.readouterr()
        rc = cli.main([command, path])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err, f"{command} printed a traceback:\n{out}{err}"
        if command == "inspect":
            assert rc == cli.EXIT_ERROR, f"inspect exit code {rc}:\n{out}{err}"
        else:
            # verify: 1 = damage found (documented), 2 = a file it cannot read; never 0
            assert rc in (cli.EXIT_DAMAGED, cli.EXIT_ERROR), f"verify exit code {rc}:\n{out}{err}"
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, f"{command}: expected one line on stderr, got:\n{err}"
        assert os.path.basename(path) in lines[0], lines[0]


def _assert_refused(path, model, capsys, *, names=(), must_name=(), allow_cast=False):
    """Restore refuses naming the key or file, the model untouched; the CLI refuses too."""
    _perturb(model)
    before = _state(model)
    with pytest.raises(REFUSALS) as info:
        kss.restore_training_state(path, model, allow_cast=allow_cast)
    err = info.value
    _assert_same_state(before, _state(model))
    assert _names_key_or_file(err, path, names), f"the refusal names neither key nor file: {err}"
    if must_name:
        assert any(n in str(err) for n in must_name), f"the refusal does not name {must_name}: {err}"
    _assert_cli_refuses(path, capsys)
    return err


def _assert_no_secret(model):
    for v in list(model.variables) + list(model.optimizer.variables):
        raw = to_np(v).tobytes()
        assert SECRET[:16] not in raw and SECRET[16:] not in raw, f"{v.path} holds the secret file's bytes"


# -- HDF5 objects that read other files -------------------------------------------------------
@pytest.fixture(params=["h5", "keras"])
def ext(request):
    return request.param


def test_external_storage_is_refused_and_never_read(tmp_path, model, capsys, ext):
    path = _save(tmp_path, model, ext)
    secret = _secret_file(tmp_path)

    def craft(f):
        _replace(
            f,
            KERNEL,
            lambda g, n: g.create_dataset(
                n, shape=(4, 8), dtype="<f4", external=[(secret, 0, h5py.h5f.UNLIMITED)]
            ),
            crc_over=SECRET * 4,
        )

    _edit(path, craft)
    _assert_refused(path, model, capsys, names=(KERNEL, "model/0"))
    _assert_no_secret(model)


def test_virtual_dataset_is_refused(tmp_path, model, capsys, ext):
    path = _save(tmp_path, model, ext)
    source = _secret_h5(tmp_path)

    def craft(f):
        def make(g, n):
            layout = h5py.VirtualLayout(shape=(4, 8), dtype="<f4")
            layout[:] = h5py.VirtualSource(source, "data", shape=(4, 8))
            return g.create_virtual_dataset(n, layout)

        _replace(f, KERNEL, make, crc_over=SECRET * 4)

    _edit(path, craft)
    _assert_refused(path, model, capsys, names=(KERNEL, "model/0"))
    _assert_no_secret(model)


def test_soft_link_in_place_of_a_dataset_is_refused(tmp_path, model, capsys, ext):
    path = _save(tmp_path, model, ext)

    def craft(f):
        where = _dataset_of(f, KERNEL)
        other = _dataset_of(f, "path:layers/hidden/bias")
        del f[where]
        f[where] = h5py.SoftLink("/" + other)

    _edit(path, craft)
    _assert_refused(path, model, capsys, names=("model/0",))


def test_external_link_in_place_of_a_dataset_is_refused(tmp_path, model, capsys, ext):
    path = _save(tmp_path, model, ext)
    other = _secret_h5(tmp_path)

    def craft(f):
        where = _dataset_of(f, KERNEL)
        del f[where]
        f[where] = h5py.ExternalLink(other, "/data")

    _edit(path, craft)
    _assert_refused(path, model, capsys, names=("model/0",))
    _assert_no_secret(model)


# -- dtypes and attributes that are not plain numbers -----------------------------------------
def _odd_dtype_dataset(kind):
    def make(g, n):
        if kind == "vlen-string":
            return g.create_dataset(n, data=np.array(["a", "bc"], dtype=h5py.string_dtype()))
        if kind == "vlen-float":
            ds = g.create_dataset(n, shape=(2,), dtype=h5py.vlen_dtype(np.float32))
            ds[0] = np.arange(3, dtype=np.float32)
            ds[1] = np.arange(5, dtype=np.float32)
            return ds
        if kind == "opaque":
            return g.create_dataset(n, data=np.frombuffer(bytes(range(128)), dtype="V4").reshape(4, 8))
        if kind == "compound":
            dt = np.dtype([("a", "<f4"), ("b", "<i4")])
            return g.create_dataset(n, data=np.zeros((4, 8), dtype=dt))
        if kind == "reference":
            ds = g.create_dataset(n, shape=(2,), dtype=h5py.ref_dtype)
            ds[0] = g.file["model"].ref
            return ds
        if kind == "region-reference":
            target = g.file["metadata"]
            ds = g.create_dataset(n, shape=(1,), dtype=h5py.regionref_dtype)
            ds[0] = target.regionref[0:2]
            return ds
        if kind == "enum":
            dt = h5py.enum_dtype({"A": 0, "B": 1}, basetype="i1")
            return g.create_dataset(n, data=np.zeros((4, 8), dtype="i1"), dtype=dt)
        if kind == "complex":
            return g.create_dataset(n, data=np.zeros((4, 8), dtype=np.complex64))
        raise AssertionError(kind)

    return make


@pytest.mark.parametrize(
    "kind",
    ["vlen-string", "vlen-float", "opaque", "compound", "reference", "region-reference", "enum", "complex"],
)
def test_non_numeric_dtype_is_refused(tmp_path, model, capsys, kind):
    path = _save(tmp_path, model, "h5")
    _edit(path, lambda f: _replace(f, KERNEL, _odd_dtype_dataset(kind)))
    _assert_refused(path, model, capsys, names=(KERNEL, "model/0"))


class _Trap:
    """Unpickling this creates the marker file: it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["extra-attribute", "key-attribute", "root-attribute"])
def test_pickled_attribute_is_never_unpickled(tmp_path, model, capsys, where):
    path = _save(tmp_path, model, "h5")
    marker = tmp_path / "unpickled.txt"
    blob = np.void(pickle.dumps(_Trap(str(marker))))

    def craft(f):
        ds = f[_dataset_of(f, KERNEL)]
        if where == "extra-attribute":
            ds.attrs["payload"] = blob
        elif where == "key-attribute":
            ds.attrs["key"] = blob
        else:
            f.attrs["format_version"] = blob

    _edit(path, craft)
    _assert_refused(path, model, capsys, names=(KERNEL, "model/0", "format_version"))
    assert not marker.exists(), "a pickled attribute was unpickled"


def test_pickled_object_dataset_is_never_unpickled(tmp_path, model, capsys):
    """The bytes of a pickle as a uint8 'array' under a valid key: a plain number array
    of the wrong shape; it is refused and nothing unpickles it."""
    path = _save(tmp_path, model, "h5")
    marker = tmp_path / "unpickled.txt"
    raw = pickle.dumps(_Trap(str(marker)))

    def make(g, n):
        return g.create_dataset(n, data=np.frombuffer(raw, dtype=np.uint8))

    _edit(path, lambda f: _replace(f, KERNEL, make, crc_over=raw))
    _assert_refused(path, model, capsys, names=(KERNEL, "model/0"))
    assert not marker.exists()


# -- byte order and stored type ---------------------------------------------------------------
@pytest.mark.parametrize("allow_cast", [False, True])
@pytest.mark.parametrize("change", ["byte-order-same-bytes", "byte-order-same-values", "float-to-uint"])
def test_stored_type_differing_from_the_record_is_refused(tmp_path, model, capsys, ext, change, allow_cast):
    path = _save(tmp_path, model, ext)

    def craft(f):
        where = _dataset_of(f, KERNEL)
        data = f[where][()]
        if change == "byte-order-same-bytes":
            new = data.view(">f4")  # the stored type's byte-order bit flipped: values byte-swapped
        elif change == "byte-order-same-values":
            new = data.astype(">f4")
        else:
            new = data.view("<u4")
        _replace(f, KERNEL, lambda g, n: g.create_dataset(n, data=new))

    _edit(path, craft)
    _assert_refused(path, model, capsys, must_name=(KERNEL,), allow_cast=allow_cast)


# -- JSON records -----------------------------------------------------------------------------
def _set_record(f, name, text: bytes):
    attrs = {k: f[name].attrs[k] for k in f[name].attrs}
    old_dtype = f[name].dtype
    del f[name]
    if old_dtype == np.uint8:
        data = np.frombuffer(text, dtype=np.uint8)
        ds = f.create_dataset(name, data=data)
        for k, v in attrs.items():
            ds.attrs[k] = v
        if "crc32" in attrs:
            ds.attrs["crc32"] = _forged_crc(name, "json", text, data.shape)
        if "xxh3" in attrs:
            ds.attrs["xxh3"] = np.uint64(sandbox.digest_v3(name, "json", data.shape, data))
    else:  # format 1: a string dataset
        f.create_dataset(name, data=text.decode())


@pytest.mark.parametrize("record", ["metadata", "extra"])
def test_deeply_nested_json_record_is_refused(tmp_path, model, capsys, record):
    path = _save(tmp_path, model, "h5")
    depth = 100_000
    _edit(path, lambda f: _set_record(f, record, b"[" * depth + b"]" * depth))
    _assert_refused(path, model, capsys, names=(record,))


def test_deeply_nested_json_in_the_archive_config_is_refused(tmp_path, model, capsys):
    path = _save(tmp_path, model, "keras")
    depth = 100_000
    with zipfile.ZipFile(path) as zin:
        members = [(info, zin.read(info.filename)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for info, data in members:
            if info.filename == "config.json":
                data = b'{"class_name": ' + b"[" * depth + b"]" * depth + b"}"
            zout.writestr(info, data)
    _assert_refused(path, model, capsys, names=("config.json",))


@pytest.mark.slow
def test_huge_json_record_is_refused(tmp_path, model, capsys):
    """A 6 MB metadata record that is a list, not the object the schema says."""
    path = _save(tmp_path, model, "h5")
    text = json.dumps([0] * 2_000_000).encode()
    _edit(path, lambda f: _set_record(f, "metadata", text))
    _assert_refused(path, model, capsys, names=("metadata",))


# -- archives ---------------------------------------------------------------------------------
@pytest.mark.parametrize("member", ["../evil.txt", "ABSOLUTE", "assets/../../evil.txt"])
def test_path_traversal_member_writes_nothing_outside(tmp_path, model, capsys, member):
    folder = tmp_path / "inner"
    folder.mkdir()
    path = _save(folder, model, "keras")
    outside = tmp_path / "evil.txt"
    absolute = tmp_path / "absolute-evil.txt"
    name = str(absolute) if member == "ABSOLUTE" else member
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(zipfile.ZipInfo(name), b"written outside the archive")
    before_listing = sorted(os.listdir(tmp_path)), sorted(os.listdir(folder))
    _perturb(model)
    before = _state(model)
    try:
        kss.restore_training_state(path, model)
    except REFUSALS as err:
        _assert_same_state(before, _state(model))
        assert _names_key_or_file(err, path, (name,)), str(err)
        _assert_cli_refuses(path, capsys)
    else:  # ignored: the state is restored and the member is not extracted
        for command in ("inspect", "verify"):
            assert cli.main([command, path]) == 0
    for p in (outside, absolute, folder.parent.parent / "evil.txt"):
        assert not p.exists(), f"{p} was written"
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(folder))) == before_listing


def _lambda_trap(marker):
    # A lambda with the path as a constant: Keras stores its bytecode in config.json.
    return eval(f"lambda x: (open({marker!r}, 'w').close(), x)[1]")  # noqa: S307


@pytest.mark.filterwarnings("ignore")
def test_lambda_layer_in_the_archive_never_runs(tmp_path, capsys, monkeypatch):
    """config.json holds a Lambda whose code creates a file; restore and the CLI read the
    training state only: the code never runs and Keras never loads the model unsafely."""
    marker = str(tmp_path / "lambda-ran.txt")
    source = _trained(_model(lambda_fn=_lambda_trap(marker)))
    path = _save(tmp_path, source, "keras")
    os.remove(marker)  # building the model ran the hook; the archive now carries it
    with zipfile.ZipFile(path) as zf:
        assert "Lambda" in zf.read("config.json").decode()
    # The trap is armed: an unsafe load would run it.
    armed = tmp_path / "armed.keras"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(armed, "w") as zout:
        for info in zin.infolist():
            if info.filename != MEMBER:
                zout.writestr(info, zin.read(info.filename))
    keras.saving.load_model(armed, safe_mode=False)(np.zeros((1, 4), "float32"))
    assert os.path.exists(marker)
    os.remove(marker)

    calls = []

    def spy(original):
        def wrapper(*args, **kwargs):
            calls.append(kwargs.get("safe_mode", True))
            return original(*args, **kwargs)

        return wrapper

    from keras.src.saving import saving_api, saving_lib

    for module, name in (
        (keras.saving, "load_model"),
        (keras.models, "load_model"),
        (saving_api, "load_model"),
        (saving_lib, "load_model"),
    ):
        monkeypatch.setattr(module, name, spy(getattr(module, name)))

    live = _trained(_model(lambda_fn=lambda x: x))
    _perturb(live)
    before = _state(live)
    try:
        kss.restore_training_state(path, live)
    except REFUSALS as err:
        _assert_same_state(before, _state(live))
        assert _names_key_or_file(err, path, ("config.json",)), str(err)
    else:
        expected = {f"variable {v.path}": to_np(v) for v in source.variables}
        restored = {f"variable {v.path}": to_np(v) for v in live.variables}
        assert [a.tobytes() for a in expected.values()] == [b.tobytes() for b in restored.values()]
    for command in ("inspect", "verify"):
        capsys.readouterr()
        rc = cli.main([command, path])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        assert rc in (0, cli.EXIT_DAMAGED, cli.EXIT_ERROR)
    assert not os.path.exists(marker), "the Lambda layer's code ran"
    assert False not in calls, "keras.saving.load_model was called with safe_mode=False"


# -- size bombs (in a subprocess: bounded memory is measured, the test process is safe) -------
_BOMB_RUNNER = r"""
import contextlib, io, json, os, random, resource, sys, traceback
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import numpy as np
import keras_stable_state as kss
from keras_stable_state import cli
from keras_stable_state.errors import StateError

keras.utils.set_random_seed(0)
inputs = keras.Input((4,), name="x")
h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h), name="crafted")
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
model(np.zeros((1, 4), "float32"))
pristine, bombs = sys.argv[1], sys.argv[2:]
kss.restore_training_state(pristine, model)  # every lazy import and build done before measuring
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    cli.main(["verify", pristine])
    cli.main(["inspect", pristine])

def vm_kib():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmSize:"))

# Protect the machine: allocations beyond 3 GiB more than now fail with MemoryError.
limit = (vm_kib() + 3 * 2**20) * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

def state():
    out = [keras.ops.convert_to_numpy(v).tobytes() for v in model.variables + model.optimizer.variables]
    return out + [repr(np.random.get_state()), repr(random.getstate())]

results = []
for path in bombs:
    for v in model.variables + model.optimizer.variables:
        value = keras.ops.convert_to_numpy(v)
        v.assign((value + np.ones((), value.dtype)).astype(value.dtype))
    before = state()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = {"path": path}
    try:
        kss.restore_training_state(path, model)
        r["outcome"] = "returned"
    except StateError as err:
        r["outcome"] = "refused"
        r["error"] = f"{type(err).__name__}: {err}"
        r["key"] = None if err.key is None else str(err.key)
    except BaseException as err:
        r["outcome"] = "raw"
        r["error"] = "".join(traceback.format_exception(err))[-3000:]
    r["changed"] = state() != before
    for command in ("verify", "inspect"):
        out, errs = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
                rc = cli.main([command, path])
        except BaseException as err:
            rc = "raised: " + "".join(traceback.format_exception(err))[-2000:]
        r[command] = {"rc": rc, "stdout": out.getvalue()[-2000:], "stderr": errs.getvalue()[-2000:]}
    r["peak_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    results.append(r)
print("KSS-BOMB " + json.dumps(results))
"""
PEAK_LIMIT_MIB = 200
ZERO_BOMB_BYTES = 5 << 30


ZERO_BOMB_CRC32 = 0x193838C3  # zlib.crc32 of ZERO_BOMB_BYTES zero bytes (2 s to compute)


def _zero_segment(chunk):
    """``chunk`` zero bytes as one byte-aligned, history-free, non-final deflate segment:
    repeated, such segments decompress to as many chunks of zeros."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(bytes(chunk)) + c.flush(zlib.Z_FULL_FLUSH)


_FINAL_BLOCK = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # an empty final block


class _FinalBlock:
    """Stands in for zipfile's compressor at close: the stream's last, empty block."""

    @staticmethod
    def flush():
        return _FINAL_BLOCK


def _write_zero_member(zf, name, size=ZERO_BOMB_BYTES, chunk=16 << 20):
    """A deflated member of ``size`` zero bytes, written in well under a second: the
    precomputed segments go straight to the archive, and zipfile's writer is told the
    sizes and CRC-32 it would have counted (its headers are then written as usual)."""
    assert size % chunk == 0 and size == ZERO_BOMB_BYTES
    info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    segment = _zero_segment(chunk)
    with zf.open(info, "w", force_zip64=True) as w:
        for _ in range(size // chunk):
            w._fileobj.write(segment)
        w._compress_size = len(segment) * (size // chunk)
        w._file_size = size
        w._crc = ZERO_BOMB_CRC32
        w._compressor = _FinalBlock()


def _zip_bomb(pristine, out, replace_member):
    with zipfile.ZipFile(pristine) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            if replace_member and info.filename == MEMBER:
                continue
            zout.writestr(info, zin.read(info.filename))
        _write_zero_member(zout, MEMBER if replace_member else "assets/zeros.bin")
    with zipfile.ZipFile(out) as z:  # a real bomb: declared 5 GiB, readable zeros
        name = MEMBER if replace_member else "assets/zeros.bin"
        assert z.getinfo(name).file_size == ZERO_BOMB_BYTES
        with z.open(name) as fh:
            assert fh.read(1 << 20) == bytes(1 << 20)
    assert os.path.getsize(out) < 64 << 20
    return str(out)


def _h5_bomb(pristine, out, layout):
    with open(pristine, "rb") as src, open(out, "wb") as dst:
        dst.write(src.read())
    n = 1_500_000_000

    def make(g, name):
        if layout == "chunked":
            return g.create_dataset(name, shape=(n,), dtype="<f4", chunks=(1 << 20,), maxshape=(None,))
        return g.create_dataset(name, shape=(n,), dtype="<f4")  # contiguous, never written

    _edit(str(out), lambda f: _replace(f, KERNEL, make))
    assert os.path.getsize(out) < 1 << 20
    return str(out)


@pytest.mark.slow
def test_size_bombs_are_refused_with_bounded_memory(tmp_path, model):
    pristine = _save(tmp_path, model, "h5")
    pristine_keras = _save(tmp_path, model, "keras")
    bombs = [
        _h5_bomb(pristine, tmp_path / "chunked-bomb.h5", "chunked"),
        _h5_bomb(pristine, tmp_path / "contiguous-bomb.h5", "contiguous"),
        _zip_bomb(pristine_keras, tmp_path / "member-bomb.keras", replace_member=True),
        _zip_bomb(pristine_keras, tmp_path / "extra-bomb.keras", replace_member=False),
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", _BOMB_RUNNER, pristine, *bombs],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("KSS-BOMB ")), None)
    assert line is not None, f"runner died (exit {done.returncode}):\n{done.stderr[-4000:]}"
    problems = []
    for r in json.loads(line[len("KSS-BOMB ") :]):
        name = os.path.basename(r["path"])
        if r["outcome"] != "refused":
            problems.append(f"{name}: restore {r['outcome']} {r.get('error', '')}")
        elif not (r["path"] in r["error"] or name in r["error"]):
            problems.append(f"{name}: the refusal does not name the file: {r['error']}")
        if not r["error"].startswith(("CorruptCheckpointError", "CheckpointFormatError")):
            problems.append(f"{name}: refused with {r['error'][:200]}")
        if r["changed"]:
            problems.append(f"{name}: the refused restore changed the model or the random state")
        for command in ("verify", "inspect"):
            c = r[command]
            ok_codes = (cli.EXIT_ERROR,) if command == "inspect" else (cli.EXIT_DAMAGED, cli.EXIT_ERROR)
            if c["rc"] not in ok_codes or "Traceback" in c["stdout"] + c["stderr"]:
                problems.append(f"{name}: {command} exit {c['rc']}: {c['stdout']}{c['stderr']}")
            elif len([x for x in c["stderr"].splitlines() if x.strip()]) != 1:
                problems.append(f"{name}: {command} printed not one line on stderr: {c['stderr']}")
        if r["peak_growth_mib"] > PEAK_LIMIT_MIB:
            problems.append(f"{name}: peak memory grew by {r['peak_growth_mib']:.0f} MiB")
    assert not problems, "\n".join(problems)


def test_zero_segments_make_a_valid_deflate_stream():
    """The segments the zip bomb is made of decompress to the zeros it declares."""
    segment = _zero_segment(1 << 16)
    d = zlib.decompressobj(-15)
    assert d.decompress(segment * 3 + _FINAL_BLOCK) == bytes(3 << 16) and d.eof
