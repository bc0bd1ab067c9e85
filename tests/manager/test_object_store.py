"""Object stores through fsspec, against a real S3-compatible server (moto's S3 in server
mode, tests/scripts/s3_server.py, on 127.0.0.1) reached by s3fs: save, restore, the command
line, commit markers, a kill mid-upload, checkpoint directories (CheckpointManager and
StableCheckpoint: markers, pruning, left-overs, the lock object, a writer killed at random
moments), a scheme without its implementation, and the old bug (a URL used as a local path: a folder ``./gs:/bucket``) never coming back.

Every s3fs client here has dummy credentials, the server's endpoint and the instance
metadata service turned off, so nothing leaves the machine. Google Cloud Storage is only
ever exercised with gcsfs hidden (a child process whose ``sys.modules['gcsfs']`` is None).
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from kit import ROOT, TESTS, StopAt, assert_same_state, mlp

import keras_stable_state as kss
from keras_stable_state import format
from keras_stable_state._engines import object_store
from keras_stable_state.errors import StorageBackendError
from keras_stable_state.format import urls
from keras_stable_state.format.atomic import atomic_path
from keras_stable_state.format.files import fs_path
from keras_stable_state.format.writer import write_record

pytest.importorskip("s3fs", reason="the [cloud] extra (s3fs) is not installed")
pytest.importorskip("moto", reason="moto (the dev extra's S3 server) is not installed")

# A test whose every backend-dependent step runs in a JAX child (whatever this pass's backend)
# repeats the same thing in every pass: it runs once, in the jax pass.
JAX_CHILD_ONLY = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="what it checks runs in a JAX child process whatever the pass: run once, in the jax pass",
)

SERVER = os.path.join(TESTS, "scripts", "s3_server.py")
_DUMMY = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254 for credentials
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The S3 server: ``(endpoint URL, flag file of the kill hook)``; stopped after the module."""
    flag = str(tmp_path_factory.mktemp("s3") / "upload-part-started")
    proc = subprocess.Popen(
        [sys.executable, SERVER, flag, "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"the S3 server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}", flag
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


def _env(endpoint):
    return {**_DUMMY, "AWS_ENDPOINT_URL": endpoint}


@pytest.fixture
def bucket(server, monkeypatch):
    """A new bucket on the server, reached through ``AWS_ENDPOINT_URL`` (the environment, as
    a user would configure it); its name."""
    import s3fs

    endpoint, _ = server
    for name, value in _env(endpoint).items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # instances made under another environment
    name = f"kss-{secrets.token_hex(4)}"
    s3fs.S3FileSystem().mkdir(name)
    yield name
    s3fs.S3FileSystem.clear_instance_cache()


def _trained(seed=0, steps=2, **kwargs):
    """A model whose optimizer took ``steps`` steps of random gradients (no compiled train
    step: the state is as real as fit's, at a fraction of the time)."""
    model = mlp(seed=seed, **kwargs)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        grads = [
            keras.ops.convert_to_tensor(rng.normal(size=v.shape).astype("float32"))
            for v in model.trainable_variables
        ]
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return model


def _fresh(seed=1):
    model = mlp(seed=seed)
    model.optimizer.build(model.trainable_variables)
    return model


def _objects(bucket_name):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sorted(p.split("/", 1)[1] for p in fs.find(bucket_name))


def _no_scheme_folder(folder):
    found = [n for n in os.listdir(folder) if n.endswith(":")]
    assert found == [], f"a local folder named after a URL scheme was made: {found}"


# -- the old bug: a URL is never a local path ------------------------------------------------
@pytest.mark.parametrize("url", ["s3://bucket/ckpts", "memory://kss-ckpts", "az://c/ckpts"])
def test_directories_with_a_scheme_make_no_local_folder(url, tmp_path, monkeypatch):
    """A directory URL is the store's (az:// without adlfs is refused naming it); never a
    local folder named after the scheme, and nothing is written on construction."""
    import importlib.util

    monkeypatch.chdir(tmp_path)
    for make in (kss.StableCheckpoint, kss.CheckpointManager):
        if url.startswith("az://") and importlib.util.find_spec("adlfs") is None:
            with pytest.raises(StorageBackendError, match=r"adlfs, which is not installed"):
                make(url)
        else:
            assert make(url).directory == url
    with pytest.raises(
        kss.CheckpointFormatError, match=r"`storage_options` of CheckpointManager .* local path"
    ):
        kss.CheckpointManager(str(tmp_path / "ck"), storage_options={"anon": True})
    _no_scheme_folder(tmp_path)
    assert os.listdir(tmp_path) == []


def test_an_orbax_directory_in_an_object_store_is_refused(tmp_path, monkeypatch):
    """``*.orbax`` step folders are written by the Orbax engine on a local (or mounted) file
    system: in an object store they are refused on construction, nothing written."""
    pytest.importorskip("orbax.checkpoint", reason="the .orbax engine needs the [orbax] extra")
    monkeypatch.chdir(tmp_path)
    for make in (kss.StableCheckpoint, kss.CheckpointManager):
        with pytest.raises(ValueError, match=r"memory://kss-run\.orbax.*not in an object store"):
            make("memory://kss-run.orbax")
    import fsspec

    assert not fsspec.filesystem("memory").exists("/kss-run.orbax")
    assert os.listdir(tmp_path) == []


def test_stable_checkpoint_takes_a_file_url_as_its_local_path(tmp_path):
    cb = kss.StableCheckpoint((tmp_path / "ck").as_uri())
    assert cb.directory == str(tmp_path / "ck")


@pytest.mark.backend_free
@pytest.mark.parametrize("url", ["s3://bucket/run.h5", "gs://bucket/run.h5", "memory://run.keras"])
def test_local_only_doors_refuse_urls(url, tmp_path, monkeypatch):
    """The writer, the atomic write, the reader's file door and fs_path never take a URL."""
    monkeypatch.chdir(tmp_path)
    record = format.StateRecord(metadata={}, contract=[], model={}, optimizer={}, extra={}, arrays={})
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL .*not a local path"):
        write_record(url, record)
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL"):
        atomic_path(url)
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL"):
        format.CheckpointFile(url)
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL"):
        fs_path(url)
    assert fs_path(url, urls=True) == url
    _no_scheme_folder(tmp_path)


@pytest.mark.backend_free
def test_url_detection():
    for url in ("s3://b/k", "gs://b", "file:///x", "memory://x", "simplecache::s3://b/k", "git+ssh://h/x"):
        assert urls.is_url(url), url
    for path in ("run.h5", "/data/s3:/x", "./gs:/b", "s3:/b/k", "c:/x", "a/b://c"):
        assert not urls.is_url(path), path
    assert urls.scheme_of("simplecache::s3://b/k") == "simplecache"
    assert urls.resolve("file:///data/a%20b.h5") == "/data/a b.h5"
    assert urls.resolve("file://localhost/data/x.h5") == "/data/x.h5"
    with pytest.raises(kss.CheckpointFormatError, match=r"on host 'elsewhere'"):
        urls.resolve("file://elsewhere/x.h5")
    assert not urls.is_remote("file:///x") and urls.is_remote("s3://b/k")


def test_save_and_restore_through_a_file_url(tmp_path):
    model = _trained()
    path = tmp_path / "run.h5"
    assert kss.save_training_state(path.as_uri(), model) == str(path)
    assert path.is_file()
    target = _fresh()
    kss.restore_training_state(path.as_uri(), target)
    assert_same_state(model, target)


def test_s3_save_makes_no_local_folder(bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _trained()
    kss.save_training_state(f"s3://{bucket}/run.h5", model)
    _no_scheme_folder(tmp_path)
    assert os.listdir(tmp_path) == []
    assert _objects(bucket) == ["run.h5"]


# -- save / restore against the server --------------------------------------------------------
@pytest.mark.parametrize("ext", [".h5", ".keras"])
def test_roundtrip_through_s3(bucket, ext):
    model = _trained()
    url = f"s3://{bucket}/runs/run{ext}"
    assert kss.save_training_state(url, model) == url
    assert _objects(bucket) == [f"runs/run{ext}"]
    target = _fresh()
    kss.restore_training_state(url, target)
    assert_same_state(model, target)


def test_storage_options_and_fsspec_config_are_honoured(bucket, server, monkeypatch):
    import fsspec.config
    import s3fs

    endpoint, _ = server
    model = _trained()
    url = f"s3://{bucket}/opts.h5"
    kss.save_training_state(url, model)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3fs.S3FileSystem.clear_instance_cache()
    # storage_options: the endpoint passed to the filesystem
    target = _fresh()
    kss.restore_training_state(url, target, storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    assert_same_state(model, target)
    # fsspec's own configuration, left as the user set it
    monkeypatch.setitem(fsspec.config.conf, "s3", {"client_kwargs": {"endpoint_url": endpoint}})
    s3fs.S3FileSystem.clear_instance_cache()
    other = _trained(seed=5)
    kss.save_training_state(url, other)
    target = _fresh()
    kss.restore_training_state(url, target)
    assert_same_state(other, target)


def test_storage_options_are_checked(bucket, tmp_path):
    model = _trained()
    with pytest.raises(TypeError, match=r"`storage_options` must be a dict"):
        kss.save_training_state(f"s3://{bucket}/x.h5", model, storage_options=["anon"])
    with pytest.raises(kss.CheckpointFormatError, match=r"is a local path"):
        kss.save_training_state(str(tmp_path / "x.h5"), model, storage_options={"anon": True})
    with pytest.raises(kss.CheckpointFormatError, match=r"use a '.keras' or '.h5' extension"):
        kss.save_training_state(f"s3://{bucket}/x.ckpt", model)
    with pytest.raises(kss.CheckpointFormatError, match=r"does not support yet"):
        kss.save_training_state(f"s3://{bucket}/x.orbax", model)
    assert _objects(bucket) == []


def test_background_save_to_s3(bucket):
    model = _trained()
    url = f"s3://{bucket}/async.h5"
    handle = kss.save_training_state(url, model, blocking=False)
    assert handle.wait() == url
    assert handle.nbytes == object_store.RemotePath(url).size()
    target = _fresh()
    kss.restore_training_state(url, target)
    assert_same_state(model, target)


def test_missing_and_damaged_objects_are_refused(bucket):
    model = _trained()
    url = f"s3://{bucket}/run.h5"
    with pytest.raises(FileNotFoundError, match=rf"No training-state object at '{url}'"):
        kss.restore_training_state(url, _fresh())
    kss.save_training_state(url, model)
    data = object_store.RemotePath(url).read_bytes()
    damaged = f"s3://{bucket}/damaged.h5"
    object_store.RemotePath(damaged).put_bytes(data[: len(data) // 2])
    target = _fresh()
    before = [np.array(v) for v in target.weights]
    with pytest.raises(kss.CorruptCheckpointError, match=rf"{damaged}"):
        kss.restore_training_state(damaged, target)
    for old, v in zip(before, target.weights, strict=True):
        np.testing.assert_array_equal(old, np.array(v))
    with pytest.raises(kss.CheckpointFormatError, match=r"is a folder of objects"):
        kss.restore_training_state(f"s3://{bucket}", _fresh())


@pytest.mark.slow
def test_cli_reads_s3_objects(bucket, server):
    endpoint, _ = server
    a, b = _trained(seed=0), _trained(seed=3)
    url_a, url_b = f"s3://{bucket}/a.h5", f"s3://{bucket}/b.keras"
    kss.save_training_state(url_a, a)
    kss.save_training_state(url_b, b)
    env = {**os.environ, **_env(endpoint), "PYTHONPATH": ROOT}

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "keras_stable_state", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    verify = cli("verify", "--json", url_a)
    assert verify.returncode == 0, verify.stderr
    result = json.loads(verify.stdout)
    assert result["ok"] and result["file"] == url_a and result["arrays_checked"] > 0
    diff = cli("diff", "--json", url_a, url_b)
    assert diff.returncode in (0, 1), diff.stderr  # 1 once diff exits 1 for differing states (issue 18)
    compared = json.dumps(json.loads(diff.stdout))
    assert url_a in compared and url_b in compared
    missing = cli("inspect", f"s3://{bucket}/none.h5")
    assert missing.returncode == 2 and f"s3://{bucket}/none.h5" in missing.stderr


# -- the building block of a checkpoint directory ----------------------------------------------
@pytest.mark.backend_free
def test_remote_folder_and_commit_markers(bucket):
    folder = object_store.RemotePath(f"s3://{bucket}/ckpts")
    assert folder.list() == [] and object_store.read_marker(folder, "ckpt-1.done") is None
    folder.child("ckpt-1.h5").put_bytes(b"one")
    folder.child("ckpt-2.h5").put_bytes(b"two")
    object_store.RemotePath(f"s3://{bucket}/ckpts/sub/deeper.h5").put_bytes(b"x")
    object_store.write_marker(folder, "ckpt-1.done", {"step": 1, "size": 3})
    assert folder.list() == ["ckpt-1.done", "ckpt-1.h5", "ckpt-2.h5"]
    assert object_store.read_marker(folder, "ckpt-1.done") == {"step": 1, "size": 3}
    assert object_store.read_marker(folder, "ckpt-2.done") is None
    with folder.child("ckpt-2.h5").open_read() as fh:
        assert fh.read() == b"two"
    folder.child("ckpt-2.done").put_bytes(b"{not json")
    with pytest.raises(kss.CorruptCheckpointError, match=r"ckpt-2.done' is damaged: it is not JSON"):
        object_store.read_marker(folder, "ckpt-2.done")
    folder.child("ckpt-2.h5").remove()
    folder.child("ckpt-2.h5").remove()  # missing_ok
    with pytest.raises(FileNotFoundError, match=r"No object at"):
        folder.child("ckpt-2.h5").remove(missing_ok=False)
    assert folder.list() == ["ckpt-1.done", "ckpt-1.h5", "ckpt-2.done"]
    assert folder.child("ckpt-1.h5").is_object() and not folder.is_object() and folder.exists()


# -- children: a kill mid-upload, a scheme without its implementation ---------------------------
_BIG_SAVE = """
import keras, numpy as np, keras_stable_state as kss
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6000,)), keras.layers.Dense(4600, use_bias=False)])
kss.save_training_state({url!r}, model, include_rng=False)  # 110 MB: a multipart upload
print("SAVED", flush=True)
"""


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="the upload killed is a JAX child's, the same in every pass (this backend's own S3 save "
    "and restore: test_roundtrip_through_s3): run once, in the jax pass",
)
@pytest.mark.slow
def test_kill_mid_upload_leaves_the_previous_object(bucket, server, tmp_path):
    """A save killed while its multipart upload is under way leaves the previous whole object
    (restored exactly) and no other object under the prefix. The writer runs on JAX (it
    starts fastest; what is killed is the upload, the same on every backend), its local
    temporary file under ``tmp_path`` (a SIGKILLed process cannot remove it)."""
    endpoint, flag = server
    if os.path.exists(flag):
        os.remove(flag)
    url = f"s3://{bucket}/kill-me/run.h5"
    model = _trained()
    kss.save_training_state(url, model)
    previous = object_store.RemotePath(url).size()
    child = subprocess.Popen(
        [sys.executable, "-c", _BIG_SAVE.format(url=url)],
        env={
            **os.environ,
            **_env(endpoint),
            "PYTHONPATH": ROOT,
            "KERAS_BACKEND": "jax",
            "TMPDIR": str(tmp_path),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(flag) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(flag), f"no multipart upload started: {child.communicate(timeout=60)}"
        child.send_signal(signal.SIGKILL)
    finally:
        out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL and "SAVED" not in out, err
    assert _objects(bucket) == ["kill-me/run.h5"]
    assert object_store.RemotePath(url).size() == previous
    target = _fresh()
    kss.restore_training_state(url, target)
    assert_same_state(model, target)


_HIDDEN = """
import sys
sys.modules["gcsfs"] = None  # gcsfs is not installed, as far as this process can tell
"""

_GS_CHILD = """
import json, os, keras, keras_stable_state as kss
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
results = {}
for name, call in [
    ("save", lambda: kss.save_training_state("gs://bucket/run.h5", model)),
    ("restore", lambda: kss.restore_training_state("gs://bucket/run.h5", model)),
    ("checkpoint", lambda: kss.StableCheckpoint("gs://bucket/ckpts")),
    ("manager", lambda: kss.CheckpointManager("gs://bucket/ckpts")),
]:
    try:
        call()
        results[name] = None
    except Exception as err:
        results[name] = [type(err).__name__, isinstance(err, kss.StateError),
                         isinstance(err, ImportError), str(err)]
from keras_stable_state.cli import main
results["cli"] = main(["verify", "gs://bucket/run.h5"])
results["listdir"] = os.listdir(".")
print("RESULT", json.dumps(results))
"""


@pytest.mark.backend_free
@JAX_CHILD_ONLY
@pytest.mark.slow
def test_gs_without_gcsfs_is_refused_naming_the_extra(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDDEN)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, **_DUMMY, "PYTHONPATH": os.pathsep.join([str(site), ROOT])}
    env["KERAS_BACKEND"] = "jax"  # the refusal comes before any backend code; JAX starts fastest
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_GS_CHILD)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    line = next((x for x in child.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, child.stderr
    results = json.loads(line[len("RESULT ") :])
    for name, url in [("save", "gs://bucket/run.h5"), ("restore", "gs://bucket/run.h5"),
                      ("checkpoint", "gs://bucket/ckpts"), ("manager", "gs://bucket/ckpts")]:  # fmt: skip
        kind, is_state, is_import, message = results[name]
        assert (kind, is_state, is_import) == ("StorageBackendError", True, True), results[name]
        assert "gcsfs" in message and 'pip install "keras-stable-state[cloud]"' in message, message
        assert url in message
    assert results["listdir"] == []
    assert results["cli"] == 2
    assert "gcsfs" in child.stderr and "keras-stable-state[cloud]" in child.stderr, child.stderr
    assert os.listdir(work) == []


def test_a_scheme_without_its_package_is_refused_naming_it(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("adlfs") is not None:  # in no extra of this project
        pytest.skip("adlfs is installed")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageBackendError, match=r"adlfs, which is not installed") as caught:
        kss.save_training_state("az://container/run.h5", _trained())
    err = caught.value
    assert isinstance(err, ImportError) and isinstance(err, kss.StateError)
    assert (err.scheme, err.package, err.path) == ("az", "adlfs", "az://container/run.h5")
    assert 'pip install "keras-stable-state[cloud]" adlfs' in str(err)
    with pytest.raises(StorageBackendError, match=r"no installed fsspec implementation knows"):
        kss.restore_training_state("nosuchscheme://x/y.h5", _fresh())
    _no_scheme_folder(tmp_path)
    assert os.listdir(tmp_path) == []


# -- checkpoint directories in the store: CheckpointManager, StableCheckpoint ------------------
def _state(model):
    """Every model weight and optimizer variable, by position, as NumPy copies."""
    return [np.array(v) for v in [*model.weights, *model.optimizer.variables]]


def _assert_state(model, expected):
    got = _state(model)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def _step(model, rng):
    grads = [
        keras.ops.convert_to_tensor(rng.normal(size=v.shape).astype("float32"))
        for v in model.trainable_variables
    ]
    model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def _marked(step):
    name = f"ckpt-{step:010d}.h5"
    return [name, name + ".commit"]


def test_manager_on_s3_saves_lists_restores_and_prunes(bucket):
    model, rng = _trained(), np.random.default_rng(7)
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.8, 5: 0.7, 6: 0.6}
    saved = {}
    url = f"s3://{bucket}/run"
    with kss.CheckpointManager(url, max_to_keep=2, keep_best=1, monitor="loss") as mgr:
        for step, loss in losses.items():
            _step(model, rng)
            assert (
                mgr.save(step, model, metrics={"loss": loss}, epoch=step // 3) == f"{url}/ckpt-{step:010d}.h5"
            )
            saved[step] = _state(model)
        # exactly the latest two and the best (step 2), each with its marker; the lock object
        assert _objects(bucket) == sorted(
            f"run/{n}" for n in [*_marked(2), *_marked(5), *_marked(6), ".stable-checkpoint.lock"]
        )
        assert (mgr.all_steps(), mgr.latest_step(), mgr.best_step()) == ([2, 5, 6], 6, 2)
        info = mgr.metadata(2)
        assert (info.step, info.epoch, dict(info.metrics), info.format) == (
            2,
            0,
            {"loss": 0.1},
            format.FORMAT_VERSION,
        )
        assert (
            info.backend == keras.backend.backend()
            and info.size_bytes == object_store.RemotePath(info.path).size()
        )
    assert f"run/{'.stable-checkpoint.lock'}" not in _objects(bucket)  # released on close
    other = kss.CheckpointManager(url, max_to_keep=2, keep_best=1, monitor="loss")  # a resumed run
    assert (other.latest_step(), other.best_step()) == (6, 2)
    target = _fresh()
    assert other.restore(target) is not None and other.restored_step == 6
    _assert_state(target, saved[6])
    other.restore(target, step="best")
    _assert_state(target, saved[2])
    other.restore(target, step=5)
    _assert_state(target, saved[5])
    with pytest.raises(FileNotFoundError, match=r"No checkpoint of step 3 .* its steps are \[2, 5, 6\]"):
        other.restore(target, step=3)
    other.close()


def test_an_uncommitted_checkpoint_is_never_latest_and_is_cleaned_up(bucket):
    """What a writer killed between an upload and its marker leaves (an object without a
    marker), a killed prune (a marker without its object), a damaged marker and an object
    that fails its checks: latest never picks them; the next lock cleans up."""
    url = f"s3://{bucket}/run"
    folder = object_store.RemotePath(url)
    model, rng = _trained(), np.random.default_rng(3)
    with kss.CheckpointManager(url, max_to_keep=None) as mgr:
        for step in (1, 2, 3):
            _step(model, rng)
            mgr.save(step, model)
            if step == 2:
                second = _state(model)
    data = folder.child("ckpt-0000000003.h5").read_bytes()
    folder.child("ckpt-0000000003.h5").put_bytes(data[: len(data) - 100])  # damaged behind its marker
    folder.child("ckpt-0000000004.h5").put_bytes(data)  # uploaded, its marker never written
    folder.child("ckpt-0000000009.h5.commit").put_bytes(b"{}")  # its object already pruned
    folder.child("ckpt-0000000007.h5").put_bytes(data)
    folder.child("ckpt-0000000007.h5.commit").put_bytes(b"not json")  # a damaged marker
    folder.child(".kss-0123-ckpt-0000000008.h5").put_bytes(b"partial")
    mgr = kss.CheckpointManager(url, max_to_keep=None)
    assert (mgr.all_steps(), mgr.latest_step()) == ([1, 2], 2)  # listing: no lock, nothing changed
    assert len(_objects(bucket)) == 11
    target = _fresh()
    mgr.restore(target)  # takes the lock: cleans up
    assert mgr.restored_step == 2 and mgr.skipped_checkpoints == []
    _assert_state(target, second)
    assert sorted(u.rsplit("/", 1)[1] for u in mgr.removed_temporary_files) == [
        ".kss-0123-ckpt-0000000008.h5", "ckpt-0000000003.h5", "ckpt-0000000004.h5",
        "ckpt-0000000007.h5", "ckpt-0000000009.h5.commit",
    ]  # fmt: skip
    assert _objects(bucket) == sorted(
        ["run/.stable-checkpoint.lock", *(f"run/{n}" for n in [*_marked(1), *_marked(2)]),
         "run/unreadable/ckpt-0000000003.h5", "run/unreadable/ckpt-0000000007.h5"]
    )  # fmt: skip
    mgr.close()
    # a committed object that fails its checks: moved aside, the one before restored
    folder.child("ckpt-0000000002.h5").put_bytes(data[:-100])
    mgr = kss.CheckpointManager(url, max_to_keep=None)
    mgr.files.commit(f"{url}/ckpt-0000000002.h5", 2, {"step": 2})  # the marker matches the damaged object
    with pytest.warns(
        kss.UnreadableCheckpointWarning,
        match=r"ckpt-0000000002.h5. -> .*unreadable/ckpt-0000000002.h5. .*Fell back",
    ):
        mgr.restore(target)
    assert mgr.restored_step == 1 and mgr.all_steps() == [1]
    assert "run/unreadable/ckpt-0000000002.h5" in _objects(bucket)
    mgr.close()


def test_the_lock_object_refuses_a_second_writer(bucket):
    url = f"s3://{bucket}/run"
    lock = object_store.RemotePath(f"{url}/.stable-checkpoint.lock")
    first = kss.CheckpointManager(url)
    first.lock()
    with pytest.raises(kss.CheckpointInUseError, match=r"in use by another CheckpointManager writer"):
        kss.CheckpointManager(url).lock()
    holder = json.loads(lock.read_bytes())
    assert (holder["pid"], holder["writer"]) == (os.getpid(), "CheckpointManager")
    first.close()
    assert not lock.exists()
    # a writer of this host that died: its lock is taken over; one of another host is refused
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    import socket

    lock.put_bytes(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}).encode())
    mgr = kss.CheckpointManager(url)
    mgr.lock()
    assert json.loads(lock.read_bytes())["pid"] == os.getpid()
    mgr.close()
    lock.put_bytes(json.dumps({"pid": 1, "host": "elsewhere", "writer": "StableCheckpoint"}).encode())
    with pytest.raises(
        kss.CheckpointInUseError, match=r"pid 1 on host elsewhere.*remove that object"
    ) as caught:
        kss.StableCheckpoint(url).manager.lock()
    assert caught.value.holder.startswith("pid 1 on host elsewhere")
    assert lock.exists()


def test_stable_checkpoint_on_s3_resumes_exactly(bucket, tmp_path):
    x = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def run(directory, stop=None):
        model = mlp(seed=0)
        callbacks = [kss.StableCheckpoint(directory, save_freq=3, max_to_keep=1)]
        try:
            model.fit(
                x,
                y,
                batch_size=8,
                epochs=2,
                shuffle=True,
                verbose=0,
                callbacks=callbacks + ([stop] if stop else []),
            )
        except RuntimeError as err:
            assert "preempted" in str(err)
        return model, callbacks

    reference, _ = run(str(tmp_path / "reference"))  # uninterrupted, in a local folder
    url = f"s3://{bucket}/fit"
    run(url, StopAt(epoch=1, batch=4))  # last save: global step 9 (epoch 1, batch 3)
    assert [n for n in _objects(bucket) if "lock" not in n] == [f"fit/{n}" for n in _marked(9)]
    assert kss.CheckpointManager(url).latest_step() == 9
    resumed, (ckpt,) = run(url)
    assert ckpt.restore_report is not None and ckpt.skipped_checkpoints == []
    assert int(resumed.optimizer.iterations) == int(reference.optimizer.iterations) == 12
    assert_same_state(reference, resumed)
    assert _objects(bucket) == [f"fit/{n}" for n in _marked(12)]


_SAVE_LOOP = """
import sys, keras, numpy as np, keras_stable_state as kss
model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, use_bias=False)])  # 4 MB
mgr = kss.CheckpointManager({url!r}, max_to_keep=2)
for step in range(1, 1000):
    for v in model.weights:
        v.assign(np.full(v.shape, step, "float32"))
    mgr.save(step, model, include_rng=False)
    print("SAVED", step, flush=True)
"""


@pytest.mark.slow
def test_a_writer_killed_at_a_random_moment_leaves_latest_complete(bucket, server, tmp_path):
    """A child saving 4 MB checkpoints in a loop, SIGKILLed at random moments (uploads,
    markers, prunes): latest_step() is a step whose object and marker are whole, and it
    restores that step's values, on this backend. ``KSS_S3_KILLS`` trials (make fuzz: 20)."""
    import random

    endpoint, _ = server
    for trial in range(int(os.environ.get("KSS_S3_KILLS", "1"))):
        url = f"s3://{bucket}/loop{trial}"
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVE_LOOP.format(url=url)],
            # the writer runs on this backend (the one a one-framework install has), which restores its files
            env={
                **os.environ,
                **_env(endpoint),
                "PYTHONPATH": ROOT,
                "KERAS_BACKEND": keras.backend.backend(),
                "TMPDIR": str(tmp_path),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            first = child.stdout.readline()
            assert first.startswith("SAVED 1"), f"the child saved nothing: {first!r}"
            time.sleep(random.uniform(0.0, 1.5))
            child.send_signal(signal.SIGKILL)
        finally:
            out, _ = child.communicate(timeout=60)
        saved = [int(line.split()[1]) for line in (first + out).splitlines() if line.startswith("SAVED")]
        mgr = kss.CheckpointManager(url, max_to_keep=2)
        latest = mgr.latest_step()
        assert latest in (saved[-1], saved[-1] + 1), (latest, saved)  # the next one if only its print was cut
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, use_bias=False)])
        mgr.restore(model, include_rng=False)
        assert mgr.restored_step == latest and mgr.skipped_checkpoints == []
        np.testing.assert_array_equal(np.array(model.weights[0]), np.full((512, 2048), latest, "float32"))
        mgr.close()
        names = [n.split("/", 1)[1] for n in _objects(bucket) if n.startswith(f"loop{trial}/")]
        assert f"ckpt-{latest:010d}.h5.commit" in names and ".stable-checkpoint.lock" not in names


def test_a_step_saved_again_replaces_its_checkpoint_in_a_store_without_etags():
    """memory:// gives no ETags: a checkpoint saved again at its step (marker removed first,
    then object, then a new marker of the same size) is listed, and restores the new state."""
    url = f"memory://kss-{secrets.token_hex(4)}"
    model, rng = _trained(), np.random.default_rng(1)
    with kss.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in (1, 1, 2, 2):
            _step(model, rng)
            mgr.save(step, model)
            assert mgr.all_steps() == sorted({1, step})
        expected = _state(model)
    mgr = kss.CheckpointManager(url, max_to_keep=2)
    target = _fresh()
    mgr.restore(target)
    assert mgr.restored_step == 2 and mgr.removed_temporary_files == []
    _assert_state(target, expected)
    mgr.close()
    assert object_store.RemotePath(url).list() == [*_marked(1), *_marked(2)]


def test_cli_lists_inspects_and_refuses_to_verify_an_s3_directory(bucket, capsys):
    """``ls`` and ``inspect`` take the URL of a checkpoint directory as they take a local
    folder (committed checkpoints by their markers, the newest read whole, an object without
    its marker as incomplete); ``verify`` refuses it as it refuses a folder, naming ``ls``."""
    from keras_stable_state.cli import main

    url = f"s3://{bucket}/run"
    model, rng = _trained(), np.random.default_rng(5)
    with kss.CheckpointManager(url, max_to_keep=None, monitor="loss") as mgr:
        for step, loss in ((1, 0.5), (2, 0.2), (3, 0.4)):
            _step(model, rng)
            mgr.save(step, model, metrics={"loss": loss})
    folder = object_store.RemotePath(url)
    folder.child("ckpt-0000000004.h5").put_bytes(folder.child("ckpt-0000000003.h5").read_bytes())  # no marker
    capsys.readouterr()
    for command in ("ls", "inspect"):
        assert main([command, "--json", url]) == 0
        listing = json.loads(capsys.readouterr().out)
        rows = [(r["step"], r["status"], r["resume"], r["best"]) for r in listing["checkpoints"]]
        assert rows == [(3, "ok", True, False), (2, "ok", False, True), (1, "ok", False, False),
                        (None, "incomplete", False, False)], rows  # fmt: skip
        assert listing["directory"] == url and listing["resume_step"] == 3 and listing["best_step"] == 2
        assert (
            listing["checkpoints"][0]["verified"]
            and listing["checkpoints"][0]["file"] == f"{url}/ckpt-0000000003.h5"
        )
        assert listing["checkpoints"][0]["size_bytes"] == folder.child("ckpt-0000000003.h5").size()
        assert listing["checkpoints"][-1]["file"] == f"{url}/ckpt-0000000004.h5"
    assert main(["ls", url]) == 0
    assert "fit resumes from step 3" in capsys.readouterr().out
    assert main(["verify", url]) == 2
    err = capsys.readouterr().err
    assert url in err and "is a folder of objects" in err and "keras-stable-state ls" in err
    assert main(["ls", f"s3://{bucket}/none"]) == 2
    err = capsys.readouterr().err
    assert f"s3://{bucket}/none" in err and "no objects under this URL" in err
    assert main(["ls", f"{url}/ckpt-0000000003.h5"]) == 2
    assert "is an object, not a checkpoint directory" in capsys.readouterr().err


@pytest.mark.backend_free
def test_the_command_line_lists_a_store_without_keras():
    """The object-store directory reader the command line uses imports no Keras."""
    code = (
        "import sys, keras_stable_state.cli.listing, keras_stable_state._manager.remote_directory\n"
        "assert 'keras' not in sys.modules, sorted(m for m in sys.modules if m.startswith('keras'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
