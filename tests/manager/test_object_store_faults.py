"""Object-store faults against a real S3-compatible server (moto's S3 in server mode,
tests/scripts/s3_server.py, on 127.0.0.1) reached by s3fs through a TCP proxy this module
runs: the server gone mid-save (the proxy stopped, its connections cut), an HTTP 500 on each
operation (save, commit, list, restore, lock, lock release, prune), refused credentials and
slow responses, injected at the server. Each failure is our
[`StorageError`][keras_stable_state.StorageError] (an ``OSError``) naming the URL and the
operation, the store library's exception as its ``__cause__``; the previous checkpoint is
intact; and the same manager saves again once the store is back.

The clients retry little and time out fast (``_OPTIONS``), so that a fault costs seconds.

The faults are met where bytes go (``_engines/object_store.py``, the remote directory and its lock:
fsspec and botocore calls), which no backend reaches; what the backend does in a save or a
restore, capturing and assigning the state, is what a local save does, which every backend's
suite checks, and tests/manager/test_object_store.py saves and restores through the store on every
backend. So this module runs once, in the pass that runs the backend-free tests
(``KSS_BACKEND_FREE_PASS``, JAX by default), and is skipped in the others with that reason.
"""

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from conftest import BACKEND, BACKEND_FREE_PASS
from kit import TESTS, mlp

import keras_stable_state as kss
from keras_stable_state._engines import object_store

pytestmark = pytest.mark.skipif(
    BACKEND != BACKEND_FREE_PASS,
    reason=f"object-store faults are met below the backend (fsspec, botocore): run once, in the "
    f"{BACKEND_FREE_PASS} pass (KSS_BACKEND_FREE_PASS)",
)
pytest.importorskip("s3fs", reason="the [cloud] extra (s3fs) is not installed")
pytest.importorskip("moto", reason="moto (the dev extra's S3 server) is not installed")

SERVER = os.path.join(TESTS, "scripts", "s3_server.py")
_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_LOCK = ".stable-checkpoint.lock"


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of the server: `stop` closes its port and cuts every
    connection through it (the server gone, as a client sees it), `start` opens the same
    port again."""

    def __init__(self, target_port):
        self.target = target_port
        self.port = None
        self.listener = None
        self.conns = []
        self.guard = threading.Lock()

    def start(self):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port or 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()  # the server is gone (the module's end)
                continue
            with self.guard:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def stop(self):
        self.listener.close()
        with self.guard:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``(endpoint through the proxy, server endpoint, proxy)``; stopped after the module."""
    flag = str(tmp_path_factory.mktemp("s3") / "unused-flag")
    proc = subprocess.Popen(
        [sys.executable, SERVER, flag], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"the S3 server did not start: {line!r}"
        port = int(line.split()[1])
        proxy = Proxy(port)
        proxy.start()
        yield f"http://127.0.0.1:{proxy.port}", f"http://127.0.0.1:{port}", proxy
        proxy.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


def _faults(server, rules=None):
    """Set the server's fault rules (``None``: read them); how many requests each caught."""
    data = None if rules is None else json.dumps(rules).encode()
    request = urllib.request.Request(
        f"{server}/__faults__", data=data, method="GET" if data is None else "PUT"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def _options(endpoint, **client):
    return {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {
            "retries": {"max_attempts": 2, "mode": "standard"},
            "connect_timeout": 1,
            "read_timeout": 2,
        },
        "skip_instance_cache": True,
        **client,
    }


@pytest.fixture
def bucket(store, monkeypatch):
    """A new bucket, its URL prefix and the options that reach it through the proxy."""
    import s3fs

    endpoint, server, proxy = store
    for name, value in _ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    _faults(server, [])
    # The store's own retries stay (max_attempts=2, and s3fs's); only botocore's wait between
    # tries (up to 2 s each, random) is shortened: what is tested is what follows the tries.
    from botocore.retries import standard

    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount", lambda self, context: 0.01)
    name = f"kss-{secrets.token_hex(4)}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": server}, skip_instance_cache=True).mkdir(name)
    yield f"s3://{name}", _options(endpoint), server, proxy
    _faults(server, [])


