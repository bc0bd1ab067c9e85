"""Object stores through fsspec, against a real S3-compatible server (moto's S3 in server
mode, tests/scripts/s3_server.py, on 127.0.0.1) reached by s3fs: save, restore, the command
line, commit markers, a kill mid-upload, a scheme without its implementation, and the old
bug (a URL used as a local path: a folder ``./gs:/bucket``) never coming back.

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
from kit import assert_same_state, mlp

import keras_stable_state as kss
from keras_stable_state import format as storage
from keras_stable_state.errors import StorageBackendError
from keras_stable_state.format import remote

pytest.importorskip("s3fs", reason="the [cloud] extra (s3fs) is not installed")
pytest.importorskip("moto", reason="moto (the dev extra's S3 server) is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SERVER = os.path.join(HERE, "scripts", "s3_server.py")
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
@pytest.mark.parametrize("url", ["s3://bucket/ckpts", "gs://bucket/ckpts", "memory://ckpts", "az://c/ckpts"])
def test_stable_checkpoint_refuses_an_object_store_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kss.StateError, match=r"remote directories for StableCheckpoint come with the"):
        kss.StableCheckpoint(url)
    _no_scheme_folder(tmp_path)


def test_stable_checkpoint_takes_a_file_url_as_its_local_path(tmp_path):
    cb = kss.StableCheckpoint((tmp_path / "ck").as_uri())
    assert cb.directory == str(tmp_path / "ck")


@pytest.mark.parametrize("url", ["s3://bucket/run.h5", "gs://bucket/run.h5", "memory://run.keras"])
def test_local_only_doors_refuse_urls(url, tmp_path, monkeypatch):
    """The writer, the atomic write, the reader's file door and fs_path never take a URL."""
    monkeypatch.chdir(tmp_path)
    record = storage.StateRecord(metadata={}, contract=[], model={}, optimizer={}, extra={}, arrays={})
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL .*not a local path"):
        storage.write_record(url, record)
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL"):
        storage.atomic_path(url)
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL"):
        storage.CheckpointFile(url)
    with pytest.raises(kss.CheckpointFormatError, match=r"is a URL"):
        storage.fs_path(url)
    assert storage.fs_path(url, urls=True) == url
    _no_scheme_folder(tmp_path)


def test_url_detection():
    for url in ("s3://b/k", "gs://b", "file:///x", "memory://x", "simplecache::s3://b/k", "git+ssh://h/x"):
        assert remote.is_url(url), url
    for path in ("run.h5", "/data/s3:/x", "./gs:/b", "s3:/b/k", "c:/x", "a/b://c"):
        assert not remote.is_url(path), path
    assert remote.scheme_of("simplecache::s3://b/k") == "simplecache"
    assert remote.resolve("file:///data/a%20b.h5") == "/data/a b.h5"
    assert remote.resolve("file://localhost/data/x.h5") == "/data/x.h5"
    with pytest.raises(kss.CheckpointFormatError, match=r"on host 'elsewhere'"):
        remote.resolve("file://elsewhere/x.h5")
    assert not remote.is_remote("file:///x") and remote.is_remote("s3://b/k")


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
    assert handle.nbytes == remote.RemotePath(url).size()
    target = _fresh()
    kss.restore_training_state(url, target)
    assert_same_state(model, target)


def test_missing_and_damaged_objects_are_refused(bucket):
    model = _trained()
    url = f"s3://{bucket}/run.h5"
    with pytest.raises(FileNotFoundError, match=rf"No training-state object at '{url}'"):
        kss.restore_training_state(url, _fresh())
    kss.save_training_state(url, model)
    data = remote.RemotePath(url).read_bytes()
    damaged = f"s3://{bucket}/damaged.h5"
    remote.RemotePath(damaged).put_bytes(data[: len(data) // 2])
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
def test_remote_folder_and_commit_markers(bucket):
    folder = remote.RemotePath(f"s3://{bucket}/ckpts")
    assert folder.list() == [] and remote.read_marker(folder, "ckpt-1.done") is None
    folder.child("ckpt-1.h5").put_bytes(b"one")
    folder.child("ckpt-2.h5").put_bytes(b"two")
    remote.RemotePath(f"s3://{bucket}/ckpts/sub/deeper.h5").put_bytes(b"x")
    remote.write_marker(folder, "ckpt-1.done", {"step": 1, "size": 3})
    assert folder.list() == ["ckpt-1.done", "ckpt-1.h5", "ckpt-2.h5"]
    assert remote.read_marker(folder, "ckpt-1.done") == {"step": 1, "size": 3}
    assert remote.read_marker(folder, "ckpt-2.done") is None
    with folder.child("ckpt-2.h5").open_read() as fh:
        assert fh.read() == b"two"
    folder.child("ckpt-2.done").put_bytes(b"{not json")
    with pytest.raises(kss.CorruptCheckpointError, match=r"ckpt-2.done' is damaged: it is not JSON"):
        remote.read_marker(folder, "ckpt-2.done")
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


@pytest.mark.slow
def test_kill_mid_upload_leaves_the_previous_object(bucket, server):
    """A save killed while its multipart upload is under way leaves the previous whole object
    (restored exactly) and no other object under the prefix."""
    endpoint, flag = server
    if os.path.exists(flag):
        os.remove(flag)
    url = f"s3://{bucket}/kill-me/run.h5"
    model = _trained()
    kss.save_training_state(url, model)
    previous = remote.RemotePath(url).size()
    child = subprocess.Popen(
        [sys.executable, "-c", _BIG_SAVE.format(url=url)],
        env={**os.environ, **_env(endpoint), "PYTHONPATH": ROOT},
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
    assert remote.RemotePath(url).size() == previous
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


@pytest.mark.slow
def test_gs_without_gcsfs_is_refused_naming_the_extra(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDDEN)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, **_DUMMY, "PYTHONPATH": os.pathsep.join([str(site), ROOT])}
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
    for name in ("save", "restore"):
        kind, is_state, is_import, message = results[name]
        assert (kind, is_state, is_import) == ("StorageBackendError", True, True), results[name]
        assert "gcsfs" in message and 'pip install "keras-stable-state[cloud]"' in message, message
        assert "gs://bucket/run.h5" in message
    assert results["checkpoint"][:2] == ["StateError", True]
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