def _step(model, value):
    for v in model.trainable_variables:
        v.assign(np.full(v.shape, value, "float32"))


def _assert_restores(url, options, value):
    """A new manager restores ``value`` (every trainable variable) as its latest step."""
    mgr = kss.CheckpointManager(url, storage_options=options)
    target = mlp(seed=9, build=True)
    assert mgr.restore(target) is not None and mgr.restored_step == value
    for v in target.trainable_variables:
        np.testing.assert_array_equal(np.array(v), np.full(v.shape, value, "float32"))
    mgr.close()


def _assert_ours(err, url, operation):
    assert isinstance(err, kss.StorageError) and isinstance(err, OSError), repr(err)
    assert err.url == url and operation in err.operation, (err.url, err.operation)
    assert url in str(err) and operation in str(err), str(err)
    assert err.__cause__ is not None and not isinstance(err.__cause__, kss.StateError)


def _ckpt(url, step):
    return f"{url}/ckpt-{step:010d}.h5"


# (what fails, the server rule, the URL the error names, the operation it names)
_OPERATIONS = [
    ("save", {"method": "PUT", "path_end": "ckpt-0000000002.h5"}, "ckpt2", "upload"),
    ("commit", {"method": "PUT", "path_end": "ckpt-0000000002.h5.commit"}, "marker2", "upload"),
    ("prune", {"method": "DELETE", "path_end": "ckpt-0000000001.h5"}, "ckpt1", "remove"),
    ("list", {"method": "GET", "query": "list-type=2"}, "dir", "list"),
]


@pytest.mark.parametrize("what,rule,names,operation", _OPERATIONS, ids=[o[0] for o in _OPERATIONS])
def test_a_5xx_on_an_operation_of_save_is_ours_and_the_manager_saves_again(
    bucket, what, rule, names, operation
):
    url, options, server, _ = bucket
    url = f"{url}/run"
    model = mlp(seed=0, build=True)
    mgr = kss.CheckpointManager(url, max_to_keep=1, storage_options=options)
    _step(model, 1)
    mgr.save(1, model)
    _faults(server, [{**rule, "status": 500}])
    _step(model, 2)
    with pytest.raises(kss.StorageError) as caught:
        mgr.save(2, model)
    named = {"ckpt2": _ckpt(url, 2), "marker2": _ckpt(url, 2) + ".commit", "ckpt1": _ckpt(url, 1), "dir": url}
    _assert_ours(caught.value, named[names], operation)
    assert _faults(server)[0] >= 1
    _faults(server, [])
    if what not in ("prune", "list"):  # the prune (which lists first) came after step 2 was committed
        assert mgr.all_steps() == [1]
        _assert_restores_held(mgr, 1)
    _step(model, 3)
    assert mgr.save(3, model) == _ckpt(url, 3)  # the same manager, once the store is back
    assert mgr.all_steps() == [3]
    mgr.close()
    _assert_restores(url, options, 3)


def _assert_restores_held(mgr, value):
    target = mlp(seed=9, build=True)
    assert mgr.restore(target) is not None and mgr.restored_step == value
    for v in target.trainable_variables:
        np.testing.assert_array_equal(np.array(v), np.full(v.shape, value, "float32"))


def test_a_5xx_on_restore_and_listing_is_ours(bucket):
    url, options, server, _ = bucket
    url = f"{url}/run"
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(url, storage_options=options) as mgr:
        _step(model, 1)
        mgr.save(1, model)
    mgr = kss.CheckpointManager(url, storage_options=options)
    _faults(server, [{"method": "GET", "path_end": "ckpt-0000000001.h5", "status": 503, "code": "SlowDown"}])
    target = mlp(seed=9, build=True)
    before = [np.array(v) for v in target.trainable_variables]
    with pytest.raises(kss.StorageError) as caught:
        mgr.restore(target, step=1)
    _assert_ours(caught.value, _ckpt(url, 1), "read")
    for old, v in zip(before, target.trainable_variables, strict=True):
        np.testing.assert_array_equal(old, np.array(v))  # untouched
    _faults(server, [{"method": "GET", "query": "list-type=2", "status": 500}])
    with pytest.raises(kss.StorageError) as caught:
        mgr.latest_step()
    _assert_ours(caught.value, url, "list")
    _faults(server, [])
    assert mgr.latest_step() == 1
    _assert_restores_held(mgr, 1)
    mgr.close()


def test_a_5xx_on_the_lock_is_ours_and_locks_again(bucket):
    url, options, server, _ = bucket
    url = f"{url}/run"
    _faults(server, [{"method": "PUT", "path_end": _LOCK, "status": 500}])
    mgr = kss.CheckpointManager(url, storage_options=options)
    with pytest.raises(kss.StorageError) as caught:
        mgr.lock()
    _assert_ours(caught.value, f"{url}/{_LOCK}", "lock")
    _faults(server, [])
    model = mlp(seed=0, build=True)
    _step(model, 1)
    assert mgr.save(1, model) == _ckpt(url, 1)
    mgr.close()
    _assert_restores(url, options, 1)


def test_a_failed_lock_release_is_retried_and_never_locks_out_this_process(bucket):
    url, options, server, _ = bucket
    url = f"{url}/run"
    lock_url = f"{url}/{_LOCK}"
    model = mlp(seed=0, build=True)
    # the store fails the first removal: the release tries again, and removes it
    _faults(server, [{"method": "DELETE", "path_end": _LOCK, "status": 500, "times": 2}])
    with kss.CheckpointManager(url, storage_options=options) as mgr:
        _step(model, 1)
        mgr.save(1, model)
    assert _faults(server) == [2]  # both tries of the first removal (max_attempts=2) failed
    assert not object_store.RemotePath(lock_url, options).exists()
    # the store fails every removal: our error, naming the lock object; the lock object is left
    _faults(server, [{"method": "DELETE", "path_end": _LOCK, "status": 500}])
    mgr = kss.CheckpointManager(url, storage_options=options)
    _step(model, 2)
    mgr.save(2, model)
    with pytest.raises(kss.StorageError) as caught:
        mgr.close()
    _assert_ours(caught.value, lock_url, "release the lock")
    assert "tried 3 times" in str(caught.value) and "takes it over" in str(caught.value)
    assert json.loads(object_store.RemotePath(lock_url, options).read_bytes())["pid"] == os.getpid()
    # ... in a `with` block that raised, the note says what failed (no background save ran)
    with pytest.raises(ZeroDivisionError) as raised:
        with kss.CheckpointManager(url, storage_options=options) as mgr:  # takes its own lock object over
            assert mgr.locked
            1 / 0  # noqa: B018
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "releasing the directory's lock failed as well" in notes and "background save" not in notes
    # this process is not locked out of its own directory: a new manager takes the lock over
    _faults(server, [])
    mgr = kss.CheckpointManager(url, max_to_keep=1, storage_options=options)
    _step(model, 3)
    assert mgr.save(3, model) == _ckpt(url, 3)
    mgr.close()
    assert not object_store.RemotePath(lock_url, options).exists()
    _assert_restores(url, options, 3)


def test_refused_credentials_name_the_url_and_what_to_check(bucket):
    url, options, server, _ = bucket
    url = f"{url}/run"
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(url, storage_options=options) as mgr:
        _step(model, 1)
        mgr.save(1, model)
    _faults(server, [{"key": "wrong", "status": 403, "code": "InvalidAccessKeyId"}])
    wrong = {**options, "key": "wrong", "secret": "wrong", "token": None}
    for call, named, operation in [
        (lambda: kss.save_training_state(f"{url}/one.h5", model, storage_options=wrong), f"{url}/one.h5", "upload"),
        (lambda: kss.restore_training_state(_ckpt(url, 1), mlp(seed=0, build=True), storage_options=wrong), _ckpt(url, 1), "read"),
        (lambda: kss.CheckpointManager(url, storage_options=wrong).all_steps(), url, "list"),
        (lambda: kss.CheckpointManager(url, storage_options=wrong).save(2, model), f"{url}/{_LOCK}", "lock"),
    ]:  # fmt: skip
        with pytest.raises(kss.StoragePermissionError) as caught:
            call()
        err = caught.value
        assert isinstance(err, PermissionError)
        _assert_ours(err, named, operation)
        assert "refused the credentials" in str(err) and "AWS_ACCESS_KEY_ID" in str(err), str(err)
    assert _faults(server)[0] >= 4
    _assert_restores(url, options, 1)  # the right credentials: the checkpoint is intact


def test_slow_responses_are_waited_for(bucket):
    url, options, server, _ = bucket
    url = f"{url}/run"
    model = mlp(seed=0, build=True)
    mgr = kss.CheckpointManager(url, max_to_keep=None, storage_options=options)
    _step(model, 1)
    mgr.save(1, model)
    # slower than usual, within the read timeout (2 s): saved
    _faults(server, [{"method": "PUT", "path_end": "ckpt-0000000002.h5", "delay": 0.8}])
    _step(model, 2)
    started = time.monotonic()
    assert mgr.save(2, model) == _ckpt(url, 2)
    assert time.monotonic() - started >= 0.8 and _faults(server) == [1]
    _faults(server, [])
    assert mgr.all_steps() == [1, 2]
    _step(model, 3)
    mgr.save(3, model)
    mgr.close()
    _assert_restores(url, options, 3)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_the_server_gone_mid_save_is_ours_and_saving_resumes_when_it_is_back(bucket, background):
    url, options, server, proxy = bucket
    url = f"{url}/run"
    model = mlp(seed=0, build=True)
    mgr = kss.CheckpointManager(url, max_to_keep=2, save_on_background=background, storage_options=options)
    _step(model, 1)
    mgr.save(1, model)
    mgr.wait()
    # the upload of step 2 is held at the server; the server goes away meanwhile
    _faults(server, [{"method": "PUT", "path_end": "ckpt-0000000002.h5", "delay": 1.5, "times": 1}])
    _step(model, 2)

    def stop_when_held():
        deadline = time.monotonic() + 30
        while _faults(server) != [1] and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.stop()

    stopper = threading.Thread(target=stop_when_held)
    stopper.start()
    try:
        with pytest.raises(kss.StorageError) as caught:
            mgr.save(2, model)
            mgr.wait()
    finally:
        stopper.join()
    _assert_ours(caught.value, _ckpt(url, 2), "upload")
    # the store is still gone: listing is ours too
    with pytest.raises(kss.StorageError) as caught:
        mgr.all_steps()
    _assert_ours(caught.value, url, "list")
    proxy.start()  # back, same port
    _faults(server, [])
    assert mgr.all_steps() == [1]  # the previous checkpoint, intact; step 2 is not committed
    _step(model, 3)
    mgr.save(3, model)
    mgr.close()
    assert kss.CheckpointManager(url, storage_options=options).all_steps() == [1, 3]
    _assert_restores(url, options, 3)


def test_keras_is_not_needed_to_translate(bucket):
    """The store's errors are translated in the object-store engine (no Keras): RemotePath alone."""
    url, options, server, _ = bucket
    folder = object_store.RemotePath(f"{url}/plain", options)
    folder.child("a.bin").put_bytes(b"x")
    _faults(server, [{"method": "GET", "path_end": "a.bin", "status": 500}])
    with pytest.raises(kss.StorageError) as caught:
        folder.child("a.bin").read_bytes()
    _assert_ours(caught.value, f"{url}/plain/a.bin", "read")
